#!/bin/bash
# Run 5 of the twenty-fourth session (one GPU), commit $1: ftz_probe.py (where a NaN partial
# stops reaching the output of merge_attn_states, correct_attn_out and the A2A unpack: the
# sm_90 PTX has ex2.approx.ftz.f32), then the GPU tests of the files this session's review
# fixes touched.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SECONDS=0
timeout 120 python3 benchmarks/results/h200-2026-12-01-s24/ftz_probe.py > $OUT/ftz_probe-$1.txt 2>&1
echo "probe rc=$? at ${SECONDS}s"; grep -v -i warn $OUT/ftz_probe-$1.txt
timeout $((580 - SECONDS)) bash scripts/gpu_tests.sh -q -rsfE \
    packages/cp-pcp/tests packages/cp-testing/tests/test_reference.py \
    packages/cp-testing/tests/test_bench.py packages/cp-testing/tests/test_forks.py \
    packages/cp-common/tests/ops/test_merge_attn_states.py packages/cp-common/tests/test_group.py \
    packages/cp-dcp/tests/ops/test_correct_attn_out.py packages/cp-dcp/tests/ops/test_mask_empty_shards.py \
    > $OUT/gpu_tests-review-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; tail -1 $OUT/gpu_tests-review-$1.txt
grep -hE '^(FAILED|ERROR)' $OUT/gpu_tests-review-$1.txt | head
