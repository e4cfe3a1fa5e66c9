"""A timed-out direct gather marks its result with NaN, as the direct A2A does.

Before, the KV gather's wait copied nothing on a timeout (the caller's ``gathered_kv`` kept its
previous, finite contents) and the query gather returned its persistent buffer as the previous
call left it: a caller used stale data without a sign until the host raised
``DirectProtocolError`` (on CUDA up to ``error_check_interval`` calls later). Now a wait that
times out, or runs on a ubatch whose error record is set (the sticky failure), stores the
dtype's NaN bit pattern into the KV gather's ``gathered_kv`` and into the query gather's
``T * S * D`` elements of the ubatch's buffer (the returned view and its padding heads).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from cpattn_dcp.direct import (
    DIRECT_KV_GATHER_DTYPES,
    DirectDCPKVGatherWorkspace,
    DirectDCPQGatherWorkspace,
    DirectProtocolError,
)
from cpattn_dcp.direct import q_gather as q_gather_module
from cpattn_dcp.direct._base import missing_ranks

Build = Callable[..., tuple[Any, list[Any]]]

#: Every query dtype the q gather takes (1-, 2- and 4-byte floats with a NaN encoding).
Q_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu,
)

#: A 1-byte float format with no NaN encoding (None on a torch without it).
_FLOAT4: torch.dtype | None = getattr(torch, "float4_e2m1fn_x2", None)


def _ids(dtypes: tuple[torch.dtype, ...]) -> list[str]:
    return [str(d).removeprefix("torch.") for d in dtypes]


def _finite(
    shape: tuple[int, ...], dtype: torch.dtype, seed: int, device: torch.device
) -> torch.Tensor:
    """Finite values in ``[0.5, 1.5)`` rounded to ``dtype`` (every format, e8m0 included)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.rand(shape, generator=gen) + 0.5).to(dtype).to(device)


_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32}


def _bits(x: torch.Tensor) -> torch.Tensor:
    """``x`` viewed as the signed integers of its element size (bit-exact comparisons)."""
    return x.view(_INT_OF_SIZE[x.element_size()])


def _torch_nan_bits(dtype: torch.dtype) -> int:
    """The dtype's NaN pattern as torch writes it (independent of the code under test)."""
    return int(_bits(torch.tensor([float("nan")], dtype=dtype)).item())


def _assert_nan(x: torch.Tensor, what: str) -> None:
    """Every element of ``x`` is NaN: as a float and bit for bit the dtype's NaN pattern."""
    assert x.numel() > 0, what
    assert bool(x.float().isnan().all()), f"{what}: not all NaN"
    assert bool((_bits(x) == _torch_nan_bits(x.dtype)).all()), f"{what}: not the NaN bits"


def _assert_finite(x: torch.Tensor, what: str) -> None:
    assert x.numel() > 0, what
    assert bool(x.float().isfinite().all()), f"{what}: not finite"


def _record(ws: Any, ubatch: int = 0) -> tuple[int, int, list[int]]:
    """``(flag, epoch, missing sources)`` of the ubatch's device error record."""
    rec = ws._error[ubatch].tolist()
    return rec[0], rec[1], missing_ranks(rec[2:], ws.world_size)


def test_nan_bits_are_each_formats_own_nan() -> None:
    """The host takes each format's NaN from torch; the fp8 formats differ (the fnuz formats'
    only NaN is the negative-zero pattern 0x80, e8m0's is 0xFF), so no single constant fits."""
    from cpattn_dcp.kernels.direct_gather import nan_bits, same_size_int

    expect = {
        torch.float32: 0x7FC00000,
        torch.float16: 0x7E00,
        torch.bfloat16: 0x7FC0,
        torch.float8_e4m3fn: 0x7F,
        torch.float8_e5m2: 0x7F,
        torch.float8_e4m3fnuz: -0x80,  # 0x80 as int8
        torch.float8_e5m2fnuz: -0x80,
        torch.float8_e8m0fnu: -1,  # 0xFF as int8
    }
    assert set(expect) == set(Q_DTYPES)
    for dtype, bits in expect.items():
        assert nan_bits(dtype) == bits, dtype
        value = torch.tensor([bits], dtype=same_size_int(dtype)).view(dtype)
        assert bool(value.float().isnan().all()), dtype
    refused = {
        torch.float64: "not a 1-, 2- or 4-byte dtype",
        torch.int16: "not a floating dtype",
    }
    if _FLOAT4 is not None:
        refused[_FLOAT4] = "has no NaN encoding"
    for dtype, why in refused.items():
        with pytest.raises(ValueError, match=why):
            nan_bits(dtype)


def test_q_gather_refuses_a_dtype_without_nan(sim_build: Build, device: torch.device) -> None:
    """A query dtype with no NaN encoding could not mark a timed-out call: refused when built
    (its publish failed in Triton before anyway)."""
    if _FLOAT4 is None:
        pytest.skip("this torch has no float4_e2m1fn_x2 (added after torch 2.7)")
    with pytest.raises(ValueError, match=r"q-gather does not support torch\.float4_e2m1fn_x2"):
        sim_build(
            2,
            device,
            lambda g: DirectDCPQGatherWorkspace(
                g, device, 2, 1, 32, _FLOAT4, require_multicast=False
            ),
        )


@pytest.mark.parametrize("dtype", DIRECT_KV_GATHER_DTYPES, ids=_ids(DIRECT_KV_GATHER_DTYPES))
def test_kv_gather_timeout_fills_gathered_kv_with_nan(
    sim_build: Build, device: torch.device, dtype: torch.dtype
) -> None:
    """Rank 0's peer never publishes: rank 0's wait leaves NaN in every element of its
    ``gathered_kv`` (two copy programs, the second one partial), none past it, and the next
    call raises ``DirectProtocolError`` naming the peer. A completed call before it is exact."""
    n, t, d = 2, 20, 64  # N*T*D = 2560 elements: two programs of 2048
    _, kvs = sim_build(
        n,
        device,
        lambda g: DirectDCPKVGatherWorkspace(
            g, device, n * t, d, dtype, require_multicast=False, max_spins=2
        ),
    )
    local = [_finite((t, d), dtype, seed=r, device=device) for r in range(n)]
    big = _finite((n * t + 3, d), dtype, seed=9, device=device)  # rows past gathered_kv: untouched
    before = big.clone()
    out = big[: n * t]
    for r in range(n):  # call 1 completes: exact
        kvs[r].publish(local[r])
    kvs[0].wait(out)
    kvs[0].check_error()
    assert torch.equal(_bits(out), _bits(torch.cat(local)))

    out.copy_(before[: n * t])  # the caller's buffer holds finite data again
    kvs[0].publish(local[0])  # call 2: rank 1 never publishes it
    kvs[0].wait(out)
    _assert_nan(out, "gathered_kv after a timeout")
    assert torch.equal(_bits(big[n * t :]), _bits(before[n * t :])), "stored past gathered_kv"
    assert _record(kvs[0]) == (1, 2, [1])
    with pytest.raises(DirectProtocolError, match=r"kv-gather: rank 0, .*epoch 2 .*\[1\]"):
        kvs[0].check_error()
    with pytest.raises(DirectProtocolError, match="timed out"):
        kvs[0].gather(out, local[0])


@pytest.mark.parametrize("dtype", Q_DTYPES, ids=_ids(Q_DTYPES))
def test_q_gather_timeout_fills_the_returned_rows_with_nan(
    sim_build: Build, device: torch.device, dtype: torch.dtype
) -> None:
    """Rank 0's peer never publishes call 2: the view rank 0's wait returns is NaN, and so are
    the padding heads of its ``T * S * D`` storage; rows past ``T`` and the other ubatch keep
    their data. The next call raises ``DirectProtocolError``. Call 1 (every rank) is exact, in
    every dtype (float8_e8m0fnu and the fnuz formats publish through integer views)."""
    n, t_max, h_r, d, s = 2, 3, 1, 32, 4  # S = 4 storage heads for N*H_r = 2 gathered
    _, qs = sim_build(
        n,
        device,
        lambda g: DirectDCPQGatherWorkspace(
            g,
            device,
            t_max,
            h_r,
            d,
            dtype,
            num_ubatches=2,
            padded_num_heads=s,
            require_multicast=False,
            max_spins=2,
        ),
    )
    t = 2
    q = [_finite((t, h_r, d), dtype, seed=r, device=device) for r in range(n)]
    for r in range(n):  # call 1 completes: exact
        qs[r].publish(q[r])
    got = qs[0].wait(t)
    qs[0].check_error()
    assert torch.equal(_bits(got), _bits(torch.cat(q, dim=1)))

    buf = qs[0].final_query
    buf.copy_(_finite(tuple(buf.shape), dtype, seed=7, device=device))  # finite data everywhere
    before = buf.clone()
    qs[0].publish(q[0])  # call 2: rank 1 never publishes it
    got = qs[0].wait(t)
    assert got.shape == (t, n * h_r, d)
    _assert_nan(got, "returned view after a timeout")
    _assert_nan(buf[0, :t], "the call's T*S*D storage (padding heads included)")
    _assert_finite(buf[0, t:], "rows past the call's T")
    assert torch.equal(_bits(buf[0, t:]), _bits(before[0, t:]))
    assert torch.equal(_bits(buf[1]), _bits(before[1])), "the other ubatch was touched"
    assert _record(qs[0]) == (1, 2, [1])
    with pytest.raises(DirectProtocolError, match=r"q-gather: rank 0, .*epoch 2 .*\[1\]"):
        qs[0].check_error()
    with pytest.raises(DirectProtocolError, match="timed out"):
        qs[0].gather(q[0])


def test_q_gather_failed_ubatch_poisons_every_later_call(
    sim_build: Build, device: torch.device
) -> None:
    """Sticky: after rank 0's wait timed out on ubatch 0, its later waits there (the host does
    not know yet: ``validate=False``) return NaN although the slow peer did publish them, and
    keep the first record. Ubatch 1 fails too: the failure is sticky per group, all ubatches
    (and workspaces) of it, so its wait fails at once with a flag-2 record (another workspace or
    ubatch of the group timed out first), and the host still reports ubatch 0's timeout."""
    n, d, dtype = 2, 8, torch.bfloat16
    _, qs = sim_build(
        n,
        device,
        lambda g: DirectDCPQGatherWorkspace(
            g, device, 2, 1, d, dtype, num_ubatches=2, require_multicast=False, max_spins=2
        ),
    )
    q = [
        [_finite((2, 1, d), dtype, seed=10 * c + r, device=device) for r in range(n)]
        for c in range(3)
    ]
    qs[0].publish(q[0][0], ubatch_id=0)
    _assert_nan(qs[0].wait(2, ubatch_id=0), "call 1")  # rank 1 is slow
    qs[1].publish(q[0][1], ubatch_id=0)  # ... and arrives: call 1 completes on rank 1
    assert torch.equal(qs[1].wait(2, ubatch_id=0), torch.cat([q[0][0], q[0][1]], dim=1))
    qs[1].check_error()

    for c in (1, 2):  # calls 2, 3 on the failed ubatch: rank 1 publishes each
        qs[1].publish(q[c][1], ubatch_id=0)  # finite heads stored into rank 0's buffer, signal
        qs[0].publish(q[c][0], ubatch_id=0, validate=False)  # sticky: stores nothing
        got = qs[0].wait(2, ubatch_id=0, validate=False)
        _assert_nan(got, f"call {c + 1} on the failed ubatch")
        assert _record(qs[0]) == (1, 1, [1]), "the first record is kept"
    assert qs[0].epoch.tolist() == [3, 0]

    for r in range(n):  # ubatch 1: rank 0's publish stores nothing, its wait does not poll
        qs[r].publish(q[0][r], ubatch_id=1, validate=False)
    _assert_nan(qs[0].wait(2, ubatch_id=1, validate=False), "ubatch 1 after the group failed")
    assert _record(qs[0], 1) == (2, 1, [])
    with pytest.raises(DirectProtocolError, match=r"ubatch 0: .*epoch 1 .*\[1\]"):
        qs[0].check_error()


def test_kv_gather_failed_ubatch_poisons_every_later_call(
    sim_build: Build, device: torch.device
) -> None:
    """Sticky, KV gather: once rank 0's wait timed out, each later wait on the ubatch fills a
    freshly finite ``gathered_kv`` with NaN again, although rank 1 published every call."""
    n, t, d, dtype = 2, 2, 8, torch.bfloat16
    _, kvs = sim_build(
        n,
        device,
        lambda g: DirectDCPKVGatherWorkspace(
            g, device, n * t, d, dtype, require_multicast=False, max_spins=2
        ),
    )
    kv = [
        [_finite((t, d), dtype, seed=10 * c + r, device=device) for r in range(n)] for c in range(3)
    ]
    out = _finite((n * t, d), dtype, seed=99, device=device)
    kvs[0].publish(kv[0][0])
    kvs[0].wait(out)
    _assert_nan(out, "call 1")
    kvs[1].publish(kv[0][1])
    out1 = torch.zeros_like(out)
    kvs[1].wait(out1)
    kvs[1].check_error()
    assert torch.equal(out1, torch.cat(kv[0]))

    for c in (1, 2):
        kvs[1].publish(kv[c][1])
        kvs[0].publish(kv[c][0], validate=False)
        out.copy_(_finite((n * t, d), dtype, seed=c, device=device))
        kvs[0].wait(out, validate=False)
        _assert_nan(out, f"call {c + 1} on the failed ubatch")
        assert _record(kvs[0]) == (1, 1, [1])
    with pytest.raises(DirectProtocolError, match=r"epoch 1 .*\[1\]"):
        kvs[0].check_error()


def test_q_gather_wait_is_one_program_and_fills_nan_only_on_failure(
    sim_build: Build, device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hot path keeps one polling program (grid ``(1,)``, nothing copied): the NaN fill is
    that program's loop after a failure, over the call's ``T * S * D`` elements."""
    n, t, d, s = 2, 2, 16, 3
    _, qs = sim_build(
        n,
        device,
        lambda g: DirectDCPQGatherWorkspace(
            g, device, 4, 1, d, torch.float16, padded_num_heads=s, require_multicast=False
        ),
    )
    launches: list[tuple[Any, tuple[int, ...], dict[str, Any]]] = []

    class Recorded:  # stands in for a kernel: records each launch, then makes it
        def __init__(self, kernel: Any):
            self.kernel = kernel

        def __getitem__(self, grid: tuple[int, ...]) -> Any:
            def launch(**kwargs: Any) -> None:
                launches.append((self.kernel, grid, kwargs))
                self.kernel[grid](**kwargs)

            return launch

    for name in ("_direct_gather_publish_kernel", "_direct_gather_wait_kernel"):
        monkeypatch.setattr(q_gather_module, name, Recorded(getattr(q_gather_module, name)))
    q = [torch.full((t, 1, d), float(r + 1), device=device, dtype=torch.float16) for r in range(n)]
    for r in range(n):
        qs[r].publish(q[r])
    got = qs[0].wait(t)
    assert torch.equal(got, torch.cat(q, dim=1))
    waits = [(grid, kw) for kernel, grid, kw in launches if "HAS_COPY" in kw]
    assert len(waits) == 1
    grid, kw = waits[0]
    assert grid == (1,)
    assert kw["num_programs"] == 1
    assert kw["HAS_COPY"] is False
    assert kw["num_elems"] == t * s * d
    assert kw["NAN_BITS"] == _torch_nan_bits(torch.float16) == 0x7E00
    assert kw["dst_ptr"].data_ptr() == qs[0].final_query.data_ptr()
