#!/bin/bash
# Run 7 of the twenty-fourth session (one GPU), commit $1: the GPU tests of the files changed
# after run 6 (direct workspaces: widened unsigned indices, TypeErrors; capability; alloc).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SECONDS=0
timeout 170 bash scripts/gpu_tests.sh -q -rsfE packages/cp-dcp/tests/direct \
    packages/cp-common/tests/test_capability.py packages/cp-common/tests/test_alloc_ubatch.py \
    > $OUT/gpu_tests-direct-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; tail -1 $OUT/gpu_tests-direct-$1.txt
grep -hE '^(FAILED|ERROR)' $OUT/gpu_tests-direct-$1.txt | head
