"""LSE merge of partial attention states in plain torch, and the checks of its inputs.
``merge_attn_states_torch`` is the Triton op's twin (its fallback where Triton cannot run), with
the kernel's guards and fp32 arithmetic; results may differ in the last bit (summation order,
``exp`` / ``log`` rounding). The formula: ``docs/packages/common.md``.
"""

from __future__ import annotations

import torch

from cpattn_common.checks import check_bool

__all__ = ["merge_attn_states_torch", "sanitize_lse", "validate_merge_inputs"]

OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LSE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def sanitize_lse(lse: torch.Tensor) -> torch.Tensor:
    """Return ``lse`` with NaN and +inf replaced by -inf (they contribute nothing)."""
    return torch.where(torch.isnan(lse) | (lse == float("inf")), float("-inf"), lse)


def validate_merge_inputs(
    partial_outs: torch.Tensor, partial_lses: torch.Tensor, *, any_float: bool = False
) -> None:
    """The checks of ``merge_attn_states`` (``any_float``: of its torch twin, which takes any
    floating dtype, fp64 references included); raises ``TypeError`` / ``ValueError``."""
    if not isinstance(partial_outs, torch.Tensor) or not isinstance(partial_lses, torch.Tensor):
        raise TypeError("partial_outs and partial_lses must be torch.Tensor")
    if partial_outs.dim() != 4:
        raise ValueError(
            f"partial_outs must be [N, B, H, D], got shape {tuple(partial_outs.shape)}"
        )
    if partial_lses.dim() != 3:
        raise ValueError(f"partial_lses must be [N, B, H], got shape {tuple(partial_lses.shape)}")
    if tuple(partial_outs.shape[:3]) != tuple(partial_lses.shape):
        raise ValueError(
            f"partial_outs {tuple(partial_outs.shape)} and partial_lses "
            f"{tuple(partial_lses.shape)} disagree on [N, B, H]"
        )
    if partial_outs.shape[0] < 1:
        raise ValueError("merge_attn_states needs N >= 1 partial states, got N = 0")
    if partial_outs.shape[3] == 0:  # as the cp-dcp ops: an empty head dim is a caller's bug
        raise ValueError(f"partial_outs {tuple(partial_outs.shape)} has head_dim 0; D must be >= 1")
    if any_float:
        for name, t in (("partial_outs", partial_outs), ("partial_lses", partial_lses)):
            if not t.dtype.is_floating_point:
                raise TypeError(f"{name} must be a floating tensor, got {t.dtype}")
    elif partial_outs.dtype not in OUT_DTYPES:
        raise TypeError(f"partial_outs dtype {partial_outs.dtype} not in {OUT_DTYPES}")
    elif partial_lses.dtype not in LSE_DTYPES:
        raise TypeError(f"partial_lses dtype {partial_lses.dtype} not in {LSE_DTYPES}")
    if partial_outs.device != partial_lses.device:
        raise ValueError(
            f"partial_outs on {partial_outs.device} but partial_lses on {partial_lses.device}"
        )


def merge_attn_states_torch(
    partial_outs: torch.Tensor,
    partial_lses: torch.Tensor,
    *,
    is_lse_base_on_e: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact N-way LSE merge of partial attention states, in plain torch.

    ``partial_outs [N, B, H, D]`` (any float dtype, any strides) and their LSEs
    ``partial_lses [N, B, H]`` (base e, or 2 without ``is_lse_base_on_e``) give ``(out [B, H,
    D]`` in ``partial_outs.dtype``, ``lse [B, H]`` fp32; fp64 math when an input is fp64).
    NaN / +inf LSEs count as -inf; an all -inf row gets output 0 and LSE -inf; a source of
    weight 0 contributes exactly 0 even if its partial holds NaN.

    Raises:
        ValueError: shapes other than ``[N, B, H, D]`` / ``[N, B, H]`` or that disagree,
            ``N == 0``, ``D == 0``, tensors on different devices.
        TypeError: non-tensor or non-floating arguments; a non-bool ``is_lse_base_on_e``.
    """
    is_lse_base_on_e = check_bool("is_lse_base_on_e", is_lse_base_on_e)
    validate_merge_inputs(partial_outs, partial_lses, any_float=True)
    # fp64 when either input is: fp64 LSEs rounded to fp32 first would lose the difference of
    # close large LSEs, and turn an LSE beyond fp32's range into +inf (an "empty" source).
    fp64 = torch.float64 in (partial_outs.dtype, partial_lses.dtype)
    compute = torch.float64 if fp64 else torch.float32
    lses = sanitize_lse(partial_lses.to(compute))
    neg_inf = float("-inf")
    m = lses.amax(dim=0)
    m = torch.where(m == neg_inf, 0.0, m)  # stabiliser of an all-empty row is 0
    # b^(l - m) / S rather than b^(l - L): l - m is exact for close values, so LSEs of
    # magnitude 1e4 keep full relative precision in the weights.
    scaled = torch.exp(lses - m) if is_lse_base_on_e else torch.exp2(lses - m)
    total = scaled.sum(dim=0)
    lse = (torch.log(total) if is_lse_base_on_e else torch.log2(total)) + m  # -inf if all empty
    weights = scaled * (1.0 / total)  # as the kernel: one reciprocal per row
    weights = torch.where(lses == neg_inf, 0.0, weights)  # also kills -inf - (-inf) = NaN
    w = weights.unsqueeze(-1)
    contrib = torch.where(w == 0.0, 0.0, partial_outs.to(compute) * w)
    out = contrib.sum(dim=0).to(partial_outs.dtype)
    return out, lse
