"""The library's main job, end to end: ``python -m cpattn_testing.demo``.

A small transformer (:mod:`~cpattn_testing.demo.model`: a GQA variant and an MLA-like one,
deterministic random weights) greedily decodes a ragged batch of prompts on ``N`` ranks
(:mod:`~cpattn_testing.demo.generate`): prefill with PCP (``cpattn_pcp``), a KV cache sharded
across the DCP ranks with an interleave size, and every decode step's partial attention (a
real kernel that returns the LSE) combined by each path in turn: AG+RS, AG+AR, A2A, the direct
symmetric-memory A2A where its gate allows it (else a skip with the gate's reason), and a
``DCPManager``. Some steps verify a drafted token (two query tokens per request). The same
model on one rank without any library op is the reference: every path must generate its
tokens, with logits within the dtype's tolerance (:mod:`~cpattn_testing.demo.run`).

Ranks come from :func:`cpattn_testing.launcher.run_distributed` (gloo on the CPU by default,
``--backend nccl`` with one GPU per rank), or from ``torchrun`` on one or several nodes
(``docs/multi-node.md``).
"""

from cpattn_testing.demo.cli import _interpreted, all_path_names, build_parser, format_table, main
from cpattn_testing.demo.generate import PATHS
from cpattn_testing.demo.model import VARIANTS
from cpattn_testing.demo.run import DemoConfig, PathResult, rank_main, summarize

__all__ = [
    "PATHS",
    "VARIANTS",
    "DemoConfig",
    "PathResult",
    "_interpreted",
    "all_path_names",
    "build_parser",
    "format_table",
    "main",
    "rank_main",
    "summarize",
]
