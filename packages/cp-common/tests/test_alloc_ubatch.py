"""alloc (poisoned outputs) and ubatch (micro-batch id context)."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
import torch

import cpattn_common
import cpattn_common.alloc as alloc_mod
from cpattn_common.alloc import (
    empty_output,
    get_output_poison,
    new_output,
    poison_outputs,
    set_output_poison,
)
from cpattn_common.ubatch import current_ubatch_id, set_ubatch_id, ubatch_context
from cpattn_testing.forks import fork_while_held


@pytest.mark.no_output_poison
def test_poison_off_and_on(device: torch.device) -> None:
    previous = get_output_poison()
    set_output_poison(None)
    try:
        out = empty_output((2, 3), dtype=torch.float32, device=device)
        assert out.shape == (2, 3)
        with poison_outputs():
            assert torch.isnan(empty_output((4,), dtype=torch.bfloat16, device=device)).all()
            ints = empty_output((3,), dtype=torch.int32, device=device)
            assert (ints == torch.iinfo(torch.int32).max).all()
            assert empty_output((2,), dtype=torch.bool, device=device).all()
            assert empty_output((0, 5), dtype=torch.float32, device=device).numel() == 0
        assert get_output_poison() is None
        with poison_outputs(7.0):
            assert (empty_output((3,), dtype=torch.float16, device=device) == 7).all()
            like = torch.zeros(2, dtype=torch.bfloat16, device=device)
            same = new_output(like, (2, 5))
            assert same.dtype == torch.bfloat16
            assert same.device == like.device
            assert (same == 7).all()
            assert (new_output(like, (4,), torch.int64) == torch.iinfo(torch.int64).max).all()
        assert new_output(like, (3, 1), torch.float32).shape == (3, 1)  # poison off: no fill
    finally:
        set_output_poison(previous)


@pytest.mark.no_output_poison
def test_poison_contexts_of_threads_exiting_out_of_order_restore_the_setting() -> None:
    """Thread A enters, thread B enters, A exits, B exits: poisoning is off afterwards (a
    save-and-restore context left B's saved value, A's poison, on for good)."""
    import threading

    assert get_output_poison() is None
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen: list[float | None] = []

    def thread_a() -> None:
        with poison_outputs(1.0):
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def thread_b() -> None:
        a_in.wait(10)
        with poison_outputs(2.0):
            b_in.set()
            a_out.wait(10)
            seen.append(get_output_poison())  # B's context is still open: its value

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert seen == [2.0]
    assert get_output_poison() is None


def test_plugin_poisons_by_default(device: torch.device) -> None:
    """The cpattn_testing plugin turns NaN poisoning on for every test."""
    assert torch.isnan(empty_output((3,), dtype=torch.float32, device=device)).all()


def test_ubatch_context_nests_and_restores() -> None:
    assert current_ubatch_id() == 0
    with ubatch_context(1) as u:
        assert u == 1
        assert current_ubatch_id() == 1
        with ubatch_context(0):
            assert current_ubatch_id() == 0
        assert current_ubatch_id() == 1
    assert current_ubatch_id() == 0
    with pytest.raises(ValueError, match="-1"):
        set_ubatch_id(-1)
    with pytest.raises(TypeError):
        set_ubatch_id(True)


def test_ubatch_is_per_thread_and_task() -> None:
    seen: dict[str, int] = {}

    def worker() -> None:
        seen["thread"] = current_ubatch_id()

    with ubatch_context(1):
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    assert seen["thread"] == 0

    async def task(i: int) -> int:
        with ubatch_context(i):
            await asyncio.sleep(0)
            return current_ubatch_id()

    async def main() -> list[int]:
        return list(await asyncio.gather(task(0), task(1)))

    assert asyncio.run(main()) == [0, 1]


def test_public_names() -> None:
    for name in cpattn_common.__all__:
        assert hasattr(cpattn_common, name), name


@pytest.mark.no_output_poison
def test_set_output_poison_inside_contexts_is_undone_as_they_exit() -> None:
    """A save / set / restore inside a context, and a setting inside an outer context around
    a nested one, leave everything as it was (as with save-and-restore contexts)."""
    assert get_output_poison() is None
    with poison_outputs(1.0):
        saved = get_output_poison()
        set_output_poison(None)
        assert get_output_poison() is None
        set_output_poison(saved)
    assert get_output_poison() is None
    with poison_outputs(1.0):
        set_output_poison(None)
        with poison_outputs(2.0):
            assert get_output_poison() == 2.0
        assert get_output_poison() is None  # the outer context's setting, not undone
    assert get_output_poison() is None


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_while_the_poison_lock_is_held_can_set_poison() -> None:
    previous = get_output_poison()
    try:
        code = fork_while_held(
            [alloc_mod._lock],
            lambda: (set_output_poison(1.5), get_output_poison() == 1.5)[1],
        )
    finally:
        set_output_poison(previous)
    assert code == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_while_another_thread_poisons_does_not_poison() -> None:
    """Another thread inside ``poison_outputs(7.0)`` at the fork: that thread does not live
    on in the child, so its context would never exit and every output there was filled with
    7.0. The forking thread's own setting (the plugin's, here) stays."""
    expected = get_output_poison()

    def same(value: float | None) -> bool:
        if value is None or expected is None:
            return value is expected
        return value == expected or (value != value and expected != expected)  # NaN

    code = fork_while_held([poison_outputs(7.0)], lambda: same(get_output_poison()))
    assert code == 0
    assert same(get_output_poison())
