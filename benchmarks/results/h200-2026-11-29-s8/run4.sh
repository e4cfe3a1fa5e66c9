#!/bin/bash
# Run 4 of the eighth session (one GPU), working tree on top of $1: the merge's decode sweep
# (variants.py --merge, two interleaved rounds; checked by relative error), then the merge's
# fast-path tests (its sm_90 compile check with the VOLATILE constexpr).
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SECONDS=0
timeout 400 python3 benchmarks/variants.py --merge --rounds 2 > $OUT/merge_sweep.txt 2>&1
echo "sweep rc=$? at ${SECONDS}s"; cut -c1-420 $OUT/merge_sweep.txt
timeout $((560 - SECONDS)) bash scripts/gpu_tests.sh -q -rs packages/cp-common/tests/test_merge_fastpath.py \
    > $OUT/gpu_tests_merge_fastpath.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; tail -3 $OUT/gpu_tests_merge_fastpath.txt
