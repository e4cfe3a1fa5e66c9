#!/bin/bash
# Run 6 of the thirteenth session, on the two-GPU kind, commit $1, after the review of the
# session's changes: the demo on 2 nccl ranks (the manager path's LSE checked, its timed calls
# bound to the checked step), then the nccl combine, manager, group-token, capability, alloc
# and launcher tests (numbered group tokens; the in-place all-reduce of AG+AR for ProcessGroup
# wrappers; a failing multicast query no longer a failed rendezvous).
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
export CPATTN_CACHE_DIR=$(mktemp -d)
SECONDS=0
timeout 120 python3 -m cpattn_testing.demo --backend nccl --world-size 2 --json $OUT/demo-x2-$1.json \
    > $OUT/demo-x2-$1.txt 2>&1
echo "demo rc=$? at ${SECONDS}s"; tail -4 $OUT/demo-x2-$1.txt
timeout 240 bash scripts/gpu_tests.sh -q -rs packages/cp-dcp/tests/distributed packages/cp-dcp/tests/test_groups.py \
    packages/cp-dcp/tests/test_manager.py packages/cp-common/tests/test_capability.py \
    packages/cp-common/tests/test_alloc_ubatch.py packages/cp-common/tests/test_launch.py \
    packages/cp-common/tests/test_launch_plans.py > $OUT/gpu_tests_x2-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E '^(FAILED|ERROR)' $OUT/gpu_tests_x2-$1.txt | head -20
tail -2 $OUT/gpu_tests_x2-$1.txt
