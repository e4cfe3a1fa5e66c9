"""Query-head bookkeeping when PCP and DCP are combined (TP x PCP x DCP layouts).

Which group the query is all-gathered over, and how ``finalize_mla_pcp_decode`` reconciles the
combined output's heads, follow from the layout: docs/packages/pcp.md, "Heads across TP x PCP x
DCP". "The TP group" (``tp_group=``) means ``cpattn_common.CPGroups.tp_inner``. Inference only:
with grad mode on, a tensor that requires grad raises ``RuntimeError`` whenever the layout makes
the call gather; calls that return or slice their input keep the ordinary gradient.
"""

from __future__ import annotations

import torch

from cpattn_common.agreement import check_tensor_agreement
from cpattn_common.checks import check_bool, check_state, check_tensors
from cpattn_common.dispatch import refuse_grad
from cpattn_common.group import CPGroupLike
from cpattn_pcp._group import GroupArg, optional_group, resolve_group
from cpattn_pcp._layout import check_size, gather_axis

__all__ = [
    "cp_reconcile_heads",
    "dcp_q_gather_group",
    "dcp_q_gather_size",
    "finalize_mla_pcp_decode",
    "maybe_all_gather_q_for_dcp",
]


def _checked(group: CPGroupLike, expected: int, name: str, layout: str) -> CPGroupLike:
    if group.world_size != expected:
        raise ValueError(f"{name} has world size {group.world_size}, but {layout} needs {expected}")
    return group


def dcp_q_gather_group(
    dcp_world_size: int,
    pcp_world_size: int,
    *,
    tp_group: GroupArg | None = None,
    dcp_group: GroupArg | None = None,
) -> CPGroupLike | None:
    """The group to all-gather the query heads over before DCP attention, or ``None``.

    Args:
        dcp_world_size: ``N_dcp >= 1``.
        pcp_world_size: ``N_pcp >= 1``.
        tp_group: the TP ranks of the DCP group in this PCP slice (``CPGroups.tp_inner``);
            required when ``N_dcp > N_pcp > 1`` (size ``N_dcp / N_pcp``).
        dcp_group: the DCP group; required when ``N_pcp == 1 < N_dcp`` (size ``N_dcp``).

    Returns:
        The selected group as a ``CPGroupLike``, or ``None`` when no gather is needed.

    Raises:
        ValueError: an unsupported layout (``1 < N_dcp < N_pcp``, or ``N_dcp`` not a multiple
            of ``N_pcp``), a missing group, or a group whose size does not fit the layout.
    """
    axis = gather_axis(dcp_world_size, pcp_world_size)
    layout = f"dcp_world_size={dcp_world_size}, pcp_world_size={pcp_world_size}"
    if axis == "dcp":
        group = resolve_group(dcp_group, "dcp_group", f"for {layout}")
        return _checked(group, dcp_world_size, "dcp_group", layout)
    if axis == "tp":
        group = resolve_group(tp_group, "tp_group", f"for {layout}")
        return _checked(group, dcp_world_size // pcp_world_size, "tp_group", layout)
    return None


def dcp_q_gather_size(
    dcp_world_size: int,
    pcp_world_size: int,
    *,
    tp_group: GroupArg | None = None,
    dcp_group: GroupArg | None = None,
) -> int:
    """World size of the query-gather group (``1`` when there is none).

    Use it to size work planned before the gather (e.g. ahead-of-time attention scheduler
    metadata for ``H_local * size`` heads). Groups are optional: without them the size follows
    from the layout (``N_dcp`` when ``N_pcp == 1``, ``N_dcp / N_pcp`` when ``N_dcp > N_pcp``,
    else ``1``); with them it is checked against the group.

    Args:
        dcp_world_size: ``N_dcp >= 1``.
        pcp_world_size: ``N_pcp >= 1``.
        tp_group: optional TP group (checked when it would be selected).
        dcp_group: optional DCP group (checked when it would be selected).

    Returns:
        The number of ranks the query heads are gathered from.

    Raises:
        ValueError: as in ``dcp_q_gather_group``.
    """
    axis = gather_axis(dcp_world_size, pcp_world_size)
    if axis == "dcp":
        if dcp_group is not None:
            dcp_q_gather_group(dcp_world_size, pcp_world_size, dcp_group=dcp_group)
        return dcp_world_size
    if axis == "tp":
        if tp_group is not None:
            dcp_q_gather_group(dcp_world_size, pcp_world_size, tp_group=tp_group)
        return dcp_world_size // pcp_world_size
    return 1


def maybe_all_gather_q_for_dcp(
    q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    dcp_world_size: int,
    pcp_world_size: int,
    already_replicated: bool = False,
    *,
    tp_group: GroupArg | None = None,
    dcp_group: GroupArg | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """All-gather the query heads over the group the layout needs (see the module docstring).

    Args:
        q: ``[T, H_local, D]``, or an MLA ``(q_nope [T, H_local, D_nope], q_pe [T, H_local,
            D_rope])`` pair.
        dcp_world_size: ``N_dcp``.
        pcp_world_size: ``N_pcp``.
        already_replicated: the query already holds every head (e.g. a replicated projection):
            returned untouched, and no group is needed.
        tp_group: the TP group (needed when ``N_dcp > N_pcp > 1``).
        dcp_group: the DCP group (needed when ``N_pcp == 1 < N_dcp``).

    Returns:
        ``q`` itself (a tuple stays a tuple) when no gather happens; otherwise one tensor
        ``[T, H_local * G, D]`` (a pair is concatenated to ``D_nope + D_rope`` first), heads in
        group-rank order, ``G`` the gather group's size.

    Raises:
        ValueError: as in ``dcp_q_gather_group``; mismatched ``(nope, pe)`` leading shapes,
            dtypes or devices.
        TypeError: ``q`` neither a tensor nor a ``(nope, pe)`` tuple of tensors (a list, say);
            ``already_replicated`` not a bool.
        RuntimeError: the layout needs a gather, grad mode is on and ``q`` (or either tensor
            of the pair) requires grad: the all-gather has no autograd formula.
    """
    if isinstance(q, tuple):
        if len(q) != 2:
            raise ValueError(f"a tuple query must be (nope, pe), got {len(q)} tensors")
        nope, pe = q
        check_tensors("maybe_all_gather_q_for_dcp", **{"q[0] (nope)": nope, "q[1] (pe)": pe})
        if nope.dim() != 3 or pe.dim() != 3 or nope.shape[:2] != pe.shape[:2]:
            raise ValueError(
                f"(nope, pe) must be [T, H, D_nope] and [T, H, D_rope] with equal T and H, got "
                f"{tuple(nope.shape)} and {tuple(pe.shape)}"
            )
        if nope.dtype != pe.dtype or nope.device != pe.device:
            raise ValueError(
                f"(nope, pe) must share dtype and device, got {nope.dtype} on {nope.device} and "
                f"{pe.dtype} on {pe.device}"
            )
    elif not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a tensor or a (nope, pe) tuple, got {type(q).__name__}")
    elif q.dim() < 2:
        raise ValueError(f"q must be [T, H, D], got shape {tuple(q.shape)}")
    # Checked, not truthy: a group passed positionally landed here and skipped the gather.
    if check_bool("already_replicated", already_replicated):
        gather_axis(dcp_world_size, pcp_world_size)  # the layout is still checked
        return q
    group = dcp_q_gather_group(
        dcp_world_size, pcp_world_size, tp_group=tp_group, dcp_group=dcp_group
    )
    if group is None or group.world_size == 1:
        return q
    if isinstance(q, tuple):
        refuse_grad("maybe_all_gather_q_for_dcp", **{"q[0] (nope)": q[0], "q[1] (pe)": q[1]})
    else:
        refuse_grad("maybe_all_gather_q_for_dcp", q=q)
    full = torch.cat(q, dim=-1) if isinstance(q, tuple) else q
    if check_state.enabled:
        check_tensor_agreement("maybe_all_gather_q_for_dcp", group, "q", full)
    return group.all_gather(full, dim=1)


def finalize_mla_pcp_decode(
    output: torch.Tensor,
    num_heads: int,
    *,
    pcp_group: GroupArg | None = None,
    tp_group: GroupArg | None = None,
) -> torch.Tensor:
    """Bring a combined decode output back to this TP rank's ``num_heads`` heads.

    ``H_out < num_heads`` (the combine split heads over PCP): all-gather over ``pcp_group``
    along dim 1 (needs ``H_out * N_pcp == num_heads``); ``H_out > num_heads`` (it kept every TP
    rank's heads): keep heads ``[tp_rank * num_heads, (tp_rank + 1) * num_heads)`` (needs
    ``H_out == num_heads * N_tp``); equal: returned unchanged.

    Args:
        output: ``[B, H_out, D]``.
        num_heads: heads this TP rank owns.
        pcp_group: the PCP group (needed when ``H_out < num_heads``).
        tp_group: the group the query was gathered over (needed when ``H_out > num_heads``;
            ``CPGroups.tp_inner``, see the module docstring).

    Returns:
        ``[B, num_heads, D]`` (``output`` itself when already right; a view when sliced).

    Raises:
        TypeError: ``output`` is not a tensor; ``num_heads`` is not an int.
        ValueError: head counts that do not divide as described, or a missing group.
        RuntimeError: ``H_out < num_heads`` (the gather), grad mode is on and ``output``
            requires grad: the all-gather has no autograd formula. (The slice keeps its
            ordinary gradient.)
    """
    check_size(num_heads, "num_heads")
    check_tensors("finalize_mla_pcp_decode", output=output)
    if output.dim() < 2:
        raise ValueError(f"output must be [B, H, D], got shape {tuple(output.shape)}")
    have = output.shape[1]
    if have == num_heads:
        return output
    if have < num_heads:
        refuse_grad("finalize_mla_pcp_decode", output=output)
        group = resolve_group(pcp_group, "pcp_group", f"to gather {have} -> {num_heads} heads")
        if have * group.world_size != num_heads:
            raise ValueError(
                f"output has {have} heads; gathering over pcp_group (size {group.world_size}) "
                f"gives {have * group.world_size}, not num_heads = {num_heads}"
            )
        if check_state.enabled:
            check_tensor_agreement("finalize_mla_pcp_decode", group, "output", output)
        return group.all_gather(output, dim=1)
    tp = optional_group(tp_group)
    if tp is None:
        raise ValueError(f"tp_group= is required to slice {have} -> {num_heads} heads")
    if have != num_heads * tp.world_size:
        raise ValueError(
            f"output has {have} heads, expected num_heads * tp world size = {num_heads} * "
            f"{tp.world_size} = {num_heads * tp.world_size}"
        )
    start = tp.rank_in_group * num_heads
    return output[:, start : start + num_heads]


#: vLLM's other name for ``finalize_mla_pcp_decode`` (the same function), so code written against
#: either name switches by changing the import.
cp_reconcile_heads = finalize_mla_pcp_decode
