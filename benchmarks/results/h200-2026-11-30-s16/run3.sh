#!/bin/bash
# Run 3 of the sixteenth session, on the four-GPU kind, commit $1: first the compile / dispatch /
# flag tests of the single-GPU ops (run 2's test step ran out of time before them: they verify
# the check_bool fix under torch 2.11's dynamo), then the collectives at world sizes 2 and 4
# (run.py --skip-kernels; the first world-size-4 rows on GPUs), then the demo at world size 4
# with two query tokens per request if time is left.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
SECONDS=0
timeout 120 bash scripts/gpu_tests.sh -q -rsfE -k "compile or dispatch or bool or opcheck" \
    packages/cp-dcp/tests/ops/test_correct_attn_out.py packages/cp-dcp/tests/ops/test_mask_empty_shards.py \
    packages/cp-common/tests/ops/test_merge_attn_states.py packages/cp-common/tests/test_checks.py \
    packages/cp-dcp/tests/ops/test_launch_plans_ops.py > $OUT/gpu_tests_ops-$1.txt 2>&1
echo "ops tests rc=$? at ${SECONDS}s"; tail -3 $OUT/gpu_tests_ops-$1.txt
timeout $((560 - SECONDS)) python3 benchmarks/run.py --skip-kernels --commit "$1" --time-budget 300 \
    --out $OUT/coll-x4-$1.json --docs-dir $OUT/docs > $OUT/coll-x4-$1.txt 2>&1
echo "collectives rc=$? at ${SECONDS}s"; grep -E 'world size|not run|failed' $OUT/coll-x4-$1.txt | head -8
grep -E 'A2A \(dcp_a2a_lse_reduce\).*graph' $OUT/docs/performance.md | head -12
timeout $((580 - SECONDS)) python3 -m cpattn_testing.demo --backend nccl --world-size 4 \
    --queries-per-request 2 > $OUT/demo-x4-tq2-$1.txt 2>&1
echo "demo ws4 tq=2 rc=$? at ${SECONDS}s"; tail -3 $OUT/demo-x4-tq2-$1.txt
