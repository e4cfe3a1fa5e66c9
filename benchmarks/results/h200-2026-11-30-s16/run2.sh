#!/bin/bash
# Run 2 of the sixteenth session, on the FOUR-GPU kind (first lent this session), commit $1:
# every multi-GPU test at world sizes up to 4 on nccl (the combines with their dispatch-mode
# checks, the direct paths, the manager, the gathers, the groups, the demo tests), the
# compile / dispatch / flag tests of the single-GPU ops (run 1 found check_bool's
# `value.__class__ is bool` False under torch 2.11's dynamo; fixed with isinstance), then the
# demo on 4 nccl ranks and on 2 with two (speculative, now causal) query tokens per request.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
SECONDS=0
nvidia-smi topo -m > $OUT/topo-x4.txt 2>&1
timeout 400 bash scripts/gpu_tests.sh -q -rsfE --durations=10 packages/cp-dcp/tests/distributed \
    packages/cp-dcp/tests/direct packages/cp-dcp/tests/test_manager.py \
    packages/cp-dcp/tests/test_manager_validation.py packages/cp-dcp/tests/test_gather.py \
    packages/cp-dcp/tests/test_groups.py packages/cp-pcp/tests packages/cp-testing/tests/test_demo.py \
    packages/cp-testing/tests/test_launcher.py packages/cp-testing/tests/test_plugin.py \
    packages/cp-common/tests/test_group.py packages/cp-common/tests/test_capability.py \
    packages/cp-common/tests/test_workspace.py packages/cp-common/tests/test_topology.py \
    packages/cp-dcp/tests/ops/test_correct_attn_out.py packages/cp-dcp/tests/ops/test_mask_empty_shards.py \
    packages/cp-common/tests/ops/test_merge_attn_states.py packages/cp-common/tests/test_checks.py \
    > $OUT/gpu_tests_x4-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E '^(FAILED|ERROR)' $OUT/gpu_tests_x4-$1.txt | head -20
tail -2 $OUT/gpu_tests_x4-$1.txt
timeout 90 python3 -m cpattn_testing.demo --backend nccl --world-size 4 > $OUT/demo-x4-$1.txt 2>&1
echo "demo ws4 rc=$? at ${SECONDS}s"; tail -4 $OUT/demo-x4-$1.txt
timeout 60 python3 -m cpattn_testing.demo --backend nccl --world-size 2 --queries-per-request 2 \
    > $OUT/demo-x2-tq2-$1.txt 2>&1
echo "demo ws2 tq=2 rc=$? at ${SECONDS}s"; tail -3 $OUT/demo-x2-tq2-$1.txt
