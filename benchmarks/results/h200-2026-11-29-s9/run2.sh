#!/bin/bash
# Run 2 of the ninth session (one GPU), commit $1 (the merge's EAGER on shrunk tiles of
# several heads up to 1 KiB per source): the merge sweep against the eighth session's rule
# ("one-head") and 2 KiB tiles, B = 16 .. 128; the merge and bench GPU tests; the page.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
SECONDS=0
timeout 200 python3 benchmarks/variants.py --merge --batches 16,24,32,48,64,96,128 \
    --settings one-head,multi-2k --rounds 2 > $OUT/merge_multi2.txt 2>&1
echo "sweep rc=$? at ${SECONDS}s"
timeout 120 bash scripts/gpu_tests.sh -q -rs packages/cp-common/tests \
    > $OUT/gpu_tests_common-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; tail -2 $OUT/gpu_tests_common-$1.txt
timeout 170 python3 benchmarks/run.py --commit "$1" --out $OUT/bench-$1.json --docs-dir $OUT/docs \
    > $OUT/bench-$1.txt 2>&1
echo "page rc=$? at ${SECONDS}s"
