"""Kernel-variant and timing-method probe: one GPU run, printed figures (dev tool).

Sections:

* ``methods``: at B=4096 (bf16), each kernel's fraction of the copy bandwidth under two ways
  of emptying L2 before a timed call: ``triton.testing.do_bench``'s (zero-fill a 256 MB
  buffer: the last L2-full of those writes is still dirty when the timed kernel starts, and
  writing it back competes with the kernel) and a read-based flush (``cpattn_testing.bench
  .time_cold``: L2 left holding clean lines). Copies of several sizes are timed both ways
  too, so the effect on the ceiling itself is visible.
* ``decode``: CUDA-graph replay time per call at decode sizes, inputs L2-cold (32 rotating
  sets) and L2-warm (one set), against an empty kernel; ``merge-lazy`` is the merge kernel's
  gated variant requested explicitly (``eager=False``).
* ``--ab``: each module-level knob setting of ``_switches`` (first = shipped default), at
  B=4096 (read-flush timing) and B=1 / B=64 (warm graph replay).
* ``--mask``: ``mask_dcp_empty_shards_`` under each tile setting of ``_MASK_SETTINGS`` (rows
  per program, lanes of the request-count tile, warps, spreading over programs, int32 rows),
  graph replay over 32 rotating input sets, decode batches (one token per request) and two
  prefill-like batches; every setting's output is checked bit for bit against the eager
  baseline.
* ``--merge``: ``merge_attn_states`` at decode sizes under each ``_MERGE_SETTINGS`` entry
  (weight-gated or EAGER loads, warps of one-head programs), graph replay
  over 32 rotating input sets, checked against the shipped setting (relative norm error).
* ``--records``: the pack kernel writing records of other widths (16 / 32 / 128-byte
  multiples).
* ``--probe``: a few launches of each kernel, to run under ``ncu``.

    PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-testing/src \
        python3 benchmarks/variants.py

The figures it printed are summarised in docs/performance-notes.md.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import cpattn_common.ops.merge_attn_states as merge_mod
import cpattn_dcp.ops.a2a_combine as a2a_mod
import cpattn_dcp.ops.correct_attn_out as correct_mod
import cpattn_dcp.ops.mask_empty_shards as mask_mod
import cpattn_testing.bench as hb
from cpattn_common import merge_attn_states
from cpattn_common.launch_plans import clear_launch_plans
from cpattn_common.ops.merge_attn_states import merge_attn_states_fwd
from cpattn_dcp import correct_attn_out, mask_dcp_empty_shards_
from cpattn_dcp.ops._common import next_pow2, tile_config
from cpattn_dcp.ops.a2a_combine import a2a_pack, a2a_unpack_combine

sys.path.insert(0, str(Path(__file__).resolve().parent))
import eager_baselines as eb

Case = tuple[torch.Tensor, ...]


def _inputs(dev: torch.device, b: int, h: int, d: int, n: int, seed: int) -> Case:
    gen = torch.Generator(device=dev).manual_seed(seed)
    out = torch.randn(b, h, d, device=dev, generator=gen).to(torch.bfloat16)
    lse = torch.randn(b, h, device=dev, generator=gen)
    outs = torch.randn(n, b, h, d, device=dev, generator=gen).to(torch.bfloat16)
    lses = torch.randn(n, b, h, device=dev, generator=gen)
    seq_lens = torch.randint(0, 4, (b,), device=dev, generator=gen, dtype=torch.int32)
    qsl = torch.arange(b + 1, device=dev, dtype=torch.int32)
    recv = eb.a2a_pack_eager(out, lse, n)
    return out, lse, outs, lses, seq_lens, qsl, recv


def _ops(n: int, d: int) -> dict[str, Callable[[Case], object]]:
    return {
        "merge": lambda t: merge_attn_states(t[2], t[3]),
        "correct": lambda t: correct_attn_out(t[0], t[3], 0),
        "pack+mask": lambda t: a2a_pack(t[0], t[1], n, seq_lens=t[4], query_start_loc=t[5]),
        "pack": lambda t: a2a_pack(t[0], t[1], n),
        "unpack": lambda t: a2a_unpack_combine(t[6], head_dim=d, return_lse=True),
    }


def _nbytes(name: str, b: int, h: int, d: int, n: int) -> int:
    """Bytes as ``bench_kernels`` counts them (bf16: s = 2, P = 2)."""
    s, hr, meta = 2, h // n, b * 4 + (b + 1) * 4
    return {
        "merge": n * b * h * (d * s + 4) + b * h * (d * s + 4),
        "correct": 2 * b * h * d * s + n * b * h * 4 + b * h * 4,
        "pack+mask": b * h * (d * s + 4) + b * h * (d + 2) * s + meta,
        "pack": b * h * (d * s + 4) + b * h * (d + 2) * s,
        "unpack": b * h * (d + 2) * s + b * hr * (d * s + 4),
    }[name]


def methods(dev: torch.device, batch: int) -> None:
    _, big = hb.measure_copy_ceiling(dev)
    copy_bps = 2 * (1 << 30) / (big.median_ms * 1e-3)
    _, big_cold = hb.measure_copy_ceiling(dev, timer=hb.time_cold)
    print(
        f"copy 2.15 GB: do_bench {copy_bps / 1e12:.3f} TB/s, "
        f"read-flush {2 * (1 << 30) / (big_cold.median_ms * 1e-3) / 1e12:.3f} TB/s",
        flush=True,
    )
    for mb in (64, 128, 256, 512):
        src = torch.randn(mb * (1 << 20) // 4, device=dev).to(torch.bfloat16)
        dst = torch.empty_like(src)
        moved = 2 * src.numel() * 2
        copy = functools.partial(dst.copy_, src)
        zero = moved / (hb.time_do_bench(copy).median_ms * 1e-3)
        cold = moved / (hb.time_cold(copy).median_ms * 1e-3)
        print(
            f"copy {moved / 1e6:.0f} MB: do_bench {zero / copy_bps:.3f}  read-flush "
            f"{cold / copy_bps:.3f} (of the 2.15 GB do_bench copy)",
            flush=True,
        )
    for h, d in ((64, 128), (128, 512)):
        for n in (2, 4, 8):
            t = _inputs(dev, batch, h, d, n, n)
            line = f"H={h} D={d} N={n}:"
            for name, op in _ops(n, d).items():
                nbytes = _nbytes(name, batch, h, d, n)
                call = functools.partial(op, t)
                zero = nbytes / (hb.time_do_bench(call).median_ms * 1e-3)
                cold = nbytes / (hb.time_cold(call).median_ms * 1e-3)
                line += f"  {name} {zero / copy_bps:.3f}/{cold / copy_bps:.3f}"
            print(line + "  (do_bench / read-flush, fraction of copy)", flush=True)
            del t, call
            torch.cuda.empty_cache()


def _setter(mod: object, caches: list[Any], **values: object) -> Callable[[], None]:
    """A setter of the module attributes ``values`` of ``mod`` that also clears the memoised
    launch plans ``caches`` (``functools.lru_cache`` functions) that were derived from them,
    and the recorded launches (``cpattn_common.launch_plans``, on by default on a GPU
    machine: a recorded call replays its kernel and tile whatever the knobs say)."""

    def set_() -> None:
        for name, value in values.items():
            setattr(mod, name, value)
        for cache in caches:
            cache.cache_clear()
        clear_launch_plans()

    return set_


def _forced_warps(num_warps: int) -> Callable[..., tuple[int, int, int]]:
    """``tile_config`` with its ``num_warps`` replaced (0: ``tile_config`` itself)."""
    if not num_warps:
        return tile_config

    def forced(*a: int) -> tuple[int, int, int]:
        block_r, block_d, _ = tile_config(*a)
        return block_r, block_d, num_warps

    return forced


def _switches() -> dict[str, list[tuple[str, Callable[[], None]]]]:
    """Module-level knobs to compare, per op: (label, setter); the first entry is the default
    and every setter clears the memoised launch plans."""
    unpack_plans = [a2a_mod._unpack_config, a2a_mod._unpack_plan]
    correct_plans = [correct_mod._contig_spec, correct_mod._contig_plan]
    pack_plans = [a2a_mod._pack_plan]
    return {
        "unpack-evict": [
            (
                label,
                _setter(
                    a2a_mod,
                    unpack_plans,
                    _UNPACK_PAY_EVICT=policy,
                    _UNPACK_PAY_EVICT_MIN_N=min_n,
                    _UNPACK_PAY_EVICT_MAX_D=max_d,
                ),
            )
            for label, policy, min_n, max_d in (
                (
                    "shipped",
                    a2a_mod._UNPACK_PAY_EVICT,
                    a2a_mod._UNPACK_PAY_EVICT_MIN_N,
                    a2a_mod._UNPACK_PAY_EVICT_MAX_D,
                ),
                ("none", "", 0, 0),
                ("everywhere", "evict_first", 0, 1 << 30),
            )
        ],
        "unpack-onevec": [
            (label, _setter(a2a_mod, unpack_plans, _UNPACK_ONE_VECTOR_MIN_N=min_n))
            for label, min_n in (("shipped", 0), ("n8", 8), ("n4", 4))
        ],
        "unpack-warps": [
            (label, _setter(a2a_mod, unpack_plans, tile_config=_forced_warps(w)))
            for label, w in (("shipped", 0), ("w4", 4), ("w8", 8))
        ],
        "correct-warps": [
            (f"w{w}", _setter(correct_mod, correct_plans, _ROWS_MAX_WARPS=w)) for w in (8, 4)
        ],
        "correct": [
            (f"{nbytes // 1024}K", _setter(correct_mod, correct_plans, _CONTIG_TARGET_BYTES=nbytes))
            for nbytes in (16384, 8192, 32768)
        ],
        "pack+mask": [
            (f"{v}v/{w}w", _setter(a2a_mod, pack_plans, _PACK_BLOCK_V=v, _PACK_NUM_WARPS=w))
            for v, w in ((256, 2), (128, 1), (512, 4), (1024, 8))
        ],
        "pack-small": [
            (
                f"{v}v/{w}w",
                _setter(a2a_mod, pack_plans, _PACK_SMALL_BLOCK_V=v, _PACK_SMALL_NUM_WARPS=w),
            )
            for v, w in ((64, 1), (32, 1), (128, 1), (256, 2))
        ],
        "unpack": [
            (f"min{nbytes // 1024}K", _setter(a2a_mod, unpack_plans, _UNPACK_MIN_BYTES=nbytes))
            for nbytes in (2048, 1024, 4096, 8192)
        ],
        "unpack-inflight": [
            (f"{nbytes // 1024}K", _setter(a2a_mod, unpack_plans, _UNPACK_INFLIGHT_BYTES=nbytes))
            for nbytes in (16384, 8192)
        ],
        "unpack-decode": [
            (f"lanes{lanes}", _setter(a2a_mod, unpack_plans, _UNPACK_SMALL_GRID_LANES=lanes))
            for lanes in (0, 4, 2)
        ],
        "unpack-store": [
            (label, _setter(a2a_mod, unpack_plans, _UNPACK_OUT_CACHE=cache))
            for label, cache in (("wb", ""), ("cs", ".cs"))
        ],
        "unpack-both": [
            (
                f"{nbytes // 1024}K/{cache or 'wb'}",
                _setter(
                    a2a_mod, unpack_plans, _UNPACK_INFLIGHT_BYTES=nbytes, _UNPACK_OUT_CACHE=cache
                ),
            )
            for nbytes, cache in ((16384, ""), (8192, ".cs"))
        ],
        "correct-weights": [
            (label, _setter(correct_mod, correct_plans, _LSE_ROWS_MAX_N=max_n))
            for label, max_n in (("default", 8), ("lse-tile", 0))
        ],
    }


def ab(dev: torch.device, batch: int, only: str | None = None, rounds: int = 1) -> None:
    """The ops under each knob setting, ``rounds`` interleaved rounds (read-flush timing;
    decode: warm graph replay, the fastest round)."""
    moved, t = hb.measure_copy_ceiling(dev, timer=hb.time_cold)
    copy_bps = moved / (t.median_ms * 1e-3)
    for switch, settings in _switches().items():
        if only is not None and switch not in only.split(","):
            continue
        op_name = switch.split("-")[0]
        for h, d in ((64, 128), (64, 256), (128, 512)):
            for n in (2, 4, 8):
                t_in = _inputs(dev, batch, h, d, n, n)
                dec_sizes = (1, 8, 64)
                dec = [_inputs(dev, b, h, d, n, 0) for b in dec_sizes]
                fracs: dict[str, list[float]] = {label: [] for label, _ in settings}
                dec_us: dict[str, list[list[float]]] = {label: [] for label, _ in settings}
                for _ in range(rounds):
                    for label, set_ in settings:
                        set_()
                        op = _ops(n, d)[op_name]
                        bps = _nbytes(op_name, batch, h, d, n) / (
                            hb.time_cold(functools.partial(op, t_in)).median_ms * 1e-3
                        )
                        fracs[label].append(bps / copy_bps)
                        dec_us[label].append(
                            [
                                hb.time_cuda_graph([functools.partial(op, x)] * 32).median_ms * 1e3
                                for x in dec
                            ]
                        )
                settings[0][1]()
                line = f"{op_name} H={h} D={d} N={n}:"
                for label, _ in settings:
                    best = [min(us) for us in zip(*dec_us[label], strict=True)]
                    decode_txt = ", ".join(
                        f"B={b} {u:.2f} us" for b, u in zip(dec_sizes, best, strict=True)
                    )
                    frac_txt = " / ".join(f"{f:.3f}" for f in fracs[label])
                    line += f"  {label} {frac_txt} ({decode_txt})"
                print(line, flush=True)
                del t_in, dec
                torch.cuda.empty_cache()


def _pack_into(out: torch.Tensor, lse: torch.Tensor, n: int, send: torch.Tensor) -> None:
    """The pack kernel (no mask) into ``send [N, B, H_r, rec]`` of any record width ``rec``
    (a multiple of 8 lanes; zero padding up to it), with the shipped block choice."""
    b, h, d = out.shape
    rec = send.shape[-1]
    block_v = a2a_mod._PACK_BLOCK_V
    a2a_mod._pack_kernel(
        (-(-(b * (h // n) * rec // 8) // block_v), n),
        out, *out.stride(), lse, *lse.stride(), send, lse, lse, 0, b,
        HEADS_PER_RANK=h // n, HEAD_DIM=d, REC_WIDTH=rec, VEC=8, PACK=2, UNIT_D=True,
        IN_ALIGN=8, IDX64=False, HAS_MASK=False, SEARCH_STEPS=0,
        TOK_POW2=next_pow2(-(-block_v // (rec // 8)) // (h // n) + 2), BLOCK_V=block_v,
        num_warps=a2a_mod._PACK_NUM_WARPS,
    )  # fmt: skip


def records(dev: torch.device, batch: int) -> None:
    """The pack kernel writing records of other widths (zero padding to the width): is a
    record width that is a multiple of 32 bytes (whole sectors) faster? Fractions of the copy
    bandwidth with the bytes actually moved (whole records) counted. Written for the former
    record format: run it at commit ``49cec06`` (``benchmarks/README.md``)."""
    moved, t = hb.measure_copy_ceiling(dev, timer=hb.time_cold)
    copy_bps = moved / (t.median_ms * 1e-3)
    for h, d, n in ((64, 128, 2), (64, 128, 8), (128, 512, 4)):
        out, lse, *_ = _inputs(dev, batch, h, d, n, 0)
        line = f"pack H={h} D={d} N={n}:"
        for align in (8, 16, 64):  # lanes: 16, 32, 128 bytes
            rec = -(-(d + 2) // align) * align
            send = torch.empty(n, batch, h // n, rec, device=dev, dtype=torch.bfloat16)
            nbytes = batch * h * (d * 2 + 4) + send.numel() * 2
            call = functools.partial(_pack_into, out, lse, n, send)
            bps = nbytes / (hb.time_cold(call).median_ms * 1e-3)
            line += f"  rec={rec} ({rec * 2} B) {bps / copy_bps:.3f}"
        print(line + "  (fraction of copy, whole records counted)", flush=True)


def _interleaved_rounds(
    title: str,
    setters: list[tuple[str, Callable[[], None]]],
    rounds: int,
    check: Callable[[str], None],
    fns: list[Callable[[], object]],
) -> None:
    """Print ``title`` and the graph-replay time per call of ``fns`` under every setting of
    ``setters``, ``rounds`` interleaved rounds; ``check(label)`` runs under each setting
    before it is timed. The first setting (the shipped one) is left set."""
    times: dict[str, list[float]] = {label: [] for label, _ in setters}
    for _ in range(rounds):
        for label, set_ in setters:
            set_()
            check(label)
            times[label].append(hb.time_cuda_graph(fns).median_ms * 1e3)
    setters[0][1]()
    line = f"{title}:"
    for label, us in times.items():
        line += f"  {label} {'/'.join(f'{u:.2f}' for u in us)}"
    print(line + "  (us per call)", flush=True)


def _check_mask(title: str, inputs: Case, ref: torch.Tensor, label: str) -> None:
    """The mask under the current setting equals the eager baseline ``ref`` bit for bit."""
    got = mask_dcp_empty_shards_(inputs[0].clone(), *inputs[1:])
    if not torch.equal(got.view(torch.int32), ref.view(torch.int32)):
        raise AssertionError(f"{title}: setting {label} differs from the eager baseline")


def _check_merge(title: str, inputs: Case, ref: torch.Tensor, label: str) -> None:
    """The merge under the current setting is within one bf16 rounding step of ``ref`` (the
    variants round the weighted sum differently: fused multiply-add or not)."""
    got = merge_attn_states(*inputs).float()
    err = float((got - ref).norm() / ref.norm())
    if not err < 4e-3:
        raise AssertionError(f"{title}: setting {label} off by {err:.1e}")


# (label, knob values of cpattn_dcp.ops.mask_empty_shards); the first is the shipped setting
# (256 lanes, spread to MIN_PROGRAMS, one warp, int32 rows), the second the one before it.
# Run 1 of benchmarks/results/h200-2026-11-29-s8 compared the former setting with tiles of
# 1024 / 512 / 256 lanes, 1 / 2 / 4 warps and spreading to 132 / 264 programs.
_MASK_SETTINGS: list[tuple[str, dict[str, object]]] = [
    ("t256/p264/w1", {}),
    ("former", {"_MASK_TILE_LANES": 1 << 30, "_MASK_MIN_PROGRAMS": 1, "_MASK_NUM_WARPS": 2,
                "_MASK_ROW32": False}),
    ("t256/p264/i64", {"_MASK_ROW32": False}),
    ("t128/p264", {"_MASK_TILE_LANES": 128}),
    ("t512/p264", {"_MASK_TILE_LANES": 512}),
    ("t256/p528", {"_MASK_MIN_PROGRAMS": 528}),
    ("t256/p1056", {"_MASK_MIN_PROGRAMS": 1056}),
    ("t256/p264/w2", {"_MASK_NUM_WARPS": 2}),
    ("t256/p264/w4", {"_MASK_NUM_WARPS": 4}),
]  # fmt: skip


# The mask module's shipped knob values (read at import, before any setter ran).
_MASK_DEFAULTS = {
    name: getattr(mask_mod, name)
    for name in ("_BLOCK_B", "_MASK_TILE_LANES", "_MASK_NUM_WARPS", "_MASK_MIN_PROGRAMS",
                 "_MASK_ROW32")
}  # fmt: skip


def _mask_setter(values: dict[str, object]) -> Callable[[], None]:
    """Setter of the shipped mask knobs with ``values`` replaced (plans cleared)."""
    plans = [mask_mod._inplace_plan, mask_mod._copy_plan]
    return _setter(mask_mod, plans, **{**_MASK_DEFAULTS, **values})


def mask_sweep(dev: torch.device, rounds: int) -> None:
    """The in-place mask under each ``_MASK_SETTINGS`` entry (graph replay, 32 input sets)."""
    empty = hb.measure_empty_kernel_graph(dev).median_ms * 1e3
    print(f"empty kernel replay {empty:.2f} us", flush=True)
    setters = [(label, _mask_setter(values)) for label, values in _MASK_SETTINGS]
    shapes = [(b, b) for b in (1, 8, 64, 256, 1024, 4096)] + [(4096, 16), (4096, 256)]
    for h in (64, 128):
        for b, r in shapes:
            gen = torch.Generator(device=dev).manual_seed(b * 131 + r + h)
            sets = []
            for _ in range(32):
                lse = torch.randn(b, h, device=dev, generator=gen)
                zero = torch.rand(r, device=dev, generator=gen) < 0.25
                seq_lens = torch.where(zero, 0, 5).to(torch.int32)
                qsl = (torch.arange(r + 1, device=dev) * (b // r)).to(torch.int32)
                qsl[-1] = b - min(3, b // 4)  # a few padding rows
                sets.append((lse, seq_lens, qsl))
            ref = eb.mask_dcp_empty_shards_eager(sets[0][0].clone(), *sets[0][1:])
            title = f"mask H={h} B={b} R={r}"
            check = functools.partial(_check_mask, title, sets[0], ref)
            fns = [functools.partial(mask_dcp_empty_shards_, *t) for t in sets]
            _interleaved_rounds(title, setters, rounds, check, fns)


# (label, knob values of cpattn_common.ops.merge_attn_states); the first is the shipped one
# (EAGER loads on one-head grids of up to 1056 programs, ~2 lanes per thread there at D >=
# 512, and on shrunk tiles of several heads up to 1 KiB per source, 8 bytes per thread), the
# second weight-gated loads everywhere (the rule before the eighth session), "one-head" the
# eighth session's rule (EAGER on one-head grids only), "multi-2k" EAGER on shrunk tiles up to
# 2 KiB (16-byte vectors at 4 warps there), "multi-2k-8w" the same with 8 warps. Runs 4-5 and 8-9 of
# benchmarks/results/h200-2026-11-29-s8 timed other knob sets (volatile EAGER loads, lanes by
# grid size, EAGER on every grid of up to 1056 / 4096 programs): run them at 3441b60 (run 4),
# 6cec7ee (run 5) and 1bb1ab4 (runs 8-9); run 1 of h200-2026-11-29-s9 (at 99e5457) timed EAGER
# on the shrunk tiles of several heads with 1x / 2x / 4x the warps.
_MERGE_SETTINGS: list[tuple[str, dict[str, object]]] = [
    ("shipped", {}),
    ("gated", {"_EAGER_BY_DEFAULT": False, "_SMALL_GRID_LANES": 0}),
    ("lanes-all-D", {"_SMALL_GRID_MIN_D": 0}),
    ("no-lanes", {"_SMALL_GRID_LANES": 0}),
    ("one-head", {"_MULTI_EAGER_MAX_BYTES": 0}),
    ("multi-2k", {"_MULTI_EAGER_MAX_BYTES": 2048}),
    ("multi-2k-8w", {"_MULTI_EAGER_MAX_BYTES": 2048, "_MULTI_EAGER_MAX_WARPS": 8}),
]
_MERGE_DEFAULTS = {
    name: getattr(merge_mod, name)
    for name in ("_EAGER_BY_DEFAULT", "_SMALL_GRID_LANES", "_SMALL_GRID_MAX_WARPS",
                 "_SMALL_GRID_MIN_D", "_EAGER_MAX_PROGRAMS", "_MULTI_EAGER_MAX_BYTES",
                 "_MULTI_EAGER_THREAD_BYTES", "_MULTI_EAGER_MAX_WARPS")
}  # fmt: skip


def _merge_setter(values: dict[str, object]) -> Callable[[], None]:
    """Setter of the shipped merge knobs with ``values`` replaced (plans cleared)."""
    plans = [
        merge_mod.merge_attn_states_config,
        merge_mod.merge_attn_states_block_sizes,
        merge_mod._specialization,
    ]
    return _setter(merge_mod, plans, **{**_MERGE_DEFAULTS, **values})


def merge_sweep(
    dev: torch.device,
    rounds: int,
    batches: tuple[int, ...] = (1, 8, 64),
    labels: tuple[str, ...] | None = None,
) -> None:
    """``merge_attn_states`` at decode sizes under each ``_MERGE_SETTINGS`` entry (those named
    in ``labels``, the shipped one always first)."""
    empty = hb.measure_empty_kernel_graph(dev).median_ms * 1e3
    print(f"empty kernel replay {empty:.2f} us", flush=True)
    setters = [
        (label, _merge_setter(values))
        for i, (label, values) in enumerate(_MERGE_SETTINGS)
        if i == 0 or labels is None or label in labels
    ]
    for h, d in ((128, 512), (64, 256), (64, 128)):
        for n in (2, 4, 8):
            for b in batches:
                sets = [_inputs(dev, b, h, d, n, i)[2:4] for i in range(32)]
                setters[0][1]()
                ref = merge_attn_states(*sets[0]).float()
                title = f"merge H={h} D={d} N={n} B={b}"
                check = functools.partial(_check_merge, title, sets[0], ref)
                fns = [functools.partial(merge_attn_states, *t) for t in sets]
                _interleaved_rounds(title, setters, rounds, check, fns)
                del sets, fns, check
                torch.cuda.empty_cache()


def decode(dev: torch.device) -> None:
    empty = hb.measure_empty_kernel_graph(dev).median_ms * 1e3
    print(f"empty kernel replay {empty:.2f} us", flush=True)
    for h, d, n in ((128, 512, 8), (128, 512, 2), (64, 128, 4)):
        for b in (1, 8, 64):
            sets = [_inputs(dev, b, h, d, n, i) for i in range(32)]
            ops = _ops(n, d)
            ops["merge-lazy"] = lambda t: merge_attn_states_fwd(t[2], t[3], eager=False)
            line = f"H={h} D={d} N={n} B={b}:"
            for name, op in ops.items():
                fns = [lambda t=t, op=op: op(t) for t in sets]
                cold = hb.time_cuda_graph(fns).median_ms * 1e3
                warm = hb.time_cuda_graph([fns[0]] * 32).median_ms * 1e3
                line += f"  {name} {cold:.2f}/{warm:.2f}"
            print(line + "  (us cold/warm)", flush=True)


def probe(dev: torch.device) -> None:
    """One launch of ``correct_attn_out`` per knob setting at H=64 D=128 N=8 (run under
    ``ncu``), then one of each op at two shapes."""
    t = _inputs(dev, 4096, 64, 128, 8, 0)
    for _, set_ in _switches()["correct"]:
        set_()
        _ops(8, 128)["correct"](t)
    _switches()["correct"][0][1]()
    for b, h, d, n in ((4096, 64, 128, 4), (1, 128, 512, 8)):
        t = _inputs(dev, b, h, d, n, 0)
        for op in _ops(n, d).values():
            op(t)
    torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--skip-methods", action="store_true")
    parser.add_argument("--probe", action="store_true", help="only a few launches, for ncu")
    parser.add_argument("--ab", action="store_true", help="only the knob comparisons")
    parser.add_argument("--ab-only", help="with --ab: switch names, comma-separated (e.g. correct)")
    parser.add_argument("--records", action="store_true", help="only the record-width probe")
    parser.add_argument("--mask", action="store_true", help="only the mask tile sweep")
    parser.add_argument("--merge", action="store_true", help="only the merge decode sweep")
    parser.add_argument("--batches", default="1,8,64", help="with --merge: batch sizes")
    parser.add_argument("--settings", help="with --merge: setting labels, comma-separated")
    parser.add_argument(
        "--rounds", type=int, default=2, help="with --ab / --mask / --merge: interleaved rounds"
    )
    args = parser.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    if args.probe:
        probe(dev)
        return
    if args.ab:
        ab(dev, args.batch, args.ab_only, args.rounds)
        return
    if args.records:
        records(dev, args.batch)
        return
    if args.mask:
        mask_sweep(dev, args.rounds)
        return
    if args.merge:
        labels = tuple(args.settings.split(",")) if args.settings else None
        merge_sweep(dev, args.rounds, tuple(int(b) for b in args.batches.split(",")), labels)
        return
    if not args.skip_methods:
        methods(dev, args.batch)
    if not args.skip_decode:
        decode(dev)


if __name__ == "__main__":
    main()
