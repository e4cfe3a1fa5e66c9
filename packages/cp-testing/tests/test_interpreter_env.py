"""cp-testing decides "Triton runs its interpreter" as the installed Triton does
(``cpattn_common.interpret.triton_interpreting``), not by comparing TRITON_INTERPRET to "1"."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from cpattn_common.interpret import triton_interpreting
from cpattn_testing import demo, interpreter


@pytest.mark.parametrize("value", ["1", "true", "On", "yes", "0", "", "2", None])
def test_fixes_and_demo_note_follow_triton(
    monkeypatch: pytest.MonkeyPatch, value: str | None
) -> None:
    if value is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", value)
    calls: list[str] = []

    def recorder(name: str) -> Callable[[], bool]:
        def fix() -> bool:
            calls.append(name)
            return True

        return fix

    monkeypatch.setattr(interpreter, "exact_bf16_widening", recorder("w"))
    monkeypatch.setattr(interpreter, "rtne_bf16_narrowing", recorder("n"))
    interpreter.apply_interpreter_fixes()
    on = triton_interpreting()
    assert calls == (["w", "n"] if on else [])
    assert demo._interpreted() is on
