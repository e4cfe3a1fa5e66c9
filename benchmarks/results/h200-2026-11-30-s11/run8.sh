#!/bin/bash
# Run 8 of the eleventh session (one GPU), commit $1: launch-plan tests after the review commit
# (op handles read the module state instead of holding a copy of the native module).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
SECONDS=0
timeout 240 bash scripts/gpu_tests.sh -q -rs packages/cp-common/tests/test_launch_plans.py \
    packages/cp-common/tests/test_native_build.py packages/cp-common/tests/test_main.py \
    packages/cp-dcp/tests/ops/test_launch_plans_ops.py packages/cp-common/tests/ops/test_merge_attn_states.py \
    > $OUT/gpu_tests-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "passed|failed|error" $OUT/gpu_tests-$1.txt | tail -3
grep -E "^(FAILED|ERROR)" $OUT/gpu_tests-$1.txt | head -20
