#!/bin/bash
# Run 1 of the tenth session (one GPU), commit $1: the compiled-launch probe for
# correct_attn_out (build, bit-exact and float64 checks, error cases, host timings in the same
# rounds as add_ / torch.add / the shipped op), then the page with each op's host loop timed
# once per round next to add_ and torch.add (measure_host_rounds).
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1
SECONDS=0
which g++ ninja nvcc; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
timeout 300 python3 benchmarks/native_launch_probe.py --json $OUT/native_probe-$1.json \
    2>&1 | tee $OUT/native_probe-$1.txt | grep -v "^\s*$" | tail -40
echo "probe rc=${PIPESTATUS[0]} at ${SECONDS}s"
timeout 240 python3 benchmarks/run.py --commit "$1" --out $OUT/bench-$1.json --docs-dir $OUT/docs \
    > $OUT/bench-$1.txt 2>&1
echo "page rc=$? at ${SECONDS}s"; grep -A12 "Host overhead of an eager call" $OUT/docs/performance.md | tail -11
