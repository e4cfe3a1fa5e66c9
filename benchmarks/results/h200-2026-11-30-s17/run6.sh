#!/bin/bash
# Run 6 of the seventeenth session, on the two-GPU kind, commit $1: after the final reread folded
# the waits' shared check/poll/record block into direct_protocol._checked_wait (kernels
# recompile): the direct-path tests (simulated peers on one GPU and real ranks) and the demo.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
SECONDS=0
timeout 300 bash scripts/gpu_tests.sh -q -rsfE packages/cp-dcp/tests/direct \
    packages/cp-common/tests/test_workspace.py > $OUT/gpu_tests_x2_direct-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E '^(FAILED|ERROR)' $OUT/gpu_tests_x2_direct-$1.txt | head -20
tail -1 $OUT/gpu_tests_x2_direct-$1.txt
timeout 90 python3 -m cpattn_testing.demo --backend nccl --world-size 2 > $OUT/demo-x2-$1.txt 2>&1
echo "demo rc=$? at ${SECONDS}s"; tail -2 $OUT/demo-x2-$1.txt
