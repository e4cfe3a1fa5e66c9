"""``triton_interpreting``: TRITON_INTERPRET read as the installed Triton reads it, and the
decisions that follow it."""

from __future__ import annotations

import pytest
import torch
import triton

from cpattn_common import interpret as interpret_mod
from cpattn_common.interpret import triton_interpreting
from cpattn_common.ops.merge_attn_states import triton_usable

_VALUES = ["1", "true", "On", "yes", "y", "TRUE", "0", "", "2", "off", None]
_KNOBS = getattr(triton, "knobs", None)


def _set(monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    if value is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", value)


@pytest.mark.parametrize("value", _VALUES)
def test_agrees_with_triton(monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    _set(monkeypatch, value)
    if _KNOBS is None:  # Triton 3.3: its jit decorator compares to "1"
        assert triton_interpreting() is (value == "1")
    else:
        assert triton_interpreting() is bool(_KNOBS.runtime.interpret)


@pytest.mark.skipif(_KNOBS is None, reason="Triton 3.3 has no triton.knobs")
@pytest.mark.parametrize(
    ("value", "on"),
    [("true", True), ("On", True), ("yes", True), ("0", False), ("", False), ("2", False)],
)
def test_spellings_triton_knobs_accept(
    monkeypatch: pytest.MonkeyPatch, value: str, on: bool
) -> None:
    """The spellings this Triton reads as on (3.4+: a boolean knob), not only ``1``."""
    _set(monkeypatch, value)
    assert triton_interpreting() is on


@pytest.mark.skipif(_KNOBS is None, reason="Triton 3.3 has no triton.knobs")
def test_knob_set_in_code_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    """``triton.knobs.runtime.interpret = True`` overrides the environment, for Triton and
    for the helper alike."""
    assert _KNOBS is not None
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(_KNOBS, "propagate_env", False)  # keep the variable at "0"
    _KNOBS.runtime.interpret = True
    try:
        assert triton_interpreting() is True
    finally:
        del _KNOBS.runtime.interpret
    assert triton_interpreting() is False


@pytest.mark.parametrize(
    ("value", "on"), [("1", True), ("true", False), ("0", False), (None, False)]
)
def test_triton_33_rule(monkeypatch: pytest.MonkeyPatch, value: str | None, on: bool) -> None:
    """Without ``triton.knobs`` (Triton 3.3) only ``1`` is on, as in its jit decorator."""
    monkeypatch.setattr(interpret_mod, "_runtime_knobs", None)
    _set(monkeypatch, value)
    assert triton_interpreting() is on


@pytest.mark.parametrize("value", _VALUES)
def test_decisions_follow_it(monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    """The merge's backend choice reads how its kernel was decorated (under the variable at
    import), whatever the variable says now, so a CPU call never reaches a kernel compiled for
    a GPU."""
    from cpattn_common.kernels.merge_attn_states import _merge_attn_states_fwd_kernel

    decorated_interpreted = type(_merge_attn_states_fwd_kernel).__name__ == "InterpretedFunction"
    _set(monkeypatch, value)
    assert triton_usable(torch.device("cpu")) is decorated_interpreted
    assert triton_usable(torch.device("meta")) is False
