"""What a full launch-plan table costs: the native look-up, registration and eviction.

The native module's plan table holds 8192 keys (``launch_plans_info``); a full table drops
its least recently used quarter (``csrc/launch_plans.cpp``, ``make_room``: a use clock per key,
one O(table) walk and selection). This times, on the native module alone (no kernel is
launched: plans hold no launch here, and the module runs dry), host time per call in µs:

- ``replay_hit``: a replay of a hot key (one tensor and three ints, like an op's key), with the
  table nearly empty and with it full;
- ``register``: recording a new key's plan into a table with room;
- ``evicting_register``: the registration that finds the table full (the walk included), with
  the hot working set replayed between registrations as a serving loop would;
- ``amortised_register``: total time of a stream of one-off registrations through a full table
  divided by their number.

Runs on any machine where the native module builds (a CPU machine too: the walk is host
work). ``--json OUT`` writes the figures.

    PYTHONPATH=packages/cp-common/src python3 benchmarks/plan_eviction.py --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Any

import torch

from cpattn_common import launch_plans as lp


def _median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def _time_calls(fn: Any, args: tuple[Any, ...], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn(*args)
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--hot", type=int, default=64, help="keys replayed between insertions")
    parser.add_argument("--stream", type=int, default=40000, help="one-off keys to register")
    ns = parser.parse_args()

    if not lp.set_launch_plans_enabled(True):
        raise SystemExit(f"launch plans unavailable here: {lp.launch_plans_reason()}")
    ext = lp._native_module()
    lp.clear_launch_plans()
    # Device 0, stream 0, no kernel launched (every plan here has no launch anyway).
    ext.set_runtime(lambda: 0, lambda device: 0, *lp._runtime_getters()[2:])
    ext.set_dry_run([])
    op = lp.OpPlans("benchmarks.plan_eviction").op_id
    x = torch.empty(4, 128, 512, dtype=torch.bfloat16)
    max_plans = 8192

    def key(n: int) -> tuple[Any, ...]:
        return (x, n, 1, True)

    def register(n: int) -> None:
        ext.register(op, 0, key(n), [], [], ())

    res: dict[str, Any] = {"host": platform.processor() or platform.machine()}
    hot = list(range(ns.hot))
    for n in hot:
        register(n)
    res["replay_hit_empty_table_us"] = _median_us(_time_calls(ext.replay, (op, *key(0)), 20000))
    reg = []
    for n in range(10**6, 10**6 + max_plans - ns.hot):
        t0 = time.perf_counter()
        register(n)
        reg.append(time.perf_counter() - t0)
    res["register_us"] = _median_us(reg)
    info = ext.info()
    if info["plans"] != max_plans or info["evicted"] != 0:
        raise SystemExit(f"the table is not {max_plans} plans long: {info}")
    res["replay_hit_full_table_us"] = _median_us(_time_calls(ext.replay, (op, *key(0)), 20000))

    evicting: list[float] = []
    other: list[float] = []
    total = 0.0
    for n in range(2 * 10**6, 2 * 10**6 + ns.stream):
        for h in hot:
            ext.replay(op, *key(h))
        before = ext.info()["evicted"]
        t0 = time.perf_counter()
        register(n)
        dt = time.perf_counter() - t0
        total += dt
        (evicting if ext.info()["evicted"] != before else other).append(dt)
    info = ext.info()
    if not all(ext.replay(op, *key(h)) == () for h in hot):
        raise SystemExit("a hot key was evicted")
    res.update(
        evicting_register_us_median=_median_us(evicting),
        evicting_register_us_max=max(evicting) * 1e6,
        evictions=len(evicting),
        other_register_us=_median_us(other),
        amortised_register_us=total / ns.stream * 1e6,
        evicted=info["evicted"],
        plans_after=info["plans"],
        hot_keys=ns.hot,
        stream=ns.stream,
        max_plans=max_plans,
    )
    ext.set_dry_run(None)
    ext.set_runtime(*lp._runtime_getters())
    lp.clear_launch_plans()
    lp.set_launch_plans_enabled(False)
    for k, v in res.items():
        print(f"{k}: {v:.2f}" if isinstance(v, float) else f"{k}: {v}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
