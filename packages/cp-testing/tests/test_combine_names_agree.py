"""``cpattn_pcp.resolve_dcp_combine`` names the combine ``cpattn_dcp.DCPManager`` selects, for
every ``DCPConfig.comm_backend`` and layout both packages support, ``"auto"`` included."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cpattn_dcp import DCPConfig, DCPManager
from cpattn_pcp import DCP_COMM_BACKENDS, resolve_dcp_combine
from cpattn_testing.simulated import SimulatedWorld


@pytest.mark.parametrize("backend", DCP_COMM_BACKENDS)
@pytest.mark.parametrize(("dcp", "pcp"), [(2, 1), (4, 1), (2, 2), (4, 2), (4, 4)])
def test_the_manager_and_the_name_agree(dcp: int, pcp: int, backend: str) -> None:
    config = DCPConfig(
        comm_backend=backend,  # type: ignore[arg-type]
        use_pcp=pcp > 1,
        pcp_world_size=pcp if pcp > 1 else None,
        use_direct_a2a=False,
    )

    def build(group: Any) -> str:
        manager = DCPManager(config, group, "cpu", num_heads=1, head_dim=8, dtype=torch.bfloat16)
        return str(manager.combine_path)

    paths = set(SimulatedWorld(dcp, torch.device("cpu")).run(build))
    assert paths == {resolve_dcp_combine(dcp, pcp, backend)}
