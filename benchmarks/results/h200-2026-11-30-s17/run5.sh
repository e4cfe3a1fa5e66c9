#!/bin/bash
# Run 5 of the seventeenth session (one GPU), commit $1: the page's kernel and host figures
# after the session's changes (must_dispatch also asks torch.jit's tracing state; the in-place
# ops and the merge check more on their dispatched path only).
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
SECONDS=0
timeout 400 python3 benchmarks/run.py --commit "$1" --out $OUT/bench-$1.json \
    --docs-dir $OUT/docs > $OUT/bench-$1.txt 2>&1
echo "page rc=$? at ${SECONDS}s"; grep -E "not met|incomplete|error" $OUT/docs/performance.md | head -20
grep -E "host overhead \(the default path" $OUT/docs/performance.md | head -8
