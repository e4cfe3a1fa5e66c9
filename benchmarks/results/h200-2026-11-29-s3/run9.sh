#!/bin/bash
# Run 9, executed inline from the repository root (commit 78c5f02).
timeout 200 bash scripts/gpu_tests.sh -q -rs packages/cp-dcp/tests/ops packages/cp-dcp/tests/test_manager.py > $OUT/gpu_tests_final.txt 2>&1
