#!/bin/bash
# Run 2 of the twelfth session (one GPU), commit $1: every GPU test of the four packages (the
# launch-plan review fixes, the manager fallbacks, tp_inner), in two pytest processes on the GPU,
# then the default-mode launch-plan probe (cold and warm cache) for the replay cost after the
# review (the current device in every key, a context check per replay).
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
SECONDS=0
timeout 420 bash scripts/gpu_tests.sh -q -rs --durations=8 packages/cp-dcp/tests \
    > $OUT/gpu_tests-dcp-$1.txt 2>&1 &
A=$!
timeout 420 bash scripts/gpu_tests.sh -q -rs --durations=8 packages/cp-common/tests \
    packages/cp-pcp/tests packages/cp-testing/tests > $OUT/gpu_tests-rest-$1.txt 2>&1 &
B=$!
wait $A; echo "cp-dcp rc=$? at ${SECONDS}s"; tail -1 $OUT/gpu_tests-dcp-$1.txt
wait $B; echo "rest rc=$? at ${SECONDS}s"; tail -1 $OUT/gpu_tests-rest-$1.txt
grep -hE "^(FAILED|ERROR)" $OUT/gpu_tests-*-$1.txt | head -30
timeout 200 python3 benchmarks/auto_plans_probe.py --json $OUT/auto_plans-$1.json > $OUT/auto_plans-$1.txt 2>&1
echo "probe rc=$? at ${SECONDS}s"; python3 -c "
import json; d = json.load(open('$OUT/auto_plans-$1.json'))
for run, r in d.items():
    print(run, {k: r.get(k) for k in ('build_s', 'plans_on_us', 'add_us', 'plans_on_ratio_to_add', 'python_path_ratio_to_add', 'replay_mismatches')})
    for k in ('new_batch_sizes_plans_on', 'new_batch_sizes_plans_off'): print(' ', k, r.get(k))"
