"""AG+RS, AG+AR and packed A2A combines on real process groups (gloo on CPU, nccl on GPU).

One launch per world size runs every case: decode with interleaved KV shards, ragged
requests, several query rows per request, empty shards (NaN partials, garbage LSEs),
padding rows, fp32/fp16/bf16 outputs, fp32 and 16-bit LSEs, base e and 2, return_lse,
ProcessGroup and CPGroup arguments, plus opcheck and a torch.compile(fullgraph=True) trace.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

from cpattn_common.group import CPGroup, shared_cp_group
from cpattn_dcp import cp_lse_ag_out_ar, cp_lse_ag_out_rs, dcp_a2a_lse_reduce
from cpattn_dcp.comm.groups import group_token
from cpattn_testing.cases import make_dcp_decode_case
from cpattn_testing.dispatch import assert_dispatches
from cpattn_testing.tolerances import assert_close_to_ref, coarsest

# (seq_lens, queries per request, padding rows, out dtype, lse dtype, base e, interleave, D)
CASES: list[tuple[list[int], int, int, torch.dtype, torch.dtype, bool, int, int]] = [
    ([5, 1, 0, 9], 1, 2, torch.bfloat16, torch.float32, True, 1, 32),
    ([3, 7], 3, 1, torch.float16, torch.bfloat16, False, 2, 48),
    ([4, 2, 6], 2, 0, torch.float32, torch.float16, True, 1, 80),
]

OPS = {"ag_rs": cp_lse_ag_out_rs, "ag_ar": cp_lse_ag_out_ar, "a2a": dcp_a2a_lse_reduce}


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def _rank_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_cases(rank: int, n: int, device: torch.device, groups: list[Any], num_cases: int) -> int:
    checks = 0
    for i, (lens, qpr, padding, dtype, lse_dtype, base_e, inter, d) in enumerate(CASES[:num_cases]):
        case = make_dcp_decode_case(
            seq_lens=lens,
            world_size=n,
            num_heads=2 * n,
            head_dim=d,
            queries_per_request=qpr,
            interleave_size=inter,
            padding_rows=padding,
            dtype=dtype,
            lse_dtype=lse_dtype,
            is_lse_base_on_e=base_e,
            device=device,
            seed=1000 + i,
        )
        out_in, lse_in = case.rank_inputs(rank)
        out_bits, lse_bits = _bits(out_in), _bits(lse_in)
        seq_lens = case.local_seq_lens[rank]
        qsl = case.query_start_loc
        h = 2 * n
        hr = h // n
        own = slice(rank * hr, (rank + 1) * hr)
        for j, (name, op) in enumerate(OPS.items()):
            group = groups[(i + j) % len(groups)]
            return_lse = (i + j) % 2 == 0
            res = op(
                out_in,
                lse_in,
                group,
                return_lse=return_lse,
                is_lse_base_on_e=base_e,
                seq_lens=seq_lens,
                query_start_loc=qsl,
            )
            out, lse = res if return_lse else (res, None)
            assert isinstance(out, torch.Tensor)
            heads = slice(None) if name == "ag_ar" else own
            tag = f"case {i} {name} rank {rank}/{n}"
            assert out.dtype == dtype, tag
            assert_close_to_ref(
                out, case.ref_out[:, heads], dtype=coarsest(dtype, lse_dtype), name=tag
            )
            if return_lse:
                assert lse is not None
                want_dtype = torch.float32 if name == "a2a" else lse_dtype
                assert lse.dtype == want_dtype, tag
                assert_close_to_ref(lse, case.ref_lse[:, heads], dtype=lse_dtype, name=tag + " lse")
            # Inputs are never modified.
            assert torch.equal(_bits(out_in), out_bits), tag
            assert torch.equal(_bits(lse_in), lse_bits), tag
            checks += 1
    return checks


def _check_unmasked(rank: int, n: int, device: torch.device, group: Any) -> int:
    """No empty shards, no padding: the mask arguments can be omitted."""
    case = make_dcp_decode_case(
        seq_lens=[2 * n + 1, 3 * n],
        world_size=n,
        num_heads=n,
        head_dim=16,
        dtype=torch.float32,
        device=device,
        seed=7,
    )
    out_in, lse_in = case.rank_inputs(rank)
    for name, op in OPS.items():
        out = op(out_in, lse_in, group)
        heads = slice(None) if name == "ag_ar" else slice(rank, rank + 1)
        assert_close_to_ref(out, case.ref_out[:, heads], dtype=torch.float32, name=name)
    return len(OPS)


def _opcheck(rank: int, n: int, device: torch.device, group: Any) -> int:
    gen = torch.Generator().manual_seed(3)
    out = torch.randn(3, 2 * n, 16, generator=gen).to(device)
    lse = torch.randn(3, 2 * n, generator=gen).to(device)
    sl = torch.tensor([1, 0], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
    tok = group_token(group)
    for op in (
        torch.ops.cpattn_dcp.cp_lse_ag_out_rs.default,
        torch.ops.cpattn_dcp.cp_lse_ag_out_ar.default,
        torch.ops.cpattn_dcp.dcp_a2a_lse_reduce.default,
    ):
        for return_lse, masks in ((True, (sl, qsl)), (False, (None, None))):
            torch.library.opcheck(op, (out, lse, tok, n, rank, return_lse, True, *masks))
    return 6


def _compile_check(rank: int, n: int, device: torch.device, group: Any) -> int:
    case = make_dcp_decode_case(
        seq_lens=[3, 0, 5],
        world_size=n,
        num_heads=2 * n,
        head_dim=16,
        padding_rows=1,
        dtype=torch.float32,
        device=device,
        seed=5,
    )
    out_in, lse_in = case.rank_inputs(rank)
    sl, qsl = case.local_seq_lens[rank], case.query_start_loc

    def fn(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, ...]:
        o = o * 1.0
        a, la = cp_lse_ag_out_rs(o, lse, group, return_lse=True, seq_lens=sl, query_start_loc=qsl)
        b = cp_lse_ag_out_ar(o, lse, group, seq_lens=sl, query_start_loc=qsl)
        c, lc = dcp_a2a_lse_reduce(o, lse, group, return_lse=True, seq_lens=sl, query_start_loc=qsl)
        return a + 0.0, la, b, c, lc

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(out_in, lse_in), fn(out_in, lse_in), strict=True):
        torch.testing.assert_close(got, want, equal_nan=True)
    return 1


def _dispatch_check(rank: int, n: int, device: torch.device, group: Any) -> int:
    """FakeTensorMode, make_fx and any TorchDispatchMode go through the registered ops (the
    eager shortcut ran the collectives and kernels under them); a non-bool base flag is a
    TypeError (bool(None) silently meant base 2)."""
    gen = torch.Generator().manual_seed(4)
    out = torch.randn(3, 2 * n, 16, generator=gen).to(device)
    lse = torch.randn(3, 2 * n, generator=gen).to(device)
    sl = torch.tensor([1, 0], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
    for fn in OPS.values():

        def call(
            o: torch.Tensor, s: torch.Tensor, a: torch.Tensor, b: torch.Tensor, fn: Any = fn
        ) -> Any:
            return fn(o, s, group, return_lse=True, seq_lens=a, query_start_loc=b)

        assert_dispatches(call, (out, lse, sl, qsl), f"cpattn_dcp.{fn.__name__}.default")
        with pytest.raises(TypeError, match="is_lse_base_on_e must be a bool, got None"):
            fn(out, lse, group, is_lse_base_on_e=None)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="return_lse must be a bool, got 'no'"):
            fn(out, lse, group, return_lse="no")  # type: ignore[call-overload]
    return len(OPS)


def _rank_main(rank: int, world_size: int, with_extras: bool, num_cases: int) -> int:
    warnings.filterwarnings("ignore", category=RuntimeWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    device = _rank_device()
    world = dist.group.WORLD
    groups: list[Any] = [world, CPGroup(world)]
    checks = _check_cases(rank, world_size, device, groups, num_cases)
    checks += _check_unmasked(rank, world_size, device, groups[1])
    if with_extras:
        checks += _opcheck(rank, world_size, device, world)
        # A CPGroup and a shared wrapper stand for their process group in the graph (torch
        # 2.11's dynamo could not pass them to the trace-time token functions).
        for group in (world, CPGroup(world), shared_cp_group(world)):
            checks += _compile_check(rank, world_size, device, group)
        checks += _dispatch_check(rank, world_size, device, world)
    return checks


# World size 8 runs one case only: 8 interpreted ranks on a small CPU machine are slow.
@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_combines(run_ranks: Any, world_size: int) -> None:
    with_extras = world_size == 2
    num_cases = 1 if world_size == 8 else len(CASES)
    results = run_ranks(_rank_main, world_size, with_extras, num_cases, timeout=400.0)
    expected = num_cases * len(OPS) + len(OPS) + (9 + len(OPS) if with_extras else 0)
    assert results == [expected] * world_size
