"""End-to-end context-parallel attention check: ``python -m cpattn_testing.demo``.

The demo launches ``--world-size`` ranks (gloo on the CPU by default, ``--backend nccl`` with one
GPU per rank) through :func:`cpattn_testing.launcher.run_distributed` and drives the public ops of
``cpattn_dcp`` and ``cpattn_pcp`` the way a serving engine would, checking every result against
float64 full attention computed from the same inputs:

1. **DCP decode** of an MLA-shaped layer (one latent KV head, ``Dk = head_dim + rope_dim``,
   ``Dv = head_dim``) and a GQA-shaped layer (``kv_heads`` KV heads). The KV of ragged requests is
   sharded across the ranks (interleaved); short requests leave some ranks with an empty shard.
   Each request has ``--queries-per-request`` query tokens, the last ones of its sequence
   (speculative decoding when more than one), attending causally. Each rank computes its partial
   attention ``out [B, H, Dv]`` / ``lse [B, H]`` in float64 against its shard's keys at their
   global positions, cast to the chosen dtype (a speculative row all of whose shard keys lie in
   its future gets output 0 and LSE -inf); empty shards and CUDA-graph padding rows get NaN
   outputs and garbage LSE, as a real backend would produce. Every combine then runs: ``ag_rs``
   (:func:`cpattn_dcp.cp_lse_ag_out_rs`), ``ag_ar`` (:func:`cpattn_dcp.cp_lse_ag_out_ar`),
   ``a2a`` (:func:`cpattn_dcp.dcp_a2a_lse_reduce`), ``direct`` (the symmetric-memory
   workspace) where the capability gate allows it, else a "skipped: <reason>" line, and
   ``manager``: a whole layer step through ``DCPManager`` (query-head gather, local attention
   of the gathered query, the combine the manager selects).
2. **PCP prefill**: DualChunkSwap split of ragged prompts, cache-input gathers (each rank must end
   with the complete KV cache), global Q/K/V gather, per-rank causal attention of the rank's own
   query rows, output sliced back to the local layout.

It prints one table row per path (path, ranks, dtype, relative error, tolerance, result, time per
call) and exits with status 1 if any path mismatches, naming the path. ``--json`` writes the same
results as JSON.

A path that raises on any rank ends the whole run at once (its peers may wait in a collective
that rank will never join): the launcher stops every rank, and the demo prints that rank's
traceback (the original exception, chained to a :class:`PathFailure` naming the path and the
rank) on stderr and a ``FAILED: <path> raised on rank <r>: ...`` line, and exits 1.

Exit status: 0 all checked paths passed (skips allowed; at least one checked), 1 a mismatch, a
path that raised on some rank, or every selected path skipped, 2 bad command-line arguments (or
``--backend gloo`` without Triton's interpreter: its ranks run on the CPU), 3
the ranks could not be run (launcher error: a crash, the ``--timeout``, a failure outside the
paths).

Test hook (not in ``--help``): ``CPATTN_DEMO_PLANT_FAULT=<patterns>`` (or ``--plant-fault``),
comma-separated ``fnmatch`` patterns, plants a fault into every path whose name matches: rank
0's partial LSE is raised by 2 before the combine (a wrong weight, for DCP paths), or rank 0's
first local key and value rows are perturbed before the gather (for PCP paths). The demo must
then fail, naming each such path. ``CPATTN_DEMO_PLANT_RAISE=<PATTERN[@RANK],...>`` (or
``--plant-raise``) makes that rank (default: the last) raise at the start of each matching path,
before its collectives; the run must then stop within seconds, naming the path and the rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import functools
import json
import math
import os
import re
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TextIO, TypeVar

import torch

if TYPE_CHECKING:
    from cpattn_testing.launcher import DistributedError

PLANT_FAULT_ENV = "CPATTN_DEMO_PLANT_FAULT"
PLANT_RAISE_ENV = "CPATTN_DEMO_PLANT_RAISE"
_T = TypeVar("_T")

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}

# The order rows appear in; the demo runs them in this order on every rank.
DCP_COMBINES = ("ag_rs", "ag_ar", "a2a", "direct", "manager")
LAYERS = ("mla", "gqa")
PCP_PATHS = ("pcp/mla/cache_gather", "pcp/gqa/cache_gather", "pcp/prefill")


def all_path_names() -> list[str]:
    """Every path the demo knows, in run order (``dcp/<layer>/<combine>``, then ``pcp/...``)."""
    names = [f"dcp/{layer}/{combine}" for layer in LAYERS for combine in DCP_COMBINES]
    return [*names, *PCP_PATHS]


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Everything a rank needs; built from the command line in the parent, pickled to ranks."""

    world_size: int = 4
    backend: str = "gloo"
    dtype: str = "bfloat16"
    num_heads: int = 8
    head_dim: int = 64
    rope_dim: int = 16
    kv_heads: int = 2
    batch: int = 4
    queries_per_request: int = 1
    max_seq_len: int = 40
    padding_rows: int = 2
    interleave_size: int = 1
    prefill_batch: int = 4
    max_prompt_len: int = 24
    decode_rows: int = 2
    seed: int = 0
    repeats: int = 0
    only: tuple[str, ...] = ()
    plant_fault: str | None = None
    plant_raise: str | None = None
    verbose_progress: bool = True

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def selected(self, path: str) -> bool:
        """Whether ``--only`` keeps ``path`` (no patterns = every path)."""
        return not self.only or any(fnmatch.fnmatchcase(path, p) for p in self.only)

    def faulty(self, path: str) -> bool:
        """Whether the hidden test hook plants a fault into ``path``."""
        if not self.plant_fault:
            return False
        patterns = [p.strip() for p in self.plant_fault.split(",") if p.strip()]
        return any(fnmatch.fnmatchcase(path, p) for p in patterns)

    def raises(self, path: str, rank: int) -> bool:
        """Whether the hidden test hook makes ``rank`` raise in ``path`` (``PATTERN[@RANK]``
        entries; no rank = the last rank)."""
        for entry in (self.plant_raise or "").split(","):
            pattern, _, on = entry.strip().partition("@")
            target = int(on) if on.strip() else self.world_size - 1
            if pattern and target == rank and fnmatch.fnmatchcase(path, pattern):
                return True
        return False


@dataclasses.dataclass
class RankRecord:
    """One rank's measurements of one path (summed over ranks by the parent)."""

    path: str
    status: str  # "ran" | "skipped" | "error"
    reason: str = ""
    diff_sq: float = 0.0
    ref_sq: float = 0.0
    nonfinite: int = 0
    exact: bool = False
    times_s: list[float] = dataclasses.field(default_factory=list)
    note: str = ""


@dataclasses.dataclass
class PathResult:
    """The verdict for one path after aggregating every rank's record."""

    path: str
    ranks: int
    dtype: str
    status: str  # "pass" | "fail" | "skipped"
    rel_err: float | None
    tol: float | None
    time_per_call_ms: float | None
    reason: str = ""
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if self.rel_err is not None and not math.isfinite(self.rel_err):
            data["rel_err"] = str(self.rel_err)
        return data


# --------------------------------------------------------------------------------------------
# Helpers shared by the rank body
# --------------------------------------------------------------------------------------------


class _Progress:
    """Progress lines on stderr, written by rank 0 only (ranks share the parent's stderr)."""

    def __init__(self, total: int, enabled: bool, stream: TextIO = sys.stderr) -> None:
        self.total = total
        self.done = 0
        self.enabled = enabled
        self.stream = stream

    def step(self, path: str) -> None:
        self.done += 1
        if self.enabled:
            width = len(str(self.total))
            self.stream.write(f"  [{self.done:>{width}}/{self.total}] {path}\n")
            self.stream.flush()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _error_terms(actual: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, int]:
    """(sum of squared error, sum of squared reference, non-finite count where ref is finite)."""
    if actual.shape != ref.shape:
        raise ValueError(f"result shape {tuple(actual.shape)} != reference {tuple(ref.shape)}")
    a = actual.detach().to("cpu", torch.float64)
    r = ref.detach().to("cpu", torch.float64)
    finite_ref = torch.isfinite(r)
    bad = finite_ref & ~torch.isfinite(a)
    ok = finite_ref & torch.isfinite(a)
    diff = torch.where(ok, a - r, torch.zeros_like(a))
    rr = torch.where(finite_ref, r, torch.zeros_like(r))
    return float((diff * diff).sum()), float((rr * rr).sum()), int(bad.sum())


def _timed(fn: Callable[[], _T], repeats: int, device: torch.device) -> tuple[_T, list[float]]:
    """Run ``fn`` once for the result, then ``repeats`` more times for the timing.

    With ``repeats == 0`` the timing is that of the checked call itself (first-call costs
    included). Each repeat must return bit for bit what the checked call did (a path whose
    later calls go wrong, such as a stale epoch of a direct path, fails): ``RuntimeError``
    otherwise.
    """
    _sync(device)
    start = time.perf_counter()
    result = fn()
    _sync(device)
    times = [time.perf_counter() - start]
    if repeats > 0:
        times = []
    for i in range(repeats):
        start = time.perf_counter()
        again = fn()
        _sync(device)
        times.append(time.perf_counter() - start)
        if not _same_result(again, result):
            raise RuntimeError(f"call {i + 2} returned other values than the checked first call")
    return result, times


def _same_result(a: object, b: object) -> bool:
    """Bit-for-bit equality of two results (tensors, or tuples of them and plain values); NaN
    equals NaN."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same_result(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return (
            a.shape == b.shape
            and a.dtype == b.dtype
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
    return type(a) is type(b) and bool(a == b)


def _interpreted() -> bool:
    from cpattn_common.interpret import triton_interpreting

    return triton_interpreting()


def _rank_device(backend: str) -> torch.device:
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# --------------------------------------------------------------------------------------------
# DCP decode
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _DecodeProblem:
    """One decode step of one layer, as seen by one rank.

    ``query [B, H, Dk]`` (dtype; padding rows random) is the whole query of the step;
    ``partial_out [B, H, Dv]`` (dtype) and ``partial_lse [B, H]`` (float32) are this rank's
    partial attention of that query over its KV shard; ``ref_out [B, H, Dv]`` and ``ref_lse
    [B, H]`` (float64) are full attention over the whole KV (padding rows: 0 and -inf);
    ``local_seq_lens [R]`` / ``query_start_loc [R+1]`` (int32) drive empty-shard masking.
    ``shards`` keeps this rank's ``(k, v)`` per request (float64) and ``shard_positions`` their
    global key positions (int64), ``seq_lens`` the global KV length of each request, so that
    the partial can be recomputed from a gathered query (:meth:`partials`).

    Attention is causal: the ``queries_per_request`` (tq) query tokens of a request with ``S``
    KV tokens are the last tq tokens of its sequence (speculative decoding when tq > 1), query
    token j at position ``S - tq + j`` sees the keys at positions ``<= S - tq + j``.
    """

    query: torch.Tensor
    partial_out: torch.Tensor
    partial_lse: torch.Tensor
    ref_out: torch.Tensor
    ref_lse: torch.Tensor
    local_seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    shards: list[tuple[torch.Tensor, torch.Tensor]]
    shard_positions: list[torch.Tensor]
    seq_lens: list[int]
    queries_per_request: int
    padding_rows: int
    scale: float
    dtype: torch.dtype
    rank: int

    def partials(self, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(out [B, H, Dv] dtype, lse [B, H] fp32)`` for ``query [B, H, Dk]``.

        Causal attention in float64 against the local shard (its keys at their global
        positions), as a backend would compute it. A query row that sees none of the shard's
        keys (an early speculative row whose shard keys all lie in its future) gets output 0
        and LSE -inf, as a kernel does for a fully masked row; rows of empty shards get NaN
        outputs and garbage LSEs (``0``, ``+inf`` or NaN by request and rank, so that each kind
        occurs), CUDA graph padding rows NaN outputs and LSE ``0``.
        """
        from cpattn_testing.reference import attention_ref

        q64 = query.detach().to("cpu", torch.float64)
        tq = self.queries_per_request
        h = q64.shape[1]
        dv = self.shards[0][1].shape[-1]
        outs: list[torch.Tensor] = []
        lses: list[torch.Tensor] = []
        for req, ((k, v), pos) in enumerate(zip(self.shards, self.shard_positions, strict=True)):
            q = q64[req * tq : (req + 1) * tq]
            if k.shape[0] == 0:
                outs.append(torch.full((tq, h, dv), float("nan"), dtype=torch.float64))
                garbage = (0.0, float("inf"), float("nan"))[(req + self.rank) % 3]
                lses.append(torch.full((tq, h), garbage, dtype=torch.float64))
            else:
                o, lse = attention_ref(
                    q,
                    k,
                    v,
                    scale=self.scale,
                    causal=True,
                    q_pos=_query_positions(self.seq_lens[req], tq),
                    k_pos=pos,
                )
                outs.append(o)
                lses.append(lse)
        for _ in range(self.padding_rows):
            outs.append(torch.full((1, h, dv), float("nan"), dtype=torch.float64))
            lses.append(torch.zeros(1, h, dtype=torch.float64))
        dev = query.device
        return (
            torch.cat(outs).to(dev, self.dtype),
            torch.cat(lses).to(dev, torch.float32),
        )


def _query_positions(seq_len: int, queries_per_request: int) -> torch.Tensor:
    """Global positions ``[tq]`` of a request's query tokens: the last tq of its ``seq_len``."""
    return torch.arange(seq_len - queries_per_request, seq_len)


def decode_seq_lens(cfg: DemoConfig) -> list[int]:
    """Ragged KV lengths of the decode batch; the first requests are short on purpose.

    Every request holds at least ``queries_per_request`` (tq) KV tokens, its query tokens
    being the last tq of its sequence. Request 0 has ``tq`` KV tokens (with tq = 1 only rank 0
    holds any of it; with tq > 1 its first query row sees key 0 only, so the keys of the other
    ranks that hold any all lie in that row's future), request 1 has ``N - 1`` interleave
    blocks (the last rank's shard is empty) or ``tq`` if more; the rest are random in
    ``[max(tq, N * I), max_seq_len]``. No length exceeds ``max(max_seq_len, tq)``.
    """
    n, inter, tq = cfg.world_size, cfg.interleave_size, cfg.queries_per_request
    top = max(cfg.max_seq_len, tq)
    gen = torch.Generator().manual_seed(cfg.seed + 17)
    lens: list[int] = []
    for i in range(cfg.batch):
        if i == 0:
            lens.append(tq)
        elif i == 1 and n > 1:
            lens.append(max(tq, min((n - 1) * inter, top)))
        else:
            lo = max(tq, min(n * inter, top))
            lens.append(int(torch.randint(lo, top + 1, (1,), generator=gen)))
    return lens


def _layer_dims(cfg: DemoConfig, layer: str) -> tuple[int, int, int]:
    """``(Hkv, Dk, Dv)``: MLA is one latent KV head with a rope part; GQA ``kv_heads`` heads."""
    if layer == "mla":
        return 1, cfg.head_dim + cfg.rope_dim, cfg.head_dim
    return cfg.kv_heads, cfg.head_dim, cfg.head_dim


def _make_decode_problem(
    cfg: DemoConfig, layer: str, rank: int, device: torch.device
) -> _DecodeProblem:
    from cpattn_testing.reference import attention_ref, interleaved_shard_positions

    n, h = cfg.world_size, cfg.num_heads
    kv_heads, dk, dv = _layer_dims(cfg, layer)
    dtype = cfg.torch_dtype
    scale = 1.0 / math.sqrt(dk)
    tq = cfg.queries_per_request
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + (1 if layer == "mla" else 2))
    seq_lens = decode_seq_lens(cfg)
    rows = len(seq_lens) * tq + cfg.padding_rows
    # The query is rounded to the dtype first: a gathered query is then bit-identical to it.
    query = (torch.randn(rows, h, dk, generator=gen, dtype=torch.float64) * 1.5).to(dtype)
    q64 = query.to(torch.float64)

    refs: list[torch.Tensor] = []
    ref_lses: list[torch.Tensor] = []
    shards: list[tuple[torch.Tensor, torch.Tensor]] = []
    positions: list[torch.Tensor] = []
    local_lens: list[int] = []
    for req, s in enumerate(seq_lens):
        k = torch.randn(s, kv_heads, dk, generator=gen, dtype=torch.float64)
        if layer == "mla":
            v = k[..., :dv]  # the latent is both key (with rope part) and value
        else:
            v = torch.randn(s, kv_heads, dv, generator=gen, dtype=torch.float64)
        q = q64[req * tq : (req + 1) * tq]
        q_pos = _query_positions(s, tq)
        ref, ref_lse = attention_ref(q, k, v, scale=scale, causal=True, q_pos=q_pos)
        refs.append(ref)
        ref_lses.append(ref_lse)
        pos = interleaved_shard_positions(s, n, rank, cfg.interleave_size)
        local_lens.append(int(pos.numel()))
        shards.append((k[pos], v[pos]))
        positions.append(pos)
    refs.append(torch.zeros(cfg.padding_rows, h, dv, dtype=torch.float64))  # padding rows: 0
    ref_lses.append(torch.full((cfg.padding_rows, h), -math.inf, dtype=torch.float64))
    qsl = [i * tq for i in range(len(seq_lens) + 1)]
    prob = _DecodeProblem(
        query=query.to(device),
        partial_out=torch.empty(0),
        partial_lse=torch.empty(0),
        ref_out=torch.cat(refs),
        ref_lse=torch.cat(ref_lses),
        local_seq_lens=torch.tensor(local_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        shards=shards,
        shard_positions=positions,
        seq_lens=seq_lens,
        queries_per_request=tq,
        padding_rows=cfg.padding_rows,
        scale=scale,
        dtype=dtype,
        rank=rank,
    )
    prob.partial_out, prob.partial_lse = prob.partials(prob.query)
    return prob


def _direct_workspace(
    cfg: DemoConfig, group: Any, device: torch.device, prob: _DecodeProblem
) -> tuple[Any | None, str]:
    """The direct A2A workspace (auto gating), or ``(None, reason)`` when the gate says no.

    Gating and construction are collective: every rank calls this in the same order.
    """
    from cpattn_dcp.direct import (
        direct_a2a_unavailable_reason,
        get_direct_dcp_a2a_workspace,
    )

    dtype = cfg.torch_dtype
    reason = direct_a2a_unavailable_reason(group, dtype, None, device=device)
    if reason is not None:
        return None, reason
    b, h, d = prob.partial_out.shape
    ws = get_direct_dcp_a2a_workspace(
        group,
        device,
        max_num_tokens=b,
        heads_per_rank=h // cfg.world_size,
        head_dim=d,
        dtype=dtype,
        num_ubatches=1,
        use_direct=None,
    )
    if ws is None:
        return None, "the capability gate returned no direct workspace"
    return ws, ""


def _run_dcp_path(
    cfg: DemoConfig,
    layer: str,
    combine: str,
    group: Any,
    rank: int,
    device: torch.device,
    prob: _DecodeProblem,
) -> RankRecord:
    import cpattn_dcp

    path = f"dcp/{layer}/{combine}"
    n = cfg.world_size
    h = prob.partial_out.shape[1]
    hr = h // n
    lse_in = prob.partial_lse
    if cfg.faulty(path) and rank == 0:
        lse_in = lse_in + 2.0  # a wrong weight for rank 0's partial
    seq_lens, qsl = prob.local_seq_lens, prob.query_start_loc

    # The three NCCL combines share one signature; AG+AR returns all heads, the others this
    # rank's H/N.
    collective = {
        "ag_rs": cpattn_dcp.cp_lse_ag_out_rs,
        "ag_ar": cpattn_dcp.cp_lse_ag_out_ar,
        "a2a": cpattn_dcp.dcp_a2a_lse_reduce,
    }.get(combine)
    heads = slice(None) if combine == "ag_ar" else slice(rank * hr, (rank + 1) * hr)
    if collective is not None:

        def call() -> tuple[torch.Tensor, torch.Tensor]:
            return collective(
                prob.partial_out.clone(),
                lse_in.clone(),
                group,
                return_lse=True,
                seq_lens=seq_lens,
                query_start_loc=qsl,
            )

    elif combine == "direct":
        ws, reason = _direct_workspace(cfg, group, device, prob)
        if ws is None:
            return RankRecord(path, "skipped", reason=reason)

        def call() -> tuple[torch.Tensor, torch.Tensor]:
            return ws.lse_reduce(  # type: ignore[no-any-return]
                prob.partial_out.clone(),
                lse_in.clone(),
                is_lse_base_on_e=True,
                seq_lens=seq_lens,
                query_start_loc=qsl,
                return_lse=True,
            )

    elif combine == "manager":
        return _run_manager_path(cfg, path, group, rank, device, prob)

    else:  # pragma: no cover - guarded by all_path_names()
        raise ValueError(f"unknown combine {combine!r}")

    (out, lse), times = _timed(call, cfg.repeats, device)
    diff_sq, ref_sq, bad = _error_terms(out, prob.ref_out[:, heads])
    lse_error = _lse_error(lse, prob.ref_lse[:, heads])
    if lse_error:
        return RankRecord(path, "error", reason=f"rank {rank}: {lse_error}")
    return RankRecord(path, "ran", diff_sq=diff_sq, ref_sq=ref_sq, nonfinite=bad, times_s=times)


def _lse_error(lse: torch.Tensor, ref_lse: torch.Tensor) -> str:
    """Why a combine's global LSE ``[B, H_r]`` (fp32) is not the reference's (``""`` if it
    is): fp32 tolerance on a scale of ``|ref| + 2`` (a merged LSE carries an absolute error
    of about ``eps * (|m| + 1)``, ``m`` the largest partial LSE, within ``log N`` of it); -inf
    exactly where the reference is (padding rows)."""
    from cpattn_testing.tolerances import assert_close_to_ref

    ref64 = ref_lse.detach().to("cpu", torch.float64)
    scale = torch.where(torch.isfinite(ref64), ref64.abs(), 0.0) + 2.0
    try:
        assert_close_to_ref(lse.detach().cpu(), ref64, dtype=torch.float32, scale=scale)
    except AssertionError as exc:
        return "LSE " + str(exc).splitlines()[0] + " " + " ".join(str(exc).splitlines()[1:3])
    return ""


def _run_manager_path(
    cfg: DemoConfig,
    path: str,
    group: Any,
    rank: int,
    device: torch.device,
    prob: _DecodeProblem,
) -> RankRecord:
    """A whole decode layer step through ``DCPManager`` (``comm_backend="auto"``).

    Each rank starts with its ``H/N`` query heads, gathers all heads through the manager,
    attends them to its KV shard, and lets the manager combine (direct A2A where the gate
    allows it, else the NCCL A2A): the result is this rank's ``H/N`` heads of full attention.
    """
    from cpattn_dcp import DCPConfig, DCPManager

    b, h, dk = prob.query.shape
    n = cfg.world_size
    hr = h // n
    dv = prob.ref_out.shape[2]
    manager = DCPManager(
        DCPConfig(comm_backend="auto", max_num_tokens=b),
        group,
        device,
        num_heads=hr,
        head_dim=dv,
        dtype=cfg.torch_dtype,
        query_head_dim=dk,
    )
    q_local = prob.query[:, rank * hr : (rank + 1) * hr].contiguous()
    seq_lens, qsl = prob.local_seq_lens, prob.query_start_loc
    faulty = cfg.faulty(path) and rank == 0

    def layer_step() -> tuple[torch.Tensor, torch.Tensor]:
        q_all = manager.query_gather(q_local)  # [B, H, Dk], rank-major heads
        out, lse = prob.partials(q_all)
        if faulty:
            lse = lse + 2.0
        combined = manager.combine(
            out, lse, seq_lens=seq_lens, query_start_loc=qsl, return_lse=True
        )
        assert isinstance(combined, tuple)
        return combined

    result, result_lse = layer_step()
    lse_error = _lse_error(result_lse, prob.ref_lse[:, rank * hr : (rank + 1) * hr])
    if lse_error:
        return RankRecord(path, "error", reason=f"rank {rank}: {lse_error}")
    out_in, lse_in = prob.partial_out, prob.partial_lse

    def library_ops() -> torch.Tensor:
        manager.query_gather(q_local)
        combined = manager.combine(
            out_in.clone(), lse_in.clone(), seq_lens=seq_lens, query_start_loc=qsl
        )
        assert isinstance(combined, torch.Tensor)
        return combined

    # The timed calls combine the same partials (the gathered query is bit-identical to the
    # original): the first must equal the checked layer step, and _timed holds the rest to it.
    first, times = _timed(library_ops, max(cfg.repeats, 1), device)
    if not _same_result(first, result):
        reason = f"rank {rank}: the timed calls returned other values than the checked layer step"
        return RankRecord(path, "error", reason=reason)
    ref = prob.ref_out[:, rank * hr : (rank + 1) * hr]
    diff_sq, ref_sq, bad = _error_terms(result, ref)
    note = f"combine={manager.last_combine_path}, query_gather={manager.last_query_gather_path}"
    return RankRecord(
        path, "ran", diff_sq=diff_sq, ref_sq=ref_sq, nonfinite=bad, times_s=times, note=note
    )


# --------------------------------------------------------------------------------------------
# PCP prefill
# --------------------------------------------------------------------------------------------


def prompt_lens(cfg: DemoConfig) -> list[int]:
    """Ragged prompt lengths, including 1 and a length shorter than ``2 * world_size``; none
    longer than ``max_prompt_len`` (``--max-prompt-len 1``: every prompt has one token)."""
    top = cfg.max_prompt_len
    gen = torch.Generator().manual_seed(cfg.seed + 29)
    lens: list[int] = []
    for i in range(cfg.prefill_batch):
        if i == 0:
            lens.append(1)
        elif i == 1:
            lens.append(max(1, min(2 * cfg.world_size - 1, top)))
        else:
            lens.append(int(torch.randint(min(2, top), top + 1, (1,), generator=gen)))
    return lens


@dataclasses.dataclass
class _PrefillData:
    """Global prompt tensors in float64, global token order: ``q [T, H, Dk]``, ``k``/``v``."""

    seq_lens: list[int]
    cu: list[int]
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scale: float


def _make_prefill_data(cfg: DemoConfig, layer: str) -> _PrefillData:
    lens = prompt_lens(cfg)
    total = sum(lens)
    if layer == "mla":
        kv_heads, dk, dv = 1, cfg.head_dim + cfg.rope_dim, cfg.head_dim
    else:
        kv_heads, dk, dv = cfg.kv_heads, cfg.head_dim, cfg.head_dim
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + (3 if layer == "mla" else 4))
    q = torch.randn(total, cfg.num_heads, dk, generator=gen, dtype=torch.float64) * 1.5
    k = torch.randn(total, kv_heads, dk, generator=gen, dtype=torch.float64)
    v = torch.randn(total, kv_heads, dv, generator=gen, dtype=torch.float64)
    cu = [0]
    for s in lens:
        cu.append(cu[-1] + s)
    return _PrefillData(lens, cu, q, k, v, 1.0 / math.sqrt(dk))


def _local_rows(plan: Any, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(global token index per local row, real-token mask) of ``rank`` under ``plan``, on CPU.

    Padding rows get global index 0 (any valid row) and mask False.
    """
    real = plan.local_is_real[rank].to("cpu", torch.bool)
    idx = plan.local_token_idx[rank].to("cpu", torch.long).clamp(min=0)
    return idx, real


def _run_pcp_cache(
    cfg: DemoConfig, layer: str, group: Any, rank: int, device: torch.device
) -> RankRecord:
    """Mixed batch (replicated decode rows first, then this rank's prefill rows) → cache rows."""
    import cpattn_pcp

    path = f"pcp/{layer}/cache_gather"
    data = _make_prefill_data(cfg, layer)
    total = data.cu[-1]
    nd = cfg.decode_rows
    dtype = cfg.torch_dtype
    gen = torch.Generator().manual_seed(cfg.seed + 41)
    dec_k = torch.randn(nd, *data.k.shape[1:], generator=gen, dtype=torch.float64)
    dec_v = torch.randn(nd, *data.v.shape[1:], generator=gen, dtype=torch.float64)
    # Slots: decode rows first, then every prompt token, scattered over a larger cache.
    num_slots = 2 * (total + nd) + 3
    perm = torch.randperm(num_slots, generator=gen)[: total + nd]
    dec_slots, tok_slots = perm[:nd], perm[nd:]

    plan = cpattn_pcp.dual_chunk_swap(data.seq_lens, cfg.world_size, device=device)
    idx, _ = _local_rows(plan, rank)
    loc_k = data.k[idx]
    loc_v = data.v[idx]
    if cfg.faulty(path) and rank == 0:
        loc_k = loc_k.clone()
        loc_k[0] = -loc_k[0] + 1.0
    key = torch.cat([dec_k, loc_k]).to(device, dtype)
    value = torch.cat([dec_v, loc_v]).to(device, dtype)
    # The expanded slot mapping is rank-major [N * T_local]: entry r*T + i is the slot of local
    # row i of rank r (decode rows replicated; -1 = padding, not written).
    per_rank: list[torch.Tensor] = []
    for r in range(cfg.world_size):
        r_idx, r_real = _local_rows(plan, r)
        r_slots = torch.where(r_real, tok_slots[r_idx], torch.full_like(r_idx, -1))
        per_rank.append(torch.cat([dec_slots, r_slots]))
    slot_mapping = torch.cat(per_rank).to(device, torch.long)

    if layer == "mla":
        # MLA caches the normalized latent (kv_c_normed) and the rope key part (k_pe).
        dv = cfg.head_dim
        kv_c = key[:, 0, :dv].contiguous()
        k_pe = key[:, :, dv:].contiguous()  # [T, 1, rope_dim]

        def call() -> tuple[torch.Tensor, ...]:
            out = cpattn_pcp.maybe_gather_mla_latent_cache_inputs(
                kv_c, k_pe, slot_mapping, nd, True, pcp_group=group
            )
            return tuple(out)

        def rows(out: tuple[torch.Tensor, ...]) -> torch.Tensor:
            c, pe, _ = out
            return torch.cat([c.reshape(c.shape[0], -1), pe.reshape(pe.shape[0], -1)], dim=1)

        width = cfg.head_dim + cfg.rope_dim
        ref_rows = torch.cat([dec_k, data.k]).reshape(nd + total, -1)[:, :width]
    else:

        def call() -> tuple[torch.Tensor, ...]:
            out = cpattn_pcp.maybe_gather_kv_cache_inputs(
                key, value, slot_mapping, nd, True, pcp_group=group
            )
            return tuple(out)

        def rows(out: tuple[torch.Tensor, ...]) -> torch.Tensor:
            kk, vv, _ = out
            return torch.cat([kk.reshape(kk.shape[0], -1), vv.reshape(vv.shape[0], -1)], dim=1)

        ref_rows = torch.cat(
            [
                torch.cat([dec_k, data.k]).reshape(nd + total, -1),
                torch.cat([dec_v, data.v]).reshape(nd + total, -1),
            ],
            dim=1,
        )

    out, times = _timed(call, cfg.repeats, device)

    # Write the returned rows at the returned slots (-1 = skip), as a cache write would.
    got_rows = rows(out).to("cpu", torch.float64)
    got_slots = out[-1].to("cpu", torch.long)
    cache = torch.full((num_slots, got_rows.shape[1]), float("nan"), dtype=torch.float64)
    keep = got_slots >= 0
    cache[got_slots[keep]] = got_rows[keep]
    expected = torch.full_like(cache, float("nan"))
    expected[torch.cat([dec_slots, tok_slots])] = ref_rows.to(dtype).to(torch.float64)
    written = torch.isfinite(expected[:, 0])
    missing = int((written & ~torch.isfinite(cache[:, 0])).sum())
    extra = int((~written & torch.isfinite(cache[:, 0])).sum())
    diff_sq, ref_sq, bad = _error_terms(cache[written], expected[written])
    reason = f"{missing} cache rows missing, {extra} unexpected" if missing or extra else ""
    return RankRecord(
        path,
        "ran",
        reason=reason,
        diff_sq=diff_sq,
        ref_sq=ref_sq,
        nonfinite=bad + missing + extra,
        exact=True,
        times_s=times,
    )


def _run_pcp_prefill(cfg: DemoConfig, group: Any, rank: int, device: torch.device) -> RankRecord:
    """DualChunkSwap split → global Q/K/V gather → own-row causal attention → local slice."""
    import cpattn_pcp
    from cpattn_testing.reference import attention_ref

    path = "pcp/prefill"
    data = _make_prefill_data(cfg, "gqa")
    dtype = cfg.torch_dtype
    plan = cpattn_pcp.dual_chunk_swap(data.seq_lens, cfg.world_size, device=device)
    idx, real = _local_rows(plan, rank)
    loc_k, loc_v = data.k[idx], data.v[idx]
    if cfg.faulty(path) and rank == 0:
        loc_k, loc_v = loc_k.clone(), loc_v.clone()
        loc_k[0] = -loc_k[0] + 1.0
        loc_v[0] = -loc_v[0] + 3.0
    q = data.q[idx].to(device, dtype)
    k = loc_k.to(device, dtype)
    v = loc_v.to(device, dtype)
    num_actual = int(idx.numel())
    owned = idx[real]
    total = data.cu[-1]

    def attend(qg: torch.Tensor, kg: torch.Tensor, vg: torch.Tensor) -> torch.Tensor:
        """Causal attention of this rank's own rows only; other rows stay NaN."""
        out = torch.full(
            (total, qg.shape[1], vg.shape[2]), float("nan"), dtype=dtype, device=qg.device
        )
        for r, s in enumerate(data.seq_lens):
            lo, hi = data.cu[r], data.cu[r] + s
            mine = owned[(owned >= lo) & (owned < hi)]
            if mine.numel() == 0:
                continue
            o, _ = attention_ref(
                qg[mine.to(qg.device)].double(),
                kg[lo:hi].double(),
                vg[lo:hi].double(),
                scale=data.scale,
                causal=True,
                q_pos=(mine - lo).to(qg.device),
                k_pos=torch.arange(s, device=qg.device),
            )
            out[mine.to(qg.device)] = o.to(dtype)
        return out

    # Time the library ops only (the per-rank attention stands in for a real kernel).
    qkv = cpattn_pcp.gather_prefill_qkv_global(plan, q, k, v, pcp_group=group)
    out_g = attend(*qkv)

    def library_ops() -> torch.Tensor:
        cpattn_pcp.gather_prefill_qkv_global(plan, q, k, v, pcp_group=group)
        return cpattn_pcp.slice_prefill_output_local(plan, out_g, num_actual, pcp_group=group)

    local_out, times = _timed(library_ops, cfg.repeats, device)

    ref = torch.empty(total, cfg.num_heads, data.v.shape[2], dtype=torch.float64)
    for r, s in enumerate(data.seq_lens):
        lo, hi = data.cu[r], data.cu[r] + s
        ref[lo:hi], _ = attention_ref(
            data.q[lo:hi], data.k[lo:hi], data.v[lo:hi], scale=data.scale, causal=True
        )
    got = local_out[: idx.numel()].to("cpu")[real]
    diff_sq, ref_sq, bad = _error_terms(got, ref[owned])
    return RankRecord(path, "ran", diff_sq=diff_sq, ref_sq=ref_sq, nonfinite=bad, times_s=times)


# --------------------------------------------------------------------------------------------
# The rank body
# --------------------------------------------------------------------------------------------


class PathFailure(RuntimeError):
    """A path raised on one rank; chained to (``from``) the original exception.

    It ends the whole run rather than becoming a failed row: the other ranks may already wait
    in a collective of that path which this rank will never join, and a rank that went on would
    pair its next collective with theirs. The launcher stops every rank as soon as one raises
    and hands this rank's traceback to :func:`main`, which reports the path, the rank and the
    original exception.
    """


# How PathFailure's line reads in the rank's formatted traceback (see _path_failure).
_PATH_FAILURE_RE = re.compile(
    r"^(?:[\w.]+\.)?PathFailure: (?P<path>\S+) raised on rank (?P<rank>\d+): (?P<what>.*)$",
    re.MULTILINE,
)


def _run_path(cfg: DemoConfig, path: str, rank: int, fn: Callable[[], RankRecord]) -> RankRecord:
    """Run one path on this rank; an exception is re-raised as :class:`PathFailure`."""
    try:
        if cfg.raises(path, rank):
            raise RuntimeError(f"planted failure in {path} on rank {rank}")
        return fn()
    except Exception as exc:
        lines = str(exc).strip().splitlines()
        what = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
        raise PathFailure(f"{path} raised on rank {rank}: {what}") from exc


def rank_main(rank: int, world_size: int, cfg: DemoConfig) -> list[dict[str, Any]]:
    """The body every rank runs (module level so the launcher can pickle it)."""
    import torch.distributed as dist

    from cpattn_common.alloc import set_output_poison
    from cpattn_common.group import as_cp_group

    if world_size != cfg.world_size:
        raise ValueError(f"launched with world_size={world_size}, config says {cfg.world_size}")
    device = _rank_device(cfg.backend)
    group = as_cp_group(dist.group.WORLD)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    # The Triton interpreter evaluates kernels with numpy, which warns on the intended -inf
    # arithmetic of empty rows (log2(0), -inf - -inf masked afterwards).
    warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.runtime")
    # Outputs an op forgets to write come out NaN (and fail the check) instead of stale memory.
    set_output_poison(float("nan"))
    paths = [p for p in all_path_names() if cfg.selected(p)]
    progress = _Progress(len(paths), enabled=cfg.verbose_progress and rank == 0)
    records: list[RankRecord] = []

    for layer in LAYERS:
        layer_paths = [p for p in paths if p.startswith(f"dcp/{layer}/")]
        if not layer_paths:
            continue
        prob = _make_decode_problem(cfg, layer, rank, device)
        for path in layer_paths:
            progress.step(path)
            combine = path.rsplit("/", 1)[1]
            run = functools.partial(_run_dcp_path, cfg, layer, combine, group, rank, device, prob)
            records.append(_run_path(cfg, path, rank, run))
    for path in PCP_PATHS:
        if path not in paths:
            continue
        progress.step(path)
        if path == "pcp/prefill":
            run = functools.partial(_run_pcp_prefill, cfg, group, rank, device)
        else:
            run = functools.partial(_run_pcp_cache, cfg, path.split("/")[1], group, rank, device)
        records.append(_run_path(cfg, path, rank, run))
    return [dataclasses.asdict(r) for r in records]


# --------------------------------------------------------------------------------------------
# Aggregation, reporting, command line
# --------------------------------------------------------------------------------------------


def aggregate(cfg: DemoConfig, per_rank: Sequence[Sequence[dict[str, Any]]]) -> list[PathResult]:
    """Combine every rank's records into one verdict per path (global relative norm error)."""
    from cpattn_testing.tolerances import tolerance

    tol_dtype = tolerance(cfg.torch_dtype)[2]
    by_path: dict[str, list[RankRecord]] = {}
    for rank_records in per_rank:
        for raw in rank_records:
            rec = RankRecord(**raw)
            by_path.setdefault(rec.path, []).append(rec)
    results: list[PathResult] = []
    for path in all_path_names():
        recs = by_path.get(path)
        if not recs:
            continue
        errors = [r for r in recs if r.status == "error"]
        skipped = [r for r in recs if r.status == "skipped"]
        if errors:
            results.append(
                PathResult(path, cfg.world_size, cfg.dtype, "fail", None, None, None,
                           reason=errors[0].reason)
            )  # fmt: skip
            continue
        if skipped and len(skipped) != len(recs):
            ran = len(recs) - len(skipped)
            results.append(
                PathResult(path, cfg.world_size, cfg.dtype, "fail", None, None, None,
                           reason=f"ranks disagree: {len(skipped)} skipped ({skipped[0].reason}), "
                           f"{ran} ran")
            )  # fmt: skip
            continue
        if skipped:
            results.append(
                PathResult(path, cfg.world_size, cfg.dtype, "skipped", None, None, None,
                           reason=skipped[0].reason)
            )  # fmt: skip
            continue
        diff = sum(r.diff_sq for r in recs)
        refn = sum(r.ref_sq for r in recs)
        bad = sum(r.nonfinite for r in recs)
        rel = math.inf if bad else math.sqrt(diff) / max(math.sqrt(refn), 1e-30)
        exact = all(r.exact for r in recs)
        tol = 0.0 if exact else tol_dtype
        per_call = [max(ts) for ts in zip(*(r.times_s for r in recs), strict=False)]
        t_ms = statistics.median(per_call) * 1e3 if per_call else None
        ok = rel <= tol
        reason = "; ".join(r.reason for r in recs if r.reason)
        if bad and not reason:
            reason = f"{bad} non-finite values where the reference is finite"
        results.append(
            PathResult(path, cfg.world_size, cfg.dtype, "pass" if ok else "fail", rel, tol, t_ms,
                       reason=reason, note=recs[0].note)
        )  # fmt: skip
    return results


def _fmt_err(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isinf(x) or math.isnan(x):
        return "nan/inf"
    return f"{x:.1e}"


def format_table(cfg: DemoConfig, results: Sequence[PathResult]) -> str:
    """The human-readable report: one row per path, skipped paths and failures spelled out."""
    header = ("path", "ranks", "dtype", "rel.err", "tol", "result", "time/call")
    rows = [header]
    for r in results:
        t = "-" if r.time_per_call_ms is None else f"{r.time_per_call_ms:.2f} ms"
        rows.append(
            (r.path, str(r.ranks), r.dtype, _fmt_err(r.rel_err), _fmt_err(r.tol),
             r.status.upper() if r.status == "fail" else r.status, t)
        )  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    skipped = [r for r in results if r.status == "skipped"]
    failed = [r for r in results if r.status == "fail"]
    noted = [r for r in results if r.note]
    if noted or skipped:
        lines.append("")
    lines.extend(f"note: {r.path}: {r.note}" for r in noted)
    lines.extend(f"skipped: {r.path}: {r.reason}" for r in skipped)
    lines.append("")
    for r in failed:
        detail = r.reason or f"relative error {_fmt_err(r.rel_err)} > tolerance {_fmt_err(r.tol)}"
        lines.append(f"MISMATCH in {r.path}: {detail}")
    checked = len(results) - len(skipped)
    if failed:
        lines.append(f"FAILED: {len(failed)} of {checked} checked paths")
    elif checked == 0:
        lines.append(f"NOTHING CHECKED: all {len(skipped)} selected paths were skipped")
    else:
        lines.append(f"OK: all {checked} checked paths passed ({len(skipped)} skipped)")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    d = DemoConfig()
    p = argparse.ArgumentParser(
        prog="python -m cpattn_testing.demo",
        description="End-to-end context-parallel attention check (DCP decode combines, "
        "PCP prefill) against float64 full attention.",
        epilog="paths: " + ", ".join(all_path_names()) + ". Exit status: 0 every checked path "
        "passed (skips allowed; at least one checked), 1 a mismatch (a 'MISMATCH in <path>' line "
        "names it), a path that raised on a rank (a '<path> raised on rank <r>' line names it; "
        "the run stops there) or nothing checked, 2 bad arguments, 3 the ranks could not run.",
    )
    p.add_argument("--world-size", type=int, default=d.world_size, help="number of ranks")
    p.add_argument("--backend", choices=("gloo", "nccl"), default=d.backend,
                   help="gloo: CPU ranks; nccl: one GPU per rank")  # fmt: skip
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=d.dtype,
                   help="dtype of partial outputs and Q/K/V")  # fmt: skip
    p.add_argument("--heads", type=int, default=d.num_heads,
                   help="query heads per layer (divisible by the world size)")  # fmt: skip
    p.add_argument("--head-dim", type=int, default=d.head_dim,
                   help="value head dim (the MLA latent dim)")  # fmt: skip
    p.add_argument("--rope-dim", type=int, default=d.rope_dim, help="MLA rope key part")
    p.add_argument("--kv-heads", type=int, default=d.kv_heads, help="KV heads of the GQA layer")
    p.add_argument("--batch", type=int, default=d.batch, help="decode requests")
    p.add_argument("--queries-per-request", type=int, default=d.queries_per_request,
                   help="query tokens per decode request (speculative decoding > 1: "
                   "the last tokens of the request, attending causally)")  # fmt: skip
    p.add_argument("--max-seq-len", type=int, default=d.max_seq_len, help="longest decode KV")
    p.add_argument("--interleave-size", type=int, default=d.interleave_size,
                   help="KV interleave block size of the DCP sharding")  # fmt: skip
    p.add_argument("--prefill-batch", type=int, default=d.prefill_batch, help="PCP prompts")
    p.add_argument("--max-prompt-len", type=int, default=d.max_prompt_len,
                   help="longest PCP prompt")  # fmt: skip
    p.add_argument("--seed", type=int, default=d.seed, help="seed of every random input")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed calls per path after the checked one (default: 2 on gloo, "
                   "20 on nccl; 0 times the checked call itself)")  # fmt: skip
    p.add_argument("--only", action="append", default=[], metavar="PATTERN",
                   help="run only paths matching this fnmatch pattern (repeatable)")  # fmt: skip
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                   help="write results as JSON to FILE ('-' or no value: stdout, "
                   "the table then goes to stderr)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=170.0, help="seconds before ranks are killed")
    p.add_argument("--list", action="store_true", help="list the path names and exit")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--plant-fault", default=None, help=argparse.SUPPRESS)
    p.add_argument("--plant-raise", default=None, help=argparse.SUPPRESS)
    return p


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    """Validate the command line; raises ``ValueError`` naming the offending numbers."""
    n = args.world_size
    positive = {
        "--world-size": n, "--heads": args.heads, "--head-dim": args.head_dim,
        "--kv-heads": args.kv_heads, "--batch": args.batch,
        "--queries-per-request": args.queries_per_request,
        "--interleave-size": args.interleave_size, "--prefill-batch": args.prefill_batch,
        "--max-prompt-len": args.max_prompt_len, "--max-seq-len": args.max_seq_len,
    }  # fmt: skip
    for name, value in positive.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    repeats = args.repeats if args.repeats is not None else (20 if args.backend == "nccl" else 2)
    if args.rope_dim < 0 or repeats < 0:
        raise ValueError(f"--rope-dim and --repeats must be >= 0, got {args.rope_dim}, {repeats}")
    if args.max_seq_len < args.queries_per_request:
        raise ValueError(
            f"--max-seq-len {args.max_seq_len} must be >= --queries-per-request "
            f"{args.queries_per_request} (a request's query tokens are the last of its KV)"
        )
    if args.heads % n:
        raise ValueError(f"--heads {args.heads} must be divisible by --world-size {n}")
    if args.heads % args.kv_heads:
        raise ValueError(f"--heads {args.heads} must be divisible by --kv-heads {args.kv_heads}")
    if args.backend == "nccl":
        gpus = torch.cuda.device_count()
        if gpus < n:
            raise ValueError(f"--backend nccl needs one GPU per rank: {n} ranks, {gpus} GPUs")
    fault = args.plant_fault or os.environ.get(PLANT_FAULT_ENV) or None
    planted_raise = args.plant_raise or os.environ.get(PLANT_RAISE_ENV) or None
    return DemoConfig(
        world_size=n,
        backend=args.backend,
        dtype=str(_DTYPES[args.dtype]).removeprefix("torch."),
        num_heads=args.heads,
        head_dim=args.head_dim,
        rope_dim=args.rope_dim,
        kv_heads=args.kv_heads,
        batch=args.batch,
        queries_per_request=args.queries_per_request,
        max_seq_len=args.max_seq_len,
        interleave_size=args.interleave_size,
        prefill_batch=args.prefill_batch,
        max_prompt_len=args.max_prompt_len,
        seed=args.seed,
        repeats=repeats,
        only=tuple(args.only),
        plant_fault=fault,
        plant_raise=planted_raise,
        verbose_progress=not args.quiet,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (see the module docstring)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(all_path_names()))
        return 0
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        parser.print_usage(sys.stderr)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not any(cfg.selected(p) for p in all_path_names()):
        print(f"error: --only {list(cfg.only)} matches no path; see --list", file=sys.stderr)
        return 2
    if cfg.backend == "gloo" and not _interpreted():
        # Said before any rank starts: each rank would otherwise fail its first kernel launch.
        print(
            "error: --backend gloo runs the ranks on the CPU, where the Triton kernels run only "
            "under Triton's interpreter: set TRITON_INTERPRET=1 (and pip install numpy), or "
            "pass --backend nccl on GPUs",
            file=sys.stderr,
        )
        return 2

    from cpattn_testing.launcher import DistributedError, run_distributed

    to_stdout_json = args.json == "-"
    report: TextIO = sys.stderr if to_stdout_json else sys.stdout
    device_words = "one GPU per rank" if cfg.backend == "nccl" else "CPU"
    print(
        f"cpattn demo: {cfg.world_size} ranks ({cfg.backend}, {device_words}), dtype {cfg.dtype}, "
        f"seed {cfg.seed}",
        file=report,
        flush=True,
    )
    start = time.perf_counter()
    try:
        per_rank = run_distributed(
            rank_main, cfg.world_size, cfg.backend, args=(cfg,), timeout=args.timeout
        )
    except DistributedError as exc:
        raised = _path_failure(exc)
        if raised is None:  # a crash, a timeout, a failure outside the paths
            print(
                f"error: the ranks did not complete: {type(exc).__name__}: {exc}", file=sys.stderr
            )
            return 3
        # One path raised on a rank: the launcher stopped every rank at once. Its traceback
        # (which carries the original exception) goes to stderr, the verdict to the report.
        path, rank, what = raised
        print(
            f"error: {path} raised on rank {rank}; every rank was stopped\n{exc}", file=sys.stderr
        )
        print(
            f"FAILED: {path} raised on rank {rank}: {what} (the run stopped there; see the "
            "traceback on stderr)",
            file=report,
        )
        result = PathResult(path, cfg.world_size, cfg.dtype, "fail", None, None, None,
                            reason=f"raised on rank {rank}: {what}")  # fmt: skip
        if args.json is not None:
            _write_json(args.json, _json_payload(cfg, [result], time.perf_counter() - start))
        return 1
    except Exception as exc:  # the ranks could not be started
        print(f"error: the ranks did not complete: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 3
    elapsed = time.perf_counter() - start
    results = aggregate(cfg, per_rank)
    print(format_table(cfg, results), file=report)
    calls = {0: "the checked call", 1: "one timed call"}.get(
        cfg.repeats, f"median over {cfg.repeats} calls"
    )
    note = "; Triton interpreter: not a performance figure" if _interpreted() else ""
    print(
        f"(wall time {elapsed:.1f} s; time/call: {calls}, slowest rank, library ops only{note})",
        file=report,
    )
    payload = _json_payload(cfg, results, elapsed)
    if args.json is not None:
        _write_json(args.json, payload)
    return 0 if payload["ok"] else 1


def _path_failure(exc: DistributedError) -> tuple[str, int, str] | None:
    """``(path, rank, "Type: message")`` when the launcher's error is a :class:`PathFailure`
    of the rank that failed first (read from that rank's traceback), else ``None``."""
    text = exc.tracebacks.get(exc.rank, "") if exc.rank is not None else ""
    found = list(_PATH_FAILURE_RE.finditer(text))
    if not found:
        return None
    last = found[-1]  # the outermost exception is the last one formatted
    return last["path"], int(last["rank"]), last["what"]


def _json_payload(cfg: DemoConfig, results: Sequence[PathResult], elapsed: float) -> dict[str, Any]:
    # A run that checked nothing (every selected path skipped) is no evidence of anything.
    ok = all(r.status != "fail" for r in results) and any(r.status == "pass" for r in results)
    return {
        "ok": ok,
        "world_size": cfg.world_size,
        "backend": cfg.backend,
        "dtype": cfg.dtype,
        "seed": cfg.seed,
        "wall_time_s": elapsed,
        "results": [r.to_json() for r in results],
        "failed": [r.path for r in results if r.status == "fail"],
        "skipped": {r.path: r.reason for r in results if r.status == "skipped"},
    }


def _write_json(target: str, payload: dict[str, Any]) -> None:
    text = json.dumps(payload, indent=2)
    if target == "-":
        print(text)
    else:
        with open(target, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    # Re-enter through the importable module so the rank function and the config pickle by
    # their real module name (``cpattn_testing.demo``), not ``__main__``.
    from cpattn_testing.demo import main as _main

    sys.exit(_main())
