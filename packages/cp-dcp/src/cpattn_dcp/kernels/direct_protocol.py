"""Device-side pieces of the direct (symmetric-memory) signal/epoch protocol.

Shared by the direct A2A LSE-reduce and the direct Q / KV gathers
(``cpattn_dcp.kernels.direct_a2a``, ``cpattn_dcp.kernels.direct_gather``).

Protocol (one call of one workspace on ubatch ``u``):

1. Every program of the *publish* launch first reads this rank's error flag ``err[u][0]`` and
   the group failure word ``grp_err[0]`` (``_failed``) and returns at once if either is set:
   no payload store, no counter bump, no signal (see "Sticky failure" below). Otherwise it
   reads ``E = epoch[u] + 1`` (the epoch of this call; ``epoch[u]`` itself is advanced only at
   the very end of the call) and the parity slot ``E & 1``. It stores its payload into the
   destination peer's symmetric receive buffer of that slot, then bumps a local
   per-destination counter (acq_rel). The program that completes
   the counter resets it and raises the signal ``signal[u, parity, rank] = E`` in the
   destination's memory with a release exchange at system scope, so every payload store of
   this rank to that destination is visible before the signal is.
2. Every program of the *wait* launch acquire-polls its local ``signal[u, parity, 0:N]`` until
   each entry equals ``E``, bounded by ``max_spins`` polls. On timeout it records
   ``err[u] = (1, E, missing-source bitmask words)``, sets ``grp_err[0] = 1`` and never reads
   the payload: it stores NaN into its share of the call's output instead (A2A combine output,
   KV gather destination, query gather rows). A program that finds ``err[u][0]`` or
   ``grp_err[0]`` already set at its start does not poll at all: it counts as timed out (NaN
   output, nothing read). It leaves a set own record as it is; where only the group word was
   set it records ``err[u] = (2, E)`` (compare-and-swap from 0: a set record is never
   overwritten), which the host reports as "another direct workspace of this group timed out
   first". The last program to finish (local completion counter) stores ``epoch[u] = E``.

Sticky failure: a timed-out wait still advances ``epoch[u]`` (the host learns of the timeout
only later: on CUDA up to ``error_check_interval`` calls later), so without step 1's check this
rank would go on publishing calls ``E + 1, E + 2, ...``. A peer that was merely slow may still
be reading an earlier call of this rank from the very slot such a publish stores into (it saw
that call's signal), and would return a finite, wrong result with no error. With the check, a
rank whose wait timed out on ubatch ``u`` never writes into any peer's memory on ``u`` again:
what it published before the failure stays intact (a peer still reading it gets the right
result), and the peers' next waits on ``u`` time out in turn (NaN A2A and gather output)
and record their own errors. The failed rank's own later waits on ``u`` fail at once (step 2):
the calls it makes before the host learns of the failure do not each spin to ``max_spins``,
and the record keeps the first timeout, the one that names the missing peer.

The failure is sticky per group, not only per workspace: ``grp_err`` is one local (not
symmetric) int64 word per (process group, device), shared by every direct workspace of the
group, every kind, geometry and ubatch (``cpattn_dcp.direct._group_failure``). Workspaces of
one group protect each other: a ``DCPManager``'s query gather has one buffer per ubatch and no
parity slots, guarded between calls only by the A2A combine's rendezvous (a peer reaches its
next query gather only after this rank published into the combine). Had this rank's combine
timed out with only its own record set, its still-healthy query gather would publish the next
step's query into a slow peer's buffer while the peer still reads the current one: a finite,
wrong query and no error. With the group word, one timeout stops every publish of the group on
this rank, and the peers' next waits of any of the group's workspaces time out in turn. Cost on
the success path: one more plain load per program.

Epoch 0 is never published (symmetric memory is zero-filled at allocation), so a freshly
allocated slot never looks ready. Two parity slots suffice because every call is a full
rendezvous (see ``docs`` / the workspace docstrings).
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
    """True (int1 scalar) once this rank must not take part in a call of this workspace:
    a wait of this workspace's ubatch timed out (``err[0] != 0``) or one of any direct
    workspace of the same group on this device did (the group word ``grp_err[0] != 0``).

    ``err_ptr`` points at this ubatch's error record (``_record_timeout``), ``grp_err_ptr`` at
    the group's failure word. Read at the start of every publish and wait program: what an
    earlier launch on the same stream stored is visible to a plain load.
    """
    return (tl.load(err_ptr) != 0) | (tl.load(grp_err_ptr) != 0)


@triton.jit
def _publish_done(counter_ptr, dst_sig_ptr, epoch_value, num_programs):
    """Count this program as finished; the last one raises the destination's signal.

    ``counter_ptr`` points at the local int32 counter of this destination,
    ``dst_sig_ptr`` at ``signal[u, parity, rank]`` in the destination's memory.
    """
    tl.debug_barrier()
    prev = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if prev == num_programs - 1:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(dst_sig_ptr, epoch_value, sem="release", scope="sys")


@triton.jit
def _wait_all(sig_ptr, epoch_value, max_spins, N: tl.constexpr, N_POW2: tl.constexpr):
    """Acquire-poll ``sig_ptr[0:N]`` until all equal ``epoch_value`` or ``max_spins`` polls.

    Returns ``(ok, arrived)``: ``ok`` is an int1 scalar, ``arrived`` an int32 ``[N_POW2]``
    vector, 1 for the sources whose signal had arrived at the last poll (0 past ``N``).
    The missing-source bitmask is built by ``_record_timeout``, only on a timeout.
    """
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
    """Record a bounded-wait timeout: ``err[0:2 + W] = (1, epoch, missing-source bitmask)``,
    then set the group word ``grp_err[0] = 1``.

    The mask takes ``W = cdiv(N, 64)`` int64 words: source ``n`` is bit ``n % 64`` of word
    ``n // 64`` (one word cannot name the sources of a group of more than 64 ranks: a shift by
    64 or more is undefined). ``arrived`` is ``_wait_all``'s vector. Every program that timed
    out records; each word is then the view of one of them (a source missing at its last poll).
    """
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
    """Record that this wait failed only because the group word was set (another direct
    workspace of the group timed out first): ``err[0:2] = (2, epoch)``, mask words untouched
    (zero: nothing was polled). The flag goes in with a compare-and-swap from 0, so a record
    already set is never overwritten; the epoch store is harmless where it loses, as every
    program of one launch stores the same ``epoch_value`` and a record of an earlier launch
    makes this one fail through ``err[0]``, not through this path. Only a program of the same
    launch that really timed out (``_record_timeout``) may turn the flag into 1 afterwards: the
    record then names the missing peers, which is the more useful one.
    """
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
    """Step 2 of the protocol for one wait program; returns ``ok`` (int1 scalar).

    An earlier wait of this workspace (its own record ``err[0]``) or of any of the group's (the
    group word) timed out: fail at once without polling, keeping a set record and setting a
    clear one to flag 2 (``_record_group_failure``). Otherwise poll ``sig_ptr[0:N]`` (the
    call's parity slot) for ``epoch_value`` (``_wait_all``) and record a timeout
    (``_record_timeout``).
    """
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
