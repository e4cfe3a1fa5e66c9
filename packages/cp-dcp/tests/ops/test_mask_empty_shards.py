"""mask_dcp_empty_shards_: kernel vs cpattn_testing.reference.mask_empty_shards_ref."""

from __future__ import annotations

import pytest
import torch

from cpattn_dcp import mask_dcp_empty_shards_
from cpattn_testing.reference import mask_empty_shards_ref

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _qsl(counts: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)


def test_vllm_seven_rows(device: torch.device) -> None:
    lse = torch.randn(7, 3, device=device)
    before = lse.clone()
    seq_lens = torch.tensor([0, 2], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 1, 5], dtype=torch.int32, device=device)
    ret = mask_dcp_empty_shards_(lse, seq_lens, qsl)
    assert ret is lse
    assert torch.isneginf(lse[[0, 5, 6]]).all()
    assert torch.equal(lse[1:5], before[1:5])


@pytest.mark.parametrize(
    ("lens", "counts", "padding", "lse_dtype"),
    [
        ([16, 0, 16, 0], [1, 1, 1, 1], 0, torch.float32),
        ([0, 0, 0], [2, 3, 1], 2, torch.bfloat16),
        ([5, 0, 7, 1, 0, 3, 0], [3, 0, 2, 1, 1, 0, 2], 3, torch.float16),
        ([7], [1], 0, torch.float32),
        ([4] * 37 + [0] * 3, [1] * 40, 5, torch.float32),
        # R >= 256 takes the binary-search path instead of the direct count.
        ([(7 * i) % 5 for i in range(300)], [(3 * i) % 4 for i in range(300)], 3, torch.float32),
    ],
    ids=["alt", "all-empty", "ragged-zero-queries", "single", "many-seqs", "binary-search"],
)
def test_matches_reference(
    device: torch.device,
    lens: list[int],
    counts: list[int],
    padding: int,
    lse_dtype: torch.dtype,
) -> None:
    qsl = _qsl(counts)
    b = int(qsl[-1]) + padding
    gen = torch.Generator().manual_seed(len(lens) * 7 + padding)
    # Non-contiguous view into padded-head storage.
    host = torch.randn(b, 9, generator=gen).to(lse_dtype)
    storage = host.to(device)
    lse = storage[:, 1:6]
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    expected = mask_empty_shards_ref(host[:, 1:6], seq_lens, qsl)
    mask_dcp_empty_shards_(lse, seq_lens.to(device), qsl.to(device))
    bits = torch.int16 if lse_dtype != torch.float32 else torch.int32
    assert torch.equal(lse.cpu().contiguous().view(bits), expected.contiguous().view(bits))
    # Columns outside the view are untouched.
    assert torch.equal(storage[:, 0].cpu(), host[:, 0])
    assert torch.equal(storage[:, 6:].cpu(), host[:, 6:])


def test_int64_inputs_and_zero_seqs(device: torch.device) -> None:
    lse = torch.randn(3, 2, device=device)
    mask_dcp_empty_shards_(
        lse,
        torch.zeros(0, dtype=torch.int64, device=device),
        torch.zeros(1, dtype=torch.int64, device=device),
    )
    assert torch.isneginf(lse).all()


def test_none_is_noop(device: torch.device) -> None:
    lse = torch.randn(4, 2, device=device)
    before = lse.clone()
    mask_dcp_empty_shards_(lse, None, None)
    assert torch.equal(lse, before)


def test_bad_inputs(device: torch.device) -> None:
    lse = torch.randn(4, 2, device=device)
    sl = torch.tensor([1, 2], device=device)
    qsl = torch.tensor([0, 1, 3], device=device)
    with pytest.raises(ValueError, match="provided together"):
        mask_dcp_empty_shards_(lse, sl, None)
    with pytest.raises(ValueError, match="provided together"):
        mask_dcp_empty_shards_(lse, None, qsl)
    with pytest.raises(ValueError, match=r"one boundary per sequence.*2 boundaries for 2"):
        mask_dcp_empty_shards_(lse, sl, qsl[:2])
    with pytest.raises(ValueError, match="1-D"):
        mask_dcp_empty_shards_(lse, sl[None], qsl)
    with pytest.raises(ValueError, match=r"expected lse \[B, H\]"):
        mask_dcp_empty_shards_(lse[0], sl, qsl)
    with pytest.raises(TypeError, match="floating"):
        mask_dcp_empty_shards_(lse.long(), sl, qsl)
    with pytest.raises(TypeError, match="integer"):
        mask_dcp_empty_shards_(lse, sl.float(), qsl)
    if device.type == "cuda":
        with pytest.raises(ValueError, match="device"):
            mask_dcp_empty_shards_(lse, sl.cpu(), qsl.cpu())


def test_opcheck(device: torch.device) -> None:
    lse = torch.randn(6, 3, device=device)
    sl = torch.tensor([0, 3], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 2, 5], dtype=torch.int32, device=device)
    torch.library.opcheck(torch.ops.cpattn_dcp.mask_dcp_empty_shards_.default, (lse, sl, qsl))


def test_compile_fullgraph(device: torch.device) -> None:
    sl = torch.tensor([0, 3], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 2, 5], dtype=torch.int32, device=device)

    def fn(lse: torch.Tensor) -> torch.Tensor:
        lse = lse * 1.0
        mask_dcp_empty_shards_(lse, sl, qsl)
        return lse + 0.0

    x = torch.randn(7, 3, device=device)
    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(x)
    assert torch.equal(got, fn(x))
    assert torch.isneginf(got[[0, 1, 5, 6]]).all()
    assert torch.isfinite(got[2:5]).all()
