#!/bin/bash
# Run 2 of the fourteenth session, on the two-GPU kind, commit $1: the demo on 2 nccl ranks,
# then the tests that create, resolve and destroy nccl process groups (the shared weakly held
# wrapper, group tokens, the capability cache keyed by group), the nccl combines, the manager
# and its direct paths, PCP on nccl, and the launcher.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
export CPATTN_CACHE_DIR=$(mktemp -d)
SECONDS=0
timeout 150 python3 -m cpattn_testing.demo --backend nccl --world-size 2 --json $OUT/demo-x2-$1.json \
    > $OUT/demo-x2-$1.txt 2>&1
echo "demo rc=$? at ${SECONDS}s"; tail -4 $OUT/demo-x2-$1.txt
timeout 330 bash scripts/gpu_tests.sh -q -rs packages/cp-dcp/tests/distributed packages/cp-dcp/tests/direct \
    packages/cp-dcp/tests/test_groups.py packages/cp-dcp/tests/test_manager.py \
    packages/cp-common/tests/test_group.py packages/cp-common/tests/test_capability.py \
    packages/cp-common/tests/test_launch.py packages/cp-pcp/tests/test_group.py \
    packages/cp-pcp/tests/distributed > $OUT/gpu_tests_x2-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E '^(FAILED|ERROR)' $OUT/gpu_tests_x2-$1.txt | head -20
tail -2 $OUT/gpu_tests_x2-$1.txt
# The host-time A/B of run 3 again, after the mask check's fix (on one of the two GPUs).
CUDA_VISIBLE_DEVICES=0 bash benchmarks/results/h200-2026-11-30-s14/run3.sh $1
