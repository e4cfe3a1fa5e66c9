#!/bin/bash
# Run 8 of the eighth session (one GPU), working tree on top of $1: the merge at B=8 with EAGER
# loads on grids of up to 1056 programs, with and without ~2 lanes per thread there.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
SECONDS=0
timeout 200 python3 benchmarks/variants.py --merge --rounds 2 --batches 8 > $OUT/merge_sweep3.txt 2>&1
echo "sweep rc=$? at ${SECONDS}s"; cut -c1-400 $OUT/merge_sweep3.txt
