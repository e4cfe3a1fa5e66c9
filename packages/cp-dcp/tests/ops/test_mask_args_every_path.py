"""One check of ``seq_lens`` / ``query_start_loc`` on every path that takes them.

The same bad index arguments go to every public entry point that accepts them: the in-place
mask, the three NCCL combines, ``a2a_pack``, the direct A2A (``lse_reduce`` and ``publish``)
and ``DCPManager.combine`` on each combine path it can select. Every path must raise the same
exception type with the same message (``cpattn_dcp.ops._common.check_mask_args``), before any
launch; every integer index dtype stays accepted everywhere, with the same result.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from cpattn_dcp import (
    DCPConfig,
    DCPManager,
    a2a_pack,
    cp_lse_ag_out_ar,
    cp_lse_ag_out_rs,
    dcp_a2a_lse_reduce,
    mask_dcp_empty_shards_,
)
from cpattn_dcp.direct import DirectDCPA2AWorkspace, clear_direct_workspace_cache
from cpattn_testing.simulated import SimulatedWorld

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

_N, _H_R, _D, _T = 2, 2, 8, 6
_H = _N * _H_R
# Two requests, the first without local KV; rows 4 and 5 are CUDA-graph padding.
_SEQ_LENS = [0, 3]
_QSL = [0, 1, 4]


@dataclass
class _Env:
    """Rank 0's view of a two-rank simulated world, with every path built once."""

    out: torch.Tensor
    lse: torch.Tensor
    group: Any
    workspace: DirectDCPA2AWorkspace
    managers: dict[str, DCPManager]


@pytest.fixture(scope="module")
def env(device: torch.device) -> Iterator[_Env]:
    clear_direct_workspace_cache()
    world = SimulatedWorld(_N, device)
    wss = world.run(lambda g: DirectDCPA2AWorkspace(g, device, 8, _H_R, _D, torch.bfloat16))
    configs = {
        "ag_rs": DCPConfig(comm_backend="ag_rs", use_direct_a2a=False),
        "ag_ar": DCPConfig(comm_backend="ag_rs", use_pcp=True, use_direct_a2a=False),
        "a2a": DCPConfig(comm_backend="a2a", use_direct_a2a=False),
        "direct_a2a": DCPConfig(comm_backend="a2a", use_direct_a2a=True, max_num_tokens=8),
    }
    managers: dict[str, DCPManager] = {}
    for path, cfg in configs.items():
        built = world.run(lambda g, c=cfg: DCPManager(c, g, device, _H_R, _D, torch.bfloat16))
        assert built[0].combine_path == path
        managers[path] = built[0]
    gen = torch.Generator().manual_seed(0)
    out = torch.randn(_T, _H, _D, generator=gen).to(torch.bfloat16).to(device)
    lse = torch.randn(_T, _H, generator=gen).to(device)
    yield _Env(out, lse, world.groups[0], wss[0], managers)
    clear_direct_workspace_cache()


Call = Callable[[_Env, Any, Any], object]


def _manager_call(path: str) -> Call:
    return lambda e, sl, qsl: e.managers[path].combine(
        e.out, e.lse, seq_lens=sl, query_start_loc=qsl
    )


PATHS: dict[str, Call] = {
    "mask_dcp_empty_shards_": lambda e, sl, qsl: mask_dcp_empty_shards_(e.lse.clone(), sl, qsl),
    "cp_lse_ag_out_rs": lambda e, sl, qsl: cp_lse_ag_out_rs(
        e.out, e.lse, e.group, seq_lens=sl, query_start_loc=qsl
    ),
    "cp_lse_ag_out_ar": lambda e, sl, qsl: cp_lse_ag_out_ar(
        e.out, e.lse, e.group, seq_lens=sl, query_start_loc=qsl
    ),
    "dcp_a2a_lse_reduce": lambda e, sl, qsl: dcp_a2a_lse_reduce(
        e.out, e.lse, e.group, seq_lens=sl, query_start_loc=qsl
    ),
    "a2a_pack": lambda e, sl, qsl: a2a_pack(e.out, e.lse, _N, seq_lens=sl, query_start_loc=qsl),
    "direct.lse_reduce": lambda e, sl, qsl: e.workspace.lse_reduce(e.out, e.lse, True, sl, qsl),
    "direct.publish": lambda e, sl, qsl: e.workspace.publish(e.out, e.lse, sl, qsl),
    **{f"manager[{p}]": _manager_call(p) for p in ("ag_rs", "ag_ar", "a2a", "direct_a2a")},
}


def _idx(values: Any, dtype: torch.dtype = torch.int32, device: Any = "cpu") -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(dtype).to(device)


def _quantized() -> torch.Tensor:
    """Quantized lengths (a CPU tensor: the dtype check comes before the device check)."""
    with warnings.catch_warnings():  # quantized tensors are deprecated in recent torch
        warnings.simplefilter("ignore", UserWarning)
        return torch.quantize_per_tensor(torch.tensor([0.0, 3.0]), 1.0, 0, torch.qint8)


@dataclass(frozen=True)
class _Bad:
    """Index arguments ``make(device) -> (seq_lens, query_start_loc)`` and the error."""

    make: Callable[[torch.device], tuple[Any, Any]]
    exc: type[Exception]
    match: str


def _sl_dtype(dtype: torch.dtype) -> Callable[[torch.device], tuple[Any, Any]]:
    return lambda dev: (_idx(_SEQ_LENS, dtype, dev), _idx(_QSL, device=dev))


def _qsl_dtype(dtype: torch.dtype) -> Callable[[torch.device], tuple[Any, Any]]:
    return lambda dev: (_idx(_SEQ_LENS, device=dev), _idx(_QSL, dtype, dev))


_INT = "must be an integer tensor"
BAD: dict[str, _Bad] = {
    "seq_lens-complex64": _Bad(_sl_dtype(torch.complex64), TypeError, "seq_lens " + _INT),
    "qsl-complex128": _Bad(_qsl_dtype(torch.complex128), TypeError, "query_start_loc " + _INT),
    "seq_lens-bool": _Bad(_sl_dtype(torch.bool), TypeError, "seq_lens " + _INT),
    "qsl-float32": _Bad(_qsl_dtype(torch.float32), TypeError, "query_start_loc " + _INT),
    "seq_lens-float8": _Bad(_sl_dtype(torch.float8_e4m3fn), TypeError, "seq_lens " + _INT),
    "seq_lens-list": _Bad(
        lambda dev: (list(_SEQ_LENS), _idx(_QSL, device=dev)),
        TypeError,
        "seq_lens must be a torch.Tensor or None, got list",
    ),
    "qsl-tuple": _Bad(
        lambda dev: (_idx(_SEQ_LENS, device=dev), tuple(_QSL)),
        TypeError,
        "query_start_loc must be a torch.Tensor or None, got tuple",
    ),
    "qsl-missing": _Bad(
        lambda dev: (_idx(_SEQ_LENS, device=dev), None), ValueError, "provided together"
    ),
    "seq_lens-missing": _Bad(
        lambda dev: (None, _idx(_QSL, device=dev)), ValueError, "provided together"
    ),
    "seq_lens-2d": _Bad(
        lambda dev: (_idx([_SEQ_LENS], device=dev), _idx(_QSL, device=dev)), ValueError, "1-D"
    ),
    "qsl-0d": _Bad(lambda dev: (_idx([], device=dev), _idx(0, device=dev)), ValueError, "1-D"),
    "length-mismatch": _Bad(
        lambda dev: (_idx(_SEQ_LENS, device=dev), _idx(_QSL[:2], device=dev)),
        ValueError,
        "one boundary per sequence",
    ),
    "seq_lens-other-device": _Bad(
        lambda dev: (_idx(_SEQ_LENS, device="meta"), _idx(_QSL, device=dev)),
        ValueError,
        "LSE's device",
    ),
    "qsl-other-device": _Bad(
        lambda dev: (_idx(_SEQ_LENS, device=dev), _idx(_QSL, device="meta")),
        ValueError,
        "LSE's device",
    ),
    # Both bad: every path reports the same defect first (the shape).
    "seq_lens-complex-2d": _Bad(
        lambda dev: (_idx([_SEQ_LENS], torch.complex64, dev), _idx(_QSL, device=dev)),
        ValueError,
        "1-D",
    ),
}
if hasattr(torch, "quantize_per_tensor"):
    BAD["seq_lens-qint8"] = _Bad(
        lambda dev: (_quantized(), _idx(_QSL, device=dev)), TypeError, "seq_lens " + _INT
    )
_UINT4: torch.dtype | None = getattr(torch, "uint4", None)  # sub-byte: no kernel reads it
if _UINT4 is not None:
    BAD["seq_lens-uint4"] = _Bad(
        lambda dev: (torch.empty(2, dtype=_UINT4, device=dev), _idx(_QSL, device=dev)),
        TypeError,
        "seq_lens " + _INT,
    )


def _answer(call: Call, env: _Env, bad: _Bad, device: torch.device) -> tuple[str, str]:
    sl, qsl = bad.make(device)
    try:
        call(env, sl, qsl)
    except Exception as exc:  # the path's answer, whatever it is
        return type(exc).__name__, str(exc)
    return "no error", ""


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("case", list(BAD))
def test_bad_index_args_raise_on_every_path(
    env: _Env, device: torch.device, case: str, path: str
) -> None:
    bad = BAD[case]
    sl, qsl = bad.make(device)
    epoch = env.workspace.epoch.clone()
    with pytest.raises(bad.exc, match=bad.match):
        PATHS[path](env, sl, qsl)
    assert torch.equal(env.workspace.epoch, epoch)  # nothing was launched


@pytest.mark.parametrize("case", list(BAD))
def test_same_answer_on_every_path(env: _Env, device: torch.device, case: str) -> None:
    """Not only the type: the message too, word for word (one check)."""
    answers = {path: _answer(call, env, BAD[case], device) for path, call in PATHS.items()}
    assert len(set(answers.values())) == 1, "\n".join(f"{p}: {a}" for p, a in answers.items())


_INTEGER_DTYPES = [
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
]


def _strided(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a non-contiguous view (every other element of a wider tensor)."""
    wide = torch.zeros(2 * len(values), dtype=torch.int64)
    wide[::2] = torch.tensor(values)
    return wide.to(dtype).to(device)[::2]


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("dtype", _INTEGER_DTYPES, ids=str)
def test_every_integer_dtype_is_accepted_on_every_path(
    device: torch.device, dtype: torch.dtype, strided: bool
) -> None:
    """Valid arguments of any integer dtype and any strides give the int32 result."""
    if strided:
        sl, qsl = _strided(_SEQ_LENS, dtype, device), _strided(_QSL, dtype, device)
        assert not sl.is_contiguous()
    else:
        sl, qsl = _idx(_SEQ_LENS, dtype, device), _idx(_QSL, dtype, device)
    sl32, qsl32 = _idx(_SEQ_LENS, device=device), _idx(_QSL, device=device)
    gen = torch.Generator().manual_seed(1)
    out = torch.randn(_N, _T, _H, _D, generator=gen).to(torch.bfloat16).to(device)
    lse = torch.randn(_N, _T, _H, generator=gen).to(device)

    got = mask_dcp_empty_shards_(lse[0].clone(), sl, qsl)
    assert torch.equal(got, mask_dcp_empty_shards_(lse[0].clone(), sl32, qsl32))
    packed = a2a_pack(out[0], lse[0], _N, seq_lens=sl, query_start_loc=qsl)
    packed32 = a2a_pack(out[0], lse[0], _N, seq_lens=sl32, query_start_loc=qsl32)
    assert torch.equal(packed.view(torch.int16), packed32.view(torch.int16))  # LSE halves: bits
    one = SimulatedWorld(1, device).groups[0]
    ops = {"rs": cp_lse_ag_out_rs, "ar": cp_lse_ag_out_ar, "a2a": dcp_a2a_lse_reduce}
    for name, op in ops.items():
        a = op(out[0], lse[0], one, return_lse=True, seq_lens=sl, query_start_loc=qsl)
        b = op(out[0], lse[0], one, return_lse=True, seq_lens=sl32, query_start_loc=qsl32)
        assert torch.equal(a[0], b[0]), name
        assert torch.equal(a[1], b[1]), name

    world = SimulatedWorld(_N, device)
    wss = world.run(lambda g: DirectDCPA2AWorkspace(g, device, 8, _H_R, _D, torch.bfloat16))

    def direct(s: torch.Tensor, q: torch.Tensor) -> list[Any]:
        for r in range(_N):
            wss[r].publish(out[r], lse[r], s, q)
        return [wss[r].wait_and_combine(_T) for r in range(_N)]

    for a, b in zip(direct(sl, qsl), direct(sl32, qsl32), strict=True):
        assert torch.equal(a, b)
