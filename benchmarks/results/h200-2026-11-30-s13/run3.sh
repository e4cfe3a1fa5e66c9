#!/bin/bash
# Run 3 of the thirteenth session, on the two-GPU kind, commit $1: the nccl combine, direct-path,
# manager, PCP, capability, group and launcher tests (the direct gate now needs a working
# rendezvous; the direct kernels' 64-bit rank offsets and multi-word timeout masks; the group
# memo that no longer keeps groups alive; non-member and overlapping-buffer checks of CPGroup)
# and the demo on 2 nccl ranks, launch plans in their default mode, from an empty cache
# directory.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
export CPATTN_CACHE_DIR=$(mktemp -d)
SECONDS=0
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu-x2.txt 2>&1
timeout 360 bash scripts/gpu_tests.sh -q -rs packages/cp-dcp/tests/distributed packages/cp-dcp/tests/direct \
    packages/cp-dcp/tests/test_manager.py packages/cp-dcp/tests/test_groups.py packages/cp-pcp/tests \
    packages/cp-testing/tests/test_launcher.py packages/cp-testing/tests/test_tp_pcp_dcp_heads.py \
    packages/cp-common/tests/test_capability.py packages/cp-common/tests/test_group.py \
    packages/cp-common/tests/test_workspace.py > $OUT/gpu_tests_x2-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E '^(FAILED|ERROR)' $OUT/gpu_tests_x2-$1.txt | head -20
tail -2 $OUT/gpu_tests_x2-$1.txt
timeout 90 python3 -m cpattn_testing.demo --backend nccl --world-size 2 > $OUT/demo-x2-$1.txt 2>&1
echo "demo rc=$? at ${SECONDS}s"; tail -3 $OUT/demo-x2-$1.txt
