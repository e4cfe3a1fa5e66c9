#!/bin/bash
# Run 6 of the seventh session (one GPU), the A2A block format (commit $1): the unpack's tile
# knobs again (benchmarks/variants.py --ab: num_warps forced to 4 / 8 against the shipped
# tile, 8 KiB in flight against 16 KiB), interleaved per shape, B=4096 and decode.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
SECONDS=0
timeout 400 python3 benchmarks/variants.py --ab --ab-only unpack-warps,unpack-inflight \
    > $OUT/ab_unpack_blocks.txt 2>&1
echo "ab rc=$? at ${SECONDS}s"; tail -20 $OUT/ab_unpack_blocks.txt
