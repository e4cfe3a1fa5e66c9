"""A vLLM call site passing its ``GroupCoordinator`` as is, on real process groups.

``GroupCoordinator`` below mimics vLLM's (``world_size``, ``rank_in_group``, ``device_group``,
``cpu_group``, ``all_gather`` / ``reduce_scatter`` / ``all_reduce``, no ``all_to_all_single``).
Every call site (the three combines, the Q/KV gathers, ``DCPManager`` construction and its
combine / gathers, cpattn_pcp's gathers) must give bit for bit what the same call with the
coordinator's ``device_group`` gives, without calling the coordinator's own collectives. A
coordinator or a wrapper whose size or rank disagrees with its process group is refused on
every rank before any collective (so no rank is left waiting). One launch per world size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from cpattn_common import CPGroup, as_cp_group, shared_cp_group
from cpattn_dcp import (
    DCPConfig,
    DCPManager,
    cp_lse_ag_out_ar,
    cp_lse_ag_out_rs,
    dcp_a2a_lse_reduce,
    dcp_gather_kv,
    dcp_gather_query,
)
from cpattn_pcp import maybe_all_gather_q_for_dcp, maybe_gather_mla_latent_cache_inputs
from cpattn_testing.cases import make_dcp_decode_case
from cpattn_testing.launcher import POISON_ENV, NotEnoughDevicesError, run_distributed


class GroupCoordinator:
    """Shaped like vLLM's ``GroupCoordinator``; its collectives work, and count their calls."""

    def __init__(
        self,
        device_group: Any,
        cpu_group: Any,
        world_size: int | None = None,
        rank: int | None = None,
    ) -> None:
        self.device_group = device_group
        self.cpu_group = cpu_group
        self.world_size = dist.get_world_size(device_group) if world_size is None else world_size
        self.rank_in_group = dist.get_rank(device_group) if rank is None else rank
        self.rank = dist.get_rank()
        self.ranks = dist.get_process_group_ranks(device_group)
        self.unique_name = "dcp:0"
        self.calls: list[str] = []

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        self.calls.append("all_gather")
        parts = [torch.empty_like(input_) for _ in range(self.world_size)]
        dist.all_gather(parts, input_.contiguous(), group=self.device_group)
        return torch.cat(parts, dim)

    def reduce_scatter(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        self.calls.append("reduce_scatter")
        total = input_.clone()
        dist.all_reduce(total, group=self.device_group)
        return total.chunk(self.world_size, dim)[self.rank_in_group].contiguous()

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        self.calls.append("all_reduce")
        dist.all_reduce(input_, group=self.device_group)
        return input_


class OffByOne(CPGroup):
    """Our own wrapper, one of whose rank metadata disagrees with its process group."""

    def __init__(self, pg: Any, world_size: int, rank: int) -> None:
        super().__init__(pg)
        self._world_size, self._rank_in_group = world_size, rank


class OutOfRange:
    """A ``CPGroupLike`` of its own whose rank is outside ``[0, world_size)``; records calls."""

    device_group = None

    def __init__(self) -> None:
        self.world_size, self.rank_in_group = 2, 2
        self.calls: list[str] = []

    def _record(self, *args: Any) -> Any:
        self.calls.append("collective")

    all_gather = reduce_scatter = all_reduce = _record
    all_to_all_single = all_gather_into_tensor = barrier = _record


def _tensors(x: Any) -> list[torch.Tensor]:
    return [t for item in x for t in _tensors(item)] if isinstance(x, (tuple, list)) else [x]


def _same_bits(a: Any, b: Any) -> bool:
    """Equal shapes, dtypes, strides and bit patterns (NaN payloads included)."""
    ta, tb = _tensors(a), _tensors(b)
    return len(ta) == len(tb) and all(
        x.shape == y.shape
        and x.dtype == y.dtype
        and x.stride() == y.stride()
        and x.cpu().contiguous().view(torch.uint8).equal(y.cpu().contiguous().view(torch.uint8))
        for x, y in zip(ta, tb, strict=True)
    )


def _call_sites(rank: int, n: int, device: torch.device) -> dict[str, Callable[[Any], Any]]:
    """Each call site as vLLM makes it, as a function of the group argument."""
    h_r, d, dtype = 2, 32, torch.bfloat16
    case = make_dcp_decode_case(
        seq_lens=[5, 1, 0, 9], world_size=n, num_heads=n * h_r, head_dim=d, padding_rows=2,
        dtype=dtype, device=device, seed=11,
    )  # fmt: skip
    out, lse = case.rank_inputs(rank)
    masks = {"seq_lens": case.local_seq_lens[rank], "query_start_loc": case.query_start_loc}
    gen = torch.Generator().manual_seed(rank)
    query = torch.randn(3, h_r, 48, generator=gen).to(device, dtype)
    local_kv = torch.randn(4, 40, generator=gen).to(device, dtype)
    kv_c, k_pe = (torch.randn(5, w, generator=gen).to(device) for w in (16, 8))
    slots = torch.arange(n * 5, dtype=torch.int64, device=device)  # rank-major [N, T]; T = 5

    def combine(op: Any) -> Callable[[Any], Any]:
        return lambda g: op(out, lse, g, return_lse=True, **masks)

    def manager(config: DCPConfig) -> Callable[[Any], Any]:
        def run(g: Any) -> Any:
            m = DCPManager(
                config, g, device, h_r, d, dtype, query_head_dim=48, padded_num_heads=4 * n
            )
            got = [*m.combine(out, lse, return_lse=True, **masks)]
            if m.has_query_gather:
                got.append(m.query_gather(query))
            buf = torch.zeros(n * 4 + 1, 40, dtype=dtype, device=device)
            return [*got, m.kv_gather(buf, local_kv)]

        return run

    return {
        "cp_lse_ag_out_rs": combine(cp_lse_ag_out_rs),
        "cp_lse_ag_out_ar": combine(cp_lse_ag_out_ar),
        "dcp_a2a_lse_reduce": combine(dcp_a2a_lse_reduce),
        "dcp_gather_query": lambda g: dcp_gather_query(query, g),
        "dcp_gather_query padded": lambda g: dcp_gather_query(query, g, padded_num_heads=4 * n),
        "dcp_gather_kv": lambda g: dcp_gather_kv(
            torch.zeros(n * 4, 40, dtype=dtype, device=device), local_kv, g
        ),
        "DCPManager ag_rs": manager(DCPConfig()),
        "DCPManager a2a": manager(DCPConfig(comm_backend="a2a")),
        "DCPManager pcp": manager(DCPConfig(use_pcp=True)),
        "maybe_gather_mla_latent_cache_inputs": lambda g: maybe_gather_mla_latent_cache_inputs(
            kv_c, k_pe, slots, 2, True, pcp_group=g
        ),
        "maybe_all_gather_q_for_dcp": lambda g: maybe_all_gather_q_for_dcp(
            query, n, 1, dcp_group=g
        ),
    }


def _refusal(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except (TypeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def coordinator_ranks(rank: int, n: int) -> dict[str, Any]:
    """Runs on every rank: every call site with the process group and with the coordinator,
    then the objects that must be refused."""
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    pg = dist.group.WORLD
    coordinator = GroupCoordinator(pg, dist.new_group(backend="gloo"))
    sites = _call_sites(rank, n, device)
    mismatches = [
        name for name, call in sites.items() if not _same_bits(call(coordinator), call(pg))
    ]
    # Wrong metadata: the same decision on every rank, so every rank raises and none waits.
    bad: dict[str, Any] = {
        "coordinator world_size": GroupCoordinator(pg, None, world_size=n + 1),
        "coordinator rank": GroupCoordinator(pg, None, rank=(rank + 1) % n),
        "wrapper world_size": OffByOne(pg, n + 1, rank),
        "wrapper rank": OffByOne(pg, n, (rank + 1) % n),
        "wrapper rank out of range": OffByOne(pg, n, n),
    }
    refusals: dict[str, list[str]] = {}
    for what, group in bad.items():
        resolvers: dict[str, Callable[[], Any]] = {
            "as_cp_group": lambda g=group: as_cp_group(g),
            "shared_cp_group": lambda g=group: shared_cp_group(g),
        }
        resolvers.update({name: lambda c=call, g=group: c(g) for name, call in sites.items()})
        refusals[what] = [f"{name}: {_refusal(fn)}" for name, fn in resolvers.items()]
    # The group still works: no rank was left inside a collective.
    alive = as_cp_group(coordinator).all_reduce(torch.ones(1, device=device))
    return {
        "sites": sorted(sites),
        "mismatches": mismatches,
        "own_calls": coordinator.calls + [c for g in bad.values() for c in getattr(g, "calls", [])],
        "wrapped": type(as_cp_group(coordinator)).__name__,
        "shared_is_pg_wrapper": shared_cp_group(coordinator) is shared_cp_group(pg),
        "refusals": refusals,
        "alive": alive.item(),
    }


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"world{n}")
def results(request: pytest.FixtureRequest, dist_backend: str) -> list[dict[str, Any]]:
    try:
        return run_distributed(
            coordinator_ranks, request.param, dist_backend, timeout=300.0, env={POISON_ENV: "nan"}
        )
    except NotEnoughDevicesError as exc:
        pytest.skip(str(exc))


def test_every_call_site_matches_the_process_group_bit_for_bit(
    results: list[dict[str, Any]],
) -> None:
    for rank, r in enumerate(results):
        assert len(r["sites"]) == 11, r["sites"]
        assert r["mismatches"] == [], f"rank {rank}"
        assert r["wrapped"] == "CPGroup"
        assert r["shared_is_pg_wrapper"]
        assert r["alive"] == len(results)


def test_the_coordinator_own_collectives_are_not_called(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["own_calls"] == []


@pytest.mark.parametrize(
    ("what", "message"),
    [
        ("coordinator world_size", r"GroupCoordinator.world_size is {n1}, but its device_group "
         r"has {n} ranks"),
        ("coordinator rank", r"GroupCoordinator.rank_in_group is {r1}, but this process is rank "
         r"{r} of its device_group"),
        ("wrapper world_size", r"OffByOne.world_size is {n1}, but its device_group has {n} ranks"),
        ("wrapper rank", r"OffByOne.rank_in_group is {r1}, but this process is rank {r}"),
        ("wrapper rank out of range", r"OffByOne.rank_in_group is {n}, outside \[0, "
         r"world_size={n}\)"),
    ],
)  # fmt: skip
def test_metadata_disagreeing_with_the_process_group_is_refused_everywhere(
    results: list[dict[str, Any]], what: str, message: str
) -> None:
    """Issue: a wrapper whose rank is outside ``[0, world_size)`` read another rank's LSE
    slot out of bounds; one whose size or rank disagreed with its process group combined the
    wrong heads. Every resolver and every call site raises ``ValueError`` instead."""
    import re

    n = len(results)
    for rank, r in enumerate(results):
        want = message.format(n=n, n1=n + 1, r=rank, r1=(rank + 1) % n)
        lines = r["refusals"][what]
        assert len(lines) == 2 + 11
        for line in lines:
            assert re.search(f": ValueError: {want}", line), line


def test_a_wrapper_rank_out_of_range_is_refused_before_any_collective(device: torch.device) -> None:
    """The combines read LSE slot ``rank_in_group`` of the gathered ``[N, B, H]``: a rank >= N
    read out of bounds. Every call site now raises before the group sees a call."""
    for name, call in _call_sites(0, 2, device).items():
        group = OutOfRange()
        with pytest.raises(ValueError, match=r"OutOfRange.rank_in_group is 2, outside \[0, wor"):
            call(group)
        assert group.calls == [], name
