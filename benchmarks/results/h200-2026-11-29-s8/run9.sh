#!/bin/bash
# Run 9 of the eighth session (one GPU), working tree on top of $1: the merge at B = 1 / 8 /
# 16 / 32 under every _MERGE_SETTINGS entry, among them EAGER loads on grids of up to 1056
# programs with ~2 lanes per thread on one-head programs of D >= 512.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
SECONDS=0
timeout 230 python3 benchmarks/variants.py --merge --rounds 2 --batches 1,8,16,32 > $OUT/merge_sweep4.txt 2>&1
echo "sweep rc=$? at ${SECONDS}s"; cut -c1-600 $OUT/merge_sweep4.txt
