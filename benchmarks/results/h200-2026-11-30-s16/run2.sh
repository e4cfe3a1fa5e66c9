#!/bin/bash
# Run 2 of the sixteenth session, on the two-GPU kind, commit $1: the nccl combine tests (now
# with the dispatch-mode checks of the three combines), direct-path, manager and gather tests,
# then the demo on 2 nccl ranks with one and with two (speculative, now causal) query tokens.
# Also the compile / dispatch / flag tests of the single-GPU ops: run 1 found check_bool's
# `value.__class__ is bool` False under torch 2.11's dynamo (fixed with isinstance).
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
SECONDS=0
timeout 330 bash scripts/gpu_tests.sh -q -rsfE packages/cp-dcp/tests/distributed \
    packages/cp-dcp/tests/direct packages/cp-dcp/tests/test_manager.py \
    packages/cp-dcp/tests/test_manager_validation.py packages/cp-dcp/tests/test_gather.py \
    packages/cp-testing/tests/test_demo.py packages/cp-common/tests/test_group.py \
    packages/cp-dcp/tests/ops/test_correct_attn_out.py packages/cp-dcp/tests/ops/test_mask_empty_shards.py \
    packages/cp-common/tests/ops/test_merge_attn_states.py packages/cp-common/tests/test_checks.py \
    > $OUT/gpu_tests_x2-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E '^(FAILED|ERROR)' $OUT/gpu_tests_x2-$1.txt | head -20
tail -2 $OUT/gpu_tests_x2-$1.txt
timeout 60 python3 -m cpattn_testing.demo --backend nccl --world-size 2 > $OUT/demo-x2-$1.txt 2>&1
echo "demo rc=$? at ${SECONDS}s"; tail -3 $OUT/demo-x2-$1.txt
timeout 60 python3 -m cpattn_testing.demo --backend nccl --world-size 2 --queries-per-request 2 \
    > $OUT/demo-x2-tq2-$1.txt 2>&1
echo "demo tq=2 rc=$? at ${SECONDS}s"; tail -3 $OUT/demo-x2-tq2-$1.txt
