"""Direct A2A LSE-reduce on simulated ranks (peer tables point at N buffers of one device).

Data path against the float64 reference and the packed NCCL A2A; the signal/epoch protocol
(timeouts never read stale data, parity-slot reuse across many calls and two micro-batches,
a rank running one call ahead of a peer); validation errors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import triton.language as tl

from cpattn_common.ubatch import ubatch_context
from cpattn_dcp.direct import (
    MAX_SPINS_LIMIT,
    DirectDCPA2AWorkspace,
    DirectDCPKVGatherWorkspace,
    DirectDCPQGatherWorkspace,
    DirectPathUnavailable,
    DirectProtocolError,
)
from cpattn_dcp.direct import a2a as a2a_module
from cpattn_dcp.kernels.direct_a2a import _direct_a2a_publish_kernel
from cpattn_dcp.ops.a2a_combine import a2a_pack, a2a_unpack_combine
from cpattn_testing.cases import make_dcp_decode_case
from cpattn_testing.reference import lse_combine_ref
from cpattn_testing.simulated import SimulatedWorld
from cpattn_testing.tolerances import assert_close_to_ref, coarsest

Build = Callable[..., tuple[Any, list[Any]]]

_EPS = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def _a2a(device: torch.device, t_max: int, h_r: int, d: int, dtype: torch.dtype, **kw: Any) -> Any:
    return lambda g: DirectDCPA2AWorkspace(g, device, t_max, h_r, d, dtype, **kw)


@pytest.mark.parametrize(
    ("n", "dtype", "lse_dtype", "base_e", "qpr", "padded_view", "index_dtype"),
    [
        pytest.param(
            2, torch.bfloat16, torch.float32, True, 1, False, torch.int64,
            id="N2-bf16-e-contig",
        ),
        # int16 indices: accepted as by the NCCL path (widened on the device).
        pytest.param(
            3, torch.float16, torch.bfloat16, False, 2, True, torch.int16,
            id="N3-fp16-bf16lse-b2-mtp-padded-int16",
        ),
    ],
)  # fmt: skip
def test_direct_a2a_matches_reference_and_nccl_a2a(
    sim_build: Build,
    input_ref: Callable[[Any], tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    n: int,
    dtype: torch.dtype,
    lse_dtype: torch.dtype,
    base_e: bool,
    qpr: int,
    padded_view: bool,
    index_dtype: torch.dtype,
) -> None:
    h_r, d = 2, 16
    h = n * h_r
    # Request 0 has one KV token: every rank but 0 holds an empty shard (NaN output, garbage
    # LSE); one CUDA-graph padding row sits past query_start_loc[-1].
    case = make_dcp_decode_case(
        seq_lens=[1, 7, 4], world_size=n, num_heads=h, head_dim=d, queries_per_request=qpr,
        padding_rows=1, dtype=dtype, lse_dtype=lse_dtype, is_lse_base_on_e=base_e,
        device=device, seed=11 + n,
    )  # fmt: skip
    b = case.num_rows
    _, wss = sim_build(n, device, _a2a(device, b + 3, h_r, d, dtype))
    qsl = case.query_start_loc.to(index_dtype)
    local_lens = [lens.to(index_dtype) for lens in case.local_seq_lens]
    inputs = []
    for r in range(n):
        out, lse = case.rank_inputs(r)
        if padded_view:  # [:, :H] view of 2 extra heads of storage: token stride > H*D
            storage = torch.randn(b, h + 2, d, device=device).to(dtype)
            storage[:, :h] = out
            out = storage[:, :h]
        inputs.append((out, lse))
    for r in range(n):
        wss[r].publish(inputs[r][0], inputs[r][1], local_lens[r], qsl)
    direct = [
        wss[r].wait_and_combine(b, is_lse_base_on_e=base_e, return_lse=True) for r in range(n)
    ]

    # The packed NCCL A2A on the same inputs: its pack and unpack-combine kernels, with the
    # all-to-all done as the permutation it is (one launch at a time: the Triton interpreter
    # is not thread-safe, so simulated ranks must not launch concurrently).
    sends = [
        a2a_pack(inputs[r][0], inputs[r][1], n, seq_lens=local_lens[r], query_start_loc=qsl)
        for r in range(n)
    ]
    nccl = [
        a2a_unpack_combine(
            torch.stack([sends[s][r] for s in range(n)]),
            head_dim=d,
            return_lse=True,
            is_lse_base_on_e=base_e,
        )
        for r in range(n)
    ]
    exact_out, exact_lse = input_ref(case)
    for r in range(n):
        out, lse = direct[r]
        heads = slice(r * h_r, (r + 1) * h_r)
        assert_close_to_ref(out, exact_out[:, heads], dtype=dtype, name=f"rank {r} out (inputs)")
        assert_close_to_ref(lse, exact_lse[:, heads], dtype=torch.float32, name=f"rank {r} lse")
        assert out.shape == (b, h_r, d)
        assert out.dtype == dtype
        # Against full attention: also carries the rounding of the partials to lse_dtype.
        tol = coarsest(dtype, lse_dtype)
        assert_close_to_ref(out, case.ref_out[:, heads], dtype=tol, name=f"rank {r} out")
        assert_close_to_ref(lse, case.ref_lse[:, heads], dtype=lse_dtype, name=f"rank {r} lse")
        assert not torch.isnan(out).any()
        assert torch.all(out[-1] == 0)
        assert torch.all(lse[-1] == float("-inf"))
        # Same inputs through the packed NCCL A2A: equal up to one rounding of the output dtype.
        n_out, n_lse = nccl[r]
        torch.testing.assert_close(out.float(), n_out.float(), rtol=_EPS[dtype], atol=1e-3)
        assert n_lse is not None
        torch.testing.assert_close(lse, n_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tiling", ["small-batch", "large-batch"])
def test_direct_a2a_unmasked_all_empty_and_nan_partials(
    sim_build: Build, device: torch.device, monkeypatch: pytest.MonkeyPatch, tiling: str
) -> None:
    """No masking args: NaN/+inf LSEs count as empty; an all-empty row is exactly 0 / -inf.

    Both combine tilings (small batches also split heads and D over programs).
    """
    if tiling == "large-batch":
        monkeypatch.setattr(a2a_module, "_SMALL_BATCH_PROGRAMS", 0)
    n, t, h_r, d = 2, 3, 6, 136  # non-power-of-two heads and D (2 D-blocks of 128)
    _, wss = sim_build(n, device, _a2a(device, 4, h_r, d, torch.bfloat16))
    gen = torch.Generator(device="cpu").manual_seed(3)
    outs = torch.randn(n, t, n * h_r, d, generator=gen).to(device, torch.bfloat16)
    lses = torch.randn(n, t, n * h_r, generator=gen).to(device)
    lses[:, 0] = float("-inf")  # row 0 empty everywhere
    outs[:, 0] = float("nan")
    lses[1, 1] = float("nan")  # rank 1 contributes nothing to row 1 ...
    outs[1, 1] = float("nan")  # ... so its NaN payload must not leak
    lses[0, 2] = float("inf")
    for r in range(n):
        wss[r].publish(outs[r], lses[r])
    res = [wss[r].wait_and_combine(t, return_lse=True) for r in range(n)]
    ref_out, ref_lse = lse_combine_ref(outs, lses)
    for r in range(n):
        out, lse = res[r]
        assert torch.all(out[0] == 0)
        assert torch.all(lse[0] == float("-inf"))
        heads = slice(r * h_r, (r + 1) * h_r)
        assert_close_to_ref(out, ref_out[:, heads], dtype=torch.bfloat16, name=f"rank {r}")
        assert_close_to_ref(lse, ref_lse[:, heads], dtype=torch.float32, name=f"rank {r} lse")


def test_timeout_sets_error_flag_and_never_reads_stale_data(
    sim_build: Build, device: torch.device
) -> None:
    n, t, h_r, d = 2, 2, 1, 8
    _, wss = sim_build(n, device, _a2a(device, 4, h_r, d, torch.bfloat16, max_spins=3))
    gen = torch.Generator(device="cpu").manual_seed(5)

    def data() -> tuple[torch.Tensor, torch.Tensor]:
        o = torch.randn(n, t, n * h_r, d, generator=gen).to(device, torch.bfloat16)
        return o, torch.randn(n, t, n * h_r, generator=gen).to(device)

    for _ in range(2):  # two complete calls: both parity slots hold valid old data + signals
        outs, lses = data()
        for r in range(n):
            wss[r].publish(outs[r], lses[r])
        for r in range(n):
            wss[r].wait_and_combine(t)
    # Call 3 (parity of call 1): rank 1 never publishes. Rank 0 must not take call 1's signal
    # (same slot, older epoch) as ready, nor read call 1's payload.
    outs, lses = data()
    wss[0].publish(outs[0], lses[0])
    out = wss[0].wait_and_combine(t)
    assert isinstance(out, torch.Tensor)
    assert torch.isnan(out).all(), "a timed-out combine must not produce data"
    assert int(wss[0].epoch[0]) == 3  # the call still completes and advances the epoch
    with pytest.raises(DirectProtocolError, match=r"epoch 3 .*source rank\(s\) \[1\]"):
        wss[0].check_error()
    with pytest.raises(DirectProtocolError, match="timed out"):
        wss[0].lse_reduce(outs[0], lses[0])
    assert wss[0].failed


def _settle(device: torch.device) -> None:
    """Let every launch and non-blocking copy on ``device`` land (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@pytest.mark.no_checks  # rank 1 never calls: check mode's all-gather would wait
@pytest.mark.parametrize("interval", [1, 3])
def test_lazy_error_check_without_explicit_check(
    sim_build: Build, device: torch.device, interval: int
) -> None:
    """The host learns of a timeout at a later call, with no ``check_error()``.

    CPU: the error record is host memory, the very next call raises. CUDA: the record is
    mirrored to pinned memory by a non-blocking copy every ``error_check_interval`` eager calls
    (no host sync on the hot path), so calls before the interval's copy do not raise, and the
    first call after that copy landed does.
    """
    n, t = 2, 1
    _, wss = sim_build(
        n,
        device,
        _a2a(device, 2, 1, 8, torch.bfloat16, max_spins=2, error_check_interval=interval),
    )
    o = torch.randn(t, n, 8, device=device).to(torch.bfloat16)
    lse = torch.randn(t, n, device=device)
    wss[0].publish(o, lse)
    out = wss[0].wait_and_combine(t)  # rank 1 absent -> records the timeout, does not raise here
    assert isinstance(out, torch.Tensor)
    assert torch.isnan(out).all()
    silent_calls = interval - 1 if device.type == "cuda" else 0
    for _ in range(silent_calls):
        _settle(device)  # even with everything landed: no copy yet, so no report yet
        late = wss[0].lse_reduce(o, lse)  # the failure is sticky: NaN at once, no polling
        assert isinstance(late, torch.Tensor)
        assert torch.isnan(late).all()
        assert not wss[0].failed
    _settle(device)
    # The record keeps the first timed-out call (later waits fail without overwriting it).
    epoch = 1
    with pytest.raises(
        DirectProtocolError,
        match=rf"Direct DCP A2A: rank 0, ubatch 0: bounded wait timed out at epoch {epoch} "
        r"after 2 polls; no signal from source rank\(s\) \[1\]",
    ):
        wss[0].lse_reduce(o, lse)
    assert wss[0].failed
    epochs = wss[0].epoch.tolist()
    with pytest.raises(DirectProtocolError, match="timed out"):  # and at every call after
        wss[0].lse_reduce(o, lse)
    with pytest.raises(DirectProtocolError, match="timed out"):
        wss[0].check_error()
    assert wss[0].epoch.tolist() == epochs == [1 + silent_calls]  # a refused call launches nothing


@pytest.mark.no_checks  # rank 1 never calls: check mode's all-gather would wait
def test_error_check_interval_zero_reports_only_through_check_error_on_cuda(
    sim_build: Build, device: torch.device
) -> None:
    """``error_check_interval=0``: on CUDA no call reports (no mirror), ``check_error()`` does;
    on the CPU the next call still sees the host-memory record."""
    n, t = 2, 1
    _, wss = sim_build(
        n, device, _a2a(device, 2, 1, 8, torch.bfloat16, max_spins=2, error_check_interval=0)
    )
    o = torch.randn(t, n, 8, device=device).to(torch.bfloat16)
    lse = torch.randn(t, n, device=device)
    wss[0].publish(o, lse)
    wss[0].wait_and_combine(t)
    _settle(device)
    if device.type == "cuda":
        wss[0].lse_reduce(o, lse)  # no mirror: the lazy check cannot see it
        assert not wss[0].failed
        with pytest.raises(DirectProtocolError, match=r"source rank\(s\) \[1\]"):
            wss[0].check_error()
    else:
        with pytest.raises(DirectProtocolError, match=r"source rank\(s\) \[1\]"):
            wss[0].lse_reduce(o, lse)
    assert wss[0].failed


def test_bare_device_is_normalised(sim_build: Build, device: torch.device) -> None:
    """A workspace built with a bare ``torch.device("cuda")`` stores the indexed current device,
    so the device checks against tensors (always ``cuda:<i>``) accept the inputs."""
    n, t, h_r, d = 2, 2, 1, 8
    bare = torch.device(device.type)  # "cuda" without an index on GPU runs; "cpu" on the CPU
    _, wss = sim_build(n, device, _a2a(bare, 4, h_r, d, torch.bfloat16))
    o = torch.randn(n, t, n * h_r, d, device=device).to(torch.bfloat16)
    lse = torch.randn(n, t, n * h_r, device=device)
    for r in range(n):
        assert wss[r].device == device
        assert wss[r].unsupported_reason(o[r], lse[r]) is None
        assert wss[r].recv_out.device == device
    for r in range(n):
        wss[r].publish(o[r], lse[r], torch.ones(1, dtype=torch.int32, device=device),
                       torch.tensor([0, t], dtype=torch.int32, device=device))  # fmt: skip
    res = [wss[r].wait_and_combine(t) for r in range(n)]
    ref, _ = lse_combine_ref(o, lse)
    for r in range(n):
        assert_close_to_ref(res[r], ref[:, r * h_r : (r + 1) * h_r], dtype=torch.bfloat16)


def test_slot_reuse_many_calls_two_ubatches_and_a_rank_one_call_ahead(
    sim_build: Build, device: torch.device
) -> None:
    n, t, h_r, d = 2, 2, 1, 8
    _, wss = sim_build(n, device, _a2a(device, 3, h_r, d, torch.bfloat16, num_ubatches=2))
    gen = torch.Generator(device="cpu").manual_seed(7)

    def data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        o = torch.randn(n, t, n * h_r, d, generator=gen).to(device, torch.bfloat16)
        lse = torch.randn(n, t, n * h_r, generator=gen).to(device) * 2
        ref, _ = lse_combine_ref(o, lse)
        return o, lse, ref

    def check(res: Any, ref: torch.Tensor, r: int) -> None:
        assert_close_to_ref(res, ref[:, r * h_r : (r + 1) * h_r], dtype=torch.bfloat16)

    iters = 6
    for k in range(iters):
        # Both micro-batches in flight at once, interleaved (disjoint slots, signals, epochs).
        (o0, l0, ref0), (o1, l1, ref1) = data(), data()
        with ubatch_context(0):
            for r in range(n):
                wss[r].publish(o0[r], l0[r])
        with ubatch_context(1):
            for r in range(n):
                wss[r].publish(o1[r], l1[r])
            for r in range(n):
                check(wss[r].wait_and_combine(t), ref1, r)
        with ubatch_context(0):
            # Rank 0 finishes call k and publishes call k+1 before rank 1 read call k:
            # call k+1 uses the other parity slot, so rank 1 still reads call k's data.
            check(wss[0].wait_and_combine(t), ref0, 0)
            o2, l2, ref2 = data()
            wss[0].publish(o2[0], l2[0])
            check(wss[1].wait_and_combine(t), ref0, 1)
            wss[1].publish(o2[1], l2[1])
            for r in range(n):
                check(wss[r].wait_and_combine(t), ref2, r)
        for r in range(n):
            assert wss[r].epoch.tolist() == [2 * (k + 1), k + 1]
    for ws in wss:
        ws.check_error()


@pytest.mark.no_checks  # one thread drives both ranks: check mode's all-gather would wait
def test_lse_reduce_single_rank_after_peer_published(
    sim_build: Build, device: torch.device
) -> None:
    """``lse_reduce`` (publish + wait in one call) on the last rank completes the rendezvous."""
    n, t = 2, 3
    _, wss = sim_build(n, device, _a2a(device, 4, 1, 8, torch.bfloat16))
    o = torch.randn(n, t, n, 8, device=device).to(torch.bfloat16)
    lse = torch.randn(n, t, n, device=device)
    wss[0].publish(o[0], lse[0])
    out1 = wss[1].lse_reduce(o[1], lse[1])
    out0 = wss[0].wait_and_combine(t)
    ref, _ = lse_combine_ref(o, lse)
    assert_close_to_ref(out0, ref[:, :1], dtype=torch.bfloat16)
    assert_close_to_ref(out1, ref[:, 1:], dtype=torch.bfloat16)


@pytest.mark.parametrize(
    ("workspace", "message"),
    [
        ("a2a", "cp_attn_out.shape[0] (B) is 2 on rank 0 but 3 on rank 1"),
        ("q_gather", "local_query.shape[0] is 2 on rank 0 but 3 on rank 1"),
        ("kv_gather", "local_kv.shape[0] is 2 on rank 0 but 3 on rank 1"),
    ],
)
def test_check_mode_refuses_ranks_whose_calls_disagree(
    sim_build: Build, device: torch.device, workspace: str, message: str
) -> None:
    """Check mode (on in every test): each rank compares its call with its peers' before it
    publishes; rank 1 passing one more row than rank 0 raises on both ranks, naming the field
    and the rank, and nothing is launched."""
    n, d = 2, 8
    ctor: Any = {
        "a2a": _a2a(device, 4, 1, d, torch.bfloat16),
        "q_gather": lambda g: DirectDCPQGatherWorkspace(
            g, device, 4, 1, d, torch.bfloat16, require_multicast=False
        ),
        "kv_gather": lambda g: DirectDCPKVGatherWorkspace(
            g, device, 8, d, torch.bfloat16, require_multicast=False
        ),
    }[workspace]
    world, wss = sim_build(n, device, ctor)

    def call(group: Any) -> str:
        r = group.rank_in_group
        t = 2 + r
        ws = wss[r]
        rows = torch.randn(t, n * d, device=device).to(torch.bfloat16)
        if workspace == "a2a":
            args: tuple[Any, ...] = (rows.view(t, n, d), torch.randn(t, n, device=device))
            method = ws.lse_reduce
        elif workspace == "q_gather":
            args, method = (rows[:, :d].view(t, 1, d),), ws.gather
        else:
            gathered = torch.empty(n * t, d, device=device, dtype=torch.bfloat16)
            args, method = (gathered, rows[:, :d].contiguous()), ws.gather
        with pytest.raises(ValueError, match="the ranks' calls disagree") as info:
            method(*args)
        return str(info.value)

    for r, text in enumerate(world.run(call)):
        assert message in text
        assert f"raised on rank {r} of {n}" in text
    assert all(int(ws.epoch.sum()) == 0 for ws in wss)  # nothing was published


@pytest.mark.parametrize("workspace", ["a2a", "q_gather", "kv_gather"])
@pytest.mark.parametrize(
    ("bound", "error", "match"),
    [
        (0, ValueError, "positive"),
        (MAX_SPINS_LIMIT + 1, ValueError, "32 bits"),
        (2**40, ValueError, "32 bits"),
        (2.5, TypeError, "int"),
        (True, TypeError, "int"),
    ],
)
def test_max_spins_out_of_the_kernels_range_is_refused(
    sim_build: Build,
    device: torch.device,
    workspace: str,
    bound: object,
    error: type[Exception],
    match: str,
) -> None:
    """The wait kernels count polls in 32 bits: a bound of 2**31 or more was accepted, and a
    wait for a dead peer then never ended (the counter wrapped negative, below the bound)."""
    ctor: Any = {
        "a2a": lambda g, **kw: DirectDCPA2AWorkspace(g, device, 4, 1, 8, torch.bfloat16, **kw),
        "q_gather": lambda g, **kw: DirectDCPQGatherWorkspace(
            g, device, 4, 1, 8, torch.bfloat16, require_multicast=False, **kw
        ),
        "kv_gather": lambda g, **kw: DirectDCPKVGatherWorkspace(
            g, device, 4, 8, torch.bfloat16, require_multicast=False, **kw
        ),
    }[workspace]
    with pytest.raises(error, match=match):
        sim_build(2, device, lambda g: ctor(g, max_spins=bound))
    with pytest.raises(error, match="error_check_interval"):
        sim_build(
            2, device, lambda g: ctor(g, error_check_interval=-1 if error is ValueError else 1.5)
        )
    _, wss = sim_build(2, device, lambda g: ctor(g, max_spins=MAX_SPINS_LIMIT))
    assert wss[0].max_spins == MAX_SPINS_LIMIT


def test_validation_errors(sim_build: Build, device: torch.device) -> None:
    with pytest.raises(ValueError, match="does not support"):
        sim_build(2, device, _a2a(device, 4, 1, 8, torch.float32))
    with pytest.raises(ValueError, match="ubatch"):
        sim_build(2, device, _a2a(device, 4, 1, 8, torch.bfloat16, num_ubatches=0))
    with pytest.raises(ValueError, match="16-byte"):
        sim_build(2, device, _a2a(device, 4, 1, 12, torch.bfloat16))
    with pytest.raises(ValueError, match="at least two ranks"):
        sim_build(1, device, _a2a(device, 4, 1, 8, torch.bfloat16))
    with pytest.raises(ValueError, match="positive"):
        sim_build(2, device, _a2a(device, 0, 1, 8, torch.bfloat16))

    _, wss = sim_build(2, device, _a2a(device, 4, 1, 8, torch.bfloat16, num_ubatches=2))
    ws = wss[0]
    o = torch.randn(3, 2, 8, device=device).to(torch.bfloat16)
    lse = torch.randn(3, 2, device=device)
    with pytest.raises(ValueError, match=r"5 rows exceed the workspace capacity 4"):
        ws.lse_reduce(
            torch.zeros(5, 2, 8, device=device, dtype=torch.bfloat16),
            torch.zeros(5, 2, device=device),
        )
    flat = torch.randn(3 * 2 * 8 + 1, device=device).to(torch.bfloat16)
    with pytest.raises(ValueError, match="16-byte"):
        ws.lse_reduce(flat[1:].view(3, 2, 8), lse)
    with pytest.raises(ValueError, match="dtype"):
        ws.lse_reduce(o.half(), lse)
    with pytest.raises(ValueError, match="geometry"):
        ws.lse_reduce(
            torch.zeros(3, 4, 8, device=device, dtype=torch.bfloat16),
            torch.zeros(3, 4, device=device),
        )
    with pytest.raises(ValueError, match="does not match"):
        ws.lse_reduce(o, torch.zeros(2, 2, device=device))
    with pytest.raises(TypeError, match="floating"):
        ws.lse_reduce(o, torch.zeros(3, 2, device=device, dtype=torch.int32))
    with pytest.raises(ValueError, match="together"):
        ws.lse_reduce(o, lse, True, torch.ones(1, dtype=torch.int32, device=device), None)
    with pytest.raises(TypeError, match="seq_lens must be an integer tensor"):
        ws.lse_reduce(
            o, lse, True, torch.ones(1, device=device),
            torch.tensor([0, 3], dtype=torch.int32, device=device),
        )  # fmt: skip
    with pytest.raises(ValueError, match="one boundary per sequence"):
        ws.lse_reduce(
            o, lse, True, torch.ones(2, dtype=torch.int32, device=device),
            torch.tensor([0, 3], dtype=torch.int32, device=device),
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"ubatch_id 2 exceeds the 2 slot"):
        ws.lse_reduce(o, lse, ubatch_id=2)
    assert int(ws.epoch.sum()) == 0  # nothing was launched by a rejected call


def test_non_tensor_arguments_are_type_errors(sim_build: Build, device: torch.device) -> None:
    """They failed on ``.dim()`` / ``.shape`` with an AttributeError; the NCCL ops raise
    TypeError for the same arguments."""
    _, wss = sim_build(2, device, _a2a(device, 4, 1, 8, torch.bfloat16))
    o = torch.randn(3, 2, 8, device=device).to(torch.bfloat16)
    lse = torch.randn(3, 2, device=device)
    with pytest.raises(TypeError, match=r"partial_output must be a torch\.Tensor, got list"):
        wss[0].lse_reduce(o.tolist(), lse)
    with pytest.raises(TypeError, match=r"partial_lse must be a torch\.Tensor, got NoneType"):
        wss[0].unsupported_reason(o, None)
    kw = {"require_multicast": False}
    _, qs = sim_build(
        2, device, lambda g: DirectDCPQGatherWorkspace(g, device, 4, 1, 8, torch.bfloat16, **kw)
    )
    with pytest.raises(TypeError, match=r"local_query must be a torch\.Tensor, got list"):
        qs[0].gather([[1.0]])
    _, kvs = sim_build(
        2, device, lambda g: DirectDCPKVGatherWorkspace(g, device, 8, 8, torch.bfloat16, **kw)
    )
    with pytest.raises(TypeError, match=r"local_kv must be a torch\.Tensor, got list"):
        kvs[0].gather(torch.zeros(4, 8, device=device, dtype=torch.bfloat16), [[1.0]])
    assert int(wss[0].epoch.sum()) == 0


def test_sizes_and_token_counts_must_be_ints(sim_build: Build, device: torch.device) -> None:
    """``int()`` turned 2.7 into 2 and True into 1 without a word: a workspace of another
    geometry, or a combine of fewer rows than published. Integers of other types (numpy's)
    are taken."""
    import numpy as np

    with pytest.raises(TypeError, match=r"max_num_tokens must be an int, got float"):
        sim_build(2, device, _a2a(device, 4.7, 1, 8, torch.bfloat16))
    with pytest.raises(TypeError, match=r"heads_per_rank must be an int, got a bool"):
        sim_build(2, device, _a2a(device, 4, True, 8, torch.bfloat16))
    kw = {"require_multicast": False}
    with pytest.raises(TypeError, match=r"padded_num_heads must be an int, got float"):
        sim_build(2, device, lambda g: DirectDCPQGatherWorkspace(g, device, 4, 1, 8, **kw, padded_num_heads=2.0))  # fmt: skip
    with pytest.raises(TypeError, match=r"token_dim must be an int, got float"):
        sim_build(2, device, lambda g: DirectDCPKVGatherWorkspace(g, device, 8, 8.0, **kw))
    _, wss = sim_build(2, device, _a2a(device, np.int64(4), 1, 8, torch.bfloat16))
    assert wss[0].max_num_tokens == 4
    with pytest.raises(TypeError, match=r"num_tokens must be an int, got float"):
        wss[0].wait_and_combine(2.7)
    _, qs = sim_build(2, device, lambda g: DirectDCPQGatherWorkspace(g, device, 4, 1, 8, **kw))
    with pytest.raises(TypeError, match=r"num_tokens must be an int, got float"):
        qs[0].wait(2.7)


def test_unsigned_32_and_64_bit_indices_keep_their_values(
    sim_build: Build, device: torch.device
) -> None:
    """uint32 / uint64 ``seq_lens`` were narrowed to int32 for the publish kernel: a local
    length of 2**32 became 0, so the shard counted as empty and its partial was dropped. The
    NCCL path reads the values as they are; both paths now agree."""
    n, h_r, d, t = 2, 1, 16, 2
    gen = torch.Generator().manual_seed(5)
    outs = [torch.randn(t, n * h_r, d, generator=gen).to(device, torch.float16) for _ in range(n)]
    lses = [torch.randn(t, n * h_r, generator=gen).to(device) for _ in range(n)]
    for index_dtype in (torch.uint64, torch.uint32):
        qsl = torch.tensor([0, 1, 2], dtype=index_dtype, device=device)
        big = 2**32 if index_dtype == torch.uint64 else 2**32 - 1
        lens = [torch.tensor([big, 5], dtype=index_dtype, device=device)]
        lens.append(torch.tensor([3, 5], dtype=index_dtype, device=device))
        _, wss = sim_build(n, device, _a2a(device, t, h_r, d, torch.float16))
        for r in range(n):
            wss[r].publish(outs[r], lses[r], lens[r], qsl)
        direct = [wss[r].wait_and_combine(t, return_lse=True) for r in range(n)]
        sends = [
            a2a_pack(outs[r], lses[r], n, seq_lens=lens[r], query_start_loc=qsl) for r in range(n)
        ]
        for r in range(n):
            recv = torch.stack([sends[s][r] for s in range(n)])
            n_out, n_lse = a2a_unpack_combine(recv, head_dim=d, return_lse=True)
            out, lse = direct[r]
            torch.testing.assert_close(lse, n_lse, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(out.float(), n_out.float(), rtol=2e-3, atol=1e-3)


def test_closed_a2a_refuses_every_call(sim_build: Build, device: torch.device) -> None:
    """After ``close()`` every public call raises, ``wait_and_combine`` included (it launched
    the combine kernel, which reads the peers' released buffers)."""
    n, h_r, d = 2, 1, 8
    _, wss = sim_build(n, device, _a2a(device, 4, h_r, d, torch.bfloat16))
    for ws in wss:
        ws.close()
        assert ws.closed
    out = torch.ones(2, n * h_r, d, device=device, dtype=torch.bfloat16)
    lse = torch.zeros(2, n * h_r, device=device)
    calls: list[Callable[[], Any]] = [
        lambda: wss[0].publish(out, lse),
        lambda: wss[0].wait_and_combine(2),
        lambda: wss[0].lse_reduce(out, lse),
    ]
    for call in calls:
        with pytest.raises(RuntimeError, match="workspace is closed"):
            call()


@pytest.mark.parametrize("flag", [None, "False", 0])
def test_flags_must_be_bools_before_anything_is_published(
    sim_build: Build, device: torch.device, flag: object
) -> None:
    """bool() made None base 2 and "False" base e. lse_reduce checks before its publish: a
    check in the wait alone would leave the call half made, its peers waiting for it."""
    n, t, h_r, d = 2, 2, 1, 8
    # max_spins: the old code's wait (rank 1 never calls) timed out quickly
    _, wss = sim_build(n, device, _a2a(device, 4, h_r, d, torch.bfloat16, max_spins=3))
    o = torch.randn(t, n * h_r, d, device=device).to(torch.bfloat16)
    lse = torch.randn(t, n * h_r, device=device)
    signals = wss[1].recv_signal.clone()
    with pytest.raises(TypeError, match="is_lse_base_on_e must be a bool"):
        wss[0].lse_reduce(o, lse, flag)  # type: ignore[arg-type]
    assert torch.equal(wss[1].recv_signal, signals)  # nothing published
    assert int(wss[0].epoch[0]) == 0
    with pytest.raises(TypeError, match="is_lse_base_on_e must be a bool"):
        wss[0].wait_and_combine(t, is_lse_base_on_e=flag)  # type: ignore[arg-type]
    # return_lse too (it was taken by truthiness: "no" returned the LSE)
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        wss[0].lse_reduce(o, lse, return_lse=flag)  # type: ignore[arg-type]
    assert torch.equal(wss[1].recv_signal, signals)
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        wss[0].wait_and_combine(t, return_lse=flag)  # type: ignore[arg-type]


def test_inputs_that_require_grad_are_refused_before_anything_is_published(
    sim_build: Build, device: torch.device
) -> None:
    """The kernels have no autograd formula: with grad on, a partial that requires grad is
    refused before the publish (the output would have dropped the gradient); under
    ``torch.no_grad()`` the same tensors combine."""
    n, t, h_r, d = 2, 2, 1, 8
    _, wss = sim_build(n, device, _a2a(device, 4, h_r, d, torch.bfloat16, max_spins=3))
    o = torch.randn(t, n * h_r, d, device=device).to(torch.bfloat16).requires_grad_()
    lse = torch.randn(t, n * h_r, device=device).requires_grad_()
    signals = wss[1].recv_signal.clone()
    for name, args in (("partial_output", (o, lse.detach())), ("partial_lse", (o.detach(), lse))):
        for method in ("lse_reduce", "publish"):
            with pytest.raises(
                RuntimeError, match=f"^DirectDCPA2AWorkspace.{method}: {name} requires grad"
            ):
                getattr(wss[0], method)(*args)
    assert torch.equal(wss[1].recv_signal, signals)  # nothing published
    assert int(wss[0].epoch[0]) == 0
    with torch.no_grad():
        for ws in wss:
            ws.publish(o, lse)
        outs = [ws.wait_and_combine(t) for ws in wss]
    assert all(not out.requires_grad and bool(torch.isfinite(out).all()) for out in outs)


def test_publish_head_offsets_past_int32(watch_interpreted_accesses: Any) -> None:
    """The publish reads head j of its destination slice at ``j * stride_out_h``: a head-major
    partial output (a ``[T, H, D]`` view of ``[H, T_cap, D]`` storage, here ``stride_h =
    2**29``) passes 2**31 elements, where the int32 product wrapped (32 of 128 loads landed
    2 GiB before the tensor). Interpreter, both destinations' publish programs, their loads
    from ``partial_output`` recorded instead of made."""
    n, h_r, d, t_max = 2, 8, 8, 1
    stride_t, stride_h = d, 2**29
    src = torch.zeros(64, dtype=torch.bfloat16)  # stands in for the head-major view
    lse = torch.zeros(1, n * h_r)
    recv_out = [torch.zeros(2 * n * t_max * h_r * d, dtype=torch.bfloat16) for _ in range(n)]
    recv_lse = [torch.zeros(2 * n * t_max * h_r) for _ in range(n)]
    sig = [torch.zeros(2, n, dtype=torch.int64) for _ in range(n)]
    loads = watch_interpreted_accesses("load", tl.bfloat16, src.data_ptr(), 2)
    _direct_a2a_publish_kernel[(n, 1)](
        src, stride_t, stride_h, 1, lse, n * h_r, 1, lse, lse, 0,
        torch.tensor([x.data_ptr() for x in recv_out]),
        torch.tensor([x.data_ptr() for x in recv_lse]),
        torch.tensor([x.data_ptr() for x in sig]),
        torch.zeros(n, dtype=torch.int32), torch.zeros(1, dtype=torch.int64),
        torch.zeros(3, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
        1, t_max, 0, 1,
        N=n, H_R=h_r, D=d, BLOCK_HD=64, BLOCK_H=8, HAS_MASK=False, NUM_SEQS_POW2=1,
    )  # fmt: skip
    want = [
        (dst * h_r + j) * stride_h + e for dst in range(n) for j in range(h_r) for e in range(d)
    ]
    np.testing.assert_array_equal(np.sort(np.concatenate(loads)), np.array(want, dtype=np.int64))


def test_a_local_allocation_failing_on_one_rank_fails_every_rank(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The workspace's local tensors (counters, error records, the group's failure word) are
    agreed on before its symmetric buffers: out of memory on one rank there raises
    ``DirectPathUnavailable`` on every rank, so every manager falls back together (no rank goes
    on alone into the first symmetric allocation's agreement)."""
    from cpattn_dcp.direct import _base

    real = _base.group_failure_word

    def failing_on_rank_1(group: Any, dev: torch.device) -> torch.Tensor:
        if group.rank_in_group == 1:
            raise torch.OutOfMemoryError("injected: 8 bytes on rank 1")
        return real(group, dev)

    monkeypatch.setattr(_base, "group_failure_word", failing_on_rank_1)
    world = SimulatedWorld(2, device, timeout=10.0)

    def build(group: Any) -> str:
        try:
            DirectDCPA2AWorkspace(group, device, 4, 1, 8, torch.bfloat16)
        except DirectPathUnavailable as exc:
            return str(exc)
        return "built"

    for message in world.run(build):
        assert "local buffers failed on rank(s) [1] of 2" in message, message
