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
import re
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


# --- links: every relative link of docs/*.md and README.md points at a file and a heading ---

ROOT = DOCS.parent
_LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose(text: str) -> list[tuple[int, str]]:
    """The lines outside fenced code blocks, numbered from 1, inline code removed."""
    kept: list[tuple[int, str]] = []
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            kept.append((number, re.sub(r"`[^`]*`", "``", line)))
    return kept


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped (not `-` or
    `_`), each space a `-`."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = text.replace("`", "").strip().lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings (a repeated one gets -1, -2, ...)."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        match = None if fenced else _HEADING.match(line)
        if match is None:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(path: Path) -> list[str]:
    """Each relative link of `path` whose file, or whose heading anchor, does not exist."""
    broken: list[str] = []
    for number, line in _prose(path.read_text()):
        for target in _LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
                continue
            where, _, anchor = target.partition("#")
            linked = (path.parent / where).resolve() if where else path
            name = f"{path.relative_to(ROOT)}:{number}: {target}"
            if not linked.exists():
                broken.append(f"{name} (no file {where})")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{name} (no heading #{anchor} in {linked.name})")
    return broken


def test_every_relative_link_and_anchor_in_the_docs_exists() -> None:
    files = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
    broken = [line for path in files for line in broken_links(path)]
    assert broken == []


def test_the_link_check_finds_a_missing_file_and_a_missing_anchor(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text(
        "# Title\n\n## An eval over workers: `eval --via`\n\n"
        "[ok](#an-eval-over-workers-eval---via) [ok](b.md#b-part) [ok](https://x.test/y.md)\n"
        "[gone](missing.md) [stale](b.md#nothing) `[code](not-a-link.md)`\n\n"
        "```text\n[in a fence](nope.md)\n```\n"
    )
    (tmp_path / "b.md").write_text("# B part\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert broken_links(tmp_path / "a.md") == [
            "a.md:6: missing.md (no file missing.md)",
            "a.md:6: b.md#nothing (no heading #nothing in b.md)",
        ]
    finally:
        ROOT = saved
