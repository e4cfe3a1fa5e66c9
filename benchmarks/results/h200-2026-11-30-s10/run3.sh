#!/bin/bash
# Run 3 of the tenth session (one GPU), commit $1: launch plans on the GPU. Their tests and the
# op tests around them; the failed-allocation case on its own (a C++ exception caught inside
# the module: run 1 saw a segfault when a C++ exception left the probe's pybind module); then
# the page, with host rows for launch plans on.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1
SECONDS=0
bash scripts/gpu_tests.sh -q -rs packages/cp-common/tests/test_launch_plans.py \
    -k "not failed_allocation" packages/cp-common/tests/test_launch.py \
    packages/cp-common/tests/ops/test_merge_attn_states.py \
    packages/cp-dcp/tests/ops/test_launch_plans_ops.py packages/cp-dcp/tests/ops/test_correct_attn_out.py \
    packages/cp-dcp/tests/ops/test_mask_empty_shards.py packages/cp-dcp/tests/ops/test_a2a_kernels.py \
    packages/cp-dcp/tests/ops/test_launch_fast_path.py packages/cp-dcp/tests/ops/test_cuda_graph.py \
    > $OUT/gpu_tests-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; tail -15 $OUT/gpu_tests-$1.txt
bash scripts/gpu_tests.sh -q -rs packages/cp-common/tests/test_launch_plans.py -k failed_allocation \
    > $OUT/gpu_tests_alloc-$1.txt 2>&1
echo "alloc test rc=$? at ${SECONDS}s"; tail -3 $OUT/gpu_tests_alloc-$1.txt
timeout 300 python3 benchmarks/run.py --commit "$1" --out $OUT/bench-$1.json --docs-dir $OUT/docs \
    > $OUT/bench-$1.txt 2>&1
echo "page rc=$? at ${SECONDS}s"; grep -A24 "Host overhead of an eager call" $OUT/docs/performance.md | tail -21
