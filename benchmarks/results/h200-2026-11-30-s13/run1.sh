#!/bin/bash
# Run 1 of the thirteenth session (one GPU), commit $1: every GPU test of the four packages
# (least-recently-used plan eviction, int64 LSE offsets of the lean correct_attn_out kernel, the
# interpreter's bf16 narrowing tests next to the GPU's, the audit's fixes), in two pytest
# processes at once on the one GPU; then the plan-table timing on this host.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
SECONDS=0
timeout 440 bash scripts/gpu_tests.sh -q -rs --durations=8 packages/cp-dcp/tests \
    > $OUT/gpu_tests-dcp-$1.txt 2>&1 &
A=$!
timeout 440 bash scripts/gpu_tests.sh -q -rs --durations=8 packages/cp-common/tests \
    packages/cp-pcp/tests packages/cp-testing/tests > $OUT/gpu_tests-rest-$1.txt 2>&1 &
B=$!
wait $A; echo "cp-dcp rc=$? at ${SECONDS}s"; tail -1 $OUT/gpu_tests-dcp-$1.txt
wait $B; echo "rest rc=$? at ${SECONDS}s"; tail -1 $OUT/gpu_tests-rest-$1.txt
grep -hE "^(FAILED|ERROR)" $OUT/gpu_tests-*-$1.txt | head -30
timeout 100 python3 benchmarks/plan_eviction.py --json $OUT/plan_eviction-$1.json \
    > $OUT/plan_eviction-$1.txt 2>&1
echo "eviction rc=$? at ${SECONDS}s"; cat $OUT/plan_eviction-$1.txt
