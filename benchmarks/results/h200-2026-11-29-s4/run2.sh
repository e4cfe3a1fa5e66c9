#!/bin/bash
# Probe run 2 of the fourth session: unpack forms again (+ int64 tuple forms, same-size
# copy), shipped unpack and correct_attn_out with gathered LSE math (A/B by N).
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
timeout 200 python3 benchmarks/unpack_variants.py > $OUT/unpack_variants2.txt 2>&1
echo "unpack rc=$?"; grep -v "^check" $OUT/unpack_variants2.txt | cut -c1-1800; grep -c FAIL $OUT/unpack_variants2.txt
timeout 170 python3 benchmarks/variants.py --ab --ab-only unpack-gather > $OUT/ab_unpack_gather.txt 2>&1
echo "ab rc=$?"; cat $OUT/ab_unpack_gather.txt
timeout 170 python3 benchmarks/variants.py --ab --ab-only correct-gather > $OUT/ab_correct_gather2.txt 2>&1
echo "ab rc=$?"; cat $OUT/ab_correct_gather2.txt
