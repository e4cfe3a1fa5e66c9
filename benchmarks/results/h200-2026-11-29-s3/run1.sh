#!/bin/bash
# Probe run 1 of the third session (one H200): ncu of the D=128 kernels, pack layouts,
# decode floor, correct_attn_out tile A/B. Outputs go to $OUT.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv > $OUT/gpu.txt 2>&1
timeout 170 /usr/local/cuda/bin/ncu -k 'regex:pack|correct' --section SpeedOfLight \
  --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
  --section WarpStateStats --section Occupancy --section SchedulerStats \
  --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_op_read.sum,lts__t_sectors_op_write.sum \
  python3 benchmarks/pack_variants.py --probe > $OUT/ncu.txt 2>&1
echo "ncu rc=$?"
timeout 150 python3 benchmarks/pack_variants.py > $OUT/pack_variants.txt 2>&1
echo "pack rc=$?"; tail -12 $OUT/pack_variants.txt
timeout 150 python3 benchmarks/decode_floor.py > $OUT/decode_floor.txt 2>&1
echo "decode rc=$?"; cat $OUT/decode_floor.txt | cut -c1-400
timeout 110 python3 benchmarks/variants.py --ab --ab-only correct > $OUT/ab_correct.txt 2>&1
echo "ab rc=$?"; cat $OUT/ab_correct.txt
