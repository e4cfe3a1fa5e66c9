#!/bin/bash
# Run 8 (the page run of 0ca5db8), executed inline from the repository root.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
timeout 100 python3 benchmarks/variants.py --ab --ab-only pack-small > $OUT/ab_pack_small.txt 2>&1
timeout 200 python3 benchmarks/run.py --commit 0ca5db8 --out $OUT/bench-h200.json --docs-dir $OUT/docs > $OUT/bench.txt 2>&1
