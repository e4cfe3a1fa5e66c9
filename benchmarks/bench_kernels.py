"""The benchmarked ops: inputs, our call, the eager baseline's call, byte counts.

Each :class:`KernelSpec` makes one set of random inputs for a :class:`Case` and binds
zero-argument callables for our public op and for the eager PyTorch baseline
(``eager_baselines``) on it; the runner rotates such callables over several input sets.

Byte counts follow one rule: each input read once, each output written once (in-place
tensors count as one read plus one write). ``s`` is the element size of the output dtype, ``P``
the number of output-dtype lanes that carry one fp32 LSE in the A2A buffers (2 for 16-bit
dtypes, 1 for fp32), ``H_r = H / N``.
"""

from __future__ import annotations

import importlib
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
    """One shape of one op. ``N`` / ``D`` are 0 where the op does not depend on them."""

    kernel: str
    dtype: torch.dtype
    H: int
    D: int
    N: int
    B: int

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


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
    """One benchmarked op; subclasses fill in the per-op parts."""

    name: str = ""
    module: str = "cpattn_dcp"
    title: str = ""
    byte_formula: str = ""
    #: The op depends on N / D (False: rows get N = 0 / D = 0).
    uses_n: bool = True

    @property
    def fn(self) -> Callable[..., Any]:
        """Our public op (imported on first use)."""
        op: Callable[..., Any] = getattr(importlib.import_module(self.module), self.name)
        return op

    def nbytes(self, case: Case) -> int:
        raise NotImplementedError

    def make_inputs(self, case: Case, device: torch.device, gen: torch.Generator) -> Inputs:
        raise NotImplementedError

    def bind_ours(self, case: Case, inp: Inputs) -> Bound:
        raise NotImplementedError

    def bind_eager(self, case: Case, inp: Inputs) -> Bound:
        raise NotImplementedError

    def compare(self, case: Case, ours: object, eager: object) -> float:
        """Relative error of our result against the eager baseline (max over outputs)."""
        err = _rel_err(_first(ours), _first(eager))
        o2, e2 = _second(ours), _second(eager)
        if o2 is not None and e2 is not None:
            err = max(err, _rel_err(o2.float(), e2.float()))
        return err

    def check(self, case: Case, inp: Inputs) -> float:
        """Our result against the eager baseline's on copies of ``inp``."""

        def clone() -> Inputs:
            return {k: v.clone() if isinstance(v, Tensor) else v for k, v in inp.items()}

        return self.compare(case, self.bind_ours(case, clone())(), self.bind_eager(case, clone())())


class MergeSpec(KernelSpec):
    name = "merge_attn_states"
    module = "cpattn_common"
    title = "`merge_attn_states` (cp-common): N-way merge of partial outputs by their LSEs"
    byte_formula = (
        "read N·B·H·D·s (partials) + N·B·H·4 (fp32 LSEs); write B·H·D·s (out) + B·H·4 (LSE)"
    )

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
    title = "`correct_attn_out` (cp-dcp): rescale this rank's output for AG+RS / AG+AR"
    byte_formula = (
        "read B·H·D·s (out) + N·B·H·4 (lses); write B·H·D·s (out, in place) + B·H·4 (LSE)"
    )

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


class A2APackSpec(KernelSpec):
    name = "a2a_pack"
    title = (
        "`a2a_pack` (cp-dcp): output + fp32 LSE into the A2A send buffer, empty-shard mask fused"
    )
    byte_formula = (
        "read B·H·D·s (out) + B·H·4 (LSE) + B·4 + (B+1)·4 (seq_lens, query_start_loc); "
        "write N·B·H_r·(D+P)·s (send: payloads and LSE lanes)"
    )

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
        fn, out, lse = self.fn, inp["out"], inp["lse"]
        sl, qsl = inp["seq_lens"], inp["query_start_loc"]
        return lambda: fn(out, lse, c.N, seq_lens=sl, query_start_loc=qsl)

    def bind_eager(self, c: Case, inp: Inputs) -> Bound:
        out, lse, sl, qsl = inp["out"], inp["lse"], inp["seq_lens"], inp["query_start_loc"]
        return lambda: eb.a2a_pack_eager(out, lse, c.N, sl, qsl)

    def compare(self, c: Case, ours: object, eager: object) -> float:
        a, e = _first(ours), _first(eager)
        if a.shape != e.shape:
            return float("inf")
        pay_a, lanes_a = eb.a2a_buffer_views(a, c.D)
        pay_e, lanes_e = eb.a2a_buffer_views(e, c.D)
        payload = _rel_err(pay_a.float(), pay_e.float())
        lse_a = lanes_a.contiguous().view(torch.float32)
        lse_e = lanes_e.contiguous().view(torch.float32)
        return max(payload, _rel_err(lse_a, lse_e))


class A2AUnpackSpec(KernelSpec):
    name = "a2a_unpack_combine"
    title = "`a2a_unpack_combine` (cp-dcp): A2A receive buffer -> combined heads"
    byte_formula = (
        "read N·B·H_r·(D+P)·s (recv: payloads and LSE lanes); write B·H_r·D·s (out) + B·H_r·4 (LSE)"
    )

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
        fn, recv = self.fn, inp["recv"]
        return lambda: fn(recv, head_dim=c.D, return_lse=True)

    def bind_eager(self, c: Case, inp: Inputs) -> Bound:
        recv = inp["recv"]
        return lambda: eb.a2a_unpack_combine_eager(recv, c.D)


class MaskSpec(KernelSpec):
    name = "mask_dcp_empty_shards_"
    title = "`mask_dcp_empty_shards_` (cp-dcp): in-place -inf LSE of empty shards"
    byte_formula = (
        "read B·4 (seq_lens) + (B+1)·4 (query_start_loc); write E·H·4 (the LSE rows of the "
        "E = max(1, ⌊B/4⌋) requests with an empty shard, in place; the kernel reads no LSE)"
    )
    uses_n = False

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


def all_specs() -> list[KernelSpec]:
    """Every benchmarked op, in page order."""
    return [MergeSpec(), CorrectSpec(), A2APackSpec(), A2AUnpackSpec(), MaskSpec()]


#: Op names in page order, and their page titles.
ORDER = [s.name for s in all_specs()]
TITLES = {s.name: s.title for s in all_specs()}
