"""Build and load a one-file CPython extension against the installed torch, cached on disk.

What ``cpattn_common.launch_plans`` builds its native module with. Compared with
``torch.utils.cpp_extension.load`` it needs no ``ninja`` (one compiler call, as Triton builds
its launcher), and it takes no lock: each build writes a file of its own and renames it into
place, so a build killed half-way leaves no lock behind for the next process to wait on
forever. A process that finds another one's build of the same file in progress (its temporary
file, written in the last ``_PEER_WAIT_S`` seconds) waits for it, at most that long, rather
than compile the same thing again (the ranks of one job start together); if it does not
finish, the process builds itself.

The cache file's name carries a hash of everything the binary's validity depends on: the
source, the torch build, the Python ABI and the compile flags; not which compiler built it nor
where torch is installed, so that a build made once (``python -m cpattn_common
build-launch-plans`` in an image) loads where no compiler is installed. The file is readable by
everyone the umask lets read it, as a compiler's own output is. Where it lives:
``$CPATTN_CACHE_DIR``, else ``$XDG_CACHE_HOME/cpattn``, else ``~/.cache/cpattn``.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch

__all__ = ["cache_dir", "load_extension"]

#: A compile taking longer than this (seconds) fails the build.
_COMPILE_TIMEOUT_S = 600.0
# Temporary files of builds older than this (seconds) are left-overs of killed builds.
_STALE_TMP_S = 3600.0
# How long to wait for another process's build of the same file (a compile takes 15-20 s).
_PEER_WAIT_S = 120.0
_PEER_POLL_S = 0.25


def cache_dir() -> Path:
    """Where built extensions are kept (see the module docstring)."""
    if d := os.environ.get("CPATTN_CACHE_DIR"):
        return Path(d)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cpattn"


def _compiler() -> list[str]:
    """The C++ compiler command: ``$CXX`` (may carry arguments), else ``c++`` / ``g++`` /
    ``clang++`` from ``PATH``."""
    if cxx := os.environ.get("CXX"):
        return shlex.split(cxx)
    for name in ("c++", "g++", "clang++"):
        if path := shutil.which(name):
            return [path]
    raise RuntimeError("no C++ compiler found (set CXX, or put c++ / g++ / clang++ on PATH)")


def _flags(name: str) -> list[str]:
    """The compile flags, without paths (part of the cache key)."""
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        *("-O2", "-std=c++17", "-shared", "-fPIC", "-w"),
        f"-DTORCH_EXTENSION_NAME={name}",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
    ]


def _command(name: str, source: Path, output: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths, library_paths

    cmd = [*_compiler(), *_flags(name)]
    # -isystem: torch's headers warn under some compilers; they are not ours to fix.
    for inc in [*include_paths(), sysconfig.get_paths()["include"]]:
        cmd += ["-isystem", inc]
    cmd += [str(source), "-o", str(output)]
    # The libraries are loaded already (import torch), so no rpath: the loader finds them by
    # their sonames, wherever torch is installed.
    cmd += [f"-L{d}" for d in library_paths()]
    cmd += ["-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]
    return cmd


def _build_key(name: str, source_text: bytes) -> str:
    h = hashlib.sha256()
    for part in (
        name.encode(),
        source_text,
        torch.__version__.encode(),
        str(torch.version.git_version).encode(),
        str(sys.implementation.cache_tag).encode(),
        str(sysconfig.get_config_var("EXT_SUFFIX")).encode(),
        "\0".join(_flags(name)).encode(),
    ):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()[:20]


def _umask() -> int:
    """This process's umask, read without changing it (Linux), else the usual 0o022."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    return 0o022


def _import(name: str, path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    if spec is None:  # pragma: no cover - spec_from_file_location with a loader never fails
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _remove_stale_temporaries(directory: Path, stem: str) -> None:
    now = time.time()
    for tmp in directory.glob(f".{stem}*.tmp"):
        try:
            if now - tmp.stat().st_mtime > _STALE_TMP_S:
                tmp.unlink()
        except OSError:
            pass


def _peer_build_finished(target: Path, prefix: str) -> bool:
    """Whether ``target`` exists, after waiting while another process's build of it (a
    temporary ``prefix*.tmp`` modified in the last ``_PEER_WAIT_S`` seconds) is in progress."""
    deadline = time.monotonic() + _PEER_WAIT_S
    while not target.is_file() and time.monotonic() < deadline:
        now = time.time()
        in_progress = False
        for tmp in target.parent.glob(f"{prefix}*.tmp"):
            with contextlib.suppress(OSError):  # renamed or removed meanwhile
                in_progress = in_progress or now - tmp.stat().st_mtime < _PEER_WAIT_S
        if not in_progress:
            break
        time.sleep(_PEER_POLL_S)
    return target.is_file()


def load_extension(name: str, source: Path, *, directory: Path | None = None) -> ModuleType:
    """The extension module ``name`` built from the C++ file ``source``.

    ``source`` defines ``PyInit_<TORCH_EXTENSION_NAME>`` (the macro is set to ``name``) and may
    use torch's C++ headers and ``torch_python``. Loads the cached build when there is one;
    otherwise compiles it (seconds to tens of seconds: torch's headers are large) into a
    temporary file next to the cache file and renames it into place. Raises ``RuntimeError``
    with the compiler's message when the build fails, ``OSError`` when the cache directory
    cannot be written.
    """
    directory = cache_dir() if directory is None else directory
    source_text = source.read_bytes()
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    key = _build_key(name, source_text)
    target = directory / f"{name}_{key}{suffix}"
    prefix = f".{name}_{key}."
    if not target.is_file():
        directory.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(directory, name)
        if _peer_build_finished(target, prefix):
            return _import(name, target)
        fd, tmp_name = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=directory)
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            cmd = _command(name, source, tmp)
            try:
                done = subprocess.run(
                    cmd, capture_output=True, text=True, timeout=_COMPILE_TIMEOUT_S, check=False
                )
            except OSError as exc:  # the compiler could not be run at all
                raise RuntimeError(f"cannot run the C++ compiler {cmd[0]!r}: {exc}") from None
            except subprocess.TimeoutExpired as exc:
                raise RuntimeError(
                    f"compiling {source.name} took over {exc.timeout:.0f} s"
                ) from None
            if done.returncode != 0:
                tail = (done.stderr or done.stdout)[-2000:]
                raise RuntimeError(
                    f"compiling {source.name} failed (exit {done.returncode}): {tail}"
                )
            # mkstemp made the file 0600 and the linker only added execute bits.
            tmp.chmod(0o755 & ~_umask())
            os.replace(tmp, target)  # atomic: a reader sees no file or a whole one
        finally:
            tmp.unlink(missing_ok=True)
    return _import(name, target)
