#!/bin/bash
# Probe run 1 of the fourth session (one H200): unpack-combine forms (gated loads, gathered
# LSE math, tiles), correct_attn_out with its LSE math gathered (A/B), ncu of both.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv > $OUT/gpu.txt 2>&1
timeout 210 python3 benchmarks/unpack_variants.py > $OUT/unpack_variants.txt 2>&1
echo "unpack rc=$?"; grep -v "^check" $OUT/unpack_variants.txt | cut -c1-1500; grep -c FAIL $OUT/unpack_variants.txt
timeout 170 python3 benchmarks/variants.py --ab --ab-only correct-gather > $OUT/ab_correct_gather.txt 2>&1
echo "ab rc=$?"; cat $OUT/ab_correct_gather.txt
timeout 170 /usr/local/cuda/bin/ncu -k 'regex:unpack|correct' --section SpeedOfLight \
  --section LaunchStats --section Occupancy --section SchedulerStats --section WarpStateStats \
  --metrics dram__bytes_read.sum,dram__bytes_write.sum,smsp__inst_executed.sum \
  python3 benchmarks/unpack_variants.py --probe > $OUT/ncu.txt 2>&1
echo "ncu rc=$?"; grep -E "^  [_a-z]|Duration|DRAM Throughput|Registers Per|Achieved Occ|inst_executed|Compute \(SM\)" $OUT/ncu.txt
