#!/bin/bash
# Run 2 of the seventeenth session, on the two-GPU kind, commit $1: every GPU test of the four
# packages, cp-dcp pinned to GPU 0 and the rest to GPU 1 (tests that need two GPUs skip here;
# run 3 takes them): the gathers' NaN on a timeout (simulated peers, compiled kernels), the
# allocation agreement, and the dispatch changes of the last session (never run on a GPU).
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
SECONDS=0
CUDA_VISIBLE_DEVICES=0 timeout 420 bash scripts/gpu_tests.sh -q -rsfE --durations=5 \
    packages/cp-dcp/tests > $OUT/gpu_tests-dcp-$1.txt 2>&1 &
A=$!
CUDA_VISIBLE_DEVICES=1 timeout 420 bash scripts/gpu_tests.sh -q -rsfE --durations=5 \
    packages/cp-common/tests packages/cp-pcp/tests packages/cp-testing/tests \
    > $OUT/gpu_tests-rest-$1.txt 2>&1 &
B=$!
wait $A; echo "cp-dcp rc=$? at ${SECONDS}s"; tail -1 $OUT/gpu_tests-dcp-$1.txt
wait $B; echo "rest rc=$? at ${SECONDS}s"; tail -1 $OUT/gpu_tests-rest-$1.txt
grep -hE "^(FAILED|ERROR)" $OUT/gpu_tests-*-$1.txt | head -30
