#!/bin/bash
# Run 3 of the eighteenth session, on the two-GPU kind, commit $1: the tests that take two
# ranks (direct paths on real symmetric memory, manager incl. the PCP A2A, gathers, nccl
# combines, groups incl. the compiled first use, workspace, PCP).
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
SECONDS=0
timeout 500 bash scripts/gpu_tests.sh -q -rsfE --durations=5 packages/cp-dcp/tests/direct \
    packages/cp-dcp/tests/test_manager.py packages/cp-dcp/tests/test_manager_validation.py \
    packages/cp-dcp/tests/test_gather.py packages/cp-dcp/tests/distributed \
    packages/cp-common/tests/test_capability.py packages/cp-common/tests/test_group.py \
    packages/cp-common/tests/test_group_compile.py packages/cp-common/tests/test_workspace.py \
    packages/cp-pcp/tests > $OUT/gpu_tests_x2-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E '^(FAILED|ERROR)' $OUT/gpu_tests_x2-$1.txt | head -20
tail -2 $OUT/gpu_tests_x2-$1.txt
