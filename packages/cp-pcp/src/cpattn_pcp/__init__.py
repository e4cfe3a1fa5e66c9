"""Prefill context parallel (PCP) helpers: DualChunkSwap partitioning, cache-input gathers, head reconciliation."""

from cpattn_pcp.__about__ import __version__

__all__ = ["__version__"]
