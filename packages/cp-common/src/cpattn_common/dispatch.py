"""When an op's public function must go through the torch dispatcher.

Every op of the packages is a ``torch.library`` custom op with a fake implementation, and its
public function launches the kernel itself in plain eager use: the dispatcher would cost
several microseconds of host time per call. That shortcut is only right when nothing is
listening to the dispatcher. ``must_dispatch`` says when something is:

* ``torch.compile`` is tracing (dynamo);
* a dispatch mode is active: ``FakeTensorMode``, ``make_fx``'s proxy mode (fake, symbolic or
  real tracing), ``torch.export``'s modes, any user ``TorchDispatchMode``. A direct launch
  would bypass the mode: a fake tensor has no memory to launch on, and a proxy mode would
  record the output allocation without the op (a graph that returns uninitialised memory);
* a functorch transform is active (``torch.vmap``, ``torch.func.grad``, ``functionalize``):
  its tensors are wrappers without storage of their own; through the dispatcher the transform
  handles the op (``vmap`` runs it per batch element);
* ``torch.jit.trace`` is tracing: it records dispatcher calls only, like a proxy mode;
* grad mode is on and an input requires grad. The ops have no autograd formula. Through the
  dispatcher the output requires grad and ``backward`` raises, torch's rule for such custom
  ops; a direct launch would return an output that silently drops the gradient.

Under ``torch.inference_mode()`` / ``torch.no_grad()`` (how serving engines run) the grad test
stops at ``torch.is_grad_enabled()``. About 0.2 µs of host time per call on the CPU.

A direct launch that writes a caller's tensor in place must also do what the dispatcher does
for torch's in-place ops: bump the tensor's version counter (``mark_written_in_place``).
Autograd then refuses a ``backward`` that saved the tensor before the write, instead of
silently computing with the new values. About 0.3 µs per call on the CPU; a no-op for tensors
made under ``torch.inference_mode()``.

Functions that exchange data between ranks outside a registered op (the gathers of
``cpattn_dcp`` and ``cpattn_pcp``, the direct workspaces, ``DCPManager``) have no op to
dispatch to. A collective is no autograd function: with an input that requires grad it fails
inside the backend with an obscure view error, or returns a result whose ``grad_fn`` ignores
the other ranks' rows; a direct kernel returns a result without the gradient. ``refuse_grad``
turns that into one clear ``RuntimeError`` before anything runs; about 0.2 µs of host time
per call on the CPU under ``torch.no_grad()`` / ``torch.inference_mode()``, where it stops at
``torch.is_grad_enabled()``.

Not detected (a per-tensor test would cost more host time than the rest together): tensor
subclasses with their own ``__torch_dispatch__`` (``DTensor``) and meta tensors. They fail
loudly on the direct launch (no storage to launch on); the registered ops accept them.
"""

from __future__ import annotations

import torch

__all__ = ["mark_written_in_place", "must_dispatch", "refuse_grad", "refuse_grad_in_place"]

_is_compiling = torch.compiler.is_compiling
_dispatch_stack_len = torch._C._len_torch_dispatch_stack
_is_grad_enabled = torch.is_grad_enabled
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)
_jit_tracing_state = getattr(torch._C, "_get_tracing_state", lambda: None)

#: ``mark_written_in_place(tensor)``: bump the version counter of a tensor that a kernel
#: launched outside the dispatcher has just written (see the module docstring). Views share
#: their base's counter, so marking either marks both.
mark_written_in_place = torch.autograd.graph.increment_version


def must_dispatch(*tensors: object) -> bool:
    """Whether a call with these inputs must go through the op's ``torch.ops`` entry (see
    the module docstring). ``None`` and non-tensor arguments are allowed and ignored: the
    op's own checks report them."""
    # _is_compiling first: under dynamo it is a constant, and the C calls after it would not be
    # traced.
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
    """Raise ``RuntimeError`` when grad mode is on and one of ``tensors`` requires grad.

    For public functions without an autograd formula that cannot go through a registered
    op (those that exchange data between ranks, see the module docstring). Call it before any
    work, so the caller sees this error instead of one from inside the backend.

    Args:
        op: the public function's name, for the message.
        **tensors: the inputs to test, keyed by argument name (for the message). ``None`` and
            non-tensor values are allowed and ignored; so are integer tensors, which cannot
            require grad.

    Raises:
        RuntimeError: grad mode is on and a tensor requires grad; the message names ``op``
            and the first such argument.
    """
    # Grad mode first: under no_grad / inference_mode (how serving engines run) that is all.
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
    requires grad.

    An in-place custom op without an autograd formula leaves the tensor's ``grad_fn`` as it
    was, so ``backward`` would run and silently ignore what the op did (a wrong gradient, not
    an error). Call it on the dispatched path only (``must_dispatch`` is True whenever this
    can raise), so plain eager calls pay nothing.
    """
    if _is_grad_enabled() and getattr(tensor, "requires_grad", False) is True:
        raise RuntimeError(
            f"{op}: {name} requires grad, but the op writes it in place and has no autograd "
            "formula (its gradient would silently ignore the op); call it under "
            "torch.no_grad() / torch.inference_mode(), or on a detached tensor"
        )
