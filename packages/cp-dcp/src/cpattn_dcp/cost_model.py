"""Predicted time of each combine path, for ``comm_backend="auto"``.

Per path and timing mode (``graph`` or eager), ``t_us = c0 + c1 * (N - 1) + c2 * MB + c3 * MB *
(N - 1) / N`` with non-negative coefficients (so predictions grow with B, H, D and element size);
``MB``: the megabytes one rank hands to the combine, ``B * H * (D * s + 4)`` for the A2A paths,
``B * H * (D * s + 4 * N)`` for AG+RS. ``cost_model.json`` holds the coefficients, fitted by
``benchmarks/fit_cost_model.py`` from ``benchmarks/nvidia-h200-x4.json``.
"""

from __future__ import annotations

import functools
import importlib.resources
import json

import torch

from cpattn_common.checks import check_bool, check_dtype, check_positive_int

#: Combine paths of ``DCPManager`` without PCP, in the order the ties go.
PATHS = ("direct_a2a", "a2a", "ag_rs")
#: Element sizes of the output dtypes the combines take.
_ITEMSIZE = {torch.float16: 2, torch.bfloat16: 2, torch.float32: 4}


@functools.cache
def coefficients() -> dict[str, dict[str, tuple[float, ...]]]:
    """The shipped coefficients: ``{path: {"eager" | "graph": (c0, c1, c2, c3)}}`` (µs, µs per
    peer, µs per MB, µs per MB crossing the links).

    Raises:
        RuntimeError: ``cost_model.json`` lacks a path or a mode, or a coefficient is negative.
    """
    text = importlib.resources.files("cpattn_dcp").joinpath("cost_model.json").read_text()
    raw = json.loads(text)["coefficients"]
    out: dict[str, dict[str, tuple[float, ...]]] = {}
    for path in PATHS:
        modes = raw.get(path, {})
        out[path] = {m: tuple(float(c) for c in modes.get(m, ())) for m in ("eager", "graph")}
        if any(len(cs) != 4 or min(cs) < 0 for cs in out[path].values()):
            raise RuntimeError(f"cost_model.json: bad coefficients for {path!r}: {modes!r}")
    return out


def cost_features(
    path: str, *, batch: int, num_heads: int, head_dim: int, world_size: int, dtype: torch.dtype
) -> tuple[float, float, float, float]:
    """The features ``(1, N - 1, MB, MB * (N - 1) / N)`` of one combine of a ``[batch,
    num_heads, head_dim]`` partial output (``num_heads``: the combine input's heads, N*H_r).

    Raises:
        TypeError: a size that is not an int (or is a bool); ``dtype`` not a ``torch.dtype``.
        ValueError: ``path`` not in ``PATHS``; a size < 1; ``world_size`` < 2 (a group of one
            exchanges nothing); ``num_heads`` not a multiple of ``world_size``; a dtype other
            than fp16/bf16/fp32.
    """
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    b = check_positive_int("batch", batch)
    h = check_positive_int("num_heads", num_heads)
    d = check_positive_int("head_dim", head_dim)
    n = check_positive_int("world_size", world_size)
    if n < 2:
        raise ValueError(f"world_size must be >= 2 (a group of one exchanges nothing), got {n}")
    if h % n:
        raise ValueError(f"num_heads {h} (the combine input's heads) is not a multiple of {n}")
    itemsize = _ITEMSIZE.get(check_dtype("dtype", dtype))
    if itemsize is None:
        raise ValueError(f"dtype must be float16, bfloat16 or float32, got {dtype}")
    mb = b * h * (d * itemsize + (4 * n if path == "ag_rs" else 4)) / 1e6
    return (1.0, n - 1.0, mb, mb * (n - 1) / n)


def predict_us(
    path: str,
    *,
    batch: int,
    num_heads: int,
    head_dim: int,
    world_size: int,
    dtype: torch.dtype,
    graph: bool = False,
) -> float:
    """Predicted microseconds of one combine by ``path`` of a ``[batch, num_heads, head_dim]``
    partial output over ``world_size`` ranks (``num_heads``: the combine input's heads, N*H_r),
    eager or (``graph=True``) replayed in a CUDA graph.

    Raises:
        TypeError, ValueError: as ``cost_features``; ``graph`` not a bool (TypeError).
    """
    mode = "graph" if check_bool("graph", graph) else "eager"
    feats = cost_features(
        path, batch=batch, num_heads=num_heads, head_dim=head_dim, world_size=world_size,
        dtype=dtype,
    )  # fmt: skip
    return sum(c * f for c, f in zip(coefficients()[path][mode], feats, strict=True))


def fastest_combine(
    *,
    batch: int,
    num_heads: int,
    head_dim: int,
    world_size: int,
    dtype: torch.dtype,
    direct_available: bool,
    graph: bool = False,
) -> tuple[str, str]:
    """The combine path with the lowest predicted time and a one-line reason, e.g.
    ``("a2a", "cost model at B=64, H=128, D=512, N=4, bfloat16, eager: a2a 162.3 us, ag_rs
    175.0 us; direct A2A unavailable")``. ``direct_a2a`` is a candidate only when
    ``direct_available``.

    Raises:
        TypeError, ValueError: as ``predict_us``; ``direct_available`` not a bool (TypeError).
    """
    direct = check_bool("direct_available", direct_available)
    times = {
        p: predict_us(p, batch=batch, num_heads=num_heads, head_dim=head_dim,
                      world_size=world_size, dtype=dtype, graph=graph)
        for p in PATHS
        if direct or p != "direct_a2a"
    }  # fmt: skip
    best = min(times, key=lambda p: times[p])  # first of PATHS on a tie
    ranked = ", ".join(f"{p} {t:.1f} us" for p, t in sorted(times.items(), key=lambda kv: kv[1]))
    where = (
        f"B={batch}, H={num_heads}, D={head_dim}, N={world_size}, "
        f"{str(dtype).removeprefix('torch.')}, {'graph' if graph else 'eager'}"
    )
    tail = "" if direct else "; direct A2A unavailable"
    return best, f"cost model at {where}: {ranked}{tail}"
