"""vLLM's AG combines also take ``out [B, 1, H, D]`` and ``lse [B, H, 1]`` / ``[B, 1, H]``
(squeezed, as its ``correct_attn_out`` does) and return the 3-D results: checked against the
float64 combine on simulated ranks, and bit for bit against the ``[B, H, D]`` / ``[B, H]`` call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from cpattn_dcp import cp_lse_ag_out_ar, cp_lse_ag_out_rs
from cpattn_testing import SimulatedWorld
from cpattn_testing.reference import lse_combine_ref
from cpattn_testing.tolerances import assert_close_to_ref

N, B, H, D = 2, 3, 4, 16
_LSE_LAYOUTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "B,H": lambda lse: lse,
    "B,H,1": lambda lse: lse[:, :, None],
    "B,1,H": lambda lse: lse[:, None, :],
}


@pytest.mark.parametrize("op", [cp_lse_ag_out_rs, cp_lse_ag_out_ar], ids=["rs", "ar"])
@pytest.mark.parametrize("lse_layout", list(_LSE_LAYOUTS))
def test_vllm_layouts_combine_exactly(device: torch.device, op: Any, lse_layout: str) -> None:
    gen = torch.Generator().manual_seed(7)
    outs = torch.randn(N, B, H, D, generator=gen, dtype=torch.float64)
    lses = torch.randn(N, B, H, generator=gen, dtype=torch.float64) * 3
    ref_out, ref_lse = lse_combine_ref(outs, lses)
    world = SimulatedWorld(N, device)
    to = _LSE_LAYOUTS[lse_layout]

    def call(out4: bool) -> list[Any]:
        def rank(g: Any) -> Any:
            out = outs[g.rank_in_group].float().to(device)
            lse = lses[g.rank_in_group].float().to(device)
            return op(out[:, None] if out4 else out, to(lse), g, return_lse=True)

        return world.run(rank)

    got, plain = call(out4=True), call(out4=False)
    for r, ((out, lse), (out_p, lse_p)) in enumerate(zip(got, plain, strict=True)):
        heads = slice(r * H // N, (r + 1) * H // N) if op is cp_lse_ag_out_rs else slice(0, H)
        assert out.dim() == 3
        assert lse.dim() == 2
        assert_close_to_ref(out, ref_out[:, heads], dtype=torch.float32, name="out")
        assert_close_to_ref(lse, ref_lse[:, heads], dtype=torch.float32, name="lse")
        assert torch.equal(out, out_p)
        assert torch.equal(lse, lse_p)
