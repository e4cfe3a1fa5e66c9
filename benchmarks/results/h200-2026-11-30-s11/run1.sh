#!/bin/bash
# Run 1 of the eleventh session (one GPU), commit $1: launch plans in their default (auto)
# mode. The probe (cold and warm cache), the launch-plan / native-build tests, then the page.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
SECONDS=0
which c++ g++; c++ --version | head -1; nproc
timeout 150 python3 benchmarks/auto_plans_probe.py --json $OUT/auto_plans-$1.json > $OUT/auto_plans-$1.txt 2>&1
echo "probe rc=$? at ${SECONDS}s"; cat $OUT/auto_plans-$1.json
timeout 200 bash scripts/gpu_tests.sh -q -rs packages/cp-common/tests/test_launch_plans.py \
    packages/cp-common/tests/test_native_build.py packages/cp-dcp/tests/ops/test_launch_plans_ops.py \
    packages/cp-common/tests/ops/test_merge_attn_states.py packages/cp-dcp/tests/ops/test_cuda_graph.py \
    > $OUT/gpu_tests-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "passed|failed|error" $OUT/gpu_tests-$1.txt | tail -3
timeout 200 python3 benchmarks/run.py --commit "$1" --out $OUT/bench-$1.json --docs-dir $OUT/docs \
    > $OUT/bench-$1.txt 2>&1
echo "page rc=$? at ${SECONDS}s"; grep "host-plans\|host/" $OUT/docs/performance.md | head -14
