"""The allocation fast path (defrag.fastpath): same blocks, bytes, counters and errors as the Python path."""

from __future__ import annotations

import ctypes
import gc
import os
import random
import subprocess
import sys
import threading

import pytest
import torch

import defrag
from defrag import fastpath
from defrag.driver import Driver

from ..forked import run_python
from .conftest import KiB, MiB, check_pattern, fill_pattern

needs_fast_path = pytest.mark.skipif(fastpath.module is None, reason=f"fast path unavailable: {fastpath.status()}")


def test_the_fast_path_builds_wherever_a_compiler_is():
    from defrag.extensions import missing_tools

    if missing_tools() is not None:
        pytest.skip(f"this machine cannot build extensions: {missing_tools()}")
    assert fastpath.status() == "ready"


@needs_fast_path
def test_a_freed_size_is_served_again_without_the_python_allocator(make_pool):
    pool = make_pool("2MiB")
    fast = pool.core.fast
    assert fast is not None and fast.enabled
    t = pool.empty(1000, dtype=torch.uint8)
    address = t.data_ptr()
    del t
    hits, misses = fast.hits, fast.misses
    for _ in range(100):
        t = pool.empty(1000, dtype=torch.uint8)
        assert t.data_ptr() == address and t.device == pool.device and t.shape == (1000,)
        del t
    assert (fast.hits - hits, fast.misses - misses) == (100, 0)
    pool.check_invariants()


def _script(pool, seed: int) -> list:
    """A seeded sequence of allocations, frees, views and reads of pool state; what each step saw."""
    rng = random.Random(seed)
    live, seen = [], []
    shapes = [(100,), (3, 7), (512,), (4096,), (64, 64), (20_000,)]
    for step in range(300):
        op = rng.random()
        if op < 0.5 or not live:
            shape = rng.choice(shapes)
            dtype = rng.choice([torch.float32, torch.uint8, torch.float16, None])
            grad = rng.random() < 0.1 and dtype != torch.uint8  # the Python path, released in the same order
            t = pool.empty(*shape, dtype=dtype, requires_grad=grad) if rng.random() < 0.5 else \
                pool.empty(shape, dtype=dtype, requires_grad=grad)
            t = t.detach()
            fill_pattern(t, step)
            live.append((t, step))
            seen.append(("alloc", t.data_ptr(), tuple(t.shape), t.dtype))
        elif op < 0.85:
            t, _ = live.pop(rng.randrange(len(live)))
            del t
        elif op < 0.87:
            report = pool.compact()
            seen.append(("compact", report.moved_tensors, report.moved_bytes))
        elif op < 0.95:
            st = pool.stats()
            seen.append(("stats", {k: st[k] for k in ("allocated_bytes.all.current", "allocated_bytes.all.peak",
                                                      "active_bytes.all.peak", "num_allocs", "num_frees",
                                                      "reserved_bytes.all.current", "live_blocks")}))
        else:
            pool.check_invariants()
    assert all(check_pattern(t, seed) for t, seed in live)
    st = pool.stats()
    seen.append(("end", st["allocated_bytes.all.current"], st["allocated_bytes.all.peak"], st["num_allocs"],
                 st["num_frees"], st["live_blocks"]))
    return seen


@needs_fast_path
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_fast_path_places_and_counts_exactly_as_the_python_path(make_pool, monkeypatch, seed):
    fast_pool = make_pool("4MiB", auto_compact=False)
    monkeypatch.setenv("DEFRAG_FASTPATH", "0")
    slow_pool = make_pool("4MiB", auto_compact=False)
    monkeypatch.undo()
    assert fast_pool.core.fast is not None and slow_pool.core.fast is None
    base_fast, base_slow = fast_pool.core.regions[0].base, slow_pool.core.regions[0].base

    def relative(seen, base):
        return [(e[0], e[1] - base, *e[2:]) if e[0] == "alloc" else e for e in seen]

    fast_seen = relative(_script(fast_pool, seed), base_fast)
    slow_seen = relative(_script(slow_pool, seed), base_slow)
    assert fast_pool.core.fast.hits > 50  # the comparison is worth something only if the fast path served
    assert fast_seen == slow_seen


@needs_fast_path
def test_compaction_moves_fast_tensors_and_their_views(make_pool):
    pool = make_pool("2MiB", auto_compact=False)
    ts = [pool.empty(8 * KiB, dtype=torch.uint8) for _ in range(64)]
    for t in ts[::2]:
        t.fill_(0)
    del ts[::2]
    ts = [pool.empty(8 * KiB, dtype=torch.uint8) for _ in range(32)] + ts  # half of them fast-path blocks
    del ts[:32:2]
    assert pool.core.fast.hits >= 32
    for i, t in enumerate(ts):
        fill_pattern(t, i)
    views = [t[100:] for t in ts]
    before = [t.data_ptr() for t in ts]
    report = pool.compact()
    assert report.moved_tensors > 0
    assert sum(t.data_ptr() != p for t, p in zip(ts, before)) == report.moved_tensors
    for i, (t, v) in enumerate(zip(ts, views)):
        assert check_pattern(t, i) and v.data_ptr() == t.data_ptr() + 100
    pool.check_invariants()


@needs_fast_path
def test_peaks_count_fast_blocks_freed_between_two_reads(make_pool):
    pool = make_pool("2MiB")
    warm = [pool.empty(10 * KiB, dtype=torch.uint8) for _ in range(3)]
    del warm
    pool.reset_peak_stats()
    pool.stats()
    hits = pool.core.fast.hits
    ts = [pool.empty(10 * KiB, dtype=torch.uint8) for _ in range(3)]
    del ts
    assert pool.core.fast.hits == hits + 3
    st = pool.stats()
    assert st["allocated_bytes.all.current"] == 0 and st["allocated_bytes.all.peak"] == 3 * 10 * KiB
    assert st["live_blocks"] == 0


@needs_fast_path
def test_a_view_keeps_a_fast_block_alive(make_pool):
    pool = make_pool("2MiB")
    pool.empty(300)  # dropped at once: its size is kept
    t = pool.empty(300)
    assert pool.core.fast.hits >= 1
    v = t[10:20]
    v.fill_(3.0)
    del t
    assert pool.stats()["live_blocks"] == 1
    assert bool((v == 3.0).all())
    del v
    assert pool.stats()["live_blocks"] == 0


NOTHING_HELD = {"handles": 0, "mappings": 0, "reservations": 0, "used_bytes": 0}


def _pool_with_a_fast_tensor(value: float):
    """A pool on its own device, and a tensor of it that the fast path made, filled with `value`."""
    drv = Driver.emulated(capacity=8 * MiB, granularity=64 * KiB)
    pool = defrag.Pool(device=drv, capacity="2MiB")
    pool.empty(5000)
    t = pool.empty(5000)
    assert pool.core.fast.hits >= 1
    t.fill_(value)
    return drv, pool, t


@needs_fast_path
def test_close_with_live_fast_tensors_gives_everything_back_when_the_last_dies():
    drv, pool, t = _pool_with_a_fast_tensor(2.0)
    pool.close()
    assert bool((t == 2.0).all())  # still mapped
    assert drv.api.state()["mappings"] > 0
    del t  # the deleter calls the pool back, with the GIL, after close
    assert drv.api.state() == NOTHING_HELD


@needs_fast_path
def test_a_fast_tensor_keeps_its_pool_alive():
    drv, pool, t = _pool_with_a_fast_tensor(4.0)
    del pool
    gc.collect()
    assert bool((t == 4.0).all()) and drv.api.state()["mappings"] > 0
    del t
    gc.collect()
    assert drv.api.state() == NOTHING_HELD


@needs_fast_path
def test_the_fast_path_declines_while_any_thread_is_at_the_gate(make_pool):
    pool = make_pool("2MiB")
    pool.empty(100)
    with pool.core.gate:
        assert pool.core.fast.empty((100,), None) is None
    t = pool.core.fast.empty((100,), None)
    assert t is not None and t.shape == (100,) and t.dtype == torch.get_default_dtype()


@needs_fast_path
def test_a_stale_access_is_reported_even_for_a_kept_size(make_pool):
    pool = make_pool("2MiB", auto_compact=False)
    small = pool.empty(2000, dtype=torch.uint8)  # on the first page
    big = pool.empty(64 * KiB, dtype=torch.uint8)  # the second page
    address = big.data_ptr()
    del small, big
    pool.trim()  # unmaps both
    pool.empty(2000, dtype=torch.uint8)  # maps the first page again; now size 2000 is kept
    assert pool.core.books.kept_count() == 1
    ctypes.memset(address, 1, 16)  # a stale write into the unmapped second page
    with pytest.raises(defrag.StaleAccessError):
        pool.empty(2000, dtype=torch.uint8)
    pool.empty(2000, dtype=torch.uint8)  # reported once; the pool goes on
    pool.check_invariants()


@needs_fast_path
def test_recording_history_and_sleeping_turn_it_off(make_pool):
    pool = make_pool("2MiB")
    pool.empty(100)
    pool.record_history(True, stacks=False)
    assert not pool.core.fast.enabled
    t = pool.empty(100)
    assert any(e["action"] == "alloc" for e in pool.snapshot()["device_traces"][0])
    pool.record_history(False)
    assert pool.core.fast.enabled
    del t
    pool.sleep()
    assert not pool.core.fast.enabled
    with pytest.raises(defrag.PoolAsleepError):
        pool.empty(100)
    pool.wake()
    assert pool.core.fast.enabled


@needs_fast_path
def test_unusual_requests_take_the_python_path_with_its_errors(make_pool):
    pool = make_pool("2MiB")
    for shape in [(100,), (2, 50)]:
        pool.empty(*shape)
    t = pool.empty(torch.Size([2, 50]))
    assert t.shape == (2, 50)
    assert pool.empty(0).numel() == 0
    g = pool.empty(100, requires_grad=True)
    assert g.requires_grad
    with pytest.raises(ValueError, match="negative dimension"):
        pool.empty(-1)
    with pytest.raises(ValueError, match="sequence of ints"):
        pool.empty(2.5)
    with pytest.raises(TypeError, match="must be a torch.dtype"):
        pool.empty(100, dtype="float32")
    with pytest.raises(TypeError, match="not supported"):
        pool.empty(100, dtype=torch.qint8)
    with pytest.raises(defrag.OutOfMemoryError):
        pool.empty(1 << 30)
    pool.check_invariants()


@needs_fast_path
def test_another_threads_fast_tensor_is_not_moved_while_it_runs(make_pool):
    pool = make_pool("2MiB", auto_compact=False)
    for _ in range(8):
        pool.empty(16 * KiB, dtype=torch.uint8)  # its size is now kept
    made, done = threading.Event(), threading.Event()
    box = {}

    def worker():
        spacer = [pool.empty(16 * KiB, dtype=torch.uint8) for _ in range(6)]
        t = pool.empty(16 * KiB, dtype=torch.uint8)
        del spacer
        box["t"], box["ptr"] = t, t.data_ptr()
        made.set()
        done.wait(30)

    thread = threading.Thread(target=worker, name="fast-worker")
    thread.start()
    assert made.wait(30)
    pool.compact()
    live = {lt.address: lt for lt in pool.live_tensors()}
    assert box["t"].data_ptr() == box["ptr"]
    assert not live[box["ptr"]].movable and "fast-worker" in live[box["ptr"]].owner
    done.set()
    thread.join()
    del box


def _run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


PLAIN = r"""
import torch, defrag
from defrag import fastpath
pool = defrag.Pool("emulated", capacity="8MiB")
fastpath.wait()
for _ in range(3):
    t = pool.empty(100); t.fill_(1.0); del t
print(fastpath.status(), pool.core.fast is not None)
"""


def test_off_means_the_python_path_and_no_compiler_a_clear_error(tmp_path):
    off = _run(PLAIN, DEFRAG_FASTPATH="0")
    assert off.returncode == 0 and off.stdout.split() == ["off", "False"], off.stderr[-2000:]
    # A fresh machine without a compiler: no pool can be made, and the error says what to install.
    broken = _run(PLAIN, CXX="/nonexistent/c++", DEFRAG_EXT_DIR=str(tmp_path))
    assert broken.returncode == 1 and not broken.stdout
    last = broken.stderr.strip().splitlines()[-1]
    assert last.startswith("defrag.errors.NativeBuildError: defrag needs its native module"), broken.stderr[-2000:]
    assert "no C++ compiler" in last and "apt install g++" in last and "pip install ninja" in last
    assert "building" not in broken.stderr  # nothing was started


STRESS = r"""
import threading, torch, defrag
from defrag import fastpath
fastpath.wait()
pool = defrag.Pool("emulated", capacity="16MiB")
errors = []
def work(seed):
    rng = torch.Generator().manual_seed(seed)
    for i in range(3000):
        n = int(torch.randint(1, 4, (1,), generator=rng)) * 1000
        t = pool.empty(n, dtype=torch.int32)
        t.fill_(seed * 10_000 + i)
        if i % 97 == 0:
            pool.compact()
        if not bool((t == seed * 10_000 + i).all()):
            errors.append((seed, i))
ths = [threading.Thread(target=work, args=(s,)) for s in range(4)]
for t in ths: t.start()
for t in ths: t.join()
pool.check_invariants()
print("hits", pool.core.fast.hits, "errors", len(errors))
"""


@needs_fast_path
def test_threads_allocating_and_compacting_through_the_fast_path_in_a_subprocess():
    # Forked from the test zygote; faulthandler as PYTHONFAULTHANDLER=1 would set it: a crash prints every stack.
    proc = run_python("import faulthandler\nfaulthandler.enable()\n" + STRESS, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    words = proc.stdout.split()
    assert words[0] == "hits" and int(words[1]) > 1000 and words[-1] == "0", proc.stdout


def test_each_source_builds_in_its_own_folder(monkeypatch, tmp_path):
    """Two versions of a native source never share a build folder (neither rebuilds nor half-imports the
    other's library); the same source always finds its own again."""
    from defrag.extensions import CppExtension

    monkeypatch.setenv("DEFRAG_EXT_DIR", str(tmp_path))
    one = CppExtension("x", "native", "int a;", "x", "now").build_directory()
    again = CppExtension("x", "native", "int a;", "x", "now").build_directory()
    other = CppExtension("x", "native", "int b;", "x", "now").build_directory()
    assert one == again != other and one.startswith(str(tmp_path))
