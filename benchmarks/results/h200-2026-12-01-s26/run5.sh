#!/bin/bash
# Run 5 of the twenty-sixth session, on one H200, commit $1: after the agreements became
# allocation-free (an int64 [1 + N] scratch, all_gather_into_tensor into it on nccl), the
# probe's same-node check became a host-name hash gathered through it, and the launcher's
# ranks apply their environment before cp-common is imported: the GPU tests of the agreement,
# capability probe and workspace (real symmetric memory at world size 1), the direct paths,
# the manager and the launcher; then every other one-GPU test of cp-common and cp-testing.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
SECONDS=0
timeout 300 bash scripts/gpu_tests.sh -q -rsfE packages/cp-common/tests/test_agreement.py \
    packages/cp-common/tests/test_capability.py packages/cp-common/tests/test_workspace.py \
    packages/cp-dcp/tests/direct packages/cp-dcp/tests/test_manager.py \
    packages/cp-testing/tests/test_launcher.py > $OUT/gpu_tests-agree-$1.txt 2>&1
echo "agreement tests rc=$? at ${SECONDS}s"; tail -n 1 $OUT/gpu_tests-agree-$1.txt
grep -hE "^(FAILED|ERROR)" $OUT/gpu_tests-agree-$1.txt | head -20
timeout $((560 - SECONDS)) bash scripts/gpu_tests.sh -q -rfE packages/cp-common/tests \
    packages/cp-testing/tests > $OUT/gpu_tests-rest-$1.txt 2>&1
echo "cp-common + cp-testing rc=$? at ${SECONDS}s"; tail -n 1 $OUT/gpu_tests-rest-$1.txt
grep -hE "^(FAILED|ERROR)" $OUT/gpu_tests-rest-$1.txt | head -20
