"""bench_collectives' eager and CUDA-graph timing paths on one nccl rank (world size 1).

A plumbing check of ``_median_event_ms`` after its refactor (seventh session), not a
measurement: run from the repository root on a one-GPU machine.
"""

import sys

sys.path.insert(0, "benchmarks")

import bench_collectives as bc

from cpattn_testing.launcher import run_distributed

if __name__ == "__main__":
    cfg = {"shapes": [(64, 128)], "bs": [1, 64], "iters": 20, "reps": 3}
    for fn in (bc._rank_main, bc._rank_graph_main):
        for r in run_distributed(fn, 1, "nccl", args=(cfg,), timeout=80)[0]:
            print(fn.__name__, r["op"], "B", r["B"], r["status"], r.get("latency_us"))
