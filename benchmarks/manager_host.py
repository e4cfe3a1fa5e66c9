"""Host time of ``DCPManager``'s own Python per call (dev tool, CPU).

The collectives, the direct workspaces' launches and the combine ops are replaced by stubs, so
what is timed is the manager's dispatch: its argument checks, the workspace's
``unsupported_reason`` and the path choice. Two simulated ranks on the CPU, bf16, H_r=16, D=512
(query and KV rows 576 wide), 8 tokens; best of five loops of 20 000 calls. Run it on two trees
to compare (``PYTHONPATH`` pointing at each), alternating, and take the minimum of several runs:
the 2-core development machine spreads single runs by up to 2x.

    PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src \
        python3 benchmarks/manager_host.py
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from cpattn_dcp import manager as manager_mod
from cpattn_dcp.direct import (
    DirectDCPA2AWorkspace,
    DirectDCPKVGatherWorkspace,
    DirectDCPQGatherWorkspace,
)
from cpattn_dcp.manager import DCPConfig, DCPManager
from cpattn_testing.simulated import SimulatedWorld

H_R, D, D_Q, T = 16, 512, 576, 8


def per_call_us(fn: Callable[[], object], calls: int = 20_000, loops: int = 5) -> float:
    for _ in range(500):
        fn()
    best = float("inf")
    for _ in range(loops):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def _stub_everything() -> None:
    """No communication and no kernel: every path returns at once."""
    manager_mod.cp_lse_ag_out_rs = lambda out, lse, group, **kw: out  # type: ignore[assignment]
    manager_mod.direct_gather_unavailable_reason = lambda *a, **k: None  # type: ignore[assignment]
    manager_mod.get_direct_dcp_q_gather_workspace = (  # type: ignore[assignment]
        lambda g, dev, t, hr, dq, dt, u, p, use: DirectDCPQGatherWorkspace(
            g, dev, t, hr, dq, dt, u, p, require_multicast=False
        )
    )
    manager_mod.get_direct_dcp_kv_gather_workspace = (  # type: ignore[assignment]
        lambda g, dev, cap, dk, dt, u, use: DirectDCPKVGatherWorkspace(
            g, dev, cap, dk, dt, u, require_multicast=False
        )
    )

    def no_launch(self: Any, *args: Any, **kwargs: Any) -> None:
        return None

    def no_q_launch(self: Any, query: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return query

    # The launches only: each gather's own argument check is timed where it still runs.
    DirectDCPA2AWorkspace.lse_reduce = no_launch  # type: ignore[method-assign,assignment]
    DirectDCPQGatherWorkspace.publish = no_launch  # type: ignore[method-assign,assignment]
    DirectDCPQGatherWorkspace.wait = no_q_launch  # type: ignore[method-assign,assignment]
    DirectDCPKVGatherWorkspace.publish = no_launch  # type: ignore[method-assign,assignment]
    DirectDCPKVGatherWorkspace.wait = no_launch  # type: ignore[method-assign,assignment]


def main() -> None:
    _stub_everything()
    world = SimulatedWorld(2, torch.device("cpu"))
    bf16 = torch.bfloat16
    direct_cfg = DCPConfig(comm_backend="a2a", use_direct_a2a=True, max_num_tokens=T)
    direct = world.run(
        lambda g: DCPManager(
            direct_cfg, g, "cpu", H_R, D, bf16, query_head_dim=D_Q, kv_token_dim=D_Q,
            max_gathered_kv_tokens=4096,
        )
    )[0]  # fmt: skip
    nccl = world.run(lambda g: DCPManager(DCPConfig(), g, "cpu", H_R, D, bf16))[0]
    out = torch.zeros(T, 2 * H_R, D, dtype=bf16)
    lse = torch.zeros(T, 2 * H_R)
    query = torch.zeros(T, H_R, D_Q, dtype=bf16)
    gathered = torch.zeros(4096, D_Q, dtype=bf16)
    local = torch.zeros(64, D_Q, dtype=bf16)
    rows = {
        "combine, ag_rs (op stubbed)": lambda: nccl.combine(out, lse),
        "combine, direct A2A": lambda: direct.combine(out, lse),
        "query_gather, direct": lambda: direct.query_gather(query),
        "kv_gather, direct": lambda: direct.kv_gather(gathered, local),
    }
    for name, fn in rows.items():
        print(f"{name:30s} {per_call_us(fn):6.2f} us")


if __name__ == "__main__":
    main()
