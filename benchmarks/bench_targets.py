"""The project's performance targets, judged on a results file (the page's last section).

- Bandwidth (issues 3 and 5): at B = 4096, bf16, H=128 D=512 and H=64 D=128, N in {2, 4, 8},
  achieved bytes/s >= 85% of the device-to-device copy of the same run.
- Decode (issue 5): B in {1, 8, 64} in CUDA-graph replay within 1.5x the time of a device copy
  of the same bytes replayed the same way (``size_copy_ratio >= 1 / 1.5``).
- Host (issue 36): an eager call of our op costs <= 0.9x the host time of the engine pattern
  for the same work (``torch.empty`` of its outputs + a plain ``kernel[grid](...)`` launch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from bench_results import HostRow, KernelRow, Results

HEAD_SHAPES: tuple[tuple[int, int], ...] = ((128, 512), (64, 128))
MASK_SHAPES: tuple[tuple[int, int], ...] = ((128, 0), (64, 0))
ALL_N: tuple[int, ...] = (2, 4, 8)
DECODE_B: tuple[int, ...] = (1, 8, 64)
COPY_FRACTION = 0.85
DECODE_RATIO = 1.5
HOST_RATIO = 0.9
BANDWIDTH_OPS = ("merge_attn_states", "correct_attn_out", "a2a_pack", "a2a_unpack_combine")
ALL_OPS = (*BANDWIDTH_OPS, "mask_dcp_empty_shards_")

Status = Literal["met", "not met", "incomplete", "not measured"]


@dataclass(frozen=True)
class Target:
    """Every selected row must satisfy ``metric op threshold``.

    Rows of ``table`` are selected by kernel and by the non-empty selectors; the expected rows
    are the product of the selectors, or, when one is empty (any), the selected rows present,
    measured or not (an errored row counts as expected and unmeasured).
    """

    name: str
    rule: str
    table: Literal["kernels", "host"]
    kernel: str
    metric: str
    op: Literal[">=", "<="]
    threshold: float
    dtypes: tuple[str, ...] = ()
    shapes: tuple[tuple[int, int], ...] = ()
    ns: tuple[int, ...] = ()
    bs: tuple[int, ...] = ()


@dataclass(frozen=True)
class Outcome:
    status: Status
    passed: int
    expected: int
    worst: float | None
    where: str


def targets() -> list[Target]:
    """Every target, in page order."""
    out = [
        Target(
            name=f"bw/{k}",
            rule="B=4096 ≥ 85% of the copy bandwidth",
            table="kernels",
            kernel=k,
            metric="copy_ratio",
            op=">=",
            threshold=COPY_FRACTION,
            dtypes=("bfloat16",),
            shapes=HEAD_SHAPES,
            ns=ALL_N,
            bs=(4096,),
        )
        for k in BANDWIDTH_OPS
    ]
    for k in ALL_OPS:
        mask = k == "mask_dcp_empty_shards_"
        out.append(
            Target(
                name=f"decode/{k}",
                rule="B ≤ 64 in graph replay ≤ 1.5× a same-size copy",
                table="kernels",
                kernel=k,
                metric="size_copy_ratio",
                op=">=",
                threshold=1 / DECODE_RATIO,
                dtypes=("float32",) if mask else ("bfloat16",),
                shapes=MASK_SHAPES if mask else HEAD_SHAPES,
                ns=(0,) if mask else ALL_N,
                bs=DECODE_B,
            )
        )
    out += [
        Target(
            name=f"host/{k}",
            rule="host time ≤ 0.9× `torch.empty` + `kernel[grid]`",
            table="host",
            kernel=k,
            metric="ratio",
            op="<=",
            threshold=HOST_RATIO,
        )
        for k in ALL_OPS
    ]
    return out


def _value(row: KernelRow | HostRow, name: str) -> float | None:
    value = getattr(row, name, None)
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def evaluate(target: Target, results: Results) -> Outcome:
    """Check ``target`` against the rows of ``results``."""
    rows: list[Any] = results.kernels if target.table == "kernels" else results.host
    expected: set[tuple[Any, ...]] = set()
    wildcard = not (target.dtypes and target.shapes and target.ns and target.bs)
    if not wildcard:
        expected = {
            (dt, h, d, n, b)
            for dt in target.dtypes
            for h, d in target.shapes
            for n in target.ns
            for b in target.bs
        }
    measured: dict[tuple[Any, ...], bool] = {}
    worst: float | None = None
    where = ""
    for row in rows:
        key = (row.dtype, row.H, row.D, row.N, row.B)
        if row.kernel != target.kernel or (not wildcard and key not in expected):
            continue
        if wildcard:
            expected.add(key)
        value = _value(row, target.metric) if row.status == "ok" else None
        if value is None:
            continue
        ok = value >= target.threshold if target.op == ">=" else value <= target.threshold
        measured[key] = ok
        if worst is None or (value < worst if target.op == ">=" else value > worst):
            worst, where = value, f"{row.dtype} H={row.H} D={row.D} N={row.N} B={row.B}"
    passed = sum(measured.values())
    status: Status
    if not measured:
        status = "not measured"
    elif passed < len(measured):
        status = "not met"
    elif len(measured) < len(expected):
        status = "incomplete"
    else:
        status = "met"
    return Outcome(status, passed, len(expected), worst, where)
