"""The demo's model: a small pre-norm decoder-only transformer with deterministic random
weights, in a ``"gqa"`` variant or an ``"mla"``-like one (one latent KV head whose cached row
``[latent (C) | decoupled key part (R)]`` is the key, its first ``C`` elements the value).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

VARIANTS = ("gqa", "mla")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes of a :class:`TinyLM`.

    ``head_dim`` is the value dim ``Dv`` (MLA: the latent dim ``C``); ``rope_dim`` the
    decoupled key part ``R`` of the MLA variant (0 for GQA), so keys and queries have
    ``Dk = head_dim + rope_dim``. ``kv_heads`` is forced to 1 for MLA.
    """

    variant: str = "gqa"
    layers: int = 2
    vocab: int = 512
    hidden: int = 256
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    rope_dim: int = 0
    max_positions: int = 256
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {self.variant!r}")
        sizes = {"layers": self.layers, "vocab": self.vocab, "hidden": self.hidden,
                 "heads": self.heads, "kv_heads": self.kv_heads, "head_dim": self.head_dim,
                 "max_positions": self.max_positions}  # fmt: skip
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.rope_dim < 0 or (self.variant == "gqa" and self.rope_dim):
            raise ValueError(f"rope_dim must be >= 0 (0 for gqa), got {self.rope_dim}")
        if self.heads % self.num_kv_heads:
            raise ValueError(f"heads {self.heads} not divisible by kv_heads {self.kv_heads}")

    @property
    def num_kv_heads(self) -> int:
        return 1 if self.variant == "mla" else self.kv_heads

    @property
    def key_dim(self) -> int:
        return self.head_dim + self.rope_dim


@dataclasses.dataclass(frozen=True)
class _Layer:
    wq: torch.Tensor  # [E, H * Dk]
    wk: torch.Tensor  # [E, Hkv * Dk]
    wv: torch.Tensor | None  # [E, Hkv * Dv]; None for MLA
    wo: torch.Tensor  # [H * Dv, E]
    w1: torch.Tensor  # [E, 2E]
    w2: torch.Tensor  # [2E, E]


def _rms_norm(x: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


class TinyLM:
    """Weights drawn from ``torch.Generator().manual_seed(seed)`` (the same on every rank).

    Args:
        config: the sizes.
        seed: the weights' seed.
        device: where the weights live.
    """

    def __init__(self, config: ModelConfig, seed: int, device: torch.device) -> None:
        self.config = c = config
        gen = torch.Generator().manual_seed(seed)

        def weight(rows: int, cols: int, std: float | None = None) -> torch.Tensor:
            w = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
            return (w * (std if std is not None else rows**-0.5)).to(device, c.dtype)

        hkv, dk, dv = c.num_kv_heads, c.key_dim, c.head_dim
        self.embedding = weight(c.vocab, c.hidden, 1.0)
        self.positions = weight(c.max_positions, c.hidden, 0.5)
        self.layers = [
            _Layer(
                wq=weight(c.hidden, c.heads * dk),
                wk=weight(c.hidden, hkv * dk),
                # MLA: the value is the latent part of the key row, no projection of its own.
                wv=weight(c.hidden, hkv * dv) if c.variant == "gqa" else None,
                wo=weight(c.heads * dv, c.hidden),
                w1=weight(c.hidden, 2 * c.hidden),
                w2=weight(2 * c.hidden, c.hidden),
            )
            for _ in range(c.layers)
        ]
        self.unembedding = weight(c.hidden, c.vocab)
        self.scale = dk**-0.5

    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[T, E]`` of tokens ``ids [T]`` at ``positions [T]``."""
        if int(positions.max()) >= self.config.max_positions:
            raise ValueError(f"position {int(positions.max())} >= max_positions")
        return self.embedding[ids] + self.positions[positions]

    def project(
        self, layer: int, x: torch.Tensor, heads: slice | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q [T, h, Dk]`` (query heads ``heads``, default all ``H``), ``k [T, Hkv, Dk]``,
        ``v [T, Hkv, Dv]`` of ``x [T, E]`` in layer ``layer`` (MLA: ``v`` is a view of ``k``)."""
        c, w = self.config, self.layers[layer]
        h = _rms_norm(x)
        wq = w.wq
        if heads is not None:
            wq = wq[:, heads.start * c.key_dim : heads.stop * c.key_dim]
        q = (h @ wq).view(x.shape[0], -1, c.key_dim)
        k = (h @ w.wk).view(x.shape[0], c.num_kv_heads, c.key_dim)
        v = k[..., : c.head_dim] if w.wv is None else (h @ w.wv).view(k.shape[0], -1, c.head_dim)
        return q, k, v

    def finish_layer(self, layer: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The residual stream after layer ``layer``, from its attention output ``[T, H, Dv]``."""
        w = self.layers[layer]
        x = x + attn.reshape(x.shape[0], -1) @ w.wo
        return x + F.silu(_rms_norm(x) @ w.w1) @ w.w2

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool = False,
        visible: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`attention_with_lse` of ``q [B, H, Tq, Dk]`` over ``k [B, Hkv, S, Dk]``,
        ``v [B, Hkv, S, Dv]``: ``(out [B, H, Tq, Dv], lse [B, H, Tq])``. MLA attends the key
        rows as values, whose first ``Dv`` output columns are the latent's."""
        if self.config.variant == "mla":
            v = k
        out, lse = attention_with_lse(q, k, v, scale=self.scale, causal=causal, visible=visible)
        return out[..., : self.config.head_dim], lse

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, V]`` float32 logits of the final hidden states ``x [T, E]``."""
        return (_rms_norm(x) @ self.unembedding).float()


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool = False,
    visible: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention and its natural-log LSE through PyTorch's fused kernels.

    A row that sees no key gets output 0 and LSE ``-inf`` (the convention of the DCP combines).

    Args:
        q: ``[B, H, Tq, D]``.
        k: ``[B, Hkv, S, D]`` (``H % Hkv == 0``).
        v: ``[B, Hkv, S, D]`` (the same ``D``).
        scale: softmax scale.
        causal: causal mask (with ``Tq == S``: query ``i`` sees keys ``<= i``).
        visible: ``[B, Tq]`` integers: query row ``t`` of ``b`` sees the first
            ``visible[b, t]`` keys (not with ``causal``).

    Returns:
        ``(out [B, H, Tq, D] in q's dtype, lse [B, H, Tq] float32)``.
    """
    b, h, tq, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    if s == 0:
        return q.new_zeros(b, h, tq, d), q.new_full((b, h, tq), -math.inf, dtype=torch.float32)
    groups = h // hkv
    rows = tq
    if groups > 1 and not causal:
        q, rows = q.reshape(b, hkv, groups * tq, d), groups * tq
        visible = None if visible is None else visible.repeat(1, groups)
    elif groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    bias = None
    if visible is not None:
        # An additive mask [B, 1, rows, S], its storage padded to 16 keys for the CUDA kernel.
        padded = -(-s // 16) * 16
        full = torch.full((b, 1, rows, padded), -math.inf, dtype=q.dtype, device=q.device)
        seen = torch.arange(padded, device=q.device) < visible[:, None, :, None]
        bias = full.masked_fill_(seen, 0.0)[..., :s]
    if q.device.type == "cuda":
        if bias is not None:
            bias = bias.expand(b, q.shape[1], rows, s)
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, True, 0.0, causal, scale=scale
        )[:2]
        lse = lse[..., :rows]  # the kernel pads the LSE's query dim to 32
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=bias, scale=scale
        )
    lse = lse.float()
    if visible is not None:
        lse = lse.masked_fill(visible[:, None, :] == 0, -math.inf)
    return out.reshape(b, h, tq, d), lse.reshape(b, h, tq)
