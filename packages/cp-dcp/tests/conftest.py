"""Fixtures shared by the cp-dcp test folders."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

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
