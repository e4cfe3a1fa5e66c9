"""``CPTritonContext``: accepted by the combine ops for drop-in compatibility with vLLM. It
holds no state (plain Triton JIT launches), so it is safe to share or to omit.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CPTritonContext"]


class CPTritonContext:
    """Launch context of the DCP combine ops (optional; safe to share between calls)."""

    __slots__ = ()

    def launch(self, kernel: Any, grid: tuple[int, ...], **kwargs: Any) -> None:
        """Launch ``kernel`` on ``grid`` with keyword arguments (a plain JIT launch)."""
        kernel[grid](**kwargs)

    def call_kernel(self, kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        """vLLM's spelling of ``launch``: the kernel's leading parameters positionally (in its
        own order), the rest (usually the constexprs) by keyword.

        Raises:
            TypeError: more positional arguments than the kernel has parameters, or a
                parameter given both positionally and by keyword.
        """
        names = kernel.arg_names
        if len(args) > len(names):
            raise TypeError(
                f"{kernel.__name__} takes {len(names)} arguments, {len(args)} given positionally"
            )
        positional = dict(zip(names, args, strict=False))
        both = positional.keys() & kwargs.keys()
        if both:
            raise TypeError(f"{kernel.__name__} got multiple values for {sorted(both)}")
        kernel[grid](**positional, **kwargs)

    def __repr__(self) -> str:
        return "CPTritonContext()"
