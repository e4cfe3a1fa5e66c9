"""Testing kit for context-parallel attention: multi-process launcher, simulated groups, float64 references, tolerances, strategies, demo.

The main entry points are re-exported here, imported on first use (PEP 562): a rank of
``run_distributed`` must not import ``cpattn_common`` before it applied its environment.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from cpattn_testing.__about__ import __version__

if TYPE_CHECKING:
    from cpattn_testing.cases import DCPDecodeCase, make_dcp_decode_case
    from cpattn_testing.launcher import DistributedError, NotEnoughDevicesError, run_distributed
    from cpattn_testing.simulated import SimulatedGroup, SimulatedWorld
    from cpattn_testing.tolerances import assert_close_to_ref, coarsest, tolerance

# re-exported name -> the submodule that defines it
_EXPORTS = {
    "DCPDecodeCase": "cases",
    "make_dcp_decode_case": "cases",
    "DistributedError": "launcher",
    "NotEnoughDevicesError": "launcher",
    "run_distributed": "launcher",
    "SimulatedGroup": "simulated",
    "SimulatedWorld": "simulated",
    "assert_close_to_ref": "tolerances",
    "coarsest": "tolerances",
    "tolerance": "tolerances",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


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
