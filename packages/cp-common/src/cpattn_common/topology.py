"""TP / PCP / DCP groups of a world in one consistent rank layout (docs/packages/common.md,
"Rank layout").

World ranks form a mesh ``[R, PCP, TP/T_in, T_in]`` with TP innermost (``T_in`` the TP share of
a DCP group); a DCP group spans the PCP axis before TP, and the TP-inner group holds the TP ranks
of this rank's DCP group in its PCP slice. Group ranks follow ascending global rank.
``cp_layout`` is the pure arithmetic; ``build_cp_groups`` creates the process groups
(collective) and checks them against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from cpattn_common.checks import check_positive_int
from cpattn_common.group import CPGroup

__all__ = ["CPGroups", "CPLayout", "build_cp_groups", "cp_layout"]


@dataclass(frozen=True)
class CPLayout:
    """The rank lists of every TP / PCP / DCP group of a world.

    Attributes:
        world_size, tp_size, pcp_size, dcp_size: the sizes.
        mesh_shape: ``(R, PCP, TP // T_in, T_in)``, the mesh the groups are cut from.
        tp_groups, pcp_groups, dcp_groups: every group's global ranks, ascending.
        tp_inner_groups: the TP-inner groups (module docstring), ascending.
    """

    world_size: int
    tp_size: int
    pcp_size: int
    dcp_size: int
    mesh_shape: tuple[int, int, int, int]
    tp_groups: list[list[int]]
    pcp_groups: list[list[int]]
    dcp_groups: list[list[int]]
    tp_inner_groups: list[list[int]]

    def group_of(self, kind: str, rank: int) -> list[int]:
        """The ``kind`` (``"tp"``, ``"pcp"``, ``"dcp"``, ``"tp_inner"``) group that holds
        global ``rank``."""
        kinds = ["dcp", "pcp", "tp", "tp_inner"]
        if kind not in kinds:
            raise ValueError(f"kind must be one of {kinds}, got {kind!r}")
        groups: list[list[int]] = getattr(self, f"{kind}_groups")
        for g in groups:
            if rank in g:
                return g
        raise ValueError(f"rank {rank} is not in the world of size {self.world_size}")


def _inner_tp(tp_size: int, pcp_size: int, dcp_size: int) -> int:
    if dcp_size == 1:
        return 1
    if pcp_size == 1:
        if tp_size % dcp_size:
            raise ValueError(
                f"dcp_size {dcp_size} must divide tp_size {tp_size} when pcp_size is 1"
            )
        return dcp_size
    if dcp_size % pcp_size or tp_size % (dcp_size // pcp_size):
        raise ValueError(
            f"with pcp_size {pcp_size} > 1, dcp_size {dcp_size} must be pcp_size times a "
            f"divisor of tp_size {tp_size}"
        )
    return dcp_size // pcp_size


def cp_layout(world_size: int, *, tp_size: int, pcp_size: int = 1, dcp_size: int = 1) -> CPLayout:
    """Rank lists of the TP / PCP / DCP groups (pure arithmetic, no process group needed).

    ``world_size`` is a multiple of ``pcp_size * tp_size``; ``dcp_size`` follows the module
    docstring's rules.

    Raises:
        TypeError: a size that is not an int.
        ValueError: a size < 1, or sizes that do not fit together.

    Example:
        >>> cp_layout(8, tp_size=4, pcp_size=2, dcp_size=4).dcp_groups
        [[0, 1, 4, 5], [2, 3, 6, 7]]
    """
    sizes = dict(world_size=world_size, tp_size=tp_size, pcp_size=pcp_size, dcp_size=dcp_size)
    for name, value in sizes.items():
        check_positive_int(name, value)
    if world_size % (pcp_size * tp_size):
        raise ValueError(
            f"world_size {world_size} is not a multiple of pcp_size * tp_size = "
            f"{pcp_size} * {tp_size}"
        )
    t_in = _inner_tp(tp_size, pcp_size, dcp_size)
    reps = world_size // (pcp_size * tp_size)
    shape = (reps, pcp_size, tp_size // t_in, t_in)
    mesh = torch.arange(world_size).reshape(shape)

    def groups(t: torch.Tensor, size: int) -> list[list[int]]:
        return sorted(sorted(g) for g in t.reshape(-1, size).tolist())

    tp = groups(mesh, tp_size)  # dims 2, 3 innermost
    pcp = groups(mesh.permute(0, 2, 3, 1), pcp_size)
    dcp_size_eff = pcp_size * t_in if dcp_size > 1 else 1
    dcp = groups(mesh.permute(0, 2, 1, 3), dcp_size_eff)
    tp_inner = groups(mesh, t_in)  # dim 3 innermost
    return CPLayout(world_size, tp_size, pcp_size, dcp_size, shape, tp, pcp, dcp, tp_inner)


@dataclass
class CPGroups:
    """This rank's groups, created by ``build_cp_groups``.

    Attributes:
        tp, pcp, dcp: ``CPGroup`` wrappers of this rank's TP, PCP and DCP groups.
        layout: the full ``CPLayout``.
        mesh: the ``DeviceMesh`` the groups were cut from (``None`` where it was not usable).
        tp_inner: this rank's TP-inner group (module docstring): pass it as ``tp_group`` to
            ``cpattn_pcp``'s query gather and ``finalize_mla_pcp_decode`` when the DCP group
            spans TP x PCP.
    """

    tp: CPGroup
    pcp: CPGroup
    dcp: CPGroup
    layout: CPLayout
    mesh: Any
    tp_inner: CPGroup


def _enumerate_group(groups: list[list[int]], rank: int) -> Any:
    """Create every group of the list (collective) and return the one with ``rank``."""
    mine: Any = None
    for ranks in groups:
        pg = dist.new_group(ranks)
        if rank in ranks:
            mine = pg
    return mine


def build_cp_groups(
    *,
    tp_size: int,
    pcp_size: int = 1,
    dcp_size: int = 1,
    device_type: str | None = None,
    use_device_mesh: bool = True,
) -> CPGroups:
    """Create this rank's TP / PCP / DCP groups (collective over the whole world).

    Uses ``init_device_mesh`` with dims ``("rep", "pcp", "tp_outer", "tp_inner")``; TP and DCP
    groups are flattened mesh dims. Where the installed torch cannot flatten a mesh, the same
    rank lists are created with ``dist.new_group``. Every group is checked against
    ``cp_layout``.

    Args:
        tp_size, pcp_size, dcp_size: as for ``cp_layout``.
        device_type: ``"cuda"`` or ``"cpu"``; default: the default group's backend decides.
        use_device_mesh: ``False`` skips ``DeviceMesh`` and enumerates the groups directly.
    """
    if not dist.is_initialized():
        raise RuntimeError("build_cp_groups needs torch.distributed to be initialised")
    world, rank = dist.get_world_size(), dist.get_rank()
    layout = cp_layout(world, tp_size=tp_size, pcp_size=pcp_size, dcp_size=dcp_size)
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh: Any = None
    try:
        if not use_device_mesh:
            raise NotImplementedError("DeviceMesh not requested")
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(
            device_type, layout.mesh_shape, mesh_dim_names=("rep", "pcp", "tp_outer", "tp_inner")
        )
        pcp_pg = mesh.get_group("pcp")
        tp_pg = mesh["tp_outer", "tp_inner"]._flatten("tp").get_group()
        tp_inner_pg = mesh.get_group("tp_inner")
        if dcp_size == 1:  # singleton DCP groups (tp_inner has size 1)
            dcp_pg = tp_inner_pg
        else:
            dcp_pg = mesh["pcp", "tp_inner"]._flatten("dcp").get_group()
    except Exception:  # older torch without _flatten / slicing: same layout, plain groups
        mesh = None
        tp_pg = _enumerate_group(layout.tp_groups, rank)
        pcp_pg = _enumerate_group(layout.pcp_groups, rank)
        dcp_pg = _enumerate_group(layout.dcp_groups, rank)
        tp_inner_pg = _enumerate_group(layout.tp_inner_groups, rank)
    groups = CPGroups(
        CPGroup(tp_pg), CPGroup(pcp_pg), CPGroup(dcp_pg), layout, mesh, CPGroup(tp_inner_pg)
    )
    for kind in ("tp", "pcp", "dcp", "tp_inner"):
        got, want = getattr(groups, kind).ranks, layout.group_of(kind, rank)
        if got != want:
            raise RuntimeError(f"{kind} group of rank {rank} is {got}, layout says {want}")
    return groups
