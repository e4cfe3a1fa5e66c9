#!/bin/bash
# Run 5 of the fourteenth session (one GPU), commit $1, after the launcher's callable-grid
# fix (a zero-cost try around len(grid) on the three hit paths): the launcher and op tests on
# the GPU, then run 3's host A/B against 185a200 again.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
SECONDS=0
timeout 330 bash scripts/gpu_tests.sh -q -rs packages/cp-dcp/tests/ops packages/cp-common/tests/test_launch.py \
    packages/cp-common/tests/test_launch_keys.py packages/cp-common/tests/test_launch_threads.py \
    packages/cp-common/tests/test_launch_plans.py packages/cp-common/tests/test_merge_fastpath.py \
    packages/cp-common/tests/ops > $OUT/gpu_tests-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E '^(FAILED|ERROR)' $OUT/gpu_tests-$1.txt | head -20
tail -1 $OUT/gpu_tests-$1.txt
bash benchmarks/results/h200-2026-11-30-s14/run3.sh $1
