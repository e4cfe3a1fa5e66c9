#!/bin/bash
# Probe run 5: run 4's pack layouts again with the 16-ary search compiling on the GPU.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
timeout 100 /usr/local/cuda/bin/ncu -k 'regex:pack_' --section SpeedOfLight --section WarpStateStats \
  --metrics smsp__inst_executed.sum,l1tex__t_sector_hit_rate.pct \
  python3 benchmarks/pack_variants.py --probe > $OUT/ncu5.txt 2>&1
echo "ncu rc=$?"; grep -E "^\s+_|Duration|DRAM Throughput|inst_executed|hit_rate" $OUT/ncu5.txt
timeout 250 python3 benchmarks/pack_variants.py > $OUT/pack_variants5.txt 2>&1
echo "pack rc=$?"; cat $OUT/pack_variants5.txt
