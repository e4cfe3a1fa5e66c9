"""merge_attn_states: both kernel variants (EAGER / weight-gated loads), the launch config, the
vector-width choice for odd layouts, the host fast path, and an sm_90 compile check.

Every numeric case compares against the float64 ``lse_combine_ref`` (relative norm error, fresh
random data, adversarial LSEs). Run as a script (outside ``TRITON_INTERPRET``) this file compiles
the merge kernel for sm_90 with Triton's bundled ptxas and prints what the compile check tests.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from cpattn_common.ops import merge_attn_states as merge_mod
from cpattn_common.ops.merge_attn_states import (
    _valid_cuda,
    merge_attn_states,
    merge_attn_states_config,
    merge_attn_states_fwd,
    triton_usable,
)
from cpattn_testing.pytest_plugin import require_ptxas
from cpattn_testing.reference import lse_combine_ref
from cpattn_testing.tolerances import assert_close_to_ref

NEG_INF = float("-inf")

pytestmark = [
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]


def _needs_triton(device: torch.device) -> None:
    if not triton_usable(device):
        pytest.skip("Triton cannot run here (CPU without TRITON_INTERPRET=1)")


def _states(
    n: int, b: int, h: int, d: int, *, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``[N, B, H, D]`` / ``[N, B, H]`` (CPU) with adversarial rows planted."""
    gen = torch.Generator().manual_seed(seed)
    outs = torch.randn(n, b, h, d, generator=gen)
    lses = torch.randn(n, b, h, generator=gen) * 3
    kinds = torch.randint(0, 6, (b, h), generator=gen)
    for i in range(b):
        for j in range(h):
            src = int(torch.randint(0, n, (1,), generator=gen))
            kind = int(kinds[i, j])
            if kind == 0:  # empty shard, NaN partial
                lses[src, i, j] = NEG_INF
                outs[src, i, j] = float("nan")
            elif kind == 1:  # NaN LSE, inf partial
                lses[src, i, j] = float("nan")
                outs[src, i, j] = float("inf")
            elif kind == 2:  # +inf LSE counts as empty
                lses[src, i, j] = float("inf")
                outs[src, i, j] = float("nan")
            elif kind == 3:  # whole row empty
                lses[:, i, j] = NEG_INF
                outs[:, i, j] = float("nan")
            elif kind == 4:  # large magnitudes
                lses[:, i, j] = 1e4 + lses[:, i, j]
    return outs.to(dtype), lses


def _check(out: torch.Tensor, lse: torch.Tensor, outs: torch.Tensor, lses: torch.Tensor) -> None:
    ref_out, ref_lse = lse_combine_ref(outs.cpu(), lses.cpu())
    assert out.dtype == outs.dtype
    assert lse.dtype == torch.float32
    assert out.is_contiguous()
    assert lse.is_contiguous()
    assert not torch.isnan(out).any(), "NaN in the merged output"
    assert_close_to_ref(out, ref_out, dtype=outs.dtype, name="out")
    assert torch.equal(torch.isneginf(lse.cpu()), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.cpu().double()[finite], ref_lse[finite], rtol=1e-6, atol=1e-5)


def _layout(
    outs: torch.Tensor, lses: torch.Tensor, layout: str
) -> tuple[torch.Tensor, torch.Tensor]:
    n, b, h, d = outs.shape
    if layout == "odd-strides":  # row strides not multiples of the 16-byte vector
        big = torch.full((n, b, h, d + 3), float("nan"), dtype=outs.dtype)
        big[..., :d] = outs
        return big[..., :d], lses
    if layout == "d-strided":  # non-unit stride along D
        big = torch.full((n, b, h, d, 2), float("nan"), dtype=outs.dtype)
        big[..., 0] = outs
        return big[..., 0], lses.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "offset":  # base pointer not 16-byte aligned
        flat = torch.full((outs.numel() + 1,), float("nan"), dtype=outs.dtype)
        flat[1:] = outs.flatten()
        return flat[1:].view(outs.shape), lses
    return outs, lses


CASES = [
    # (N, B, H, D, dtype, layout)
    (3, 2, 3, 64, torch.bfloat16, "contiguous"),
    (2, 3, 2, 80, torch.float16, "odd-strides"),
    (4, 2, 3, 32, torch.float32, "d-strided"),
    (2, 2, 5, 48, torch.bfloat16, "offset"),
    (1, 3, 2, 64, torch.bfloat16, "contiguous"),
]


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "gated"])
@pytest.mark.parametrize(
    ("n", "b", "h", "d", "dtype", "layout"),
    CASES,
    ids=[f"N{c[0]}-B{c[1]}-H{c[2]}-D{c[3]}-{str(c[4])[6:]}-{c[5]}" for c in CASES],
)
def test_both_variants_match_reference(
    device: torch.device,
    eager: bool,
    n: int,
    b: int,
    h: int,
    d: int,
    dtype: torch.dtype,
    layout: str,
) -> None:
    _needs_triton(device)
    outs, lses = _layout(*_states(n, b, h, d, dtype=dtype, seed=n * 31 + d), layout)
    outs, lses = outs.to(device), lses.to(device)
    out, lse = merge_attn_states_fwd(outs, lses, eager=eager)
    _check(out, lse, outs, lses)


def test_size_one_dims_and_broadcast_inputs(device: torch.device) -> None:
    """N = 1 / B = 1 / H = 1 (their strides are ignored) and stride-0 (expanded) partials."""
    _needs_triton(device)
    outs, lses = _states(1, 1, 1, 64, dtype=torch.bfloat16, seed=3)
    for eager in (True, False):
        out, lse = merge_attn_states_fwd(outs.to(device), lses.to(device), eager=eager)
        _check(out, lse, outs, lses)
    row = torch.randn(1, 1, 1, 32).to(torch.float16)
    expanded = row.expand(3, 2, 4, 32)  # every stride but D's is 0
    lses2 = torch.randn(3, 2, 4)
    out, lse = merge_attn_states_fwd(expanded.to(device), lses2.to(device))
    _check(out, lse, expanded, lses2)
    # Odd strides on a size-1 B dim must not matter: a [N, 1, H, D] slice of a bigger buffer.
    big, lses3 = _states(2, 3, 4, 64, dtype=torch.bfloat16, seed=5)
    sliced = big[:, 1:2]
    out, lse = merge_attn_states_fwd(sliced.to(device), lses3[:, 1:2].to(device))
    _check(out, lse, sliced, lses3[:, 1:2])


def test_config_rules() -> None:
    # decode, one head per program: EAGER loads; D >= 512: ~2 lanes per thread
    assert merge_attn_states_config(1, 128, 512, 2) == (1, 512, 4, True)
    assert merge_attn_states_config(8, 128, 512, 2) == (1, 512, 4, True)  # 1024 programs
    assert merge_attn_states_config(1, 16, 576, 2) == (1, 1024, 4, True)
    assert merge_attn_states_config(1, 64, 128, 2) == (1, 128, 1, True)
    assert merge_attn_states_config(16, 64, 256, 2) == (1, 256, 1, True)
    # several heads per program, at most 1 KiB per source: EAGER, 8 bytes per thread
    assert merge_attn_states_config(32, 64, 128, 2) == (2, 128, 2, True)
    assert merge_attn_states_config(64, 64, 128, 2) == (4, 128, 4, True)
    assert merge_attn_states_config(32, 64, 256, 2) == (2, 256, 4, True)
    assert merge_attn_states_config(48, 64, 128, 4) == (4, 128, 4, False)  # fp32: 2 KiB
    # several heads per program, larger tiles: weight-gated loads
    assert merge_attn_states_config(16, 128, 512, 2) == (2, 512, 4, False)
    assert merge_attn_states_config(64, 64, 256, 2) == (4, 256, 4, False)
    assert merge_attn_states_config(128, 64, 128, 2) == (8, 128, 4, False)
    # the bandwidth shapes: 4096-element tiles at D >= 128, 2048 below; gated loads
    assert merge_attn_states_config(4096, 128, 512, 2) == (8, 512, 8, False)
    assert merge_attn_states_config(4096, 64, 128, 2) == (32, 128, 8, False)
    assert merge_attn_states_config(4096, 64, 128, 4) == (32, 128, 8, False)
    assert merge_attn_states_config(8192, 32, 64, 2) == (32, 64, 4, False)
    # mid-size grids keep big tiles
    assert merge_attn_states_config(64, 128, 512, 2) == (8, 512, 8, False)
    # beyond _EAGER_MAX_PROGRAMS rows the batch no longer matters (the launcher caps it)
    cap = merge_mod._EAGER_MAX_PROGRAMS + 1
    for h, d in ((128, 512), (64, 128), (1, 64), (3, 576)):
        assert merge_attn_states_config(10**6, h, d, 2) == merge_attn_states_config(cap, h, d, 2)
    for b in (1, 3, 8, 64, 200, 4096, 10_000):
        for h, d, es in ((128, 512, 2), (64, 128, 2), (8, 80, 4), (3, 576, 2), (1, 64, 1)):
            bh, bd, nw, _ = merge_attn_states_config(b, h, d, es)
            assert bd >= d
            assert bd & (bd - 1) == 0
            assert bh & (bh - 1) == 0
            assert 1 <= bh <= max(1, 4096 // bd)
            assert nw in (1, 2, 4, 8)


def test_fast_validation_only_accepts_plain_cuda_tensors() -> None:
    outs, lses = torch.randn(2, 1, 2, 8), torch.randn(2, 1, 2)
    assert not _valid_cuda(outs, lses)  # CPU: the general path validates
    if torch.cuda.is_available():
        c_outs, c_lses = outs.cuda(), lses.cuda()
        assert _valid_cuda(c_outs, c_lses)
        assert not _valid_cuda(c_outs, lses)
        assert not _valid_cuda(c_outs.double(), c_lses)
        assert not _valid_cuda(c_outs, c_lses.double())
        assert not _valid_cuda(c_outs[:, :, :1], c_lses)
        assert not _valid_cuda(c_outs[:0], c_lses[:0])
        assert not _valid_cuda(torch.nn.Parameter(c_outs), c_lses)
    with pytest.raises(ValueError, match="disagree"):
        merge_attn_states(outs, torch.randn(2, 1, 3))


def test_poisoned_outputs_are_fully_written(device: torch.device) -> None:
    """With the test plugin's NaN poisoning on, no output element stays NaN (either path)."""
    _needs_triton(device)
    from cpattn_common.alloc import get_output_poison

    assert get_output_poison() is not None
    outs = torch.randn(2, 3, 5, 40, device=device)
    lses = torch.randn(2, 3, 5, device=device)
    for eager in (True, False):
        out, lse = merge_attn_states_fwd(outs, lses, eager=eager)
        assert torch.isfinite(out).all()
        assert torch.isfinite(lse).all()


# ---- sm_90 compile check (no GPU needed) -----------------------------------------------------

_COMPILE_CASES = [
    # (name, N, B, H, D, dtype)
    ("decode-N2", 2, 1, 128, 512, "bf16"),
    ("decode-N8", 8, 1, 128, 512, "bf16"),
    ("mid-N4", 4, 64, 128, 512, "bf16"),
    ("bw-D128-N2", 2, 4096, 64, 128, "bf16"),
    ("bw-D512-N4", 4, 4096, 128, 512, "bf16"),
    ("decode-fp32-D80", 2, 64, 8, 80, "fp32"),
    ("multi-N4", 4, 32, 64, 256, "bf16"),  # EAGER, two heads per program
    ("multi-N8", 8, 64, 64, 128, "bf16"),  # EAGER, four heads per program
]


def _compile_report() -> dict[str, Any]:
    """Compile each case for sm_90; PTX load/store kinds and the SASS order of loads / math."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from cpattn_common.kernels.merge_attn_states import _merge_attn_states_fwd_kernel as kernel

    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    report: dict[str, Any] = {}
    for name, n, b, h, d, dt in _COMPILE_CASES:
        es = 4 if dt == "fp32" else 2
        block_h, block_d, num_warps, eager_cfg = merge_attn_states_config(b, h, d, es)
        eager = eager_cfg or b <= 64  # B=64: also compile the EAGER variant (eager=True)
        consts = {
            "N": n,
            "D": d,
            "BLOCK_H": block_h,
            "BLOCK_D": block_d,
            "VEC": 16 // es,
            "D_CONTIG": True,
            "EAGER": eager,
            "IS_BASE_E": True,
        }
        types = {
            "out_ptr": f"*{dt}",
            "out_lse_ptr": "*fp32",
            "partial_out_ptr": f"*{dt}",
            "partial_lse_ptr": "*fp32",
            "H": "i32",
        }
        names = kernel.arg_names
        sig = {a: "constexpr" if a in consts else types.get(a, "i64") for a in names}
        attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in types if a != "H"}
        compiled = triton.compile(
            ASTSource(kernel, sig, consts, attrs),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": num_warps},
        )
        ptx = compiled.asm["ptx"]
        order: list[str] = []
        if nvdisasm.exists():
            cubin = Path(os.environ.get("TMPDIR", "/tmp")) / f"cpattn_merge_{os.getpid()}.cubin"
            cubin.write_bytes(compiled.asm["cubin"])
            sass = subprocess.run(
                [str(nvdisasm), "-c", str(cubin)], capture_output=True, text=True, check=True
            ).stdout
            cubin.unlink()
            for line in sass.splitlines():
                m = re.search(r"\b(LDG\.E\.(?:128|64)|LDG|STG\.E\.128|STG|MUFU\.EX2|FMNMX)", line)
                if m:
                    op = m.group(1)
                    order.append({"LDG.E.128": "LDG128", "LDG.E.64": "LDG64"}.get(op, op))
        report[name] = {
            "eager_cfg": eager_cfg,
            "multi_head": eager_cfg and block_h > 1,
            # one-head programs with more lanes per thread than one 16-byte vector holds
            "narrow": eager_cfg and block_d >= merge_mod._SMALL_GRID_MIN_D,
            "ld_v4": len(re.findall(r"ld\.global(?:\.\w+)*\.v4\.b32", ptx)),
            "ld_vec": len(re.findall(r"ld\.global(?:\.\w+)*\.v[24]\.b32", ptx)),
            "st_vec": len(re.findall(r"st\.global(?:\.\w+)*\.v[24]\.b32", ptx)),
            "sass": order,
        }
    return report


def test_sm90_compile_vector_loads_and_eager_order() -> None:
    """Vector loads / stores everywhere (16-byte ones but for the narrow decode tiles); where
    the configuration picks the EAGER variant on one-head tiles, every load is issued before
    the first weight computation (one DRAM round trip per program);
    on EAGER tiles of several heads (8-byte partial loads) at least half of the partial loads
    are (ptxas sinks a few at N=8: 2 of 8 with Triton 3.9's, 3 of 8 with Triton 3.6's; in the
    weight-gated order none would be)."""
    require_ptxas()
    # Any other failure is a failure (a broad skip once hid a kernel signature change).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, __file__], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, n, *_ in _COMPILE_CASES:
        r = report[name]
        assert r["st_vec"] >= 1, (name, r)
        # at least one vector load per source (16-byte ones but for the narrow tiles)
        assert r["ld_vec" if r["narrow"] or r["multi_head"] else "ld_v4"] >= n, (name, r)
        order = r["sass"]
        if not (r["eager_cfg"] and order):
            continue
        first_math = min(i for i, op in enumerate(order) if op in ("MUFU.EX2", "FMNMX"))
        if r["multi_head"]:
            vectors = [i for i, op in enumerate(order) if op in ("LDG64", "LDG128")]
            early = sum(i < first_math for i in vectors)
            assert vectors, (name, " ".join(order))
            assert 2 * early >= len(vectors), (name, " ".join(order))
        else:
            last_load = max(i for i, op in enumerate(order) if op.startswith("LDG"))
            assert last_load < first_math, (name, " ".join(order))


# ---- GPU -------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_variants_agree_on_benchmark_shapes(device: torch.device) -> None:
    """Both variants == float64 reference at the benchmark shapes (reduced B) and decode B."""
    for h, d in ((128, 512), (64, 128), (16, 576)):
        for n in (1, 2, 4, 8):
            for b in (1, 8, 40):
                outs, lses = _states(n, b, h, d, dtype=torch.bfloat16, seed=n + d + b)
                outs, lses = outs.to(device), lses.to(device)
                for eager in (True, False):
                    out, lse = merge_attn_states_fwd(outs, lses, eager=eager)
                    _check(out, lse, outs, lses)


@pytest.mark.gpu
def test_gpu_merge_under_cuda_graph(device: torch.device) -> None:
    outs, lses = _states(4, 2, 128, 512, dtype=torch.bfloat16, seed=1)
    outs, lses = outs.to(device), lses.to(device)
    merge_attn_states(outs, lses)  # compile + cache outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = merge_attn_states(outs, lses)
    new_outs, new_lses = _states(4, 2, 128, 512, dtype=torch.bfloat16, seed=2)
    outs.copy_(new_outs.to(device))
    lses.copy_(new_lses.to(device))
    graph.replay()
    torch.cuda.synchronize()
    ref, _ = lse_combine_ref(new_outs, new_lses)
    assert_close_to_ref(out, ref, dtype=torch.bfloat16, name="graph replay")


@pytest.mark.gpu
def test_gpu_variant_bandwidth_report(device: torch.device) -> None:
    """Prints GB/s of both variants at B = 4096 next to a copy (no assert): which to prefer."""
    from triton.testing import do_bench

    def bandwidth(outs: torch.Tensor, lses: torch.Tensor, eager: bool, nbytes: int) -> float:
        t = do_bench(lambda: merge_attn_states_fwd(outs, lses, eager=eager), quantiles=[0.5])
        return float(nbytes / (t * 1e-3) / 1e9)

    def copy_bandwidth(nbytes: int) -> float:
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        t = do_bench(lambda: dst.copy_(src), quantiles=[0.5])
        return float(2 * src.numel() / (t * 1e-3) / 1e9)

    for h, d in ((128, 512), (64, 128)):
        for n in (2, 4, 8):
            b = 4096
            outs = torch.randn(n, b, h, d, device=device, dtype=torch.bfloat16)
            lses = torch.randn(n, b, h, device=device)
            nbytes = (n + 1) * b * h * (d * 2 + 4)
            copy_bw = copy_bandwidth(nbytes)
            line = f"H={h} D={d} N={n}: copy {copy_bw:6.0f} GB/s"
            for eager in (False, True):
                bw = bandwidth(outs, lses, eager, nbytes)
                line += f" | {'eager' if eager else 'gated'} {bw:6.0f} GB/s ({bw / copy_bw:5.1%})"
            print(line)
    default = merge_mod.merge_attn_states_config(4096, 64, 128, 2)
    print(f"default at B=4096 H=64 D=128: {default}")


if __name__ == "__main__":
    print(json.dumps(_compile_report()))
