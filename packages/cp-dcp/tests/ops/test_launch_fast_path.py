"""Every combine op launches exactly one kernel per call, through ``launch_cached``'s fast path
after the first call (a plain JIT launch costs 20-40 µs of host time more). GPU only.

If this fails for one op only, that op's eager host time is dominated by Triton's JIT launch
path: ``launch_fast_path_reason(kernel)`` says why.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from cpattn_common.launch import launch_cache_info
from cpattn_dcp import a2a_pack, a2a_unpack_combine, correct_attn_out, mask_dcp_empty_shards_

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::RuntimeWarning")]


def _fast_launches(fn: Callable[[], object], calls: int = 3) -> int:
    for _ in range(2):  # compile + cache the specialisation
        fn()
    before = launch_cache_info()["fast"]
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return launch_cache_info()["fast"] - before


@pytest.mark.parametrize("b", [1, 4096])
def test_ops_use_cached_launch(device: torch.device, b: int) -> None:
    h, d, n = 64, 128, 4
    out = torch.randn(b, h, d, device=device, dtype=torch.bfloat16)
    lses = torch.randn(n, b, h, device=device)
    lse = torch.randn(b, h, device=device)
    seq_lens = torch.ones(b, device=device, dtype=torch.int32)
    qsl = torch.arange(b + 1, device=device, dtype=torch.int32)
    send = a2a_pack(out, lse, n, seq_lens=seq_lens, query_start_loc=qsl)
    cases: dict[str, Callable[[], object]] = {
        "correct_attn_out": lambda: correct_attn_out(out, lses, 1),
        "a2a_pack": lambda: a2a_pack(out, lse, n, seq_lens=seq_lens, query_start_loc=qsl),
        "a2a_unpack_combine": lambda: a2a_unpack_combine(send, head_dim=d, return_lse=True),
        "mask_dcp_empty_shards_": lambda: mask_dcp_empty_shards_(lse, seq_lens, qsl),
    }
    got = {name: _fast_launches(fn) for name, fn in cases.items()}
    assert got == dict.fromkeys(cases, 3), got
