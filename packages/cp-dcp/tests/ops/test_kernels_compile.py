"""Compile the kernels for sm_90 with Triton's bundled ptxas, on the CPU (no GPU needed).

The interpreter accepts code the GPU compiler rejects (e.g. non-constexpr globals), so this
is the CPU suite's guard that the kernels build for the H200, and that the bandwidth-critical
accesses are 16-byte vectors (``ld/st.global.v4``).
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

_SCRIPT = pathlib.Path(__file__).with_name("_compile_sm90.py")


def test_kernels_compile_for_sm90(run_sm90_script: Callable[[pathlib.Path], Any]) -> None:
    stats = run_sm90_script(_SCRIPT)
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
                # 16-byte payload loads (L2 only: read once) from the 16-byte-aligned partial
                # output and 16-byte stores into the payload region (16-byte blocks).
                assert kernel == "_a2a_pack_kernel", where
                assert ld.get("ld.global.cg.v4.b32", 0) > 0, where
                assert st.get("st.global.v4.b32", 0) > 0, where
            elif case.startswith("unpack-1-"):
                # Decode grid (B=1): a row spread over up to 4 warps, about 2 lanes per thread
                # and source (ops.a2a_unpack._UNPACK_SMALL_GRID_LANES): vector loads and
                # stores, 8 bytes at D=512.
                assert _vector(ld, "v2") + _vector(ld, "v4") > 0, where
                assert _vector(st, "v2") + _vector(st, "v4") > 0, where
            elif case.startswith("unpack-"):
                # 16-byte payload loads (16-byte blocks, D a multiple of 8; evict_first on the
                # large grids of ops.a2a_unpack._UNPACK_PAY_EVICT), 16-byte output stores.
                assert _vector(ld, "v4") > 0, where
                assert st.get("st.global.v4.b32", 0) > 0, where
                # evict_first only at N >= 4 and D <= 256 (of these cases: N=8, D=128).
                evict = any("evict_first" in k for k in ld)
                assert evict == case.startswith("unpack-4096-64-128-8-"), where
            elif case.startswith("packfallback-"):
                # Input rows not 16-byte aligned (odd D, shifted pointer) or a strided head
                # dim: payload loads (the .cg ones; the contiguous fp32 LSEs may be read as
                # vectors) never wider than 4 bytes (true alignment only, as Triton may
                # over-derive it: "misaligned address" on the GPU).
                assert kernel == "_a2a_pack_kernel", where
                payload = {k: v for k, v in ld.items() if ".cg." in k}
                assert _vector(payload, "v2") + _vector(payload, "v4") == 0, where
