"""Command line of the demo: launch the ranks, print the per-path table, exit 0 or 1."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from cpattn_testing.demo.generate import PATHS
from cpattn_testing.demo.model import VARIANTS
from cpattn_testing.demo.run import DTYPES, DemoConfig, PathResult, rank_main, summarize


def _interpreted() -> bool:
    from cpattn_common.interpret import triton_interpreting

    return triton_interpreting()


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None or not math.isfinite(x) else format(x, spec)


def format_table(results: Sequence[PathResult]) -> str:
    """One row per ``variant/path``, then the skip reasons, notes and failures."""
    head = ("path", "ranks", "tokens", "max rel.err", "tol", "drafts acc/rej", "step", "result")
    rows = [head] + [
        (r.path, str(r.ranks), r.tokens or "-", _fmt(r.max_rel_err, ".1e"), _fmt(r.tol, ".0e"),
         r.drafts or "-", "-" if r.step_ms is None else f"{r.step_ms:.2f} ms", r.status)
        for r in results
    ]  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines += [f"{r.status}: {r.path}: {r.reason}" for r in results if r.reason]
    failed = [r.path for r in results if r.status == "FAIL"]
    checked = sum(r.status != "skipped" for r in results)
    if failed:
        lines.append(f"FAILED: {', '.join(failed)} ({len(failed)} of {checked} checked paths)")
    elif checked == 0:
        lines.append("NOTHING CHECKED: every path was skipped")
    else:
        lines.append(f"OK: every checked path ({checked}) generated the reference's tokens, "
                     f"{len(results) - checked} skipped")  # fmt: skip
    return "\n".join(lines)


def _csv(kind: str, allowed: Sequence[str]) -> Any:
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(x.strip() for x in text.split(",") if x.strip())
        if not items or any(x not in allowed for x in items):
            raise argparse.ArgumentTypeError(f"{kind}: comma-separated from {', '.join(allowed)}")
        return items

    return parse


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated integers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    d = DemoConfig()
    p = argparse.ArgumentParser(
        prog="python -m cpattn_testing.demo",
        description="Greedy decoding of a small transformer on context-parallel ranks: "
        "prefill with PCP, KV cache sharded across DCP ranks, every decode step combined by "
        "each path in turn; tokens and logits checked against the same model on one rank.",
        epilog="Exit status: 0 every checked path passed, 1 a path failed (or none was "
        "checked), 2 bad arguments, 3 the ranks did not complete. Under torchrun the ranks "
        "come from its environment and global rank 0 prints the table (docs/multi-node.md).",
    )
    a = p.add_argument
    a(
        "--world-size",
        type=int,
        default=None,
        help="ranks (default: 4 on gloo, every visible GPU on nccl)",
    )
    a(
        "--backend",
        choices=("gloo", "nccl"),
        default=d.backend,
        help="gloo: CPU ranks; nccl: one GPU per rank",
    )
    a("--dtype", choices=sorted(DTYPES), default=d.dtype, help="model and attention dtype")
    a("--variants", type=_csv("variants", VARIANTS), default=d.variants, help="gqa,mla")
    a("--paths", type=_csv("paths", PATHS), default=d.paths, help=",".join(PATHS))
    a("--prompt-lens", type=_ints, default=d.prompt_lens, help="prompt lengths, e.g. 1,5,37,64")
    a("--new-tokens", type=int, default=d.new_tokens, help="greedy tokens per request")
    a(
        "--verify-every",
        type=int,
        default=d.verify_every,
        help="every K-th decode step verifies a drafted token (2 query tokens; 0: never)",
    )
    a("--interleave", type=int, default=d.interleave, help="KV interleave size of the DCP shards")
    a("--layers", type=int, default=d.layers)
    a("--hidden", type=int, default=d.hidden)
    a("--vocab", type=int, default=d.vocab)
    a("--heads", type=int, default=d.heads, help="query heads (divisible by the world size)")
    a("--kv-heads", type=int, default=d.kv_heads, help="GQA KV heads")
    a("--head-dim", type=int, default=d.head_dim, help="GQA head dim")
    a("--latent-dim", type=int, default=d.latent_dim, help="MLA latent (value) dim")
    a("--rope-dim", type=int, default=d.rope_dim, help="MLA decoupled key part")
    a("--seed", type=int, default=d.seed)
    a("--json", default=None, metavar="FILE", help="also write the results as JSON ('-': stdout)")
    a("--timeout", type=float, default=600.0, help="seconds before the ranks are killed")
    a("--quiet", action="store_true", help="no progress lines")
    a("--list", action="store_true", help="list the variant/path rows and exit")
    a("--plant-fault", type=_csv("paths", all_path_names()),
      default=(), help=argparse.SUPPRESS)  # fmt: skip
    return p


def all_path_names(variants: Sequence[str] = VARIANTS) -> list[str]:
    """Every ``variant/path`` row the demo can print, in run order."""
    return [f"{v}/{p}" for v in variants for p in PATHS]


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    """The :class:`DemoConfig` of the parsed command line (``ValueError`` if inconsistent).

    Under torchrun (``TORCHELASTIC_RUN_ID`` set) the world size is torchrun's ``WORLD_SIZE``.
    """
    import torch

    gpus = torch.cuda.device_count()
    if "TORCHELASTIC_RUN_ID" in os.environ:
        n = int(os.environ["WORLD_SIZE"])
        if args.world_size not in (None, n):
            raise ValueError(f"--world-size {args.world_size}, but torchrun started {n} ranks")
        if args.backend == "nccl" and int(os.environ["LOCAL_RANK"]) >= gpus:
            raise ValueError(f"local rank {os.environ['LOCAL_RANK']} has no GPU ({gpus} visible)")
    else:
        n = args.world_size or (gpus if args.backend == "nccl" else 4)
        if args.backend == "nccl" and not 0 < n <= gpus:
            raise ValueError(f"--backend nccl needs one GPU per rank: {n} ranks, {gpus} GPUs")
    fields = {f.name for f in dataclasses.fields(DemoConfig)}
    values = {k: v for k, v in vars(args).items() if k in fields and k != "world_size"}
    return DemoConfig(world_size=n, progress=not args.quiet, fault=args.plant_fault, **values)


def _report(cfg: DemoConfig, results: list[PathResult], elapsed: float, json_to: str | None) -> int:
    out = sys.stderr if json_to == "-" else sys.stdout
    print(format_table(results), file=out)
    note = "; Triton interpreter: not a performance figure" if _interpreted() else ""
    print(f"(wall time {elapsed:.1f} s; step: median wall time of one decode step, slowest "
          f"rank, the whole model{note})", file=out)  # fmt: skip
    ok = not any(r.status == "FAIL" for r in results) and any(r.status == "pass" for r in results)
    if json_to is not None:
        payload = {"ok": ok, "config": dataclasses.asdict(cfg), "wall_time_s": elapsed,
                   "results": [dataclasses.asdict(r) for r in results]}  # fmt: skip
        text = json.dumps(payload, indent=2)
        if json_to == "-":
            print(text)
        else:
            with open(json_to, "w", encoding="utf-8") as fh:
                fh.write(text + "\n")
    return 0 if ok else 1


def _torchrun_main(cfg: DemoConfig, json_to: str | None) -> int:
    """One rank started by torchrun: the process group from its environment (``env://``);
    global rank 0 gathers every rank's results and reports."""
    import torch
    import torch.distributed as dist

    from cpattn_testing.interpreter import apply_interpreter_fixes

    rank = int(os.environ["RANK"])
    if cfg.backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    apply_interpreter_fixes()
    if rank == 0:
        _header(cfg, json_to)
    start = time.perf_counter()
    dist.init_process_group(cfg.backend)
    try:
        mine = rank_main(rank, cfg.world_size, cfg)
        gathered: list[Any] | None = [None] * cfg.world_size if rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
    finally:
        dist.destroy_process_group()
    if gathered is None:
        return 0
    return _report(cfg, summarize(cfg, gathered), time.perf_counter() - start, json_to)


def _header(cfg: DemoConfig, json_to: str | None) -> None:
    where = "one GPU per rank" if cfg.backend == "nccl" else "CPU"
    print(f"cpattn demo: {cfg.world_size} ranks ({cfg.backend}, {where}), {cfg.dtype}, "
          f"prompts {list(cfg.prompt_lens)}, {cfg.new_tokens} new tokens, interleave "
          f"{cfg.interleave}", file=sys.stderr if json_to == "-" else sys.stdout, flush=True)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(all_path_names()))
        return 0
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        parser.print_usage(sys.stderr)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if cfg.backend == "gloo" and not _interpreted():
        print("error: --backend gloo runs the ranks on the CPU, where the Triton kernels run "
              "only under Triton's interpreter: set TRITON_INTERPRET=1 (and pip install "
              "numpy), or pass --backend nccl on GPUs", file=sys.stderr)  # fmt: skip
        return 2
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return _torchrun_main(cfg, args.json)

    from cpattn_testing.launcher import DistributedError, run_distributed

    _header(cfg, args.json)
    start = time.perf_counter()
    try:
        per_rank = run_distributed(rank_main, cfg.world_size, cfg.backend, args=(cfg,),
                                   timeout=args.timeout)  # fmt: skip
    except DistributedError as exc:
        print(f"error: the ranks did not complete: {exc}", file=sys.stderr)
        return 3
    return _report(cfg, summarize(cfg, per_rank), time.perf_counter() - start, args.json)
