"""Whether Triton runs its CPU interpreter, decided as the installed Triton decides it.

Triton >= 3.4 reads ``TRITON_INTERPRET`` through ``triton.knobs.runtime.interpret``, a boolean
knob: ``1``, ``true``, ``on``, ``yes`` and ``y`` (any case) are on, and a value set in code
(``triton.knobs.runtime.interpret = True``) overrides the environment. Triton 3.3 has no
``triton.knobs``; its ``@triton.jit`` compares the variable to ``"1"``. Every decision of the
project that depends on the interpreter (how a kernel is launched, interpreter-sized tiles, the
interpreter's fixes) reads it here, so it agrees with what Triton does.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["triton_interpreting"]

_UNRESOLVED: Any = object()
# triton.knobs.runtime (Triton >= 3.4), None on Triton 3.3; resolved at the first call (this
# module's own imports stay light; the cpattn_common package's __init__ imports triton anyway).
_runtime_knobs: Any = _UNRESOLVED


def triton_interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` (or Triton's knob) asks for the interpreter now, as the
    installed Triton reads it: ``triton.knobs.runtime.interpret`` where ``triton.knobs``
    exists, else Triton 3.3's rule (``== "1"``).

    Read at each call (one environment lookup), so a change of the variable is seen; kernels
    that ``@triton.jit`` decorated earlier keep what the variable said then.
    """
    global _runtime_knobs
    knobs = _runtime_knobs
    if knobs is _UNRESOLVED:
        import triton

        knobs = _runtime_knobs = getattr(getattr(triton, "knobs", None), "runtime", None)
    if knobs is not None:
        return bool(knobs.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
