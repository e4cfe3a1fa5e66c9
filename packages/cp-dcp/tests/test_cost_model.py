"""The combine cost model: the shipped coefficients, their fit to the repository's measured
collectives (``benchmarks/fit_cost_model.py``, imported by path), the held-out selection
accuracy, monotonicity and argument checks."""

from __future__ import annotations

import importlib
import itertools
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from cpattn_dcp.cost_model import PATHS, coefficients, cost_features, fastest_combine, predict_us

BENCH = Path(__file__).resolve().parents[3] / "benchmarks"
GEOMETRY = {"batch": 64, "num_heads": 128, "head_dim": 512, "world_size": 4}
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@pytest.fixture(scope="module")
def fitter() -> ModuleType:
    """``benchmarks/fit_cost_model.py`` (skips outside a repository checkout)."""
    if not (BENCH / "fit_cost_model.py").is_file():
        pytest.skip("benchmarks/ is not here (an sdist)")
    sys.path.insert(0, str(BENCH))  # for its own import of bench_collectives
    try:
        return importlib.import_module("fit_cost_model")
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def samples(fitter: ModuleType) -> dict[tuple[str, object], float]:
    out: dict[tuple[str, object], float] = fitter.load_samples(sorted(BENCH.glob("*.json")))
    assert out, "no combine rows in benchmarks/*.json"
    return out


def test_shipped_coefficients_load() -> None:
    coefs = coefficients()
    assert set(coefs) == set(PATHS)
    for modes in coefs.values():
        assert set(modes) == {"eager", "graph"}
        assert all(len(cs) == 4 and min(cs) >= 0 for cs in modes.values())


def test_shipped_coefficients_are_the_fit_of_the_measurements(
    fitter: ModuleType, samples: dict[tuple[str, object], float]
) -> None:
    shipped = json.loads(fitter.PACKAGE_JSON.read_text())["coefficients"]
    assert fitter.matches(shipped, fitter.fit(samples)), "run benchmarks/fit_cost_model.py"


def test_features_count_the_measured_bytes(fitter: ModuleType) -> None:
    """MB of the features is the ``bytes`` of every measured combine row, and the prediction
    is the linear form of the module docstring (float64 reference)."""
    checked = 0
    for f in sorted(BENCH.glob("*.json")):
        for r in json.loads(f.read_text()).get("collectives", []):
            path = fitter.OPS.get(r["op"].removesuffix(fitter.GRAPH_SUFFIX))
            if path is None:
                continue
            n, graph, dtype = r["world_size"], r["op"].endswith(fitter.GRAPH_SUFFIX), r["dtype"]
            geo = {"batch": r["B"], "num_heads": r["H"], "head_dim": r["D"], "world_size": n}
            feats = cost_features(path, **geo, dtype=getattr(torch, dtype))
            assert feats[2] * 1e6 == pytest.approx(r["bytes"], rel=1e-12)
            c, mb = coefficients()[path]["graph" if graph else "eager"], r["bytes"] / 1e6
            ref = c[0] + c[1] * (n - 1) + c[2] * mb + c[3] * mb * (n - 1) / n
            got = predict_us(path, **geo, dtype=getattr(torch, dtype), graph=graph)
            assert got == pytest.approx(ref, rel=1e-12)
            checked += 1
    assert checked > 0


@pytest.mark.parametrize("folds", ["shape", "batch"])
def test_held_out_selection(
    fitter: ModuleType, samples: dict[tuple[str, object], float], folds: str
) -> None:
    """Fitted without the fold it decides: >= 90% of the picks are the measured fastest path;
    no pick is more than 1.2x the fastest where the device is timed (eager loops at decode
    sizes time the host, whose jitter exceeds the gaps between paths)."""
    decisions, ratios = fitter.evaluate(samples, folds)
    assert len(decisions) == 2 * len({g for _, g in samples})  # with and without direct
    assert len(ratios) == len(samples)
    hits = sum(d.pick == d.fastest for d in decisions)
    assert hits >= 0.9 * len(decisions), fitter.summary(decisions, ratios)
    device = [d for d in decisions if not d.geometry.host_bound]
    assert device
    assert max(d.slowdown for d in device) <= 1.2, fitter.summary(decisions, ratios)


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("path", PATHS)
def test_predictions_increase_with_the_bytes(path: str, graph: bool) -> None:
    """Monotone in B (far past the measured 4096), H, D and the element size, at measured
    and unseen world sizes."""
    for n in (2, 4, 8):
        for h, d in ((8 * n, 64), (64, 128), (128, 512)):
            kw = {"num_heads": h, "head_dim": d, "world_size": n, "graph": graph}
            for dtype in DTYPES:
                ts = [predict_us(path, batch=1 << k, dtype=dtype, **kw) for k in range(18)]
                assert all(0 < a <= b for a, b in itertools.pairwise(ts)), (n, h, d, ts)
            t16, t32 = (predict_us(path, batch=64, dtype=t, **kw) for t in DTYPES[1:])
            assert t16 <= t32
            kw["head_dim"] = 2 * d
            assert predict_us(path, batch=64, dtype=torch.bfloat16, **kw) >= t16
            kw["num_heads"] = 2 * h
            assert predict_us(path, batch=64, dtype=torch.bfloat16, **kw) >= t16


@pytest.mark.parametrize("graph", [False, True])
def test_fastest_combine(graph: bool) -> None:
    for direct in (False, True):
        for n in (2, 4, 8):
            geo = {**GEOMETRY, "world_size": n, "dtype": torch.bfloat16, "graph": graph}
            path, reason = fastest_combine(direct_available=direct, **geo)
            cands = [p for p in PATHS if direct or p != "direct_a2a"]
            times = {p: predict_us(p, **geo) for p in cands}
            assert path == min(cands, key=lambda p: times[p])
            assert "\n" not in reason
            assert f"{path} {times[path]:.1f} us" in reason
            assert ("direct A2A unavailable" in reason) is not direct
    # The measured ranking at a measured geometry: the direct A2A, else the packed A2A.
    geo = {**GEOMETRY, "dtype": torch.bfloat16, "graph": graph}
    assert fastest_combine(direct_available=True, **geo)[0] == "direct_a2a"
    assert fastest_combine(direct_available=False, **geo)[0] == "a2a"


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"path": "ag_ar"}, ValueError),
        ({"batch": 0}, ValueError),
        ({"batch": 2.0}, TypeError),
        ({"batch": True}, TypeError),
        ({"num_heads": 130}, ValueError),  # not a multiple of the world size
        ({"head_dim": -1}, ValueError),
        ({"world_size": 1}, ValueError),
        ({"world_size": "4"}, TypeError),
        ({"dtype": "bfloat16"}, TypeError),
        ({"dtype": torch.int8}, ValueError),
        ({"dtype": torch.float64}, ValueError),
        ({"graph": 1}, TypeError),
    ],
)
def test_bad_arguments(change: dict[str, object], error: type[Exception]) -> None:
    kw: dict[str, object] = {"path": "a2a", **GEOMETRY, "dtype": torch.bfloat16, **change}
    with pytest.raises(error):
        predict_us(**kw)
    if "path" not in change:
        kw.pop("path")
        with pytest.raises(error):
            fastest_combine(direct_available=False, **kw)


def test_bad_direct_available() -> None:
    with pytest.raises(TypeError, match="direct_available"):
        fastest_combine(direct_available=None, dtype=torch.bfloat16, **GEOMETRY)
