"""Every ```python block in docs/**/*.md and in the READMEs runs as is, so the documentation
cannot rot.

One test per block, named ``<page>:<line>`` (for example ``packages/dcp.md:41``; a README is
named by its path from the repository root, ``README.md`` or ``packages/cp-dcp/README.md``).
A block runs in this process with a fresh namespace, except:

- a block that guards its body with ``if __name__ == "__main__":`` (needed when it launches
  ranks with ``cpattn_testing.launcher.run_distributed``, whose rank function must be
  importable by the workers) runs as a script in a fresh interpreter;
- a block whose first line is a comment naming its ``torchrun`` command (``# torchrun
  --nproc-per-node 2 combine.py ...``) runs as that script under
  ``python -m torch.distributed.run --standalone --nproc-per-node <n>`` (gloo ranks on the CPU).

A block that truly cannot run on the CPU (GPU-only) is marked ``{.python .notest}``, which
mkdocs renders as Python; it is reported as skipped. Fence info strings that mkdocs cannot
render (such as ``python notest``) fail :func:`test_fences_render`.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SRC_DIRS = [ROOT / "packages" / p / "src" for p in ("cp-common", "cp-dcp", "cp-pcp", "cp-testing")]
SCRIPT_TIMEOUT_S = 240

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
# What Python-Markdown's fenced_code renders: ```lang or ```{.lang .class ...} / ``` { ... }.
_RENDERABLE_INFO = re.compile(r"^\s*([\w+-]+)?\s*(\{[^}]*\})?\s*$")
_SCRIPT_MARKER = re.compile(r"^if __name__ == [\"']__main__[\"']\s*:", re.MULTILINE)
_TORCHRUN = re.compile(r"^# torchrun\b.*--nproc[-_]per[-_]node[ =](?P<n>\d+)")


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced code block of a docs page."""

    page: str  # path relative to docs/
    line: int  # 1-based line of the opening fence
    info: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def classes(self) -> list[str]:
        info = self.info.strip()
        if info.startswith("{"):
            return [c.lstrip(".") for c in info.strip("{} ").split()]
        return info.split()

    @property
    def is_python(self) -> bool:
        return bool(self.classes) and self.classes[0] == "python"

    @property
    def notest(self) -> bool:
        return "notest" in self.classes[1:]

    @property
    def torchrun_ranks(self) -> int | None:
        """Ranks of a block that names its ``torchrun`` command on its first line, else None."""
        m = _TORCHRUN.match(self.code)
        return int(m.group("n")) if m else None


def extract_blocks(text: str, page: str) -> list[Block]:
    """Fenced code blocks of one Markdown page, in order (indented fences are dedented)."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, indent, start = m.group("fence"), m.group("indent"), i
        body: list[str] = []
        i += 1
        while i < len(lines):
            close = _FENCE.match(lines[i])
            if (
                close
                and close.group("fence")[0] == fence[0]
                and len(close.group("fence")) >= len(fence)
                and not close.group("info").strip()
            ):
                break
            line = lines[i]
            body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
            i += 1
        blocks.append(Block(page, start + 1, m.group("info"), textwrap.dedent("\n".join(body))))
        i += 1
    return blocks


def _all_blocks() -> list[Block]:
    blocks: list[Block] = []
    for path in sorted(DOCS.rglob("*.md")):
        page = path.relative_to(DOCS).as_posix()
        blocks.extend(extract_blocks(path.read_text(encoding="utf-8"), page))
    for path in [ROOT / "README.md", *sorted(ROOT.glob("packages/*/README.md"))]:
        page = path.relative_to(ROOT).as_posix()
        blocks.extend(extract_blocks(path.read_text(encoding="utf-8"), page))
    return blocks


ALL_BLOCKS = _all_blocks()
PYTHON_BLOCKS = [b for b in ALL_BLOCKS if b.is_python]


def _script_env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(p) for p in SRC_DIRS]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("TRITON_INTERPRET", "1")
    return env


# The Triton interpreter evaluates kernels with numpy, which warns on the intended -inf math.
@pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[b.id for b in PYTHON_BLOCKS])
def test_docs_example_runs(block: Block, tmp_path: pathlib.Path) -> None:
    if block.notest:
        pytest.skip(f"{block.id} is marked notest (cannot run on the CPU)")
    script = tmp_path / f"docs_example_{block.page.replace('/', '_').replace('.', '_')}.py"
    script.write_text(block.code + "\n", encoding="utf-8")
    ranks = block.torchrun_ranks
    if ranks is not None or _SCRIPT_MARKER.search(block.code):
        if ranks is None:
            launch = [sys.executable, str(script)]
        else:
            torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
            launch = [sys.executable, *torchrun, str(ranks), str(script)]
        result = subprocess.run(
            launch,
            cwd=tmp_path,
            env=_script_env(),
            capture_output=True,
            text=True,
            timeout=SCRIPT_TIMEOUT_S,
            check=False,
        )
        assert result.returncode == 0, (
            f"{block.id} failed (exit {result.returncode}):\n{result.stdout}\n{result.stderr}"
        )
        return
    namespace: dict[str, object] = {"__name__": f"docs_example_{block.line}"}
    code = compile(block.code, f"docs/{block.page}:{block.line}", "exec")
    exec(code, namespace)


def test_docs_have_python_examples() -> None:
    runnable = [b for b in PYTHON_BLOCKS if not b.notest]
    assert len(runnable) >= 5, [b.id for b in PYTHON_BLOCKS]
    notest = [b.id for b in PYTHON_BLOCKS if b.notest]
    assert len(notest) <= max(2, len(PYTHON_BLOCKS) // 5), f"too many notest blocks: {notest}"


def test_readme_has_a_torchrun_example() -> None:
    """The README's DCP combine runs under torchrun here, as a user would run it."""
    readme = [b for b in PYTHON_BLOCKS if b.page == "README.md"]
    assert any(b.torchrun_ranks == 2 and "cp_lse_ag_out_rs" in b.code for b in readme)


@pytest.mark.parametrize("block", ALL_BLOCKS, ids=[b.id for b in ALL_BLOCKS])
def test_fences_render(block: Block) -> None:
    """mkdocs (Python-Markdown fenced_code) renders ``python`` and ``{.python .notest}`` as code,
    but turns an info string like ``python notest`` into a paragraph: use the brace form."""
    assert _RENDERABLE_INFO.match(block.info), (
        f"{block.id}: fence info {block.info!r} does not render as a code block in mkdocs; "
        "write ```{.python .notest} to mark a block that must not run"
    )


def test_extract_blocks_handles_markers_and_indent() -> None:
    text = textwrap.dedent(
        """\
        # t

        ```python
        a = 1
        ```

        - item

            ```python
            b = 2
            ```

        ```{.python .notest}
        c = 3
        ```

        ````text
        ```python
        not a block
        ```
        ````

        ```python
        # torchrun --nproc-per-node 4 x.py
        d = 4
        ```
        """
    )
    blocks = extract_blocks(text, "t.md")
    assert [(b.line, b.is_python, b.notest, b.torchrun_ranks) for b in blocks] == [
        (3, True, False, None),
        (9, True, False, None),
        (13, True, True, None),
        (17, False, False, None),
        (23, True, False, 4),
    ]
    assert blocks[1].code == "b = 2"
    assert "not a block" in blocks[3].code
