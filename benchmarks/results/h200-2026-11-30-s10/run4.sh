#!/bin/bash
# Run 4 of the tenth session (one GPU), commit $1: every test of the four packages (launch
# plans included), then the page again (the ops now test OpPlans.on before touching plans).
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1
SECONDS=0
timeout 380 bash scripts/gpu_tests.sh -q -rs packages/cp-common/tests packages/cp-dcp/tests \
    packages/cp-pcp/tests packages/cp-testing/tests > $OUT/gpu_tests_all-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "passed|failed|error" $OUT/gpu_tests_all-$1.txt | tail -5
timeout 190 python3 benchmarks/run.py --commit "$1" --out $OUT/bench-$1.json --docs-dir $OUT/docs \
    > $OUT/bench-$1.txt 2>&1
echo "page rc=$? at ${SECONDS}s"; grep -A24 "Host overhead of an eager call" $OUT/docs/performance.md | tail -21
