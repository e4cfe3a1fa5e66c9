#!/bin/bash
# Probe run 4: flat32 pack with .cg payload loads / 16-ary search; unpack weighted-sum forms.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
timeout 100 /usr/local/cuda/bin/ncu -k 'regex:pack_' --section SpeedOfLight --section WarpStateStats \
  --metrics smsp__inst_executed.sum,l1tex__t_sector_hit_rate.pct \
  python3 benchmarks/pack_variants.py --probe > $OUT/ncu4.txt 2>&1
echo "ncu rc=$?"; grep -E "^\s+_|Duration|DRAM Throughput|inst_executed|hit_rate" $OUT/ncu4.txt
for w in shipped sel16 and; do
  timeout 90 python3 benchmarks/unpack_probe.py --wsum $w > $OUT/unpack_$w.txt 2>&1
  echo "unpack $w rc=$?"; cat $OUT/unpack_$w.txt
done
timeout 250 python3 benchmarks/pack_variants.py > $OUT/pack_variants4.txt 2>&1
echo "pack rc=$?"; cat $OUT/pack_variants4.txt
