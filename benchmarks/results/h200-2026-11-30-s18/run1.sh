#!/bin/bash
# Run 1 of the eighteenth session, on the two-GPU kind, commit $1: the version-counter bumps of
# the in-place ops (launch plans forced on, so the native replays run), the manager's PCP A2A on
# real nccl ranks (direct A2A where the gate is on), the direct gathers, then the performance
# page on GPU 0 alone (host time of the ops that now bump a version counter).
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CPATTN_CACHE_DIR=/tmp/cpattn_cache_s18
SECONDS=0
CPATTN_LAUNCH_PLANS=1 CUDA_VISIBLE_DEVICES=0 timeout 240 bash scripts/gpu_tests.sh -q -rsfE \
    packages/cp-dcp/tests/ops/test_launch_plans_ops.py packages/cp-dcp/tests/ops/test_correct_attn_out.py \
    packages/cp-dcp/tests/ops/test_mask_empty_shards.py > $OUT/gpu_tests_ops-$1.txt 2>&1 &
unset CPATTN_LAUNCH_PLANS
CUDA_VISIBLE_DEVICES=1 timeout 240 bash scripts/gpu_tests.sh -q -rsfE -k "not multiprocess" \
    packages/cp-dcp/tests/direct/test_direct_gather.py packages/cp-dcp/tests/test_manager.py \
    packages/cp-dcp/tests/test_manager_validation.py packages/cp-pcp/tests/test_heads.py > $OUT/gpu_tests_one-$1.txt 2>&1
wait
echo "one-GPU tests done at ${SECONDS}s"
for f in $OUT/gpu_tests_ops-$1.txt $OUT/gpu_tests_one-$1.txt; do grep -E '^(FAILED|ERROR)' $f | head -10; tail -1 $f; done
timeout 120 bash scripts/gpu_tests.sh -q -rsfE packages/cp-dcp/tests/test_manager.py -k multiprocess \
    > $OUT/gpu_tests_x2-$1.txt 2>&1
echo "two-rank tests rc=$? at ${SECONDS}s"; grep -E '^(FAILED|ERROR)' $OUT/gpu_tests_x2-$1.txt | head; tail -1 $OUT/gpu_tests_x2-$1.txt
CUDA_VISIBLE_DEVICES=0 timeout 230 python3 benchmarks/run.py --commit $1 --out $OUT/bench-$1.json \
    --docs-dir $OUT/docs > $OUT/bench-$1.log 2>&1
echo "page rc=$? at ${SECONDS}s"; tail -3 $OUT/bench-$1.log
