#!/bin/bash
# Run 1 of the ninth session (one GPU), commit $1: the merge's EAGER variant on decode grids
# with several heads per program (knobs _MULTI_HEAD_EAGER / _MULTI_HEAD_WARP_SCALE) at
# B = 8 / 16 / 32 / 64, then the page with the same-size copy replayed for decode rows, then
# the bench harness GPU tests.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
SECONDS=0
timeout 260 python3 benchmarks/variants.py --merge --batches 8,16,32,64 \
    --settings multi,multi-w2,multi-w4 --rounds 2 > $OUT/merge_multi.txt 2>&1
echo "sweep rc=$? at ${SECONDS}s"
timeout 170 python3 benchmarks/run.py --commit "$1" --out $OUT/bench-$1.json --docs-dir $OUT/docs \
    > $OUT/bench-$1.txt 2>&1
echo "page rc=$? at ${SECONDS}s"
timeout 60 bash scripts/gpu_tests.sh -q -rs packages/cp-testing/tests/test_bench.py \
    > $OUT/gpu_tests_bench-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; tail -2 $OUT/gpu_tests_bench-$1.txt
