"""Whether Triton runs its CPU interpreter, decided as the installed Triton decides it
(``triton.knobs.runtime.interpret`` on Triton >= 3.4, ``TRITON_INTERPRET == "1"`` on 3.3).
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["triton_interpreting"]

_UNRESOLVED: Any = object()
# triton.knobs.runtime (Triton >= 3.4), None on Triton 3.3; resolved at the first call.
_runtime_knobs: Any = _UNRESOLVED


def triton_interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` (or Triton's knob) asks for the interpreter now, as the
    installed Triton reads it. Read at each call; kernels decorated before a change keep what
    the variable said then."""
    global _runtime_knobs
    knobs = _runtime_knobs
    if knobs is _UNRESOLVED:
        import triton

        knobs = _runtime_knobs = getattr(getattr(triton, "knobs", None), "runtime", None)
    if knobs is not None:
        return bool(knobs.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
