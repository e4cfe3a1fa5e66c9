"""Testing kit for context-parallel attention: multi-process launcher, simulated groups, float64 references, tolerances, strategies, demo."""

from cpattn_testing.__about__ import __version__

__all__ = ["__version__"]
