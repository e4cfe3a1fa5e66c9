#!/bin/bash
# Run 4 of the seventeenth session, on the two-GPU kind, commit $1: the mended manager test
# (rank 1 out of memory: every manager keeps the NCCL path), with the workspace, capability and
# direct-path tests around it, then the demo on 2 nccl ranks with two query tokens.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
SECONDS=0
timeout 400 bash scripts/gpu_tests.sh -q -rsfE --durations=5 packages/cp-dcp/tests/test_manager.py \
    packages/cp-common/tests/test_workspace.py packages/cp-common/tests/test_capability.py \
    packages/cp-dcp/tests/direct > $OUT/gpu_tests_x2_manager-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E '^(FAILED|ERROR)' $OUT/gpu_tests_x2_manager-$1.txt | head -20
tail -2 $OUT/gpu_tests_x2_manager-$1.txt
timeout 90 python3 -m cpattn_testing.demo --backend nccl --world-size 2 --queries-per-request 2 \
    > $OUT/demo-x2-tq2-$1.txt 2>&1
echo "demo rc=$? at ${SECONDS}s"; tail -2 $OUT/demo-x2-tq2-$1.txt
