"""Checks that an op's public function goes through its ``torch.library`` op when it must
(whenever something listens to the dispatcher: ``cpattn_common.dispatch.must_dispatch``), on
given inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["assert_dispatches", "dispatched_ops"]


class _OpLog(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records the name of every op the dispatcher hands to this mode (top level only: the
    mode is off while an op it sees runs)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.names: list[str] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def dispatched_ops(fn: Callable[..., Any], *args: Any) -> list[str]:
    """Names of the ops (``"namespace.op.overload"``) that ``fn(*args)`` sends through the
    dispatcher, in order, as a ``TorchDispatchMode`` sees them."""
    log = _OpLog()
    with log:
        fn(*args)
    return log.names


def _same_layout_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with its sizes and strides, gaps and overlaps included (``clone`` makes
    such views contiguous): the span of memory ``t`` covers is cloned and viewed the same way."""
    if t.numel() == 0:
        return t.clone()
    span = 1 + sum((n - 1) * s for n, s in zip(t.size(), t.stride(), strict=True))
    covered = torch.as_strided(t, (span,), (1,))  # from t's first element on
    return torch.as_strided(covered.clone(), t.size(), t.stride())


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def assert_dispatches(
    fn: Callable[..., Any],
    args: Sequence[Any],
    op: str,
    *,
    tracing_modes: Sequence[Literal["fake", "symbolic", "real"]] = ("fake", "symbolic", "real"),
) -> None:
    """Assert that ``fn(*args)`` goes through the registered op ``op`` (e.g.
    ``"cpattn_dcp.correct_attn_out.default"``) wherever something listens to the dispatcher.

    Checks, each on fresh clones of the tensors in ``args`` (``fn`` may modify its inputs):

    * under a ``TorchDispatchMode``, ``op`` is among the ops dispatched;
    * under ``FakeTensorMode`` (inputs converted to fake tensors), ``fn`` runs, and its tensor
      outputs have the shapes, dtypes and devices of an eager call's;
    * ``make_fx`` in each of ``tracing_modes`` records ``op``; the graph traced in ``"real"``
      mode, replayed on fresh clones, gives what an eager call gives.

    Raises:
        AssertionError: one of the above fails.
    """

    def clones() -> list[Any]:
        # clone() would make a strided view with gaps contiguous: keep the caller's layout.
        return [_same_layout_copy(a) if isinstance(a, torch.Tensor) else a for a in args]

    expected = _tensors(fn(*clones()))

    names = dispatched_ops(fn, *clones())
    assert op in names, f"{op} not dispatched under a TorchDispatchMode; saw {names}"

    real_args = clones()
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in real_args]
        fake_out = _tensors(fn(*fake_args))
    got = [(t.shape, t.dtype, t.device) for t in fake_out]
    want = [(t.shape, t.dtype, t.device) for t in expected]
    assert got == want, f"under FakeTensorMode: {got}, eager: {want}"

    # make_fx traces a function of tensors only: the other arguments (a group, flags) are
    # bound here.
    tensor_positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

    def traced(*tensors: torch.Tensor) -> Any:
        call = list(args)
        for i, t in zip(tensor_positions, tensors, strict=True):
            call[i] = t
        return fn(*call)

    for tracing_mode in tracing_modes:
        inputs = [clones()[i] for i in tensor_positions]
        graph = make_fx(traced, tracing_mode=tracing_mode)(*inputs)
        targets = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
        assert op in targets, f"make_fx({tracing_mode!r}) did not record {op}: {targets}"
        if tracing_mode == "real":
            fresh = clones()
            replayed = _tensors(graph(*[fresh[i] for i in tensor_positions]))
            assert len(replayed) == len(expected)
            for r, e in zip(replayed, expected, strict=True):
                torch.testing.assert_close(r, e, rtol=0, atol=0, equal_nan=True)
