"""Every Python example in the user guide runs as written (on the emulated device here)."""

from __future__ import annotations

import gc
import pathlib
import re

import pytest

import defrag

GUIDE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "guide.md"
BLOCKS = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.S)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_guide_example_runs(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples that write pictures or snapshots write here
    namespace: dict = {"__name__": "__guide__"}
    try:
        exec(compile(BLOCKS[index], f"{GUIDE}:block{index}", "exec"), namespace)
    finally:
        namespace.clear()
        gc.collect()
        for pool in defrag.open_pools():
            pool.close()


def test_the_guide_has_examples():
    assert len(BLOCKS) >= 10
