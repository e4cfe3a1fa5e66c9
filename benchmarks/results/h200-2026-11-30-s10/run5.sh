#!/bin/bash
# Run 5 of the tenth session (one GPU), commit $1: launch-plan tests and the op tests around
# them after the replay checks moved into the native module, then the page.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1
SECONDS=0
timeout 200 bash scripts/gpu_tests.sh -q -rs packages/cp-common/tests/test_launch_plans.py \
    packages/cp-common/tests/test_launch.py packages/cp-dcp/tests/ops/test_launch_plans_ops.py \
    packages/cp-dcp/tests/ops/test_launch_fast_path.py packages/cp-dcp/tests/ops/test_cuda_graph.py \
    -k "plans or launch or graph or failed_allocation" > $OUT/gpu_tests-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "passed|failed|error" $OUT/gpu_tests-$1.txt | tail -3
timeout 190 python3 benchmarks/run.py --commit "$1" --out $OUT/bench-$1.json --docs-dir $OUT/docs \
    > $OUT/bench-$1.txt 2>&1
echo "page rc=$? at ${SECONDS}s"; grep "plans\]\|launch plans on |" $OUT/docs/performance.md | grep -v "^| \`" | tail -12
grep "host-plans\|launch plans on ≤" $OUT/docs/performance.md | head -6
