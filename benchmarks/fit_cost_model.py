"""Fit the combine cost model of ``cpattn_dcp.cost_model`` from the measured collectives and
print its held-out evaluation.

Reads the ``collectives`` rows of the results files (default: every ``benchmarks/*.json`` that
has some), fits per combine path and timing mode (eager, ``[graph]``) the non-negative
coefficients of ``cpattn_dcp.cost_model.cost_features`` by least squares in relative error,
and writes them to ``packages/cp-dcp/src/cpattn_dcp/cost_model.json`` (``--check``: compare
instead, exit 1 on a difference).

The evaluation refits with one fold left out (``--folds shape``: one (H, D); ``batch``: one B)
and, for every measured geometry of that fold, with and without the direct A2A, picks the path
of lowest predicted time and compares it with the measured fastest. Eager rows at
B <= ``GRAPH_MAX_B`` time the host (``bench_collectives``), so the worst slowdown is also given
over the device-bound rows (graph replays, eager B > ``GRAPH_MAX_B``).

    python3 benchmarks/fit_cost_model.py [--folds shape|batch] [--check] [FILE.json ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from pathlib import Path
from typing import NamedTuple

import torch
from bench_collectives import GRAPH_MAX_B, GRAPH_SUFFIX

from cpattn_dcp.cost_model import PATHS, cost_features

HERE = Path(__file__).resolve().parent
PACKAGE_JSON = HERE.parent / "packages/cp-dcp/src/cpattn_dcp/cost_model.json"
OPS = {
    "ours: AG+RS (cp_lse_ag_out_rs)": "ag_rs",
    "ours: A2A (dcp_a2a_lse_reduce)": "a2a",
    "ours: direct A2A": "direct_a2a",
}


class Geometry(NamedTuple):
    """One measured combine: world size, heads of the input, head dim, batch, dtype, and
    whether it was replayed in a CUDA graph."""

    n: int
    h: int
    d: int
    b: int
    dtype: str
    graph: bool

    @property
    def host_bound(self) -> bool:
        """An eager loop at decode sizes: it times the host (``bench_collectives``)."""
        return not self.graph and self.b <= GRAPH_MAX_B


@dataclasses.dataclass(frozen=True)
class Decision:
    geometry: Geometry
    direct: bool
    pick: str
    fastest: str
    slowdown: float  # measured time of the pick / of the fastest


def load_samples(files: list[Path]) -> dict[tuple[str, Geometry], float]:
    """``{(path, geometry): latency_us}`` of the combine rows with status ``ok``."""
    out: dict[tuple[str, Geometry], float] = {}
    for f in files:
        for r in json.loads(f.read_text()).get("collectives", []):
            graph = r["op"].endswith(GRAPH_SUFFIX)
            path = OPS.get(r["op"].removesuffix(GRAPH_SUFFIX))
            if path and r["status"] == "ok":
                geo = Geometry(r["world_size"], r["H"], r["D"], r["B"], r["dtype"], graph)
                out[(path, geo)] = float(r["latency_us"])
    return out


def _features(path: str, geo: Geometry) -> list[float]:
    dtype = getattr(torch, geo.dtype)
    f = cost_features(path, batch=geo.b, num_heads=geo.h, head_dim=geo.d, world_size=geo.n,
                      dtype=dtype)  # fmt: skip
    return list(f)


def _nnls_relative(x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """argmin_{c >= 0} sum(((x c - y) / y)^2): the best unconstrained fit over every subset of
    the columns whose solution is non-negative (the optimum is one of them)."""
    a, ones = x / y[:, None], torch.ones_like(y)
    best: tuple[float, list[float]] = (float("inf"), [])
    for k in range(1, x.shape[1] + 1):
        for cols in itertools.combinations(range(x.shape[1]), k):
            c = torch.linalg.lstsq(a[:, cols], ones[:, None]).solution[:, 0]
            loss = float(((a[:, cols] @ c - ones) ** 2).sum())
            if bool((c >= 0).all()) and loss < best[0]:
                full = [0.0] * x.shape[1]
                for i, v in zip(cols, c.tolist(), strict=True):
                    full[i] = v
                best = (loss, full)
    return best[1]


def fit(samples: dict[tuple[str, Geometry], float]) -> dict[str, dict[str, list[float]]]:
    """``{path: {"eager" | "graph": [c0, c1, c2, c3]}}`` fitted on ``samples``."""
    coefs: dict[str, dict[str, list[float]]] = {}
    for path, graph in itertools.product(PATHS, (False, True)):
        rows = [(geo, t) for (p, geo), t in samples.items() if p == path and geo.graph == graph]
        if not rows:
            raise ValueError(f"no measured rows of {path} ({'graph' if graph else 'eager'})")
        x = torch.tensor([_features(path, geo) for geo, _ in rows], dtype=torch.float64)
        y = torch.tensor([t for _, t in rows], dtype=torch.float64)
        cs = [float(f"{c:.6g}") for c in _nnls_relative(x, y)]
        coefs.setdefault(path, {})["graph" if graph else "eager"] = cs
    return coefs


def predict(coefs: dict[str, dict[str, list[float]]], path: str, geo: Geometry) -> float:
    cs = coefs[path]["graph" if geo.graph else "eager"]
    return sum(c * f for c, f in zip(cs, _features(path, geo), strict=True))


def evaluate(
    samples: dict[tuple[str, Geometry], float], folds: str
) -> tuple[list[Decision], dict[tuple[str, Geometry], float]]:
    """Held-out picks and ``{(path, geometry): predicted / measured}``: per fold (one (H, D),
    or one B), fit without the fold, then predict and decide its rows."""
    key = (lambda g: (g.h, g.d)) if folds == "shape" else (lambda g: g.b)
    geos = sorted({geo for _, geo in samples})
    decisions: list[Decision] = []
    ratios: dict[tuple[str, Geometry], float] = {}
    for fold in sorted({key(g) for g in geos}):
        coefs = fit({(p, g): t for (p, g), t in samples.items() if key(g) != fold})
        for geo in (g for g in geos if key(g) == fold):
            pred = {p: predict(coefs, p, geo) for p in PATHS if (p, geo) in samples}
            ratios.update({(p, geo): t / samples[(p, geo)] for p, t in pred.items()})
            for direct in (True, False):
                cands = [p for p in pred if direct or p != "direct_a2a"]
                if len(cands) < 2:
                    continue
                pick = min(cands, key=lambda p: pred[p])
                fastest = min(cands, key=lambda p: samples[(p, geo)])
                slowdown = samples[(pick, geo)] / samples[(fastest, geo)]
                decisions.append(Decision(geo, direct, pick, fastest, slowdown))
    return decisions, ratios


def summary(decisions: list[Decision], ratios: dict[tuple[str, Geometry], float]) -> str:
    """Picks of the measured fastest, worst slowdown and relative prediction error, over all
    rows and over the device-bound ones."""

    def line(what: str, ds: list[Decision], rs: list[float]) -> str:
        hits = sum(d.pick == d.fastest for d in ds)
        errs = sorted(abs(r - 1) for r in rs)
        return (
            f"{what}: {len(ds)} rows, {hits} ({100 * hits / max(1, len(ds)):.1f}%) pick the "
            f"measured fastest, worst pick {max(d.slowdown for d in ds):.3f}x the fastest; "
            f"prediction error median {100 * errs[len(errs) // 2]:.0f}%, "
            f"max {100 * errs[-1]:.0f}% ({len(errs)} timings)"
        )

    device = [d for d in decisions if not d.geometry.host_bound]
    device_r = [r for (_, g), r in ratios.items() if not g.host_bound]
    return (
        line("all", decisions, list(ratios.values()))
        + "\n"
        + line("device-bound", device, device_r)
    )


def matches(a: dict[str, dict[str, list[float]]], b: dict[str, dict[str, list[float]]]) -> bool:
    """Same coefficients up to 1e-4 relative (or 1e-6 absolute): refits on another BLAS."""
    return a.keys() == b.keys() and all(
        a[p].keys() == b[p].keys()
        and all(abs(x - y) <= 1e-4 * abs(y) + 1e-6 for x, y in zip(a[p][m], b[p][m], strict=True))
        for p in a
        for m in a[p]
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", type=Path, help="results files (default: benchmarks/*)")
    ap.add_argument("--folds", choices=("shape", "batch"), default="shape")
    ap.add_argument("--check", action="store_true", help="compare with the shipped file")
    args = ap.parse_args(argv)
    files = args.files or sorted(HERE.glob("*.json"))
    samples = load_samples(files)
    coefs = fit(samples)
    decisions, ratios = evaluate(samples, args.folds)
    print(f"{'N':>2} {'H':>4} {'D':>4} {'B':>5} mode   direct pick       (pred/meas us) "
          "fastest    (meas us) slowdown")  # fmt: skip
    for d in decisions:
        g = d.geometry
        mode = "graph" if g.graph else "eager" + ("*" if g.host_bound else "")
        meas = samples[(d.pick, g)]
        print(f"{g.n:>2} {g.h:>4} {g.d:>4} {g.b:>5} {mode:<6} {'yes' if d.direct else 'no':<6} "
              f"{d.pick:<10} ({ratios[(d.pick, g)] * meas:7.1f}/{meas:7.1f}) "
              f"{d.fastest:<10} ({samples[(d.fastest, g)]:7.1f}) "
              f"{d.slowdown:.3f}")  # fmt: skip
    print(f"held out by {args.folds}; * eager at B <= {GRAPH_MAX_B}: the host is timed")
    print(summary(decisions, ratios))
    if args.check:
        same = matches(json.loads(PACKAGE_JSON.read_text())["coefficients"], coefs)
        print(f"shipped coefficients {'match' if same else 'differ'}: {PACKAGE_JSON}")
        return int(not same)
    doc = {
        "model": "t_us = c0 + c1*(N-1) + c2*MB + c3*MB*(N-1)/N (cpattn_dcp/cost_model.py)",
        "fitted_from": [f.name for f in files if load_samples([f])],
        "coefficients": coefs,
    }
    PACKAGE_JSON.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {PACKAGE_JSON}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
