"""Decode context parallel (DCP) attention combine ops, Q/KV gathers and manager."""

from cpattn_dcp.__about__ import __version__

__all__ = ["__version__"]
