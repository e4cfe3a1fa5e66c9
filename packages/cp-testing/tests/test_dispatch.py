"""cpattn_testing.dispatch: the inputs handed to the function keep the caller's layout."""

from __future__ import annotations

import torch

from cpattn_common.ops.merge_attn_states import merge_attn_states
from cpattn_testing.dispatch import _same_layout_copy, assert_dispatches


def test_copies_keep_strides_gaps_and_overlaps() -> None:
    base = torch.randn(4, 8)
    for t in (base[:, ::2], base.t(), base[:1].expand(3, 8), base[1:3, 2:5], torch.empty(0, 3)):
        copy = _same_layout_copy(t)
        assert copy.shape == t.shape
        assert copy.stride() == t.stride()
        assert torch.equal(copy, t)
        assert copy.numel() == 0 or copy.data_ptr() != t.data_ptr()


def test_assert_dispatches_runs_the_function_on_the_callers_layout() -> None:
    """clone() made a strided view with gaps contiguous, so a caller checking strided inputs
    never exercised them."""
    outs = torch.randn(2, 3, 4, 16)[..., ::2]
    lses = torch.randn(2, 3, 8)[..., ::2]
    strides: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def fn(o: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        strides.append((o.stride(), s.stride()))
        return merge_attn_states(o, s)

    assert_dispatches(fn, (outs, lses), "cpattn_common.merge_attn_states.default")
    assert strides[0] == (outs.stride(), lses.stride())
    assert strides[1] == (outs.stride(), lses.stride())
