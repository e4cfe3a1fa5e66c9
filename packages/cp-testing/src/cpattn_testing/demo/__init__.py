"""The library's main job, end to end: ``python -m cpattn_testing.demo``.

A small transformer greedily decodes a ragged batch of prompts on ``N`` ranks: PCP prefill, a
DCP-sharded KV cache, and every decode step combined by each path in turn (AG+RS, AG+AR, A2A,
direct A2A where its gate allows, ``DCPManager``). The same model on one rank is the
reference. Ranks come from ``run_distributed`` or ``torchrun`` (``docs/multi-node.md``).
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
