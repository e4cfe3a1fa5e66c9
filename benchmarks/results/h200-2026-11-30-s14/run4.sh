#!/bin/bash
# Run 4 of the fourteenth session, on the two-GPU kind, commit $1, after the review fixes
# (shared_cp_group skips wrappers without weak references; group_probe never raises for a
# released shared wrapper; run_distributed names the rank that failed first; the mask
# argument check's one-expression valid case): the demo on 2 nccl ranks, the group, capability,
# launcher, PCP and nccl combine tests, and the mask-argument tests of every path on a GPU.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
export CPATTN_CACHE_DIR=$(mktemp -d)
SECONDS=0
timeout 150 python3 -m cpattn_testing.demo --backend nccl --world-size 2 --json $OUT/demo-x2-$1.json \
    > $OUT/demo-x2-$1.txt 2>&1
echo "demo rc=$? at ${SECONDS}s"; tail -3 $OUT/demo-x2-$1.txt
timeout 400 bash scripts/gpu_tests.sh -q -rs packages/cp-dcp/tests/distributed \
    packages/cp-dcp/tests/test_groups.py packages/cp-common/tests/test_group.py \
    packages/cp-common/tests/test_capability.py packages/cp-pcp/tests/test_group.py \
    packages/cp-pcp/tests/distributed packages/cp-testing/tests/test_launcher.py \
    packages/cp-testing/tests/test_demo.py packages/cp-dcp/tests/ops/test_mask_args_every_path.py \
    packages/cp-dcp/tests/ops/test_mask_empty_shards.py > $OUT/gpu_tests_x2-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E '^(FAILED|ERROR)' $OUT/gpu_tests_x2-$1.txt | head -20
tail -2 $OUT/gpu_tests_x2-$1.txt
