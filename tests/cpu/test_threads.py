"""The thread contract: a compaction never moves a block another thread may be using.

The stress test runs the pool in a subprocess, so that a crash (the old failure:
a segfault when a compaction unmapped a page under another thread's write)
fails the test instead of killing pytest.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

import defrag
from defrag import threads as th

from ..forked import run_python

KiB = 1 << 10


def _in_thread(fn):
    """Run `fn` in a new thread and return (result, thread) once it finished."""
    out = {}

    def run():
        out["value"] = fn()

    t = threading.Thread(target=run, name="helper")
    t.start()
    t.join()
    return out.get("value"), t


def _fragmented(pool, n=8):
    """n quarter-page tensors on the calling thread; every other one freed: half-used pages."""
    q = pool.page_size // 4
    ts = [pool.full((q // 4,), float(i)) for i in range(n)]
    for i in range(0, n, 2):
        ts[i] = None
    return [(i, t) for i, t in enumerate(ts) if t is not None]


def _check(kept):
    for i, t in kept:
        assert bool((t == float(i)).all())


class _Runner:
    """A thread that fragments the pool, then runs (not inside any pool call) until released."""

    def __init__(self, pool, make=_fragmented):
        self.pool, self.make, self.ready, self.release = pool, make, threading.Event(), threading.Event()
        self.kept = None
        self.thread = threading.Thread(target=self._run, name="runner")

    def _run(self):
        self.kept = self.make(self.pool)
        self.ready.set()
        self.release.wait(30)

    def __enter__(self):
        self.thread.start()
        assert self.ready.wait(30)
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.thread.join()


def test_running_threads_blocks_never_move(make_pool):
    pool = make_pool("2MiB", granularity=64 * KiB)
    with _Runner(pool) as other:
        before = [t.data_ptr() for _, t in other.kept]
        mine = _fragmented(pool)
        report = pool.compact()
        assert [t.data_ptr() for _, t in other.kept] == before
        assert report.moved_tensors > 0  # the caller's own tensors did move
        _check(other.kept), _check(mine)
        reasons = {lt.reason for lt in pool.live_tensors() if not lt.movable}
        assert any("owned by thread 'runner'" in r and "running" in r for r in reasons), reasons
        owners = {lt.owner for lt in pool.live_tensors()}
        assert "thread 'runner'" in owners and "thread 'MainThread'" in owners
    pool.check_invariants()


def test_ended_threads_blocks_move_once_no_other_thread_runs(make_pool):
    pool = make_pool("2MiB", granularity=64 * KiB)
    kept, t = _in_thread(lambda: _fragmented(pool))
    assert not t.is_alive()
    before = [x.data_ptr() for _, x in kept]
    report = pool.compact()
    assert report.moved_tensors > 0 and [x.data_ptr() for _, x in kept] != before
    _check(kept)


def test_threads_all_refused_while_another_thread_runs_and_changes_nothing(make_pool):
    pool = make_pool("2MiB", granularity=64 * KiB)
    mine = _fragmented(pool)
    with _Runner(pool):
        layout = pool.layout()
        with pytest.raises(defrag.ConcurrencyError, match="runner"):
            pool.compact(threads="all")
        assert pool.layout() == layout
    assert pool.compact(threads="all").moved_tensors > 0  # the runner has ended now
    _check(mine)


def test_threads_argument_is_checked(make_pool):
    pool = make_pool("2MiB", granularity=64 * KiB)
    with pytest.raises(ValueError, match="threads must be"):
        pool.compact(threads="mine")
    with pytest.raises(ValueError, match="threads must be"):
        defrag.compact(threads=1)


def test_own_moves_only_the_callers_blocks(make_pool):
    pool = make_pool("2MiB", granularity=64 * KiB)
    orphans, _ = _in_thread(lambda: _fragmented(pool))
    before = [t.data_ptr() for _, t in orphans]
    pool.compact(threads="own")
    assert [t.data_ptr() for _, t in orphans] == before


def test_a_thread_waiting_at_the_gate_has_its_blocks_moved(make_pool):
    pool = make_pool("2MiB", granularity=64 * KiB)
    made, go, done = threading.Event(), threading.Event(), threading.Event()
    box = {}

    def worker():
        box["kept"] = _fragmented(pool)
        box["ref"] = th.owner_ref()
        made.set()
        go.wait(30)
        pool.stats()  # waits at the gate while the main thread compacts
        done.set()
        go.wait(30)

    t = threading.Thread(target=worker, name="waiter")
    t.start()
    assert made.wait(30)
    before = [x.data_ptr() for _, x in box["kept"]]
    with pool.core.gate:
        go.set()
        ref = box["ref"]
        deadline = time.monotonic() + 30
        while not pool.core.gate.parked(ref):
            assert time.monotonic() < deadline
            time.sleep(0.001)
        report = pool.compact()
    assert done.wait(30)
    t.join()
    assert report.moved_tensors > 0
    assert [x.data_ptr() for _, x in box["kept"]] != before
    _check(box["kept"])


def test_share_and_claim(make_pool):
    pool = make_pool("2MiB", granularity=64 * KiB)
    mine = _fragmented(pool)
    for _, t in mine:
        pool.share(t)
    # The other thread's one tensor fills a page of its own, away from the caller's holes.
    with _Runner(pool, lambda p: [(0, p.full((p.page_size // 4,), 0.0))]):
        before = [t.data_ptr() for _, t in mine]
        pool.compact()
        assert [t.data_ptr() for _, t in mine] == before  # shared: another thread may use them
        assert all("shared" in lt.reason for lt in pool.live_tensors() if lt.owner == "shared")
        for _, t in mine:
            pool.claim(t)
        assert pool.compact().moved_tensors > 0  # claimed back: the caller's own again
    _check(mine)
    with pytest.raises(ValueError, match="not in pool"):
        pool.share(torch.zeros(3))


def test_full_and_zeros_are_initialised_before_anyone_can_move_them(make_pool):
    """`full` fills outside the lock; the block is its thread's, so no other compaction moves it meanwhile."""
    pool = make_pool("4MiB", granularity=64 * KiB)
    stop = threading.Event()
    errors = []
    compactions = []

    def compactor():
        while not stop.is_set():
            compactions.append(pool.compact())
            # Yield the GIL: without it this loop retakes the pool's lock before the main thread wakes
            # to take it, and the test's run time depends on that race (20 s to 6 min seen).
            time.sleep(0)

    c = threading.Thread(target=compactor)
    c.start()
    try:
        for i in range(200):
            t = pool.full((5000 + i,), float(i))
            z = pool.zeros((3000 + i,), dtype=torch.int32)
            if not (bool((t == float(i)).all()) and not bool(z.any())):
                errors.append(i)
    finally:
        stop.set()
        c.join()
    assert not errors
    assert len(compactions) > 10, f"the compactions must really run beside the allocations ({len(compactions)})"


@pytest.mark.parametrize("seed", [0, 1])
def test_thread_stress_in_a_subprocess(seed):
    """Workers allocate (empty, full, zeros), write and re-check every element while automatic
    and explicit compactions run; the subprocess must exit 0 with no byte error."""
    # python -m defrag.benchmarks.bench_threads, forked from the test zygote; faulthandler enabled as
    # PYTHONFAULTHANDLER=1 would (a crash prints every thread's stack).
    code = ("import faulthandler, runpy\nfaulthandler.enable()\n"
            "runpy.run_module('defrag.benchmarks.bench_threads', run_name='__main__', alter_sys=True)\n")
    proc = run_python(code, "--seconds", "2.5", "--seed", str(seed), timeout=120)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["errors"] == []
    assert result["automatic_compactions"] > 0 and result["explicit_compactions"] > 0
    assert result["moved_tensors"] > 0 and result["checks"] > 0


STALE_SCRIPT = r"""
import ctypes, torch, defrag
from defrag.driver import Driver
pool = defrag.Pool(Driver.emulated(capacity=8 << 20, granularity=64 << 10), capacity="2MiB")
ts = [pool.full((4096,), float(i)) for i in range(8)]   # 16 KiB each, 4 per 64 KiB page
del ts[::2]
old = [t.data_ptr() for t in ts]
report = pool.compact(release=True)                      # moves, then unmaps the emptied pages
assert report.moved_tensors and report.unmapped_pages, report
stale = next(p for p, t in zip(old, ts) if t.data_ptr() != p)
ctypes.memset(stale, 0x7F, 4096)                         # a stale write: a segfault before the tombstones
seen = ctypes.c_uint8.from_address(stale + 8192).value   # a stale read
try:
    pool.empty(10)
except defrag.StaleAccessError as exc:
    print("raised:", exc)
else:
    raise SystemExit("no StaleAccessError")
assert all(bool((t == float(2 * i + 1)).all()) for i, t in enumerate(ts)), "pool tensors changed"
pool.empty(10)                                           # reported once: the pool goes on
pool.check_invariants()
print("ok", seen)
"""


def test_stale_access_to_an_unmapped_page_is_an_error_not_a_segfault():
    proc = run_python(STALE_SCRIPT, timeout=120)  # a process of its own, forked (tests/forked.py)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    assert "raised:" in proc.stdout and "pool.claim(t)" in proc.stdout
    assert proc.stdout.strip().endswith("ok 0")  # the stale read saw zeros
