#!/bin/bash
# Run 5 of the eighth session (one GPU), commit $1 (the merge's decode rule): the merge sweep
# against the former rule (shipped setting first), the page, the cp-common GPU tests.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SECONDS=0
timeout 200 python3 benchmarks/variants.py --merge --rounds 2 > $OUT/merge_sweep2.txt 2>&1
echo "sweep rc=$? at ${SECONDS}s"; cut -c1-300 $OUT/merge_sweep2.txt
timeout 200 python3 benchmarks/run.py --commit "$1" --out $OUT/bench-$1.json --docs-dir $OUT/docs \
    > $OUT/bench-$1.txt 2>&1
echo "page rc=$? at ${SECONDS}s"; grep -E '^\| `merge' $OUT/docs/performance.md | head -4
timeout $((560 - SECONDS)) bash scripts/gpu_tests.sh -q -rs packages/cp-common/tests \
    > $OUT/gpu_tests_common-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; tail -3 $OUT/gpu_tests_common-$1.txt
