#!/bin/bash
# Run 6 of the tenth session (one GPU), commit $1: the final code's launch-plan tests and the op
# tests around them (changes since run 5: a shared test fixture, the kernel description holding
# its compiled kernel, the order of clear_launch_plans).
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1
SECONDS=0
timeout 300 bash scripts/gpu_tests.sh -q -rs packages/cp-common/tests/test_launch_plans.py \
    packages/cp-common/tests/test_launch.py packages/cp-dcp/tests/ops/test_launch_plans_ops.py \
    packages/cp-common/tests/ops/test_merge_attn_states.py -k "plans or launch or failed_allocation" \
    > $OUT/gpu_tests-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "passed|failed|error" $OUT/gpu_tests-$1.txt | tail -3
