"""`defrag.TorchAllocator`: PyTorch's pluggable-allocator entry points over a pool, called as PyTorch calls them.

No GPU here: the C entry points are called through their function pointers
with ctypes (exactly the calls PyTorch's `CUDAPluggableAllocator` makes) over
the emulated device, and the segments they return are written and read
through ctypes. `pool.capture()` / `defrag.install()` themselves need CUDA
(tests/gpu/test_capture_gpu.py); here they must refuse clearly.
"""

from __future__ import annotations

import ctypes
import gc
import json
import logging
import sys
import textwrap
import threading
import weakref

import pytest
import torch

import defrag
from defrag import allocator_install, capture as cap
from defrag.driver import Driver

from ..forked import run_python
from .conftest import KiB, MiB, check_pattern, fill_pattern

PAGE = 64 * KiB  # the cpu fixture's granularity


def entry_points(allocator):
    """The two C functions PyTorch would call, rebuilt from the raw addresses PyTorch is given."""
    alloc = cap.ALLOC_FN(allocator.alloc_ptr)
    free = cap.FREE_FN(allocator.free_ptr)
    return alloc, free


def write(ptr: int, data: bytes) -> None:
    ctypes.memmove(ptr, data, len(data))


def read(ptr: int, n: int) -> bytes:
    return ctypes.string_at(ptr, n)


def pattern(n: int, seed: int) -> bytes:
    return bytes((i * 131 + seed * 7919) % 251 for i in range(n))


def fragment(pool, n=64, keep_every=4, nbytes=PAGE // 4):
    """Quarter-page pool tensors filling n/4 pages; 3 of every 4 freed by address: every page keeps one."""
    ts = sorted((pool.empty(nbytes, dtype=torch.uint8) for _ in range(n)), key=lambda t: t.data_ptr())
    for i, t in enumerate(ts):
        fill_pattern(t, i + 1)
    survivors = {i + 1: t for i, t in enumerate(ts) if i % keep_every == 0}
    del ts, t
    return survivors


def intact(survivors) -> bool:
    return all(check_pattern(t, seed) for seed, t in survivors.items())


@pytest.fixture
def unraisable(monkeypatch):
    """Exceptions that escaped a ctypes callback (Python reports them through sys.unraisablehook)."""
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda info: seen.append(repr(info.exc_value)))
    return seen


# ---------------------------------------------------------------- the C face

def test_entry_points_are_stable_c_addresses(make_pool):
    pool = make_pool()
    allocator = defrag.TorchAllocator(pool)
    assert isinstance(allocator.alloc_ptr, int) and isinstance(allocator.free_ptr, int)
    assert allocator.alloc_ptr and allocator.free_ptr and allocator.alloc_ptr != allocator.free_ptr
    assert allocator.alloc_ptr == allocator.alloc_ptr  # the same trampoline every time
    assert allocator.pool is pool
    assert defrag.TorchAllocator.for_pool(pool) is defrag.TorchAllocator.for_pool(pool)
    assert defrag.TorchAllocator.for_pool(pool) is not allocator
    with pytest.raises(TypeError, match="needs a defrag.Pool"):
        defrag.TorchAllocator(object())
    assert "allocs=0" in repr(allocator)


def test_segments_are_written_read_and_freed_through_the_pointers(make_pool, unraisable):
    pool = make_pool("2MiB")
    allocator = defrag.TorchAllocator(pool)
    alloc, free = entry_points(allocator)
    sizes = [1, 512, 3000, PAGE, 3 * PAGE + 1]
    ptrs = []
    for seed, n in enumerate(sizes, start=1):
        ptr = alloc(n, 0, None)
        assert ptr, f"a {n}-byte segment should fit"
        write(ptr, pattern(n, seed))
        ptrs.append(ptr)
    assert sorted(ptrs) == [a for a, _ in pool.segments()]
    assert dict(pool.segments()) == dict(zip(ptrs, sizes))
    st = pool.stats()
    assert st["segments"] == len(sizes) and st["segment_bytes"] >= sum(sizes)
    assert st["allocated_bytes.all.current"] >= sum(sizes)
    # Every segment kept its own bytes (none overlaps another).
    for seed, (ptr, n) in enumerate(zip(ptrs, sizes), start=1):
        assert read(ptr, n) == pattern(n, seed)
    pool.check_invariants()
    # Segments are the pool's own blocks of kind "segment" and never move.
    kinds = {b["address"]: b.get("kind") for b in pool.layout()["blocks"]}
    assert all(kinds[p] == "segment" for p in ptrs)
    live = {t.address: t for t in pool.live_tensors()}
    assert all(not live[p].movable and "segment" in live[p].reason for p in ptrs)
    for ptr, n in zip(ptrs, sizes):
        free(ptr, n, 0, None)
    assert pool.segments() == [] and pool.stats()["segments"] == 0
    assert pool.stats()["allocated_bytes.all.current"] == 0
    c = allocator.counters()
    assert (c["allocs"], c["frees"], c["failures"], c["errors"], c["foreign_frees"]) == (5, 5, 0, 0, 0)
    pool.check_invariants()
    assert unraisable == []


def test_zero_bytes_is_null_and_not_a_failure(make_pool):
    pool = make_pool()
    allocator = defrag.TorchAllocator(pool)
    alloc, free = entry_points(allocator)
    assert alloc(0, 0, None) is None
    free(None, 0, 0, None)  # PyTorch frees the NULL of an empty tensor too
    assert allocator.counters()["failures"] == 0 and allocator.counters()["foreign_frees"] == 0
    assert pool.segments() == []


def test_segments_and_tensors_draw_on_one_budget(make_pool):
    pool = make_pool("1MiB", auto_compact=False)  # 16 pages
    allocator = defrag.TorchAllocator(pool)
    alloc, free = entry_points(allocator)
    seg = alloc(12 * PAGE, 0, None)
    assert seg
    with pytest.raises(defrag.OutOfMemoryError):
        pool.empty(5 * PAGE, dtype=torch.uint8)  # 12 + 5 pages > 16
    t = pool.empty(4 * PAGE, dtype=torch.uint8)  # 12 + 4 fit exactly
    assert alloc(PAGE, 0, None) is None  # and now nothing is left for a segment
    del t
    assert alloc(PAGE, 0, None)  # the tensor's pages serve a segment once it dies
    for addr, n in pool.segments():
        free(addr, n, 0, None)
    pool.check_invariants()


def test_a_segment_that_fits_only_after_compaction(make_pool, unraisable):
    pool = make_pool("1MiB")  # 16 pages, automatic compaction on
    survivors = fragment(pool)  # 16 pages, each with one quarter-page survivor: no page free
    before = {s: t.data_ptr() for s, t in survivors.items()}
    ids = {s: id(t) for s, t in survivors.items()}
    views = {s: t[10:20] for s, t in survivors.items()}
    n = pool.capacity // 2
    # By default the callback does not compact (an op may hold its inputs' addresses): NULL, nothing moved.
    cautious = defrag.TorchAllocator(pool)
    assert entry_points(cautious)[0](n, 0, None) is None
    assert {s: t.data_ptr() for s, t in survivors.items()} == before and intact(survivors)
    allocator = defrag.TorchAllocator(pool, compact_in_callback=True)
    alloc, free = entry_points(allocator)
    ptr = alloc(n, 0, None)
    assert ptr, allocator.last_error
    assert pool.stats()["num_alloc_retries"] >= 1
    assert any(t.data_ptr() != before[s] for s, t in survivors.items()), "nothing moved: no compaction ran"
    write(ptr, pattern(n, 77))
    assert intact(survivors) and read(ptr, n) == pattern(n, 77)
    for s, t in survivors.items():
        assert id(t) == ids[s] and torch.equal(views[s], t[10:20])
        assert not (ptr <= t.data_ptr() < ptr + n), "a survivor lies inside the segment"
    pool.check_invariants()
    free(ptr, n, 0, None)
    assert pool.segments() == [] and intact(survivors)
    assert allocator.counters()["allocs"] == 1 and allocator.counters()["failures"] == 0
    assert unraisable == []


def test_an_impossible_request_is_null_counted_logged_and_changes_nothing(make_pool, caplog, unraisable):
    pool = make_pool("1MiB")
    survivors = fragment(pool)
    allocator = defrag.TorchAllocator(pool)
    alloc, _ = entry_points(allocator)
    layout, segments = pool.layout(), pool.segments()
    stats = {k: v for k, v in pool.stats().items() if not k.startswith("num_")}
    with caplog.at_level(logging.WARNING, logger="defrag"):
        assert alloc(2 * pool.capacity, 0, None) is None
    c = allocator.counters()
    assert (c["allocs"], c["failures"], c["errors"]) == (0, 1, 0)
    assert "does not fit; returned NULL" in c["last_error"] and "cannot allocate" in c["last_error"]
    assert any("returned NULL" in r.getMessage() for r in caplog.records)
    assert pool.layout() == layout and pool.segments() == segments
    assert {k: v for k, v in pool.stats().items() if not k.startswith("num_")} == stats
    assert intact(survivors)
    pool.check_invariants()
    # A negative size (a size_t past 2**63) and another device are refused the same way.
    assert alloc(-5, 0, None) is None and alloc(PAGE, 3, None) is None
    assert allocator.counters()["failures"] == 3 and "device 3" in allocator.counters()["last_error"]
    assert unraisable == []


def test_a_foreign_pointer_is_logged_and_ignored(make_pool, caplog):
    pool = make_pool()
    allocator = defrag.TorchAllocator(pool)
    alloc, free = entry_points(allocator)
    ptr = alloc(1000, 0, None)
    t = pool.empty(1000, dtype=torch.uint8)
    with caplog.at_level(logging.WARNING, logger="defrag"):
        free(0xDEAD0000, 64, 0, None)  # not pool memory at all
        free(t.data_ptr(), 1000, 0, None)  # a pool tensor, not a segment: never freed through here
        free(ptr + 512, 100, 0, None)  # inside a segment, not its start
    assert allocator.counters()["foreign_frees"] == 3 and allocator.counters()["frees"] == 0
    assert sum("not a segment of pool" in r.getMessage() for r in caplog.records) == 3
    assert pool.segments() == [(ptr, 1000)] and pool.owns(t)
    free(ptr, 1000, 0, None)
    assert pool.segments() == []
    pool.check_invariants()


def test_no_exception_crosses_the_c_boundary(make_pool, monkeypatch, caplog, unraisable):
    pool = make_pool()
    allocator = defrag.TorchAllocator(pool)
    alloc, free = entry_points(allocator)
    ptr = alloc(4096, 0, None)

    def boom(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(pool, "alloc_segment", boom)
    monkeypatch.setattr(pool, "free_segment", boom)
    with caplog.at_level(logging.ERROR, logger="defrag"):
        assert alloc(4096, 0, None) is None
        free(ptr, 4096, 0, None)
    c = allocator.counters()
    assert c["errors"] == 2 and c["failures"] == 1
    assert "RuntimeError: boom" in c["last_error"]
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert text.count("Traceback (most recent call last)") == 2 and "RuntimeError: boom" in text
    assert all(r.exc_info is None for r in caplog.records)  # the text only: no exception object kept
    assert unraisable == []
    monkeypatch.undo()
    free(ptr, 4096, 0, None)
    assert pool.segments() == []


def test_a_closed_pool_refuses_segments_but_takes_them_back(make_pool):
    pool = make_pool()
    allocator = defrag.TorchAllocator(pool)
    alloc, free = entry_points(allocator)
    ptr = alloc(PAGE, 0, None)
    write(ptr, pattern(PAGE, 3))
    pool.close()
    assert read(ptr, PAGE) == pattern(PAGE, 3)  # a live segment keeps its pages after close
    assert alloc(PAGE, 0, None) is None and "closed" in allocator.counters()["last_error"]
    free(ptr, PAGE, 0, None)  # PyTorch frees late: the pool then releases everything (the fixture checks)
    assert allocator.counters()["frees"] == 1 and pool.segments() == []


def test_callbacks_pause_the_garbage_collector_and_say_so(make_pool, monkeypatch):
    pool = make_pool()
    allocator = defrag.TorchAllocator(pool)
    alloc, free = entry_points(allocator)
    seen = []
    real = pool.alloc_segment

    def spy(nbytes, stream=0, **kwargs):
        seen.append((cap.in_callback(), gc.isenabled()))
        return real(nbytes, stream, **kwargs)

    monkeypatch.setattr(pool, "alloc_segment", spy)
    assert gc.isenabled() and not cap.in_callback()
    ptr = alloc(100, 0, None)
    assert seen == [(True, False)]
    assert gc.isenabled() and not cap.in_callback()
    gc.disable()
    try:
        alloc(100, 0, None)
        assert not gc.isenabled(), "a callback must not enable a collector the program disabled"
    finally:
        gc.enable()
    for a, n in pool.segments():
        free(a, n, 0, None)
    assert ptr


def test_the_allocator_keeps_its_pool_alive():
    drv = Driver.emulated(capacity=8 * MiB, granularity=PAGE)
    pool = defrag.Pool(device=drv, capacity="1MiB")
    allocator = defrag.TorchAllocator(pool)
    alloc, free = entry_points(allocator)
    ptr = alloc(1000, 0, None)
    ref = weakref.ref(pool)
    del pool
    gc.collect()
    assert ref() is not None, "PyTorch may still call free: the pool must outlive the allocator"
    free(ptr, 1000, 0, None)
    ref().close()
    assert drv.api.state()["handles"] == 0


# ---------------------------------------------------------------- driver faults inside the callback

def _stitching(pool):
    """Page-sized pool tensors, every other one freed: empty pages scattered, nothing to compact."""
    ts = [pool.empty(PAGE, dtype=torch.uint8) for _ in range(pool.capacity_pages)]
    for i, t in enumerate(ts):
        fill_pattern(t, i + 1)
    survivors = {i + 1: t for i, t in enumerate(ts) if i % 2 == 0}
    del ts, t
    return survivors, pool.capacity // 2


def _compaction(pool):
    """16 of 32 pages mapped, each holding one survivor: the request needs a compaction and new pages."""
    return fragment(pool), 28 * PAGE


SCENARIOS = {"compaction": ("2MiB", _compaction), "stitching": ("1MiB", _stitching)}


def _driver_calls(make_pool, scenario):
    """Which driver calls the alloc callback makes in `scenario`, and how many of each."""
    capacity, setup = SCENARIOS[scenario]
    pool = make_pool(capacity)
    survivors, n = setup(pool)
    alloc, free = entry_points(defrag.TorchAllocator(pool, compact_in_callback=True))
    before = dict(pool.driver.faults.calls)
    ptr = alloc(n, 0, None)
    assert ptr and intact(survivors)
    calls = {k: v - before.get(k, 0) for k, v in pool.driver.faults.calls.items() if v != before.get(k, 0)}
    free(ptr, n, 0, None)
    return calls


def _fault_plan(make_pool):
    plan = []
    for scenario in SCENARIOS:
        for call, count in sorted(_driver_calls(make_pool, scenario).items()):
            nths = range(1, count + 1)
            plan += [(scenario, call, nth) for nth in nths if nth <= count]
    return plan


def test_faults_at_every_driver_call_inside_the_callback(make_pool, unraisable):
    plan = _fault_plan(make_pool)
    calls = {c for _, c, _ in plan}
    assert {"cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuCtxSynchronize"} <= calls, calls
    outcomes = {"null": 0, "served": 0}
    for scenario, call, nth in plan:
        capacity, setup = SCENARIOS[scenario]
        pool = make_pool(capacity)
        survivors, n = setup(pool)
        allocator = defrag.TorchAllocator(pool, compact_in_callback=True)  # fault the compaction too
        alloc, free = entry_points(allocator)
        pool.driver.faults.inject(call, nth=nth)
        ptr = alloc(n, 0, None)
        fired = pool.driver.faults.pending() == 0
        pool.driver.faults.clear()
        where = f"{scenario}: fault in {call} #{nth}"
        assert fired, where
        assert unraisable == [], where
        pool.check_invariants()
        assert intact(survivors), f"{where} corrupted a pool tensor"
        if ptr is None:
            outcomes["null"] += 1
            assert allocator.counters()["failures"] == 1, where
            assert pool.segments() == [], where
        else:
            outcomes["served"] += 1
            assert pool.segments() == [(ptr, n)], where
            write(ptr, pattern(n, 9))
            assert read(ptr, n) == pattern(n, 9) and intact(survivors), where
            free(ptr, n, 0, None)
        # The pool still serves the same request afterwards.
        ptr = alloc(n, 0, None)
        assert ptr, f"{where}: the pool no longer serves the request ({allocator.last_error})"
        free(ptr, n, 0, None)
        pool.check_invariants()
        assert intact(survivors) and pool.segments() == [], where
        pool.close()
    assert outcomes["null"] > 0
    assert len(plan) >= 10


# ---------------------------------------------------------------- threads

THREADS_SCRIPT = textwrap.dedent(r"""
    import ctypes, json, random, sys, threading
    import torch, defrag
    from defrag import capture as cap
    from defrag.driver import Driver

    PAGE = 64 << 10
    drv = Driver.emulated(capacity=64 << 20, granularity=PAGE)
    pool = defrag.Pool(device=drv, capacity="8MiB")
    allocator = defrag.TorchAllocator(pool)
    alloc, free = cap.ALLOC_FN(allocator.alloc_ptr), cap.FREE_FN(allocator.free_ptr)
    errors, nulls = [], [0]
    lock = threading.Lock()
    start = threading.Barrier(6)

    def segments(seed):
        rng = random.Random(seed)
        held = []
        start.wait()
        for i in range(300):
            if held and (len(held) > 6 or rng.random() < 0.4):
                ptr, n, tag = held.pop(rng.randrange(len(held)))
                if ctypes.string_at(ptr, n) != bytes([tag]) * n:
                    errors.append(f"segment {ptr:#x} lost its bytes")
                free(ptr, n, 0, None)
            else:
                n = rng.choice([512, 4000, PAGE, 2 * PAGE + 3, 5 * PAGE])
                ptr = alloc(n, 0, None)
                if not ptr:
                    with lock:
                        nulls[0] += 1
                    continue
                tag = (seed * 31 + i) % 251
                ctypes.memset(ptr, tag, n)
                held.append((ptr, n, tag))
        for ptr, n, tag in held:
            if ctypes.string_at(ptr, n) != bytes([tag]) * n:
                errors.append(f"segment {ptr:#x} lost its bytes")
            free(ptr, n, 0, None)

    def tensors(seed):
        # Pool tensors made, checked and compacted by their own thread, next to the segments.
        rng = random.Random(seed)
        start.wait()
        for i in range(60):
            try:
                ts = [pool.full((rng.choice([1000, 9000, 30000]),), k % 200, dtype=torch.uint8) for k in range(8)]
            except torch.OutOfMemoryError:
                continue
            del ts[::2]
            try:
                pool.compact()
            except defrag.ConcurrencyError:
                pass
            for k, t in zip(range(1, 8, 2), ts):
                if not bool((t == k % 200).all()):
                    errors.append("a pool tensor lost its bytes")
            del ts

    workers = [threading.Thread(target=segments, args=(s,)) for s in range(4)]
    workers += [threading.Thread(target=tensors, args=(s,)) for s in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    pool.check_invariants()
    c = allocator.counters()
    out = {"errors": errors, "nulls": nulls[0], "segments": pool.segments(), "counters": c}
    pool.close()
    out["leak"] = drv.api.state()
    print(json.dumps(out))
""")


def test_callbacks_from_several_threads_at_once(tmp_path):
    script = tmp_path / "threads.py"
    script.write_text(THREADS_SCRIPT)
    proc = run_python(THREADS_SCRIPT, path=str(script), timeout=240)  # python threads.py, forked from the test zygote
    assert proc.returncode == 0, f"the threads run died (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    c = out["counters"]
    assert out["errors"] == [], out["errors"][:5]
    assert out["segments"] == []
    assert c["errors"] == 0 and c["foreign_frees"] == 0
    assert c["allocs"] == c["frees"] > 100
    assert c["failures"] == out["nulls"]
    assert out["leak"] == {"handles": 0, "mappings": 0, "reservations": 0, "used_bytes": 0}
    assert "Exception ignored" not in proc.stderr


# ---------------------------------------------------------------- routing needs CUDA

def test_capture_refuses_the_emulated_device(make_pool):
    pool = make_pool()
    with pytest.raises(RuntimeError, match=r"pool\.capture\(\) routes PyTorch's CUDA allocations; this pool is on "
                                           r"the emulated device"):
        with cap.capture(pool):
            pass
    # defrag.install(pool) of an emulated pool makes it PyTorch's CPU allocator instead: tests/cpu/test_cpu_allocator.py
    if hasattr(pool, "capture"):
        with pytest.raises(RuntimeError, match="emulated device"):
            with pool.capture():
                pass
    assert allocator_install.installed() is None
    assert cap.release_cached(pool) == 0  # nothing was ever routed
    assert defrag.TorchAllocator.for_pool(pool).release_cached() == 0  # no CUDA: nothing cached
    assert defrag.TorchAllocator.for_pool(pool).mempools() == {"open": 0, "busy": 0, "retired": 0}


def test_the_trampolines_outlive_every_allocator(make_pool):
    pool = make_pool()
    allocator = defrag.TorchAllocator(pool)
    alloc_ptr = allocator.alloc_ptr
    del allocator
    gc.collect()
    # PyTorch still holds the raw address: calling it must work.
    alloc = cap.ALLOC_FN(alloc_ptr)
    ptr = alloc(100, 0, None)
    assert ptr and pool.free_segment(ptr)


def test_a_thread_that_is_not_python_s_own(make_pool):
    """The callbacks run on a thread Python did not start (as autograd's are) and take the GIL there."""
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "pthread_create"):
        pytest.skip("no pthread_create")
    pool = make_pool()
    allocator = defrag.TorchAllocator(pool)
    result = {}
    START = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)

    @START
    def body(_arg):
        alloc, free = entry_points(allocator)
        ptr = alloc(3000, 0, None)
        result["ptr"] = ptr
        result["owned"] = [a for a, _ in pool.segments()] == [ptr]
        free(ptr, 3000, 0, None)
        return None

    tid = ctypes.c_ulong()
    libc.pthread_create.argtypes = [ctypes.POINTER(ctypes.c_ulong), ctypes.c_void_p, START, ctypes.c_void_p]
    libc.pthread_join.argtypes = [ctypes.c_ulong, ctypes.c_void_p]
    assert libc.pthread_create(ctypes.byref(tid), None, body, None) == 0
    done = threading.Event()
    threading.Thread(target=lambda: (libc.pthread_join(tid.value, None), done.set()), daemon=True).start()
    assert done.wait(30), "the native thread did not finish"
    assert result["ptr"] and result["owned"]
    assert pool.segments() == [] and allocator.counters()["frees"] == 1


def test_release_cached_finds_every_allocator_the_pool_was_captured_with(make_pool, monkeypatch):
    """A `TorchAllocator` built by the user and passed to `capture()` caches PyTorch's segments in its own
    MemPools: `release_cached(pool)` (and `pool.release_cached()`) must reach it, not only the pool's
    default allocator (`TorchAllocator.for_pool`). CUDA's routing is stood in for: this checks which
    allocators are asked, which needs no GPU (tests/gpu/test_capture_gpu.py checks the segments)."""
    import contextlib

    pool = make_pool()
    monkeypatch.setattr(cap, "require_cuda", lambda pool, what: None)
    monkeypatch.setattr(cap.TorchAllocator, "_take_mempool", lambda self: object())
    monkeypatch.setattr(cap.TorchAllocator, "_give_mempool", lambda self, mempool: None)
    monkeypatch.setattr(cap.torch.cuda, "use_mem_pool", lambda mempool, device=None: contextlib.nullcontext(),
                        raising=False)
    asked = []
    monkeypatch.setattr(cap.TorchAllocator, "release_cached", lambda self: asked.append(self) or 3 << 20)
    own = defrag.TorchAllocator(pool, compact_in_callback=True)
    with cap.capture(pool, allocator=own) as routed:
        assert routed is own
    assert cap.release_cached(pool) == 3 << 20 and asked == [own]
    with cap.capture(pool):  # the pool's default allocator too, from now on
        pass
    assert pool.release_cached() == 6 << 20
    assert asked[1:] == [own, defrag.TorchAllocator.for_pool(pool, create=False)]
    other = make_pool()
    assert cap.release_cached(other) == 0 and len(asked) == 3  # another pool's allocators are not asked
