"""When an op's public function must go through the torch dispatcher instead of launching its
kernel directly: ``must_dispatch`` is true while tracing (dynamo, ``torch.jit.trace``), under a
dispatch mode or a functorch transform, and in grad mode with an input that requires grad.
``refuse_grad`` guards the functions that exchange data between ranks outside a registered op.
Tensor subclasses (``DTensor``) and meta tensors are not detected; they fail loudly.
"""

from __future__ import annotations

import torch

__all__ = ["mark_written_in_place", "must_dispatch", "refuse_grad", "refuse_grad_in_place"]

_is_compiling = torch.compiler.is_compiling
_dispatch_stack_len = torch._C._len_torch_dispatch_stack
_is_grad_enabled = torch.is_grad_enabled
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)
_jit_tracing_state = getattr(torch._C, "_get_tracing_state", lambda: None)

#: ``mark_written_in_place(tensor)``: bump the version counter of a tensor a direct launch
#: has just written (views share their base's counter).
mark_written_in_place = torch.autograd.graph.increment_version


def must_dispatch(*tensors: object) -> bool:
    """Whether a call with these inputs must go through the op's ``torch.ops`` entry (see
    the module docstring). ``None`` and non-tensor arguments are allowed and ignored: the
    op's own checks report them."""
    # _is_compiling first: a constant under dynamo, which would not trace the C calls after it.
    if (
        _is_compiling()
        or _dispatch_stack_len()
        or _functorch_active()
        or _jit_tracing_state() is not None
    ):
        return True
    if _is_grad_enabled():
        for t in tensors:
            if getattr(t, "requires_grad", False) is True:
                return True
    return False


def refuse_grad(op: str, /, **tensors: object) -> None:
    """Raise ``RuntimeError`` when grad mode is on and one of ``tensors`` (keyed by argument
    name; non-tensors ignored) requires grad: for functions that exchange data between ranks
    outside a registered op. Call it before any work; the message names ``op`` and the
    argument.
    """
    if _is_grad_enabled():
        for name, tensor in tensors.items():
            if getattr(tensor, "requires_grad", False) is True:
                raise RuntimeError(
                    f"{op}: {name} requires grad, but {op} exchanges data between "
                    "ranks and has no autograd formula (a gradient would not reflect "
                    "the other ranks); call it under torch.no_grad() / torch.inference_mode(), "
                    "or pass detached tensors"
                )


def refuse_grad_in_place(op: str, name: str, tensor: object) -> None:
    """Raise ``RuntimeError`` when grad mode is on and ``tensor``, which ``op`` writes in place,
    requires grad (an in-place custom op without an autograd formula would leave a wrong
    gradient). For the dispatched path only: ``must_dispatch`` is True whenever this raises.
    """
    if _is_grad_enabled() and getattr(tensor, "requires_grad", False) is True:
        raise RuntimeError(
            f"{op}: {name} requires grad, but the op writes it in place and has no autograd "
            "formula (its gradient would silently ignore the op); call it under "
            "torch.no_grad() / torch.inference_mode(), or on a detached tensor"
        )
