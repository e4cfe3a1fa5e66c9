#!/bin/bash
# Run 9 of the twenty-first session (one GPU), commit $1: the page's kernel and host rows
# (benchmarks/run.py) with the new unpack (one vector per thread at N=8, weights just before
# their sums), then the cp-dcp one-GPU tests.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
SECONDS=0
timeout 200 python3 benchmarks/run.py --commit "$1" --out $OUT/bench-$1.json \
    --docs-dir $OUT/docs > $OUT/bench-$1.txt 2>&1
echo "page rc=$? at ${SECONDS}s"; grep -E "not met|incomplete|error" $OUT/docs/performance.md | head -20
grep -E "a2a_unpack_combine" $OUT/docs/performance.md | head -8
timeout $((585 - SECONDS)) bash scripts/gpu_tests.sh -q -rsfE --durations=5 packages/cp-dcp/tests \
    > $OUT/gpu_tests-dcp-$1.txt 2>&1
echo "dcp tests rc=$? at ${SECONDS}s"; tail -1 $OUT/gpu_tests-dcp-$1.txt
grep -hE '^(FAILED|ERROR)' $OUT/gpu_tests-dcp-$1.txt | head
