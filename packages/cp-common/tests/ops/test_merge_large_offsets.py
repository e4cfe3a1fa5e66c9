"""``merge_attn_states`` past 2**31 elements, where int32 offsets would wrap (GPU only).

Fresh random partials whose last sources and rows sit past element offset 2**31, compared
row chunk by row chunk with the float64 reference on the device. Needs about 13 GB of free
device memory per test; skips otherwise.
"""

from __future__ import annotations

import pytest
import torch

from cpattn_common import merge_attn_states
from cpattn_testing.cases import random_lses
from cpattn_testing.pytest_plugin import require_device_memory
from cpattn_testing.reference import lse_combine_ref
from cpattn_testing.tolerances import ChunkedAgreement, assert_close_by_row_chunks

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

_INT32_SPAN = 2**31
_CHUNK_ROWS = 1 << 12  # float64 temporaries of a chunk stay within about 2 GB


@pytest.mark.parametrize("layout", ["contiguous", "head-slice"])
def test_merge_past_int32_offsets(device: torch.device, layout: str) -> None:
    """Every merged row and LSE matches the reference; with a head slice of a wider tensor
    the partials' strides are not those of a packed tensor."""
    n, h, d = 2, 8, 512
    extra_heads = 1 if layout == "head-slice" else 0
    b = _INT32_SPAN // (n * (h + extra_heads) * d) + 64
    require_device_memory(device, 2 * n * b * (h + extra_heads) * d * 2 + 4 * 2**30)
    gen = torch.Generator(device).manual_seed(201 + extra_heads)
    backing = torch.randn(
        n, b, h + extra_heads, d, generator=gen, device=device, dtype=torch.bfloat16
    )
    partial_outs = backing[:, :, extra_heads:]
    partial_lses = random_lses((n, b, h), gen)
    out, lse = merge_attn_states(partial_outs, partial_lses, return_lse=True)
    assert_close_by_row_chunks(
        [out, lse],
        lambda s, e: lse_combine_ref(partial_outs[:, s:e], partial_lses[:, s:e]),
        [
            ChunkedAgreement(torch.bfloat16, name="out", reduction_len=n),
            ChunkedAgreement(torch.float32, name="lse"),
        ],
        chunk_rows=_CHUNK_ROWS,
    )
