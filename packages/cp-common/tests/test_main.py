"""``python -m cpattn_common build-launch-plans``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cpattn_common.__main__ import main


def test_build_launch_plans_prints_the_module_file() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-m", "cpattn_common", "build-launch-plans"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    path = done.stdout.split("launch plans: ", 1)[1].rsplit(" (", 1)[0]
    assert Path(path).is_file()
    assert Path(path).name.startswith("cpattn_launch_plans_")


def test_a_failed_build_exits_non_zero(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from cpattn_common import launch_plans

    def failing() -> None:
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(launch_plans, "_native_module", failing)
    assert main(["build-launch-plans"]) == 1
    assert "no C++ compiler found" in capsys.readouterr().err


def test_a_command_is_required() -> None:
    with pytest.raises(SystemExit):
        main([])
