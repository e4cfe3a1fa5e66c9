"""``scripts/gpu_tests.sh`` (what ``nox -s gpu_tests`` runs) tells a python without torch from a
machine without a GPU."""

from __future__ import annotations

import os
import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run_with_python3(tmp_path: pathlib.Path, body: str) -> subprocess.CompletedProcess[str]:
    """Run the script with a stand-in ``python3`` (a shell script with ``body``) first on PATH."""
    shim = tmp_path / "python3"
    shim.write_text(f"#!/bin/sh\n{body}\n")
    shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ.get('PATH', '')}"}
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_tests.sh"), "-q"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_python_without_torch_fails(tmp_path: pathlib.Path) -> None:
    """From a virtual environment without torch the import failed, the script read that as
    "no CUDA device", printed SKIPPED and exited 0: nox reported the session successful."""
    result = _run_with_python3(
        tmp_path, "echo \"ModuleNotFoundError: No module named 'torch'\" >&2; exit 1"
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "cannot import torch and triton" in result.stderr
    assert "SKIPPED" not in result.stdout


def test_a_machine_without_a_gpu_skips(tmp_path: pathlib.Path) -> None:
    """torch and triton import, CUDA is unavailable: a skip, exit 0."""
    body = 'case "$2" in *cuda.is_available*) exit 1;; *) exit 0;; esac'
    result = _run_with_python3(tmp_path, body)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SKIPPED gpu_tests: no CUDA device" in result.stdout
