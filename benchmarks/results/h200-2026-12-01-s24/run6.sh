#!/bin/bash
# Run 6 of the twenty-fourth session (one GPU), commit $1: the GPU tests of the files changed
# after run 5 (DCPConfig with PCP of size one, last_*_path, the subnormal allowance of the
# tolerances) and the cp-dcp property tests, which the tolerance change touches most.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SECONDS=0
timeout 280 bash scripts/gpu_tests.sh -q -rsfE packages/cp-dcp/tests/test_manager.py \
    packages/cp-testing/tests/test_tolerances.py packages/cp-dcp/tests/ops/test_properties.py \
    > $OUT/gpu_tests-late-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; tail -1 $OUT/gpu_tests-late-$1.txt
grep -hE '^(FAILED|ERROR)' $OUT/gpu_tests-late-$1.txt | head
