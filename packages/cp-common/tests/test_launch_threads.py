"""Launches from several threads at once stay correct (the interpreter is serialised)."""

from __future__ import annotations

import threading

import pytest
import torch
import triton
import triton.language as tl

from cpattn_common.interpret import triton_interpreting
from cpattn_common.launch import launch_cached


@triton.jit
def _affine_kernel(x_ptr, y_ptr, n, alpha, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    x = tl.load(x_ptr + o, mask=m)
    tl.store(y_ptr + o, x * alpha + 1.0, mask=m)


def test_concurrent_launches_from_threads(device: torch.device) -> None:
    if device.type == "cpu":
        if not triton_interpreting():
            pytest.skip("CPU tensors need Triton's interpreter (TRITON_INTERPRET=1)")
        pytest.importorskip("numpy")  # the interpreter needs it
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def worker(seed: int) -> None:
        try:
            gen = torch.Generator().manual_seed(seed)
            start.wait()
            for i in range(12):
                n = 33 + 7 * i
                x = torch.randn(n, generator=gen).to(device)
                y = torch.full((n,), float("nan"), device=device)
                alpha = 0.5 + seed
                launch_cached(
                    _affine_kernel, (triton.cdiv(n, 16),), x_ptr=x, y_ptr=y, n=n, alpha=alpha,
                    BLOCK=16,
                )  # fmt: skip
                torch.testing.assert_close(y, x * alpha + 1.0)
        except BaseException as exc:  # reported below, with the thread's seed
            exc.add_note(f"(thread seed {seed})")
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[0]
