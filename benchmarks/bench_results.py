"""The results JSON of a benchmark run: its rows, schema check, load / save, and the kernel-time
comparison of two runs (``run.py --compare``).

One file per machine kind lives next to this module (``nvidia-h200.json``: one GPU, the ops'
kernel and host rows; ``nvidia-h200-x4.json``: four GPUs, the collectives); the page
``docs/performance.md`` is rendered from them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = "cpattn-bench/2"
DEFAULT_L2_BYTES = 60 * 1000 * 1000


@dataclass
class KernelRow:
    """One op at one shape: ours timed, the eager PyTorch baseline timed, derived ratios.

    ``N`` / ``D`` are 0 where the op does not depend on them (the empty-shard mask). ``bytes``
    follows the op's byte formula (each input read once, each output written once).
    ``timing``: ``cuda_graph`` (per call in a replayed graph), ``cold`` (CUDA events, L2
    emptied before each call) or ``wall`` (CPU smoke run).
    """

    kernel: str
    dtype: str
    H: int
    D: int
    N: int
    B: int
    bytes: int
    timing: str = "none"
    ms: float | None = None
    ms_p20: float | None = None
    ms_p80: float | None = None
    bytes_per_s: float | None = None
    copy_ratio: float | None = None  # of the large copy's bandwidth
    size_copy_ratio: float | None = None  # of a copy of the same bytes, timed the same way
    eager_timing: str = "none"
    eager_ms: float | None = None
    eager_speedup: float | None = None  # eager time / ours
    check_rel_err: float | None = None
    input_sets: int = 1
    status: str = "ok"


@dataclass
class HostRow:
    """Host time of one eager call of an op, and of the engine pattern for the same work:
    ``torch.empty`` of the op's outputs plus a plain ``kernel[grid](...)`` launch of each
    kernel the op launched, with the same arguments (``baseline_us``); ``ratio`` = median over
    rounds of ours / baseline; ``launches`` = kernel launches per call of the op. Check mode
    (``cpattn_common.checks``): ``check_reads`` = reads of the switch per call, ``checks_off_ns``
    = their cost when it is off (reads x one read's time), ``checks_on_us`` = the op's host time
    with it on."""

    kernel: str
    dtype: str
    H: int
    D: int
    N: int
    B: int
    host_us: float | None = None
    baseline_us: float | None = None
    ratio: float | None = None
    launches: int = 0
    check_reads: int = 0
    checks_off_ns: float | None = None
    checks_on_us: float | None = None
    status: str = "ok"


@dataclass
class CollectiveRow:
    """One collective (ours or bare NCCL) at one shape, max over ranks of the per-rank median."""

    op: str
    world_size: int
    dtype: str
    H: int
    D: int
    B: int
    bytes: int
    byte_formula: str
    latency_us: float | None = None
    algbw_bytes_per_s: float | None = None
    busbw_bytes_per_s: float | None = None
    status: str = "ok"


@dataclass
class References:
    """Reference points measured in the same run as the rows."""

    copy_bytes: int = 0
    copy_ms: float | None = None
    copy_bytes_per_s: float | None = None
    empty_graph_us: float | None = None
    touch_graph_us: float | None = None
    empty_launch_host_us: float | None = None
    add_host_us: float | None = None
    calls_per_graph: int = 64
    l2_bytes: int = DEFAULT_L2_BYTES
    host_calls: int = 1000
    host_rounds: int = 7


@dataclass
class Results:
    """Everything one run produced; serialised as the results JSON file."""

    env: dict[str, str]
    mode: str
    references: References
    kernels: list[KernelRow] = field(default_factory=list)
    host: list[HostRow] = field(default_factory=list)
    collectives_status: str = "not run"
    collectives: list[CollectiveRow] = field(default_factory=list)
    byte_formulas: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    elapsed_s: float | None = None
    schema: str = SCHEMA


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite_or_none(v) for v in value]
    return value


def results_to_dict(results: Results) -> dict[str, Any]:
    """Plain-JSON form of ``results`` (non-finite numbers become ``null``: strict JSON)."""
    data: dict[str, Any] = _finite_or_none(dataclasses.asdict(results))
    return data


def _build(cls: type[Any], data: Mapping[str, Any]) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


def results_from_dict(data: Mapping[str, Any]) -> Results:
    """Inverse of :func:`results_to_dict`; raises ``ValueError`` naming every schema problem."""
    errors = validate_results_dict(data)
    if errors:
        raise ValueError("invalid results file: " + "; ".join(errors))
    results: Results = _build(Results, data)
    results.references = _build(References, data["references"])
    results.kernels = [_build(KernelRow, r) for r in data.get("kernels", [])]
    results.host = [_build(HostRow, r) for r in data.get("host", [])]
    results.collectives = [_build(CollectiveRow, r) for r in data.get("collectives", [])]
    return results


_KEY_INTS = {"H": int, "D": int, "N": int, "B": int}
_ROW_REQUIRED: dict[str, dict[str, type]] = {
    "kernels": {"kernel": str, "dtype": str, **_KEY_INTS, "bytes": int, "status": str},
    "host": {"kernel": str, "dtype": str, **_KEY_INTS, "status": str},
    "collectives": {"op": str, "world_size": int, "B": int, "status": str},
}
_ROW_NUMBERS = {
    table: {f.name for f in dataclasses.fields(cls) if "float" in str(f.type)}
    for table, cls in (("kernels", KernelRow), ("host", HostRow), ("collectives", CollectiveRow))
}
ENV_KEYS = ("date", "device", "device_count", "driver", "cuda", "torch", "triton", "git_commit")


def validate_results_dict(data: Mapping[str, Any]) -> list[str]:
    """Schema problems of a loaded results file (empty list when it is valid)."""
    errors: list[str] = []
    if data.get("schema") != SCHEMA:
        errors.append(f"schema is {data.get('schema')!r}, expected {SCHEMA!r}")
    for key, kind in (("env", dict), ("mode", str), ("references", dict)):
        if not isinstance(data.get(key), kind):
            errors.append(f"{key!r} missing or not a {kind.__name__}")
    env = data.get("env")
    if isinstance(env, dict):
        errors += [f"env[{k!r}] missing" for k in ENV_KEYS if not isinstance(env.get(k), str)]
    for table, required in _ROW_REQUIRED.items():
        rows = data.get(table, [])
        if not isinstance(rows, list):
            errors.append(f"{table!r} is not a list")
            continue
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                errors.append(f"{table}[{i}] is not an object")
                continue
            for key, want in required.items():
                value = row.get(key)
                if type(value) is not want:
                    errors.append(f"{table}[{i}].{key} = {value!r} has the wrong type")
            for key in _ROW_NUMBERS[table] & row.keys():
                value = row[key]
                if value is not None and (
                    not isinstance(value, (int, float)) or isinstance(value, bool)
                ):
                    errors.append(f"{table}[{i}].{key} = {value!r} is not a number or null")
    return errors


def save_results(results: Results, path: str | Path) -> Path:
    """Write ``results`` as indented JSON (parent folders created)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results_to_dict(results), indent=1, allow_nan=False) + "\n")
    return out


def load_results(path: str | Path) -> Results:
    """Read and validate a results JSON file."""
    return results_from_dict(json.loads(Path(path).read_text()))


def row_key(row: KernelRow) -> tuple[str, str, int, int, int, int]:
    """What identifies a kernel row across runs."""
    return (row.kernel, row.dtype, row.H, row.D, row.N, row.B)


def row_label(row: KernelRow) -> str:
    dims = f"H={row.H}" + (f" D={row.D}" if row.D else "") + (f" N={row.N}" if row.N else "")
    return f"{row.kernel} {row.dtype} {dims} B={row.B}"


def compare_kernels(new: Results, old: Results, *, tolerance: float = 0.03) -> str:
    """Report of every kernel row timed in both runs: new / old time per call, the slowest
    rows, the worst row and how many rows are more than ``tolerance`` slower. Timing methods
    must match (a decode row timed in graph replay is compared with a replay)."""
    before = {row_key(r): r for r in old.kernels if r.status == "ok" and r.ms}
    pairs: list[tuple[float, KernelRow, KernelRow]] = []
    for r in new.kernels:
        o = before.get(row_key(r))
        if r.status == "ok" and r.ms and o is not None and o.ms and o.timing == r.timing:
            pairs.append((r.ms / o.ms, r, o))
    if not pairs:
        return "no kernel row was timed in both runs (same key and timing method)"
    pairs.sort(key=lambda p: -p[0])
    slower = sum(ratio > 1 + tolerance for ratio, _, _ in pairs)
    lines = [
        f"{len(pairs)} kernel rows in both runs; new / old time per call: median "
        f"{statistics.median(p[0] for p in pairs):.3f}, {slower} rows more than "
        f"{tolerance:.0%} slower",
        f"{'new/old':>8}  {'new µs':>9}  {'old µs':>9}  timing      row",
    ]
    for ratio, r, o in pairs[:15]:
        lines.append(
            f"{ratio:8.3f}  {(r.ms or 0) * 1e3:9.3f}  {(o.ms or 0) * 1e3:9.3f}  {r.timing:<10}  "
            + row_label(r)
        )
    worst_ratio, worst, _ = pairs[0]
    lines.append(f"worst: {row_label(worst)} at {worst_ratio:.3f}x the old time")
    return "\n".join(lines)


def first_with(
    sources: Sequence[Results], what: str
) -> Results | None:  # "kernels", "host" or "collectives"
    """The first of ``sources`` holding a measured row of table ``what``."""
    for res in sources:
        if any(r.status == "ok" for r in getattr(res, what)):
            return res
    return None
