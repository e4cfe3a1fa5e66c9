"""The device-side failure word shared by every direct workspace of one group on one device.

A timeout sets the error record of the workspace whose wait timed out, and that workspace stops
publishing (``cpattn_dcp.kernels.direct_protocol``). That alone does not protect the *other*
direct workspaces of the group: the query gather of a ``DCPManager`` has a single buffer per
ubatch, guarded between calls only by the A2A combine's rendezvous. After this rank's combine
timed out (a peer merely slow), the host does not know yet, the query gather is still healthy,
and its next publish would overwrite the query the slow peer is still reading. So every timeout
also sets one int64 word per (group, device), and every publish and wait program of every
direct workspace of that group (all kinds, geometries and ubatches) checks it at its start.

The word is an ordinary local tensor (not symmetric memory): it only tells this rank's own
kernels that this rank failed. It is keyed like the workspace factories key their workspaces,
by ``cache_owner(shared_cp_group(group))`` (so every wrapper of one process group shares it;
each ``SimulatedGroup``, one per simulated rank, is its own owner and gets its own word) plus
the indexed device. The memo holds the word weakly and the owner strongly: every workspace holds
its word, so the word, and the memo entry keeping the owner's ``id()`` from being reused, live
exactly as long as some workspace of the group does. A set word is never cleared: once one of
the group's workspaces failed, the group is broken (rebuild it; a new group gets a new word).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from cpattn_common.group import cache_owner, shared_cp_group

__all__ = ["group_failure_word"]

# Re-entrant: a collection inside the locked block may run another word's ``_forget`` here.
_lock = threading.RLock()
# (id(owner), device) -> (owner, held so that its id() cannot be reused, weak ref to the word).
_words: dict[tuple[int, str], tuple[Any, weakref.ref[torch.Tensor]]] = {}


def group_failure_word(group: Any, device: torch.device) -> torch.Tensor:
    """The int64 ``[1]`` failure word of ``group`` on ``device`` (zero until a direct wait of
    one of the group's workspaces on this device times out).

    Args:
        group: the DCP group (anything ``shared_cp_group`` takes).
        device: the indexed device of the caller's workspace.

    Returns:
        The same tensor for every caller of this group and device while any caller holds it.
    """
    owner = cache_owner(shared_cp_group(group))
    key = (id(owner), str(device))
    with _lock:
        entry = _words.get(key)
        word = entry[1]() if entry is not None else None
        if word is not None:
            return word
        word = torch.zeros((1,), dtype=torch.int64, device=device)
        ref: weakref.ref[torch.Tensor] | None = None

        def _forget(_: object) -> None:
            # Only this word's own entry: a word made later under the same key stays.
            with _lock:
                current = _words.get(key)
                if current is not None and current[1] is ref:
                    del _words[key]

        ref = weakref.ref(word, _forget)
        _words[key] = (owner, ref)
        return word
