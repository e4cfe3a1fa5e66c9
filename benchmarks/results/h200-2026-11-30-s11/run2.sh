#!/bin/bash
# Run 2 of the eleventh session (one GPU), commit $1: every GPU test of the four packages with
# launch plans in their default (auto) mode, in two pytest processes at once on the one GPU
# (cp-dcp; the other three packages and the repo tests), so that the whole suite fits one call.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
SECONDS=0
timeout 560 bash scripts/gpu_tests.sh -q -rs --durations=8 packages/cp-dcp/tests \
    > $OUT/gpu_tests-dcp-$1.txt 2>&1 &
A=$!
timeout 560 bash scripts/gpu_tests.sh -q -rs --durations=8 packages/cp-common/tests \
    packages/cp-pcp/tests packages/cp-testing/tests tests > $OUT/gpu_tests-rest-$1.txt 2>&1 &
B=$!
wait $A; echo "cp-dcp rc=$? at ${SECONDS}s"; tail -3 $OUT/gpu_tests-dcp-$1.txt
wait $B; echo "rest rc=$? at ${SECONDS}s"; tail -3 $OUT/gpu_tests-rest-$1.txt
grep -hE "^(FAILED|ERROR)" $OUT/gpu_tests-*-$1.txt | head -30
