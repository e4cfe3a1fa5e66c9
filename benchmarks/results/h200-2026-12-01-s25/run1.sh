#!/bin/bash
# Run 1 of the twenty-fifth session, on the two-GPU kind, commit $1 (the device guard):
# 1. the new foreign-device tests against the code before the guard (build/old: `1fd7790`'s
#    packages with this commit's test files; one pytest process per file, so a CUDA fault in
#    one does not hide the other): expected to fail;
# 2. the same tests at $1;
# 3. every multi-GPU test at world size 2 on nccl, in two pytest processes sharing the GPUs
#    (as the nineteenth session's run 4), then the demo on 2 nccl ranks.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
SECONDS=0
nvidia-smi -L > $OUT/gpus-x2.txt
for t in packages/cp-dcp/tests/ops/test_foreign_device.py \
         "packages/cp-dcp/tests/direct/test_direct_gpu.py::test_direct_workspaces_run_on_their_device"; do
    (cd build/old && timeout 150 bash scripts/gpu_tests.sh -q -rsfE -x "$t") >> $OUT/foreign_before-$1.txt 2>&1
    echo "before the guard: $t rc=$? at ${SECONDS}s"
done
grep -E "passed|failed|Error" $OUT/foreign_before-$1.txt | tail -8
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
timeout 200 bash scripts/gpu_tests.sh -q -rsfE packages/cp-common/tests/test_device.py \
    packages/cp-dcp/tests/ops/test_foreign_device.py \
    "packages/cp-dcp/tests/direct/test_direct_gpu.py::test_direct_workspaces_run_on_their_device" \
    > $OUT/foreign_after-$1.txt 2>&1
echo "after the guard rc=$? at ${SECONDS}s"; tail -n 3 $OUT/foreign_after-$1.txt
timeout $((560 - SECONDS)) bash scripts/gpu_tests.sh -q -rsfE --durations=10 packages/cp-dcp/tests/distributed \
    packages/cp-dcp/tests/direct packages/cp-dcp/tests/test_manager.py \
    packages/cp-dcp/tests/test_manager_validation.py packages/cp-dcp/tests/test_gather.py \
    packages/cp-dcp/tests/test_groups.py > $OUT/gpu_tests_multi_dcp-$1.txt 2>&1 &
A=$!
timeout $((560 - SECONDS)) bash scripts/gpu_tests.sh -q -rsfE --durations=10 packages/cp-common/tests/test_group.py \
    packages/cp-common/tests/test_group_compile.py packages/cp-common/tests/test_workspace.py \
    packages/cp-common/tests/test_capability.py packages/cp-common/tests/test_topology.py \
    packages/cp-pcp/tests packages/cp-testing/tests/test_demo.py \
    packages/cp-testing/tests/test_launcher.py packages/cp-testing/tests/test_plugin.py \
    > $OUT/gpu_tests_multi_rest-$1.txt 2>&1 &
B=$!
wait $A; echo "cp-dcp multi-GPU rc=$? at ${SECONDS}s"; tail -n 1 $OUT/gpu_tests_multi_dcp-$1.txt
wait $B; echo "rest multi-GPU rc=$? at ${SECONDS}s"; tail -n 1 $OUT/gpu_tests_multi_rest-$1.txt
grep -hE "^(FAILED|ERROR)" $OUT/gpu_tests_multi_*-$1.txt | head -30
timeout $((595 - SECONDS)) python3 -m cpattn_testing.demo --backend nccl --world-size 2 \
    > $OUT/demo-x2-$1.txt 2>&1
echo "demo ws2 rc=$? at ${SECONDS}s"; tail -n 3 $OUT/demo-x2-$1.txt
