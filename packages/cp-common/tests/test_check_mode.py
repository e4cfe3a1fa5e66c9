"""Check mode's switch, the overlap checks, ``check_device``, ``check_fits_in_memory`` and the
cross-rank signature comparison (``check_ranks_agree``) on simulated ranks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import cpattn_common
from cpattn_common.agreement import check_ranks_agree, tensor_fields
from cpattn_common.checks import (
    check_device,
    check_fits_in_memory,
    check_mode,
    check_no_overlap,
    checks_enabled,
    overlaps,
    set_check_mode,
)
from cpattn_testing.simulated import SimulatedWorld


def test_switch_context_manager_and_root_exports() -> None:
    assert cpattn_common.check_mode is check_mode
    assert cpattn_common.checks_enabled is checks_enabled
    assert cpattn_common.set_check_mode is set_check_mode
    before = checks_enabled()
    with check_mode():
        assert checks_enabled()
        with check_mode(False):
            assert not checks_enabled()
        assert checks_enabled()
    assert checks_enabled() == before
    assert set_check_mode(True) == before
    assert set_check_mode(before) is True
    with pytest.raises(TypeError, match="enabled must be a bool, got 1"):
        set_check_mode(1)  # type: ignore[arg-type]


@pytest.mark.parametrize(("value", "enabled"), [("1", True), ("0", False), ("", False)])
def test_environment_variable_is_read_at_import(value: str, enabled: bool) -> None:
    env = {**os.environ, "CPATTN_CHECKS": value}
    code = "import cpattn_common; print(cpattn_common.checks_enabled())"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == str(enabled)


def test_overlaps_compares_address_ranges() -> None:
    buf = torch.zeros(64)
    assert overlaps(buf[:10], buf[5:20])
    assert overlaps(buf[5:20], buf[:10])
    assert not overlaps(buf[:10], buf[10:20])
    assert not overlaps(buf[10:20], buf[:10])
    assert overlaps(buf[:10], buf[30:40], buf[9:12])
    assert not overlaps(buf[:10], buf[:0])  # empty views overlap nothing
    assert not overlaps(buf[:0], buf)
    assert overlaps(buf.view(8, 8)[:, 0], buf[7:8])  # strided: the span of its rows
    assert overlaps(buf.view(torch.int32)[3:4], buf)  # other dtypes view the same bytes
    assert not overlaps(buf, torch.zeros(64))
    meta = torch.empty(4, device="meta")
    assert not overlaps(meta, meta)


def test_check_no_overlap_names_both_arguments() -> None:
    buf = torch.zeros(12)
    check_no_overlap("op", "out", out=buf[:6], lses=buf[6:], other=None)
    with pytest.raises(
        ValueError, match=r"op: out \(shape \(6,\)\) overlaps lses \(shape \(4,\)\)"
    ):
        check_no_overlap("op", "out", out=buf[:6], lses=buf[4:8])


def test_check_device() -> None:
    assert check_device("device", "cpu") == torch.device("cpu")
    assert check_device("device", torch.device("meta")) == torch.device("meta")
    for bad in (None, 0, 1.5, ["cpu"]):
        with pytest.raises(TypeError, match=r"device must be a torch\.device or a device string"):
            check_device("device", bad)
    for bad in ("cdua", "cuda:x", ""):
        with pytest.raises(ValueError, match=f"device: torch cannot parse device {bad!r}"):
            check_device("device", bad)
    assert check_device("device", "cuda:7", available=False) == torch.device("cuda", 7)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match=f"device is 'cuda:{count}', but this process cannot"):
        check_device("device", f"cuda:{count}")
    if not count:
        with pytest.raises(ValueError, match="device is 'cuda', but this process cannot use it"):
            check_device("device", "cuda")


def test_check_fits_in_memory() -> None:
    cpu = torch.device("cpu")
    check_fits_in_memory("op", "a plan", 2**20, cpu)  # small: no query
    check_fits_in_memory("op", "a plan", 2**60, torch.device("meta"))  # unknown: passes
    with pytest.raises(ValueError, match=r"op: a plan would need about 8388608\.0 GiB on cpu"):
        check_fits_in_memory("op", "a plan", 2**53, cpu)


def _agree(group: object, b: int, dtype: torch.dtype, flag: bool, op: str) -> str:
    x = torch.zeros(b, 3, dtype=dtype)
    fields = {**tensor_fields("x", x), "flag": flag}
    try:
        check_ranks_agree(op, group, x.device, fields)  # type: ignore[arg-type]
    except ValueError as exc:
        return str(exc)
    return "agreed"


def test_check_ranks_agree_names_the_field_and_the_rank() -> None:
    world = SimulatedWorld(3, torch.device("cpu"))
    f32 = torch.float32
    assert world.run(lambda g: _agree(g, 2, f32, True, "op")) == ["agreed"] * 3
    got = world.run(lambda g: _agree(g, 2 + (g.rank_in_group == 2), f32, True, "op"))
    assert all("x.shape[0] is 2 on rank 0 but 3 on rank 2" in m for m in got), got
    assert [m.split("raised on rank ")[1][0] for m in got] == ["0", "1", "2"]
    got = world.run(
        lambda g: _agree(
            g, 2, torch.bfloat16 if g.rank_in_group else f32, g.rank_in_group < 1, "op"
        )
    )
    assert "x.dtype is torch.float32 on rank 0 but torch.bfloat16 on rank 1" in got[0]
    assert "flag is True on rank 0 but False on rank 1" in got[0]
    got = world.run(lambda g: _agree(g, 2, f32, True, "op_b" if g.rank_in_group == 1 else "op"))
    assert "rank 0 calls op, rank 1 another op" in got[0]
    assert "rank 0 calls another op, rank 1 op_b" in got[1]
    # one rank: nothing to compare, no collective
    assert _agree(SimulatedWorld(1, torch.device("cpu")).groups[0], 2, f32, True, "op") == "agreed"
