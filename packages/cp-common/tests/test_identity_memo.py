"""``IdentityMemo``: entries by identity that go with their keys."""

from __future__ import annotations

import gc
import threading

from cpattn_common.identity_memo import IdentityMemo
from cpattn_testing.forks import fork_while_held


class Key:
    """Equal to every other key and hashing alike: the memo must not look at either."""

    def __eq__(self, other: object) -> bool:
        return True

    def __hash__(self) -> int:
        return 0


class Slotted:
    __slots__ = ()  # takes no weak reference


def test_lookup_is_by_identity() -> None:
    memo: IdentityMemo[str] = IdentityMemo()
    a, b = Key(), Key()
    assert memo.setdefault(a, "a") == "a"
    assert memo.setdefault(a, "other") == "a"  # the first value stays
    assert memo.get(a, None) == "a"
    assert memo.get(b, "missing") == "missing"
    memo.clear()
    assert memo.get(a, "missing") == "missing"


def test_an_entry_goes_with_its_key() -> None:
    memo: IdentityMemo[int] = IdentityMemo()
    keys = [Key() for _ in range(100)]
    for i, key in enumerate(keys):
        memo.setdefault(key, i)
    assert len(memo) == 100
    del keys, key
    gc.collect()
    assert len(memo) == 0


def test_a_new_object_at_a_dead_ones_address_is_not_its_entry() -> None:
    """CPython reuses addresses at once; the dead key's entry must not answer for the new."""
    memo: IdentityMemo[str] = IdentityMemo()
    seen: set[int] = set()
    reused = 0
    for _ in range(200):
        key = Key()
        reused += id(key) in seen
        assert memo.get(key, None) is None
        memo.setdefault(key, "x")
        seen.add(id(key))
        del key
    assert reused > 0  # the situation under test did occur
    assert len(memo) == 0


def test_keys_without_weak_references_are_held() -> None:
    memo: IdentityMemo[str] = IdentityMemo()
    key = Slotted()
    memo.setdefault(key, "held")
    ident = id(key)
    del key
    gc.collect()
    assert len(memo) == 1  # held, so that its address is not reused while the entry exists
    assert ident in memo.entries
    memo.clear()
    assert len(memo) == 0


def test_concurrent_first_lookups_agree() -> None:
    memo: IdentityMemo[object] = IdentityMemo()
    key = Key()
    results: list[object] = []
    start = threading.Barrier(8)

    def first_lookup() -> None:
        start.wait()
        results.append(memo.setdefault(key, object()))

    threads = [threading.Thread(target=first_lookup) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({id(r) for r in results}) == 1


def test_a_child_forked_while_the_lock_is_held_can_write() -> None:
    """Another thread holds the memo's lock at the fork: the child gets a fresh lock."""
    memo: IdentityMemo[str] = IdentityMemo()
    code = fork_while_held([memo._lock], lambda: memo.setdefault(Key(), "written") == "written")
    assert code is not None, "the child blocked on the lock held at the fork"
    assert code == 0


def test_a_memo_that_does_not_hold_skips_keys_without_weak_references() -> None:
    memo: IdentityMemo[str] = IdentityMemo(hold_unreferable=False)
    key = Slotted()
    assert memo.setdefault(key, "not stored") == "not stored"
    assert len(memo) == 0
    assert memo.get(key, "missing") == "missing"
    weak = Key()
    memo.setdefault(weak, "stored")
    assert memo.get(weak, None) == "stored"
