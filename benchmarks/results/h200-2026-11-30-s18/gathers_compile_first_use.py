"""The group-taking gathers of cp-dcp and cp-pcp under torch.compile(fullgraph=True), compiled
before any eager call resolved their group (a world-size-1 gloo group, a CPGroup over it and a
user CPGroupLike), then again after one eager call. Before the eighteenth session's
shared_cp_group change the first compile failed (its memo miss did not trace)."""

import os
import tempfile
import warnings

import torch
import torch.distributed as dist

from cpattn_common import CPGroup
from cpattn_dcp import cp_lse_ag_out_rs, dcp_gather_kv, dcp_gather_query
from cpattn_pcp import (
    dual_chunk_swap,
    finalize_mla_pcp_decode,
    gather_prefill_qkv_global,
    maybe_all_gather_q_for_dcp,
    maybe_gather_kv_cache_inputs,
    slice_prefill_output_local,
)

warnings.filterwarnings("ignore")
fd, store = tempfile.mkstemp()
os.close(fd)
dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
q = torch.randn(3, 2, 4)
k = torch.randn(4, 2, 3)
v = torch.randn(4, 2, 5)
sm = torch.arange(4)
plan = dual_chunk_swap([3, 2], 1)
cases = {
    "dcp_gather_query": lambda g: (lambda q: dcp_gather_query(q, g), (q,)),
    "dcp_gather_kv": lambda g: (
        lambda b, x: dcp_gather_kv(b, x, g) * 1,
        (torch.zeros(4, 4), torch.randn(3, 4)),
    ),
    "maybe_gather_kv_cache_inputs": lambda g: (
        lambda k, v, s: maybe_gather_kv_cache_inputs(k, v, s, 2, True, pcp_group=g),
        (k, v, sm),
    ),
    "gather_prefill_qkv_global": lambda g: (
        lambda a: gather_prefill_qkv_global(plan, a, a, a, pcp_group=g),
        (torch.randn(plan.padded_local_len, 2, 4),),
    ),
    "slice_prefill_output_local": lambda g: (
        lambda a: slice_prefill_output_local(plan, a, 2, pcp_group=g),
        (torch.randn(5, 3),),
    ),
    "finalize_mla_pcp_decode (gather)": lambda g: (
        lambda a: finalize_mla_pcp_decode(a, 2, pcp_group=g) * 1,
        (q,),
    ),
    "cp_lse_ag_out_rs (for contrast)": lambda g: (
        lambda a, b: cp_lse_ag_out_rs(a, b, g),
        (torch.randn(3, 4, 8), torch.randn(3, 4)),
    ),
}
for kind in ("ProcessGroup", "CPGroup"):
    for name, mk in cases.items():
        g = dist.new_group([0])  # a group no op has resolved yet
        if kind == "CPGroup":
            g = CPGroup(g)
        fn, args = mk(g)
        torch._dynamo.reset()
        try:
            torch.compile(fn, fullgraph=True, backend="eager")(*args)
            first = "ok"
        except Exception as e:
            first = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        fn(*args)  # eager call resolves (memoises) the group
        torch._dynamo.reset()
        torch.compile(fn, fullgraph=True, backend="eager")(*args)
        print(f"{kind:12s} {name:34s} first call compiled: {first:45s} | after an eager call: ok")

# The same with a user CPGroupLike of world size 2 (all peers hold the same data) for the heads helpers.


class Loopback:
    world_size, rank_in_group, device_group = 2, 0, None

    def all_gather(self, t, dim=-1):
        return torch.cat([t, t], dim=dim)

    def reduce_scatter(self, t, dim=-1):
        return (2 * t).chunk(2, dim)[0].contiguous()

    def all_reduce(self, t):
        return 2 * t

    def all_to_all_single(self, out, inp):
        out.copy_(torch.cat([inp.chunk(2)[0]] * 2))

    def all_gather_into_tensor(self, out, inp):
        out.copy_(torch.cat([inp, inp]))

    def barrier(self):
        pass


for name, mk in {
    "maybe_all_gather_q_for_dcp": lambda g: (
        lambda a: maybe_all_gather_q_for_dcp(a, 2, 1, dcp_group=g)
    ),
    "finalize_mla_pcp_decode (gather)": lambda g: (
        lambda a: finalize_mla_pcp_decode(a, 4, pcp_group=g)
    ),
}.items():
    g = Loopback()
    fn = mk(g)
    torch._dynamo.reset()
    try:
        torch.compile(fn, fullgraph=True, backend="eager")(q)
        first = "ok"
    except Exception as e:
        first = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    fn(q)
    torch._dynamo.reset()
    torch.compile(fn, fullgraph=True, backend="eager")(q)
    print(
        f"{'CPGroupLike':12s} {name:34s} first call compiled: {first:45s} | after an eager call: ok"
    )
