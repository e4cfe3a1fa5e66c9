"""``scripts/gpu_tests.sh`` (what ``nox -s gpu_tests`` runs) tells a python without torch, or
with a CPU-only torch, from a machine without a GPU."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

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


def test_a_cpu_only_torch_fails(tmp_path: pathlib.Path) -> None:
    """torch and triton import but torch is a CPU build (a venv from the CPU setup): the script
    blamed the machine ("no CUDA device is visible"), printed SKIPPED and exited 0."""
    body = (
        'case "$2" in *torch.version.cuda*) exit 1;; *__version__*) echo 2.13.0+cpu;; '
        "*cuda.is_available*) echo REACHED; exit 1;; *) exit 0;; esac"
    )
    result = _run_with_python3(tmp_path, body)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{tmp_path / 'python3'} has a CPU-only torch (2.13.0+cpu" in result.stderr
    assert "SKIPPED" not in result.stdout
    assert "REACHED" not in result.stdout


@pytest.mark.parametrize(
    ("cuda", "hip", "returncode"),
    [(None, None, 1), ("12.8", None, 0), (None, "6.4.0", 0)],
    ids=["cpu-only", "cuda-build", "rocm-build"],
)
def test_the_build_check_against_a_fake_torch(
    tmp_path: pathlib.Path, cuda: str | None, hip: str | None, returncode: int
) -> None:
    """The script's own python checks, run by a real interpreter on a stand-in ``torch`` with no
    visible GPU: a CPU-only build fails, a CUDA or ROCm build skips."""
    fake = tmp_path / "fake"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text(
        '__version__ = "2.13.0+fake"\nfrom . import cuda, version\n'
    )
    (fake / "torch" / "version.py").write_text(f"cuda = {cuda!r}\nhip = {hip!r}\n")
    (fake / "torch" / "cuda.py").write_text("def is_available():\n    return False\n")
    (fake / "triton.py").write_text('__version__ = "3.9.0+fake"\n')
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    body = f'PYTHONPATH="$PYTHONPATH:{fake}" exec {sys.executable} "$@"'
    result = _run_with_python3(bin_dir, body)
    assert result.returncode == returncode, result.stdout + result.stderr
    if returncode:
        assert "has a CPU-only torch (2.13.0+fake: neither a CUDA nor a ROCm build)" in (
            result.stderr
        )
        assert "SKIPPED" not in result.stdout
    else:
        assert "SKIPPED gpu_tests: no CUDA device" in result.stdout
