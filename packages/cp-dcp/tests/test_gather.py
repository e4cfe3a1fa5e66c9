"""NCCL-path query and KV gathers: simulated ranks (threads) and one real multi-process run."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

from cpattn_dcp.gather import dcp_gather_kv, dcp_gather_query, reserve_query_head_storage
from cpattn_testing.pytest_plugin import RunRanks
from cpattn_testing.simulated import SimulatedWorld


def _queries(
    n: int, t: int, h_r: int, d: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(100 * n + t)
    return torch.randn(t, n * h_r, d, generator=gen).to(device, dtype)


def test_reserve_query_head_storage(device: torch.device) -> None:
    q = torch.randn(3, 24, 576, device=device).to(torch.bfloat16)
    out = reserve_query_head_storage(q, 128)
    assert out.shape == q.shape
    assert out.stride() == (24 * 576, 576, 1)
    assert out.storage_offset() == 0
    assert out.untyped_storage().nbytes() >= 3 * 128 * 576 * 2
    assert torch.equal(out, q)
    with pytest.raises(ValueError, match="padded_num_heads 23 < query heads 24"):
        reserve_query_head_storage(q, 23)
    with pytest.raises(ValueError, match=r"\[T, H, D\]"):
        reserve_query_head_storage(q[0], 128)


@pytest.mark.parametrize(("n", "padded"), [(2, None), (3, 16), (1, None), (1, 8)], ids=str)
def test_gather_query_simulated(device: torch.device, n: int, padded: int | None) -> None:
    t, h_r, d = 3, 2, 8
    full = _queries(n, t, h_r, d, torch.float16, device)
    world = SimulatedWorld(n, device)

    def body(g: Any) -> torch.Tensor:
        r = g.rank_in_group
        # Non-contiguous local query (head slice of the full tensor) is accepted.
        return dcp_gather_query(full[:, r * h_r : (r + 1) * h_r], g, padded)

    for out in world.run(body):
        assert out.shape == (t, n * h_r, d)
        assert out.is_contiguous()
        assert torch.equal(out, full)
        if padded is not None:
            assert out.untyped_storage().nbytes() >= t * padded * d * out.element_size()


def test_gather_query_single_rank_returns_packed_rows(device: torch.device) -> None:
    """N = 1 without padding: a strided query (the head slice of a fused QKV projection, token
    stride 3*H*D) comes back contiguous, as from every other path; a contiguous one as is."""
    t, h, d = 3, 4, 8
    qkv = torch.randn(t, 3 * h * d, device=device)
    q = qkv[:, : h * d].view(t, h, d)
    assert not q.is_contiguous()
    packed = q.contiguous()
    world = SimulatedWorld(1, device)
    [(out, same)] = world.run(lambda g: (dcp_gather_query(q, g), dcp_gather_query(packed, g)))
    assert out.is_contiguous()
    assert torch.equal(out, q)
    assert same is packed  # no copy


def test_gather_query_rejects_too_few_padded_heads(device: torch.device) -> None:
    world = SimulatedWorld(2, device)
    with pytest.raises(ValueError, match="padded_num_heads 3 < gathered heads"):
        world.run(lambda g: dcp_gather_query(torch.zeros(1, 2, 8, device=device), g, 3))


@pytest.mark.parametrize("padded", [8.0, True, "8"])
@pytest.mark.parametrize("n", [1, 2])
def test_gather_query_refuses_a_padded_head_count_that_is_not_an_int(
    device: torch.device, n: int, padded: object
) -> None:
    """A float went on to ``torch.empty`` (an undocumented ``TypeError`` there) and ``True``
    read as one head."""
    query = torch.zeros(1, 2, 8, device=device)
    world = SimulatedWorld(n, device)
    with pytest.raises(TypeError, match="padded_num_heads must be an int"):
        world.run(lambda g: dcp_gather_query(query, g, padded))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="padded_num_heads must be an int"):
        reserve_query_head_storage(query, padded)  # type: ignore[arg-type]


def test_gather_kv_simulated(device: torch.device) -> None:
    n, t, d = 3, 2, 8
    gen = torch.Generator(device="cpu").manual_seed(9)
    local = torch.randn(n, t, d, generator=gen).to(device, torch.bfloat16)
    world = SimulatedWorld(n, device)

    def body(g: Any) -> torch.Tensor:
        buf = torch.full((n * t + 2, d), float("nan"), device=device, dtype=torch.bfloat16)
        view = dcp_gather_kv(buf, local[g.rank_in_group], g)
        assert view.data_ptr() == buf.data_ptr()
        assert view.shape == (n * t, d)
        assert torch.isnan(buf[n * t :]).all()  # rows past N*T untouched
        return view.clone()

    for out in world.run(body):
        assert torch.equal(out, local.reshape(n * t, d))


def test_gather_kv_validation(device: torch.device) -> None:
    world = SimulatedWorld(2, device)
    local = torch.zeros(3, 8, device=device)
    cases = [
        (torch.zeros(5, 8, device=device), "needs N\\*T = 2\\*3 = 6"),
        (torch.zeros(6, 4, device=device), "row shapes differ"),
        (torch.zeros(6, 8, device=device, dtype=torch.float16), "share dtype"),
        (torch.zeros(8, 6, device=device).t(), "row shapes differ|contiguous"),
    ]
    for buf, match in cases:
        with pytest.raises(ValueError, match=match):
            world.run(lambda g, b=buf: dcp_gather_kv(b, local, g))


def _rank_device() -> torch.device:
    """This rank's device: its current GPU on nccl, the CPU on gloo."""
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _dist_body(rank: int, world_size: int) -> dict[str, bool]:
    import torch.distributed as dist

    from cpattn_common.group import as_cp_group
    from cpattn_dcp.gather import dcp_gather_kv, dcp_gather_query

    group = dist.group.WORLD
    device = _rank_device()
    t, h_r, d = 3, 2, 16
    full = _queries(world_size, t, h_r, d, torch.bfloat16, device)
    mine = full[:, rank * h_r : (rank + 1) * h_r]
    results = {}
    results["query"] = torch.equal(dcp_gather_query(mine, group), full)
    padded = dcp_gather_query(mine, as_cp_group(group), padded_num_heads=world_size * h_r + 4)
    results["query_padded"] = torch.equal(padded, full)
    local = full[:, 0, :] + rank
    buf = torch.empty(world_size * t, d, device=device, dtype=torch.bfloat16)
    dcp_gather_kv(buf, local, group)
    results["kv"] = all(
        torch.equal(buf[s * t : (s + 1) * t], full[:, 0, :] + s) for s in range(world_size)
    )
    # A lazily negated buffer (torch's negative bit): c10d wrote into a resolved copy of it,
    # so the caller's buffer kept its zeros.
    raw = torch.zeros(world_size * t, d, device=device, dtype=torch.bfloat16)
    negated = dcp_gather_kv(torch._neg_view(raw), local, group)
    results["kv_negated_buffer"] = all(
        torch.equal(negated[s * t : (s + 1) * t], full[:, 0, :] + s) for s in range(world_size)
    )
    return results


def test_gathers_multiprocess(run_ranks: RunRanks) -> None:
    """One real process-group launch (gloo on CPU, nccl on GPU) covering both gathers."""
    for res in run_ranks(_dist_body, 2):
        assert res == {
            "query": True, "query_padded": True, "kv": True, "kv_negated_buffer": True,
        }  # fmt: skip


_NO_GRAD = r"call it under torch.no_grad\(\) / torch.inference_mode\(\), or pass detached tensors"


def _grad_error(name: str, arg: str) -> str:
    return rf"^{name}: {arg} requires grad, but {name} exchanges data between ranks.*{_NO_GRAD}"


def test_gathers_refuse_grad_on_one_rank(device: torch.device) -> None:
    """With grad on, an input that requires grad raises before anything runs, also at N = 1
    (where the old code returned the query itself, or a view with an AsStridedBackward0), so a
    script tried on one rank does not start failing on two. Under no_grad nothing changes."""
    world = SimulatedWorld(1, device)
    q = torch.randn(3, 2, 8, device=device, requires_grad=True)
    local = torch.randn(3, 8, device=device, requires_grad=True)
    buf = torch.zeros(3, 8, device=device, requires_grad=True) * 1.0  # a non-leaf
    for padded in (None, 8):
        with pytest.raises(RuntimeError, match=_grad_error("dcp_gather_query", "query")):
            world.run(lambda g, p=padded: dcp_gather_query(q, g, p))
    with pytest.raises(RuntimeError, match=_grad_error("dcp_gather_kv", "local_kv")):
        world.run(lambda g: dcp_gather_kv(torch.empty(3, 8, device=device), local, g))
    with pytest.raises(RuntimeError, match=_grad_error("dcp_gather_kv", "gathered_kv")):
        world.run(lambda g: dcp_gather_kv(buf, local.detach(), g))

    def no_grad_body(g: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        with torch.no_grad():  # in the rank's thread: grad mode is thread-local
            return dcp_gather_query(q, g), dcp_gather_query(q, g, 8), dcp_gather_kv(buf, local, g)

    [(out, padded_out, kv)] = world.run(no_grad_body)
    assert torch.equal(out, q.detach())
    assert torch.equal(padded_out, q.detach())
    assert torch.equal(kv, local.detach())


def _grad_body(rank: int, world_size: int) -> dict[str, object]:
    import torch.distributed as dist

    from cpattn_dcp.gather import dcp_gather_kv, dcp_gather_query

    group = dist.group.WORLD
    device = _rank_device()
    t, h_r, d = 3, 2, 8
    full = _queries(world_size, t, h_r, d, torch.float32, device)
    mine = full[:, rank * h_r : (rank + 1) * h_r].clone().requires_grad_()
    local = (full[:, 0, :] + rank).requires_grad_()
    calls: dict[str, Callable[[], torch.Tensor]] = {
        "query": lambda: dcp_gather_query(mine, group),
        "query_padded": lambda: dcp_gather_query(mine, group, world_size * h_r + 4),
        "kv_local": lambda: dcp_gather_kv(
            torch.empty(world_size * t, d, device=device), local, group
        ),
        "kv_buffer": lambda: dcp_gather_kv(
            torch.zeros(world_size * t, d, device=device, requires_grad=True) * 1.0,
            local.detach(),
            group,
        ),
    }
    results: dict[str, object] = {}
    for name, call in calls.items():
        try:
            out = call()
            results[name] = f"no error: requires_grad={out.requires_grad}"
        except RuntimeError as exc:
            results[name] = str(exc)
    with torch.no_grad():
        ok_query = torch.equal(dcp_gather_query(mine, group), full)
        ok_padded = torch.equal(dcp_gather_query(mine, group, world_size * h_r + 4), full)
        buf = torch.empty(world_size * t, d, device=device)
        out = dcp_gather_kv(buf, local, group)
        ok_kv = not out.requires_grad and all(
            torch.equal(buf[s * t : (s + 1) * t], full[:, 0, :] + s) for s in range(world_size)
        )
    results["no_grad"] = (ok_query, ok_padded, ok_kv)
    return results


def test_gathers_refuse_grad_multiprocess(run_ranks: RunRanks) -> None:
    """Two real ranks: the old code failed inside gloo's all-gather ("A view was created in
    no_grad mode and is being modified inplace...") or returned a result that required grad
    through a grad_fn ignoring the other ranks (``AsStridedBackward0`` for the KV gather)."""
    for res in run_ranks(_grad_body, 2):
        for name, arg in [
            ("query", "query"),
            ("query_padded", "query"),
            ("kv_local", "local_kv"),
            ("kv_buffer", "gathered_kv"),
        ]:
            fn = "dcp_gather_query" if name.startswith("query") else "dcp_gather_kv"
            assert re.search(_grad_error(fn, arg), str(res[name])), (name, res[name])
        assert res["no_grad"] == (True, True, True)
