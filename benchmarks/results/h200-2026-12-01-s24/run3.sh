#!/bin/bash
# Run 3 of the twenty-fourth session (one GPU), commit $1: the GPU tests of cp-common, cp-pcp
# and cp-testing.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SECONDS=0
timeout 590 bash scripts/gpu_tests.sh -q -rsfE --durations=5 \
    packages/cp-common/tests packages/cp-pcp/tests packages/cp-testing/tests \
    > $OUT/gpu_tests-rest-$1.txt 2>&1
echo "rest tests rc=$? at ${SECONDS}s"; tail -1 $OUT/gpu_tests-rest-$1.txt
grep -hE '^(FAILED|ERROR)' $OUT/gpu_tests-rest-$1.txt | head
