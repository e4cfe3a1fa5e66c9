"""Launch plans in their default (auto) mode, as a serving process meets them (GPU only).

A fresh process, ``CPATTN_LAUNCH_PLANS`` unset, calls ``correct_attn_out`` (B=1, N=4,
H=128 D=512, bf16) eagerly in a tight loop from its first call on, as a decode loop would.
The first call starts the background build of the native module; the loop goes on on the
Python path until plans turn on, then records and replays. Reported per process:

- ``build_s``: from the first op call until ``launch_plans_reason()`` is ``None``;
- ``first_call_ms``: the first call (Triton compiles the kernel there);
- host time per call while the build runs (median / p99 / max, µs), against the same loop
  timed afterwards with plans off (``python_path_us``): what the build thread costs the
  caller;
- the default path's steady state: host time per call next to ``add_`` in the same rounds
  (``cpattn_testing.bench.measure_host_rounds``), with the replay checked bit for bit against
  the Python path on fresh data;
- what a serving loop's varying batch costs: each new B is a new call key; 255 new batch sizes
  in a shuffled order, the host time of the first four calls of each (median / p90, µs), with
  plans on and then off. With plans on a key's first call is a plain miss, its second call is
  recorded (since `a9607bd`; before, the first call was), later calls replay.

Run twice on one cache directory: the first process builds (a cold cache), the second loads.

    PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-testing/src \\
        python3 benchmarks/auto_plans_probe.py --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any


def _child() -> dict[str, Any]:
    import torch

    import cpattn_testing.bench as hb
    from cpattn_common import launch_plans as lp
    from cpattn_dcp import correct_attn_out

    assert "CPATTN_LAUNCH_PLANS" not in os.environ
    device = torch.device("cuda")
    B, N, H, D = 1, 4, 128, 512
    out = torch.randn(B, H, D, device=device, dtype=torch.bfloat16)
    lses = torch.randn(N, B, H, device=device)
    res: dict[str, Any] = {"reason_at_start": lp.launch_plans_reason()}

    t0 = time.perf_counter()
    correct_attn_out(out, lses, 1)
    torch.cuda.synchronize()
    res["first_call_ms"] = (time.perf_counter() - t0) * 1e3
    res["reason_after_first_call"] = lp.launch_plans_reason()
    during: list[float] = []
    while lp.launch_plans_reason() is not None and time.perf_counter() - t0 < 300:
        if not str(lp.launch_plans_reason()).startswith("auto: building"):
            break
        t = time.perf_counter()
        correct_attn_out(out, lses, 1)
        during.append(time.perf_counter() - t)
        if len(during) % 4096 == 0:
            torch.cuda.synchronize()  # keep the queue short, as a real step would
    res["build_s"] = time.perf_counter() - t0
    res["reason_after_build"] = lp.launch_plans_reason()
    res["calls_during_build"] = len(during)
    if during:
        during_us = sorted(x * 1e6 for x in during)
        res["during_build_us"] = {
            "median": statistics.median(during_us),
            "p99": during_us[int(0.99 * (len(during_us) - 1))],
            "max": during_us[-1],
        }
    if lp.launch_plans_reason() is not None:
        return res

    # Replays equal the Python path bit for bit, on fresh data.
    for _ in range(3):
        correct_attn_out(out, lses, 1)
    hits = lp.launch_plans_info()["hits"]
    mismatches = 0
    for _ in range(5):
        fresh = torch.randn_like(out)
        fresh_lses = torch.randn_like(lses)
        a, b = fresh.clone(), fresh.clone()
        _, lse_a = correct_attn_out(a, fresh_lses, 1)  # replayed
        lp.set_launch_plans_enabled(False)
        _, lse_b = correct_attn_out(b, fresh_lses, 1)  # Python path
        lp.set_launch_plans_enabled(True)
        mismatches += int(not (torch.equal(a, b) and torch.equal(lse_a, lse_b)))
    res["replayed_calls"] = lp.launch_plans_info()["hits"] - hits
    res["replay_mismatches"] = mismatches

    add = hb.host_reference_add(device)

    def ours() -> object:
        return correct_attn_out(out, lses, 1)

    timed = hb.measure_host_rounds({"add_": add, "ours": ours}, calls=2000, rounds=7)
    res["plans_on_us"] = timed.timing("ours").median_ms * 1e3
    res["add_us"] = timed.timing("add_").median_ms * 1e3
    res["plans_on_ratio_to_add"] = timed.ratio("ours", "add_")
    lp.set_launch_plans_enabled(False)
    timed = hb.measure_host_rounds({"add_": add, "ours": ours}, calls=2000, rounds=7)
    res["python_path_us"] = timed.timing("ours").median_ms * 1e3
    res["python_path_ratio_to_add"] = timed.ratio("ours", "add_")

    batch_sizes = list(range(2, 257))
    random.Random(0).shuffle(batch_sizes)
    inputs = [
        (
            torch.randn(b, H, D, device=device, dtype=torch.bfloat16),
            torch.randn(N, b, H, device=device),
        )
        for b in batch_sizes
    ]
    lp.set_launch_plans_enabled(False)
    for o, ls in inputs:  # compile every kernel configuration first (not what is measured)
        correct_attn_out(o, ls, 1)
    for plans_on in (True, False):
        lp.set_launch_plans_enabled(plans_on)
        before = lp.launch_plans_info()
        calls: list[list[float]] = [[], [], [], []]
        for o, ls in inputs:
            torch.cuda.synchronize()
            for times in calls:
                t = time.perf_counter()
                correct_attn_out(o, ls, 1)
                times.append((time.perf_counter() - t) * 1e6)
        summary: dict[str, Any] = {}
        for i, times in enumerate(calls):
            times.sort()
            summary[f"call{i + 1}_us"] = {
                "median": statistics.median(times),
                "p90": times[int(0.9 * (len(times) - 1))],
            }
        if plans_on:
            after = lp.launch_plans_info()
            summary["recorded"] = after["recorded"] - before["recorded"]
            summary["refusals"] = after["refusals"] - before["refusals"]
            summary["hits"] = after["hits"] - before["hits"]
        res["new_batch_sizes_plans_on" if plans_on else "new_batch_sizes_plans_off"] = summary
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child()))
        return
    env = {k: v for k, v in os.environ.items() if k != "CPATTN_LAUNCH_PLANS"}
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="cpattn-cache-") as cache:
        env["CPATTN_CACHE_DIR"] = cache
        for run in ("cold_cache", "warm_cache"):
            done = subprocess.run(
                [sys.executable, __file__, "--child"],
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
                check=False,
            )
            if done.returncode != 0:
                results[run] = {"error": done.stderr[-3000:]}
            else:
                results[run] = json.loads(done.stdout.strip().splitlines()[-1])
            print(run, json.dumps(results[run], indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
