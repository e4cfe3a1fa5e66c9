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
* grad mode is on and an input requires grad. The ops have no autograd formula. Through the
  dispatcher the output requires grad and ``backward`` raises, torch's rule for such custom
  ops; a direct launch would return an output that silently drops the gradient.

Under ``torch.inference_mode()`` / ``torch.no_grad()`` (how serving engines run) the grad test
stops at ``torch.is_grad_enabled()``. About 0.2 µs of host time per call on the CPU.
"""

from __future__ import annotations

import torch

__all__ = ["must_dispatch"]

_is_compiling = torch.compiler.is_compiling
_dispatch_stack_len = torch._C._len_torch_dispatch_stack
_is_grad_enabled = torch.is_grad_enabled
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)


def must_dispatch(*tensors: object) -> bool:
    """Whether a call with these inputs must go through the op's ``torch.ops`` entry (see
    the module docstring). ``None`` and non-tensor arguments are allowed and ignored: the
    op's own checks report them."""
    # _is_compiling first: under dynamo it is a constant, and the C calls after it would not be
    # traced.
    if _is_compiling() or _dispatch_stack_len() or _functorch_active():
        return True
    if _is_grad_enabled():
        for t in tensors:
            if getattr(t, "requires_grad", False) is True:
                return True
    return False
