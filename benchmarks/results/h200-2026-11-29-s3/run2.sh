#!/bin/bash
# Probe run 2: pack layouts with the per-token mask (flat-tok), unpack / correct warp counts.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
timeout 120 /usr/local/cuda/bin/ncu -k 'regex:pack_' --section SpeedOfLight \
  --section WarpStateStats --section Occupancy \
  --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_op_read.sum,lts__t_sectors_op_write.sum,smsp__inst_executed.sum \
  python3 benchmarks/pack_variants.py --probe > $OUT/ncu2.txt 2>&1
echo "ncu rc=$?"; grep -E "^\s+_|Duration|DRAM Throughput|inst_executed|lts__t_sectors_op_write" $OUT/ncu2.txt
timeout 170 python3 benchmarks/pack_variants.py > $OUT/pack_variants2.txt 2>&1
echo "pack rc=$?"; cat $OUT/pack_variants2.txt
timeout 130 python3 benchmarks/variants.py --ab --ab-only unpack-warps > $OUT/ab_unpack_warps.txt 2>&1
echo "ab rc=$?"; cat $OUT/ab_unpack_warps.txt
timeout 130 python3 benchmarks/variants.py --ab --ab-only correct-warps > $OUT/ab_correct_warps.txt 2>&1
echo "ab rc=$?"; cat $OUT/ab_correct_warps.txt
