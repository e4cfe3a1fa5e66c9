#!/bin/bash
# Run 4 of the nineteenth session, on the two-GPU kind (the four-GPU kind was no longer lent),
# commit $1, after CPGroup's grad refusal and the cp-pcp input checks (runs 1-2 predate them):
# every multi-GPU test at world sizes up to the GPUs visible, on nccl, in two pytest processes
# that share the GPUs (cp-dcp's combines, with their compile checks over a ProcessGroup, a
# CPGroup and a shared wrapper; the direct paths; the manager; the gathers; the group memo and
# its compile tests; the rest: PCP, workspaces, capability, topology, launcher, plugin, demo
# tests), then the demo on one rank per GPU.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
SECONDS=0
timeout 480 bash scripts/gpu_tests.sh -q -rsfE --durations=10 packages/cp-dcp/tests/distributed \
    packages/cp-dcp/tests/direct packages/cp-dcp/tests/test_manager.py \
    packages/cp-dcp/tests/test_manager_validation.py packages/cp-dcp/tests/test_gather.py \
    packages/cp-dcp/tests/test_groups.py > $OUT/gpu_tests_multi_dcp-$1.txt 2>&1 &
A=$!
timeout 480 bash scripts/gpu_tests.sh -q -rsfE --durations=10 packages/cp-common/tests/test_group.py \
    packages/cp-common/tests/test_group_compile.py packages/cp-common/tests/test_workspace.py \
    packages/cp-common/tests/test_capability.py packages/cp-common/tests/test_topology.py \
    packages/cp-pcp/tests packages/cp-testing/tests/test_demo.py \
    packages/cp-testing/tests/test_launcher.py packages/cp-testing/tests/test_plugin.py \
    > $OUT/gpu_tests_multi_rest-$1.txt 2>&1 &
B=$!
wait $A; echo "cp-dcp multi-GPU rc=$? at ${SECONDS}s"; tail -1 $OUT/gpu_tests_multi_dcp-$1.txt
wait $B; echo "rest multi-GPU rc=$? at ${SECONDS}s"; tail -1 $OUT/gpu_tests_multi_rest-$1.txt
grep -hE "^(FAILED|ERROR)" $OUT/gpu_tests_multi_*-$1.txt | head -30
GPUS=$(nvidia-smi -L | wc -l)
timeout $((590 - SECONDS)) python3 -m cpattn_testing.demo --backend nccl --world-size $GPUS \
    > $OUT/demo-x$GPUS-$1.txt 2>&1
echo "demo ws$GPUS rc=$? at ${SECONDS}s"; tail -3 $OUT/demo-x$GPUS-$1.txt
