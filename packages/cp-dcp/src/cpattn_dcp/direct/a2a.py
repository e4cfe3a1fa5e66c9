"""Direct DCP A2A LSE-reduce over symmetric memory: each rank writes every destination's head
slice of its partial output and LSE straight into that rank's receive buffer, signals, waits
(bounded) and combines the N partials (``dcp_a2a_lse_reduce``'s result). Two launches, no host
sync (CUDA-graph capturable); protocol: ``cpattn_dcp.kernels.direct_protocol``.
"""

from __future__ import annotations

from typing import Any

import torch

from cpattn_common.alloc import empty_output
from cpattn_common.checks import check_bool, check_state, check_tensors
from cpattn_common.dispatch import refuse_grad
from cpattn_dcp.direct._base import (
    DEFAULT_ERROR_CHECK_INTERVAL,
    DEFAULT_MAX_SPINS,
    MAX_PUBLISH_PROGRAMS,
    DirectWorkspaceBase,
    as_int,
    check_16b_aligned,
    check_16b_rows,
    checked_sizes,
    next_pow2,
    on_workspace_device,
)
from cpattn_dcp.kernels.direct_a2a import _direct_a2a_combine_kernel, _direct_a2a_publish_kernel
from cpattn_dcp.ops._collective_common import check_combine_agreement
from cpattn_dcp.ops._common import NATIVE_INDEX_DTYPES, check_mask_args

__all__ = ["DIRECT_A2A_DTYPES", "DirectDCPA2AWorkspace"]

#: Output dtypes the direct A2A supports.
DIRECT_A2A_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
_LSE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SMALL_BATCH_PROGRAMS = 64  # below this many (row, head-block) programs, split D as well


def _widened(dtype: torch.dtype) -> torch.dtype:
    """The index dtype the publish kernel reads for ``dtype`` (not int32 / int64): int64 for
    the 32- and 64-bit unsigned ones, whose values int32 would wrap, else int32."""
    return torch.int64 if dtype in (torch.uint32, torch.uint64) else torch.int32


class DirectDCPA2AWorkspace(DirectWorkspaceBase):
    """Direct symmetric-memory A2A LSE-reduce workspace of one DCP group and geometry
    (construction is collective: every rank, same arguments, same order).

    Buffers per rank: ``recv_out [U, 2, N, T_max, H_r, D]`` (``dtype``),
    ``recv_lse [U, 2, N, T_max, H_r]`` fp32, ``recv_signal [U, 2, N]`` int64.

    Args:
        group / device: the DCP group and the buffers' device.
        max_num_tokens: row capacity T_max of one call.
        heads_per_rank / head_dim: H_r, the heads each rank owns after the combine (the input
            has N*H_r), and D.
        dtype: output dtype, float16 or bfloat16.
        num_ubatches: micro-batch slots (``cpattn_common.ubatch``).
        max_spins / error_check_interval: see ``DirectWorkspaceBase``.

    Raises:
        ValueError: unsupported dtype, sizes < 1, rows that are not 16-byte multiples, fewer
            than two ranks, or ``max_spins`` / ``error_check_interval`` out of range.
        TypeError: a size that is not an int.
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
        *,
        max_spins: int = DEFAULT_MAX_SPINS,
        error_check_interval: int = DEFAULT_ERROR_CHECK_INTERVAL,
    ) -> None:
        name = "Direct DCP A2A"
        t_max, h_r, d, num_ubatches = checked_sizes(
            name,
            max_num_tokens=max_num_tokens,
            heads_per_rank=heads_per_rank,
            head_dim=head_dim,
            num_ubatches=num_ubatches,
        )
        if dtype not in DIRECT_A2A_DTYPES:
            raise ValueError(f"{name} does not support {dtype}; supported: float16, bfloat16")
        check_16b_rows(name, dtype, head_dim=d)
        super().__init__(
            name, group, device, num_ubatches, max_spins=max_spins,
            error_check_interval=error_check_interval,
        )  # fmt: skip
        self.max_num_tokens, self.heads_per_rank, self.head_dim, self.dtype = t_max, h_r, d, dtype
        n = self.world_size
        self._init_buffers()
        self.recv_out, self._out_ptrs = self._allocate((2, n, t_max, h_r, d), dtype)
        self.recv_lse, self._lse_ptrs = self._allocate((2, n, t_max, h_r), torch.float32)
        self.recv_signal, self._sig_ptrs = self._allocate((2, n), torch.int64)
        self._block_hd = min(next_pow2(h_r * d), 4096)
        self._block_h_pub = next_pow2(h_r)
        # Combine tiling: one program per (row, 16 heads) over all of D; small batches (fewer
        # than _SMALL_BATCH_PROGRAMS such programs) split heads and D finer.
        self._block_h = min(next_pow2(h_r), 16)
        self._block_d = min(next_pow2(d), max(16, 2048 // self._block_h))
        self._block_h_small = min(next_pow2(h_r), 4)
        self._block_d_small = min(next_pow2(d), 128)
        self._n_pow2 = next_pow2(n)
        # Per-ubatch launch arguments that never change (fewer host operations per call).
        self._pub_static: list[dict[str, Any]] = [
            {
                "peer_out_ptrs": self._out_ptrs[u], "peer_lse_ptrs": self._lse_ptrs[u],
                "peer_sig_ptrs": self._sig_ptrs[u], "counter_ptr": self._pub_counter[u],
                "epoch_ptr": self.epoch[u:], "err_ptr": self._error[u],
                "grp_err_ptr": self._group_failure, "T_MAX": t_max, "rank": self.rank, "N": n,
                "H_R": h_r, "D": d, "BLOCK_HD": self._block_hd, "BLOCK_H": self._block_h_pub,
            }
            for u in range(num_ubatches)
        ]  # fmt: skip
        self._comb_static: list[dict[str, Any]] = [
            {
                "recv_out_ptr": self.recv_out[u], "recv_lse_ptr": self.recv_lse[u],
                "sig_ptr": self.recv_signal[u], "epoch_ptr": self.epoch[u:],
                "done_ptr": self._wait_done[u:], "err_ptr": self._error[u],
                "grp_err_ptr": self._group_failure, "T_MAX": t_max, "N": n, "N_POW2": self._n_pow2,
                "H_R": h_r, "D": d,
            }
            for u in range(num_ubatches)
        ]  # fmt: skip

    @property
    def num_heads(self) -> int:
        """Heads of the input, N * H_r."""
        return self.world_size * self.heads_per_rank

    def unsupported_reason(
        self, partial_output: torch.Tensor, partial_lse: torch.Tensor, *, layout: bool = True
    ) -> str | None:
        """Why this call cannot take the direct path (``None``: it can): too many rows, another
        geometry or dtype, or (unless ``layout=False``) a layout of this rank's tensors that a
        packed copy mends: misaligned or unpacked rows, torch's negative bit. ``TypeError``
        for a non-tensor argument."""
        check_tensors(self.name, partial_output=partial_output, partial_lse=partial_lse)
        if partial_output.dim() != 3 or partial_lse.dim() != 2:
            return "expected partial_output [T, H, D] and partial_lse [T, H]"
        t, h, d = partial_output.shape
        if t > self.max_num_tokens:
            return f"partial_output: {t} rows exceed the workspace capacity {self.max_num_tokens}"
        if h != self.num_heads or d != self.head_dim:
            return (
                f"partial_output shape [T, {h}, {d}] != workspace geometry "
                f"[T, {self.num_heads}, {self.head_dim}]"
            )
        if partial_output.dtype != self.dtype:
            return f"partial_output dtype {partial_output.dtype} != workspace dtype {self.dtype}"
        if partial_lse.dtype not in _LSE_DTYPES:
            return f"partial_lse dtype {partial_lse.dtype} is not fp32/fp16/bf16"
        for name, t_ in (("partial_output", partial_output), ("partial_lse", partial_lse)):
            if t_.device != self.device:
                return f"{name} on {t_.device}, workspace on {self.device}"
        if not layout or t == 0:
            return None
        if partial_output.is_neg() or partial_lse.is_neg():
            return "partial_output or partial_lse has torch's negative bit (a lazily negated view)"
        if partial_output.stride(2) != 1:
            return "partial_output must have a unit stride on its last dim"
        return check_16b_aligned(
            partial_output, "partial_output", (partial_output.stride(0), partial_output.stride(1))
        )

    def _validate(
        self, partial_output: torch.Tensor, partial_lse: torch.Tensor,
        seq_lens: torch.Tensor | None, query_start_loc: torch.Tensor | None,
    ) -> None:  # fmt: skip
        check_tensors(self.name, partial_output=partial_output, partial_lse=partial_lse)
        if partial_output.dim() != 3 or partial_lse.dim() != 2:
            raise ValueError(
                f"{self.name}: expected partial_output [T, H, D] and partial_lse [T, H], got "
                f"{tuple(partial_output.shape)} and {tuple(partial_lse.shape)}"
            )
        if tuple(partial_lse.shape) != tuple(partial_output.shape[:2]):
            raise ValueError(
                f"{self.name}: partial_lse {tuple(partial_lse.shape)} does not match "
                f"partial_output {tuple(partial_output.shape)} in [T, H]"
            )
        if not partial_lse.dtype.is_floating_point:
            raise TypeError(
                f"{self.name}: partial_lse must be floating point, got {partial_lse.dtype}"
            )
        self._refuse(self.unsupported_reason(partial_output, partial_lse))
        # The check every op taking these arguments applies (same errors as the NCCL path).
        check_mask_args(seq_lens, query_start_loc, self.device, partial_lse.shape[0])

    @on_workspace_device
    def publish(
        self,
        partial_output: torch.Tensor,
        partial_lse: torch.Tensor,
        seq_lens: torch.Tensor | None = None,
        query_start_loc: torch.Tensor | None = None,
        *,
        ubatch_id: int | None = None,
        validate: bool = True,
    ) -> None:
        """First launch of ``lse_reduce``: write this rank's slices into every peer and signal
        them (separate so simulated ranks of one process can all publish before any wait)."""
        if validate:
            refuse_grad(
                "DirectDCPA2AWorkspace.publish",
                partial_output=partial_output,
                partial_lse=partial_lse,
            )
            self._before_call()
            self._validate(partial_output, partial_lse, seq_lens, query_start_loc)
        u = self._resolve_ubatch(ubatch_id)
        t = partial_output.shape[0]
        if t == 0:
            return
        has_mask = seq_lens is not None and query_start_loc is not None
        if seq_lens is not None and query_start_loc is not None:
            # The kernel reads int32/int64 indices: other integer dtypes are widened on the
            # device (uint32 / uint64 to int64, which int32 would wrap).
            seq_lens, query_start_loc = (
                (x if x.dtype in NATIVE_INDEX_DTYPES else x.to(_widened(x.dtype))).contiguous()
                for x in (seq_lens, query_start_loc)
            )
        num_seqs = seq_lens.numel() if seq_lens is not None else 0
        num_pub = min(t, MAX_PUBLISH_PROGRAMS)
        _direct_a2a_publish_kernel[(self.world_size, num_pub)](
            **self._pub_static[u], out_ptr=partial_output, stride_out_t=partial_output.stride(0),
            stride_out_h=partial_output.stride(1), stride_out_d=partial_output.stride(2),
            lse_ptr=partial_lse, stride_lse_t=partial_lse.stride(0),
            stride_lse_h=partial_lse.stride(1),
            seq_lens_ptr=seq_lens if seq_lens is not None else partial_lse,
            qsl_ptr=query_start_loc if query_start_loc is not None else partial_lse,
            num_seqs=num_seqs, T=t, NUM_PUB=num_pub, HAS_MASK=has_mask,
            NUM_SEQS_POW2=next_pow2(num_seqs),
        )  # fmt: skip

    @on_workspace_device
    def wait_and_combine(
        self,
        num_tokens: int,
        *,
        is_lse_base_on_e: bool = True,
        return_lse: bool = False,
        ubatch_id: int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Second launch of ``lse_reduce``: bounded wait for all sources, then the combine.

        Returns ``out [num_tokens, H_r, D]`` and, with ``return_lse``, the combined LSE
        ``[num_tokens, H_r]`` fp32; NaN after a timeout (``DirectProtocolError`` later). Raises
        ``RuntimeError`` (closed workspace), ``ValueError`` (``num_tokens`` or the ubatch out of
        range), ``TypeError`` (a non-bool flag).
        """
        is_lse_base_on_e = check_bool("is_lse_base_on_e", is_lse_base_on_e)
        return_lse = check_bool("return_lse", return_lse)
        if self._closed:  # one attribute read: the kernel would read released peer memory
            raise RuntimeError(f"{self.name}: workspace is closed")
        u = self._resolve_ubatch(ubatch_id)
        t = as_int(f"{self.name}: num_tokens", num_tokens)
        if not 0 <= t <= self.max_num_tokens:
            raise ValueError(f"{self.name}: num_tokens {t} not in [0, {self.max_num_tokens}]")
        h_r, d = self.heads_per_rank, self.head_dim
        out = empty_output((t, h_r, d), dtype=self.dtype, device=self.device)
        lse = (
            empty_output((t, h_r), dtype=torch.float32, device=self.device) if return_lse else None
        )
        if t > 0:
            block_h, block_d = self._block_h, self._block_d
            n_hb = -(-h_r // block_h)
            if t * n_hb < _SMALL_BATCH_PROGRAMS:
                block_h, block_d = self._block_h_small, self._block_d_small
                n_hb = -(-h_r // block_h)
                d_per_prog, n_db, num_warps = block_d, -(-d // block_d), 2
            else:
                d_per_prog, n_db, num_warps = -(-d // block_d) * block_d, 1, 4
            _direct_a2a_combine_kernel[(t, n_hb, n_db)](
                **self._comb_static[u], res_ptr=out, stride_res_t=out.stride(0),
                stride_res_h=out.stride(1), res_lse_ptr=lse if lse is not None else out,
                stride_res_lse_t=lse.stride(0) if lse is not None else 0, max_spins=self.max_spins,
                num_programs=t * n_hb * n_db, BLOCK_H=block_h, BLOCK_D=block_d,
                D_PER_PROG=d_per_prog, num_warps=num_warps, IS_BASE_E=is_lse_base_on_e,
                HAS_LSE_OUT=lse is not None,
            )  # fmt: skip
            self._after_call()
        return (out, lse) if lse is not None else out

    @on_workspace_device
    def lse_reduce(
        self,
        partial_output: torch.Tensor,
        partial_lse: torch.Tensor,
        is_lse_base_on_e: bool = True,
        seq_lens: torch.Tensor | None = None,
        query_start_loc: torch.Tensor | None = None,
        *,
        return_lse: bool = False,
        ubatch_id: int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Combine this rank's partial attention with all peers' into its own heads.

        Args:
            partial_output: ``[T, H, D]`` (H = N*H_r), workspace dtype; last dim unit stride;
                16-byte-aligned base and row strides.
            partial_lse: ``[T, H]`` LSE (fp32/fp16/bf16, any strides).
            is_lse_base_on_e: LSE base (True: e, False: 2).
            seq_lens / query_start_loc: optional ``[R]`` local KV lengths and ``[R+1]`` query
                offsets: empty-shard and padding rows contribute nothing.
            return_lse: also return the combined LSE ``[T, H_r]`` fp32.
            ubatch_id: micro-batch slot (default ``cpattn_common.current_ubatch_id()``).

        Returns:
            ``out [T, H_r, D]`` (rank r holds global heads ``[r*H_r, (r+1)*H_r)``), plus the
            LSE with ``return_lse``.

        Raises:
            ValueError / TypeError: bad shapes, dtypes, alignment, ``T > max_num_tokens``,
                ubatch out of range; bad ``seq_lens``/``query_start_loc`` (as
                ``dcp_a2a_lse_reduce``); a non-bool flag.
            RuntimeError: grad mode is on and an input requires grad, or the workspace is
                closed.
            DirectProtocolError: an earlier call's bounded wait timed out.
        """
        # Everything is checked before the publish: a call must not stop half made.
        is_lse_base_on_e = check_bool("is_lse_base_on_e", is_lse_base_on_e)
        return_lse = check_bool("return_lse", return_lse)
        refuse_grad(
            "DirectDCPA2AWorkspace.lse_reduce",
            partial_output=partial_output,
            partial_lse=partial_lse,
        )
        self._before_call()
        self._validate(partial_output, partial_lse, seq_lens, query_start_loc)
        u = self._resolve_ubatch(ubatch_id)
        if check_state.enabled:  # check mode: the ranks' calls agree
            check_combine_agreement(self.name, self.cp_group, partial_output, partial_lse,
                                    return_lse, is_lse_base_on_e, seq_lens)  # fmt: skip
        self.publish(
            partial_output, partial_lse, seq_lens, query_start_loc, ubatch_id=u, validate=False
        )
        return self.wait_and_combine(
            partial_output.shape[0],
            is_lse_base_on_e=is_lse_base_on_e,
            return_lse=return_lse,
            ubatch_id=u,
        )
