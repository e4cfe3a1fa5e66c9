#!/bin/bash
# Run 3 of the twelfth session, on the two-GPU kind, commit $1: the nccl combine, direct-path,
# manager, PCP and launcher tests (the manager's fallbacks, workspaces shared by process group,
# int16 indices on the direct A2A) and the demo on 2 nccl ranks, launch plans in their default
# mode, from an empty cache directory.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
export CPATTN_CACHE_DIR=$(mktemp -d)
SECONDS=0
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu-x2.txt 2>&1
timeout 330 bash scripts/gpu_tests.sh -q -rs packages/cp-dcp/tests/distributed packages/cp-dcp/tests/direct \
    packages/cp-dcp/tests/test_manager.py packages/cp-pcp/tests packages/cp-testing/tests/test_launcher.py \
    > $OUT/gpu_tests_x2-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E '^(FAILED|ERROR)' $OUT/gpu_tests_x2-$1.txt | head -20
tail -2 $OUT/gpu_tests_x2-$1.txt
timeout 90 python3 -m cpattn_testing.demo --backend nccl --world-size 2 > $OUT/demo-x2-$1.txt 2>&1
echo "demo rc=$? at ${SECONDS}s"; tail -3 $OUT/demo-x2-$1.txt
