#!/bin/bash
# Run 2 of the eighteenth session, on the two-GPU kind, commit $1: every GPU test of the four
# packages, cp-dcp pinned to GPU 0 and the rest to GPU 1 (tests that need two GPUs skip here;
# run 3 takes them): the A2A pack / unpack as registered ops (CUDA graphs, launch plans), the
# version bumps, the trace-time group resolution; the demo on 2 nccl ranks; then the page on
# GPU 0.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
SECONDS=0
CUDA_VISIBLE_DEVICES=0 timeout 300 bash scripts/gpu_tests.sh -q -rsfE --durations=5 \
    packages/cp-dcp/tests > $OUT/gpu_tests-dcp-$1.txt 2>&1 &
A=$!
CUDA_VISIBLE_DEVICES=1 timeout 300 bash scripts/gpu_tests.sh -q -rsfE --durations=5 \
    packages/cp-common/tests packages/cp-pcp/tests packages/cp-testing/tests \
    > $OUT/gpu_tests-rest-$1.txt 2>&1 &
B=$!
wait $A; echo "cp-dcp rc=$? at ${SECONDS}s"; tail -1 $OUT/gpu_tests-dcp-$1.txt
wait $B; echo "rest rc=$? at ${SECONDS}s"; tail -1 $OUT/gpu_tests-rest-$1.txt
grep -hE "^(FAILED|ERROR)" $OUT/gpu_tests-*-$1.txt | head -30
timeout 60 python3 -m cpattn_testing.demo --backend nccl --world-size 2 > $OUT/demo-x2-$1.txt 2>&1
echo "demo rc=$? at ${SECONDS}s"; tail -2 $OUT/demo-x2-$1.txt
CUDA_VISIBLE_DEVICES=0 timeout $((570 - SECONDS)) python3 benchmarks/run.py --commit $1 \
    --out $OUT/bench-$1.json --docs-dir $OUT/docs > $OUT/bench-$1.log 2>&1
echo "page rc=$? at ${SECONDS}s"; grep -E "not met" $OUT/docs/performance.md | grep -v "graph replay\|plans off" | head
