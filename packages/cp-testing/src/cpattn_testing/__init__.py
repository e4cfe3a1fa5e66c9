"""Testing kit for context-parallel attention: multi-process launcher, simulated groups, float64 references, tolerances, strategies, demo.

The main entry points are re-exported here; the modules hold the rest:

- :mod:`cpattn_testing.launcher`: ``run_distributed`` (N ranks in N processes, gloo or nccl);
- :mod:`cpattn_testing.pytest_plugin`: fixtures ``device``, ``dist_backend``, ``run_ranks`` and
  markers ``gpu`` / ``multigpu(n)`` (opt in with ``pytest_plugins = [...]``);
- :mod:`cpattn_testing.simulated`: ``SimulatedWorld`` (N virtual ranks in threads);
- :mod:`cpattn_testing.reference`: float64 attention, combine, sharding and masking references;
- :mod:`cpattn_testing.cases`: generators of per-rank partials with their reference;
- :mod:`cpattn_testing.tolerances`: the per-dtype tolerance policy;
- :mod:`cpattn_testing.strategies`: hypothesis strategies (imported on its own).
"""

from cpattn_testing.__about__ import __version__
from cpattn_testing.cases import DCPDecodeCase, make_dcp_decode_case
from cpattn_testing.launcher import DistributedError, NotEnoughDevicesError, run_distributed
from cpattn_testing.simulated import SimulatedGroup, SimulatedWorld
from cpattn_testing.tolerances import assert_close_to_ref, coarsest, tolerance

__all__ = [
    "DCPDecodeCase",
    "DistributedError",
    "NotEnoughDevicesError",
    "SimulatedGroup",
    "SimulatedWorld",
    "__version__",
    "assert_close_to_ref",
    "coarsest",
    "make_dcp_decode_case",
    "run_distributed",
    "tolerance",
]
