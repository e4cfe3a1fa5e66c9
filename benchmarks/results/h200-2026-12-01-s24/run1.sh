#!/bin/bash
# Run 1 of the twenty-fourth session (one GPU), commit $1: the pinned-host launch-plan test
# (written in session 23, never run), then the unpack's evict_first rule (payload loads
# evict_first on grids of >= 4096 programs with N >= 4 and D <= 256) against no eviction hint
# and evict_first on every large grid (variants.py --ab unpack-evict: B=4096 read-flush timing,
# decode sizes by warm graph replay), then the page's kernel and host rows (benchmarks/run.py).
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
SECONDS=0
timeout 60 bash scripts/gpu_tests.sh -q -rsfE packages/cp-dcp/tests/ops/test_launch_plans_ops.py \
    > $OUT/gpu_tests-launch_plans-$1.txt 2>&1
echo "pinned test rc=$? at ${SECONDS}s"; tail -3 $OUT/gpu_tests-launch_plans-$1.txt
timeout 240 python3 benchmarks/variants.py --ab --ab-only unpack-evict --rounds 2 \
    > $OUT/ab_unpack_evict-$1.txt 2>&1
echo "ab rc=$? at ${SECONDS}s"; grep -v Warning $OUT/ab_unpack_evict-$1.txt
timeout $((585 - SECONDS)) python3 benchmarks/run.py --commit "$1" --out $OUT/bench-$1.json \
    --docs-dir $OUT/docs > $OUT/bench-$1.txt 2>&1
echo "page rc=$? at ${SECONDS}s"; grep -E "not met|incomplete|error" $OUT/docs/performance.md | head -20
grep -E "a2a_unpack_combine" $OUT/docs/performance.md | head -8
