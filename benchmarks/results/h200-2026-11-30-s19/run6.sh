#!/bin/bash
# Run 6 of the nineteenth session, on the two-GPU kind, commit $1: the new compile test of
# DCPManager.combine over a ProcessGroup and a CPGroup (A2A, AG+RS) on two nccl ranks, under the
# device's torch 2.11, with the combines' distributed tests beside it.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SECONDS=0
timeout 300 bash scripts/gpu_tests.sh -q -rsfE packages/cp-dcp/tests/test_manager.py \
    packages/cp-dcp/tests/distributed/test_combine_dist.py -k "compiled or test_combines" \
    > $OUT/gpu_tests_x2_compile-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; head -1 $OUT/gpu_tests_x2_compile-$1.txt; tail -1 $OUT/gpu_tests_x2_compile-$1.txt
grep -E '^(FAILED|ERROR)' $OUT/gpu_tests_x2_compile-$1.txt | head
