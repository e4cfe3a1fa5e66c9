"""Device side of the direct (symmetric-memory) signal/epoch protocol, shared by the direct
A2A LSE-reduce and the direct Q / KV gathers (docs/direct-internals.md, "Bounded waits and sticky
failure"). Error record ``err[u] = (code, E, missing-source bitmask words)``: code 1 timeout, 2
failed because the group word ``grp_err[0]`` was set. Epoch 0 is never published.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _call_epoch(epoch_ptr):
    """``(E, parity)`` of the running call: ``E = epoch + 1`` (int64), ``parity = E & 1``."""
    e = tl.load(epoch_ptr) + 1
    return e, e & 1


@triton.jit
def _failed(err_ptr, grp_err_ptr):
    """True (int1 scalar) once this rank must not take part in a call of this workspace: its
    ubatch's error record ``err[0]`` or the group's failure word ``grp_err[0]`` is set (plain
    loads see what an earlier launch on the same stream stored)."""
    return (tl.load(err_ptr) != 0) | (tl.load(grp_err_ptr) != 0)


@triton.jit
def _publish_done(counter_ptr, dst_sig_ptr, epoch_value, num_programs):
    """Count this program as finished on the destination's local int32 counter; the last one
    raises ``signal[u, parity, rank]`` (``dst_sig_ptr``) in the destination's memory."""
    tl.debug_barrier()
    prev = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if prev == num_programs - 1:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(dst_sig_ptr, epoch_value, sem="release", scope="sys")


@triton.jit
def _wait_all(sig_ptr, epoch_value, max_spins, N: tl.constexpr, N_POW2: tl.constexpr):
    """Acquire-poll ``sig_ptr[0:N]`` until all equal ``epoch_value`` or ``max_spins`` polls;
    returns ``(ok, arrived)``: int1 scalar, int32 ``[N_POW2]`` (1: arrived at the last poll)."""
    offs = tl.arange(0, N_POW2)
    valid = offs < N
    arrived = tl.zeros([N_POW2], dtype=tl.int32)
    count = tl.sum(arrived, axis=0)
    spins = 0
    while (count < N) & (spins < max_spins):
        sig = tl.atomic_add(sig_ptr + offs, 0, mask=valid, sem="acquire", scope="sys")
        arrived = ((sig == epoch_value) & valid).to(tl.int32)
        count = tl.sum(arrived, axis=0)
        spins += 1
    tl.debug_barrier()
    return count == N, arrived


@triton.jit
def _record_timeout(
    err_ptr, grp_err_ptr, epoch_value, arrived, N: tl.constexpr, N_POW2: tl.constexpr
):
    """Record a bounded-wait timeout: ``err[0:2 + W] = (1, epoch, missing-source bitmask)``
    (``W = cdiv(N, 64)`` int64 words, source ``n`` at bit ``n % 64`` of word ``n // 64``), then
    set the group word ``grp_err[0] = 1``. Every program that timed out records its view."""
    offs = tl.arange(0, N_POW2)
    gone = (offs < N) & (arrived == 0)
    bit = tl.full([N_POW2], 1, tl.int64) << (offs % 64).to(tl.int64)
    for w in tl.static_range((N + 63) // 64):
        # Distinct bits: their sum is their OR (bit 63 wraps to the sign bit, as intended).
        tl.store(err_ptr + 2 + w, tl.sum(tl.where(gone & (offs // 64 == w), bit, 0), axis=0))
    tl.store(err_ptr + 1, epoch_value)
    tl.atomic_xchg(err_ptr, 1, sem="release", scope="gpu")
    # Then fail every other direct workspace of the group on this rank (``_failed``).
    tl.atomic_xchg(grp_err_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _record_group_failure(err_ptr, epoch_value):
    """Record that this wait failed only because the group word was set (another workspace
    of the group timed out first): ``err[0:2] = (2, epoch)``, the flag by a compare-and-swap
    from 0, so a set record is never overwritten (a real timeout of the same launch may still
    turn it into 1, which names the missing peers)."""
    tl.store(err_ptr + 1, epoch_value)
    clear = tl.full([], 0, tl.int64)
    tl.atomic_cas(err_ptr, clear, clear + 2, sem="release", scope="gpu")


@triton.jit
def _wait_done(done_ptr, epoch_ptr, epoch_value, num_programs):
    """Count this wait program as finished; the last one advances ``epoch`` to ``epoch_value``."""
    tl.debug_barrier()
    prev = tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="gpu")
    if prev == num_programs - 1:
        tl.atomic_xchg(done_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(epoch_ptr, epoch_value, sem="release", scope="gpu")


@triton.jit
def _checked_wait(
    sig_ptr, err_ptr, grp_err_ptr, epoch_value, max_spins, N: tl.constexpr, N_POW2: tl.constexpr
):
    """Step 2 of the protocol for one wait program; returns ``ok`` (int1 scalar). After an
    earlier failure (own record or group word) it fails at once without polling."""
    own = tl.load(err_ptr) != 0
    group = tl.load(grp_err_ptr) != 0
    failed = own | group
    spins = tl.where(failed, 0, max_spins)
    ok, arrived = _wait_all(sig_ptr, epoch_value, spins, N, N_POW2)
    if (ok == 0) & (failed == 0):
        _record_timeout(err_ptr, grp_err_ptr, epoch_value, arrived, N, N_POW2)
    if group & (own == 0):
        _record_group_failure(err_ptr, epoch_value)  # tells the host which workspace failed first
    return ok


__all__ = [
    "_call_epoch",
    "_checked_wait",
    "_failed",
    "_publish_done",
    "_record_group_failure",
    "_record_timeout",
    "_wait_all",
    "_wait_done",
]
