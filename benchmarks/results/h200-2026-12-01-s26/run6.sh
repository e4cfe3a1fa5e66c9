#!/bin/bash
# Run 6 of the twenty-sixth session, on one H200, commit $1: every one-GPU test at the end of
# the session (after run 5: merge_attn_states return_lse check, resolve_dcp_combine("auto"),
# the demo's interpreter check, the gather reasons' order, the AgreementError export). cp-dcp
# and the other packages run as two pytest processes sharing the GPU.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
SECONDS=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $OUT/gpu-$1.txt 2>&1
timeout 540 bash scripts/gpu_tests.sh -q -rfE packages/cp-dcp/tests \
    > $OUT/gpu_tests-dcp-$1.txt 2>&1 &
A=$!
timeout 540 bash scripts/gpu_tests.sh -q -rfE packages/cp-common/tests \
    packages/cp-pcp/tests packages/cp-testing/tests > $OUT/gpu_tests-rest-$1.txt 2>&1 &
B=$!
wait $A; echo "cp-dcp rc=$? at ${SECONDS}s"; tail -n 1 $OUT/gpu_tests-dcp-$1.txt
wait $B; echo "rest rc=$? at ${SECONDS}s"; tail -n 1 $OUT/gpu_tests-rest-$1.txt
grep -hE "^(FAILED|ERROR)" $OUT/gpu_tests-*-$1.txt | head -30
