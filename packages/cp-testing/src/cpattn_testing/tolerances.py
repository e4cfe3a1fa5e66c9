"""The project's one tolerance policy (docs/packages/testing.md, "One tolerance policy").

A result passes :func:`assert_close_to_ref` with the reference's shape and infinities, finite
where it is, ``|actual - ref| <= atol + rtol * |ref|`` elementwise and ``||actual - ref|| /
||ref|| <= max_rel_norm`` over the finite entries (not for an essentially zero reference).
NaN reference entries are not checked.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

__all__ = [
    "TOLERANCES",
    "ChunkedAgreement",
    "assert_close_by_row_chunks",
    "assert_close_to_ref",
    "coarsest",
    "lse_magnitude",
    "tolerance",
]

#: dtype -> (atol, rtol, max_rel_norm): a few ulps of the low-precision dtypes.
TOLERANCES: dict[torch.dtype, tuple[float, float, float]] = {
    torch.float64: (1e-10, 1e-10, 1e-12),
    torch.float32: (1e-5, 1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2, 1e-2),
}

_FP8_TOLERANCE = (0.25, 0.25, 0.125)


def tolerance(dtype: torch.dtype) -> tuple[float, float, float]:
    """``(atol, rtol, max_rel_norm)`` for results computed or stored in ``dtype``.

    Raises:
        TypeError: ``dtype`` is not a floating-point dtype.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"tolerance() needs a floating-point torch.dtype, got {dtype!r}")
    if dtype in TOLERANCES:
        return TOLERANCES[dtype]
    if torch.finfo(dtype).bits == 8:
        return _FP8_TOLERANCE
    raise TypeError(f"no tolerance defined for {dtype}")


def coarsest(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype with the loosest tolerance among ``dtypes``: check a combine's output under
    ``coarsest(out_dtype, lse_dtype)`` (a bf16 LSE perturbs the weights too)."""
    if not dtypes:
        raise ValueError("coarsest() needs at least one dtype")
    return max(dtypes, key=lambda dt: tolerance(dt))


def _fmt_index(flat: int, shape: torch.Size) -> tuple[int, ...]:
    idx = []
    for size in reversed(shape):
        idx.append(flat % size if size else 0)
        flat = flat // size if size else 0
    return tuple(reversed(idx))


def lse_magnitude(lses: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``|m| + 1`` with ``m`` the largest finite entry of ``lses`` along ``dim`` (0 where
    there is none), float64: pass it as ``scale`` to :func:`assert_close_to_ref` when checking
    a merged LSE (``lses [N, B, H]`` of the sources -> ``[B, H]``)."""
    l64 = lses.detach().to(torch.float64)
    m = torch.where(torch.isfinite(l64), l64, -math.inf).amax(dim=dim)
    return torch.where(torch.isfinite(m), m.abs(), 0.0) + 1.0


# The rms below which a reference counts as zero, as a fraction of atol.
_ZERO_FRACTION_OF_ATOL = 1e-3


class _Comparison:
    """Elementwise terms of the policy for one pair of float64 tensors (same device).

    ``scale``: magnitude of the operands (broadcastable to ``r``), or None for ``|r|``.
    """

    def __init__(
        self,
        a: torch.Tensor,
        r: torch.Tensor,
        atol: float,
        rtol: float,
        scale: torch.Tensor | None = None,
    ) -> None:
        finite = torch.isfinite(r)
        a_finite = torch.isfinite(a)
        self.nonfinite_bad = (finite & ~a_finite) | (torch.isinf(r) & (a != r))
        rf = torch.where(finite, r, 0.0)
        mag = rf.abs()
        if scale is not None:
            mag = torch.where(finite, torch.maximum(mag, scale), 0.0)
        self.err = (torch.where(finite & a_finite, a, 0.0) - rf).abs()
        self.elem_bad = finite & a_finite & (self.err > atol + rtol * mag)
        self.ref_sq = float(mag.square().sum())  # the norm the error is relative to
        self.err_sq = float(self.err.square().sum())
        self.n_finite = int(finite.sum())


def _subnormal_spacing(dtype: torch.dtype) -> float:
    """The spacing of ``dtype``'s subnormals (fp16: 2**-24)."""
    info = torch.finfo(dtype)
    return float(info.smallest_normal * info.eps)


def _norm_verdict(
    ref_sq: float, err_sq: float, n_finite: int, atol: float, max_rel_norm: float,
    dtype: torch.dtype,
) -> tuple[float, bool, bool]:  # fmt: skip
    """``(relative norm error, whether it is checked, whether it passes)``."""
    ref_norm, err_norm = math.sqrt(ref_sq), math.sqrt(err_sq)
    rel_norm = err_norm / ref_norm if ref_norm > 0 else (0.0 if err_norm == 0 else math.inf)
    # An essentially zero reference (far below atol) has no meaningful relative error.
    root_n = math.sqrt(max(1, n_finite))
    checked = ref_norm > _ZERO_FRACTION_OF_ATOL * atol * root_n
    # Values in dtype's subnormal range carry up to one subnormal spacing of error each.
    allowed = max_rel_norm * ref_norm + _subnormal_spacing(dtype) * root_n
    return rel_norm, checked, err_norm <= allowed or not checked


def _scaled_tolerance(dtype: torch.dtype, reduction_len: int | None) -> tuple[float, float, float]:
    atol, rtol, max_rel_norm = tolerance(dtype)
    if reduction_len is not None:
        atol *= math.sqrt(max(1, reduction_len))
    return atol, rtol, max_rel_norm


def _summary(
    label: str, dtype: torch.dtype, tol: tuple[float, float, float], shape: str, rel_norm: float,
    norm_checked: bool, max_abs: str, n_elem_bad: int, total: int, n_nonfinite_bad: int,
) -> list[str]:  # fmt: skip
    atol, rtol, max_rel_norm = tol
    return [
        f"{label}not close to the reference under {dtype} tolerance "
        f"(atol={atol:.3g}, rtol={rtol:.3g}, max_rel_norm={max_rel_norm:.3g}); shape {shape}",
        f"  relative norm error: {rel_norm:.3e}"
        + ("" if norm_checked else " (not checked: the reference is ~0)"),
        f"  max abs error: {max_abs}",
        f"  elementwise mismatches: {n_elem_bad} / {total}",
        f"  non-finite mismatches (NaN/inf where the reference differs): {n_nonfinite_bad}",
    ]


def assert_close_to_ref(
    actual: torch.Tensor,
    ref: torch.Tensor,
    *,
    dtype: torch.dtype,
    name: str = "",
    reduction_len: int | None = None,
    scale: torch.Tensor | None = None,
) -> None:
    """Assert ``actual`` matches the float64 ``ref`` under ``dtype``'s tolerance (see module doc).

    ``actual`` (any float dtype and device) against ``ref`` of the same shape; ``dtype``: the
    tolerance's; ``name`` for the message; ``reduction_len``: a summed axis' length (``atol``
    times its square root); ``scale``: size of the terms the result was computed from
    (broadcastable, finite, >= 0; :func:`lse_magnitude` for a merged LSE). The
    ``AssertionError`` names the relative norm error, the max abs error and where, and the
    counts of elementwise and non-finite mismatches.
    """
    tol = _scaled_tolerance(dtype, reduction_len)
    atol, rtol, max_rel_norm = tol
    label = f"{name}: " if name else ""
    if actual.shape != ref.shape:
        raise AssertionError(
            f"{label}shape {tuple(actual.shape)} != reference shape {tuple(ref.shape)}"
        )
    a = actual.detach().to(device="cpu", dtype=torch.float64)
    r = ref.detach().to(device="cpu", dtype=torch.float64)
    mag = None
    if scale is not None:
        mag = scale.detach().to(device="cpu", dtype=torch.float64)
        if not bool(torch.isfinite(mag).all()) or bool((mag < 0).any()):
            raise ValueError(f"{label}scale must be finite and >= 0")
    c = _Comparison(a, r, atol, rtol, mag)
    n_nonfinite_bad = int(c.nonfinite_bad.sum())
    n_elem_bad = int(c.elem_bad.sum())
    rel_norm, norm_checked, norm_ok = _norm_verdict(
        c.ref_sq, c.err_sq, c.n_finite, atol, max_rel_norm, dtype
    )
    if n_nonfinite_bad == 0 and n_elem_bad == 0 and norm_ok:
        return
    err = c.err
    max_abs = f"{float(err.max()) if err.numel() else 0.0:.3e}" + (
        f" at {_fmt_index(int(err.argmax()), r.shape)}" if err.numel() else ""
    )
    lines = _summary(
        label, dtype, tol, str(tuple(r.shape)), rel_norm, norm_checked, max_abs, n_elem_bad,
        r.numel(), n_nonfinite_bad,
    )  # fmt: skip
    bad = (c.elem_bad | c.nonfinite_bad).flatten().nonzero().flatten()[:5].tolist()
    for flat in bad:
        idx = _fmt_index(int(flat), r.shape)
        lines.append(f"    at {idx}: actual {a[idx].item()!r}, ref {r[idx].item()!r}")
    raise AssertionError("\n".join(lines))


class ChunkedAgreement:
    """:func:`assert_close_to_ref` for a result too large for a float64 copy: :meth:`add` each
    chunk with its reference, then :meth:`check` (the norm over the whole result).

    Example::

        agree = ChunkedAgreement(torch.bfloat16, name="out")
        for s in range(0, B, 4096):
            agree.add(out[s : s + 4096], reference(s, s + 4096))
        agree.check()
    """

    def __init__(
        self, dtype: torch.dtype, *, name: str = "", reduction_len: int | None = None
    ) -> None:
        self.dtype = dtype
        self.name = name
        self._tol = _scaled_tolerance(dtype, reduction_len)
        self._ref_sq = 0.0
        self._err_sq = 0.0
        self._n_finite = 0
        self._n_elem_bad = 0
        self._n_nonfinite_bad = 0
        self._total = 0
        self._chunks = 0
        self._max_abs = 0.0
        self._first_bad: str | None = None

    def add(self, actual: torch.Tensor, ref: torch.Tensor) -> None:
        """Compare one chunk (same shape; the reference usually float64)."""
        if actual.shape != ref.shape:
            raise AssertionError(
                f"{self.name or 'chunk'}: shape {tuple(actual.shape)} != reference shape "
                f"{tuple(ref.shape)}"
            )
        a = actual.detach().to(torch.float64)
        r = ref.detach().to(device=a.device, dtype=torch.float64)
        atol, rtol, _ = self._tol
        c = _Comparison(a, r, atol, rtol)
        self._ref_sq += c.ref_sq
        self._err_sq += c.err_sq
        self._n_finite += c.n_finite
        n_elem_bad = int(c.elem_bad.sum())
        n_nonfinite_bad = int(c.nonfinite_bad.sum())
        if (n_elem_bad or n_nonfinite_bad) and self._first_bad is None:
            flat = int((c.elem_bad | c.nonfinite_bad).flatten().nonzero()[0])
            idx = _fmt_index(flat, r.shape)
            self._first_bad = (
                f"chunk {self._chunks} at {idx}: actual {a[idx].item()!r}, ref {r[idx].item()!r}"
            )
        self._n_elem_bad += n_elem_bad
        self._n_nonfinite_bad += n_nonfinite_bad
        self._total += r.numel()
        self._chunks += 1
        if c.err.numel():
            self._max_abs = max(self._max_abs, float(c.err.max()))

    def check(self) -> None:
        """Raise ``AssertionError`` (same message terms as :func:`assert_close_to_ref`) unless
        every chunk added so far passes."""
        atol, _, max_rel_norm = self._tol
        rel_norm, norm_checked, norm_ok = _norm_verdict(
            self._ref_sq, self._err_sq, self._n_finite, atol, max_rel_norm, self.dtype
        )
        if self._n_elem_bad == 0 and self._n_nonfinite_bad == 0 and norm_ok:
            return
        label = f"{self.name}: " if self.name else ""
        lines = _summary(
            label, self.dtype, self._tol, f"{self._total} elements in chunks", rel_norm,
            norm_checked, f"{self._max_abs:.3e}", self._n_elem_bad, self._total,
            self._n_nonfinite_bad,
        )  # fmt: skip
        if self._first_bad is not None:
            lines.append(f"    first mismatch: {self._first_bad}")
        raise AssertionError("\n".join(lines))


def assert_close_by_row_chunks(
    actual: Sequence[torch.Tensor],
    reference: Callable[[int, int], Sequence[torch.Tensor]],
    checks: Sequence[ChunkedAgreement],
    *,
    chunk_rows: int,
) -> None:
    """Check results row chunk by row chunk against references computed per chunk.

    ``actual``: results sharing their row count, e.g. ``(out [B, H, D], lse [B, H])``;
    ``reference(s, e)``: the references of rows ``[s, e)`` of each, in order; ``checks``: one
    :class:`ChunkedAgreement` per result; ``chunk_rows`` bounds the float64 temporaries.
    ``AssertionError`` as :meth:`ChunkedAgreement.check`; ``ValueError`` for mismatched
    lengths or row counts, or ``chunk_rows < 1``.
    """
    if len(actual) != len(checks) or not actual:
        raise ValueError(f"{len(actual)} results for {len(checks)} checks")
    rows = actual[0].shape[0]
    if any(t.shape[0] != rows for t in actual):
        raise ValueError(f"results differ in row count: {[t.shape[0] for t in actual]}")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    for s in range(0, rows, chunk_rows):
        e = min(rows, s + chunk_rows)
        refs = reference(s, e)
        if len(refs) != len(actual):
            raise ValueError(f"reference returned {len(refs)} tensors for {len(actual)} results")
        for check, got, ref in zip(checks, actual, refs, strict=True):
            check.add(got[s:e], ref)
    for check in checks:
        check.check()
