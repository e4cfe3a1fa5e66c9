#!/bin/bash
# Run 3 of the nineteenth session, on the four-GPU kind, commit $1: the collectives at world
# sizes 2 and 4 (run.py --skip-kernels), for the page's Collectives table (it showed the
# sixteenth session's 5eab7d9; the combines' dispatch and the A2A registered ops changed since).
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
SECONDS=0
timeout 400 python3 benchmarks/run.py --skip-kernels --commit "$1" --time-budget 300 \
    --out $OUT/coll-x4-$1.json --docs-dir $OUT/docs > $OUT/coll-x4-$1.txt 2>&1
echo "collectives rc=$? at ${SECONDS}s"; grep -E 'world size|not run|failed' $OUT/coll-x4-$1.txt | head -8
