#!/bin/bash
# Run 10 of the twenty-first session (one GPU), commit $1: the A2A kernel tests, including the
# new one that runs the unpack at N=8 with one vector per thread (twice the tile rule's warps)
# against the float64 combine and bit for bit against the tile rule's warps.
SECONDS=0
timeout 300 bash scripts/gpu_tests.sh -q -rsfE packages/cp-dcp/tests/ops/test_a2a_kernels.py \
    > $OUT/gpu_tests-a2a-$1.txt 2>&1
echo "a2a tests rc=$? at ${SECONDS}s"; tail -1 $OUT/gpu_tests-a2a-$1.txt
grep -hE '^(FAILED|ERROR)' $OUT/gpu_tests-a2a-$1.txt | head
