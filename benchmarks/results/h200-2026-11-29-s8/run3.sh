#!/bin/bash
# Run 3 of the eighth session (one GPU), working tree on top of $1: the merge's decode sweep
# (variants.py --merge, two interleaved rounds), bench_collectives' timing paths on one nccl
# rank, the merge GPU tests (run 3 stopped at the sweep's bit-for-bit check; run 4 repeats it).
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SECONDS=0
timeout 330 python3 benchmarks/variants.py --merge --rounds 2 > $OUT/merge_sweep.txt 2>&1
echo "sweep rc=$? at ${SECONDS}s"; cut -c1-420 $OUT/merge_sweep.txt
timeout 100 python3 benchmarks/results/h200-2026-11-29-s8/collectives_ws1.py > $OUT/collectives_ws1.txt 2>&1
echo "collectives ws1 rc=$? at ${SECONDS}s"; tail -12 $OUT/collectives_ws1.txt
timeout $((560 - SECONDS)) bash scripts/gpu_tests.sh -q -rs packages/cp-common/tests/test_merge_fastpath.py \
    packages/cp-common/tests/ops > $OUT/gpu_tests_merge.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; tail -3 $OUT/gpu_tests_merge.txt
