"""Direct DCP KV gather (MLA chunked-context prefill): every rank stores its local KV rows into
every peer's symmetric parity slot at ``rank * T``, signals and waits; the rows are then copied
into the caller's ``gathered_kv [N*T, D]`` (NaN after a failed wait). Created only where NVLS
multicast spans the group.
"""

from __future__ import annotations

from typing import Any

import torch

from cpattn_common.agreement import check_tensor_agreement
from cpattn_common.checks import check_no_overlap, check_state, check_tensors
from cpattn_common.dispatch import mark_written_in_place, refuse_grad
from cpattn_dcp.direct._base import (
    DEFAULT_ERROR_CHECK_INTERVAL,
    DEFAULT_MAX_SPINS,
    MAX_PUBLISH_PROGRAMS,
    DirectWorkspaceBase,
    check_16b_aligned,
    check_16b_rows,
    checked_sizes,
    next_pow2,
    on_workspace_device,
)
from cpattn_dcp.direct.q_gather import _require_multicast
from cpattn_dcp.kernels.direct_gather import (
    _direct_gather_publish_kernel,
    _direct_gather_wait_kernel,
    nan_bits,
)

__all__ = ["DIRECT_KV_GATHER_DTYPES", "DirectDCPKVGatherWorkspace"]

#: KV dtypes the direct KV gather supports.
DIRECT_KV_GATHER_DTYPES: tuple[torch.dtype, ...] = (
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
)
_COPY_BLOCK = 2048  # elements one wait program copies out of the slot


class DirectDCPKVGatherWorkspace(DirectWorkspaceBase):
    """Direct symmetric-memory KV gather of one DCP group and geometry (collective ctor).

    Buffers per rank: ``received_kv [U, 2, G, D]`` (G = ``max_gathered_tokens``),
    ``signal [U, 2, N]`` int64.

    Args:
        group / device / num_ubatches / max_spins / error_check_interval / require_multicast:
            as ``DirectDCPQGatherWorkspace``.
        max_gathered_tokens: G, capacity of one gathered chunk (N*T <= G); divisible by N.
        token_dim: D (576 for DeepSeek-style MLA); dtype: float16, bfloat16 or float8_e4m3fn.
    """

    def __init__(
        self,
        group: Any,
        device: torch.device | str,
        max_gathered_tokens: int,
        token_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        num_ubatches: int = 1,
        *,
        require_multicast: bool = True,
        max_spins: int = DEFAULT_MAX_SPINS,
        error_check_interval: int = DEFAULT_ERROR_CHECK_INTERVAL,
    ) -> None:
        name = "Direct DCP kv-gather"
        max_gathered_tokens, token_dim, num_ubatches = checked_sizes(
            name,
            max_gathered_tokens=max_gathered_tokens,
            token_dim=token_dim,
            num_ubatches=num_ubatches,
        )
        if dtype not in DIRECT_KV_GATHER_DTYPES:
            raise ValueError(f"{name} does not support {dtype}; supported: fp16, bf16, fp8_e4m3fn")
        check_16b_rows(name, dtype, token_dim=token_dim)
        super().__init__(
            name, group, device, num_ubatches, max_spins=max_spins,
            error_check_interval=error_check_interval,
        )  # fmt: skip
        n = self.world_size
        if max_gathered_tokens % n != 0:
            raise ValueError(
                f"{name} capacity must divide evenly across ranks: {max_gathered_tokens} % {n} != 0"
            )
        self.max_gathered_tokens = max_gathered_tokens
        self.token_dim = token_dim
        self.dtype = dtype
        self._init_buffers()
        self.received_kv, self._kv_ptrs = self._allocate(
            (2, self.max_gathered_tokens, token_dim), dtype
        )
        self.recv_signal, self._sig_ptrs = self._allocate((2, n), torch.int64)
        if require_multicast:
            _require_multicast(self, [self.received_kv, self.recv_signal])
        self._block_w = min(next_pow2(token_dim), 4096)
        self._n_pow2 = next_pow2(n)
        self._nan_bits = nan_bits(dtype)  # what a failed wait stores into ``gathered_kv``

    def _kv_reason(
        self, what: str, kv: torch.Tensor, layout: bool = True, rows: bool = True
    ) -> str | None:
        """Why ``kv`` (``what``: ``local_kv [T, D]`` or ``gathered_kv [N*T, D]``) is not a
        ``[rows, D]`` tensor of this workspace's dtype and device with ``layout_ok`` (unless
        ``layout=False``) and, unless ``rows=False``, row counts within the capacity."""
        if kv.dim() != 2:
            return f"expected {what} [rows, D], got {tuple(kv.shape)}"
        if kv.shape[1] != self.token_dim:
            return f"{what} token dim {kv.shape[1]} != workspace token_dim {self.token_dim}"
        if kv.dtype != self.dtype:
            return f"{what} dtype {kv.dtype} != workspace dtype {self.dtype}"
        if kv.device != self.device:
            return f"{what} on {kv.device}, workspace on {self.device}"
        if layout and not self.layout_ok(kv):
            if not kv.is_contiguous():
                return f"{what} must be contiguous"
            if kv.is_neg():
                return f"{what} has torch's negative bit (a lazily negated view)"
            return check_16b_aligned(kv, what, ())
        n, t, cap = self.world_size, kv.shape[0], self.max_gathered_tokens
        if not rows:
            return None
        if what == "local_kv":
            if n * t > cap:
                return f"gathered kv {n}*{t} = {n * t} rows exceed the kv-gather capacity {cap}"
        elif t % n != 0:
            return f"gathered_kv has {t} rows, not N*T rows for N = {n}"
        elif t > cap:
            return f"gathered_kv has {t} rows, more than the kv-gather capacity {cap}"
        return None

    def layout_ok(self, kv: torch.Tensor) -> bool:
        """Whether ``kv``'s layout is one the direct gather reads or writes as is: contiguous,
        16-byte aligned, without torch's negative bit (shape, dtype and device unchecked)."""
        return (
            kv.is_contiguous() and (kv.numel() == 0 or kv.data_ptr() % 16 == 0) and not kv.is_neg()
        )

    def unsupported_reason(
        self, gathered_kv: torch.Tensor, local_kv: torch.Tensor, *, layout: bool = True
    ) -> str | None:
        """Why this call cannot take the direct path (``None``: it can): ``local_kv [T, D]``
        and ``gathered_kv [N*T, D]`` of the workspace dtype, device and token dim, ``N*T <=
        max_gathered_tokens``, and (unless ``layout=False``: what packed copies of this rank's
        tensors mend) ``layout_ok``. ``TypeError`` for a non-tensor."""
        check_tensors(self.name, gathered_kv=gathered_kv, local_kv=local_kv)
        # Accept in one expression first (the hot path); the checks below name what is wrong.
        local_shape, gathered_shape = local_kv.shape, gathered_kv.shape
        if (
            len(local_shape) == 2
            and local_shape[1] == self.token_dim
            and gathered_shape == (self.world_size * local_shape[0], self.token_dim)
            and gathered_shape[0] <= self.max_gathered_tokens
            and local_kv.dtype == self.dtype
            and gathered_kv.dtype == self.dtype
            and local_kv.device == self.device
            and gathered_kv.device == self.device
            and (not layout or (self.layout_ok(local_kv) and self.layout_ok(gathered_kv)))
        ):
            return None
        reason = self._kv_reason("local_kv", local_kv, layout) or self._kv_reason(
            "gathered_kv", gathered_kv, layout, rows=False
        )
        if reason is not None:
            return reason
        n, t = self.world_size, local_kv.shape[0]
        if gathered_kv.shape[0] != n * t:  # implies the capacity check
            return f"gathered_kv has {gathered_kv.shape[0]} rows, expected N*T = {n}*{t} = {n * t}"
        return None

    @on_workspace_device
    def publish(
        self, local_kv: torch.Tensor, *, ubatch_id: int | None = None, validate: bool = True
    ) -> None:
        """First launch of ``gather`` (as ``DirectDCPQGatherWorkspace.publish``): store this
        rank's rows into every peer's parity slot and signal. Raises as ``gather``."""
        if validate:
            refuse_grad("DirectDCPKVGatherWorkspace.publish", local_kv=local_kv)
            self._before_call()
            self._refuse(self._kv_reason("local_kv", local_kv))
        u = self._resolve_ubatch(ubatch_id)
        t = local_kv.shape[0]
        if t == 0:
            return
        d = self.token_dim
        num_pub = min(t, MAX_PUBLISH_PROGRAMS)
        _direct_gather_publish_kernel[(self.world_size, num_pub)](
            src_ptr=local_kv, stride_src_t=local_kv.stride(0), peer_dst_ptrs=self._kv_ptrs[u],
            peer_sig_ptrs=self._sig_ptrs[u], counter_ptr=self._pub_counter[u],
            epoch_ptr=self.epoch[u:], err_ptr=self._error[u], grp_err_ptr=self._group_failure, T=t,
            rank=self.rank, dst_parity_stride=self.max_gathered_tokens * d, dst_rank_stride=t * d,
            dst_row_stride=d, NUM_PUB=num_pub, N=self.world_size, W=d, BLOCK_W=self._block_w,
        )  # fmt: skip

    @on_workspace_device
    def wait(
        self, gathered_kv: torch.Tensor, *, ubatch_id: int | None = None, validate: bool = True
    ) -> None:
        """Second launch of ``gather``: bounded wait, then copy the slot's ``N*T`` rows into
        ``gathered_kv [N*T, D]`` (NaN after a timeout). Raises as ``gather`` for
        ``gathered_kv``, whose rows must be a multiple of N."""
        if validate:
            refuse_grad("DirectDCPKVGatherWorkspace.wait", gathered_kv=gathered_kv)
            self._before_call()
            self._refuse(self._kv_reason("gathered_kv", gathered_kv))
        u = self._resolve_ubatch(ubatch_id)
        num_elems = gathered_kv.numel()
        if num_elems == 0:
            return
        grid = (-(-num_elems // _COPY_BLOCK),)
        _direct_gather_wait_kernel[grid](
            sig_ptr=self.recv_signal[u], epoch_ptr=self.epoch[u:], done_ptr=self._wait_done[u:],
            err_ptr=self._error[u], grp_err_ptr=self._group_failure, slot_ptr=self.received_kv[u],
            dst_ptr=gathered_kv, num_elems=num_elems,
            slot_parity_stride=self.max_gathered_tokens * self.token_dim, max_spins=self.max_spins,
            num_programs=grid[0], N=self.world_size, N_POW2=self._n_pow2, HAS_COPY=True,
            BLOCK=_COPY_BLOCK, NAN_BITS=self._nan_bits,
        )  # fmt: skip
        # As all_gather_into_tensor does through the dispatcher.
        mark_written_in_place(gathered_kv)
        self._after_call()

    @on_workspace_device
    def gather(
        self,
        gathered_kv: torch.Tensor,
        local_kv: torch.Tensor,
        *,
        ubatch_id: int | None = None,
        checked: bool = False,
    ) -> None:
        """``gathered_kv [N*T, D]`` = every rank's ``local_kv [T, D]``, rank-major (in place).

        Same result as ``all_gather_into_tensor(gathered_kv, local_kv)``; NaN after a timed-out
        wait. ``checked=True``: the caller has just found ``unsupported_reason`` to be ``None``.

        Raises:
            ValueError: ``unsupported_reason(gathered_kv, local_kv)`` is not ``None``, or the
                ubatch is out of range.
            RuntimeError: the workspace is closed, or grad mode is on and a tensor requires
                grad.
            DirectProtocolError: an earlier call's bounded wait timed out.
        """
        refuse_grad("DirectDCPKVGatherWorkspace.gather", gathered_kv=gathered_kv, local_kv=local_kv)
        self._before_call()
        self._refuse(None if checked else self.unsupported_reason(gathered_kv, local_kv))
        check_no_overlap(self.name, "gathered_kv", gathered_kv=gathered_kv, local_kv=local_kv)
        u = self._resolve_ubatch(ubatch_id)
        if check_state.enabled:  # check mode: the ranks' calls agree
            check_tensor_agreement(self.name, self.cp_group, "local_kv", local_kv)
        # Checked above (N*T <= capacity included): the launches skip the checks.
        self.publish(local_kv, ubatch_id=u, validate=False)
        self.wait(gathered_kv, ubatch_id=u, validate=False)
