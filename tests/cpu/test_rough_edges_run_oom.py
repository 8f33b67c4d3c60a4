"""An out-of-memory error under `defrag run` says what is true there (defrag/oom.py).

Under `defrag run` the pool is PyTorch's allocator: every block is PyTorch's,
and a request from inside an operation (whose tensors' raw addresses the
operation holds) moves nothing. The error says so, names the safe points
where PyTorch's tensors do move (`--rescue`, `--compact-at step`), how much is stranded between those blocks, the
`--capacity` that would have served the request (and the program completes
with it), freeing what the program no longer needs, and a `defrag.Pool` for
the data the program owns; never "unpin tensors" (the user pinned nothing),
"retry with defrag.retry_on_oom" (nothing it could move) or "create the pool
with capacity" (the option is --capacity). One test per situation the
message names.
"""

from __future__ import annotations

import re
import subprocess
import textwrap

import pytest
import torch

import defrag
from defrag import fastpath, oom

from ..forked import run_module
from .conftest import KiB, MiB

needs_native = pytest.mark.skipif(fastpath.setting() == "off", reason="DEFRAG_FASTPATH=0: no native allocator")
WRONG_HERE = ("unpin", "retry_on_oom", "create the pool with", "suggestion:")

# "frag N": 256 tensors of 256 KiB (8 per 2 MiB page), every 4th kept: each page keeps two, at the same
# offsets in every page (nothing to mesh), 16 MiB live and 48 MiB stranded; then a request of N MiB.
# "full L N": one tensor of L MiB, then a request of N MiB.
PROGRAM = textwrap.dedent("""
    import sys, torch
    if sys.argv[1] == "frag":
        ts = [torch.empty(256 << 10, dtype=torch.uint8) for _ in range(256)]
        keep = ts[::4]
        del ts
    else:
        keep = torch.empty(int(sys.argv[2]) << 20, dtype=torch.uint8)
    big = torch.empty(int(sys.argv[-1]) << 20, dtype=torch.uint8)
    print("served")
""")


def defrag_run(tmp_path, capacity: str, *args: str) -> subprocess.CompletedProcess:
    """`python -m defrag run ... prog.py args`, forked from the test zygote (tests/forked.py)."""
    (tmp_path / "prog.py").write_text(PROGRAM)
    return run_module("defrag", "run", "--device", "emulated", "--capacity", capacity, "prog.py", *args,
                      cwd=str(tmp_path), timeout=240)


def the_error(proc: subprocess.CompletedProcess) -> str:
    """The OutOfMemoryError's message as the program's traceback printed it."""
    assert proc.returncode == 1, proc.stdout + proc.stderr
    text = proc.stderr.split("torch.OutOfMemoryError: ", 1)[1]
    message = text.rsplit("\ndefrag run: exit 1", 1)[0]
    for phrase in WRONG_HERE:
        assert phrase not in message, f"{phrase!r} does not fit under defrag run:\n{message}"
    return message


def suggested_capacity(message: str) -> str:
    (value,) = re.findall(r"run with --capacity (\S+) or more", message)
    return value


@needs_native
def test_fragmentation_between_pytorchs_blocks_names_the_stranded_bytes_and_a_capacity_that_works(tmp_path):
    message = the_error(defrag_run(tmp_path, "64MiB", "frag", "40"))
    assert "this request came from inside an operation, which holds its tensors' raw addresses" in message
    assert "nothing moves there (16.00 MiB of PyTorch's blocks live)" in message
    assert "let PyTorch's tensors move between operations: defrag run --rescue" in message
    assert "48.00 MiB is free but stranded between PyTorch's blocks" in message and "(fragmentation)" in message
    assert "in a defrag.Pool (pool.empty, pool.adopt)" in message
    assert "free what the program no longer needs" in message
    # The capacity it names serves the request: every page stays as it was, 20 more are free.
    assert suggested_capacity(message) == "104MiB"
    proc = defrag_run(tmp_path, suggested_capacity(message), "frag", "40")
    assert proc.returncode == 0 and proc.stdout.split() == ["served"], proc.stderr


@needs_native
def test_more_live_than_the_capacity_is_not_called_fragmentation(tmp_path):
    message = the_error(defrag_run(tmp_path, "64MiB", "full", "50", "26"))
    assert "Live + request = 76.00 MiB is more than the capacity (64.00 MiB)" in message
    assert "needs more memory than the pool has, not a better layout" in message
    assert "fragmentation" not in message and "defrag.Pool" not in message  # a layout would not help
    proc = defrag_run(tmp_path, suggested_capacity(message), "full", "50", "26")
    assert proc.returncode == 0 and proc.stdout.split() == ["served"], proc.stderr


@needs_native
def test_a_request_larger_than_the_capacity_names_the_option(tmp_path):
    message = the_error(defrag_run(tmp_path, "64MiB", "frag", "100"))
    assert "the request alone is larger than the pool's capacity (64.00 MiB)" in message
    assert suggested_capacity(message) == "164MiB"  # the 32 pages in use + 50 for the request
    proc = defrag_run(tmp_path, suggested_capacity(message), "frag", "100")
    assert proc.returncode == 0 and proc.stdout.split() == ["served"], proc.stderr


# ---------------------------------------------------------------- the same wording, in-process
@pytest.fixture
def pinned_fragments(make_pool):
    """A 64 MiB pool (2 MiB pages) whose live tensors are pinned the way PyTorch's blocks are under
    `defrag.install`: 16 MiB live, two blocks in each of its 32 pages, 48 MiB stranded."""
    def make(**kwargs):
        pool = make_pool(kwargs.pop("capacity", "64MiB"), granularity=2 * MiB, **kwargs)
        ts = [pool.empty(256 * KiB, dtype=torch.uint8) for _ in range(256)]
        ts.sort(key=lambda t: t.data_ptr())
        keep = ts[::4]
        del ts
        for t in keep:
            pool.pin(t)
        return pool, keep
    return make


def refusal(pool, nbytes: int, option: str | None = "--capacity", fits: tuple = ()) -> str:
    with pytest.raises(defrag.OutOfMemoryError) as err:
        pool.empty(nbytes, dtype=torch.uint8)
    oom.set_capacity_option(option)
    try:
        message = oom.refused_inside_allocator(err.value)
    finally:
        oom.set_capacity_option(None)
    if option:
        for phrase in WRONG_HERE:
            assert phrase in fits or phrase not in message, message
    return message


def test_in_the_program_itself_the_installed_pools_capacity_is_named(pinned_fragments):
    """`defrag.install(pool)` called by the program (no `defrag run`): the pool's own capacity argument."""
    pool, keep = pinned_fragments()
    message = refusal(pool, 40 * MiB, option=None)
    assert "under defrag.install the pool is PyTorch's allocator" in message
    assert "defrag.Pool(capacity='104MiB') or more" in message and "--capacity" not in message


def test_a_request_larger_than_the_whole_device_says_split_it(pinned_fragments):
    pool, keep = pinned_fragments(capacity="64MiB", device_capacity=96 * MiB)
    message = refusal(pool, 128 * MiB)
    assert "the request alone is larger than the whole device (96.00 MiB)" in message
    assert "split the tensor" in message and "--capacity" not in message


def test_a_request_that_would_need_more_than_the_device_names_no_capacity(pinned_fragments):
    pool, keep = pinned_fragments(capacity="64MiB", device_capacity=64 * MiB)
    message = refusal(pool, 40 * MiB)
    assert "(fragmentation)" in message
    assert "no capacity: this request would need 104.00 MiB, more than the device's 64.00 MiB" in message
    assert "--capacity" not in message and "in a defrag.Pool" in message


def test_a_device_that_gave_no_more_pages_is_the_limit(make_pool):
    pool = make_pool("1GiB", granularity=2 * MiB, device_capacity=16 * MiB)
    keep = [pool.empty(1 * MiB, dtype=torch.uint8) for _ in range(8)]
    for t in keep:
        pool.pin(t)
    message = refusal(pool, 12 * MiB)
    assert "the device gave no more pages (it has 16.00 MiB in all" in message
    assert "a larger capacity would not help either" in message and "--capacity" not in message


def test_tensors_the_pool_can_move_are_named_with_compaction_between_steps(pinned_fragments):
    """A program that also made pool tensors (movable) hears about compacting them, outside the allocator."""
    pool, keep = pinned_fragments()
    pool.unpin(keep[0])
    message = refusal(pool, 40 * MiB, fits=("retry_on_oom",))
    assert "compact this pool's own 256.00 KiB of movable tensors between steps (pool.compact()" in message
    assert "nothing moves there (15.75 MiB of PyTorch's blocks live)" in message
