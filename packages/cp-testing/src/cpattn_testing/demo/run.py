"""What each rank runs, and the verdict: a path passes when every rank generated the one-rank
reference's tokens with logits within the dtype's ``rtol``; a token that differs at a near-tie
ends that request's comparison with a note.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from cpattn_testing.demo.generate import (
    PATHS,
    Combiner,
    Generation,
    KVShard,
    LibraryCombiner,
    PathUnavailable,
    generate,
    prefill,
)
from cpattn_testing.demo.model import VARIANTS, ModelConfig, TinyLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Everything a rank needs (pickled to the ranks). Defaults: the demo's own run."""

    world_size: int = 4
    backend: str = "gloo"
    dtype: str = "float32"
    variants: tuple[str, ...] = VARIANTS
    paths: tuple[str, ...] = PATHS
    prompt_lens: tuple[int, ...] = (1, 5, 37, 64)
    new_tokens: int = 32
    verify_every: int = 10
    interleave: int = 4
    layers: int = 2
    hidden: int = 256
    vocab: int = 512
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    latent_dim: int = 128
    rope_dim: int = 32
    seed: int = 0
    progress: bool = True
    fault: tuple[str, ...] = ()  # test hook: "variant/path" names whose rank 0 LSE is skewed

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        bad = [v for v in self.variants if v not in VARIANTS] + [
            p for p in self.paths if p not in PATHS
        ]
        if bad or not self.variants or not self.paths:
            raise ValueError(
                f"unknown or no variants/paths {bad}: variants {VARIANTS}, paths {PATHS}"
            )
        counts = {"world_size": self.world_size, "new_tokens": self.new_tokens,
                  "interleave": self.interleave, "heads": self.heads}  # fmt: skip
        for name, value in counts.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not self.prompt_lens or min(self.prompt_lens) < 1 or self.verify_every < 0:
            raise ValueError(f"prompt lengths must be >= 1 and verify_every >= 0, got "
                             f"{self.prompt_lens}, {self.verify_every}")  # fmt: skip
        if self.heads % self.world_size:
            raise ValueError(f"heads {self.heads} must be divisible by the world size "
                             f"{self.world_size}")  # fmt: skip
        for variant in self.variants:
            self.model_config(variant)  # its own checks

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def max_len(self) -> int:
        """Positions a request may reach: its prompt, up to twice ``new_tokens`` (accepted
        drafts run ahead while other requests catch up) and a draft."""
        return max(self.prompt_lens) + 2 * self.new_tokens + 1

    def model_config(self, variant: str) -> ModelConfig:
        mla = variant == "mla"
        return ModelConfig(
            variant=variant, layers=self.layers, vocab=self.vocab, hidden=self.hidden,
            heads=self.heads, kv_heads=1 if mla else self.kv_heads,
            head_dim=self.latent_dim if mla else self.head_dim,
            rope_dim=self.rope_dim if mla else 0, max_positions=self.max_len,
            dtype=self.torch_dtype,
        )  # fmt: skip

    def prompts(self) -> list[list[int]]:
        """Deterministic random prompts of ``prompt_lens`` tokens."""
        gen = torch.Generator().manual_seed(self.seed + 1)
        return [
            torch.randint(0, self.vocab, (n,), generator=gen).tolist() for n in self.prompt_lens
        ]


def _say(enabled: bool, text: str) -> None:
    if enabled:
        print(text, file=sys.stderr, flush=True)


def rank_main(rank: int, world_size: int, cfg: DemoConfig) -> dict[str, Any]:
    """Every rank's body (module level, so the launcher can pickle it): the prefill once per
    variant, then the decode loop once per path. Rank 0 also runs the reference.

    Returns:
        ``{"reference": {variant: Generation} (rank 0 only), "paths": {"variant/path":
        Generation | "skipped: reason"}}``; ranks other than 0 return empty logits.
    """
    import torch.distributed as dist

    from cpattn_common import as_cp_group, set_output_poison

    if world_size != cfg.world_size:
        raise ValueError(f"launched with world_size={world_size}, config says {cfg.world_size}")
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.backend == "nccl" else (
        torch.device("cpu"))  # fmt: skip
    group = as_cp_group(dist.group.WORLD)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    # The interpreter's numpy warns on the intended -inf arithmetic of empty rows.
    warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.runtime")
    set_output_poison(float("nan"))  # an output an op forgets to write shows up as NaN
    talk = cfg.progress and rank == 0
    prompts = cfg.prompts()
    rows = 2 * len(prompts)  # the widest step: two query tokens per request
    result: dict[str, Any] = {"reference": {}, "paths": {}}
    with torch.inference_mode():
        for variant in cfg.variants:
            model = TinyLM(cfg.model_config(variant), cfg.seed, device)
            if rank == 0:
                ref_shard = KVShard(model, len(prompts), cfg.max_len, 0, 1, 1, device)
                first = prefill(model, ref_shard, prompts, None)
                ref = generate(model, ref_shard, prompts, first, Combiner(),
                               new_tokens=cfg.new_tokens)  # fmt: skip
                result["reference"][variant] = ref
                _say(talk, f"{variant}: reference on one rank, {cfg.new_tokens} tokens")
            capacity = -(-cfg.max_len // (world_size * cfg.interleave)) * cfg.interleave
            shard = KVShard(model, len(prompts), capacity, rank, world_size, cfg.interleave,
                            device)  # fmt: skip
            first = prefill(model, shard, prompts, group)
            _say(talk, f"{variant}: prefill of {list(cfg.prompt_lens)} on {world_size} ranks")
            for path in cfg.paths:
                name = f"{variant}/{path}"
                try:
                    combiner = LibraryCombiner(path, group, model, rows, name in cfg.fault)
                except PathUnavailable as exc:
                    result["paths"][name] = f"skipped: {exc}"
                    _say(talk, f"{name}: skipped: {exc}")
                    continue
                _say(talk, f"{name}: decoding {cfg.new_tokens} tokens ...")
                out = generate(model, shard.clone(), prompts, first, combiner,
                               new_tokens=cfg.new_tokens, verify_every=cfg.verify_every)  # fmt: skip
                out.note = combiner.describe()
                if rank:
                    out.logits = torch.empty(0)
                result["paths"][name] = out
                step = statistics.median(out.step_s) * 1e3 if out.step_s else 0.0
                _say(talk, f"{name}: done, {len(out.step_s)} decode steps, {step:.1f} ms per "
                     "step")  # fmt: skip
    return result


@dataclasses.dataclass
class PathResult:
    """The verdict on one ``variant/path``."""

    path: str
    ranks: int
    status: str  # "pass" | "FAIL" | "skipped"
    tokens: str = ""  # "128/128 identical"
    max_rel_err: float | None = None
    tol: float | None = None
    step_ms: float | None = None
    drafts: str = ""  # "accepted/rejected"
    reason: str = ""


def compare(ref: Generation, got: Generation, dtype: torch.dtype) -> tuple[int, int, float, str]:
    """``(identical tokens, compared tokens, max relative logit error, problem)`` of ``got``
    against ``ref``; ``problem`` is ``""``, a near-tie note starting with ``"tie:"``, or why
    the path fails."""
    from cpattn_testing.tolerances import tolerance

    rtol = tolerance(dtype)[1]
    same = total = 0
    worst = 0.0
    notes: list[str] = []
    for b, (want, have) in enumerate(zip(ref.tokens, got.tokens, strict=True)):
        for i, (t_ref, t_got) in enumerate(zip(want, have, strict=True)):
            r, a = ref.logits[b, i].double(), got.logits[b, i].double()
            scale = float(r.abs().max())
            worst = max(worst, float((a - r).abs().max()) / scale)
            total += 1
            if t_ref == t_got:
                same += 1
                continue
            margin = float(r[t_ref] - r[t_got])
            if margin > 2 * rtol * scale:
                return same, total, worst, (f"request {b} token {i}: {t_got} instead of {t_ref} "
                                            f"(reference margin {margin:.3g})")  # fmt: skip
            notes.append(f"tie: request {b} diverged at token {i} (margin {margin:.2g})")
            break
    if worst > rtol:
        return same, total, worst, f"logits off by {worst:.2e} > {rtol:.0e}"
    return same, total, worst, "; ".join(notes)


def summarize(cfg: DemoConfig, per_rank: Sequence[dict[str, Any]]) -> list[PathResult]:
    """One :class:`PathResult` per ``variant/path`` from every rank's :func:`rank_main`."""
    from cpattn_testing.tolerances import tolerance

    rtol = tolerance(cfg.torch_dtype)[1]
    results = []
    for variant in cfg.variants:
        ref = per_rank[0]["reference"][variant]
        for path in cfg.paths:
            name = f"{variant}/{path}"
            runs = [rank["paths"][name] for rank in per_rank]
            if any(isinstance(g, str) for g in runs):  # the gate answers alike on every rank
                alike = all(g == runs[0] for g in runs)
                status, reason = ("skipped", runs[0][len("skipped: ") :]) if alike else (
                    "FAIL", f"ranks disagree: {runs}")  # fmt: skip
                results.append(PathResult(name, cfg.world_size, status, reason=reason))
                continue
            res = PathResult(name, cfg.world_size, "pass", tol=rtol)
            same, total, worst, problem = compare(ref, runs[0], cfg.torch_dtype)
            res.tokens, res.max_rel_err = f"{same}/{total} identical", worst
            steps = [max(s) for s in zip(*(g.step_s for g in runs), strict=True)]
            res.step_ms = statistics.median(steps) * 1e3 if steps else None
            res.drafts = f"{runs[0].accepted}/{runs[0].rejected}"
            res.reason = "; ".join(x for x in (runs[0].note, problem) if x)
            disagree = [r for r, g in enumerate(runs) if g.tokens != runs[0].tokens]
            if disagree:
                res.reason = f"ranks {disagree} generated other tokens than rank 0"
            if disagree or (problem and not problem.startswith("tie:")):
                res.status = "FAIL"
            results.append(res)
    return results
