"""`defrag run`'s summary line and `--report` (issue 46 items 10 and 18).

The report of a run that ran out of memory says what the refusal was, as it
was then: the request, live, stranded and reserved bytes, the capacity the
message advised, and the pool's stats at that moment (the rest of the report
is taken at exit). The summary line says what is stranded at exit in bytes,
with its share of the reserved bytes beside them.
"""

from __future__ import annotations

import json
import re
import subprocess
import textwrap

import pytest

from defrag import fastpath
from defrag.run import summary_line

from ..forked import run_module
from .conftest import MiB

needs_native = pytest.mark.skipif(fastpath.setting() == "off", reason="DEFRAG_FASTPATH=0: no native allocator")

BASE = {"exit_code": 0, "seconds": 0.1, "device": "emulated", "capacity_bytes": 1 << 30, "page_size_bytes": 2 << 20,
        "peak_live_bytes": 3 << 20, "peak_reserved_bytes": 6 << 20, "reserved_over_live": 2.0, "ooms": 0,
        "compactions": 0, "allocations": 20}


@pytest.mark.parametrize("stranded, reserved, shown", [
    (1258291, 4 << 20, "stranded at exit 1.20 MiB (30% of reserved)"),
    (0, 4 << 20, "stranded at exit 0 B"),
    (0, 0, "stranded at exit 0 B"),
    (16 << 10, 8 << 30, "stranded at exit 16.00 KiB (<1% of reserved)"),
])
def test_the_summary_says_what_is_stranded_at_exit_in_bytes_first(stranded, reserved, shown):
    """A small healthy run strands a large share of its few pages: the bytes come first, the share is named
    as a share of the reserved bytes, and the alarming word "fragmentation" is not used."""
    line = summary_line({**BASE, "stranded_at_exit_bytes": stranded, "reserved_at_exit_bytes": reserved,
                         "fragmentation_at_exit": stranded / reserved if reserved else 0.0})
    assert f" · {shown} · 0 OOMs · " in line, line
    assert "fragmentation" not in line


# 256 tensors of 256 KiB, every 4th kept: 16 MiB live, 48 MiB stranded in 32 pages of a 64 MiB pool. A
# request of 40 MiB is refused (caught, its message printed), then one of 100 MiB (uncaught: exit 1).
OOMS = textwrap.dedent("""
    import torch
    ts = [torch.empty(256 << 10, dtype=torch.uint8) for _ in range(256)]
    keep = ts[::4]
    del ts
    try:
        torch.empty(40 << 20, dtype=torch.uint8)
    except torch.OutOfMemoryError as exc:
        print(str(exc).replace("\\n", " "))
    del keep[32:]  # live shrinks between the two
    torch.empty(100 << 20, dtype=torch.uint8)
""")


def defrag_run(tmp_path) -> subprocess.CompletedProcess:
    """`python -m defrag run ... --report mem.json prog.py` in `tmp_path`, forked from the test zygote."""
    return run_module("defrag", "run", "--device", "emulated", "--capacity", "64MiB", "--report", "mem.json",
                      "prog.py", cwd=str(tmp_path), timeout=240)


def advised(message: str) -> str:
    (value,) = re.findall(r"run with --capacity (\S+) or more", message)
    return value


@needs_native
def test_the_report_of_a_run_that_ran_out_of_memory_says_what_was_refused_then(tmp_path):
    (tmp_path / "prog.py").write_text(OOMS)
    proc = defrag_run(tmp_path)
    assert proc.returncode == 1, proc.stderr
    data = json.loads((tmp_path / "mem.json").read_text())
    first, last = data["first_oom"], data["last_oom"]
    assert data["summary"]["ooms"] == 2
    assert (first["requested_bytes"], first["capacity_bytes"], first["live_bytes"], first["stranded_bytes"]) == \
        (40 * MiB, 64 * MiB, 16 * MiB, 48 * MiB)
    assert first["reserved_bytes"] == 64 * MiB and first["device_full"] is False
    # The capacity the report advises is the one each message advised, as typed there.
    assert first["advised_capacity"] == advised(proc.stdout) == "104MiB"
    assert first["advised_capacity_bytes"] == 104 * MiB
    message = proc.stderr.split("torch.OutOfMemoryError: ", 1)[1]
    assert (last["requested_bytes"], last["live_bytes"]) == (100 * MiB, 8 * MiB)
    assert last["advised_capacity"] == advised(message)
    # The stats at each refusal, not at exit (where nothing the program made is live).
    assert first["stats"]["allocated_bytes.all.current"] == 16 * MiB and first["stats"]["num_ooms"] == 1
    assert last["stats"]["allocated_bytes.all.current"] == 8 * MiB and last["stats"]["num_ooms"] == 2
    assert data["stats"]["allocated_bytes.all.current"] == 0
    assert first["seconds"] <= last["seconds"] <= data["summary"]["seconds"]
    summary = proc.stderr.splitlines()[-1]
    assert f"stranded at exit {'0 B' if not data['summary']['stranded_at_exit_bytes'] else ''}" in summary, summary


@needs_native
def test_a_run_without_an_oom_reports_none(tmp_path):
    (tmp_path / "prog.py").write_text("import torch\nx = torch.ones(1000)\n")
    proc = defrag_run(tmp_path)
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "mem.json").read_text())
    assert data["first_oom"] is None and data["last_oom"] is None and data["summary"]["ooms"] == 0
    assert data["summary"]["stranded_at_exit_bytes"] == data["stats"]["stranded_bytes"]
    assert data["summary"]["reserved_at_exit_bytes"] == data["stats"]["reserved_bytes.all.current"]
