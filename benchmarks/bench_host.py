"""Host time of an eager call of each op, against what an engine's eager op does for the same
work: ``torch.empty`` of the same outputs and a plain ``kernel[grid](...)`` Triton launch of the
same kernel with the same arguments.

"The same kernel with the same arguments" is taken from the op itself: one call runs with
``cpattn_common.launch.Specialization.__call__`` wrapped, which records every launch
(``spec``, grid, runtime arguments); the baseline replays them as
``spec.kernel[grid](*args, **spec.constexprs)``. Both are timed in the same process, in rounds
that interleave their loops (``cpattn_testing.bench.measure_host_rounds``: the ratio is the
median over rounds of ours / baseline, so a host whose speed drifts affects both alike).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

Launch = tuple[Any, Any, tuple[Any, ...]]  # (Specialization, grid, runtime arguments)


def record_launches(call: Callable[[], object]) -> tuple[object, list[Launch]]:
    """Run ``call`` once; return its result and every ``Specialization`` launch it made."""
    from cpattn_common.launch import Specialization

    launches: list[Launch] = []
    original = Specialization.__call__

    def recording(self: Any, grid: Any, *args: Any) -> Any:
        launches.append((self, grid, args))
        return original(self, grid, *args)

    Specialization.__call__ = recording  # type: ignore[method-assign]
    try:
        result = call()
    finally:
        Specialization.__call__ = original  # type: ignore[method-assign]
    return result, launches


def _tensors(x: object) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for item in x:
            yield from _tensors(item)
    elif isinstance(x, dict):
        for item in x.values():
            yield from _tensors(item)


def launch_baseline(result: object, inputs: object, launches: list[Launch]) -> Callable[[], object]:
    """The engine pattern for one recorded call: ``torch.empty`` of each output that is not an
    input (in-place results allocate nothing), then each recorded launch the plain way."""
    given = {t.data_ptr() for t in _tensors(inputs)}
    outs = [(o.shape, o.dtype, o.device) for o in _tensors(result) if o.data_ptr() not in given]
    plain = [(spec.kernel, grid, args, spec.constexprs) for spec, grid, args in launches]

    def baseline() -> object:
        allocated = [
            torch.empty(shape, dtype=dtype, device=device) for shape, dtype, device in outs
        ]
        for kernel, grid, args, constexprs in plain:
            kernel[grid](*args, **constexprs)
        return allocated

    return baseline


def host_rows(plan: Any, specs: list[Any], device: torch.device, results: Any) -> None:
    """One host row per op and head shape at B = 1 (``plan.host_shapes``, N = ``plan.host_n``)."""
    import bench_kernels as bk
    from bench_results import HostRow

    import cpattn_testing.bench as hb

    for spec in specs:
        for h, d in plan.host_shapes:
            if spec.uses_n:
                case = bk.Case(spec.name, getattr(torch, plan.dtypes[0]), h, d, plan.host_n, 1)
            else:
                case = bk.Case(spec.name, torch.float32, h, 0, 0, 1)
            row = HostRow(case.kernel, case.dtype_name, case.H, case.D, case.N, 1)
            results.host.append(row)
            try:
                gen = torch.Generator(device=device).manual_seed(1234)
                inp = spec.make_inputs(case, device, gen)
                ours = spec.bind_ours(case, inp)
                ours()  # compiles
                result, launches = record_launches(ours)
                if not launches:
                    row.status = "error: no Triton launch recorded"
                    continue
                baseline = launch_baseline(result, inp, launches)
                timed = hb.measure_host_rounds(
                    {"baseline": baseline, "ours": ours},
                    calls=plan.host_calls,
                    rounds=plan.host_rounds,
                )
                row.host_us = timed.timing("ours").median_ms * 1e3
                row.baseline_us = timed.timing("baseline").median_ms * 1e3
                row.ratio = timed.ratio("ours", "baseline")
                row.launches = len(launches)
            except Exception as exc:
                row.status = f"error: {type(exc).__name__}: {exc}".splitlines()[0][:160]
