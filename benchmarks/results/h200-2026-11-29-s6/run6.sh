#!/bin/bash
# Run 6 of the sixth session (one GPU): correct_attn_out's lean kernel of f362a8e^ against the
# working tree (benchmarks/ab_correct_versions.py; benchmarks/_ab_ref carried), then the
# property tests with the large-LSE draws.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
timeout 150 python3 benchmarks/ab_correct_versions.py > $OUT/ab_correct_versions.txt 2>&1
echo "ab rc=$?"; cat $OUT/ab_correct_versions.txt | tail -8
timeout 120 bash scripts/gpu_tests.sh -q packages/cp-dcp/tests/ops/test_properties.py > $OUT/gpu_tests_properties.txt 2>&1
echo "properties rc=$?"; tail -2 $OUT/gpu_tests_properties.txt
