#!/bin/bash
# Run 2 of the eighth session (one GPU), commit $1 (the mask's decode tiles): the refined mask
# sweep (shipped setting first), the page, bench_collectives' CUDA timing paths on one nccl
# rank (world size 1: a plumbing check of _median_event_ms, not a measurement), GPU tests.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SECONDS=0
timeout 120 python3 benchmarks/variants.py --mask --rounds 2 > $OUT/mask_sweep2.txt 2>&1
echo "sweep rc=$? at ${SECONDS}s"; cut -c1-330 $OUT/mask_sweep2.txt
timeout 200 python3 benchmarks/run.py --commit "$1" --out $OUT/bench-$1.json --docs-dir $OUT/docs \
    > $OUT/bench-$1.txt 2>&1
echo "page rc=$? at ${SECONDS}s"; grep -E '^\| `mask|^\| `a2a_pack' $OUT/docs/performance.md | head -4
timeout 90 python3 - > $OUT/collectives_ws1.txt 2>&1 <<'PY'
import sys
sys.path.insert(0, "benchmarks")
import bench_collectives as bc
from cpattn_testing.launcher import run_distributed
cfg = {"shapes": [(64, 128)], "bs": [1, 64], "iters": 20, "reps": 3}
for fn in (bc._rank_main, bc._rank_graph_main):
    for r in run_distributed(fn, 1, "nccl", args=(cfg,), timeout=80)[0]:
        print(fn.__name__, r["op"], "B", r["B"], r["status"], r.get("latency_us"))
PY
echo "collectives ws1 rc=$? at ${SECONDS}s"; tail -4 $OUT/collectives_ws1.txt
timeout $((560 - SECONDS)) bash scripts/gpu_tests.sh -q -rs packages/cp-dcp/tests/ops/test_mask_empty_shards.py \
    packages/cp-dcp/tests/ops/test_a2a_kernels.py packages/cp-dcp/tests/ops/test_cuda_graph.py \
    packages/cp-dcp/tests/test_manager.py > $OUT/gpu_tests-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; tail -3 $OUT/gpu_tests-$1.txt
