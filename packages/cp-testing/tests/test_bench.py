"""CPU tests of the timing helpers (cpattn_testing.bench): quantiles and CPU fallbacks, host
rounds and their per-round ratios, the copy references, the environment stamp."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

from cpattn_testing import bench as hb


def test_rotation_count() -> None:
    l2 = 60_000_000
    assert hb.rotation_count(200_000_000, l2) == 1
    assert hb.rotation_count(40_000_000, l2) == 3
    assert hb.rotation_count(1_000, l2) == 32
    with pytest.raises(ValueError, match="positive"):
        hb.rotation_count(0, l2)


def test_cpu_timing_fallbacks() -> None:
    x = torch.zeros(256)
    t = hb.time_wall(lambda: x.add_(1.0), calls=3, rounds=3)
    assert t.method == "wall"
    assert 0 < t.p20_ms <= t.median_ms <= t.p80_ms
    h = hb.measure_host_overhead(lambda: x.add_(1.0), calls=10, rounds=3)
    assert math.isfinite(h.median_ms)
    assert h.median_ms > 0
    moved, tc = hb.measure_copy_ceiling(torch.device("cpu"), nbytes=1 << 16)
    assert moved == 2 * (1 << 16)
    assert tc.median_ms > 0


def test_host_reference_works_in_place() -> None:
    """``add_`` allocates nothing: every call returns the same tensor, one more each time."""
    add_ = hb.host_reference_add(torch.device("cpu"))
    first = add_()
    assert first is add_()
    assert torch.equal(first, torch.full((1024,), 2.0))


@pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="launches a Triton kernel: needs a GPU or TRITON_INTERPRET=1",
)
def test_reference_kernels_and_host_times_run_on_this_device() -> None:
    """The empty and load + store kernels (graph replay on a GPU, wall clock on the CPU) and
    the host references: one positive figure each, under the documented keys."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert hb.measure_empty_kernel_graph(dev, calls_per_graph=4).median_ms > 0
    assert hb.measure_touch_kernel_graph(dev, calls_per_graph=4).median_ms > 0
    host = hb.measure_reference_host_times(dev, calls=3, rounds=2)
    assert set(host) == {"torch_add_", "triton_jit_launch"}
    assert all(t.method == "wall" and t.median_ms > 0 for t in host.values())


def test_copy_graph_counts_read_and_write_and_checks_sets() -> None:
    """CPU fallback of the decode rows' same-size copy: bytes = read + write of whole bf16
    elements; at least one buffer pair."""
    moved, tc = hb.measure_copy_graph(torch.device("cpu"), nbytes=1001, sets=3)
    assert moved == 4 * 500
    assert tc.method == "wall"
    assert tc.median_ms > 0
    with pytest.raises(ValueError, match="sets"):
        hb.measure_copy_graph(torch.device("cpu"), nbytes=64, sets=0)
    with pytest.raises(ValueError, match="calls_per_graph"):
        hb.measure_copy_graph(torch.device("cpu"), nbytes=64, sets=1, calls_per_graph=0)


def test_copy_graph_holds_as_many_calls_as_the_rows_it_is_compared_with(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A row's graph holds ``calls_per_graph`` calls; the copy it is compared with must too
    (fewer calls spread the replay's own cost over fewer copies, flattering the row)."""
    captured: list[int] = []

    def fake_graph(fns: Any, **kwargs: Any) -> hb.Timing:
        captured.append(len(fns))
        return hb.Timing(1.0, 1.0, 1.0, "cuda_graph")

    monkeypatch.setattr(hb, "time_cuda_graph", fake_graph)
    monkeypatch.setattr(torch, "randn", lambda n, device: torch.zeros(n))
    monkeypatch.setattr(torch, "empty", lambda n, device, dtype: torch.zeros(n, dtype=dtype))
    for sets, calls, want in ((1, 64, 64), (4, 64, 64), (32, 16, 32)):
        hb.measure_copy_graph(torch.device("cuda"), nbytes=64, sets=sets, calls_per_graph=calls)
        assert captured[-1] == want


@pytest.mark.gpu
def test_copy_graph_replays_every_pair() -> None:
    """On the GPU the copies are captured into one graph and timed by replays."""
    moved, tc = hb.measure_copy_graph(torch.device("cuda"), nbytes=1 << 14, sets=4)
    assert moved == 2 * (1 << 14)
    assert tc.method == "cuda_graph"
    assert tc.median_ms > 0


@pytest.mark.gpu
def test_time_cold_with_host_guard_times_the_call_not_the_guard() -> None:
    """The GPU wait of ``host_guard_us`` runs before the start event: a call timed with a 200
    µs guard is not 200 µs slower than without it (a small copy takes a few µs)."""
    src = torch.randn(1 << 16, device="cuda")
    dst = torch.empty_like(src)
    plain = hb.time_cold(lambda: dst.copy_(src), warmup_ms=2.0, rep_ms=5.0)
    guarded = hb.time_cold(lambda: dst.copy_(src), warmup_ms=2.0, rep_ms=5.0, host_guard_us=200.0)
    assert plain.method == guarded.method == "cold"
    assert 0 < guarded.median_ms < plain.median_ms + 0.1
    assert torch.equal(dst, src)


def test_host_ratio_interleaves_and_compares_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rounds alternate ref, fn; the ratio is the median of per-round ratios."""
    order: list[str] = []
    ticks = iter(range(10_000))
    clock = {"now": 0.0}

    def ref() -> None:
        order.append("r")
        clock["now"] += 1.0  # 1 ms per ref call

    def fn() -> None:
        order.append("f")
        clock["now"] += 3.0 if next(ticks) % 2 else 2.0  # 2 or 3 ms per fn call

    with monkeypatch.context() as m:
        m.setattr(hb.time, "perf_counter", lambda: clock["now"] / 1e3)
        t_fn, t_ref, ratio = hb.measure_host_ratio(fn, ref, calls=4, rounds=3)
    assert order[:6] == ["r", "f"] * 3  # warm-up
    assert order[6:] == (["r"] * 4 + ["f"] * 4) * 3
    assert t_ref.median_ms == pytest.approx(1.0)
    assert t_fn.median_ms == pytest.approx(2.5)
    assert ratio == pytest.approx(2.5)
    x = torch.zeros(8)
    _, _, r = hb.measure_host_ratio(lambda: x.add_(1.0), hb.host_reference_add(x.device))
    assert math.isfinite(r)
    assert r > 0


def test_host_rounds_time_every_function_in_each_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each round runs a loop of every function in the mapping's order; ratios are per round."""
    order: list[str] = []
    clock = {"now": 0.0, "round": 0}
    cost = {"a": 1.0, "b": 2.0}

    def make(name: str) -> Callable[[], None]:
        def fn() -> None:
            order.append(name)
            if name == "c":  # 3 ms per call in even rounds, 6 ms in odd ones
                clock["now"] += 6.0 if clock["round"] % 2 else 3.0
            else:
                clock["now"] += cost[name]

        return fn

    fns = {name: make(name) for name in ("a", "b", "c")}
    real_loop = hb._host_loop_ms

    def loop(fn: Callable[[], object], calls: int) -> float:
        t = real_loop(fn, calls)
        if fn is fns["c"]:
            clock["round"] += 1
        return t

    with monkeypatch.context() as m:
        m.setattr(hb.time, "perf_counter", lambda: clock["now"] / 1e3)
        m.setattr(hb, "_host_loop_ms", loop)
        timed = hb.measure_host_rounds(fns, calls=2, rounds=3)
    assert order[:9] == ["a", "b", "c"] * 3  # warm-up
    assert order[9:] == (["a"] * 2 + ["b"] * 2 + ["c"] * 2) * 3
    assert timed.samples_ms == {
        "a": pytest.approx([1.0] * 3),
        "b": pytest.approx([2.0] * 3),
        "c": pytest.approx([3.0, 6.0, 3.0]),
    }
    assert timed.timing("c").median_ms == pytest.approx(3.0)
    assert timed.ratio("c", "a") == pytest.approx(3.0)
    assert timed.ratio("b", "c") == pytest.approx(2.0 / 3.0)
    with pytest.raises(ValueError, match="at least one"):
        hb.measure_host_rounds({})


def test_environment_stamp_keys() -> None:
    stamp = hb.environment_stamp(commit="abc123")
    assert stamp["git_commit"] == "abc123"
    for key in ("date", "device", "driver", "cuda", "torch", "triton", "python"):
        assert stamp[key]
