"""Time the masked LSE copy of the AG combines (``masked_lse_copy``) on a GPU (dev tool).

The AG+RS / AG+AR combines copy this rank's LSE with empty-shard rows set to -inf before the
all-gather. This prints one JSON line per case: LSE dtype, ``B``, ``H``, the CUDA-graph replay
time of one call (µs, 32 calls per graph on rotating inputs), and at ``B = 4096`` the
``do_bench`` median with a cold L2 (µs). Run it against two source trees to A/B a kernel change:

    PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-testing/src \
        python3 benchmarks/masked_copy.py --tag new
"""

from __future__ import annotations

import argparse
import json

import torch

import cpattn_testing.bench as hb
from cpattn_dcp.ops.mask_empty_shards import masked_lse_copy

_SETS = 32


def _case(dtype: torch.dtype, batch: int, heads: int) -> dict[str, object]:
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(batch * heads)
    # Two queries per request, every third request's shard empty, two padding rows.
    requests = max(1, (batch - 2) // 2)
    seq_lens = torch.arange(requests, device=device, dtype=torch.int32) % 3
    counts = torch.full((requests,), 2, device=device, dtype=torch.int32)
    counts[-1] = batch - 2 * (requests - 1) - min(2, batch - 1)
    qsl = torch.zeros(requests + 1, device=device, dtype=torch.int32)
    qsl[1:] = counts.cumsum(0)
    lses = [torch.randn(batch, heads, device=device, generator=gen).to(dtype) for _ in range(_SETS)]
    fns = [lambda x=x: masked_lse_copy(x, seq_lens, qsl) for x in lses]
    graph_us = hb.time_cuda_graph(fns).median_ms * 1e3
    row: dict[str, object] = {
        "dtype": str(dtype).removeprefix("torch."),
        "B": batch,
        "H": heads,
        "graph_us": round(graph_us, 3),
    }
    if batch >= 4096:
        cold_ms = hb.time_do_bench(fns[0], rep_ms=200.0).median_ms
        row["do_bench_us"] = round(cold_ms * 1e3, 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tag", default="", help="a label copied into every line")
    args = parser.parse_args()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for batch in (1, 64, 4096):
            for heads in (16, 128):
                print(json.dumps({"tag": args.tag, **_case(dtype, batch, heads)}), flush=True)


if __name__ == "__main__":
    main()
