"""Host time of an eager call of each op, against what an engine's eager op does for the same
work: ``torch.empty`` of the same outputs and a plain ``kernel[grid](...)`` Triton launch of the
same kernel with the same arguments.

"The same kernel with the same arguments" is taken from the op itself: one call runs with
``cpattn_common.launch.Specialization.__call__`` wrapped, which records every launch
(``spec``, grid, runtime arguments); the baseline replays them as
``spec.kernel[grid](*args, **spec.constexprs)``. Both are timed in the same process, in rounds
that interleave their loops (``cpattn_testing.bench.measure_host_rounds``: the ratio is the
median over rounds of ours / baseline, so a host whose speed drifts affects both alike).

Check mode's cost, in the same rounds: the op with check mode on, and with it off the reads of
its switch per call (counted) times the measured cost of one such read.
"""

from __future__ import annotations

import time
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


def count_check_reads(call: Callable[[], object]) -> int:
    """Reads of the check-mode switch (``check_state.enabled``) during one ``call``."""
    from cpattn_common.checks import check_state

    cls = type(check_state)
    slot = cls.__dict__["enabled"]  # the __slots__ descriptor
    reads = 0

    def read(state: Any) -> Any:
        nonlocal reads
        reads += 1
        return slot.__get__(state, cls)

    setattr(cls, "enabled", property(read, slot.__set__))  # noqa: B010
    try:
        call()
    finally:
        setattr(cls, "enabled", slot)  # noqa: B010
    return reads


_state: Any = None  # cpattn_common.checks.check_state while check_read_ns runs


def _read_loop(reads: int) -> float:
    start = time.perf_counter()
    for _ in range(reads):
        if _state.enabled:  # what an op does at each check site: a global, an attribute
            pass
    return time.perf_counter() - start


def _empty_loop(reads: int) -> float:
    start = time.perf_counter()
    for _ in range(reads):
        pass
    return time.perf_counter() - start


def check_read_ns(reads: int = 1_000_000) -> float:
    """Host time of one check site with check mode off (``if check_state.enabled:``), less the
    loop's own time; the median of 5 loops."""
    global _state
    from cpattn_common.checks import check_state

    _state = check_state
    samples = sorted(_read_loop(reads) - _empty_loop(reads) for _ in range(5))
    return max(samples[2], 0.0) / reads * 1e9


def _checks_on(call: Callable[[], object]) -> Callable[[], object]:
    from cpattn_common.checks import check_state

    def checked() -> object:
        previous, check_state.enabled = check_state.enabled, True
        try:
            return call()
        finally:
            check_state.enabled = previous

    return checked


def host_rows(plan: Any, specs: list[Any], device: torch.device, results: Any) -> None:
    """One host row per op and head shape at B = 1 (``plan.host_shapes``, N = ``plan.host_n``)."""
    import bench_kernels as bk
    from bench_results import HostRow

    import cpattn_testing.bench as hb

    read_ns = check_read_ns()
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
                    {"baseline": baseline, "ours": ours, "checked": _checks_on(ours)},
                    calls=plan.host_calls,
                    rounds=plan.host_rounds,
                )
                row.host_us = timed.timing("ours").median_ms * 1e3
                row.baseline_us = timed.timing("baseline").median_ms * 1e3
                row.ratio = timed.ratio("ours", "baseline")
                row.launches = len(launches)
                row.check_reads = count_check_reads(ours)
                row.checks_off_ns = row.check_reads * read_ns
                row.checks_on_us = timed.timing("checked").median_ms * 1e3
            except Exception as exc:
                row.status = f"error: {type(exc).__name__}: {exc}".splitlines()[0][:160]
