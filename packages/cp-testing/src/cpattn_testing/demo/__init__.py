"""The library's main job, end to end: ``python -m cpattn_testing.demo`` (docs/packages/testing.md,
"The demo"): a small transformer greedily decodes a ragged batch on ``N`` ranks with PCP prefill,
a DCP-sharded KV cache and each combine path in turn, against the same model on one rank.
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
