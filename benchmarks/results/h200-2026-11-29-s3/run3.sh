#!/bin/bash
# Probe run 3: pack with int32 index arithmetic and the int32 per-token search (flat32).
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
timeout 120 /usr/local/cuda/bin/ncu -k 'regex:pack_' --section SpeedOfLight \
  --section WarpStateStats --section Occupancy \
  --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_op_write.sum,smsp__inst_executed.sum \
  python3 benchmarks/pack_variants.py --probe > $OUT/ncu3.txt 2>&1
echo "ncu rc=$?"; grep -E "^\s+_|Duration|DRAM Throughput|inst_executed|Registers Per|Achieved Occ" $OUT/ncu3.txt
timeout 200 python3 benchmarks/pack_variants.py > $OUT/pack_variants3.txt 2>&1
echo "pack rc=$?"; cat $OUT/pack_variants3.txt
