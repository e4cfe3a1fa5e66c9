"""A head dim past the merge kernel's tile limit (2**20 lanes) is merged by the torch twin, as
the cp-dcp combines (which loop over D) merge it; the typed launcher refuses it by name."""

from __future__ import annotations

import pytest
import torch

from cpattn_common import merge_attn_states, merge_attn_states_torch
from cpattn_common.ops.merge_attn_states import merge_attn_states_fwd

D = 2**20 + 1


def test_head_dim_past_the_tile_limit(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(0)
    outs = torch.randn(2, 1, 1, D, generator=gen).to(device)
    lses = torch.tensor([[[0.5]], [[-0.25]]]).to(device)
    out, lse = merge_attn_states(outs, lses, return_lse=True)
    want, want_lse = merge_attn_states_torch(outs, lses)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)
    with pytest.raises(ValueError, match=f"head_dim {D} > 1048576, the kernel.s tile limit"):
        merge_attn_states_fwd(outs, lses)
