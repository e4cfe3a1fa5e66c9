#!/bin/bash
# Run 6 (final of the session): bench page, pack block A/B on the shipped kernel, GPU tests.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
SHA=$1
timeout 220 python3 benchmarks/run.py --commit $SHA --out $OUT/bench-h200.json --docs-dir $OUT/docs > $OUT/bench.txt 2>&1
echo "bench rc=$?"; tail -3 $OUT/bench.txt
timeout 80 python3 benchmarks/variants.py --ab --ab-only pack+mask > $OUT/ab_pack_block.txt 2>&1
echo "ab rc=$?"; cat $OUT/ab_pack_block.txt
timeout 270 bash scripts/gpu_tests.sh > $OUT/gpu_tests.txt 2>&1
echo "tests rc=$?"; tail -8 $OUT/gpu_tests.txt
