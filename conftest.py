"""Repository-wide pytest setup: the cp-testing plugin (device fixture, rank launcher, markers)."""

pytest_plugins = ["cpattn_testing.pytest_plugin"]
