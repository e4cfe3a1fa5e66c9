#!/bin/bash
# Run 5 of the fifteenth session, on the two-GPU kind, commit $1: after the review of the
# manager changes (PCP head counts, one check per direct call, KV staging only when needed,
# fork-safe log set): the manager, direct-path, gather and nccl combine tests, and the demo.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SECONDS=0
timeout 300 bash scripts/gpu_tests.sh -q -rs packages/cp-dcp/tests/test_manager.py \
    packages/cp-dcp/tests/test_manager_validation.py packages/cp-dcp/tests/direct \
    packages/cp-dcp/tests/test_gather.py packages/cp-dcp/tests/distributed \
    packages/cp-common/tests/test_group.py > $OUT/gpu_tests_x2-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E '^(FAILED|ERROR)' $OUT/gpu_tests_x2-$1.txt | head -20
tail -2 $OUT/gpu_tests_x2-$1.txt
timeout 60 python3 -m cpattn_testing.demo --backend nccl --world-size 2 > $OUT/demo-x2-$1.txt 2>&1
echo "demo rc=$? at ${SECONDS}s"; tail -3 $OUT/demo-x2-$1.txt
