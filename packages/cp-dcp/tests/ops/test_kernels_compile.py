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
    check_ptx_stats(stats)


def _vector(counts: dict[str, int], width: str) -> int:
    return sum(v for k, v in counts.items() if f".{width}." in k)


def check_ptx_stats(stats: dict[str, dict[str, dict[str, dict[str, int]]]]) -> None:
    """The access widths each kernel must (and must not) use, per benchmark case."""
    for case, kernels in stats.items():
        assert kernels, case
        for kernel, s in kernels.items():
            ld, st = s["ld"], s["st"]
            where = (case, kernel, s)
            if case.startswith(("correct-", "correctgrouped-")) and "-100-" not in case:
                # Partial output rows are 16-byte aligned: 16-byte loads and stores.
                assert ld.get("ld.global.v4.b32", 0) > 0, where
                assert st.get("st.global.v4.b32", 0) > 0, where
            elif case.startswith("pack-"):
                # Padded records (D_rec * s a multiple of 16 bytes): 16-byte payload loads
                # from the 16-byte-aligned partial output and 16-byte record stores.
                assert kernel == "_a2a_pack_kernel", where
                assert ld.get("ld.global.v4.b32", 0) > 0, where
                assert st.get("st.global.v4.b32", 0) > 0, where
            elif case.startswith("unpack-"):
                # 16-byte payload loads (records start 16-byte aligned), 16-byte output stores.
                assert ld.get("ld.global.v4.b32", 0) > 0, where
                assert st.get("st.global.v4.b32", 0) > 0, where
            elif case.startswith("packfallback-"):
                # Input rows not 16-byte aligned (odd D, shifted pointer) or a strided head
                # dim: payload loads never wider than 4 bytes (true alignment only; Triton
                # 3.6 once over-derived it, "misaligned address" on the GPU).
                assert kernel == "_a2a_pack_kernel", where
                assert _vector(ld, "v2") + _vector(ld, "v4") == 0, where
