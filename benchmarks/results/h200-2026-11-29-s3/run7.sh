#!/bin/bash
# Run 7, executed inline from the repository root.
timeout 330 bash scripts/gpu_tests.sh -q -rs -x packages/cp-dcp/tests packages/cp-testing/tests packages/cp-pcp/tests > $OUT/gpu_tests2.txt 2>&1
