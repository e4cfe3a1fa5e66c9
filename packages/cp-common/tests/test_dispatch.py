"""must_dispatch's triggers that no op test covers (torch.jit.trace), refuse_grad_in_place, and
the merge's checks on the dispatched path."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cpattn_common import dispatch
from cpattn_common.dispatch import must_dispatch, refuse_grad, refuse_grad_in_place
from cpattn_common.lse import merge_attn_states_torch
from cpattn_common.ops.merge_attn_states import merge_attn_states


class _PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def test_jit_trace_dispatches() -> None:
    """torch.jit.trace records dispatcher calls only: a direct launch would leave a trace that
    allocates the output and never computes it."""
    seen: list[bool] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        seen.append(must_dispatch(x))
        return x + 1

    x = torch.randn(3)
    assert must_dispatch(x) is False
    torch.jit.trace(fn, (x,), check_trace=False)
    assert seen == [True]


def test_jit_trace_of_merge_records_the_op() -> None:
    outs, lses = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4)
    traced = torch.jit.trace(lambda o, s: merge_attn_states(o, s), (outs, lses), check_trace=False)
    assert "cpattn_common::merge_attn_states" in str(traced.graph)
    outs2, lses2 = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4)
    assert torch.equal(traced(outs2, lses2), merge_attn_states(outs2, lses2))


def test_refuse_grad_in_place() -> None:
    x = torch.randn(3, requires_grad=True) * 1.0  # a non-leaf that requires grad
    with pytest.raises(RuntimeError, match=r"^op: out requires grad, but the op writes it"):
        refuse_grad_in_place("op", "out", x)
    with torch.no_grad():
        refuse_grad_in_place("op", "out", x)
    refuse_grad_in_place("op", "out", x.detach())
    refuse_grad_in_place("op", "out", None)


def test_refuse_grad() -> None:
    """Names the function and the first argument that requires grad, says what to do; quiet
    under no_grad / inference_mode, for detached, integer, None and non-tensor arguments."""
    x = torch.randn(3, requires_grad=True) * 1.0  # a non-leaf that requires grad
    plain = torch.randn(3)
    with pytest.raises(
        RuntimeError,
        match=r"^gather: b requires grad, but gather exchanges data between ranks and has "
        r"no autograd formula .*; call it under torch.no_grad\(\) / torch.inference_mode\(\), "
        r"or pass detached tensors$",
    ):
        refuse_grad("gather", a=plain, b=x, c=x)
    with pytest.raises(RuntimeError, match=r"^op: op requires grad"):
        refuse_grad("op", op=x)  # op is positional-only: an argument may share its name
    with torch.no_grad():
        refuse_grad("gather", a=x)
    with torch.inference_mode():
        refuse_grad("gather", a=x)
    refuse_grad("gather", a=x.detach(), b=torch.arange(3), c=None, d=3, e=(x,))
    refuse_grad("gather")
    assert "refuse_grad" in dispatch.__all__


def test_merge_names_non_tensor_inputs_with_its_type_error_when_dispatching() -> None:
    """The dispatched path raised the dispatcher's RuntimeError about the op's schema."""
    outs = torch.randn(2, 3, 4, 8).tolist()
    with _PassThrough(), pytest.raises(TypeError, match=r"must be torch\.Tensor"):
        merge_attn_states(outs, torch.randn(2, 3, 4))  # type: ignore[arg-type]
    lses = torch.randn(2, 3, 4, requires_grad=True)  # autograd: also the dispatched path
    with pytest.raises(TypeError, match=r"must be torch\.Tensor"):
        merge_attn_states(outs, lses)  # type: ignore[arg-type]


@pytest.mark.parametrize("flag", [None, "False", 0, 1.0])
def test_torch_twin_flag_must_be_a_bool(flag: object) -> None:
    # The twin used the flag by truthiness: None meant base 2, "False" base e.
    with pytest.raises(TypeError, match="is_lse_base_on_e must be a bool"):
        merge_attn_states_torch(
            torch.randn(2, 1, 1, 4), torch.randn(2, 1, 1), is_lse_base_on_e=flag
        )  # type: ignore[arg-type]
