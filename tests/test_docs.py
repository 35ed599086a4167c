"""Every ```python block in docs/*.md runs, as a standalone program, and exits 0.

Rules (docs/testing.md explains them to authors):

* A fenced block opened with ```python is a complete program: it runs in a subprocess
  (`python example.py`, cwd a fresh temporary directory, 60 s timeout) and must exit 0
  (forked from a Python that has imported trio_tasksets: `tests/fixtures/forkserver.py`).
* A block whose nearest non-blank line above it is `<!-- no-run -->` is not run (signatures,
  sketches, code that needs a network or a server).
* A ```text block that directly follows a run block (only blank lines between) is that
  program's expected stdout, compared as doctest does with ELLIPSIS and
  NORMALIZE_WHITESPACE: `...` matches anything.

Tests are named `<file>:<line of the opening fence>`, so a failure points at the block.
"""

from __future__ import annotations

import doctest
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import forkserver
import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
NO_RUN = "<!-- no-run -->"
TIMEOUT = 60
OUTPUT_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


@dataclass(frozen=True)
class Block:
    file: str
    line: int  # 1-based line of the opening fence
    code: str
    run: bool
    expected: str | None  # the ```text block right after it, if any

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass(frozen=True)
class _Fence:
    line: int
    lang: str
    body: str
    no_run: bool
    blank_gap_before: bool  # only blank lines since the previous fence closed


def _fences(text: str) -> list[_Fence]:
    fences: list[_Fence] = []
    lines = text.splitlines()
    previous = ""  # the nearest non-blank line seen outside a fence
    only_blank_since_fence = False
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        if stripped.startswith("```"):
            marker = stripped[: len(stripped) - len(stripped.lstrip("`"))]
            lang = stripped[len(marker) :].strip().split(" ")[0].lower()
            start = i
            body: list[str] = []
            i += 1
            while i < len(lines) and lines[i].strip() != marker:
                body.append(lines[i])
                i += 1
            fences.append(
                _Fence(
                    line=start + 1,
                    lang=lang,
                    body="\n".join(body) + "\n",
                    no_run=previous == NO_RUN,
                    blank_gap_before=only_blank_since_fence,
                )
            )
            previous = ""
            only_blank_since_fence = True
        elif stripped:
            previous = stripped
            only_blank_since_fence = False
        i += 1
    return fences


def extract(file: str, text: str) -> list[Block]:
    """The ```python blocks of one markdown text, with their run flag and expected output."""
    fences = _fences(text)
    blocks: list[Block] = []
    for index, fence in enumerate(fences):
        if fence.lang != "python":
            continue
        expected = None
        following = fences[index + 1] if index + 1 < len(fences) else None
        if following is not None and following.lang == "text" and following.blank_gap_before:
            expected = following.body
        blocks.append(Block(file, fence.line, fence.body, not fence.no_run, expected))
    return blocks


def all_blocks() -> list[Block]:
    blocks: list[Block] = []
    for path in sorted(DOCS.glob("*.md")):
        blocks.extend(extract(path.name, path.read_text(encoding="utf-8")))
    return blocks


BLOCKS = all_blocks()
RUNNABLE = [block for block in BLOCKS if block.run]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    for name in ("PYTEST_ADDOPTS", "PYTEST_CURRENT_TEST", "PYTEST_XDIST_WORKER"):
        env.pop(name, None)
    return env


@pytest.mark.parametrize("block", RUNNABLE, ids=[block.id for block in RUNNABLE])
def test_doc_example_runs(block: Block, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(block.code, encoding="utf-8")
    try:
        done = forkserver.run(
            [sys.executable, str(script)],
            cwd=tmp_path,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.id}: still running after {TIMEOUT} s")
    report = (
        f"{block.id} exited {done.returncode}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    )
    assert done.returncode == 0, report
    if block.expected is not None:
        checker = doctest.OutputChecker()
        assert checker.check_output(block.expected, done.stdout, OUTPUT_FLAGS), (
            f"{block.id}: stdout differs from the ```text block after it\n"
            f"--- expected\n{block.expected}--- got\n{done.stdout}"
        )


def test_the_docs_have_runnable_examples() -> None:
    files = {block.file for block in RUNNABLE}
    assert {"concepts.md", "runner.md", "tasksets.md", "testing.md"} <= files


def test_extract_honours_no_run_and_expected_output() -> None:
    text = "\n".join(
        [
            "Intro.",
            "",
            "```python",
            "print('a')",
            "```",
            "",
            "```text",
            "a",
            "```",
            "",
            "<!-- no-run -->",
            "",
            "```python",
            "await nothing",
            "```",
            "",
            "```pycon",
            ">>> 1",
            "```",
            "````python",
            "print('```')",
            "````",
            "Some prose.",
            "```text",
            "not output: prose came between",
            "```",
        ]
    )
    blocks = extract("x.md", text)
    assert [(b.line, b.run, b.expected) for b in blocks] == [
        (3, True, "a\n"),
        (13, False, None),
        (20, True, None),
    ]
    assert blocks[2].code == "print('```')\n"
