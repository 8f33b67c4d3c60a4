"""Where defrag's subpackages load from: `kernels/` and `benchmarks/` stand beside `defrag/` in a checkout
and ship inside it in a wheel (`defrag.kernels`, `defrag.benchmarks`, pyproject's package-dir). Run from
a copy of a checkout, all three must come from that copy, never from the checkout an editable install
was made from."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_copy_of_the_checkout_loads_its_own_kernels_and_benchmarks(tmp_path):
    copy = tmp_path / "checkout-copy"
    for name in ("defrag", "kernels", "benchmarks"):
        shutil.copytree(ROOT / name, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", "import defrag, defrag.kernels, defrag.benchmarks.runner as r\n"
                               "print(defrag.__file__); print(defrag.kernels.__file__); print(r.__file__)"],
        cwd=copy, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = [Path(line).resolve() for line in proc.stdout.split()]
    assert len(files) == 3 and all(copy.resolve() in f.parents for f in files), (files, copy)
