"""Every combine op launches exactly one kernel per call, through the cached compiled handle
(``cpattn_common.launch``) after the first call of a key. GPU only.

If this fails for one op only, that op's eager host time is dominated by Triton's JIT launch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from cpattn_common import launch as launch_mod
from cpattn_dcp import a2a_pack, a2a_unpack_combine, correct_attn_out, mask_dcp_empty_shards_

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::RuntimeWarning")]


def _handle_launches(
    monkeypatch: pytest.MonkeyPatch, fn: Callable[[], object], calls: int = 3
) -> list[bool]:
    """Per launch of ``calls`` calls of ``fn`` (after two to compile): whether its key had a
    cached handle."""
    for _ in range(2):
        fn()
    seen: list[bool] = []
    launch = launch_mod.Specialization.__call__

    def counted(spec: Any, grid: tuple[int, ...], *args: Any) -> None:
        key = (launch_mod.current_device(), launch_mod._key(args))
        seen.append(key in spec._handles)
        launch(spec, grid, *args)

    with monkeypatch.context() as m:
        m.setattr(launch_mod.Specialization, "__call__", counted)
        for _ in range(calls):
            fn()
    torch.cuda.synchronize()
    return seen


@pytest.mark.parametrize("b", [1, 4096])
def test_ops_use_cached_launch(
    device: torch.device, monkeypatch: pytest.MonkeyPatch, b: int
) -> None:
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
    got = {name: _handle_launches(monkeypatch, fn) for name, fn in cases.items()}
    assert got == dict.fromkeys(cases, [True] * 3), got
