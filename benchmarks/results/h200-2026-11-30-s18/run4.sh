#!/bin/bash
# Run 4 of the eighteenth session, on the two-GPU kind, commit $1: run 3's seven failures were
# the compiled first use of a group on torch 2.11 (dynamo there cannot trace id() of a process
# group, nor pass a CPGroup to a trace-time function); the reworked shared_cp_group no longer
# traces the memo. The group tests on two nccl ranks, and the gathers' compile repro on gloo.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
SECONDS=0
timeout 200 bash scripts/gpu_tests.sh -q -rsfE packages/cp-common/tests/test_group_compile.py \
    packages/cp-common/tests/test_group.py packages/cp-dcp/tests/test_groups.py \
    > $OUT/gpu_tests_x2_groups-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E '^(FAILED|ERROR)|^E .*(Error|Explanation)' $OUT/gpu_tests_x2_groups-$1.txt | head -20
tail -1 $OUT/gpu_tests_x2_groups-$1.txt
timeout 100 python3 benchmarks/results/h200-2026-11-30-s18/gathers_compile_first_use.py > $OUT/gathers_compile-$1.txt 2>&1
echo "repro rc=$? at ${SECONDS}s"; cat $OUT/gathers_compile-$1.txt | tail -17
