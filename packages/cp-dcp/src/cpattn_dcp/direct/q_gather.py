"""Direct DCP query gather: every rank stores its query heads straight into every peer's
consumer-final ``[T, N*H_r, D]`` buffer (rank-major heads), signals, and waits. Created only
where NVLS multicast spans the group.

The result is a view of the ubatch's persistent buffer, which the peers' next gather
overwrites: it is valid until this rank enters this layer's combine (the next rendezvous), so
copy it if needed later. A failed wait fills the call's ``T * S * D`` elements with NaN.
"""

from __future__ import annotations

from typing import Any

import torch

from cpattn_common.agreement import check_tensor_agreement, gather_rank_values
from cpattn_common.capability import multicast_disabled_by_env
from cpattn_common.checks import check_state, check_tensors
from cpattn_common.dispatch import refuse_grad
from cpattn_dcp.direct._base import (
    DEFAULT_ERROR_CHECK_INTERVAL,
    DEFAULT_MAX_SPINS,
    MAX_PUBLISH_PROGRAMS,
    DirectPathUnavailable,
    DirectWorkspaceBase,
    as_int,
    check_16b_aligned,
    check_16b_rows,
    checked_sizes,
    next_pow2,
    on_workspace_device,
)
from cpattn_dcp.kernels.direct_gather import (
    _direct_gather_publish_kernel,
    _direct_gather_wait_kernel,
    nan_bits,
    same_size_int,
)

__all__ = ["DirectDCPQGatherWorkspace"]

# Elements per NaN store of a failed wait (its single program loops over the call's rows).
_NAN_FILL_BLOCK = 1024
# Query dtypes the publish passes to Triton as they are; others (float8_e8m0fnu, the fnuz fp8
# types) move through a same-size integer view (a bit-exact copy either way).
_PUBLISHED_AS_IS = frozenset(
    {torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2}
)


def _require_multicast(workspace: DirectWorkspaceBase, storages: list[torch.Tensor]) -> None:
    """Collectively close ``workspace`` and raise ``DirectPathUnavailable`` unless every rank's
    ``storages`` have multicast pointers (never queried where the environment disables it)."""
    name, symm = workspace.name, workspace.symmetric_workspace
    env_off = multicast_disabled_by_env()
    ok = not env_off and all(
        (ptrs := symm.multicast_ptrs(storage)) and all(int(p) != 0 for p in ptrs)
        for storage in storages
    )
    flags = gather_rank_values(symm.group, symm.agreement_flag, int(ok))
    missing = [r for r, flag in enumerate(flags) if not flag]
    if not missing:
        return
    workspace.close()  # every rank refuses together (the flags agree), so all close
    if env_off:
        raise DirectPathUnavailable(
            f"{name} requires NVLS symmetric-memory multicast, which the environment disables"
        )
    raise DirectPathUnavailable(
        f"{name} requires NVLS symmetric-memory multicast; rank(s) {missing} of "
        f"{len(flags)} have no multicast address."
    )


class DirectDCPQGatherWorkspace(DirectWorkspaceBase):
    """Direct symmetric-memory query gather of one DCP group and geometry (collective ctor).

    Buffers per rank: ``final_query [U, T_max, S, D]`` (S = ``padded_num_heads`` or N*H_r),
    ``signal [U, 2, N]`` int64.

    Args:
        group / device / num_ubatches / max_spins / error_check_interval: as
            ``DirectDCPA2AWorkspace``.
        max_num_tokens / heads_per_rank / head_dim: T_max, this rank's query heads H_r, D.
        dtype: query dtype (any 1-, 2- or 4-byte floating dtype with a NaN encoding, fp8
            included).
        padded_num_heads: head capacity S >= N*H_r of the returned tensor's storage, for
            fixed-head attention kernels (``None``: N*H_r).
        require_multicast: raise ``DirectPathUnavailable`` unless multicast spans the group
            (``False`` only for tests with simulated peers).
    """

    def __init__(
        self,
        group: Any,
        device: torch.device | str,
        max_num_tokens: int,
        heads_per_rank: int,
        head_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        num_ubatches: int = 1,
        padded_num_heads: int | None = None,
        *,
        require_multicast: bool = True,
        max_spins: int = DEFAULT_MAX_SPINS,
        error_check_interval: int = DEFAULT_ERROR_CHECK_INTERVAL,
    ) -> None:
        name = "Direct DCP q-gather"
        max_num_tokens, heads_per_rank, head_dim, num_ubatches = checked_sizes(
            name,
            max_num_tokens=max_num_tokens,
            heads_per_rank=heads_per_rank,
            head_dim=head_dim,
            num_ubatches=num_ubatches,
        )
        if padded_num_heads is not None:
            padded_num_heads = as_int(f"{name}: padded_num_heads", padded_num_heads)
        try:
            # A failed wait marks the call's rows with this pattern (no NaN: not supported).
            self._nan_bits = nan_bits(dtype)
        except ValueError as exc:
            raise ValueError(f"{name} does not support {dtype}: {exc}") from None
        super().__init__(
            name, group, device, num_ubatches, max_spins=max_spins,
            error_check_interval=error_check_interval,
        )  # fmt: skip
        n = self.world_size
        gathered = n * heads_per_rank
        storage_heads = gathered if padded_num_heads is None else padded_num_heads
        check_16b_rows(
            name,
            dtype,
            local_heads=heads_per_rank * head_dim,
            storage_heads=storage_heads * head_dim,
        )
        if storage_heads < gathered:
            raise ValueError(
                f"{name} padded heads must cover gathered heads: {storage_heads} < {gathered}"
            )
        self.max_num_tokens = max_num_tokens
        self.heads_per_rank = heads_per_rank
        self.head_dim = head_dim
        self.dtype = dtype
        self.storage_heads = storage_heads
        self._init_buffers()
        self.final_query, self._q_ptrs = self._allocate(
            (self.max_num_tokens, storage_heads, head_dim), dtype
        )
        self.recv_signal, self._sig_ptrs = self._allocate((2, n), torch.int64)
        if require_multicast:
            _require_multicast(self, [self.final_query, self.recv_signal])
        # The wait stores NaN bit patterns through this view (its dtype Triton always knows).
        self._final_query_bits = self.final_query.view(same_size_int(dtype))
        self._publish_view = None if dtype in _PUBLISHED_AS_IS else same_size_int(dtype)
        self._block_w = min(next_pow2(heads_per_rank * head_dim), 4096)
        self._n_pow2 = next_pow2(n)

    def unsupported_reason(self, local_query: torch.Tensor, *, layout: bool = True) -> str | None:
        """Why ``local_query`` cannot take the direct path (``None``: it can). ``layout=False``
        leaves out what a packed copy of this rank's tensor mends (the negative bit, head
        packing, alignment). ``TypeError`` for a non-tensor."""
        check_tensors(self.name, local_query=local_query)
        if local_query.dim() != 3:
            return f"expected local_query [T, H_r, D], got {tuple(local_query.shape)}"
        t, h, d = local_query.shape
        if h != self.heads_per_rank or d != self.head_dim:
            return (
                f"local_query: expected {self.heads_per_rank} heads of dim {self.head_dim}, "
                f"got {h} x {d}"
            )
        if t > self.max_num_tokens:
            return f"local_query: {t} tokens exceed the q-gather capacity {self.max_num_tokens}"
        if local_query.dtype != self.dtype:
            return f"local_query dtype {local_query.dtype} != workspace dtype {self.dtype}"
        if local_query.device != self.device:
            return f"local_query on {local_query.device}, workspace on {self.device}"
        if not layout:
            return None
        if local_query.is_neg():
            return "local_query has torch's negative bit (a lazily negated view)"
        if t > 0 and (local_query.stride(2) != 1 or (h > 1 and local_query.stride(1) != d)):
            return "local_query heads must be packed (head stride D, dim stride 1)"
        if t > 0:
            return check_16b_aligned(local_query, "local_query", (local_query.stride(0),))
        return None

    @on_workspace_device
    def publish(
        self, local_query: torch.Tensor, *, ubatch_id: int | None = None, validate: bool = True
    ) -> None:
        """First launch of ``gather`` (separate so simulated ranks can all publish before any
        wait): store this rank's heads into every peer's buffer and signal. ``validate=False``
        only after ``gather``'s checks (unchecked, it stores out of bounds). Raises as ``gather``."""
        if validate:
            refuse_grad("DirectDCPQGatherWorkspace.publish", local_query=local_query)
            self._before_call()
            self._refuse(self.unsupported_reason(local_query))
        u = self._resolve_ubatch(ubatch_id)
        t = local_query.shape[0]
        if t == 0:
            return
        n, w = self.world_size, self.heads_per_rank * self.head_dim
        num_pub = min(t, MAX_PUBLISH_PROGRAMS)
        src = local_query if self._publish_view is None else local_query.view(self._publish_view)
        _direct_gather_publish_kernel[(n, num_pub)](
            src_ptr=src, stride_src_t=local_query.stride(0), peer_dst_ptrs=self._q_ptrs[u],
            peer_sig_ptrs=self._sig_ptrs[u], counter_ptr=self._pub_counter[u],
            epoch_ptr=self.epoch[u:], err_ptr=self._error[u], grp_err_ptr=self._group_failure, T=t,
            rank=self.rank, dst_parity_stride=0, dst_rank_stride=w, dst_row_stride=n * w,
            NUM_PUB=num_pub, N=n, W=w, BLOCK_W=self._block_w,
        )  # fmt: skip

    @on_workspace_device
    def wait(
        self, num_tokens: int, *, ubatch_id: int | None = None, validate: bool = True
    ) -> torch.Tensor:
        """Second launch of ``gather``: bounded wait for every source's ``publish`` of this call
        (T = ``num_tokens`` rows each); returns ``gather``'s view, valid until this rank enters
        this layer's combine. Raises as ``gather``, and ``ValueError`` for ``num_tokens``
        outside ``[0, max_num_tokens]``."""
        t = as_int(f"{self.name}: num_tokens", num_tokens)
        if validate:
            self._before_call()
            if not 0 <= t <= self.max_num_tokens:
                raise ValueError(f"{self.name}: num_tokens {t} not in [0, {self.max_num_tokens}]")
        u = self._resolve_ubatch(ubatch_id)
        if t > 0:  # dst: written (NaN) only on a failure, there is nothing to copy
            _direct_gather_wait_kernel[(1,)](
                sig_ptr=self.recv_signal[u], epoch_ptr=self.epoch[u:],
                done_ptr=self._wait_done[u:], err_ptr=self._error[u],
                grp_err_ptr=self._group_failure, slot_ptr=self.recv_signal[u],
                dst_ptr=self._final_query_bits[u],
                num_elems=t * self.storage_heads * self.head_dim, slot_parity_stride=0,
                max_spins=self.max_spins, num_programs=1, N=self.world_size, N_POW2=self._n_pow2,
                HAS_COPY=False, BLOCK=_NAN_FILL_BLOCK, NAN_BITS=self._nan_bits,
            )  # fmt: skip
            self._after_call()
        g = self.world_size * self.heads_per_rank
        buf = self.final_query[u]
        return torch.as_strided(
            buf, (t, g, self.head_dim), (g * self.head_dim, self.head_dim, 1), buf.storage_offset()
        )

    @on_workspace_device
    def gather(
        self, local_query: torch.Tensor, *, ubatch_id: int | None = None, checked: bool = False
    ) -> torch.Tensor:
        """All-gather the query heads of the DCP group.

        Args:
            local_query: ``[T, H_r, D]``; heads packed, rows 16-byte aligned.
            ubatch_id: micro-batch slot (default ``cpattn_common.current_ubatch_id()``).
            checked: the caller has just found ``unsupported_reason(local_query)`` to be
                ``None``, so it is not run again.

        Returns:
            ``[T, N*H_r, D]`` contiguous view (rank-major heads) of the persistent buffer, with
            storage for ``T * S * D`` elements behind it (S = padded heads), valid until this
            rank enters this layer's combine (module docstring); NaN after a timed-out wait.

        Raises:
            RuntimeError: the workspace is closed, or grad mode is on and ``local_query``
                requires grad.
            DirectProtocolError: an earlier call's bounded wait timed out.
            ValueError: ``unsupported_reason(local_query)`` is not ``None``, or the ubatch is
                out of range.
        """
        refuse_grad("DirectDCPQGatherWorkspace.gather", local_query=local_query)
        self._before_call()
        self._refuse(None if checked else self.unsupported_reason(local_query))
        u = self._resolve_ubatch(ubatch_id)
        if check_state.enabled:  # check mode: the ranks' calls agree
            check_tensor_agreement(self.name, self.cp_group, "local_query", local_query)
        # Checked above (T <= max_num_tokens included): the launches skip the checks.
        self.publish(local_query, ubatch_id=u, validate=False)
        return self.wait(local_query.shape[0], ubatch_id=u, validate=False)
