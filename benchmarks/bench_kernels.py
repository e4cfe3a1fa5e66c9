"""The benchmarked kernels: how to build inputs, call ours, call the eager baseline, count bytes.

Each :class:`KernelSpec` resolves our implementation defensively (an op that is not written yet
is reported as ``missing: ...`` instead of failing the run), makes one set of random inputs for a
:class:`Case`, and binds zero-argument callables for our op and for the eager PyTorch baseline
(``eager_baselines``) on one input set; the runner rotates such callables over several sets.

Byte counts follow one rule: each input read once, each output written once (in-place
tensors count as one read plus one write). ``s`` is the element size of the output dtype, ``P``
the number of output-dtype lanes that carry one fp32 LSE in the packed A2A buffers (2 for
16-bit dtypes, 1 for fp32), ``H_r = H / N``.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import eager_baselines as eb
import torch

Tensor = torch.Tensor
Inputs = dict[str, Any]
Bound = Callable[[], object]


@dataclass(frozen=True)
class Case:
    """One shape of one kernel. ``N``/``D`` are 0 where the kernel does not depend on them."""

    kernel: str
    dtype: torch.dtype
    H: int
    D: int
    N: int
    B: int

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def _resolve(candidates: Sequence[tuple[str, str]]) -> tuple[Callable[..., Any] | None, str]:
    """First importable ``module.attr`` among ``candidates``: ``(fn, "ok")`` or ``(None, why)``."""
    reasons: list[str] = []
    for module_name, attr in candidates:
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # an op module under construction may fail in any way
            reasons.append(f"{module_name}: {type(exc).__name__}: {exc}".splitlines()[0])
            continue
        fn = getattr(module, attr, None)
        if callable(fn):
            return fn, "ok"
        reasons.append(f"{module_name} has no {attr}")
    return None, "missing: " + "; ".join(reasons)


def _rel_err(actual: Tensor, expected: Tensor) -> float:
    """Relative norm error over finite reference entries; inf when non-finite patterns differ."""
    a = actual.detach().double().flatten()
    e = expected.detach().double().flatten()
    if a.shape != e.shape:
        return float("inf")
    finite = torch.isfinite(e)
    if not torch.equal(finite, torch.isfinite(a)):
        return float("inf")
    if not bool(torch.equal(a[~finite], e[~finite])):  # -inf must match -inf
        return float("inf")
    num = torch.linalg.vector_norm(a[finite] - e[finite])
    den = torch.linalg.vector_norm(e[finite]).clamp_min(1e-30)
    return float(num / den)


def _first(x: object) -> Tensor:
    if isinstance(x, (tuple, list)):
        return _first(x[0])
    if not isinstance(x, Tensor):
        raise TypeError(f"expected a tensor result, got {type(x).__name__}")
    return x


def _second(x: object) -> Tensor | None:
    if isinstance(x, (tuple, list)) and len(x) > 1 and isinstance(x[1], Tensor):
        return x[1]
    return None


def _randn(
    shape: Sequence[int], dtype: torch.dtype, device: torch.device, gen: torch.Generator
) -> Tensor:
    return torch.randn(tuple(shape), generator=gen, device=device, dtype=torch.float32).to(dtype)


def _lses(shape: Sequence[int], device: torch.device, gen: torch.Generator) -> Tensor:
    """Finite, spread-out fp32 LSEs (so weights are far from uniform)."""
    return torch.randn(tuple(shape), generator=gen, device=device, dtype=torch.float32) * 3.0 + 4.0


def _empty_shards(b: int) -> int:
    """How many of ``b`` requests have an empty local shard in the decode metadata."""
    return max(1, b // 4)


def _seq_meta(b: int, device: torch.device, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """Decode metadata: one query row per request, ``_empty_shards(b)`` (a quarter, at least
    one) of the local shards empty, at random rows."""
    seq_lens = torch.randint(1, 64, (b,), generator=gen, device=device, dtype=torch.int32)
    empty_rows = torch.randperm(b, generator=gen, device=device)[: _empty_shards(b)]
    seq_lens[empty_rows] = 0
    query_start_loc = torch.arange(b + 1, device=device, dtype=torch.int32)
    return seq_lens, query_start_loc


class KernelSpec:
    """Base class: one benchmarked op. Subclasses fill in the abstract parts."""

    name: str = ""
    title: str = ""
    byte_formula: str = ""
    #: The op depends on N / D (False: rows get N = 0 / D = 0).
    uses_n: bool = True
    uses_d: bool = True

    def __init__(self) -> None:
        self.status = "not resolved"
        self._fn: Callable[..., Any] | None = None

    # -- resolution -------------------------------------------------------------------------
    def candidates(self) -> Sequence[tuple[str, str]]:
        raise NotImplementedError

    def resolve(self) -> str:
        """Import our implementation; returns and stores ``"ok"`` or ``"missing: <why>"``."""
        fn, status = _resolve(self.candidates())
        if fn is not None:
            status = self.adapt(fn)
        self._fn = fn if status == "ok" else None
        self.status = status
        return status

    def adapt(self, fn: Callable[..., Any]) -> str:
        """Hook for ops whose signature is not pinned by a contract; ``"ok"`` or a reason."""
        return "ok"

    @property
    def fn(self) -> Callable[..., Any]:
        if self._fn is None:
            raise RuntimeError(f"{self.name} is not available: {self.status}")
        return self._fn

    # -- per case ---------------------------------------------------------------------------
    def nbytes(self, case: Case) -> int:
        raise NotImplementedError

    def make_inputs(self, case: Case, device: torch.device, gen: torch.Generator) -> Inputs:
        raise NotImplementedError

    def bind_ours(self, case: Case, inp: Inputs) -> Bound:
        raise NotImplementedError

    def bind_eager(self, case: Case, inp: Inputs) -> Bound:
        raise NotImplementedError

    def clone_inputs(self, inp: Inputs) -> Inputs:
        return {k: v.clone() if isinstance(v, Tensor) else v for k, v in inp.items()}

    def compare(self, case: Case, ours: object, eager: object) -> float:
        """Relative error of our result against the eager baseline (max over outputs)."""
        err = _rel_err(_first(ours), _first(eager))
        o2, e2 = _second(ours), _second(eager)
        if o2 is not None and e2 is not None:
            err = max(err, _rel_err(o2.float(), e2.float()))
        return err

    def check(self, case: Case, inp: Inputs) -> float:
        ours = self.bind_ours(case, self.clone_inputs(inp))()
        eager = self.bind_eager(case, self.clone_inputs(inp))()
        return self.compare(case, ours, eager)


# ------------------------------------------------------------------------------------------------


class MergeSpec(KernelSpec):
    name = "merge_attn_states"
    title = "cp-common `merge_attn_states` (N-way LSE merge)"
    byte_formula = (
        "read N·B·H·D·s (partials) + N·B·H·4 (fp32 LSEs); write B·H·D·s (out) + B·H·4 (LSE)"
    )

    def candidates(self) -> Sequence[tuple[str, str]]:
        return [
            ("cpattn_common", "merge_attn_states"),
            ("cpattn_common.ops.merge_attn_states", "merge_attn_states"),
            ("cpattn_common.lse", "merge_attn_states"),
        ]

    def nbytes(self, c: Case) -> int:
        s = c.dtype.itemsize
        return c.N * c.B * c.H * (c.D * s + 4) + c.B * c.H * (c.D * s + 4)

    def make_inputs(self, c: Case, device: torch.device, gen: torch.Generator) -> Inputs:
        return {
            "outs": _randn((c.N, c.B, c.H, c.D), c.dtype, device, gen),
            "lses": _lses((c.N, c.B, c.H), device, gen),
        }

    def bind_ours(self, c: Case, inp: Inputs) -> Bound:
        fn, outs, lses = self.fn, inp["outs"], inp["lses"]
        return lambda: fn(outs, lses, is_lse_base_on_e=True, return_lse=True)

    def bind_eager(self, c: Case, inp: Inputs) -> Bound:
        outs, lses = inp["outs"], inp["lses"]
        return lambda: eb.merge_attn_states_eager(outs, lses)


class CorrectSpec(KernelSpec):
    name = "correct_attn_out"
    title = "cp-dcp `correct_attn_out` (AG+RS / AG+AR rescale)"
    byte_formula = (
        "read B·H·D·s (out) + N·B·H·4 (lses); write B·H·D·s (out, in place) + B·H·4 (LSE)"
    )

    def candidates(self) -> Sequence[tuple[str, str]]:
        return [
            ("cpattn_dcp", "correct_attn_out"),
            ("cpattn_dcp.ops.correct_attn_out", "correct_attn_out"),
        ]

    def nbytes(self, c: Case) -> int:
        s = c.dtype.itemsize
        return 2 * c.B * c.H * c.D * s + c.N * c.B * c.H * 4 + c.B * c.H * 4

    def make_inputs(self, c: Case, device: torch.device, gen: torch.Generator) -> Inputs:
        return {
            "out": _randn((c.B, c.H, c.D), c.dtype, device, gen),
            "lses": _lses((c.N, c.B, c.H), device, gen),
            "cp_rank": c.N // 2,
        }

    def bind_ours(self, c: Case, inp: Inputs) -> Bound:
        fn, out, lses, rank = self.fn, inp["out"], inp["lses"], inp["cp_rank"]
        return lambda: fn(out, lses, rank)

    def bind_eager(self, c: Case, inp: Inputs) -> Bound:
        out, lses, rank = inp["out"], inp["lses"], inp["cp_rank"]
        return lambda: eb.correct_attn_out_eager(out, lses, rank)


class MaskSpec(KernelSpec):
    name = "mask_dcp_empty_shards_"
    title = "cp-dcp `mask_dcp_empty_shards_` (in-place LSE mask)"
    byte_formula = (
        "read B·4 (seq_lens) + (B+1)·4 (query_start_loc); write E·H·4 (the LSE rows of the "
        "E = max(1, ⌊B/4⌋) requests with an empty shard, in place; the kernel reads no LSE)"
    )
    uses_n = False
    uses_d = False

    def candidates(self) -> Sequence[tuple[str, str]]:
        return [
            ("cpattn_dcp", "mask_dcp_empty_shards_"),
            ("cpattn_dcp.ops.mask", "mask_dcp_empty_shards_"),
        ]

    def nbytes(self, c: Case) -> int:
        return _empty_shards(c.B) * c.H * 4 + c.B * 4 + (c.B + 1) * 4

    def make_inputs(self, c: Case, device: torch.device, gen: torch.Generator) -> Inputs:
        seq_lens, qsl = _seq_meta(c.B, device, gen)
        return {"lse": _lses((c.B, c.H), device, gen), "seq_lens": seq_lens, "query_start_loc": qsl}

    def bind_ours(self, c: Case, inp: Inputs) -> Bound:
        fn, lse, sl, qsl = self.fn, inp["lse"], inp["seq_lens"], inp["query_start_loc"]

        def call() -> object:
            fn(lse, sl, qsl)
            return lse

        return call

    def bind_eager(self, c: Case, inp: Inputs) -> Bound:
        lse, sl, qsl = inp["lse"], inp["seq_lens"], inp["query_start_loc"]
        return lambda: eb.mask_dcp_empty_shards_eager(lse, sl, qsl)


# Parameter names that the A2A pack / unpack-combine functions may use (their signatures are
# not pinned by the shared contract; we map by name and fall back to positions).
_WORLD_NAMES = ("world_size", "cp_world_size", "dcp_world_size", "num_ranks", "cp_size", "n", "N")
_HEAD_DIM_NAMES = ("head_dim", "d", "D", "v_head_dim")


def _bind_by_name(
    fn: Callable[..., Any], values: dict[str, Any], first: Sequence[Any]
) -> tuple[list[Any], dict[str, Any]]:
    """Build ``(args, kwargs)`` for ``fn``: ``first`` fills the leading positional parameters,
    later parameters are filled from ``values`` by name; a required parameter that cannot be
    filled raises ``TypeError`` naming it."""
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    args: list[Any] = list(first)
    kwargs: dict[str, Any] = {}
    for p in params[len(first) :]:
        if p.name in values:
            if p.kind == p.POSITIONAL_ONLY:
                args.append(values[p.name])
            else:
                kwargs[p.name] = values[p.name]
        elif p.default is inspect.Parameter.empty:
            raise TypeError(f"cannot fill required parameter {p.name!r} of {fn.__name__}{sig}")
    return args, kwargs


class A2APackSpec(KernelSpec):
    name = "a2a_pack"
    title = "cp-dcp A2A pack (output + fp32 LSE into one send buffer, empty-shard mask fused)"
    byte_formula = (
        "read B·H·D·s (out) + B·H·4 (LSE) + B·4 + (B+1)·4 (seq_lens, query_start_loc); "
        "write N·B·H_r·(D+P)·s (send: payloads and LSE lanes)"
    )

    def candidates(self) -> Sequence[tuple[str, str]]:
        return [("cpattn_dcp.ops.a2a_combine", "a2a_pack")]

    def adapt(self, fn: Callable[..., Any]) -> str:
        try:
            inspect.signature(fn)
        except (TypeError, ValueError) as exc:
            return f"missing: cannot read the signature of a2a_pack: {exc}"
        return "ok"

    def nbytes(self, c: Case) -> int:
        s, p = c.dtype.itemsize, eb.lse_pack_lanes(c.dtype)
        return c.B * c.H * (c.D * s + 4) + c.B * 4 + (c.B + 1) * 4 + c.B * c.H * (c.D + p) * s

    def make_inputs(self, c: Case, device: torch.device, gen: torch.Generator) -> Inputs:
        seq_lens, qsl = _seq_meta(c.B, device, gen)
        return {
            "out": _randn((c.B, c.H, c.D), c.dtype, device, gen),
            "lse": _lses((c.B, c.H), device, gen),
            "seq_lens": seq_lens,
            "query_start_loc": qsl,
        }

    def bind_ours(self, c: Case, inp: Inputs) -> Bound:
        # The op allocates its send buffer, as dcp_a2a_lse_reduce does on every call.
        values: dict[str, Any] = {name: c.N for name in _WORLD_NAMES}
        values.update(
            seq_lens=inp["seq_lens"],
            query_start_loc=inp["query_start_loc"],
            is_lse_base_on_e=True,
        )
        args, kwargs = _bind_by_name(self.fn, values, (inp["out"], inp["lse"]))
        fn = self.fn
        return lambda: fn(*args, **kwargs)

    def bind_eager(self, c: Case, inp: Inputs) -> Bound:
        out, lse, sl, qsl = inp["out"], inp["lse"], inp["seq_lens"], inp["query_start_loc"]
        return lambda: eb.a2a_pack_eager(out, lse, c.N, sl, qsl)

    def compare(self, c: Case, ours: object, eager: object) -> float:
        a, e = _first(ours), _first(eager)
        if a.shape != e.shape:
            return float("inf")
        # Payloads and LSE lanes (as fp32).
        pay_a, lanes_a = eb.a2a_buffer_views(a, c.D)
        pay_e, lanes_e = eb.a2a_buffer_views(e, c.D)
        payload = _rel_err(pay_a.float(), pay_e.float())
        lse_a = lanes_a.contiguous().view(torch.float32)
        lse_e = lanes_e.contiguous().view(torch.float32)
        return max(payload, _rel_err(lse_a, lse_e))


class A2AUnpackSpec(KernelSpec):
    name = "a2a_unpack_combine"
    title = "cp-dcp A2A unpack-combine (receive buffer -> combined heads)"
    byte_formula = (
        "read N·B·H_r·(D+P)·s (recv: payloads and LSE lanes); write B·H_r·D·s (out) + B·H_r·4 (LSE)"
    )

    def candidates(self) -> Sequence[tuple[str, str]]:
        return [("cpattn_dcp.ops.a2a_combine", "a2a_unpack_combine")]

    def adapt(self, fn: Callable[..., Any]) -> str:
        try:
            inspect.signature(fn)
        except (TypeError, ValueError) as exc:
            return f"missing: cannot read the signature of a2a_unpack_combine: {exc}"
        return "ok"

    def nbytes(self, c: Case) -> int:
        s, p = c.dtype.itemsize, eb.lse_pack_lanes(c.dtype)
        h_r = c.H // c.N
        return c.B * c.H * (c.D + p) * s + c.B * h_r * (c.D * s + 4)

    def make_inputs(self, c: Case, device: torch.device, gen: torch.Generator) -> Inputs:
        # A receive buffer has the same layout as a send buffer: build one with the eager pack.
        out = _randn((c.B, c.H, c.D), c.dtype, device, gen)
        lse = _lses((c.B, c.H), device, gen)
        return {"recv": eb.a2a_pack_eager(out, lse, c.N)}

    def bind_ours(self, c: Case, inp: Inputs) -> Bound:
        values: dict[str, Any] = {name: c.D for name in _HEAD_DIM_NAMES}
        values.update({name: c.N for name in _WORLD_NAMES if name not in ("d", "D")})
        values.update(return_lse=True, is_lse_base_on_e=True, out_dtype=c.dtype, dtype=c.dtype)
        args, kwargs = _bind_by_name(self.fn, values, (inp["recv"],))
        fn = self.fn
        return lambda: fn(*args, **kwargs)

    def bind_eager(self, c: Case, inp: Inputs) -> Bound:
        recv = inp["recv"]
        return lambda: eb.a2a_unpack_combine_eager(recv, c.D)


def all_specs() -> list[KernelSpec]:
    """Every benchmarked kernel, in report order."""
    return [MergeSpec(), CorrectSpec(), A2APackSpec(), A2AUnpackSpec(), MaskSpec()]
