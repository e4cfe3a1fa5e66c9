"""The import-layer contract (root pyproject.toml) holds on main and fails on planted violations."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ["cp-common", "cp-dcp", "cp-pcp", "cp-testing"]


def _lint_imports(src_root: pathlib.Path) -> subprocess.CompletedProcess[str]:
    lint_imports = shutil.which("lint-imports")
    if lint_imports is None:
        pytest.fail("import-linter is not installed in this environment (nox installs it)")
    pythonpath = ":".join(str(src_root / p) for p in PACKAGES)
    return subprocess.run(
        [lint_imports, "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=src_root,
        env={"PYTHONPATH": pythonpath, "PATH": str(pathlib.Path(sys.executable).parent)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.fixture
def src_copy(tmp_path: pathlib.Path) -> pathlib.Path:
    """A copy of every package's src/ tree, one folder per package, to plant imports in."""
    for package in PACKAGES:
        shutil.copytree(ROOT / "packages" / package / "src", tmp_path / package)
    return tmp_path


def test_layers_hold_on_main(src_copy: pathlib.Path) -> None:
    result = _lint_imports(src_copy)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("package", "module", "forbidden"),
    [
        ("cp-pcp", "cpattn_pcp", "cpattn_dcp"),
        ("cp-dcp", "cpattn_dcp", "cpattn_pcp"),
        ("cp-common", "cpattn_common", "cpattn_dcp"),
        ("cp-dcp", "cpattn_dcp", "cpattn_testing"),
        ("cp-common", "cpattn_common", "cpattn_testing"),
    ],
    ids=["pcp->dcp", "dcp->pcp", "common->dcp", "dcp->testing", "common->testing"],
)
def test_planted_forbidden_import_fails(
    src_copy: pathlib.Path, package: str, module: str, forbidden: str
) -> None:
    planted = src_copy / package / module / "_planted_violation.py"
    planted.write_text(f"import {forbidden}  # planted by the layer test\n")
    result = _lint_imports(src_copy)
    assert result.returncode != 0, result.stdout
    assert "BROKEN" in result.stdout or "broken" in result.stdout.lower(), result.stdout
