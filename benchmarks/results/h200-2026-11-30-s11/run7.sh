#!/bin/bash
# Run 7 of the eleventh session, on the two-GPU kind, commit $1: the nccl combine, direct-path,
# manager and PCP tests and the demo on 2 nccl ranks, with launch plans in their default (auto)
# mode in every process (each builds or loads the module in the background while nccl runs),
# starting from an empty cache directory.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
export CPATTN_CACHE_DIR=$(mktemp -d)
SECONDS=0
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu-x2.txt 2>&1
timeout 300 bash scripts/gpu_tests.sh -q -rs packages/cp-dcp/tests/distributed packages/cp-dcp/tests/direct \
    packages/cp-dcp/tests/test_manager.py packages/cp-pcp/tests > $OUT/gpu_tests_x2-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E '^(FAILED|ERROR)' $OUT/gpu_tests_x2-$1.txt | head -20
tail -2 $OUT/gpu_tests_x2-$1.txt
ls -la $CPATTN_CACHE_DIR
timeout 90 python3 -m cpattn_testing.demo --backend nccl --world-size 2 > $OUT/demo-x2-$1.txt 2>&1
echo "demo rc=$? at ${SECONDS}s"; tail -3 $OUT/demo-x2-$1.txt
