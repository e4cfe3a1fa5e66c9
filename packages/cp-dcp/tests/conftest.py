"""Fixtures shared by the cp-dcp test folders."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from cpattn_common.interpret import triton_interpreting
from cpattn_testing.pytest_plugin import require_ptxas


@pytest.fixture
def run_sm90_script() -> Callable[[pathlib.Path], Any]:
    """Run an sm_90 compile script (``_compile*_sm90.py``) in a subprocess outside the Triton
    interpreter and return the JSON object of its last output line. Skips when Triton's
    NVIDIA backend (ptxas) is not installed."""
    require_ptxas()

    def run(script: pathlib.Path) -> Any:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["TRITON_DEFAULT_FP_FUSION"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(sys.path)
        proc = subprocess.run(
            [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    return run


WatchAccesses = Callable[[str, Any, int, int], list[np.ndarray]]


@pytest.fixture
def watch_interpreted_accesses(monkeypatch: pytest.MonkeyPatch) -> WatchAccesses:
    """``watch(kind, element_ty, base, elem_size) -> offsets``: Triton's interpreter records
    the element offsets from ``base`` (a data pointer) of every active lane of each masked
    ``kind`` (``"load"`` / ``"store"``) through a pointer to ``element_ty`` (``tl.float32``,
    ...) instead of making the access (a load gives 0 on its active lanes, ``other`` on the
    rest); other accesses run as usual.

    For checks of offsets past 2**31 elements without a tensor that large: the kernel gets a
    small tensor at ``base`` and the watched accesses never dereference. The list grows by
    one int64 array per watched access, while the test runs. Skips outside the interpreter
    (``TRITON_INTERPRET=1``).
    """
    if not triton_interpreting():
        pytest.skip("records accesses in Triton's interpreter (TRITON_INTERPRET=1)")
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder

    def watch(kind: str, element_ty: Any, base: int, elem_size: int) -> list[np.ndarray]:
        seen: list[np.ndarray] = []

        def offsets(ptrs: Any, mask: Any) -> None:
            addr = ptrs.data.astype(np.int64)[np.broadcast_to(mask.data, ptrs.data.shape)]
            seen.append((addr - np.int64(base)) // elem_size)

        if kind == "load":
            load = builder.create_masked_load

            def watched_load(self: Any, ptrs: Any, mask: Any, other: Any, *args: Any) -> Any:
                if ptrs.get_element_ty() != element_ty:
                    return load(self, ptrs, mask, other, *args)
                offsets(ptrs, mask)
                zeros = np.zeros(ptrs.data.shape, interpreter._get_np_dtype(element_ty))
                value = zeros if other is None else np.where(mask.data, zeros, other.data)
                return interpreter.TensorHandle(value, element_ty)

            monkeypatch.setattr(builder, "create_masked_load", watched_load)
        elif kind == "store":
            store = builder.create_masked_store

            def watched_store(self: Any, ptrs: Any, value: Any, mask: Any, *args: Any) -> Any:
                if ptrs.get_element_ty() != element_ty:
                    return store(self, ptrs, value, mask, *args)
                offsets(ptrs, mask)
                return None

            monkeypatch.setattr(builder, "create_masked_store", watched_store)
        else:
            raise ValueError(f"kind must be 'load' or 'store', got {kind!r}")
        return seen

    return watch


@pytest.fixture
def patch_direct_gathers(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """A call that makes ``DCPManager`` build the direct Q / KV gathers as on a multicast GPU
    node: the gate says yes and the workspaces are built without a multicast address (simulated
    peers need none). Tests call it where they want the patch to start."""
    from cpattn_dcp import manager as manager_mod
    from cpattn_dcp.direct import DirectDCPKVGatherWorkspace, DirectDCPQGatherWorkspace

    def patch() -> None:
        monkeypatch.setattr(manager_mod, "direct_gather_unavailable_reason", lambda *a, **k: None)
        monkeypatch.setattr(
            manager_mod,
            "get_direct_dcp_q_gather_workspace",
            lambda g, dev, t, hr, dq, dt, u, p, use: DirectDCPQGatherWorkspace(
                g, dev, t, hr, dq, dt, u, p, require_multicast=False
            ),
        )
        monkeypatch.setattr(
            manager_mod,
            "get_direct_dcp_kv_gather_workspace",
            lambda g, dev, cap, dk, dt, u, use: DirectDCPKVGatherWorkspace(
                g, dev, cap, dk, dt, u, require_multicast=False
            ),
        )

    return patch
