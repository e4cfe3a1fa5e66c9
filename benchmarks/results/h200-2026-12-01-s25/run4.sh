#!/bin/bash
# Run 4 of the twenty-fifth session, on one H200, commit $1: after the kernel index-width fixes
# (direct KV wait's NaN-fill step, direct A2A publish head offset, pack program id in IDX64
# mode), the direct workspaces' agreement on their local tensors, and the launcher's exit
# handshake through a file store: the direct folder (simulated peers on the GPU), the A2A
# kernels, the large-offset and sm_90 compile tests, the manager, and the launcher's tests.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
SECONDS=0
timeout 400 bash scripts/gpu_tests.sh -q -rfE packages/cp-dcp/tests/direct \
    packages/cp-dcp/tests/ops/test_a2a_kernels.py packages/cp-dcp/tests/ops/test_large_offsets.py \
    packages/cp-dcp/tests/ops/test_kernels_compile.py packages/cp-dcp/tests/test_manager.py \
    packages/cp-testing/tests/test_launcher.py > $OUT/gpu_tests-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; tail -n 1 $OUT/gpu_tests-$1.txt
grep -hE "^(FAILED|ERROR)" $OUT/gpu_tests-$1.txt | head -20
