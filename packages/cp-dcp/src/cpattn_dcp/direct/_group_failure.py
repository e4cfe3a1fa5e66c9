"""The device-side failure word shared by every direct workspace of one group on one device:
every timeout sets it and every publish and wait program checks it first (docs/direct-internals.md,
"Bounded waits and sticky failure"). Held weakly; a set word is never cleared.
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
    """The int64 ``[1]`` failure word of ``group`` on the indexed ``device`` (zero until a
    direct wait of one of the group's workspaces there times out): the same tensor for every
    caller while any caller holds it."""
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
