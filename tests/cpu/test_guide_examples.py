"""Every Python example of docs/guide.md runs, and prints what the guide shows it prints.

The guide's conventions (stated at its top, checked here):

* An example is a ```python block. What it prints is the ```text block that
  follows it directly (only blank lines in between). An example with no such
  block must print nothing.
* In the output, `...` inside a line stands for any text on that line (times,
  addresses); a line that is only `...` stands for any number of lines (a long
  table shown in part). Everything else is compared exactly (trailing spaces
  aside).
* An example that cannot run here carries a visible marker on the line before
  its fence: `<!-- not run: why, and what runs it instead -->`. Every other
  example runs, so a new example is run unless someone says why not.

Each example runs as its own `python` process in a fresh folder, on the
emulated device: a crash fails its test instead of killing pytest, pool
numbers start at #1, and examples cannot see each other's pools. What it
writes to stderr fails the test too (the reader would see it).
"""

from __future__ import annotations

import dataclasses
import difflib
import pathlib
import re

import pytest

from ..forked import checkout_env, run_python

ROOT = pathlib.Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guide.md"
NOT_RUN = re.compile(r"<!--\s*not run:\s*(.*?)\s*-->")
# The examples that do not run here, by the section they are in; adding one means saying why, here too.
EXPECTED_NOT_RUN = {"2. Your program, unmodified: `defrag run`", "16. Several GPUs"}
# Settings that change what the examples print: the guide shows a reader's defaults (a suite run in
# another mode, e.g. without torch's storage swap, still checks the guide as a reader runs it).
RESET = ("DEFRAG_EMULATED_CAPACITY", "DEFRAG_EMULATED_GRANULARITY", "DEFRAG_FORCE_NO_SWAP_DATA_PTR",
         "DEFRAG_NO_STORAGE_EXT")


@dataclasses.dataclass
class Example:
    line: int  # 1-based line of the ```python fence
    section: str
    code: str
    output: str | None  # the ```text block after it, None when there is none
    not_run: str | None  # the reason given by a <!-- not run: ... --> marker

    @property
    def name(self) -> str:
        return f"line{self.line}"


def parse(text: str) -> list[Example]:
    """The ```python blocks of a guide, each with its output block and its not-run marker."""
    lines = text.splitlines()
    blocks = []  # (fence line index, info string, body lines, closing line index)
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            info = lines[i][3:].strip()
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            if j == len(lines):
                raise ValueError(f"guide line {i + 1}: a ``` block that is never closed")
            blocks.append((i, info, lines[i + 1:j], j))
            i = j + 1
        else:
            i += 1
    examples = []
    section = ""
    headings = [(k, line[3:].strip()) for k, line in enumerate(lines) if line.startswith("## ")]
    for n, (start, info, body, end) in enumerate(blocks):
        if info != "python":
            continue
        section = ([h for k, h in headings if k < start] or [""])[-1]
        before = start - 1
        while before >= 0 and not lines[before].strip():
            before -= 1
        marker = NOT_RUN.search(lines[before]) if before >= 0 else None
        output = None
        if n + 1 < len(blocks):
            nstart, ninfo, nbody, _ = blocks[n + 1]
            if ninfo == "text" and all(not line.strip() for line in lines[end + 1:nstart]):
                output = "\n".join(nbody)
        examples.append(Example(start + 1, section, "\n".join(body) + "\n", output,
                                marker.group(1) if marker else None))
    return examples


def pattern(expected: str) -> re.Pattern:
    """`expected` as a regex: `...` in a line is any text, a line of `...` any number of lines."""
    parts = []
    for line in expected.rstrip("\n").splitlines():
        if line.strip() == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append(".*?".join(re.escape(piece) for piece in line.rstrip().split("...")) + r"\n")
    return re.compile("".join(parts))


def normalise(out: str) -> str:
    return "".join(line.rstrip() + "\n" for line in out.splitlines())


def matches(expected: str | None, out: str) -> bool:
    if expected is None or not expected.strip():
        return out.strip() == ""
    return pattern(expected).fullmatch(normalise(out)) is not None


EXAMPLES = parse(GUIDE.read_text())
RUN = [e for e in EXAMPLES if e.not_run is None]


@pytest.mark.parametrize("example", RUN, ids=[e.name for e in RUN])
def test_guide_example_prints_what_the_guide_shows(example, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(example.code)
    # The checkout first on PYTHONPATH, as for every forked scenario: where PYTHONUNBUFFERED=1 is set already
    # and no RESET variable is, this is the suite's zygote (one start fewer).
    env = checkout_env(PYTHONUNBUFFERED="1")
    for name in RESET:
        env.pop(name, None)
    # `python example.py` in tmp_path, forked from a zygote that imported torch and defrag (tests/forked.py)
    proc = run_python(example.code, path=str(script), cwd=str(tmp_path), env=env, timeout=300)
    where = f"docs/guide.md line {example.line} ({example.section})"
    assert proc.returncode == 0, f"{where} failed (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}"
    assert proc.stderr == "", f"{where} wrote to stderr:\n{proc.stderr}"
    if not matches(example.output, proc.stdout):
        shown = (example.output or "").splitlines()
        diff = "\n".join(difflib.unified_diff(shown, normalise(proc.stdout).splitlines(), "the guide shows",
                                              "the example prints", lineterm=""))
        pytest.fail(f"{where} prints something else than the ```text block after it shows "
                    f"(`...` matches anything):\n{diff}")


def test_every_example_is_run_or_says_why_not():
    assert len(EXAMPLES) >= 15 and len(RUN) >= 14
    not_run = {e.section: e.not_run for e in EXAMPLES if e.not_run is not None}
    assert set(not_run) == EXPECTED_NOT_RUN, not_run
    assert all(len(reason) > 10 for reason in not_run.values()), not_run


def test_every_output_block_belongs_to_an_example():
    """A ```text block that follows no example would be read as output and never checked."""
    text = GUIDE.read_text()
    attached = sum(e.output is not None for e in EXAMPLES)
    assert text.count("\n```text\n") == attached


def test_the_comparison_rules():
    assert matches("a 1\nb ... ms\n", "a 1  \nb 3.2 ms\n")
    assert matches("head\n...\ntail\n", "head\nx\ny\ntail\n")
    assert matches("head\n...\ntail\n", "head\ntail\n")
    assert not matches("a 1\n", "a 2\n")
    assert not matches("a 1\n", "a 1\nmore\n")
    assert not matches(None, "anything\n")
    assert matches(None, "")
    assert not matches("x ... y\n", "x 1\ny\n")  # `...` inside a line stays on that line
