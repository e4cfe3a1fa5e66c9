#!/bin/bash
# Run 8 of the tenth session (one GPU), commit $1: launch-plan tests after the review of the recorder
# (kernel-pointer owners listed once per recording).
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1
SECONDS=0
timeout 240 bash scripts/gpu_tests.sh -q -rs packages/cp-common/tests/test_launch_plans.py \
    packages/cp-dcp/tests/ops/test_launch_plans_ops.py packages/cp-common/tests/ops/test_merge_attn_states.py \
    -k "plans or failed_allocation" > $OUT/gpu_tests-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "passed|failed|error" $OUT/gpu_tests-$1.txt | tail -3
