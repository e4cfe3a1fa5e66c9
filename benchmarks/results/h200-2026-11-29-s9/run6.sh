#!/bin/bash
# Run 6 of the ninth session (one GPU), commit $1: the page with the host rows' second
# reference (out-of-place torch.add, an allocating torch op). Kernels as at f170263.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
SECONDS=0
timeout 200 python3 benchmarks/run.py --commit "$1" --out $OUT/bench-$1.json --docs-dir $OUT/docs \
    > $OUT/bench-$1.txt 2>&1
echo "page rc=$? at ${SECONDS}s"; grep -A12 "Host overhead of an eager call" $OUT/docs/performance.md | tail -11
