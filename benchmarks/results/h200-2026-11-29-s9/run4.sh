#!/bin/bash
# Run 4 of the ninth session (one GPU), commit $1: every test of the four packages on the GPU
# (gpu_tests.sh without arguments; multi-GPU tests skip).
SECONDS=0
timeout 540 bash scripts/gpu_tests.sh -q -rs \
    packages/cp-common/tests packages/cp-dcp/tests packages/cp-pcp/tests packages/cp-testing/tests \
    > $OUT/gpu_tests_all-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E '^(FAILED|ERROR)' $OUT/gpu_tests_all-$1.txt | head -20
tail -2 $OUT/gpu_tests_all-$1.txt
