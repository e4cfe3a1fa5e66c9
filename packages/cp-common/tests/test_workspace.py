"""DirectCPWorkspace: simulated groups (CPU), real symmetric memory (GPU), validation, teardown,
the ranks' agreement on a failed allocation (gloo on CPU, nccl on GPU)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from cpattn_common import capability
from cpattn_common.agreement import SymmetricAllocationError, agree_on_local_step, agreement_flag
from cpattn_common.group import CPGroupLike, as_cp_group
from cpattn_common.workspace import DirectCPWorkspace
from cpattn_testing.simulated import SimulatedWorld


def _allocate_on_rank(group: CPGroupLike, num_ubatches: int) -> dict[str, Any]:
    ws = DirectCPWorkspace(group, group_device(group), num_ubatches)
    storage, ptrs = ws.allocate((num_ubatches, 3, 5), torch.bfloat16)
    storage2, ptrs2 = ws.allocate((num_ubatches, 7), torch.int32)
    return {
        "ws": ws,
        "storage": storage,
        "ptrs": ptrs,
        "storage2": storage2,
        "ptrs2": ptrs2,
        "mc": ws.multicast_ptrs(storage),
    }


def group_device(group: Any) -> torch.device:
    return torch.device(getattr(group, "device", "cpu"))


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("num_ubatches", [1, 2])
def test_simulated_peer_pointer_tables(
    device: torch.device, world_size: int, num_ubatches: int
) -> None:
    world = SimulatedWorld(world_size, device)
    results = world.run(_allocate_on_rank, num_ubatches)
    storages = [r["storage"] for r in results]
    for rank, r in enumerate(results):
        ws: DirectCPWorkspace = r["ws"]
        assert ws.world_size == world_size
        assert ws.rank == rank
        assert ws.epoch.dtype == torch.int64
        assert ws.epoch.tolist() == [0] * num_ubatches
        assert r["storage"].shape == (num_ubatches, 3, 5)
        assert torch.equal(
            r["storage"].cpu(), torch.zeros(num_ubatches, 3, 5, dtype=torch.bfloat16)
        )
        ptrs = r["ptrs"]
        assert ptrs.dtype == torch.int64
        assert ptrs.shape == (num_ubatches, world_size)
        assert ptrs.device.type == device.type
        for u in range(num_ubatches):
            for p in range(world_size):
                assert int(ptrs[u, p]) == storages[p][u].data_ptr()
                assert int(r["ptrs2"][u, p]) == results[p]["storage2"][u].data_ptr()
        assert r["mc"] == [0] * num_ubatches  # simulated groups have no multicast
        assert ws.nbytes() == num_ubatches * (15 * 2 + 7 * 4)
        with ws:
            pass
        assert ws.closed
        with pytest.raises(RuntimeError, match="closed"):
            ws.allocate((num_ubatches, 1), torch.float32)
        ws.close()  # idempotent


@pytest.mark.parametrize(
    ("field", "message"),
    [
        ("shape", "shape[1] is 3 on rank 0 but 4 on rank 1"),
        ("dtype", "dtype is torch.bfloat16 on rank 0 but torch.float32 on rank 1"),
    ],
)
def test_check_mode_refuses_ranks_allocating_different_buffers(
    device: torch.device, field: str, message: str
) -> None:
    """Check mode (on in every test): the ranks compare shape and dtype before the symmetric
    allocation; each raises, naming the field and the rank, and nothing is allocated."""

    def allocate(group: Any) -> str:
        r = group.rank_in_group
        ws = DirectCPWorkspace(group, device, 2)
        shape = (2, 3 + (r if field == "shape" else 0))
        dtype = torch.float32 if field == "dtype" and r == 1 else torch.bfloat16
        with pytest.raises(ValueError, match="the ranks' calls disagree") as info:
            ws.allocate(shape, dtype)
        assert ws.nbytes() == 0
        return str(info.value)

    for r, text in enumerate(SimulatedWorld(2, device).run(allocate)):
        assert message in text
        assert f"raised on rank {r} of 2" in text


def test_validation(device: torch.device) -> None:
    group = SimulatedWorld(1, device).groups[0]
    with pytest.raises(ValueError, match="num_ubatches must be >= 1, got 0"):
        DirectCPWorkspace(group, device, 0)
    with pytest.raises(TypeError, match="num_ubatches must be an int"):
        DirectCPWorkspace(group, device, True)  # type: ignore[arg-type]
    ws = DirectCPWorkspace(group, device, 2)
    with pytest.raises(ValueError, match=r"must start with the ubatch dim num_ubatches=2"):
        ws.allocate((3, 4), torch.float32)
    with pytest.raises(ValueError, match="non-positive"):
        ws.allocate((2, 0), torch.float32)
    with pytest.raises(TypeError, match=r"torch\.dtype"):
        ws.allocate((2, 4), "float32")  # type: ignore[arg-type]
    for shape in ((2, 4.7), (2, True), (2, "3")):  # int() would truncate or parse them
        with pytest.raises(TypeError, match="must hold ints"):
            ws.allocate(shape, torch.float32)  # type: ignore[arg-type]
    assert ws.multicast_ptrs(torch.empty(2, 4)) == [0, 0]  # unknown storage


def test_allocate_refuses_a_shape_that_is_not_a_sequence(device: torch.device) -> None:
    """An int, None, a string or bytes is refused with a TypeError (a string is no sequence of
    sizes, nor are bytes)."""
    ws = DirectCPWorkspace(SimulatedWorld(1, device).groups[0], device, 2)
    bad: tuple[Any, ...] = (4, None, "24", b"\x02\x04")
    for shape in bad:
        message = f"shape must be a sequence of ints, got {shape!r}"
        with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
            ws.allocate(shape, torch.float32)
    with pytest.raises(TypeError, match=r"^workspace shape \(2, '3'\) must hold ints$"):
        ws.allocate([2, "3"], torch.float32)  # type: ignore[list-item]
    good: tuple[Any, ...] = ([2, 4], torch.Size([2, 4]), (2, torch.tensor(4)))
    for seq in good:  # sequences of ints
        storage, _ = ws.allocate(seq, torch.float32)
        assert storage.shape == (2, 4)


class _Handle:
    def __init__(self, ptr: int, forbid: bool = False):
        self._ptr = ptr
        self._forbid = forbid

    @property
    def multicast_ptr(self) -> int:
        if self._forbid:
            pytest.fail("multicast_ptr read although the environment disables multicast")
        return self._ptr


def test_multicast_ptrs_from_handle(monkeypatch: pytest.MonkeyPatch, device: torch.device) -> None:
    for name in capability.MULTICAST_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    ws = DirectCPWorkspace(SimulatedWorld(1, device).groups[0], device, 3)
    storage, _ = ws.allocate((3, 8), torch.float32)
    ws._allocations[-1].handle = _Handle(1 << 40)
    assert ws.multicast_ptrs(storage) == [(1 << 40) + u * 32 for u in range(3)]
    ws._allocations[-1].handle = _Handle(0)
    assert ws.multicast_ptrs(storage) == [0, 0, 0]
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    ws._allocations[-1].handle = _Handle(1 << 40, forbid=True)
    assert ws.multicast_ptrs(storage) == [0, 0, 0]


def symm_mem_ranks(rank: int, world_size: int) -> list[str]:
    """Real torch symmetric memory on the GPU: pointer table, zero fill, a peer write."""
    failures: list[str] = []
    device = torch.device("cuda", torch.cuda.current_device())
    with DirectCPWorkspace(dist.group.WORLD, device, 2) as ws:
        storage, ptrs = ws.allocate((2, 64), torch.float32)
        if ptrs.shape != (2, world_size):
            failures.append(f"ptrs shape {tuple(ptrs.shape)}")
        if int(ptrs[0, rank]) != storage.data_ptr() or int(ptrs[1, rank]) != storage[1].data_ptr():
            failures.append("own pointers differ from the storage")
        if not torch.equal(storage, torch.zeros_like(storage)):
            failures.append("storage not zero-filled")
        if ws.multicast_ptrs(storage) != [0, 0]:
            failures.append("multicast pointers non-zero with multicast disabled")
    return failures


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [1, 2])
def test_gpu_symmetric_memory_workspace(
    run_ranks: Callable[..., list[Any]], world_size: int
) -> None:
    results = run_ranks(symm_mem_ranks, world_size, timeout=180.0)
    failures = [f for r in results for f in r]
    assert not failures, failures


def agreement_ranks(rank: int, world_size: int, failing: tuple[int, ...]) -> dict[str, Any]:
    """Every rank runs the agreement after a local step that failed on the ``failing`` ranks;
    then one more collective shows the group is still in step."""
    group = as_cp_group(dist.group.WORLD)
    device = torch.device("cuda", torch.cuda.current_device()) if dist_backend_is_nccl() else None
    flag = agreement_flag(group, torch.device("cpu") if device is None else device)
    failure = MemoryError(f"rank {rank} is full") if rank in failing else None
    report: dict[str, Any] = {"raised": None}
    try:
        agree_on_local_step(group, flag, failure, "the step")
    except SymmetricAllocationError as exc:
        report.update(
            raised=str(exc), failed_ranks=exc.failed_ranks, cause=type(exc.__cause__).__name__
        )
    total = group.all_reduce(torch.ones(1, device=device))
    report["after"] = float(total.item())
    return report


def dist_backend_is_nccl() -> bool:
    return dist.get_backend() == "nccl"


@pytest.mark.parametrize(
    ("world_size", "failing"),
    [(1, ()), (1, (0,)), (2, ()), (2, (1,)), (2, (0, 1)), (4, (2,)), (4, (0, 3))],
)
def test_a_local_failure_raises_on_every_rank_together(
    run_ranks: Callable[..., list[Any]], world_size: int, failing: tuple[int, ...]
) -> None:
    """A rank-local allocation failure (out of memory on one rank) must not leave the other
    ranks waiting in the rendezvous: after the agreement every rank raises
    ``SymmetricAllocationError`` naming the failing ranks, and the group stays in step."""
    reports = run_ranks(agreement_ranks, world_size, failing, timeout=120.0)
    for rank, rep in enumerate(reports):
        assert rep["after"] == world_size
        if not failing:
            assert rep["raised"] is None
            continue
        assert rep["failed_ranks"] == list(failing)
        assert rep["raised"].startswith(
            f"the step failed on rank(s) {list(failing)} of {world_size}"
        )
        if rank in failing:
            assert rep["cause"] == "MemoryError"
            assert f"here (rank {rank}): MemoryError: rank {rank} is full" in rep["raised"]
        else:
            assert rep["cause"] == "NoneType"
            assert "here" not in rep["raised"]


def failing_symm_mem_ranks(rank: int, world_size: int) -> list[str]:
    """Real symmetric memory: rank 1 cannot allocate (stubbed ``empty``), then every rank
    raises together, the group stays in step and the next allocation works."""
    import torch.distributed._symmetric_memory as symm_mem

    failures: list[str] = []
    device = torch.device("cuda", torch.cuda.current_device())
    real_empty = symm_mem.empty

    def empty_oom(*args: Any, **kwargs: Any) -> torch.Tensor:
        if rank == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (stubbed on rank 1)")
        return real_empty(*args, **kwargs)

    with DirectCPWorkspace(dist.group.WORLD, device, 1) as ws:
        symm_mem.empty = empty_oom  # type: ignore[assignment]
        try:
            ws.allocate((1, 64), torch.float32)
            failures.append("no error")
        except SymmetricAllocationError as exc:
            if exc.failed_ranks != [1]:
                failures.append(f"failed ranks {exc.failed_ranks}")
        finally:
            symm_mem.empty = real_empty  # type: ignore[assignment]
        storage, _ = ws.allocate((1, 64), torch.float32)
        if not torch.equal(storage, torch.zeros_like(storage)):
            failures.append("storage not zero-filled")
    return failures


@pytest.mark.multigpu(2)
def test_gpu_one_rank_out_of_memory_fails_every_rank_together(
    run_ranks: Callable[..., list[Any]],
) -> None:
    results = run_ranks(failing_symm_mem_ranks, 2, timeout=180.0)
    failures = [f for r in results for f in r]
    assert not failures, failures


@pytest.mark.gpu
def test_gpu_out_of_memory_is_a_symmetric_allocation_error(
    run_ranks: Callable[..., list[Any]],
) -> None:
    """A real out-of-memory allocation (2**50 bytes) at world size 1."""
    assert run_ranks(oversized_symm_mem_rank, 1, timeout=180.0) == [[]]


def oversized_symm_mem_rank(rank: int, world_size: int) -> list[str]:
    device = torch.device("cuda", torch.cuda.current_device())
    with DirectCPWorkspace(dist.group.WORLD, device, 1) as ws:
        try:
            ws.allocate((1, 1 << 48), torch.float32)
        except SymmetricAllocationError as exc:
            return [] if exc.failed_ranks == [0] and exc.__cause__ is not None else [str(exc)]
    return ["no error"]


def _after_rendezvous_failing_ranks(rank: int, world_size: int, case: str) -> dict[str, Any]:
    """gloo ranks over stubbed symmetric memory (host buffers, a store-backed rendezvous and
    barrier that wait for every rank, like torch's): rank 1 fails a rank-local step after the
    rendezvous (``case="no_handle"``: its rendezvous returns None; ``"table"``: building its
    peer table raises). One more collective then shows whether the group is still in step."""
    import torch.distributed._symmetric_memory as symm_mem

    store = dist.distributed_c10d._get_default_store()
    store.set_timeout(__import__("datetime").timedelta(seconds=10))

    class _Handle:
        def __init__(self, buf: torch.Tensor) -> None:
            self.buf = buf

        def get_buffer(
            self, peer: int, shape: tuple[int, ...], dtype: torch.dtype, offset: int
        ) -> torch.Tensor:
            return self.buf  # host stand-in: every peer's view is the local buffer

        def barrier(self) -> None:
            store.set(f"barrier/{rank}", "in")
            for peer in range(world_size):
                store.get(f"barrier/{peer}")  # a rank that skipped it times the others out

    def rendezvous(buf: torch.Tensor, name: str) -> _Handle | None:
        store.set(f"rendezvous/{rank}", "in")
        for peer in range(world_size):
            store.get(f"rendezvous/{peer}")
        return None if case == "no_handle" and rank == 1 else _Handle(buf)

    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    symm_mem.empty = lambda shape, dtype, device: torch.zeros(shape, dtype=dtype)  # type: ignore[assignment]
    symm_mem.rendezvous = rendezvous  # type: ignore[assignment]
    ws = DirectCPWorkspace(dist.group.WORLD, "cpu", 1)
    ws.device = torch.device("cuda", 0)  # past the CUDA check; the buffers stay on the host
    host_table = ws._peer_table

    def peer_table(views: list[torch.Tensor]) -> torch.Tensor:
        if case == "table" and rank == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (stubbed on rank 1)")
        ws.device = torch.device("cpu")
        try:
            return host_table(views)
        finally:
            ws.device = torch.device("cuda", 0)

    ws._peer_table = peer_table  # type: ignore[method-assign]
    report: dict[str, Any] = {"raised": None}
    try:
        ws.allocate((1, 4), torch.float32)
    except SymmetricAllocationError as exc:
        report.update(raised=str(exc), failed_ranks=exc.failed_ranks)
    report["after"] = float(as_cp_group(dist.group.WORLD).all_reduce(torch.ones(1)).item())
    return report


@pytest.mark.parametrize("case", ["no_handle", "table"])
def test_a_rank_local_failure_after_the_rendezvous_raises_on_every_rank(
    run_ranks: Callable[..., list[Any]], device: torch.device, case: str
) -> None:
    """A rank-local step after the rendezvous failed on rank 1 (its peer table could not be
    built; or a handle was missing, which the stub returns after its exchange: torch's CUDA
    backend returns None only before its exchange, for a buffer it did not allocate). The
    ranks agree before the barrier and raise together."""
    if device.type != "cpu":
        pytest.skip("stubs symmetric memory in its rank processes: a CPU (gloo) test")
    for report in run_ranks(_after_rendezvous_failing_ranks, 2, case, timeout=60.0):
        assert report["after"] == 2
        assert report["failed_ranks"] == [1]
        assert report["raised"].startswith("rendezvous of the symmetric allocation of 16 bytes")
