"""The pytest plugin: device/backend fixtures, run_ranks, output poisoning, gpu markers."""

from __future__ import annotations

import math
import textwrap

import pytest
import torch

pytest_plugins = ["pytester"]


def test_device_and_backend_fixtures(device: torch.device, dist_backend: str) -> None:
    assert device.type in ("cpu", "cuda")
    assert dist_backend == ("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":  # indexed: torch.cuda.set_device / tensor.device compare equal
        assert device.index is not None
        assert torch.empty(1, device=device).device == device


def _fake_gpu_count(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """Make the plugin (markers, ``device`` fixture) see ``count`` GPUs, on any machine."""
    from cpattn_testing import pytest_plugin

    monkeypatch.setattr(pytest_plugin, "available_gpus", lambda: count)


def test_outputs_are_poisoned_during_tests() -> None:
    alloc = pytest.importorskip("cpattn_common.alloc")
    value = alloc.get_output_poison()
    assert value is not None
    assert math.isnan(value)
    out = alloc.empty_output((2, 3), dtype=torch.float32, device="cpu")
    assert torch.isnan(out).all()


@pytest.mark.no_output_poison
def test_no_output_poison_marker_turns_it_off() -> None:
    alloc = pytest.importorskip("cpattn_common.alloc")
    assert alloc.get_output_poison() is None


_INNER_TESTS = """
import pytest
import torch
import torch.distributed as dist

pytest_plugins = ["cpattn_testing.pytest_plugin"]


def rank_sum(rank, world_size):
    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    return int(t)


@pytest.mark.gpu
def test_needs_gpu():
    pass


@pytest.mark.multigpu(64)
def test_needs_64_gpus():
    pass


@pytest.mark.parametrize("world_size", [1, 4])
def test_four_ranks(run_ranks, world_size):
    assert run_ranks(rank_sum, world_size, timeout=60) == [world_size * (world_size + 1) // 2] * world_size
"""


@pytest.mark.parametrize("gpus", [0, 2])
def test_markers_and_run_ranks_in_a_downstream_project(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, gpus: int
) -> None:
    """The inner project runs on the CPU (gloo ranks) with the plugin seeing ``gpus`` GPUs:
    the GPU tests skip either way (with GPUs, because the CPU was asked for: they used to run
    and get the CPU device and gloo ranks)."""
    monkeypatch.setenv("CPATTN_TEST_DEVICE", "cpu")
    _fake_gpu_count(monkeypatch, gpus)
    pytester.makepyfile(test_downstream=_INNER_TESTS)
    result = pytester.runpytest_inprocess("-rs", "-p", "no:cacheprovider", "--strict-markers")
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed") == 2, result.stdout.str()
    assert outcomes.get("skipped") == 2, result.stdout.str()
    first = (
        "*needs a CUDA GPU; none is visible to torch on this machine*"
        if gpus == 0
        else "*runs on CUDA only, and CPATTN_TEST_DEVICE asks for the CPU*"
    )
    result.stdout.fnmatch_lines([first, f"*needs 64 CUDA GPUs; {gpus} visible to torch*"])


def test_gpu_marked_tests_run_when_cuda_is_asked_for(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CPATTN_TEST_DEVICE", "cuda")
    _fake_gpu_count(monkeypatch, 2)
    pytester.makepyfile(
        test_gpu=textwrap.dedent(
            """
            import pytest
            pytest_plugins = ["cpattn_testing.pytest_plugin"]

            @pytest.mark.gpu
            def test_one():
                pass

            @pytest.mark.multigpu(2)
            def test_two():
                pass

            @pytest.mark.multigpu(4)
            def test_four():
                pass
            """
        )
    )
    result = pytester.runpytest_inprocess("-rs", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, skipped=1)
    result.stdout.fnmatch_lines(["*needs 4 CUDA GPUs; 2 visible to torch*"])


def test_cuda_device_without_gpu_skips_run_ranks(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CPATTN_TEST_DEVICE", "cuda")
    _fake_gpu_count(monkeypatch, 0)  # a GPU machine behaves like one without GPUs here
    pytester.makepyfile(
        test_cuda=textwrap.dedent(
            """
            pytest_plugins = ["cpattn_testing.pytest_plugin"]

            def test_uses_ranks(run_ranks):
                raise AssertionError("must not run")
            """
        )
    )
    result = pytester.runpytest_inprocess("-rs", "-p", "no:cacheprovider")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*CPATTN_TEST_DEVICE=cuda but no CUDA GPU is visible*"])


def test_bad_multigpu_argument_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_bad=textwrap.dedent(
            """
            import pytest
            pytest_plugins = ["cpattn_testing.pytest_plugin"]

            @pytest.mark.multigpu("two")
            def test_x():
                pass
            """
        )
    )
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(["*multigpu(n) needs an int n >= 1, got 'two'*"])


def _python_blocks(markdown: str) -> list[str]:
    blocks: list[str] = []
    current: list[str] = []
    inside = False
    for line in markdown.splitlines():
        if line.startswith("```python"):
            inside, current = True, []
        elif line.startswith("```") and inside:
            inside = False
            blocks.append("\n".join(current) + "\n")
        elif inside:
            current.append(line)
    return blocks


def test_readme_four_rank_example_runs(pytester: pytest.Pytester) -> None:
    """The README's downstream example (conftest + 4-rank test) passes as written.

    On the CPU every world size (1, 2, 4) runs over gloo. With ``CPATTN_TEST_DEVICE=cuda`` the
    ranks use nccl, one GPU per rank: world sizes above the visible GPU count are skipped with
    the launcher's reason (all of them when no GPU is visible), the others must pass.
    """
    import os
    import pathlib

    from cpattn_testing.launcher import available_gpus

    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    blocks = _python_blocks(readme)
    conftest = next(b for b in blocks if b.startswith("# conftest.py"))
    test = next(b for b in blocks if b.startswith("# test_my_combine.py"))
    assert "[1, 2, 4]" in test, "the README example's world sizes changed: update this test"
    pytester.makeconftest(conftest)
    pytester.makepyfile(test_my_combine=test)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-q", "-rs")
    world_sizes = (1, 2, 4)
    requested = os.environ.get("CPATTN_TEST_DEVICE", "cpu").strip() or "cpu"
    if torch.device(requested).type == "cuda":
        gpus = available_gpus()
        runnable = [w for w in world_sizes if w <= gpus]
        too_big = [w for w in world_sizes if w > gpus]
    else:
        gpus, runnable, too_big = 0, list(world_sizes), []
    result.assert_outcomes(passed=len(runnable), skipped=len(too_big))
    if too_big and gpus == 0:
        result.stdout.fnmatch_lines(["*CPATTN_TEST_DEVICE=cuda but no CUDA GPU is visible*"])
    elif too_big:
        for w in too_big:  # the launcher's reason, one line per world size
            result.stdout.fnmatch_lines(
                [f"*world_size {w} needs {w} GPUs (one per rank on nccl), but {gpus} * visible*"]
            )


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"PYTEST_XDIST_WORKER": "gw5", "CPATTN_XDIST_GPUS": "4"}, "1"),
        ({"PYTEST_XDIST_WORKER": "gw2", "CPATTN_XDIST_GPUS": "8"}, "2"),
        ({"PYTEST_XDIST_WORKER": "gw2"}, None),
        ({"CPATTN_XDIST_GPUS": "8"}, None),
        (
            {"PYTEST_XDIST_WORKER": "gw1", "CPATTN_XDIST_GPUS": "2", "CUDA_VISIBLE_DEVICES": "7"},
            "7",
        ),
    ],
)
def test_xdist_gpu_pinning(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], expected: str | None
) -> None:
    import os

    from cpattn_testing.pytest_plugin import _pin_gpu_for_xdist_worker

    # The function writes os.environ directly: give it a copy, so that no CUDA_VISIBLE_DEVICES
    # it sets outlives this test (it once did, and hid the GPU from the ranks spawned by later
    # tests of the same session).
    monkeypatch.setattr(os, "environ", dict(os.environ))
    for key in ("PYTEST_XDIST_WORKER", "CPATTN_XDIST_GPUS", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    _pin_gpu_for_xdist_worker()
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == expected
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    monkeypatch.setenv("CPATTN_XDIST_GPUS", "zero")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(pytest.UsageError, match="must be a GPU count"):
        _pin_gpu_for_xdist_worker()


def test_require_device_memory_skips_with_the_amount() -> None:
    """Off CUDA, and on CUDA with less free memory than asked, the test is skipped with a
    reason that names the amount."""
    from cpattn_testing.pytest_plugin import require_device_memory

    with pytest.raises(
        pytest.skip.Exception, match=r"needs 3\.0 GiB of CUDA memory; running on cpu"
    ):
        require_device_memory(torch.device("cpu"), 3 * 2**30)
    if torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
        with pytest.raises(pytest.skip.Exception, match=r"needs .* GiB free on cuda"):
            require_device_memory(dev, 2**60)
        require_device_memory(dev, 1)  # returns: enough is free


def test_require_ptxas_skips_without_the_nvidia_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without Triton's NVIDIA backend the test is skipped, with the reason."""
    import sys

    from cpattn_testing.pytest_plugin import require_ptxas

    monkeypatch.setitem(sys.modules, "triton.backends.nvidia", None)  # import fails
    with pytest.raises(pytest.skip.Exception, match="NVIDIA backend is not installed"):
        require_ptxas()


_ENV_TESTS = """
import os

import torch
import triton
import triton.language as tl

WANT = {want!r}


@triton.jit
def add_one(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)


def environment(rank, world_size):
    return {{k: os.environ.get(k) for k in WANT}}


def test_environment(run_ranks):
    assert {{k: os.environ.get(k) for k in WANT}} == WANT
    assert run_ranks(environment, 1, timeout=120) == [WANT]  # the ranks inherit it
    if WANT["TRITON_INTERPRET"] == "1":  # a kernel of the test module runs on CPU tensors
        x = torch.zeros(3)
        add_one[(1,)](x, 3, BLOCK=4)
        assert x.tolist() == [1.0, 1.0, 1.0]
"""


@pytest.mark.parametrize(
    ("given", "want"),
    [
        ({}, {"TRITON_INTERPRET": "1", "CPATTN_CHECKS": "1"}),
        (
            {"TRITON_INTERPRET": "0", "CPATTN_CHECKS": "0"},
            {"TRITON_INTERPRET": "0", "CPATTN_CHECKS": "0"},
        ),
    ],
    ids=["unset", "set-by-the-user"],
)
def test_a_cpu_machine_runs_the_interpreter_and_the_checks(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    given: dict[str, str],
    want: dict[str, str],
) -> None:
    """In a fresh process without a visible GPU, the plugin sets ``TRITON_INTERPRET=1`` before
    the test module's kernels are decorated, and ``CPATTN_CHECKS=1``; what the user set stays."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU, on any machine
    monkeypatch.setenv("CPATTN_TEST_DEVICE", "cpu")  # a GPU run's setting would skip run_ranks
    for key in want:
        monkeypatch.delenv(key, raising=False)
    for key, value in given.items():
        monkeypatch.setenv(key, value)
    pytester.makeconftest('pytest_plugins = ["cpattn_testing.pytest_plugin"]\n')
    pytester.makepyfile(test_env=_ENV_TESTS.format(want=want))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_triton_imported_before_the_plugin_is_a_warning(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    pytester.makeconftest('import triton\n\npytest_plugins = ["cpattn_testing.pytest_plugin"]\n')
    pytester.makepyfile(test_nothing="def test_nothing():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, warnings=1)
    result.stdout.fnmatch_lines(
        ["*set TRITON_INTERPRET=1 in the environment before Triton is imported*"]
    )
