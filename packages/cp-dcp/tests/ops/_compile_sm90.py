"""Compile the DCP kernels for sm_90 with Triton's bundled ptxas (no GPU needed).

Run as a script (outside TRITON_INTERPRET) by test_kernels_compile.py. The ops are called on
CPU tensors of the benchmark shapes with every launch replaced by a recorder, so every
kernel is compiled with exactly the arguments, tiles and specialisation (pointer 16-byte
alignment, ints == 1 or divisible by 16) that a GPU launch of the same call would use.
Prints one JSON object: case name -> kernel -> global load/store instruction counts.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from functools import partial
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import cpattn_common.launch as launch_mod
import cpattn_dcp.ops.a2a_combine as a2a_mod
import cpattn_dcp.ops.correct_attn_out as correct_mod
import cpattn_dcp.ops.mask_empty_shards as mask_mod

TARGET = GPUTarget("cuda", 90, 32)
_OPTIONS = {"num_warps", "num_stages"}
_TYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.int32: "i32",
    torch.int64: "i64",
}


def _count(ptx: str) -> dict[str, dict[str, int]]:
    return {
        # Whole mnemonics, eviction hints included (``ld.global.L1::evict_first.v4.b32``).
        "ld": dict(Counter(re.findall(r"ld\.global[\.\w:]*", ptx))),
        "st": dict(Counter(re.findall(r"st\.global[\.\w:]*", ptx))),
    }


def compile_like_launch(kernel: Any, kwargs: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Compile ``kernel`` as Triton's JIT would specialise a launch with ``kwargs``."""
    names = kernel.arg_names
    constexpr_names = {p.name for p in kernel.params if p.is_constexpr}
    sig: dict[str, str] = {}
    consts: dict[str, Any] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for i, name in enumerate(names):
        v = kwargs[name]
        if name in constexpr_names:
            sig[name], consts[name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[name] = "*" + _TYPES[v.dtype]
            if v.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            if v == 1:
                sig[name], consts[name] = "constexpr", 1
            else:
                sig[name] = "i32" if -(2**31) <= v < 2**31 else "i64"
                if v % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            raise TypeError(f"{name}: {type(v).__name__}")
    opts = {k: kwargs[k] for k in _OPTIONS if k in kwargs}
    compiled = triton.compile(ASTSource(kernel, sig, consts, attrs), target=TARGET, options=opts)
    return _count(compiled.asm["ptx"])


_recorded: list[tuple[Any, dict[str, Any]]] = []


def _record(spec: Any, grid: tuple[int, ...], *args: Any) -> None:
    kwargs = dict(zip(spec.kernel.arg_names, args, strict=False))
    kwargs.update(spec.constexprs)
    _recorded.append((spec.kernel, kwargs))


# Every op launches through ``Specialization``: record instead of launching.
launch_mod.Specialization.__call__ = _record  # type: ignore[method-assign]


def _run(name: str, fn: Any, out: dict[str, Any]) -> None:
    _recorded.clear()
    fn()
    out[name] = {k.fn.__name__: compile_like_launch(k, kw) for k, kw in _recorded}


def main() -> None:
    out: dict[str, Any] = {}
    g = torch.Generator().manual_seed(0)
    shapes = [(4096, 64, 128, 2), (4096, 64, 128, 8), (4096, 128, 512, 4), (1, 128, 512, 4)]
    if len(sys.argv) > 1 and sys.argv[1] == "--quick":
        shapes = shapes[:1]
    for b, h, d, n in shapes:
        for dt in (torch.bfloat16, torch.float32) if (b, h) == (4096, 64) else (torch.bfloat16,):
            tag = f"{b}-{h}-{d}-{n}-{_TYPES[dt]}"
            x = torch.randn(b, h, d, generator=g).to(dt)
            lse = torch.randn(b, h, generator=g)
            lses = torch.randn(n, b, h, generator=g)
            sl = torch.ones(b, dtype=torch.int32)
            qsl = torch.arange(b + 1, dtype=torch.int32)
            _run(f"correct-{tag}", partial(correct_mod.correct_attn_out, x, lses, n // 2), out)
            _run(
                f"pack-{tag}",
                partial(a2a_mod.a2a_pack, x, lse, n, seq_lens=sl, query_start_loc=qsl),
                out,
            )
            recv = torch.empty(n, b, h // n, a2a_mod.a2a_record_width(d, dt), dtype=dt)
            _run(
                f"unpack-{tag}",
                partial(a2a_mod.a2a_unpack_combine, recv, head_dim=d, return_lse=True),
                out,
            )
    # Odd head dim: the general correct kernel with 8-byte rows, the generic pack fallback.
    x = torch.randn(64, 16, 100, generator=g).to(torch.bfloat16)
    lses = torch.randn(2, 64, 16, generator=g)
    _run("correct-64-16-100-2-bf16", lambda: correct_mod.correct_attn_out(x, lses, 1), out)
    # A2A pack fallbacks: odd D (2-byte-aligned input rows, LSE as two 16-bit lanes), input
    # one element past a 16-byte boundary, strided head dim. Blocks stay 16-byte aligned.
    x = torch.randn(4096, 64, 127, generator=g).to(torch.bfloat16)
    _run(
        "packfallback-odd-4096-64-127-2-bf16",
        lambda: a2a_mod.a2a_pack(x, torch.randn(4096, 64), 2),
        out,
    )
    flat = torch.randn(4096 * 64 * 128 + 1, generator=g).to(torch.bfloat16)
    x = flat[1:].view(4096, 64, 128)
    _run(
        "packfallback-shifted-4096-64-128-2-bf16",
        lambda: a2a_mod.a2a_pack(x, torch.randn(4096, 64), 2),
        out,
    )
    x = torch.randn(1024, 64, 256, generator=g).to(torch.bfloat16)[..., ::2]
    _run(
        "packfallback-dstride-1024-64-128-2-bf16",
        lambda: a2a_mod.a2a_pack(x, torch.randn(1024, 64), 2),
        out,
    )
    # AG+RS correction into the grouped reduce-scatter layout.
    x = torch.randn(256, 64, 128, generator=g).to(torch.bfloat16)
    lses = torch.randn(4, 256, 64, generator=g)
    buf = torch.empty(4, 256, 16, 128, dtype=torch.bfloat16)
    lse_out = torch.empty(256, 16)
    _run(
        "correctgrouped-256-64-128-4-bf16",
        lambda: correct_mod.launch_correct(
            x, buf, (16 * 128, 256 * 16 * 128, 128, 1), 16, lses, lse_out, 16, 1, True
        ),
        out,
    )
    # Empty-shard mask: direct count (few requests) and binary search (many).
    for r in (20, 1000):
        lse = torch.randn(4096, 64)
        sl = torch.ones(r, dtype=torch.int32)
        qsl = torch.arange(r + 1, dtype=torch.int32)
        _run(f"mask-{r}", partial(mask_mod.mask_dcp_empty_shards_, lse, sl, qsl), out)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
