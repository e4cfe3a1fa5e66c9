"""The ``>>>`` examples in the four packages' docstrings run as doctests, so they cannot rot.

One test per module that holds examples. A fragment that needs objects the example does not
make (a process group, a rank's partial output) carries ``# doctest: +SKIP``.
"""

from __future__ import annotations

import doctest
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SRC_DIRS = [ROOT / "packages" / p / "src" for p in ("cp-common", "cp-dcp", "cp-pcp", "cp-testing")]


def _modules_with_examples() -> list[str]:
    names = []
    for src in SRC_DIRS:
        for path in sorted(src.rglob("*.py")):
            if path.name == "__main__.py" or ">>>" not in path.read_text():
                continue
            rel = path.relative_to(src).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            names.append(".".join(parts))
    return names


@pytest.mark.parametrize("module", _modules_with_examples())
def test_docstring_examples(module: str) -> None:
    result = doctest.testmod(
        importlib.import_module(module),
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
        report=True,
        verbose=False,
    )
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed"
