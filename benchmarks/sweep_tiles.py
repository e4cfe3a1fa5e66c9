"""Tile-size sweep for the memory-bound kernels at one shape (dev tool; GPU only).

Varies the module-level tile knobs of cp-dcp / cp-common (bytes per program, row cap, merge
tile) and prints each kernel's fraction of the copy bandwidth, so a default can be chosen from
measurements rather than guesses.

    PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src python3 benchmarks/sweep_tiles.py
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable
from types import ModuleType

import torch
import triton.testing

import cpattn_common.ops.merge_attn_states as merge_mod
import cpattn_dcp.ops._common as common_mod
import cpattn_dcp.ops.a2a_combine as a2a_mod
import cpattn_dcp.ops.correct_attn_out as correct_mod


def _clear_caches(*modules: ModuleType) -> None:
    for mod in modules:
        for value in vars(mod).values():
            clear = getattr(value, "cache_clear", None)
            if callable(clear):
                clear()


def _bench(fn: Callable[[], object]) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _sweep_shape(b: int, h: int, d: int, copy_bps: float, dev: torch.device) -> None:
    mods = (common_mod, a2a_mod, correct_mod, merge_mod)
    tile_defaults = common_mod.tile_config.__wrapped__.__defaults__  # type: ignore[attr-defined]
    max_r_default = common_mod._MAX_BLOCK_R  # type: ignore[attr-defined]
    inflight_default = a2a_mod._UNPACK_INFLIGHT_BYTES  # type: ignore[attr-defined]
    big_tile_default = merge_mod._BIG_TILE  # type: ignore[attr-defined]
    for n in (2, 4, 8):
        _sweep_n(b, h, d, n, copy_bps, dev, mods)
        torch.cuda.empty_cache()
    common_mod.tile_config.__wrapped__.__defaults__ = tile_defaults  # type: ignore[attr-defined]
    common_mod._MAX_BLOCK_R = max_r_default  # type: ignore[attr-defined]
    a2a_mod._UNPACK_INFLIGHT_BYTES = inflight_default  # type: ignore[attr-defined]
    merge_mod._BIG_TILE = big_tile_default  # type: ignore[attr-defined]


def _sweep_n(
    b: int, h: int, d: int, n: int, copy_bps: float, dev: torch.device, mods: tuple[ModuleType, ...]
) -> None:
    tile_defaults = common_mod.tile_config.__wrapped__.__defaults__  # type: ignore[attr-defined]
    max_r_default = common_mod._MAX_BLOCK_R  # type: ignore[attr-defined]
    inflight_default = a2a_mod._UNPACK_INFLIGHT_BYTES  # type: ignore[attr-defined]
    big_tile_default = merge_mod._BIG_TILE  # type: ignore[attr-defined]
    s = 2  # bf16
    outs = torch.randn(n, b, h, d, device=dev, dtype=torch.bfloat16)
    lses = torch.randn(n, b, h, device=dev)
    out = outs[0].clone()
    lse = lses[0].clone()
    hr = h // n
    rec = a2a_mod.a2a_record_width(d, torch.bfloat16)
    recv = torch.randn(n, b, hr, rec, device=dev).to(torch.bfloat16)
    a2a_mod.a2a_buffer_views(recv, d)[1].zero_()  # LSE lanes: finite bits

    def run(name: str, fn: Callable[[], object], nbytes: int, knobs: str) -> None:
        _clear_caches(*mods)
        try:
            ratio = nbytes / (_bench(fn) * 1e-3) / copy_bps
            print(f"H={h} D={d} N={n} {name:8s} {knobs}: {ratio:.3f}", flush=True)
        except Exception as exc:  # a configuration the kernel rejects
            print(f"H={h} D={d} N={n} {name:8s} {knobs}: {type(exc).__name__}", flush=True)

    for target, max_r in itertools.product((8192, 16384, 32768, 65536), (64, 256)):
        common_mod.tile_config.__wrapped__.__defaults__ = (target,)  # type: ignore[attr-defined]
        common_mod._MAX_BLOCK_R = max_r  # type: ignore[attr-defined]
        knobs = f"target={target} max_r={max_r}"
        run(
            "correct",
            lambda: correct_mod.correct_attn_out(out, lses, 0),
            2 * b * h * d * s,
            knobs,
        )
        run("pack", lambda: a2a_mod.a2a_pack(out, lse, n), 2 * b * h * d * s + b * h * 8, knobs)
    common_mod.tile_config.__wrapped__.__defaults__ = tile_defaults  # type: ignore[attr-defined]
    for inflight, max_r in itertools.product((16384, 32768, 65536, 131072), (64, 256)):
        a2a_mod._UNPACK_INFLIGHT_BYTES = inflight  # type: ignore[attr-defined]
        common_mod._MAX_BLOCK_R = max_r  # type: ignore[attr-defined]
        run(
            "unpack",
            lambda: a2a_mod.a2a_unpack_combine(recv, head_dim=d),
            (n + 1) * b * hr * d * s,
            f"inflight={inflight} max_r={max_r}",
        )
    a2a_mod._UNPACK_INFLIGHT_BYTES = inflight_default  # type: ignore[attr-defined]
    common_mod._MAX_BLOCK_R = max_r_default  # type: ignore[attr-defined]
    for big_tile in (2048, 4096, 8192):
        merge_mod._BIG_TILE = big_tile  # type: ignore[attr-defined]
        run(
            "merge",
            lambda: merge_mod.merge_attn_states(outs, lses),
            (n + 1) * b * h * d * s,
            f"tile={big_tile}",
        )
    merge_mod._BIG_TILE = big_tile_default  # type: ignore[attr-defined]


def _copy_bps(dev: torch.device) -> float:
    src = torch.randn(1 << 28, device=dev)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / (_bench(lambda: dst.copy_(src)) * 1e-3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=4096)
    args = parser.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    copy_bps = _copy_bps(dev)
    print(f"copy {copy_bps / 1e12:.3f} TB/s; B={args.batch} bf16")
    for h, d in ((64, 128), (128, 512)):
        _sweep_shape(args.batch, h, d, copy_bps, dev)


if __name__ == "__main__":
    main()
