"""Compile the direct-path kernels for sm_90 with Triton's bundled ptxas (no GPU needed).

Run as a script (outside TRITON_INTERPRET) by test_direct_compile.py; prints one JSON object:
kernel variant -> the sorted set of global load/store/atomic instruction forms in its PTX.
"""

from __future__ import annotations

import json
import re
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from cpattn_dcp.kernels.direct_a2a import _direct_a2a_combine_kernel, _direct_a2a_publish_kernel
from cpattn_dcp.kernels.direct_gather import (
    _direct_gather_publish_kernel,
    _direct_gather_wait_kernel,
)

TARGET = GPUTarget("cuda", 90, 32)
PTR_TYPES = {
    "out_ptr": "*bf16", "lse_ptr": "*fp32", "seq_lens_ptr": "*i32", "qsl_ptr": "*i32",
    "peer_out_ptrs": "*i64", "peer_lse_ptrs": "*i64", "peer_sig_ptrs": "*i64",
    "peer_dst_ptrs": "*i64", "counter_ptr": "*i32", "epoch_ptr": "*i64", "done_ptr": "*i32",
    "err_ptr": "*i64", "grp_err_ptr": "*i64", "sig_ptr": "*i64", "recv_out_ptr": "*bf16",
    "recv_lse_ptr": "*fp32", "res_ptr": "*bf16", "res_lse_ptr": "*fp32", "src_ptr": "*bf16",
    "slot_ptr": "*bf16", "dst_ptr": "*bf16",
}  # fmt: skip


def _compile(
    fn: Any,
    consts: dict[str, Any],
    div16: list[str],
    num_warps: int = 4,
    ptr_types: dict[str, str] | None = None,
) -> list[str]:
    names = fn.arg_names
    types = {**PTR_TYPES, **(ptr_types or {})}
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16 if n in names}
    kernel = triton.compile(
        ASTSource(fn, sig, consts, attrs), target=TARGET, options={"num_warps": num_warps}
    )
    ptx = kernel.asm["ptx"]
    return sorted(set(re.findall(r"(?:ld|st|atom)\.global[\.\w]*", ptx)))


def main() -> None:
    # What the JIT marks 16-divisible on a real launch: aligned pointers, 16-multiple ints.
    div = [n for n in PTR_TYPES] + [
        "stride_out_t",
        "stride_out_h",
        "stride_res_t",
        "stride_res_h",
        "T_MAX",
    ]
    div += ["stride_src_t", "dst_parity_stride", "dst_rank_stride", "dst_row_stride"]
    div += ["slot_parity_stride", "num_elems"]
    out: dict[str, list[str]] = {}
    for mask in (False, True):
        out[f"a2a_publish_mask{int(mask)}"] = _compile(
            _direct_a2a_publish_kernel,
            {
                "stride_out_d": 1,
                "N": 4,
                "H_R": 16,
                "D": 512,
                "BLOCK_HD": 4096,
                "BLOCK_H": 16,
                "HAS_MASK": mask,
                "NUM_SEQS_POW2": 8,
            },
            div,
        )
    # (large-batch tiling, 4 warps) and (small-batch tiling, 2 warps), as a2a.py launches them
    tilings = ((True, False, 8, 256, 768, 4), (False, True, 4, 128, 128, 2))
    for base_e, lse_out, bh, bd, dpp, nw in tilings:
        out[f"a2a_combine_e{int(base_e)}_lse{int(lse_out)}"] = _compile(
            _direct_a2a_combine_kernel,
            {
                "N": 8,
                "N_POW2": 8,
                "H_R": 6,
                "D": 576,
                "BLOCK_H": bh,
                "BLOCK_D": bd,
                "D_PER_PROG": dpp,
                "IS_BASE_E": base_e,
                "HAS_LSE_OUT": lse_out,
            },
            div,
            nw,
        )
    out["gather_publish"] = _compile(
        _direct_gather_publish_kernel, {"N": 4, "W": 3456, "BLOCK_W": 4096}, div
    )
    # As q_gather.py (no copy, the destination an int16 view for the NaN) and kv_gather.py
    # (bf16 copy) launch it, plus an fp8 KV copy: the NaN stores go through an integer pointer.
    waits = (
        ("gather_wait_copy0", False, 1024, 0x7FC0, {"dst_ptr": "*i16"}),
        ("gather_wait_copy1", True, 2048, 0x7FC0, None),
        (
            "gather_wait_copy1_fp8",
            True,
            2048,
            0x7F,
            {"slot_ptr": "*fp8e4nv", "dst_ptr": "*fp8e4nv"},
        ),
    )
    for name, copy, block, nan, types in waits:
        out[name] = _compile(
            _direct_gather_wait_kernel,
            {"N": 4, "N_POW2": 4, "HAS_COPY": copy, "BLOCK": block, "NAN_BITS": nan},
            div,
            ptr_types=types,
        )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
