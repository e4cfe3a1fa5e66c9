"""Fixtures shared by cp-common's tests."""

from __future__ import annotations

from typing import Any

import pytest


class _FakeDriver:
    """Stands in for ``triton.runtime.driver``: current device 0, current stream 777."""

    class active:
        @staticmethod
        def get_current_device() -> int:
            return 0

        @staticmethod
        def get_current_stream(device: int) -> int:
            return 777


@pytest.fixture
def fake_triton_driver() -> Any:
    """A Triton driver object whose current device is 0 and current stream 777 (to put in
    place of ``cpattn_common.launch``'s runtime driver)."""
    return _FakeDriver
