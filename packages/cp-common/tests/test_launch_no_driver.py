"""Without a GPU driver and without the interpreter, a launch fails with advice, not Triton's
internal "0 active drivers" message."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

_SCRIPT = """
import torch, triton, triton.language as tl
from cpattn_common.launch import launch_cached

@triton.jit
def _copy_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(y_ptr + o, tl.load(x_ptr + o))

x = torch.randn(16)
try:
    launch_cached(_copy_kernel, (1,), x_ptr=x, y_ptr=torch.empty_like(x), BLOCK=16)
except RuntimeError as exc:
    print("RAISED:", exc)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU driver")
def test_cpu_launch_without_interpreter_explains_itself(tmp_path: pathlib.Path) -> None:
    script = tmp_path / "launch_without_driver.py"  # @triton.jit needs a source file
    script.write_text(_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert "RAISED:" in result.stdout, result.stdout + result.stderr
    assert "no GPU driver is available" in result.stdout
    assert "TRITON_INTERPRET=1" in result.stdout
