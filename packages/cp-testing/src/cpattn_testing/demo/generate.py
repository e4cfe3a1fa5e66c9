"""Prefill with PCP (:func:`prefill`), a KV cache sharded across the same ranks as DCP
(:class:`KVShard`), and greedy decoding (:func:`generate`) whose partial attention a
:class:`Combiner` merges every step; some steps verify a drafted token.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from typing import Any

import torch

from cpattn_testing.demo.model import TinyLM

#: The combines, in the order the demo runs them.
PATHS = ("ag_rs", "ag_ar", "a2a", "direct", "manager")


class PathUnavailable(Exception):
    """A combine that cannot run here (the direct path's capability gate said no)."""


class KVShard:
    """This rank's share of the KV cache: ``capacity`` local slots per request and layer.

    Position ``p`` belongs to rank ``(p // I) % N`` (blocks of ``I`` positions dealt
    round-robin), at local slot ``(p // (N*I)) * I + p % I``: a rank's keys stay in position
    order, so a query at position ``p`` sees a prefix of them (:meth:`visible`).

    Args:
        model: the model (layer count, KV heads and dims, dtype).
        num_requests: ``R``.
        capacity: local slots per request (``>= visible(longest sequence - 1)``).
        rank, world_size, interleave: ``r``, ``N``, ``I``.
        device: where the cache lives.
    """

    def __init__(self, model: TinyLM, num_requests: int, capacity: int, rank: int,
                 world_size: int, interleave: int, device: torch.device) -> None:  # fmt: skip
        c = model.config
        self.rank, self.world_size, self.interleave = rank, world_size, interleave
        self.capacity, self.device = capacity, device
        rows = num_requests * capacity
        self.keys = [torch.zeros(rows, c.num_kv_heads, c.key_dim, dtype=c.dtype, device=device)
                     for _ in range(c.layers)]  # fmt: skip
        self.values: list[torch.Tensor | None] = [
            torch.zeros(rows, c.num_kv_heads, c.head_dim, dtype=c.dtype, device=device)
            if c.variant == "gqa" else None  # MLA: the value is the key row's latent part
            for _ in range(c.layers)
        ]  # fmt: skip
        #: global KV length of each request (positions 0 .. seq_len - 1 are cached somewhere)
        self.seq_lens = [0] * num_requests

    def owner(self, pos: Any) -> Any:
        """Rank of position(s) ``pos`` (int or int64 tensor)."""
        return (pos // self.interleave) % self.world_size

    def slot(self, req: Any, pos: Any) -> Any:
        """Row of position ``pos`` of request ``req`` in this rank's cache tensors."""
        n, i = self.world_size, self.interleave
        return req * self.capacity + (pos // (n * i)) * i + pos % i

    def visible(self, pos: int) -> int:
        """How many of this rank's positions are ``<= pos`` (its keys a query at ``pos`` sees)."""
        blocks, rest = divmod(pos + 1, self.world_size * self.interleave)
        return blocks * self.interleave + min(max(rest - self.rank * self.interleave, 0),
                                              self.interleave)  # fmt: skip

    def local_lens(self) -> list[int]:
        """This rank's cached tokens per request."""
        return [self.visible(n - 1) for n in self.seq_lens]

    def write(
        self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None
    ) -> None:
        """Store rows ``k [T, Hkv, Dk]`` / ``v [T, Hkv, Dv]`` at ``slots [T]`` (``-1``: skip)."""
        keep = slots >= 0
        self.keys[layer][slots[keep]] = k[keep]
        values = self.values[layer]
        if values is not None and v is not None:
            values[slots[keep]] = v[keep]

    def layer_kv(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` of layer ``layer``: ``[R, Hkv, length, D]`` views of every request's
        first ``length`` local slots (MLA: ``v`` is ``k``)."""
        keys = self.keys[layer].view(-1, self.capacity, *self.keys[layer].shape[1:])[:, :length]
        values = self.values[layer]
        if values is None:  # MLA: the key rows hold the value (TinyLM.attend)
            v = keys
        else:
            v = values.view(-1, self.capacity, *values.shape[1:])[:, :length]
        return keys.transpose(1, 2), v.transpose(1, 2)

    def clone(self) -> KVShard:
        other = KVShard.__new__(KVShard)
        other.__dict__.update(self.__dict__)
        other.keys = [k.clone() for k in self.keys]
        other.values = [None if v is None else v.clone() for v in self.values]
        other.seq_lens = list(self.seq_lens)
        return other


def prefill(
    model: TinyLM, shard: KVShard, prompts: Sequence[Sequence[int]], group: Any
) -> torch.Tensor:
    """Run the prompts through the model, fill ``shard``, return logits ``[R, V]`` (float32) of
    each prompt's last token, on every rank.

    With ``group`` the prompts are split by DualChunkSwap across its ranks; without it, one
    rank runs them whole without any library op (``shard`` a one-rank shard).
    """
    from cpattn_pcp import (
        dual_chunk_swap,
        gather_prefill_qkv_global,
        maybe_gather_kv_cache_inputs,
        maybe_gather_mla_latent_cache_inputs,
        slice_prefill_output_local,
    )

    dev, rank = shard.device, shard.rank
    lens = [len(p) for p in prompts]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    ids = torch.tensor([t for p in prompts for t in p], device=dev)
    pos = torch.cat([torch.arange(n) for n in lens]).to(dev)
    req = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)).to(dev)
    plan = None
    if group is None:
        x = model.embed(ids, pos)
        slots = shard.slot(req, pos)
    else:
        plan = dual_chunk_swap(lens, shard.world_size, device=dev)
        x = model.embed(plan.local_rows(ids, rank), plan.local_rows(pos, rank))
        # The rank-major slot mapping [N * P]: -1 for padding or another rank's position.
        p_all = plan.local_positions
        mine = plan.local_is_real & (shard.owner(p_all) == rank)
        slots = torch.where(mine, shard.slot(plan.local_request_idx, p_all), -1).reshape(-1)
    c = model.config
    for layer in range(c.layers):
        q, k, v = model.project(layer, x)
        if plan is None:
            shard.write(layer, slots, k, v)
        elif c.variant == "mla":
            latent, rope, s = maybe_gather_mla_latent_cache_inputs(
                k[:, 0, : c.head_dim], k[:, :, c.head_dim :], slots, 0, True, pcp_group=group
            )
            shard.write(layer, s, torch.cat([latent, rope.flatten(1)], -1).unsqueeze(1), None)
        else:
            k_rows, v_rows, s = maybe_gather_kv_cache_inputs(k, v, slots, 0, True, pcp_group=group)
            shard.write(layer, s, k_rows, v_rows)
        if plan is not None:
            q, k, v = gather_prefill_qkv_global(plan, q, k, v, pcp_group=group)
        out = torch.cat([
            model.attend(*(t[a:b].transpose(0, 1)[None] for t in (q, k, v)), causal=True)[0][0]
            for a, b in itertools.pairwise(cu)
        ], dim=1).transpose(0, 1)  # fmt: skip
        if plan is not None:
            out = slice_prefill_output_local(plan, out, x.shape[0], pcp_group=group)
        x = model.finish_layer(layer, x, out)
    if plan is not None:
        x = plan.restore(group.all_gather(x, dim=0))  # every rank's rows, in global order
    shard.seq_lens = lens
    return model.logits(x[torch.tensor(cu[1:], device=dev) - 1])


class Combiner:
    """Turns a decode step's partial attention into every head's output; this base class is
    the one-rank reference (its partial is the whole attention, no library op)."""

    def project(
        self, model: TinyLM, layer: int, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return model.project(layer, x)

    def combine(self, layer: int, out: torch.Tensor, lse: torch.Tensor,
                seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """``out [T, H, Dv]``, ``lse [T, H]`` (this rank's partials), this rank's KV lengths
        ``seq_lens [R]`` and ``query_start_loc [R+1]`` -> ``[T, H, Dv]``."""
        return out


class LibraryCombiner(Combiner):
    """One of :data:`PATHS` over ``group``; ``finalize_mla_pcp_decode`` gathers the heads
    back. ``manager``: each rank projects its ``H/N`` query heads and one ``DCPManager`` per
    layer gathers the query and combines. ``fault`` raises rank 0's LSE by 2 (a test hook).

    Raises:
        PathUnavailable: ``direct`` where the capability gate says no (collective: every rank
            raises it together).
    """

    def __init__(self, name: str, group: Any, model: TinyLM, max_rows: int, fault: bool) -> None:
        import cpattn_dcp
        from cpattn_dcp.direct import direct_a2a_unavailable_reason, get_direct_dcp_a2a_workspace
        from cpattn_pcp import finalize_mla_pcp_decode

        if name not in PATHS:
            raise ValueError(f"unknown path {name!r}; expected one of {PATHS}")
        c = model.config
        self.group, self.heads = group, c.heads
        n, self.rank = group.world_size, group.rank_in_group
        self.own = slice(self.rank * c.heads // n, (self.rank + 1) * c.heads // n)
        self.fault = fault and self.rank == 0
        self.finalize = finalize_mla_pcp_decode
        device = model.embedding.device
        self.call: Any = {
            "ag_rs": cpattn_dcp.cp_lse_ag_out_rs,
            "ag_ar": cpattn_dcp.cp_lse_ag_out_ar,
            "a2a": cpattn_dcp.dcp_a2a_lse_reduce,
        }.get(name)
        if name == "direct":
            ws = get_direct_dcp_a2a_workspace(group, device, max_rows, c.heads // n, c.head_dim,
                                              c.dtype)  # fmt: skip
            if ws is None:
                raise PathUnavailable(direct_a2a_unavailable_reason(group, c.dtype, device=device))
            self.call = lambda out, lse, _group, **kw: ws.lse_reduce(out, lse, **kw)
        self.managers = [
            cpattn_dcp.DCPManager(
                cpattn_dcp.DCPConfig(comm_backend="auto", max_num_tokens=max_rows),
                group,
                device,
                num_heads=c.heads // n,
                head_dim=c.head_dim,
                dtype=c.dtype,
                query_head_dim=c.key_dim,
            )
            for _ in range(c.layers if name == "manager" else 0)
        ]

    def project(
        self, model: TinyLM, layer: int, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self.managers:
            return model.project(layer, x)
        q, k, v = model.project(layer, x, heads=self.own)
        return self.managers[layer].query_gather(q), k, v

    def combine(self, layer: int, out: torch.Tensor, lse: torch.Tensor,
                seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:  # fmt: skip
        if self.fault:
            lse = lse + 2.0
        if self.managers:
            result = self.managers[layer].combine(
                out, lse, seq_lens=seq_lens, query_start_loc=query_start_loc
            )
        else:
            result = self.call(out, lse, self.group, seq_lens=seq_lens,
                               query_start_loc=query_start_loc)  # fmt: skip
        assert isinstance(result, torch.Tensor)
        return self.finalize(result, self.heads, pcp_group=self.group)

    def describe(self) -> str:
        """Which implementation the manager selected (empty for the other paths)."""
        if not self.managers:
            return ""
        sel = self.managers[0].selection
        return f"combine={sel.combine}, query_gather={sel.query_gather}"


def decode_step(
    model: TinyLM, shard: KVShard, feed: Sequence[Sequence[int]], combiner: Combiner
) -> torch.Tensor:
    """One forward pass of ``tq = len(feed[b])`` new tokens per request (the same ``tq`` for
    all), at the positions following each request's cache. Appends their K/V on the owning
    rank and returns logits ``[R, tq, V]`` (float32)."""
    c, dev = model.config, shard.device
    r, tq = len(feed), len(feed[0])
    pos = [[n + j for j in range(tq)] for n in shard.seq_lens]
    slots = torch.tensor([shard.slot(b, p) if shard.owner(p) == shard.rank else -1
                          for b, row in enumerate(pos) for p in row], device=dev)  # fmt: skip
    visible = torch.tensor([[shard.visible(p) for p in row] for row in pos], device=dev)
    shard.seq_lens = [n + tq for n in shard.seq_lens]
    lens = shard.local_lens()
    local_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    query_start_loc = torch.arange(0, (r + 1) * tq, tq, dtype=torch.int32, device=dev)
    keys = max(lens)
    x = model.embed(
        torch.tensor(feed, device=dev).flatten(), torch.tensor(pos, device=dev).flatten()
    )
    for layer in range(c.layers):
        q, k, v = combiner.project(model, layer, x)
        shard.write(layer, slots, k, v)
        out, lse = model.attend(q.view(r, tq, c.heads, -1).transpose(1, 2),
                                *shard.layer_kv(layer, keys), visible=visible)  # fmt: skip
        out = out.transpose(1, 2).reshape(r * tq, c.heads, c.head_dim)
        lse = lse.transpose(1, 2).reshape(r * tq, c.heads)
        attn = combiner.combine(layer, out, lse, local_lens, query_start_loc)
        x = model.finish_layer(layer, x, attn)
    return model.logits(x).view(r, tq, -1)


def draft_token(context: Sequence[int]) -> int:
    """Prompt-lookup draft: the token that followed the last token's latest earlier
    occurrence in ``context``, else the last token itself."""
    last = context[-1]
    for i in range(len(context) - 2, -1, -1):
        if context[i] == last:
            return context[i + 1]
    return last


@dataclasses.dataclass
class Generation:
    """Greedy tokens ``[R][n]`` with the float32 logits ``[R, n, V]`` (CPU) that chose them,
    wall time of each decode step, and the verified drafts' fate."""

    tokens: list[list[int]]
    logits: torch.Tensor
    step_s: list[float]
    accepted: int = 0
    rejected: int = 0
    note: str = ""


def generate(
    model: TinyLM,
    shard: KVShard,
    prompts: Sequence[Sequence[int]],
    first_logits: torch.Tensor,
    combiner: Combiner,
    *,
    new_tokens: int,
    verify_every: int = 0,
) -> Generation:
    """Greedy decoding of ``new_tokens`` tokens per request after :func:`prefill`; every
    ``verify_every``-th step (0: never) also feeds a drafted token (:func:`draft_token`),
    accepted when it equals the greedy choice, else its K/V are dropped. The tokens are those
    of plain greedy decoding either way.
    """
    r = len(prompts)
    tokens = [[int(first_logits[b].argmax())] for b in range(r)]
    logits = [[first_logits[b]] for b in range(r)]
    gen = Generation(tokens, torch.empty(0), [])

    def sync() -> None:
        if shard.device.type == "cuda":
            torch.cuda.synchronize(shard.device)

    step = 0
    while min(len(t) for t in tokens) < new_tokens:
        step += 1
        verify = verify_every > 0 and step % verify_every == 0
        feed = [[t[-1], draft_token([*p, *t])] if verify else [t[-1]]
                for p, t in zip(prompts, tokens, strict=True)]  # fmt: skip
        sync()
        start = time.perf_counter()
        out = decode_step(model, shard, feed, combiner)
        sync()
        gen.step_s.append(time.perf_counter() - start)
        for b in range(r):
            choice = int(out[b, 0].argmax())
            tokens[b].append(choice)
            logits[b].append(out[b, 0])
            if not verify:
                continue
            if choice == feed[b][1]:
                gen.accepted += 1
                tokens[b].append(int(out[b, 1].argmax()))
                logits[b].append(out[b, 1])
            else:
                gen.rejected += 1
                shard.seq_lens[b] -= 1  # the draft's K/V slot is free again
    gen.tokens = [t[:new_tokens] for t in tokens]
    gen.logits = torch.stack([torch.stack(row[:new_tokens]) for row in logits]).cpu()
    return gen
