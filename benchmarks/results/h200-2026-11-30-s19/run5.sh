#!/bin/bash
# Run 5 of the nineteenth session, on the one-GPU kind, commit $1: scripts/gpu_tests.sh after its
# new torch/triton import check (a python without torch now fails instead of skipping), on the
# group tests (CPGroup's collectives now call torch's *_single names where torch has them; the
# device's torch 2.11 has only the old ones) and the gather tests.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SECONDS=0
timeout 300 bash scripts/gpu_tests.sh -q -rsfE packages/cp-common/tests/test_group.py \
    packages/cp-common/tests/test_group_compile.py packages/cp-dcp/tests/test_gather.py \
    > $OUT/gpu_tests_one-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; head -1 $OUT/gpu_tests_one-$1.txt; tail -1 $OUT/gpu_tests_one-$1.txt
grep -E '^(FAILED|ERROR)' $OUT/gpu_tests_one-$1.txt | head
