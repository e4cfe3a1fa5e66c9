#!/bin/bash
# Run 1 of the nineteenth session, on the four-GPU kind, commit $1: the performance page on
# GPU 0 alone (nothing else running), then every one-GPU test of the four packages, cp-dcp on
# GPU 2 and the rest on GPU 3 (tests that need more GPUs skip here; run 2 takes them).
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
SECONDS=0
nvidia-smi --query-gpu=index,name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/gpus-x4.txt 2>&1
CUDA_VISIBLE_DEVICES=0 timeout 240 python3 benchmarks/run.py --commit $1 \
    --out $OUT/bench-$1.json --docs-dir $OUT/docs > $OUT/bench-$1.log 2>&1
echo "page rc=$? at ${SECONDS}s"; grep -E "not met" $OUT/docs/performance.md | grep -v "graph replay\|plans off" | head
CUDA_VISIBLE_DEVICES=2 timeout $((585 - SECONDS)) bash scripts/gpu_tests.sh -q -rsfE --durations=5 \
    packages/cp-dcp/tests > $OUT/gpu_tests-dcp-$1.txt 2>&1 &
A=$!
CUDA_VISIBLE_DEVICES=3 timeout $((585 - SECONDS)) bash scripts/gpu_tests.sh -q -rsfE --durations=5 \
    packages/cp-common/tests packages/cp-pcp/tests packages/cp-testing/tests \
    > $OUT/gpu_tests-rest-$1.txt 2>&1 &
B=$!
wait $A; echo "cp-dcp rc=$? at ${SECONDS}s"; tail -1 $OUT/gpu_tests-dcp-$1.txt
wait $B; echo "rest rc=$? at ${SECONDS}s"; tail -1 $OUT/gpu_tests-rest-$1.txt
grep -hE "^(FAILED|ERROR)" $OUT/gpu_tests-*-$1.txt | head -30
