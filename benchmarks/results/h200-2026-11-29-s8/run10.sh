#!/bin/bash
# Run 10 of the eighth session (one GPU), commit $1 (the merge's final decode rule): the page,
# then the merge's fast-path tests (configuration, compile check, GPU variants).
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
SECONDS=0
timeout 150 python3 benchmarks/run.py --commit "$1" --out $OUT/bench-$1.json --docs-dir $OUT/docs \
    > $OUT/bench-$1.txt 2>&1
echo "page rc=$? at ${SECONDS}s"
timeout 45 bash scripts/gpu_tests.sh -q -rs packages/cp-common/tests/test_merge_fastpath.py \
    > $OUT/gpu_tests_merge-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; tail -2 $OUT/gpu_tests_merge-$1.txt
