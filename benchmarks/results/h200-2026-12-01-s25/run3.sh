#!/bin/bash
# Run 3 of the twenty-fifth session, on the one-GPU kind (the two-GPU kind was no longer
# lent), commit $1: the cp-dcp test files touched after run 2 (return_lse checked as a bool,
# the AG-AR all-reduce of a CPGroup subclass, the launch-plans fixture moved to the conftest,
# the numpy-bool flag test now asserting a replay on the GPU) and the rest of the ops folder.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
SECONDS=0
timeout 540 bash scripts/gpu_tests.sh -q -rfE packages/cp-dcp/tests/ops \
    packages/cp-dcp/tests/direct/test_direct_a2a.py packages/cp-dcp/tests/distributed \
    packages/cp-dcp/tests/test_groups.py packages/cp-dcp/tests/test_manager.py \
    > $OUT/gpu_tests-dcp-$1.txt 2>&1
echo "cp-dcp rc=$? at ${SECONDS}s"; tail -n 1 $OUT/gpu_tests-dcp-$1.txt
grep -hE "^(FAILED|ERROR)" $OUT/gpu_tests-dcp-$1.txt | head -20
