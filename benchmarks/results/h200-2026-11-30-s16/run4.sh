#!/bin/bash
# Run 4 of the sixteenth session, on the four-GPU kind, commit $1: the test files run 2 did not
# reach in its 400 s (its list from the PCP tests on), at world sizes up to 4.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
SECONDS=0
timeout 540 bash scripts/gpu_tests.sh -q -rsfE --durations=10 packages/cp-common/tests/test_group.py \
    packages/cp-common/tests/test_workspace.py packages/cp-common/tests/test_capability.py \
    packages/cp-common/tests/test_topology.py packages/cp-pcp/tests packages/cp-testing/tests/test_demo.py \
    packages/cp-testing/tests/test_launcher.py packages/cp-testing/tests/test_plugin.py \
    > $OUT/gpu_tests_x4_rest-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E '^(FAILED|ERROR)' $OUT/gpu_tests_x4_rest-$1.txt | head -20
tail -2 $OUT/gpu_tests_x4_rest-$1.txt
