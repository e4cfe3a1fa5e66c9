"""Compile every DCP kernel for sm_90 with Triton's bundled ptxas (no GPU needed).

Run as a script (outside TRITON_INTERPRET) by test_kernels_compile.py; prints one JSON object:
kernel name -> global load/store instruction counts of its PTX.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from cpattn_dcp.kernels.a2a import _a2a_pack_fwd_kernel, _a2a_unpack_combine_fwd_kernel
from cpattn_dcp.kernels.correct_attn_out import _correct_attn_out_fwd_kernel
from cpattn_dcp.kernels.empty_shards import _mask_empty_shards_kernel
from cpattn_dcp.ops._common import tile_config

TARGET = GPUTarget("cuda", 90, 32)


def _compile(
    fn: Any, types: dict[str, str], consts: dict[str, Any], div16: list[str], num_warps: int
) -> dict[str, dict[str, int]]:
    names = fn.arg_names
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
    kernel = triton.compile(
        ASTSource(fn, sig, consts, attrs), target=TARGET, options={"num_warps": num_warps}
    )
    ptx = kernel.asm["ptx"]
    return {
        "ld": dict(Counter(re.findall(r"ld\.global[\.\w]*", ptx))),
        "st": dict(Counter(re.findall(r"st\.global[\.\w]*", ptx))),
    }


def main() -> None:
    out: dict[str, Any] = {}
    for d, h, dt, n in [(512, 128, "bf16", 4), (128, 64, "bf16", 8), (576, 16, "fp16", 3)]:
        size = 2 if dt != "fp32" else 4
        p = 2 if size == 2 else 1
        br, bd, nw = tile_config(4096 * h, d, size, 16384)
        out[f"correct-{d}-{h}-{n}"] = _compile(
            _correct_attn_out_fwd_kernel,
            {"src_ptr": f"*{dt}", "dst_ptr": f"*{dt}", "lses_ptr": "*fp32", "lse_out_ptr": "*fp32"},
            {
                "stride_src_d": 1,
                "stride_dst_d": 1,
                "HEAD_DIM": d,
                "N_POW2": triton.next_power_of_2(n),
                "BLOCK_R": br,
                "BLOCK_D": bd,
                "IS_BASE_E": True,
                "HAS_LSE_OUT": True,
            },
            [
                *("src_ptr", "dst_ptr", "lses_ptr", "lse_out_ptr"),
                *("stride_src_b", "stride_src_h", "stride_dst_b", "stride_dst_g", "stride_dst_h"),
            ],
            nw,
        )
        out[f"pack-{d}-{h}-{n}"] = _compile(
            _a2a_pack_fwd_kernel,
            {
                "out_ptr": f"*{dt}",
                "lse_ptr": "*bf16",
                "send_ptr": f"*{dt}",
                "seq_lens_ptr": "*i32",
                "qsl_ptr": "*i32",
            },
            {
                "stride_out_d": 1,
                "HEAD_DIM": d,
                "PACK": p,
                "HAS_MASK": True,
                "SEARCH_STEPS": 7,
                "BLOCK_R": br,
                "BLOCK_D": bd,
            },
            ["out_ptr", "lse_ptr", "send_ptr", "stride_out_b", "stride_out_h"],
            nw,
        )
        br, bd, nw = tile_config(4096 * h // n, d, size, max(2048, 32768 // n))
        out[f"unpack-{d}-{h}-{n}"] = _compile(
            _a2a_unpack_combine_fwd_kernel,
            {"recv_ptr": f"*{dt}", "dst_ptr": f"*{dt}", "lse_out_ptr": "*fp32"},
            {
                "N": n,
                "N_POW2": triton.next_power_of_2(n),
                "HEAD_DIM": d,
                "PACK": p,
                "BLOCK_R": br,
                "BLOCK_D": bd,
                "IS_BASE_E": False,
                "HAS_LSE_OUT": True,
            },
            ["recv_ptr", "dst_ptr", "lse_out_ptr"],
            nw,
        )
    # SEARCH_STEPS 5: direct count over the boundaries; 10: binary search.
    for is_copy, steps in ((True, 5), (False, 10)):
        out[f"mask-copy{is_copy}-steps{steps}"] = _compile(
            _mask_empty_shards_kernel,
            {"src_ptr": "*fp32", "dst_ptr": "*fp32", "seq_lens_ptr": "*i32", "qsl_ptr": "*i64"},
            {
                "HAS_MASK": True,
                "IS_COPY": is_copy,
                "SEARCH_STEPS": steps,
                "BLOCK_B": 64,
                "BLOCK_H": 64,
            },
            ["src_ptr", "dst_ptr"],
            2,
        )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
