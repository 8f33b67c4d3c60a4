"""The README's usage example runs as written and does what its comments say."""

from __future__ import annotations

import gc
import pathlib
import re

import defrag

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def test_readme_example_runs(capsys):
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    assert len(code.strip().splitlines()) <= 12
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "1"  # the automatic compaction the comment promises
    assert "Compaction (explicit" in out and "memory summary" in out
    pool = namespace["pool"]
    assert pool.owns(namespace["big"]) and pool.owns(namespace["model"].weight)
    pool.check_invariants()
    namespace.clear()
    gc.collect()
    pool.close()
    assert pool.closed and pool not in defrag.open_pools()


def test_readme_first_lines_are_the_two_commands():
    lines = README.read_text().splitlines()
    assert lines[0] == "```sh" and lines[3] == "```"
    assert lines[1].endswith("defrag demo") and lines[2].endswith("python -m pytest -q")
    assert all("pip install torch==2.13.0" in line for line in lines[1:3])
