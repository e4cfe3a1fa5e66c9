"""native_build: a cached, lock-free build of a one-file extension (a tiny source here, so
that each build takes about a second)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from cpattn_common import native_build

_TINY = textwrap.dedent(
    """
    #include <Python.h>
    #define CAT2(a, b) a##b
    #define CAT(a, b) CAT2(a, b)
    static PyModuleDef tiny_def = {PyModuleDef_HEAD_INIT, "tiny", nullptr, -1, nullptr};
    PyMODINIT_FUNC CAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
      PyObject* m = PyModule_Create(&tiny_def);
      if (m != nullptr) PyModule_AddIntConstant(m, "answer", ANSWER);
      return m;
    }
    """
)


def _source(tmp_path: Path, answer: int) -> Path:
    path = tmp_path / "tiny.cpp"
    path.write_text(_TINY.replace("ANSWER", str(answer)))
    return path


def _built(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if not p.name.startswith("."))


def test_builds_once_then_loads_from_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    module = native_build.load_extension("cpattn_tiny_a", _source(tmp_path, 41), directory=cache)
    assert module.answer == 41
    (built,) = _built(cache)
    assert built.name.startswith("cpattn_tiny_a_")
    assert not list(cache.glob(".*.tmp"))

    def no_compiler(*args: object, **kwargs: object) -> None:
        raise AssertionError("a cached build compiled again")

    monkeypatch.setattr("cpattn_common.native_build.subprocess.run", no_compiler)
    again = native_build.load_extension("cpattn_tiny_a", _source(tmp_path, 41), directory=cache)
    assert again.answer == 41


def test_a_cached_build_loads_without_a_compiler_and_from_another_source_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Built once (in an image, say), loaded where no compiler is on PATH and the package
    sits elsewhere: the key holds no compiler and no path."""
    cache = tmp_path / "cache"
    native_build.load_extension("cpattn_tiny_k", _source(tmp_path, 17), directory=cache)
    moved = tmp_path / "site-packages-elsewhere"
    moved.mkdir()
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "no-tools-here"))
    module = native_build.load_extension("cpattn_tiny_k", _source(moved, 17), directory=cache)
    assert module.answer == 17
    assert len(_built(cache)) == 1


def test_a_build_is_readable_by_others_as_the_umask_allows(tmp_path: Path) -> None:
    """mkstemp creates 0600 files; a build shared through CPATTN_CACHE_DIR must not stay so."""
    cache = tmp_path / "cache"
    previous = os.umask(0o022)
    try:
        native_build.load_extension("cpattn_tiny_m", _source(tmp_path, 19), directory=cache)
    finally:
        os.umask(previous)
    (built,) = _built(cache)
    assert built.stat().st_mode & 0o777 == 0o755


def test_a_changed_source_is_a_new_build(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    native_build.load_extension("cpattn_tiny_b", _source(tmp_path, 1), directory=cache)
    module = native_build.load_extension("cpattn_tiny_c", _source(tmp_path, 2), directory=cache)
    assert module.answer == 2
    assert len(_built(cache)) == 2


def test_compile_errors_raise_with_the_compiler_message(tmp_path: Path) -> None:
    bad = tmp_path / "bad.cpp"
    bad.write_text("#include <Python.h>\nint broken( {\n")
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match=r"compiling bad\.cpp failed \(exit \d+\): .*error"):
        native_build.load_extension("cpattn_tiny_bad", bad, directory=cache)
    assert list(cache.iterdir()) == []  # neither a build nor a temporary file left


def test_a_missing_compiler_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(RuntimeError, match="cannot run the C\\+\\+ compiler"):
        native_build.load_extension("cpattn_tiny_d", _source(tmp_path, 3), directory=tmp_path)
    monkeypatch.delenv("CXX")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler found"):
        native_build.load_extension("cpattn_tiny_d", _source(tmp_path, 3), directory=tmp_path)


def test_stale_temporaries_are_removed(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    stale, fresh = cache / ".cpattn_tiny_e_old.tmp", cache / ".cpattn_tiny_e_new.tmp"
    for path in (stale, fresh):
        path.write_bytes(b"partial")
    hours_ago = time.time() - 2 * 3600
    os.utime(stale, (hours_ago, hours_ago))
    native_build.load_extension("cpattn_tiny_e", _source(tmp_path, 5), directory=cache)
    assert not stale.exists()
    assert fresh.exists()  # may be another process's build in progress


def test_a_build_in_progress_elsewhere_is_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process's fresh temporary of the same file: wait for its build, compile
    nothing."""
    source = _source(tmp_path, 11)
    native_build.load_extension("cpattn_tiny_g", source, directory=tmp_path / "elsewhere")
    (built,) = _built(tmp_path / "elsewhere")
    cache = tmp_path / "cache"
    cache.mkdir()
    key = built.name.removeprefix("cpattn_tiny_g_").split(".")[0]
    (cache / f".cpattn_tiny_g_{key}.peer.tmp").write_bytes(b"being written")

    def no_compiler(*args: object, **kwargs: object) -> None:
        raise AssertionError("compiled while another build of the same file was in progress")

    monkeypatch.setattr("cpattn_common.native_build.subprocess.run", no_compiler)
    peer = threading.Timer(0.5, shutil.copy, (built, cache / built.name))
    peer.start()
    try:
        module = native_build.load_extension("cpattn_tiny_g", source, directory=cache)
    finally:
        peer.join()
    assert module.answer == 11


def test_a_build_that_does_not_finish_is_not_waited_for_long(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    source = _source(tmp_path, 13)
    key = native_build._build_key("cpattn_tiny_h", source.read_bytes())
    (cache / f".cpattn_tiny_h_{key}.killed.tmp").write_bytes(b"never finished")
    monkeypatch.setattr(native_build, "_PEER_WAIT_S", 0.5)
    start = time.monotonic()
    module = native_build.load_extension("cpattn_tiny_h", source, directory=cache)
    assert module.answer == 13
    assert time.monotonic() - start >= 0.5  # waited, then built


def test_processes_building_at_once_both_succeed(tmp_path: Path) -> None:
    """No lock: each build renames its own file into place."""
    source, cache = _source(tmp_path, 7), tmp_path / "cache"
    code = (
        "import sys; from pathlib import Path; from cpattn_common import native_build as nb; "
        "m = nb.load_extension('cpattn_tiny_f', Path(sys.argv[1]), directory=Path(sys.argv[2]));"
        " print(m.answer)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(source), str(cache)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        assert out.strip() == "7"
    assert len(_built(cache)) == 1


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CPATTN_CACHE_DIR", "/x/cpattn-cache")
    assert native_build.cache_dir() == Path("/x/cpattn-cache")
    monkeypatch.delenv("CPATTN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "/y")
    assert native_build.cache_dir() == Path("/y/cpattn")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", "/z")
    assert native_build.cache_dir() == Path("/z/.cache/cpattn")
