#!/bin/bash
# Run 7 of the eighth session (one GPU), commit $1: the large-offset tests (past 2**31
# elements) of cp-common and cp-dcp after their chunked check moved into
# cpattn_testing.tolerances.assert_close_by_row_chunks.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
SECONDS=0
timeout 400 bash scripts/gpu_tests.sh -q -rs packages/cp-common/tests/ops/test_merge_large_offsets.py \
    packages/cp-dcp/tests/ops/test_large_offsets.py > $OUT/gpu_tests_large-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; tail -3 $OUT/gpu_tests_large-$1.txt
