"""Shared layer for context-parallel attention: process-group wrapper, capability gating, symmetric workspaces, LSE merge kernels."""

from cpattn_common.__about__ import __version__

__all__ = ["__version__"]
