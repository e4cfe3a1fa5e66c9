"""When an op's public function must go through the torch dispatcher.

Every op of the packages is a ``torch.library`` custom op with a fake implementation, and its
public function launches the kernel itself in plain eager use: the dispatcher would cost
microseconds of host time per call. ``must_dispatch`` says when something listens to the
dispatcher, so that the shortcut would be wrong:

* ``torch.compile`` is tracing (dynamo), or ``torch.jit.trace`` is;
* a dispatch mode is active (``FakeTensorMode``, ``make_fx``, ``torch.export``, any user
  ``TorchDispatchMode``): a direct launch would bypass it;
* a functorch transform is active (``torch.vmap``, ``torch.func.grad``, ``functionalize``);
* grad mode is on and an input requires grad: through the dispatcher the output requires grad
  and ``backward`` raises (the ops have no autograd formula), where a direct launch would drop
  the gradient silently.

A direct launch that writes a caller's tensor in place bumps its version counter, as the
dispatcher does (``mark_written_in_place``), so autograd refuses a stale ``backward``.
Functions that exchange data between ranks outside a registered op (gathers, direct
workspaces, ``DCPManager``) call ``refuse_grad`` first: one clear ``RuntimeError`` instead of
an obscure backend error or a gradient that ignores the other ranks. Each check stops at
``torch.is_grad_enabled()`` under ``torch.inference_mode()`` / ``torch.no_grad()``.

Not detected (a per-tensor test would cost more than the rest together): tensor subclasses
with their own ``__torch_dispatch__`` (``DTensor``) and meta tensors; they fail loudly on the
direct launch.
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
