#!/bin/bash
# Run 6 of the eleventh session (one GPU), commit $1: keys recorded at their second call. The
# default-mode probe (varying batch: first four calls per new key), then every launch-plan
# test of cp-common and cp-dcp with the merge, CUDA-graph and cached-launch op tests.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
SECONDS=0
timeout 200 python3 benchmarks/auto_plans_probe.py --json $OUT/auto_plans-$1.json > $OUT/auto_plans-$1.txt 2>&1
echo "probe rc=$? at ${SECONDS}s"; python3 -c "
import json; d = json.load(open('$OUT/auto_plans-$1.json'))
for run, r in d.items():
    print(run, {k: r.get(k) for k in ('build_s', 'plans_on_ratio_to_add', 'python_path_ratio_to_add', 'replay_mismatches')})
    for k in ('new_batch_sizes_plans_on', 'new_batch_sizes_plans_off'): print(' ', k, r.get(k))"
timeout 300 bash scripts/gpu_tests.sh -q -rs packages/cp-common/tests/test_launch_plans.py \
    packages/cp-common/tests/test_native_build.py packages/cp-common/tests/test_main.py \
    packages/cp-dcp/tests/ops/test_launch_plans_ops.py packages/cp-common/tests/ops/test_merge_attn_states.py \
    packages/cp-dcp/tests/ops/test_cuda_graph.py packages/cp-dcp/tests/ops/test_launch_fast_path.py \
    packages/cp-common/tests/test_launch.py > $OUT/gpu_tests-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "passed|failed|error" $OUT/gpu_tests-$1.txt | tail -3
grep -E "^(FAILED|ERROR)" $OUT/gpu_tests-$1.txt | head -20
