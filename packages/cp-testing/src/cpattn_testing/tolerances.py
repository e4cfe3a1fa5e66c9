"""The project's one tolerance policy: per-dtype thresholds and a checker with a useful message.

A result passes :func:`assert_close_to_ref` when all of these hold:

- same shape;
- wherever the reference is finite, the result is finite (a NaN where the reference has a
  number always fails: poisoned outputs that a kernel forgot to write show up here);
- wherever the reference is ±inf (e.g. LSE -inf of an empty row), the result is the same inf;
- elementwise ``|actual - ref| <= atol + rtol * |ref|`` on the finite entries;
- relative norm error ``||actual - ref|| / ||ref|| <= max_rel_norm`` over the finite entries
  (skipped when ``||ref|| <= atol * sqrt(n)``: for an essentially zero reference the
  elementwise ``atol`` is the meaningful bound).

Entries where the reference itself is NaN are not checked.

``dtype`` names the precision the result was *computed or stored* in (bf16 output -> bf16
tolerances), which is usually ``actual.dtype``. For sums over a long axis pass its length as
``reduction_len``: ``atol`` then grows with ``sqrt(reduction_len)`` (rounding errors of a
sum grow like a random walk). The same thresholds apply on every machine; there is no
CI-only softening.
"""

from __future__ import annotations

import math

import torch

__all__ = ["TOLERANCES", "assert_close_to_ref", "coarsest", "tolerance"]

#: dtype -> (atol, rtol, max_rel_norm). Low-precision rows allow a few ulps of the output dtype
#: (bf16 eps = 2**-7, fp16 eps = 2**-10) since outputs are rounded at least once, and the
#: AG+RS path rounds a scaled partial before a sum.
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
    """The dtype with the loosest tolerance among ``dtypes``.

    A combine's output carries the error of both its output dtype and its LSE dtype (a bf16 LSE
    perturbs the weights by about ``2**-8 * |lse|``), so check it under
    ``coarsest(out_dtype, lse_dtype)``.
    """
    if not dtypes:
        raise ValueError("coarsest() needs at least one dtype")
    return max(dtypes, key=lambda dt: tolerance(dt))


def _fmt_index(flat: int, shape: torch.Size) -> tuple[int, ...]:
    idx = []
    for size in reversed(shape):
        idx.append(flat % size if size else 0)
        flat = flat // size if size else 0
    return tuple(reversed(idx))


def assert_close_to_ref(
    actual: torch.Tensor,
    ref: torch.Tensor,
    *,
    dtype: torch.dtype,
    name: str = "",
    reduction_len: int | None = None,
) -> None:
    """Assert ``actual`` matches the float64 ``ref`` under ``dtype``'s tolerance (see module doc).

    Args:
        actual: the result under test (any float dtype, any device).
        ref: the reference, same shape (usually float64).
        dtype: the dtype whose tolerance applies.
        name: what is compared, for the message.
        reduction_len: length of a summed axis; scales ``atol`` by ``sqrt(reduction_len)``.

    Raises:
        AssertionError: with the relative norm error, max abs error (and where), and the counts
            of elementwise mismatches and non-finite mismatches.
    """
    atol, rtol, max_rel_norm = tolerance(dtype)
    if reduction_len is not None:
        atol *= math.sqrt(max(1, reduction_len))
    label = f"{name}: " if name else ""
    if actual.shape != ref.shape:
        raise AssertionError(
            f"{label}shape {tuple(actual.shape)} != reference shape {tuple(ref.shape)}"
        )
    a = actual.detach().to(device="cpu", dtype=torch.float64)
    r = ref.detach().to(device="cpu", dtype=torch.float64)
    finite = torch.isfinite(r)
    inf_ref = torch.isinf(r)
    nonfinite_bad = (finite & ~torch.isfinite(a)) | (inf_ref & (a != r))
    n_nonfinite_bad = int(nonfinite_bad.sum())

    af = torch.where(finite & torch.isfinite(a), a, 0.0)
    rf = torch.where(finite, r, 0.0)
    err = (af - rf).abs()
    elem_bad = finite & torch.isfinite(a) & (err > atol + rtol * rf.abs())
    n_elem_bad = int(elem_bad.sum())
    ref_norm = float(torch.linalg.vector_norm(rf))
    err_norm = float(torch.linalg.vector_norm(err))
    rel_norm = err_norm / ref_norm if ref_norm > 0 else (0.0 if err_norm == 0 else math.inf)
    # A reference that is essentially zero has no meaningful relative error: atol governs.
    norm_checked = ref_norm > atol * math.sqrt(max(1, int(finite.sum())))
    norm_ok = rel_norm <= max_rel_norm or not norm_checked
    max_abs = float(err.max()) if err.numel() else 0.0

    if n_nonfinite_bad == 0 and n_elem_bad == 0 and norm_ok:
        return
    total = r.numel()
    lines = [
        f"{label}not close to the reference under {dtype} tolerance "
        f"(atol={atol:.3g}, rtol={rtol:.3g}, max_rel_norm={max_rel_norm:.3g}); shape "
        f"{tuple(r.shape)}",
        f"  relative norm error: {rel_norm:.3e}"
        + ("" if norm_checked else " (not checked: the reference is ~0)"),
        f"  max abs error: {max_abs:.3e}"
        + (f" at {_fmt_index(int(err.argmax()), r.shape)}" if err.numel() else ""),
        f"  elementwise mismatches: {n_elem_bad} / {total}",
        f"  non-finite mismatches (NaN/inf where the reference differs): {n_nonfinite_bad}",
    ]
    bad = (elem_bad | nonfinite_bad).flatten().nonzero().flatten()[:5].tolist()
    for flat in bad:
        idx = _fmt_index(int(flat), r.shape)
        lines.append(f"    at {idx}: actual {a[idx].item()!r}, ref {r[idx].item()!r}")
    raise AssertionError("\n".join(lines))
