"""pytest plugin of cpattn-testing (opt in with ``pytest_plugins = ["cpattn_testing.pytest_plugin"]``)."""

from __future__ import annotations
