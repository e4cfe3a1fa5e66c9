#!/bin/bash
# Run 3 of the eleventh session (one GPU), commit $1: launch plans turning on in the middle of a
# CUDA-graph capture (the new test), with the other launch-plan tests of cp-common and cp-dcp.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
SECONDS=0
timeout 240 bash scripts/gpu_tests.sh -q -rs packages/cp-common/tests/test_launch_plans.py \
    packages/cp-common/tests/test_native_build.py packages/cp-dcp/tests/ops/test_launch_plans_ops.py \
    > $OUT/gpu_tests-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "passed|failed|error" $OUT/gpu_tests-$1.txt | tail -3
grep -E "^(FAILED|ERROR)|Error" $OUT/gpu_tests-$1.txt | head -20
