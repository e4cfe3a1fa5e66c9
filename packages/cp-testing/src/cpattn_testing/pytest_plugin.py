"""pytest plugin of cpattn-testing (opt in with ``pytest_plugins = ["cpattn_testing.pytest_plugin"]``;
docs/packages/testing.md, "In your pytest suite").

Fixtures ``device`` (``CPATTN_TEST_DEVICE``, ``cpu`` by default; cuda without a GPU skips),
``dist_backend`` (gloo / nccl) and ``run_ranks(fn, world_size, *args, timeout=120.0)``
(``run_distributed`` with the device's backend; skips when GPUs are missing); autouse NaN output
poisoning (opt out: ``@pytest.mark.no_output_poison``) and check mode as ``CPATTN_CHECKS`` says
(opt out: ``@pytest.mark.no_checks``); markers ``gpu`` and ``multigpu(n)``. Under pytest-xdist
with ``CPATTN_XDIST_GPUS=<n>`` worker ``gwK`` sees only GPU ``K % n``. Sets
``TRITON_INTERPRET=1`` without a CUDA device and ``CPATTN_CHECKS=1``, each unless set (in
``os.environ``, so the ranks inherit them).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import pytest
import torch

from cpattn_testing.interpreter import apply_interpreter_fixes
from cpattn_testing.launcher import (
    POISON_ENV,
    NotEnoughDevicesError,
    available_gpus,
    run_distributed,
)

__all__ = [
    "RunRanks",
    "device",
    "dist_backend",
    "require_device_memory",
    "require_ptxas",
    "run_ranks",
]

_DEVICE_ENV = "CPATTN_TEST_DEVICE"
_XDIST_GPUS_ENV = "CPATTN_XDIST_GPUS"
_CHECKS_ENV = "CPATTN_CHECKS"


class RunRanks(Protocol):
    """Type of the ``run_ranks`` fixture."""

    def __call__(
        self, fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = ...
    ) -> list[Any]: ...


def _pin_gpu_for_xdist_worker() -> None:
    """Under pytest-xdist with ``CPATTN_XDIST_GPUS=<n>`` (and no ``CUDA_VISIBLE_DEVICES``),
    worker ``gwK`` sees only GPU ``K % n``."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = os.environ.get(_XDIST_GPUS_ENV, "")
    if not worker.startswith("gw") or not count or "CUDA_VISIBLE_DEVICES" in os.environ:
        return
    try:
        index, n = int(worker[2:]), int(count)
    except ValueError as exc:
        raise pytest.UsageError(
            f"{_XDIST_GPUS_ENV}={count!r} must be a GPU count (worker {worker!r})"
        ) from exc
    if n < 1:
        raise pytest.UsageError(f"{_XDIST_GPUS_ENV} must be >= 1, got {n}")
    os.environ["CUDA_VISIBLE_DEVICES"] = str(index % n)


def _set_test_environment(config: pytest.Config) -> None:
    """``CPATTN_CHECKS=1`` unless set; ``TRITON_INTERPRET=1`` unless set or a GPU is visible."""
    os.environ.setdefault(_CHECKS_ENV, "1")
    if "TRITON_INTERPRET" in os.environ or available_gpus() > 0:
        return
    os.environ["TRITON_INTERPRET"] = "1"
    if "triton" in sys.modules:
        config.issue_config_time_warning(
            pytest.PytestConfigWarning(
                "no CUDA device: cpattn_testing.pytest_plugin set TRITON_INTERPRET=1, but Triton "
                "was imported before, and kernels decorated before now are compiled for a GPU "
                "(their launches fail on CPU tensors): set TRITON_INTERPRET=1 in the "
                "environment before Triton is imported"
            ),
            stacklevel=2,
        )


def pytest_configure(config: pytest.Config) -> None:
    """Register the markers (so ``--strict-markers`` accepts them in downstream projects); set
    ``CPATTN_CHECKS`` and, without a GPU, ``TRITON_INTERPRET`` (unless set); under the
    interpreter, make it convert bf16 as the GPU does (``cpattn_testing.interpreter``)."""
    _pin_gpu_for_xdist_worker()
    _set_test_environment(config)
    apply_interpreter_fixes()
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped otherwise)")
    config.addinivalue_line(
        "markers", "multigpu(n): needs at least n CUDA GPUs (skipped otherwise)"
    )
    config.addinivalue_line(
        "markers", "no_output_poison: do not fill fresh outputs with NaN in this test"
    )
    config.addinivalue_line("markers", "no_checks: run this test with the library's check mode off")


def _multigpu_count(marker: pytest.Mark) -> int:
    n = marker.args[0] if marker.args else marker.kwargs.get("n")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise pytest.UsageError(f"multigpu(n) needs an int n >= 1, got {n!r}")
    return n


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip ``gpu`` / ``multigpu(n)`` tests the machine or the requested device cannot run,
    with the reason."""
    needed = 0
    if item.get_closest_marker("gpu") is not None:
        needed = 1
    for marker in item.iter_markers("multigpu"):
        needed = max(needed, _multigpu_count(marker))
    if needed == 0:
        return
    gpus = available_gpus()
    if gpus < needed:
        if needed == 1:
            pytest.skip("needs a CUDA GPU; none is visible to torch on this machine")
        pytest.skip(f"needs {needed} CUDA GPUs; {gpus} visible to torch on this machine")
    if _requested_device().type != "cuda":  # the fixtures would hand it the CPU
        pytest.skip(
            f"runs on CUDA only, and {_DEVICE_ENV} asks for the CPU (set {_DEVICE_ENV}=cuda, "
            "as scripts/gpu_tests.sh does)"
        )


def require_device_memory(device: torch.device, nbytes: int) -> None:
    """Skip the calling test unless ``device`` is a CUDA device with ``nbytes`` free now (after
    emptying torch's cache)."""
    if device.type != "cuda":
        pytest.skip(f"needs {nbytes / 2**30:.1f} GiB of CUDA memory; running on {device}")
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    if free < nbytes:
        pytest.skip(f"needs {nbytes / 2**30:.1f} GiB free on {device}, {free / 2**30:.1f} free")


def require_ptxas() -> None:
    """Skip the calling test unless Triton's NVIDIA backend and its bundled ``ptxas`` are
    installed (what compiling a kernel for sm_90 without a GPU needs)."""
    try:
        import triton.backends.nvidia as nv
    except ImportError:
        pytest.skip("Triton's NVIDIA backend is not installed")
    if not os.path.exists(os.path.join(os.path.dirname(nv.__file__), "bin", "ptxas")):
        pytest.skip("Triton's NVIDIA backend has no ptxas")


def _requested_device() -> torch.device:
    name = os.environ.get(_DEVICE_ENV, "cpu").strip() or "cpu"
    try:
        dev = torch.device(name)
    except RuntimeError as exc:
        raise pytest.UsageError(f"{_DEVICE_ENV}={name!r} is not a torch device: {exc}") from exc
    if dev.type not in ("cpu", "cuda"):
        raise pytest.UsageError(f"{_DEVICE_ENV} must be 'cpu' or 'cuda', got {name!r}")
    return dev


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The device tests run on: ``CPATTN_TEST_DEVICE`` (``cpu`` by default, or ``cuda``)."""
    dev = _requested_device()
    if dev.type == "cuda" and available_gpus() == 0:
        pytest.skip(f"{_DEVICE_ENV}={dev} but no CUDA GPU is visible to torch")
    index: int | None = dev.index  # None for a bare "cuda"
    if dev.type == "cuda" and index is None:  # torch.cuda.set_device rejects a bare "cuda"
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


@pytest.fixture(scope="session")
def dist_backend(device: torch.device) -> str:
    """``"gloo"`` when tests run on the CPU, ``"nccl"`` on CUDA."""
    return "nccl" if device.type == "cuda" else "gloo"


@pytest.fixture
def run_ranks(dist_backend: str) -> RunRanks:
    """``run_ranks(fn, world_size, *args, timeout=120.0) -> [result of rank 0, ...]``.

    ``fn`` must be a module-level function ``fn(rank, world_size, *args)``. Uses the test
    device's backend; skips when nccl needs more GPUs than are visible.
    """

    def run(
        fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0
    ) -> list[Any]:
        try:
            return run_distributed(fn, world_size, dist_backend, args=args, timeout=timeout)
        except NotEnoughDevicesError as exc:
            pytest.skip(str(exc))

    return run


@pytest.fixture(autouse=True)
def _cpattn_check_mode(request: pytest.FixtureRequest) -> Iterator[None]:
    """The library's check mode as ``CPATTN_CHECKS`` says (the plugin defaults it to on), off
    in tests marked ``no_checks``; set for the test whatever the import order was."""
    from cpattn_common.checks import check_mode, check_mode_from_env

    wanted = check_mode_from_env(default=True)
    with check_mode(wanted and request.node.get_closest_marker("no_checks") is None):
        yield


@pytest.fixture(autouse=True)
def _cpattn_output_poison(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """Fill every output allocated through ``cpattn_common.alloc`` with NaN during the test
    (also in the ranks of ``run_ranks``, through ``POISON_ENV``)."""
    if request.node.get_closest_marker("no_output_poison") is not None:
        monkeypatch.delenv(POISON_ENV, raising=False)
        yield
        return
    monkeypatch.setenv(POISON_ENV, "nan")
    from cpattn_common.alloc import poison_outputs

    with poison_outputs(float("nan")):
        yield
