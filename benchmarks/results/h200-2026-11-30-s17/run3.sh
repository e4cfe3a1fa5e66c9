#!/bin/bash
# Run 3 of the seventeenth session, on the two-GPU kind, commit $1: the tests that need two
# GPUs (direct paths on real symmetric memory, manager, gathers, nccl combines, workspace,
# PCP; files whose tests take world size 2 through run_ranks without a multigpu marker),
# plus the review fixes' op and dispatch tests), the demo on 2 nccl ranks, then the two-GPU
# collectives (the direct paths' rows after the NaN-on-timeout and group-failure-word changes
# of their kernels: one more load per program).
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
SECONDS=0
timeout 330 bash scripts/gpu_tests.sh -q -rsfE --durations=5 packages/cp-dcp/tests/direct \
    packages/cp-dcp/tests/test_manager.py packages/cp-dcp/tests/test_manager_validation.py \
    packages/cp-dcp/tests/test_gather.py packages/cp-dcp/tests/distributed \
    packages/cp-common/tests/test_capability.py packages/cp-common/tests/test_group.py \
    packages/cp-common/tests/test_workspace.py packages/cp-pcp/tests \
    packages/cp-common/tests/test_dispatch.py packages/cp-common/tests/ops/test_merge_attn_states.py \
    packages/cp-dcp/tests/ops/test_correct_attn_out.py packages/cp-dcp/tests/ops/test_mask_empty_shards.py \
    packages/cp-testing/tests/test_dispatch.py > $OUT/gpu_tests_x2-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E '^(FAILED|ERROR)' $OUT/gpu_tests_x2-$1.txt | head -20
tail -2 $OUT/gpu_tests_x2-$1.txt
timeout 60 python3 -m cpattn_testing.demo --backend nccl --world-size 2 > $OUT/demo-x2-$1.txt 2>&1
echo "demo rc=$? at ${SECONDS}s"; tail -2 $OUT/demo-x2-$1.txt
timeout $((560 - SECONDS)) python3 benchmarks/run.py --skip-kernels --commit "$1" --time-budget 60 \
    --out $OUT/coll-x2-$1.json --docs-dir $OUT/docs > $OUT/coll-x2-$1.txt 2>&1
echo "collectives rc=$? at ${SECONDS}s"
grep -E 'gather' $OUT/docs/performance.md | grep -E '\| 2 \|' | head -12
