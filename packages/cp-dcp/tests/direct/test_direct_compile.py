"""The direct-path kernels build for sm_90 (H200) on the CPU, with the memory ordering the
protocol needs: the signal is a system-scope release exchange, the wait a system-scope acquire,
the counters acq_rel at GPU scope; the payload moves in 16-byte vectors and the receiver's
payload loads bypass L1 (``.cg``), so a slot reused two calls later is never served stale."""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

_SCRIPT = pathlib.Path(__file__).with_name("_compile_direct_sm90.py")


def test_direct_kernels_compile_for_sm90_with_protocol_ordering(
    run_sm90_script: Callable[[pathlib.Path], Any],
) -> None:
    ptx = {k: set(v) for k, v in run_sm90_script(_SCRIPT).items()}
    for name, forms in ptx.items():
        if "publish" in name:
            assert "atom.global.sys.release.exch.b64" in forms, (name, forms)  # the signal
            assert "atom.global.gpu.acq_rel.add.u32" in forms, (name, forms)  # the counter
            assert any(f.startswith("st.global.v4") for f in forms), (name, forms)
        else:
            assert "atom.global.sys.acquire.add.u64" in forms, (name, forms)  # the wait
            assert "atom.global.gpu.release.exch.b64" in forms, (name, forms)  # epoch advance
            # The flag-2 record (group failed elsewhere first) never overwrites a set record.
            assert "atom.global.release.gpu.cas.b64" in forms, (name, forms)
        if name.startswith("a2a_combine") or name.startswith("gather_wait_copy1"):
            assert any(f.startswith("ld.global.cg.v4") for f in forms), (name, forms)
            assert any(f.startswith("st.global.v4") for f in forms), (name, forms)
        if name == "gather_wait_copy0":  # the query gather reads nothing; a failure stores NaN
            assert not any(f.startswith("ld.global.cg") for f in forms), (name, forms)
            assert any(f.startswith("st.global.v4") for f in forms), (name, forms)
