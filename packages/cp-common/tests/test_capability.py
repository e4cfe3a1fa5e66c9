"""Capability gating: explicit override, CPU behaviour, env-disabled multicast is never probed."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from cpattn_common import capability
from cpattn_common.capability import (
    MULTICAST_ENV_VARS,
    clear_capability_cache,
    direct_cp_disabled_reason,
    direct_cp_enabled,
    direct_cp_multicast_enabled,
    group_probe,
    multicast_disabled_by_env,
    multicast_env_reason,
    propagate_multicast_off,
)
from cpattn_testing.simulated import SimulatedWorld


class _PGStub:
    group_name = "stub"


class _Group:
    """A minimal CPGroupLike with a (stub) process group so the probe would rendezvous; its
    peers answer the probe's agreement as this rank does (host tensors, as for gloo)."""

    backend = "gloo"

    def __init__(self, world_size: int = 2, with_pg: bool = True):
        self.world_size = world_size
        self.rank_in_group = 0
        self.device_group: Any = _PGStub() if with_pg else None

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat([tensor] * self.world_size, dim=dim)

    def reduce_scatter(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        raise NotImplementedError

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor) -> None:
        raise NotImplementedError

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> None:
        output.copy_(torch.cat([input] * self.world_size))

    def barrier(self) -> None:
        pass


@pytest.fixture(autouse=True)
def _fresh_cache() -> Iterator[None]:
    clear_capability_cache()
    yield
    clear_capability_cache()


@pytest.fixture
def no_multicast_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in MULTICAST_ENV_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Pretend CUDA + symmetric memory exist; record every probe call."""
    calls: dict[str, Any] = {"multicast_support": 0, "rendezvous": [], "same_node": 0}
    monkeypatch.setattr(capability, "symm_mem_available", True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def same_node(group: Any, flag: torch.Tensor | None) -> bool:
        calls["same_node"] += 1
        return calls.get("same_node_value", True)

    def multicast_support(device: torch.device) -> bool:
        calls["multicast_support"] += 1
        return True

    def rendezvous(
        group: Any, device: torch.device, want_multicast: bool, flag: torch.Tensor
    ) -> tuple[bool, bool]:
        calls["rendezvous"].append(want_multicast)
        return calls.get("reached", True), want_multicast

    monkeypatch.setattr(capability, "_all_same_node", same_node)
    monkeypatch.setattr(capability, "_device_has_multicast", multicast_support)
    monkeypatch.setattr(capability, "_rendezvous_probe", rendezvous)
    return calls


def test_cpu_auto_is_off_and_override_wins(device: torch.device) -> None:
    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    world = SimulatedWorld(1, device)
    group = world.groups[0]
    assert direct_cp_enabled(group, torch.bfloat16, None) is False
    assert direct_cp_enabled(group, torch.bfloat16, True) is True
    assert direct_cp_enabled(group, torch.float64, True, supported_dtypes=(torch.bfloat16,)) is True
    assert direct_cp_enabled(group, torch.bfloat16, False) is False
    reason = direct_cp_disabled_reason(group, torch.bfloat16, None)
    assert reason is not None
    assert "CUDA" in reason or "symmetric" in reason
    assert direct_cp_disabled_reason(group, torch.bfloat16, True) is None
    assert direct_cp_disabled_reason(group, torch.bfloat16, False) == "use_direct=False"
    assert direct_cp_multicast_enabled(group, torch.bfloat16, None) is False
    assert direct_cp_multicast_enabled(group, torch.bfloat16, True) is False  # fallback, no error


@pytest.mark.parametrize(
    ("name", "value"), [*MULTICAST_ENV_VARS.items(), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "true")]
)
def test_env_disables_multicast_without_any_probe(
    monkeypatch: pytest.MonkeyPatch, no_multicast_env: None, name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    assert multicast_disabled_by_env()

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        pytest.fail("a multicast probe ran although the environment disables multicast")

    monkeypatch.setattr(capability, "symm_mem_available", True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(capability, "_device_has_multicast", forbidden)
    rendezvous_calls: list[bool] = []

    def rendezvous(
        group: Any, device: torch.device, want_multicast: bool, flag: torch.Tensor
    ) -> tuple[bool, bool]:
        if want_multicast:
            forbidden()
        rendezvous_calls.append(want_multicast)
        return True, False

    monkeypatch.setattr(capability, "_rendezvous_probe", rendezvous)
    monkeypatch.setattr(capability, "_all_same_node", lambda g, flag: False)
    group = _Group()
    for use_direct in (None, True, False):
        assert direct_cp_multicast_enabled(group, torch.bfloat16, use_direct) is False
        reason = direct_cp_disabled_reason(group, torch.bfloat16, use_direct, multicast=True)
        assert reason is not None
        assert name in reason
    # The unicast path still works (a plain rendezvous, no multicast).
    assert direct_cp_enabled(group, torch.bfloat16, None) is True
    probe = group_probe(group)
    assert probe.multicast is False
    assert probe.reason is not None
    assert name in probe.reason
    assert rendezvous_calls == [False]


def test_env_values_that_keep_multicast_on(
    monkeypatch: pytest.MonkeyPatch, no_multicast_env: None
) -> None:
    assert not multicast_disabled_by_env()
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "0")
    assert not multicast_disabled_by_env()


# NCCL reads NCCL_NVLS_ENABLE with strtoll(value, NULL, 0): an integer prefix in base 0, and 0
# when there is none, so 00, 0x0, -0, disable and n turn multicast off too.
@pytest.mark.parametrize(
    "value", ["0", "00", "0x0", "-0", " 0 ", "disable", "n", "false", "true", "0x", "08", " "]
)
def test_nccl_nvls_enable_read_as_nccl_reads_it_disables(
    monkeypatch: pytest.MonkeyPatch, no_multicast_env: None, value: str
) -> None:
    monkeypatch.setenv("NCCL_NVLS_ENABLE", value)
    assert multicast_env_reason() == f"NCCL_NVLS_ENABLE={value}"


@pytest.mark.parametrize("value", ["1", "2", "0x1", " 1", "1abc", "+1", "010", ""])
def test_nccl_nvls_enable_nonzero_or_empty_keeps_multicast_on(
    monkeypatch: pytest.MonkeyPatch, no_multicast_env: None, value: str
) -> None:
    monkeypatch.setenv("NCCL_NVLS_ENABLE", value)
    assert multicast_env_reason() is None


# The DISABLE variables: anything but a clear "no" (or an empty value) keeps multicast off.
@pytest.mark.parametrize("name", ["TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"])
@pytest.mark.parametrize("value", ["1", "y", "Y", "t", "T", "yes", "TRUE", "on", "2", "00", "?"])
def test_disable_variables_disable_for_any_value_but_a_clear_no(
    monkeypatch: pytest.MonkeyPatch, no_multicast_env: None, name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    assert multicast_env_reason() == f"{name}={value}"


@pytest.mark.parametrize("value", ["0", " 0 ", "false", "False", "no", "off", "n", "F", ""])
def test_torch_disable_variable_that_says_no(
    monkeypatch: pytest.MonkeyPatch, no_multicast_env: None, value: str
) -> None:
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", value)
    assert multicast_env_reason() is None


# NVSHMEM reads a boolean option as true whenever it is set, unless its first character is 0,
# N, n, F or f. The gate read NVSHMEM_DISABLE_NVLS like the torch variable, so "", "off",
# " 0" and "\t0" kept multicast on although NVSHMEM had it off. Values NVSHMEM reads as false
# but that are no clear "no" ("00", "nope") still disable (the safe side).
@pytest.mark.parametrize("value", ["0", "false", "False", "no", "NO", "n", "N", "F", "f"])
def test_nvshmem_disable_variable_that_says_no(
    monkeypatch: pytest.MonkeyPatch, no_multicast_env: None, value: str
) -> None:
    monkeypatch.setenv("NVSHMEM_DISABLE_NVLS", value)
    assert multicast_env_reason() is None


@pytest.mark.parametrize(
    "value", ["", "off", "OFF", " 0", "\t0", " no", "1", "yes", "true", "00", "nope", "f1"]
)
def test_nvshmem_disable_variable_read_as_nvshmem_reads_it_disables(
    monkeypatch: pytest.MonkeyPatch, no_multicast_env: None, value: str
) -> None:
    monkeypatch.setenv("NVSHMEM_DISABLE_NVLS", value)
    assert multicast_env_reason() == f"NVSHMEM_DISABLE_NVLS={value}"


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1" * 5000, (1 << 63) - 1),  # int("1" * 5000) raises past Python's 4300 digits
        ("-" + "9" * 30, -(1 << 63)),
        ("0x" + "f" * 40, (1 << 63) - 1),
        ("0" * 5000, 0),
        ("0" * 5000 + "7", 7),  # octal, leading zeros
        ("9223372036854775808", (1 << 63) - 1),  # saturates like strtoll
        ("12abc", 12),
    ],
)
def test_c_integer_saturates_like_strtoll(text: str, value: int) -> None:
    assert capability._c_integer(text) == value


def test_a_very_long_nccl_value_is_read_not_raised(
    monkeypatch: pytest.MonkeyPatch, no_multicast_env: None
) -> None:
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1" * 5000)
    assert multicast_env_reason() is None
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0" * 5000)
    assert multicast_env_reason() is not None


def test_an_odd_spelling_also_turns_the_symmetric_memory_backends_off(
    monkeypatch: pytest.MonkeyPatch, no_multicast_env: None
) -> None:
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0x0")
    propagate_multicast_off()
    assert os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert os.environ["NVSHMEM_DISABLE_NVLS"] == "1"


def test_auto_decision_with_fake_cuda(no_multicast_env: None, fake_cuda: dict[str, Any]) -> None:
    group = _Group()
    assert direct_cp_enabled(group, torch.bfloat16, None) is True
    assert direct_cp_multicast_enabled(group, torch.bfloat16, None) is True
    assert direct_cp_disabled_reason(group, torch.bfloat16, None, multicast=True) is None
    # cached per group: one probe only
    assert fake_cuda["same_node"] == 1
    assert fake_cuda["rendezvous"] == [True]
    # dtype gating
    assert direct_cp_enabled(group, torch.float32, None, supported_dtypes=[torch.bfloat16]) is False
    reason = direct_cp_disabled_reason(group, torch.float32, None, [torch.bfloat16])
    assert reason is not None
    assert "float32" in reason


@pytest.mark.parametrize(
    ("same_node", "reached", "expected"),
    [(True, True, True), (True, False, False), (False, True, True), (False, False, False)],
)
def test_the_direct_path_needs_a_working_rendezvous(
    no_multicast_env: None,
    fake_cuda: dict[str, Any],
    same_node: bool,
    reached: bool,
    expected: bool,
) -> None:
    fake_cuda["same_node_value"] = same_node
    fake_cuda["reached"] = reached
    assert direct_cp_enabled(_Group(), torch.bfloat16, None) is expected


def test_a_raising_rendezvous_turns_the_direct_path_off(
    monkeypatch: pytest.MonkeyPatch, no_multicast_env: None, fake_cuda: dict[str, Any]
) -> None:
    """One host, but the rendezvous raised: the workspaces would fail the same way, so the
    automatic decision is off, with the reason."""

    def boom(*args: Any) -> Any:
        raise RuntimeError("planted rendezvous failure")

    monkeypatch.setattr(capability, "_rendezvous_probe", boom)
    assert group_probe(_Group()).rendezvous_failed is True
    assert direct_cp_enabled(_Group(), torch.bfloat16, None) is False
    assert "planted" in str(direct_cp_disabled_reason(_Group(), torch.bfloat16, None))
    assert direct_cp_enabled(_Group(), torch.bfloat16, True) is True  # forced: as asked


def test_a_group_without_a_process_group_is_on_only_when_it_allocates_symmetric_buffers(
    no_multicast_env: None, fake_cuda: dict[str, Any]
) -> None:
    """Simulated ranks in one process (``allocate_symmetric``): nothing to rendezvous on, one
    host, on. Any other group without a process group cannot allocate a workspace: it was on
    too, and the direct path then raised RuntimeError instead of falling back."""
    simulated = _Group(with_pg=False)
    simulated.allocate_symmetric = lambda *args, **kwargs: None  # type: ignore[attr-defined]
    assert direct_cp_enabled(simulated, torch.bfloat16, None) is True
    plain = _Group(with_pg=False)
    assert direct_cp_enabled(plain, torch.bfloat16, None) is False
    reason = direct_cp_disabled_reason(plain, torch.bfloat16, None)
    assert reason == "the group has no process group to rendezvous on and no allocate_symmetric"
    assert fake_cuda["rendezvous"] == []


def test_supported_dtypes_may_be_any_iterable(
    no_multicast_env: None, fake_cuda: dict[str, Any]
) -> None:
    """A generator was read up to three times: the later reads found it empty ("disabled",
    and a message listing no dtype)."""
    group = _Group()
    assert direct_cp_enabled(group, torch.bfloat16, None, (d for d in [torch.bfloat16])) is True
    assert direct_cp_multicast_enabled(
        group, torch.bfloat16, None, (d for d in [torch.float16, torch.bfloat16])
    )
    reason = direct_cp_disabled_reason(group, torch.float32, None, (d for d in [torch.bfloat16]))
    assert reason == "dtype torch.float32 not in the supported dtypes (torch.bfloat16,)"


def test_a_cached_probe_goes_with_its_group(
    no_multicast_env: None, fake_cuda: dict[str, Any]
) -> None:
    """The cache shares one probe among the wrappers of a process group and does not keep
    the group alive."""
    import gc
    import weakref

    group = _Group()
    probe = group_probe(group)
    twin = _Group()
    twin.device_group = group.device_group  # another wrapper of the same process group
    assert group_probe(twin) is probe
    assert fake_cuda["rendezvous"] == [True]  # probed once
    pg_ref = weakref.ref(group.device_group)
    del group, twin
    gc.collect()
    assert pg_ref() is None
    assert len(capability._probes) == 0


def test_a_probe_of_a_released_group_does_not_raise() -> None:
    """A shared wrapper outliving its released process group: the probe says so (reading the
    group under the wrapper raised, outside the probe's guard)."""
    from cpattn_common.group import _SharedCPGroup, shared_cp_group

    class Pg:  # stands in for a ProcessGroup (only its weak reference is read)
        pass

    wrapper = _SharedCPGroup.__new__(_SharedCPGroup)
    pg = Pg()
    wrapper._group = pg  # type: ignore[assignment]
    wrapper._world_size, wrapper._rank_in_group = 2, 0
    assert shared_cp_group(wrapper) is wrapper  # memoised while its group lives
    del pg
    probe = group_probe(wrapper)
    assert probe.reason is not None
    assert "destroyed and released" in probe.reason
    assert direct_cp_enabled(wrapper, torch.bfloat16, None) is False


@pytest.mark.parametrize("use_direct", ["false", "0", 0, 1, 1.0])
def test_use_direct_must_be_a_bool_or_none(use_direct: Any) -> None:
    for check in (direct_cp_enabled, direct_cp_disabled_reason, direct_cp_multicast_enabled):
        with pytest.raises(TypeError, match="use_direct"):
            check(_Group(), torch.bfloat16, use_direct)


def test_probe_never_raises(
    monkeypatch: pytest.MonkeyPatch, no_multicast_env: None, fake_cuda: dict[str, Any]
) -> None:
    def boom(*args: Any) -> Any:
        raise RuntimeError("planted")

    monkeypatch.setattr(capability, "_all_same_node", boom)
    monkeypatch.setattr(capability, "_device_has_multicast", boom)
    probe = group_probe(_Group())
    assert probe.multicast is False
    assert "planted" in str(probe.reason)
    # The rendezvous itself still ran (without multicast) and worked: the direct path is on.
    assert fake_cuda["rendezvous"] == [False]
    assert (probe.symm_mem_reaches_group, probe.rendezvous_failed) == (True, False)
    assert direct_cp_enabled(_Group(), torch.bfloat16, None) is True
    monkeypatch.setattr(capability, "_rendezvous_probe", boom)
    clear_capability_cache()
    assert direct_cp_enabled(_Group(), torch.bfloat16, None) is False
    assert group_probe(object()).reason is not None  # not a group: reported, not raised


def test_a_probe_that_cannot_allocate_its_flag_raises_before_any_collective(
    monkeypatch: pytest.MonkeyPatch, no_multicast_env: None, fake_cuda: dict[str, Any]
) -> None:
    """The flag the probe's agreements gather is its one step outside them. Where it cannot be
    allocated, the rank raises before its first collective instead of answering "off" and
    pairing its next collective with its peers' probe."""

    def oom(*args: Any) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory (stubbed flag)")

    monkeypatch.setattr(capability, "agreement_flag", oom)
    with pytest.raises(torch.OutOfMemoryError, match="stubbed flag"):
        group_probe(_Group())
    assert (fake_cuda["same_node"], fake_cuda["rendezvous"]) == (0, [])
    with pytest.raises(torch.OutOfMemoryError):
        direct_cp_enabled(_Group(), torch.bfloat16, None)
    monkeypatch.undo()


def test_the_probe_rendezvous_gathers_the_probe_flag(
    monkeypatch: pytest.MonkeyPatch, no_multicast_env: None
) -> None:
    """The probe allocates one flag; its symmetric allocation's agreement gathers that flag
    and allocates none of its own."""
    from cpattn_common import agreement

    class _Handle:
        multicast_ptr = 0

    monkeypatch.setattr(capability, "symm_mem_available", True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    monkeypatch.setattr(capability, "_all_same_node", lambda group, flag: True)
    monkeypatch.setattr(
        capability._symm_mem, "empty", lambda *a, **k: torch.zeros(8, dtype=torch.uint8)
    )
    monkeypatch.setattr(capability._symm_mem, "rendezvous", lambda buf, name: _Handle())
    flags: list[torch.Tensor] = []
    real_flag = agreement.agreement_flag

    def counted_flag(group: Any, device: torch.device) -> torch.Tensor:
        flags.append(real_flag(group, torch.device("cpu")))
        return flags[-1]

    def no_flag(*args: Any) -> torch.Tensor:
        raise AssertionError("the rendezvous step allocated a flag of its own")

    monkeypatch.setattr(capability, "agreement_flag", counted_flag)
    monkeypatch.setattr(agreement, "agreement_flag", no_flag)
    probe = group_probe(_Group())
    assert (probe.symm_mem_reaches_group, probe.rendezvous_failed) == (True, False)
    assert len(flags) == 1


def test_a_failing_multicast_query_is_not_a_failed_rendezvous(
    monkeypatch: pytest.MonkeyPatch, no_multicast_env: None, fake_cuda: dict[str, Any]
) -> None:
    """One host, the multicast-support query raises: no multicast, but the unicast direct
    path stays on (the rendezvous was not what failed)."""

    def boom(*args: Any) -> Any:
        raise RuntimeError("planted multicast query failure")

    monkeypatch.setattr(capability, "_device_has_multicast", boom)
    probe = group_probe(_Group())
    assert (probe.multicast, probe.rendezvous_failed) == (False, False)
    assert "planted" in str(probe.reason)
    assert direct_cp_enabled(_Group(), torch.bfloat16, None) is True
    assert direct_cp_multicast_enabled(_Group(), torch.bfloat16, None) is False


def probe_ranks(rank: int, world_size: int) -> tuple[bool, bool, str | None, bool]:
    probe = group_probe(dist.group.WORLD)
    return (
        probe.same_node,
        probe.multicast,
        probe.reason,
        direct_cp_enabled(dist.group.WORLD, torch.bfloat16, None),
    )


def test_probe_on_real_group(run_ranks: Callable[..., list[Any]], device: torch.device) -> None:
    results = run_ranks(probe_ranks, 2, timeout=120.0)
    for same_node, multicast, reason, enabled in results:
        assert same_node is True
        assert multicast is False  # CPU: no CUDA; GPU runs set the multicast-off variables
        if device.type == "cpu":
            assert enabled is False
            assert reason is not None


def test_multicast_off_reaches_torch_symm_mem(
    monkeypatch: pytest.MonkeyPatch, no_multicast_env: None
) -> None:
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    capability.propagate_multicast_off()
    import os

    assert os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert os.environ["NVSHMEM_DISABLE_NVLS"] == "1"  # torch's NVSHMEM backend reads this one
    monkeypatch.delenv("TORCH_SYMM_MEM_DISABLE_MULTICAST")
    monkeypatch.delenv("NVSHMEM_DISABLE_NVLS")
    monkeypatch.delenv("NCCL_NVLS_ENABLE")
    capability.propagate_multicast_off()
    assert "TORCH_SYMM_MEM_DISABLE_MULTICAST" not in os.environ
    assert "NVSHMEM_DISABLE_NVLS" not in os.environ


def _pretend_cuda() -> None:
    """In a gloo rank process: torch reports CUDA device 0 and ``synchronize`` does nothing,
    so the probe takes its CUDA path over stubbed symmetric memory."""
    torch.cuda.is_available = lambda: True  # type: ignore[assignment]
    torch.cuda.current_device = lambda: 0  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]


def _probe_with_rank_1_out_of_memory(rank: int, world_size: int) -> str | None:
    """gloo ranks that pretend to have CUDA: the probe's symmetric allocation fails on rank 1
    only; the stubbed rendezvous is collective like torch's (store keys of every rank)."""

    class _Handle:
        multicast_ptr = 0

    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        if rank == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (stubbed on rank 1)")
        return torch.zeros(8, dtype=torch.uint8)

    def rendezvous(buf: torch.Tensor, name: str) -> _Handle:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"rendezvous/{rank}", "handle")
        for peer in range(world_size):
            store.get(f"rendezvous/{peer}")  # waits for the peer (the store's timeout)
        return _Handle()

    _pretend_cuda()
    capability._device_has_multicast = lambda device: False  # type: ignore[assignment]
    capability._symm_mem.empty = empty  # type: ignore[assignment]
    capability._symm_mem.rendezvous = rendezvous  # type: ignore[assignment]
    return capability.direct_cp_disabled_reason(dist.group.WORLD, torch.bfloat16)


def test_a_probe_allocation_failing_on_one_rank_fails_the_probe_on_every_rank(
    run_ranks: Callable[..., list[Any]], device: torch.device
) -> None:
    """The ranks agree before the rendezvous: both probes fail at once, naming rank 1 (rank 0
    does not wait in the rendezvous while rank 1 reports "direct off")."""
    if device.type != "cpu":
        pytest.skip("replaces torch.cuda in its rank processes: a CPU (gloo) test")
    for reason in run_ranks(_probe_with_rank_1_out_of_memory, 2, timeout=60.0):
        assert reason is not None
        assert "symmetric-memory probe failed: SymmetricAllocationError" in reason
        assert "failed on rank(s) [1] of 2" in reason


def _probe_with_rank_1_unable_to_read_the_multicast_address(
    rank: int, world_size: int
) -> tuple[bool, bool, bool, str | None]:
    """gloo ranks that pretend to have CUDA and multicast; the rendezvous works on both, but
    reading the handle's multicast address raises on rank 1."""

    class _Handle:
        @property
        def multicast_ptr(self) -> int:
            if rank == 1:
                raise RuntimeError("multicast address read failed (stubbed on rank 1)")
            return 1

    def rendezvous(buf: torch.Tensor, name: str) -> _Handle:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"rendezvous/{rank}", "handle")
        for peer in range(world_size):
            store.get(f"rendezvous/{peer}")
        return _Handle()

    _pretend_cuda()
    for name in MULTICAST_ENV_VARS:
        os.environ.pop(name, None)
    capability._device_has_multicast = lambda device: True  # type: ignore[assignment]
    capability._symm_mem.empty = lambda *a, **k: torch.zeros(8, dtype=torch.uint8)  # type: ignore[assignment]
    capability._symm_mem.rendezvous = rendezvous  # type: ignore[assignment]
    probe = group_probe(dist.group.WORLD)
    return (
        probe.symm_mem_reaches_group,
        probe.rendezvous_failed,
        probe.multicast,
        probe.reason,
    )


def test_an_unreadable_multicast_address_costs_multicast_only(
    run_ranks: Callable[..., list[Any]], device: torch.device
) -> None:
    """The rendezvous worked on both ranks; rank 1 could not read the multicast address: only
    multicast is off, the plain direct path stays on."""
    if device.type != "cpu":
        pytest.skip("replaces torch.cuda in its rank processes: a CPU (gloo) test")
    results = run_ranks(_probe_with_rank_1_unable_to_read_the_multicast_address, 2, timeout=60.0)
    for rank, (reached, failed, multicast, reason) in enumerate(results):
        assert (reached, failed, multicast) == (True, False, False)
        assert reason is not None
        if rank == 0:
            assert "no multicast on rank(s) [1] of 2" in reason


def _probe_with_a_rank_local_multicast_answer(
    rank: int, world_size: int, case: str
) -> tuple[bool, bool, bool, str | None, bool]:
    """gloo ranks that pretend to have CUDA; the multicast query (``case="query"``) or the
    handle's multicast address (``"handle"``) fails on rank 1 only, or rank 1's rendezvous
    returns no handle (``"unreached"``)."""

    def has_multicast(device: torch.device) -> bool:
        if case == "query" and rank == 1:
            raise RuntimeError("multicast query failed (stubbed on rank 1)")
        return True

    def rendezvous(
        group: Any, device: torch.device, want_multicast: bool, flag: torch.Tensor
    ) -> tuple[bool, bool]:
        if case == "unreached" and rank == 1:
            return False, False
        return True, want_multicast and not (case == "handle" and rank == 1)

    _pretend_cuda()
    for name in MULTICAST_ENV_VARS:
        os.environ.pop(name, None)
    capability._device_has_multicast = has_multicast  # type: ignore[assignment]
    capability._rendezvous_probe = rendezvous  # type: ignore[assignment]
    probe = group_probe(dist.group.WORLD)
    return (
        probe.symm_mem_reaches_group,
        probe.rendezvous_failed,
        probe.multicast,
        probe.reason,
        direct_cp_multicast_enabled(dist.group.WORLD, torch.bfloat16, None),
    )


@pytest.mark.parametrize("case", ["query", "handle", "unreached"])
def test_the_ranks_agree_on_a_rank_local_multicast_answer(
    run_ranks: Callable[..., list[Any]], device: torch.device, case: str
) -> None:
    """What one rank finds alone (its multicast query raised, its handle has no multicast
    address, its rendezvous gave no handle) turns the path off on every rank, so no rank takes
    the direct gather while another takes the NCCL all-gather."""
    if device.type != "cpu":
        pytest.skip("replaces torch.cuda in its rank processes: a CPU (gloo) test")
    results = run_ranks(_probe_with_a_rank_local_multicast_answer, 2, case, timeout=60.0)
    for rank, (reached, failed, multicast, reason, enabled) in enumerate(results):
        assert (multicast, enabled) == (False, False)
        assert reason is not None
        if case == "unreached":
            assert (reached, failed) == (False, True)
            assert "rank(s) [1] of 2" in reason
        else:
            assert (reached, failed) == (True, False)
            if rank == 0:
                assert "no multicast on rank(s) [1] of 2" in reason
