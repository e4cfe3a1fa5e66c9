"""Compile the kernels for sm_90 with Triton's bundled ptxas, on the CPU (no GPU needed).

The interpreter accepts code the GPU compiler rejects (e.g. non-constexpr globals), so this
is the CPU suite's guard that the kernels build for the H200, and that the bandwidth-critical
accesses are 16-byte vectors (``ld/st.global.v4``).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

_SCRIPT = pathlib.Path(__file__).with_name("_compile_sm90.py")


def _have_ptxas() -> bool:
    try:
        import triton.backends.nvidia as nv
    except ImportError:
        return False
    return (pathlib.Path(nv.__file__).parent / "bin" / "ptxas").exists()


@pytest.mark.skipif(not _have_ptxas(), reason="Triton's NVIDIA backend (ptxas) is not installed")
def test_kernels_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    proc = subprocess.run(
        [sys.executable, str(_SCRIPT)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, s in stats.items():
        if name.startswith("correct"):
            # Partial output: 16-byte vector loads and stores.
            assert s["ld"].get("ld.global.v4.b32", 0) > 0, (name, s)
            assert s["st"].get("st.global.v4.b32", 0) > 0, (name, s)
        elif name.startswith("pack"):
            assert s["ld"].get("ld.global.v4.b32", 0) > 0, (name, s)
        elif name.startswith("unpack"):
            assert s["st"].get("st.global.v4.b32", 0) > 0, (name, s)
