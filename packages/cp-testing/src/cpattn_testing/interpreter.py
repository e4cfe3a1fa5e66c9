"""Corrections to Triton's CPU interpreter where it disagrees with the GPU: bf16 subnormal
widening (``exact_bf16_widening``), round-to-nearest-even bf16 narrowing
(``rtne_bf16_narrowing``) and launches serialized across threads (``serialized_launches``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = [
    "apply_interpreter_fixes",
    "exact_bf16_widening",
    "rtne_bf16_narrowing",
    "serialized_launches",
]

_installed: set[str] = set()


def apply_interpreter_fixes() -> None:
    """Every correction of this module, when this process runs Triton's interpreter; nothing
    otherwise."""
    from cpattn_common.interpret import triton_interpreting

    if triton_interpreting():
        exact_bf16_widening()
        rtne_bf16_narrowing()
        serialized_launches()


def exact_bf16_widening() -> bool:
    """Make the interpreter widen bfloat16 to float32 exactly (a 16-bit shift of the bits),
    once, unless its converter already is exact.

    Returns:
        Whether the interpreter's widening is exact now (``False`` only when its converter is
        missing).
    """
    try:
        import numpy as np
    except ImportError:
        return False

    def exact(value: Any) -> Any:
        return (np.asarray(value, dtype=np.uint16).astype(np.uint32) << 16).reshape(value.shape)

    return _wrap_converter(
        "widening",
        np.array([0x0003, 0x8001, 0x3F80], dtype=np.uint16),
        lambda tl, input_dtype, output_dtype: (
            input_dtype == tl.bfloat16 and output_dtype == tl.float32
        ),
        lambda value, rounding_mode: exact(value),
    )


def rtne_bf16_narrowing() -> bool:
    """Make the interpreter narrow float32 to bfloat16 as the GPU does (round to nearest even,
    or toward zero for ``"rtz"``; NaN stays a quiet NaN), once, unless its converter already
    rounds.

    Returns:
        Whether the interpreter's narrowing rounds to nearest-even now (``False`` only when
        its converter is missing).
    """
    try:
        import numpy as np
        from triton._C.libtriton import ir
    except ImportError:
        return False

    def narrow(value: Any, rounding_mode: Any) -> Any:
        bits = np.frombuffer(np.ascontiguousarray(value, dtype=np.float32).tobytes(), np.uint32)
        wide = bits.astype(np.uint64)
        if rounding_mode == ir.ROUNDING_MODE.RTZ:
            rounded = wide >> 16
        else:
            rounded = (wide + 0x7FFF + ((wide >> 16) & 1)) >> 16
        nan = (bits & 0x7FFFFFFF) > 0x7F800000
        out = np.where(nan, (wide >> 16) | 0x0040, rounded).astype(np.uint16)
        return out.reshape(np.shape(value))

    def applies(tl: Any, input_dtype: Any, output_dtype: Any) -> bool:
        return bool(input_dtype == tl.float32 and output_dtype == tl.bfloat16)

    probe = np.array([1.0 + 2.0**-8 + 2.0**-10, -(1.0 + 3 * 2.0**-9), 3.3961e38], np.float32)
    return _wrap_converter("narrowing", probe, applies, narrow)


def _wrap_converter(
    name: str,
    probe: Any,
    applies: Callable[[Any, Any, Any], bool],
    correct: Callable[[Any, Any], Any],
) -> bool:
    """Route the interpreter's float conversions for which ``applies(tl, in_dtype, out_dtype)``
    to ``correct(value, rounding_mode)``, unless its converter already agrees with ``correct``
    on ``probe`` (converted with rounding mode ``None``)."""
    if name in _installed:
        return True
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    convert = getattr(interpreter, "_convert_float", None)
    if convert is None:
        return False
    input_dtype = tl.bfloat16 if probe.dtype == np.uint16 else tl.float32
    output_dtype = tl.float32 if input_dtype == tl.bfloat16 else tl.bfloat16
    if np.array_equal(convert(probe, input_dtype, output_dtype, None), correct(probe, None)):
        _installed.add(name)  # this Triton gets it right
        return True

    def converted(value: Any, input_dtype: Any, output_dtype: Any, rounding_mode: Any) -> Any:
        if applies(tl, input_dtype, output_dtype):
            return correct(value, rounding_mode)
        return convert(value, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = converted
    _installed.add(name)
    return True


def serialized_launches() -> bool:
    """Make interpreted kernel launches of this process run one at a time (a re-entrant lock
    around ``triton.runtime.interpreter.InterpretedFunction.run``, which also covers the
    kernel's first-use source rewrite: concurrent ``ast`` compiles fail on CPython 3.11), once.

    Returns:
        Whether launches are serialized now (``False`` only when the interpreter's function
        class is missing).
    """
    if "launches" in _installed:
        return True
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    function = getattr(interpreter, "InterpretedFunction", None)
    if function is None:
        return False
    launch = function.run
    lock = threading.RLock()

    def serialized(self: Any, *args: Any, **kwargs: Any) -> Any:
        with lock:
            return launch(self, *args, **kwargs)

    function.run = serialized
    _installed.add("launches")
    return True
