#!/bin/bash
# Run 1 of the sixteenth session (one GPU), commit $1: every GPU test of the four packages
# (the ops now go through their registered ops under dispatch modes and autograd; the A2A
# staging gap; the plugin's gpu markers), then the page (host time of the ops after the
# must_dispatch test was added to every public functional).
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
SECONDS=0
timeout 300 bash scripts/gpu_tests.sh -q -rs --durations=5 packages/cp-dcp/tests \
    > $OUT/gpu_tests-dcp-$1.txt 2>&1 &
A=$!
timeout 300 bash scripts/gpu_tests.sh -q -rs --durations=5 packages/cp-common/tests \
    packages/cp-pcp/tests packages/cp-testing/tests > $OUT/gpu_tests-rest-$1.txt 2>&1 &
B=$!
wait $A; echo "cp-dcp rc=$? at ${SECONDS}s"; tail -1 $OUT/gpu_tests-dcp-$1.txt
wait $B; echo "rest rc=$? at ${SECONDS}s"; tail -1 $OUT/gpu_tests-rest-$1.txt
grep -hE "^(FAILED|ERROR)" $OUT/gpu_tests-*-$1.txt | head -30
timeout $((590 - SECONDS)) python3 benchmarks/run.py --commit "$1" --out $OUT/bench-$1.json \
    --docs-dir $OUT/docs > $OUT/bench-$1.txt 2>&1
echo "page rc=$? at ${SECONDS}s"; grep -E "not met|incomplete|error" $OUT/docs/performance.md | head -20
grep -E "host overhead \(the default path" $OUT/docs/performance.md | head -8
