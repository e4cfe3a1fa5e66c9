#!/bin/bash
# Run 7 of the seventh session (one GPU), commit $1: the unpack's warps for decode-size grids
# (variants.py --ab --ab-only unpack-decode: _UNPACK_SMALL_GRID_LANES 0 = the tile rule alone,
# 4 or 2 head-dim lanes per thread), B=4096 and graph replay at B = 1 / 8 / 64.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
SECONDS=0
timeout 300 python3 benchmarks/variants.py --ab --ab-only unpack-decode > $OUT/ab_unpack_decode.txt 2>&1
echo "ab rc=$? at ${SECONDS}s"; tail -10 $OUT/ab_unpack_decode.txt
