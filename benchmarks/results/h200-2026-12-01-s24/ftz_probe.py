"""Where does a NaN partial stop reaching the output? (s24 run 5; GPU or interpreter)

Two sources per row: source 0 with LSE 0 and a finite output, source 1 with a NaN output and
LSE -gap (base e). The ops give a zero weight exactly 0 contribution, so the output is NaN only
while source 1's fp32 weight is nonzero: below ~103.3 with subnormals (the interpreter), below
~87.3 if exp2 flushes subnormal results (the sm_90 PTX has ex2.approx.ftz.f32).
"""

from __future__ import annotations

import torch

from cpattn_common import merge_attn_states
from cpattn_dcp import correct_attn_out
from cpattn_dcp.ops.a2a_combine import a2a_pack, a2a_unpack_combine

dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
h, d = 4, 8
for gap in (80.0, 86.0, 87.0, 88.0, 90.0, 95.0, 100.0, 103.0, 104.0, 110.0):
    outs = torch.stack([torch.randn(1, h, d), torch.full((1, h, d), float("nan"))]).to(dev)
    lses = torch.tensor([0.0, -gap]).view(2, 1, 1).expand(2, 1, h).contiguous().to(dev)
    merged = merge_attn_states(outs, lses)
    assert isinstance(merged, torch.Tensor)
    corrected, _ = correct_attn_out(outs[1].clone(), lses, 1)
    # The A2A unpack of the same two sources (N=2, each rank's heads: all h of one source
    # here, packed as rank 0's / rank 1's partials of a one-row batch).
    send = [a2a_pack(outs[r].repeat(1, 2, 1), lses[r].repeat(1, 2), 2) for r in range(2)]
    recv = torch.stack([send[0][0], send[1][0]])  # what rank 0 receives
    unpacked, _ = a2a_unpack_combine(recv, head_dim=d)
    print(
        f"gap {gap:6.1f}: merge NaN {bool(merged.isnan().any())}, "
        f"correct_attn_out NaN {bool(corrected.isnan().any())}, "
        f"a2a unpack NaN {bool(unpacked.isnan().any())}",
        flush=True,
    )
