"""Corrections to Triton's CPU interpreter (``TRITON_INTERPRET=1``) where it disagrees with
the GPU, so that CPU test runs check what a GPU computes.

``exact_bf16_widening``: the interpreter widens a bfloat16 *subnormal* to a wrong float32
(Triton 3.9: the bf16 bits ``0x0003``, 2.76e-40, become 5.88e-39). Both formats have the same
exponent range, so the GPU widening is exact: the bf16 bits shifted left by 16. Kernels that
widen a bf16 LSE (the A2A pack, ``correct_attn_out``, the merge) then disagreed with their
float64 references on bf16 subnormal LSEs, which the property tests draw.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["apply_interpreter_fixes", "exact_bf16_widening"]

_installed = False


def apply_interpreter_fixes() -> None:
    """Every correction of this module, when this process runs Triton's interpreter
    (``TRITON_INTERPRET=1``); nothing otherwise. The pytest plugin and the rank launcher's
    workers call it."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        exact_bf16_widening()


def exact_bf16_widening() -> bool:
    """Make the interpreter widen bfloat16 to float32 exactly (a 16-bit shift of the bits),
    leaving every other conversion as it is.

    Wraps ``triton.runtime.interpreter._convert_float`` in this process, once. Does nothing
    when that converter is missing or already exact for a bf16 subnormal (a fixed Triton).

    Returns:
        Whether the exact widening is in place (installed now or before).
    """
    global _installed
    if _installed:
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

    def exact(value: Any) -> Any:
        return (np.asarray(value, dtype=np.uint16).astype(np.uint32) << 16).reshape(value.shape)

    probe = np.array([0x0003, 0x8001, 0x3F80], dtype=np.uint16)
    if np.array_equal(convert(probe, tl.bfloat16, tl.float32, None), exact(probe)):
        return False

    def converted(value: Any, input_dtype: Any, output_dtype: Any, rounding_mode: Any) -> Any:
        if input_dtype == tl.bfloat16 and output_dtype == tl.float32:
            return exact(value)
        return convert(value, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = converted
    _installed = True
    return True
