#!/bin/bash
# Run 4 of the eleventh session (one GPU), commit $1: the final code's launch-plan tests
# (cp-common and cp-dcp), native-build tests and the ahead-of-time build command.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
SECONDS=0
timeout 240 bash scripts/gpu_tests.sh -q -rs packages/cp-common/tests/test_launch_plans.py \
    packages/cp-common/tests/test_native_build.py packages/cp-common/tests/test_main.py \
    packages/cp-dcp/tests/ops/test_launch_plans_ops.py > $OUT/gpu_tests-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "passed|failed|error" $OUT/gpu_tests-$1.txt | tail -3
grep -E "^(FAILED|ERROR)|Error" $OUT/gpu_tests-$1.txt | head -20
CPATTN_CACHE_DIR=$(mktemp -d) PYTHONPATH=packages/cp-common/src python3 -m cpattn_common build-launch-plans
echo "build rc=$? at ${SECONDS}s"
