"""The cp-dcp ops with launch plans on (``cpattn_common.launch_plans``): every call returns
exactly what the Python path returns, on fresh random data per call; on a GPU the repeated
calls replay natively (and a replayed call captures into a CUDA graph). On the CPU the
interpreter's launches are never recorded, so the same tests check that the ops stay correct
with plans on and that the refused keys stop being recorded.

Output poisoning is off here: a poison fill is a torch operation, which refuses a recording.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from cpattn_common.launch_plans import (
    launch_plans_info,
    set_launch_plans_enabled,
)
from cpattn_dcp import (
    a2a_pack,
    a2a_record_width,
    a2a_unpack_combine,
    correct_attn_out,
    mask_dcp_empty_shards_,
)

pytestmark = [pytest.mark.no_output_poison, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

_CALLS = 5


def _clone(x: Any) -> Any:
    """A copy with the same strides (``clone`` makes a gappy view contiguous)."""
    if not isinstance(x, torch.Tensor):
        return x
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).copy_(x)


def _flat(x: Any) -> list[Any]:
    if isinstance(x, tuple | list):
        return [y for item in x for y in _flat(item)]
    return [x]


def _check_against_python_path(
    device: torch.device,
    make: Callable[[torch.Generator], tuple[Any, ...]],
    call: Callable[..., Any],
    written: int | None = None,
) -> None:
    """``_CALLS`` calls on fresh inputs of one call key, plans on, each against the same call
    with plans off (inputs cloned first: the in-place ops modify them); on a GPU every call
    after the compiling and the recording one is a native replay. ``written``: index of the
    argument the op writes in place, whose version every call (replays included) must bump."""
    for i in range(_CALLS):
        gen = torch.Generator(device=device).manual_seed(100 + i)
        args = make(gen)
        ref_args = tuple(_clone(a) for a in args)
        hits = launch_plans_info()["hits"]
        version = None if written is None else args[written]._version
        got = call(*args)
        if device.type == "cuda" and i >= 2:
            assert launch_plans_info()["hits"] == hits + 1, (i, launch_plans_info())
        if version is not None:
            assert args[written]._version > version, f"call {i} did not mark its output written"
        set_launch_plans_enabled(False)
        try:
            want = call(*ref_args)
        finally:
            set_launch_plans_enabled(True)
        for g, w in zip(_flat((got, args)), _flat((want, ref_args)), strict=True):
            if isinstance(w, torch.Tensor):
                assert isinstance(g, torch.Tensor)
                assert g.shape == w.shape
                assert g.dtype == w.dtype
                torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True, msg=f"call {i}")
            else:
                assert g is None
                assert w is None
    info = launch_plans_info()
    if device.type == "cuda":
        assert info["plans"] >= 1, info
    else:  # the interpreter's launches are never recorded
        assert info["hits"] == 0, info


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    device = gen.device
    return torch.randn(*shape, generator=gen, device=device).to(dtype)


@pytest.mark.parametrize(
    ("b", "h", "d", "n", "dtype", "lse_dtype", "layout"),
    [
        (1, 64, 128, 4, torch.bfloat16, torch.float32, "contiguous"),
        (37, 16, 512, 3, torch.float16, torch.float16, "contiguous"),
        (5, 8, 64, 2, torch.float32, torch.float32, "strided"),
    ],
)
@pytest.mark.parametrize("base_e", [True, False], ids=["base_e", "base_2"])
def test_correct_attn_out(
    device: torch.device,
    plans: None,
    b: int,
    h: int,
    d: int,
    n: int,
    dtype: torch.dtype,
    lse_dtype: torch.dtype,
    layout: str,
    base_e: bool,
) -> None:
    def make(gen: torch.Generator) -> tuple[Any, ...]:
        out = _randn(gen, b, 2 * h if layout == "strided" else h, d, dtype=dtype)
        out = out[:, ::2] if layout == "strided" else out
        lses = _randn(gen, n, b, h, dtype=lse_dtype) * 4
        lses[0, 0, 0] = float("nan")
        return out, lses

    def call(out: torch.Tensor, lses: torch.Tensor) -> Any:
        return correct_attn_out(out, lses, n - 1, is_lse_base_on_e=base_e)

    _check_against_python_path(device, make, call, written=0)


def test_correct_attn_out_errors_still_raise(device: torch.device, plans: None) -> None:
    out = torch.randn(2, 4, 8, device=device)
    lses = torch.randn(3, 2, 4, device=device)
    for _ in range(3):
        correct_attn_out(out, lses, 1)
    with pytest.raises(ValueError, match="out of range"):
        correct_attn_out(out, lses, 3)
    with pytest.raises(ValueError, match="disagree"):
        correct_attn_out(out[:1], lses, 1)


def test_numpy_bool_flags_share_the_bool_key(device: torch.device, plans: None) -> None:
    """numpy bools as flags (accepted by the ops) are turned into bools before the call key is
    built, so their calls share the key and the results of the Python bool's. (The unpack's
    ``return_lse`` used to be keyed as given: a numpy bool was no key, and was never
    recorded.)"""
    out = torch.randn(2, 4, 8, device=device)
    lses = torch.randn(3, 2, 4, device=device)
    recv = torch.randn(2, 2, 2, a2a_record_width(8, torch.float32), device=device)
    want = a2a_unpack_combine(recv, head_dim=8, return_lse=True)
    for flag in (np.True_, True, np.True_, np.True_):
        got = a2a_unpack_combine(recv, head_dim=8, return_lse=flag)
        for g, w in zip(got, want, strict=True):
            assert g is not None
            assert w is not None
            assert torch.equal(g, w)
    if device.type == "cuda":  # the second call recorded, the last three replayed
        info = launch_plans_info()
        assert (info["refusals"], info["hits"]) == (0, 3), info
    for _ in range(3):
        got = correct_attn_out(out.clone(), lses, 1, is_lse_base_on_e=np.False_)
        want = correct_attn_out(out.clone(), lses, 1, is_lse_base_on_e=False)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)


def test_mask(device: torch.device, plans: None) -> None:
    b, h = 9, 16

    def make(gen: torch.Generator) -> tuple[Any, ...]:
        seq_lens = torch.tensor([3, 0, 5], device=device, dtype=torch.int32)
        qsl = torch.tensor([0, 2, 5, 7], device=device, dtype=torch.int32)
        return _randn(gen, b, h), seq_lens, qsl

    _check_against_python_path(device, make, mask_dcp_empty_shards_, written=0)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("given_send", [False, True])
def test_pack(device: torch.device, plans: None, masked: bool, given_send: bool) -> None:
    b, h, d, n = 6, 8, 64, 4

    def make(gen: torch.Generator) -> tuple[Any, ...]:
        out = _randn(gen, b, h, d, dtype=torch.bfloat16)
        lse = _randn(gen, b, h)
        width = a2a_record_width(d, torch.bfloat16)
        send = torch.empty(n, b, h // n, width, device=device, dtype=torch.bfloat16)
        return out, lse, send

    def call(out: torch.Tensor, lse: torch.Tensor, send: torch.Tensor) -> Any:
        mask: dict[str, Any] = {}
        if masked:
            mask["seq_lens"] = torch.tensor([2, 0, 1], device=device, dtype=torch.int32)
            mask["query_start_loc"] = torch.tensor([0, 1, 3, 5], device=device, dtype=torch.int32)
        return a2a_pack(out, lse, n, send=send if given_send else None, **mask)

    _check_against_python_path(device, make, call)


@pytest.mark.parametrize("return_lse", [False, True])
def test_unpack_combine(device: torch.device, plans: None, return_lse: bool) -> None:
    n, b, hr, d = 4, 7, 2, 128

    def make(gen: torch.Generator) -> tuple[Any, ...]:
        out = _randn(gen, b, n * hr, d, dtype=torch.bfloat16)
        lse = _randn(gen, b, n * hr)
        return (a2a_pack(out, lse, n),)

    def call(recv: torch.Tensor) -> Any:
        return a2a_unpack_combine(recv, head_dim=d, return_lse=return_lse)

    _check_against_python_path(device, make, call)


@pytest.mark.gpu
def test_replayed_call_captures_into_a_cuda_graph(device: torch.device, plans: None) -> None:
    b, h, d, n = 3, 16, 128, 4
    out = torch.randn(b, h, d, device=device, dtype=torch.bfloat16)
    lses = torch.randn(n, b, h, device=device)
    for _ in range(3):  # compile, record, replay
        correct_attn_out(out.clone(), lses, 2)
    assert launch_plans_info()["hits"] >= 1
    static_out, static_lses = out.clone(), lses.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        correct_attn_out(static_out.clone(), static_lses, 2)  # warm-up on the side stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    hits = launch_plans_info()["hits"]
    with torch.cuda.graph(graph):
        _, static_lse = correct_attn_out(static_out, static_lses, 2)
    assert launch_plans_info()["hits"] == hits + 1  # the captured call was a replay
    for seed in range(3):
        gen = torch.Generator(device=device).manual_seed(seed)
        fresh_out = torch.randn(b, h, d, device=device, generator=gen).to(torch.bfloat16)
        fresh_lses = torch.randn(n, b, h, device=device, generator=gen)
        static_out.copy_(fresh_out)
        static_lses.copy_(fresh_lses)
        graph.replay()
        set_launch_plans_enabled(False)
        try:
            want_out, want_lse = correct_attn_out(fresh_out.clone(), fresh_lses, 2)
        finally:
            set_launch_plans_enabled(True)
        torch.testing.assert_close(static_out, want_out, rtol=0, atol=0)
        torch.testing.assert_close(static_lse, want_lse, rtol=0, atol=0)


@pytest.mark.gpu
def test_gpu_a_pinned_host_call_is_never_replayed_for_pageable_memory(plans: None) -> None:
    """``mask_dcp_empty_shards_`` launches its kernel on host tensors too: pinned ones a GPU
    kernel can read, pageable ones Triton's launcher refuses with ``ValueError``. A plan key
    does not tell the two apart, so a plan recorded on pinned tensors would replay for
    pageable ones (an illegal address that poisons the CUDA context): pinned calls are not
    recorded."""

    def args(pinned: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lse = torch.randn(64, 8)
        seq_lens = torch.tensor([0, 5, 3], dtype=torch.int32)
        query_start_loc = torch.tensor([0, 10, 20, 30], dtype=torch.int32)
        t = (lse, seq_lens, query_start_loc)
        return tuple(x.pin_memory() for x in t) if pinned else t  # type: ignore[return-value]

    for _ in range(3):  # compile, then a recording the pinned arguments refuse
        lse, seq_lens, qsl = args(True)
        want = lse.clone()
        want[:10] = float("-inf")  # request 0's shard is empty
        want[30:] = float("-inf")  # padding rows
        mask_dcp_empty_shards_(lse, seq_lens, qsl)
        torch.cuda.synchronize()
        torch.testing.assert_close(lse, want, rtol=0, atol=0)
    info = launch_plans_info()
    assert info["plans"] == 0, info
    assert (
        info["last_refusal"]["cpattn_dcp.mask_dcp_empty_shards_"] == "a pinned host tensor argument"
    )
    hits = info["hits"]
    with pytest.raises(ValueError, match="cannot be accessed from Triton"):
        mask_dcp_empty_shards_(*args(False))
    torch.cuda.synchronize()
    assert launch_plans_info()["hits"] == hits
