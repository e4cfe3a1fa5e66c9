#!/bin/bash
# Run 2 of the tenth session (one GPU), commit $1: the compiled-launch probe again, its error
# cases last and one by one (run 1's probe crashed with a segfault after its checks).
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1
SECONDS=0
g++ --version | head -1
timeout 300 python3 benchmarks/native_launch_probe.py --json $OUT/native_probe-$1.json \
    > $OUT/native_probe-$1.txt 2>&1
echo "probe rc=$? at ${SECONDS}s"; grep -v "^{'B'" $OUT/native_probe-$1.txt | tail -45
