#!/bin/bash
# Run 2 of the thirteenth session (one GPU), commit $1: the page (the lean correct_attn_out
# kernel's LSE offsets became int64; the same-size graph copy now holds the rows' call count),
# then the default-mode launch-plan probe (cold and warm cache).
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
SECONDS=0
timeout 300 python3 benchmarks/run.py --commit "$1" --out $OUT/bench-$1.json --docs-dir $OUT/docs \
    > $OUT/bench-$1.txt 2>&1
echo "page rc=$? at ${SECONDS}s"; grep -E "correct_attn_out|unpack|pack" $OUT/docs/performance.md | grep -E "4096" | head -20
timeout 200 python3 benchmarks/auto_plans_probe.py --json $OUT/auto_plans-$1.json > $OUT/auto_plans-$1.txt 2>&1
echo "probe rc=$? at ${SECONDS}s"; python3 -c "
import json; d = json.load(open('$OUT/auto_plans-$1.json'))
for run, r in d.items():
    print(run, {k: r.get(k) for k in ('build_s', 'plans_on_us', 'add_us', 'plans_on_ratio_to_add', 'python_path_ratio_to_add', 'replay_mismatches')})
    for k in ('new_batch_sizes_plans_on', 'new_batch_sizes_plans_off'): print(' ', k, r.get(k))"
