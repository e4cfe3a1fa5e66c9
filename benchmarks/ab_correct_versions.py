"""A/B of ``correct_attn_out``'s lean kernel at an earlier commit against the working tree (dev
tool, GPU), interleaved, under CUDA-graph replay.

Written to check the decode-size rows after the LSE-math change of ``f362a8e``: the page of
``99486ba`` read +0.23 µs at N=8 B=64 against the page of ``ea3c946`` (other runs).

    python3 benchmarks/ab_correct_versions.py --export f362a8e^   # here: needs git; writes
        # benchmarks/_ab_ref/ (the kernel modules at that commit; git-ignored, carry it)
    python3 benchmarks/ab_correct_versions.py                     # GPU: both versions
    TRITON_INTERPRET=1 python3 benchmarks/ab_correct_versions.py --cpu-check

The earlier ``kernels/correct_attn_out.py`` is loaded under another module name with its
``lse_math`` import pointed at the earlier ``lse_math.py``; both versions launch through
``CachedKernel`` specializations with the constexprs the op's plan picks for the shape.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
REF_DIR = Path(__file__).resolve().parent / "_ab_ref"
_KERNELS = "packages/cp-dcp/src/cpattn_dcp/kernels"
_MODULES = ("lse_math", "correct_attn_out")


def export(ref: str) -> None:
    """Write the kernel modules at ``ref`` into ``REF_DIR`` (and the ref's name)."""
    REF_DIR.mkdir(exist_ok=True)
    for name in _MODULES:
        text = subprocess.run(
            ["git", "show", f"{ref}:{_KERNELS}/{name}.py"],
            cwd=ROOT, check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip
        (REF_DIR / f"{name}.py").write_text(text)
    (REF_DIR / "REF").write_text(ref + "\n")
    print(f"wrote {REF_DIR} ({ref})")


def _load(name: str, path: Path, source: str) -> ModuleType:
    spec = importlib.util.spec_from_loader(name, loader=None, origin=str(path))
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    module.__file__ = str(path)
    sys.modules[name] = module
    exec(compile(source, str(path), "exec"), module.__dict__)
    return module


def load_reference() -> ModuleType:
    """The earlier ``correct_attn_out`` kernel module (imports the earlier ``lse_math``)."""
    _load("ab_ref_lse_math", REF_DIR / "lse_math.py", (REF_DIR / "lse_math.py").read_text())
    source = (REF_DIR / "correct_attn_out.py").read_text()
    source = source.replace(
        "from cpattn_dcp.kernels.lse_math import", "from ab_ref_lse_math import"
    )
    return _load("ab_ref_correct_attn_out", REF_DIR / "correct_attn_out.py", source)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--export", metavar="REF", help="write the kernel modules at REF (git)")
    parser.add_argument("--cpu-check", action="store_true", help="outputs only, CPU, small")
    args = parser.parse_args()
    if args.export:
        export(args.export)
        return
    for src in ("cp-common", "cp-dcp", "cp-testing"):
        sys.path.insert(0, str(ROOT / "packages" / src / "src"))
    import torch

    import cpattn_dcp.ops.correct_attn_out as ops
    from cpattn_common.launch import CachedKernel

    ref_kernel = CachedKernel(load_reference()._correct_attn_out_contig_kernel)
    ref_name = (REF_DIR / "REF").read_text().strip()
    dev = torch.device("cpu") if args.cpu_check else torch.device("cuda")

    def launchers(
        b: int, h: int, d: int, n: int, sets: int
    ) -> tuple[dict[str, list[Any]], list[Any]]:
        """Per version, one launch per rotating input set (in place on ``outs``)."""
        grid, spec = ops._contig_plan(b, h, d, n, 2, True)
        ref_spec = ref_kernel.specialize(**spec.constexprs)
        gen = torch.Generator(device=dev).manual_seed(b * n + d)
        outs = [torch.randn(b, h, d, device=dev, generator=gen).to(torch.bfloat16)
                for _ in range(sets)]  # fmt: skip
        lses = [torch.randn(n, b, h, device=dev, generator=gen) * 4 for _ in range(sets)]
        lse = torch.empty(b, h, device=dev)
        calls: dict[str, list[Any]] = {"ref": [], "new": []}
        for o, ls in zip(outs, lses, strict=True):
            calls["ref"].append(lambda s=ref_spec, o=o, ls=ls: s(grid, o, ls, lse, b * h, n - 1))
            calls["new"].append(lambda s=spec, o=o, ls=ls: s(grid, o, ls, lse, b * h, n - 1))
        return calls, outs

    shapes = [(64, 64, 128, 8), (64, 64, 256, 8), (64, 64, 128, 4), (1, 64, 128, 8),
              (64, 128, 512, 8)]  # fmt: skip
    if args.cpu_check:
        for b, h, d, n in [(3, 8, 32, 8), (2, 4, 24, 3)]:
            got = {}
            for name in ("ref", "new"):
                calls, outs = launchers(b, h, d, n, 1)  # same seed: same inputs
                calls[name][0]()
                got[name] = outs[0].float()
            diff = (got["ref"] - got["new"]).abs().max().item()
            print(f"check b={b} h={h} d={d} n={n}: max diff {diff:.2e}")
        return
    import cpattn_testing.bench as hb

    print(f"reference {ref_name} against the working tree; µs per call, graph replay")
    for b, h, d, n in shapes:
        calls, _ = launchers(b, h, d, n, 8)
        line = f"B={b} H={h} D={d} N={n}:"
        for rnd in range(3):
            for name in ("ref", "new") if rnd % 2 == 0 else ("new", "ref"):
                t = hb.time_cuda_graph(calls[name], repeats=10)
                line += f"  {name} {t.median_ms * 1e3:.3f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
