"""A/B of ``correct_attn_out``'s lean kernel at earlier commits against the working tree (dev
tool, GPU), interleaved, under CUDA-graph replay; optionally the SASS of every version.

Written to check the decode-size rows after the LSE-math change of ``f362a8e``: the page of
``99486ba`` read +0.23 µs at N=8 B=64 against the page of ``ea3c946`` (other runs).

    python3 benchmarks/ab_correct_versions.py --export f362a8e^ fc6b3a7   # here: needs git;
        # writes benchmarks/_ab_ref/<i>/ (the kernel modules at each ref; git-ignored, carry it)
    python3 benchmarks/ab_correct_versions.py [--sass DIR]   # GPU: every version
    TRITON_INTERPRET=1 python3 benchmarks/ab_correct_versions.py --cpu-check

An earlier ``kernels/correct_attn_out.py`` is loaded under another module name with its
``lse_math`` import pointed at the ``lse_math.py`` of the same ref; every version launches
through ``CachedKernel`` specializations with the constexprs the op's plan picks for the shape.
``--sass DIR`` writes each version's PTX and SASS at N=8 B=64 H=64 D=128 (Triton's bundled
``nvdisasm``) and prints their instruction counts by opcode where they differ.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
REF_DIR = Path(__file__).resolve().parent / "_ab_ref"
_KERNELS = "packages/cp-dcp/src/cpattn_dcp/kernels"
_MODULES = ("lse_math", "correct_attn_out")


def export(refs: list[str]) -> None:
    """Write the kernel modules at each ref into ``REF_DIR/<i>/`` (and the ref's name)."""
    for i, ref in enumerate(refs):
        out = REF_DIR / str(i)
        out.mkdir(parents=True, exist_ok=True)
        for name in _MODULES:
            text = subprocess.run(
                ["git", "show", f"{ref}:{_KERNELS}/{name}.py"],
                cwd=ROOT, check=True, capture_output=True, text=True,
            ).stdout  # fmt: skip
            (out / f"{name}.py").write_text(text)
        (out / "REF").write_text(ref + "\n")
        print(f"wrote {out} ({ref})")


def _load(name: str, path: Path, source: str) -> ModuleType:
    spec = importlib.util.spec_from_loader(name, loader=None, origin=str(path))
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    module.__file__ = str(path)
    sys.modules[name] = module
    exec(compile(source, str(path), "exec"), module.__dict__)
    return module


def load_references() -> dict[str, ModuleType]:
    """The earlier ``correct_attn_out`` kernel modules by ref name (each importing its own
    ``lse_math``)."""
    mods = {}
    for i, ref_dir in enumerate(sorted(p for p in REF_DIR.iterdir() if (p / "REF").exists())):
        lse_math = f"ab_ref{i}_lse_math"
        _load(lse_math, ref_dir / "lse_math.py", (ref_dir / "lse_math.py").read_text())
        source = (ref_dir / "correct_attn_out.py").read_text()
        source = source.replace(
            "from cpattn_dcp.kernels.lse_math import", f"from {lse_math} import"
        )
        name = (ref_dir / "REF").read_text().strip()
        mods[name] = _load(f"ab_ref{i}_correct_attn_out", ref_dir / "correct_attn_out.py", source)
    return mods


_CONTROL = re.compile(r"^\s*(?:/\*[0-9a-f]+\*/)?\s*(?:[-\w]+:[-\w]+:[-\w]+:[-\w]+:\d+\s+)?")
_OPCODE = re.compile(r"^(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)[.\s;]")


def _opcodes(sass: str) -> collections.Counter[str]:
    """Opcode counts of a SASS listing (nvdisasm's or Triton's form; predicates, modifiers
    and control codes stripped)."""
    ops: collections.Counter[str] = collections.Counter()
    for line in sass.splitlines():
        m = _OPCODE.match(_CONTROL.sub("", line, count=1))
        if m:
            ops[m.group(1)] += 1
    return ops


def _write_sass(out_dir: Path, jits: dict[str, Any], ops: Any, dev: Any) -> None:
    """Each version's PTX and SASS at N=8 B=64 H=64 D=128 into ``out_dir``; print the opcode
    counts that differ between versions."""
    import torch

    out_dir.mkdir(parents=True, exist_ok=True)
    b, h, d, n = 64, 64, 128, 8
    grid, spec = ops._contig_plan(b, h, d, n, 2, True)
    o = torch.randn(b, h, d, device=dev).to(torch.bfloat16)
    ls = torch.randn(n, b, h, device=dev)
    lse = torch.empty(b, h, device=dev)
    counts = {}
    for i, (name, jit) in enumerate(jits.items()):
        compiled = jit[grid](o, ls, lse, b * h, n - 1, **spec.constexprs)
        stem = f"v{i}_{re.sub(r'[^A-Za-z0-9]+', '_', name)}"
        (out_dir / f"{stem}.ptx").write_text(compiled.asm["ptx"])
        sass = compiled.asm["sass"]
        (out_dir / f"{stem}.sass").write_text(sass)
        counts[name] = _opcodes(sass)
        print(f"{name}: {sum(counts[name].values())} SASS instructions -> {stem}.sass")
    print("opcode   " + " ".join(f"{k:>12s}" for k in counts))
    for op in sorted(set().union(*counts.values())):
        row = [counts[k][op] for k in counts]
        if len(set(row)) > 1:
            print(f"{op:8s} " + " ".join(f"{c:12d}" for c in row))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--export", nargs="+", metavar="REF", help="write the modules at each REF")
    parser.add_argument("--cpu-check", action="store_true", help="outputs only, CPU, small")
    parser.add_argument("--sass", type=Path, metavar="DIR", help="write PTX and SASS into DIR")
    parser.add_argument("--sass-only", action="store_true", help="with --sass: no timing")
    args = parser.parse_args()
    if args.export:
        export(args.export)
        return
    for src in ("cp-common", "cp-dcp", "cp-testing"):
        sys.path.insert(0, str(ROOT / "packages" / src / "src"))
    import torch

    import cpattn_dcp.ops.correct_attn_out as ops
    from cpattn_common.launch import CachedKernel
    from cpattn_dcp.kernels.correct_attn_out import _correct_attn_out_contig_kernel

    jits = {ref: m._correct_attn_out_contig_kernel for ref, m in load_references().items()}
    jits["new"] = _correct_attn_out_contig_kernel
    kernels = {ref: CachedKernel(k) for ref, k in jits.items()}
    dev = torch.device("cpu") if args.cpu_check else torch.device("cuda")

    def launchers(
        b: int, h: int, d: int, n: int, sets: int
    ) -> tuple[dict[str, list[Any]], list[Any]]:
        """Per version, one launch per rotating input set (in place on ``outs``)."""
        grid, spec = ops._contig_plan(b, h, d, n, 2, True)
        gen = torch.Generator(device=dev).manual_seed(b * n + d)
        outs = [torch.randn(b, h, d, device=dev, generator=gen).to(torch.bfloat16)
                for _ in range(sets)]  # fmt: skip
        lses = [torch.randn(n, b, h, device=dev, generator=gen) * 4 for _ in range(sets)]
        lse = torch.empty(b, h, device=dev)
        calls: dict[str, list[Any]] = {}
        for name, ck in kernels.items():
            sp = ck.specialize(**spec.constexprs)
            calls[name] = [
                lambda s=sp, o=o, ls=ls: s(grid, o, ls, lse, b * h, n - 1)
                for o, ls in zip(outs, lses, strict=True)
            ]
        return calls, outs

    shapes = [(64, 64, 128, 8), (64, 64, 256, 8), (64, 64, 128, 4), (1, 64, 128, 8),
              (64, 128, 512, 8)]  # fmt: skip
    if args.cpu_check:
        for b, h, d, n in [(3, 8, 32, 8), (2, 4, 24, 3)]:
            got = {}
            for name in kernels:
                calls, outs = launchers(b, h, d, n, 1)  # same seed: same inputs
                calls[name][0]()
                got[name] = outs[0].float()
            diffs = [f"{k} {(got[k] - got['new']).abs().max().item():.2e}" for k in got]
            print(f"check b={b} h={h} d={d} n={n}: max diff against new: {', '.join(diffs)}")
        return
    if args.sass:
        try:
            _write_sass(args.sass, jits, ops, dev)
        except Exception as exc:  # a dev tool: the timing below still runs
            print(f"--sass failed: {type(exc).__name__}: {exc}")
        if args.sass_only:
            return
    import cpattn_testing.bench as hb

    names = list(kernels)
    print(f"versions {names} ('new' = working tree); µs per call, graph replay")
    for b, h, d, n in shapes:
        calls, _ = launchers(b, h, d, n, 8)
        line = f"B={b} H={h} D={d} N={n}:"
        for rnd in range(3):
            for name in names if rnd % 2 == 0 else names[::-1]:
                t = hb.time_cuda_graph(calls[name], repeats=10)
                line += f"  {name} {t.median_ms * 1e3:.3f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
