#!/bin/bash
# Run 3 of the fourth session: the page (bench) of the committed kernels, then the cp-dcp GPU tests.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
timeout 240 python3 benchmarks/run.py --commit "$1" --out $OUT/bench-h200.json --docs-dir $OUT/docs > $OUT/bench.txt 2>&1
echo "bench rc=$?"; tail -5 $OUT/bench.txt
timeout 300 bash scripts/gpu_tests.sh -q -rs packages/cp-dcp/tests > $OUT/gpu_tests.txt 2>&1
echo "gpu tests rc=$?"; tail -8 $OUT/gpu_tests.txt
