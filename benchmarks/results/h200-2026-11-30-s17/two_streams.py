"""Two micro-batches on two CUDA streams through one direct A2A workspace (world size 2, nccl).

Question: can the spinning wait programs of one ubatch fill the GPU so that the other ubatch's
publish is never scheduled, on both ranks at once (rank 0 launches ubatch 0 first, rank 1
ubatch 1 first)? Each case builds a fresh workspace (a timed-out one is unusable), runs
``iters`` rounds and reports whether any bounded wait timed out. ``same`` is the control: both
ranks launch ubatch 0 first.

Run: python two_streams.py OUT.json
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from cpattn_common.ubatch import ubatch_context
from cpattn_dcp.direct import DirectDCPA2AWorkspace, DirectProtocolError
from cpattn_testing.launcher import run_distributed

H_R, D = 16, 128


def body(rank: int, world_size: int, max_spins: int, iters: int) -> list[dict[str, Any]]:
    device = torch.device("cuda", torch.cuda.current_device())
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    rows: list[dict[str, Any]] = []
    for t in (64, 512, 1024, 2048, 4096):
        for order in ("same", "crossed"):
            ws = DirectDCPA2AWorkspace(
                dist.group.WORLD, device, t, H_R, D, torch.bfloat16, 2, max_spins=max_spins
            )
            gen = torch.Generator(device="cpu").manual_seed(rank)
            out = torch.randn(t, world_size * H_R, D, generator=gen).to(device, torch.bfloat16)
            lse = torch.randn(t, world_size * H_R, generator=gen).to(device)
            first = 1 if (order == "crossed" and rank == 1) else 0
            ubatches = (first, 1 - first)
            dist.barrier()
            torch.cuda.synchronize()
            start = time.perf_counter()
            error = None
            try:
                for _ in range(iters):
                    for u in ubatches:
                        with torch.cuda.stream(streams[u]), ubatch_context(u):
                            ws.lse_reduce(out, lse)
                    torch.cuda.synchronize()
                ws.check_error()
            except DirectProtocolError as exc:
                error = str(exc)[:300]
            torch.cuda.synchronize()
            rows.append(
                {
                    "t": t,
                    "order": order,
                    "timed_out": error is not None,
                    "error": error,
                    "seconds": round(time.perf_counter() - start, 3),
                }
            )
            ws.close()
            dist.barrier()
    return rows


def main() -> None:
    path = sys.argv[1]
    reports = run_distributed(body, 2, backend="nccl", args=(1 << 20, 50), timeout=500.0)
    props = torch.cuda.get_device_properties(0)
    result = {
        "device": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "ranks": reports,
    }
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    for rank, rows in enumerate(reports):
        for r in rows:
            print(rank, r)


if __name__ == "__main__":
    main()
