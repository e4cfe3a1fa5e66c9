"""The project's only task runner.

CPU sessions (``lint typecheck layers tests build demo docs``) create their own virtual
environments with ``torch`` pinned by ``testing/constraints.txt`` (a CPU build on our machines).
GPU sessions (``gpu_tests bench``) run against the machine's already-installed CUDA torch and
triton without creating a venv, so they work on a GPU box that has no package registry.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import sys
import tempfile

import nox

ROOT = pathlib.Path(__file__).parent
PACKAGES = ["cp-common", "cp-dcp", "cp-pcp", "cp-testing"]
IMPORT_NAMES = {p: "cpattn_" + p.removeprefix("cp-") for p in PACKAGES}
CONSTRAINTS = str(ROOT / "testing" / "constraints.txt")
# The oldest torch the packages declare, with the Triton its wheel pins (``tests_oldest``).
OLDEST_CONSTRAINTS = str(ROOT / "testing" / "constraints-oldest.txt")
SRC_DIRS = [str(ROOT / "packages" / p / "src") for p in PACKAGES]
TEST_DIRS = [f"packages/{p}/tests" for p in PACKAGES] + ["tests"]
# numpy: the Triton interpreter (TRITON_INTERPRET=1) imports it; torch does not pull it in.
# matplotlib: the benchmark page's plot in tests/test_benchmarks.py.
TEST_DEPS = [
    "pytest>=8",
    "pytest-timeout>=2.2",
    "pytest-xdist>=3.5",
    "hypothesis>=6.100",
    "import-linter>=2.1",
    "numpy",
    "matplotlib>=3.7",
]
# Multicast must stay off wherever our processes run; children inherit these.
NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

nox.options.default_venv_backend = "venv"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["lint", "typecheck", "layers", "tests", "build"]


def _install_packages(session: nox.Session, *extra: str, constraints: str = CONSTRAINTS) -> None:
    """Install torch (pinned), then every package editable, siblings resolved from source."""
    editables: list[str] = []
    for package in PACKAGES:
        editables += ["-e", f"packages/{package}"]
    session.install("-c", constraints, "torch", *extra, *editables)


def _src_pythonpath() -> str:
    return os.pathsep.join([*SRC_DIRS, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check + ruff format --check over the whole tree."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict, one run per package (configuration in the root pyproject.toml)."""
    # numpy: the interpreter fixes of cpattn_testing import it lazily (it is not declared)
    _install_packages(session, "mypy>=1.10", "numpy")
    for package in PACKAGES:
        session.run("mypy", f"packages/{package}/src")


@nox.session
def layers(session: nox.Session) -> None:
    """import-linter contracts: testing > (dcp | pcp) > common, siblings independent."""
    session.install("import-linter>=2.1")
    # grimp reads sources from sys.path; no need to install torch for a static check.
    session.run("lint-imports", env={"PYTHONPATH": _src_pythonpath()})


def _run_tests(session: nox.Session, constraints: str) -> None:
    _install_packages(session, *TEST_DEPS, constraints=constraints)
    # One worker per core (at most 4: each worker and each rank it starts imports torch); a
    # single-threaded torch in each, as the interpreter's numpy and the gloo ranks share the
    # cores anyway.
    workers = ["-n", "auto", "--maxprocesses", "4"]
    args = session.posargs or ["-q", *workers, "--durations=20", "--timeout=900", *TEST_DIRS]
    env = {"TRITON_INTERPRET": "1", "CPATTN_TEST_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
    session.run("python", "-m", "pytest", *args, env={**env, **NO_MULTICAST_ENV})


@nox.session
def tests(session: nox.Session) -> None:
    """CPU tests of every package: Triton kernels under TRITON_INTERPRET=1, ranks on gloo."""
    _run_tests(session, CONSTRAINTS)


@nox.session
def tests_oldest(session: nox.Session) -> None:
    """The same tests on the oldest torch and Triton the packages declare (not run by CI).

    torch 2.7 has only CUDA wheels on the package index for Linux: this session downloads
    torch, its NVIDIA libraries and Triton 3.3 (5.3 GB installed), which then run on the CPU.
    """
    _run_tests(session, OLDEST_CONSTRAINTS)


@nox.session(venv_backend="none")
def gpu_tests(session: nox.Session) -> None:
    """Tests on the machine's CUDA torch/triton (no venv): kernels on the GPU, ranks on nccl.

    World sizes larger than the number of visible GPUs are skipped with a reason.
    Equivalent plain command (for a GPU box without nox): ``bash scripts/gpu_tests.sh``.
    """
    session.run("bash", "scripts/gpu_tests.sh", *session.posargs, external=True)


def _wheel_for(dist: pathlib.Path, package: str) -> pathlib.Path:
    stem = "cpattn_" + package.removeprefix("cp-")
    wheels = sorted(dist.glob(f"{stem}-*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one wheel for {package} in {dist}, found {wheels}")
    return wheels[0]


@nox.session
def build(session: nox.Session) -> None:
    """Build sdist + wheel of each package, then install each wheel ALONE into a fresh venv.

    Each install resolves our own siblings only from the freshly built wheels (checked in pip's
    install report: a `cpattn-*` distribution that came from anywhere else fails the session),
    third-party dependencies from the index. torch, the one dependency every package declares
    and the largest, is installed once (pinned to the local CPU build) into a venv of its own
    that each fresh venv sees through a ``.pth`` file.
    """
    session.install("build>=1.2", "hatchling>=1.21")
    dist = ROOT / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    for package in PACKAGES:
        wheel_and_sdist = ["python", "-m", "build", "--no-isolation", "--outdir", str(dist)]
        session.run(*wheel_and_sdist, f"packages/{package}")
    with tempfile.TemporaryDirectory(prefix="cpattn-build-") as tmp:
        torch_venv = pathlib.Path(tmp) / "torch"
        session.run(sys.executable, "-m", "venv", str(torch_venv), external=True)
        torch_py = str(torch_venv / "bin" / "python")
        pip = ["-m", "pip", "install", "-q", "-c", CONSTRAINTS]
        session.run(torch_py, *pip, "torch", external=True)
        site = _purelib(session, torch_py)
        for package in PACKAGES:
            _install_alone(session, pathlib.Path(tmp) / package, dist, package, site)


def _purelib(session: nox.Session, python: str) -> str:
    """The site-packages directory of the venv whose interpreter is ``python``."""
    code = "import sysconfig; print(sysconfig.get_path('purelib'))"
    return str(session.run(python, "-c", code, external=True, silent=True)).strip()


def _install_alone(
    session: nox.Session, where: pathlib.Path, dist: pathlib.Path, package: str, torch_site: str
) -> None:
    """``build``'s check of one wheel: a fresh venv (torch from ``torch_site``), the wheel
    installed with pip, the provenance of our siblings checked, the package imported."""
    venv = where / "venv"
    session.run(sys.executable, "-m", "venv", str(venv), external=True)
    py = str(venv / "bin" / "python")
    (pathlib.Path(_purelib(session, py)) / "torch-site.pth").write_text(torch_site + "\n")
    report = where / "report.json"
    wheel = _wheel_for(dist, package)
    session.run(
        py, "-m", "pip", "install", "-q", "--report", str(report),
        "--find-links", str(dist), "-c", CONSTRAINTS, str(wheel),
        external=True,
    )  # fmt: skip
    for item in json.loads(report.read_text())["install"]:
        name = item["metadata"]["name"]
        url = item["download_info"]["url"]
        if name == "torch":
            session.error(f"{package} reinstalled torch ({url}): the shared build was not seen")
        if name.startswith("cpattn-") or name.startswith("cpattn_"):
            if not url.startswith(dist.as_uri()):
                session.error(f"{name} for {package} came from {url}, not from {dist}")
            session.log(f"{package}: {name} {item['metadata']['version']} <- {url}")
        if name in ("cp-common", "cp_common"):
            session.error(f"{package} pulled the unrelated index project {name}")
    module = IMPORT_NAMES[package]
    check = f"import {module}; print({module}.__name__, {module}.__version__)"
    # The installed wheel, not a source tree an outer PYTHONPATH may point at; no interpreter
    # (it would need numpy, which the wheels do not declare).
    session.run(py, "-c", check, external=True, env={"PYTHONPATH": "", "TRITON_INTERPRET": "0"})


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: greedy decoding of a small transformer on context-parallel ranks.

    PCP prefill, a KV cache sharded across DCP ranks, each decode step combined by every path
    and checked against the same model on one rank; 4 CPU ranks on gloo by default.
    ``nox -s demo -- --backend nccl`` (one rank per visible GPU) runs on the machine's CUDA
    torch and triton instead, like ``gpu_tests``: no install, the packages from source, no
    interpreter. The same without nox: ``PYTHONPATH=<the four packages/*/src> python3 -m
    cpattn_testing.demo --backend nccl``; under ``torchrun`` on several nodes see
    ``docs/multi-node.md``.
    """
    args = list(session.posargs)
    joined = " ".join(args)
    nccl = "--backend nccl" in joined or "--backend=nccl" in joined
    if nccl:
        python = shutil.which("python3") or sys.executable  # the machine's, not this venv's
        session.run(
            python, "-m", "cpattn_testing.demo", *args,
            env={"PYTHONPATH": _src_pythonpath(), "TRITON_INTERPRET": "0", **NO_MULTICAST_ENV},
            external=True,
        )  # fmt: skip
        return
    # numpy: the Triton interpreter (TRITON_INTERPRET=1) needs it; torch does not pull it in.
    _install_packages(session, "numpy")
    session.run(
        "python",
        "-m",
        "cpattn_testing.demo",
        *args,
        env={"TRITON_INTERPRET": "1", **NO_MULTICAST_ENV},
    )


@nox.session(venv_backend="none")
def bench(session: nox.Session) -> None:
    """The benchmark on the machine's CUDA torch and triton: ``benchmarks/<kind>.json``, then
    ``docs/performance.md`` and its plot (``benchmarks/README.md``).

    ``nox -s bench -- --quick`` (< 2 min), ``-- --render-only`` (the page from the committed
    JSON files, no GPU). The same without nox: ``python3 benchmarks/run.py [args]``.
    """
    python = shutil.which("python3") or sys.executable  # the machine's, not nox's
    session.run(
        python,
        "benchmarks/run.py",
        *session.posargs,
        env={"PYTHONPATH": _src_pythonpath(), **NO_MULTICAST_ENV},
        external=True,
    )


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation site with mkdocs, warnings as errors.

    The site needs no package import (no API autodoc), so only mkdocs is installed. The
    ```python examples on the pages are executed by ``tests/test_docs_examples.py`` (part of
    ``nox -s tests``); ``nox -s docs -- --examples`` runs them here too.
    """
    examples = "--examples" in session.posargs
    if examples:
        _install_packages(session, "mkdocs>=1.5", "numpy", *TEST_DEPS)
    else:
        session.install("mkdocs>=1.5")
    session.run("mkdocs", "build", "--strict", "--site-dir", "build/site")
    if examples:
        session.run(
            "python", "-m", "pytest", "-q", "tests/test_docs_examples.py",
            env={"TRITON_INTERPRET": "1", "CPATTN_TEST_DEVICE": "cpu", **NO_MULTICAST_ENV},
        )  # fmt: skip
