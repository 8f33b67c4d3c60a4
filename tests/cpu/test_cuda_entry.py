"""`defrag.install(pool)` on CUDA, rehearsed on the emulated device: the native entry points
`defrag_cuda_alloc` / `defrag_cuda_free` (native/cuda_allocator.cpp) over an emulated pool.

The pool is registered for device 0 through `defrag.allocator_install.register_native`, the registration
`install_cuda` makes before it hands the entry points to PyTorch (`change_current_allocator`, which
needs CUDA torch, is the one step left out). ctypes cannot carry a C++ exception, so the entry points
are called through the native module's test hooks (`cuda_allocator_call` / `cuda_allocator_free`),
which call them from C++ with the GIL released, as PyTorch's malloc does, and turn
c10::OutOfMemoryError into torch.OutOfMemoryError. Emulated device memory is host memory: the bytes
are written and read through ctypes and through a tensor over the block (`torch.frombuffer`, as the
pool's own tensors are made).

A registration lasts as long as the process, so each run is a subprocess (a crash fails the test
instead of killing pytest).
"""

from __future__ import annotations

import subprocess

import pytest

from defrag import fastpath

from ..forked import run_clean

pytestmark = pytest.mark.skipif(fastpath.setting() == "off", reason="DEFRAG_FASTPATH=0: no native entry points")

PRELUDE = r"""
import ctypes, threading, torch, defrag
from defrag import allocator_install as cap, fastpath
MiB = 1 << 20
pool = defrag.Pool("emulated", capacity="64MiB", auto_compact=False)
route = cap.register_native(pool, device=0)
m = fastpath.module
alloc, free = m.cuda_allocator_call, m.cuda_allocator_free

def counters():
    return route.counters()

def block_at(address):
    return next((b for b in pool.layout()["blocks"] if b["address"] == address), None)
"""


def run(body: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return run_clean(PRELUDE + body + "\nprint('ok')\n", ends_with="ok", timeout=timeout)  # its own process


def test_a_block_lives_in_the_pool_pinned_and_its_bytes_are_usable():
    run(r"""
before = pool.stats()["allocated_bytes.all.current"]
n = 3 * MiB + 100
ptr = alloc(n, 0)
assert ptr and pool.owns_address(ptr) and pool.owns_address(ptr + n - 1), hex(ptr)
# Emulated device memory is host memory: write it through ctypes, read it through a tensor over it.
ctypes.memset(ptr, 0xAB, n)
view = torch.frombuffer((ctypes.c_uint8 * n).from_address(ptr), dtype=torch.uint8)
assert bool((view == 0xAB).all())
view[-1] = 7
assert ctypes.string_at(ptr + n - 2, 2) == b"\xab\x07"
del view
pool.check_invariants()
stats = pool.stats()
assert stats["allocated_bytes.all.current"] >= before + n, stats
assert stats["live_blocks"] == 1 and stats["pinned_blocks"] == 1, stats
block = block_at(ptr)
assert block is not None and block["pinned"] and block["nbytes"] == n and block["state"] == "live", block
live = pool.live_tensors()
assert [t.movable for t in live] == [False], live  # PyTorch holds its raw pointer: never moved
report = pool.compact()
assert block_at(ptr) is not None and ctypes.string_at(ptr, 1) == b"\xab"

free(ptr, n, 0)
pool.check_invariants()
stats = pool.stats()
assert stats["live_blocks"] == 0 and stats["allocated_bytes.all.current"] == before, stats
c = counters()
assert (c["allocs"], c["frees"], c["failures"], c["foreign_frees"]) == (1, 1, 0, 0), c
# The range went back to the books: the next request of that size is served from it.
again = alloc(n, 0)
assert again == ptr, (hex(again), hex(ptr))
free(again, n, 0)
assert alloc(0, 0) == 0  # an empty tensor: NULL, nothing placed or counted
free(0, 0, 0)  # and its free does nothing
assert counters()["allocs"] == 2 and counters()["failures"] == 0
pool.close()
""")


def test_an_impossible_request_raises_torch_oom_and_the_pool_stays_intact():
    run(r"""
keep = alloc(4 * MiB, 0)
ctypes.memset(keep, 0x5A, 4 * MiB)
stats = pool.stats()
for n in (1 << 30, 65 * MiB, 1 << 61):
    try:
        alloc(n, 0)
    except torch.OutOfMemoryError as exc:
        text = str(exc)  # the pool's explained OOM: the request, the capacity, what is live
        assert f"cannot allocate" in text and f"({n} bytes)" in text and "capacity 64.00 MiB" in text, text
        assert "live 4.00 MiB" in text and "(pinned)" in text, text
    else:
        raise AssertionError(f"{n} bytes were served by a 64 MiB pool")
assert isinstance(torch.OutOfMemoryError("x"), RuntimeError)
after = pool.stats()
assert after["live_blocks"] == stats["live_blocks"] == 1, after
assert after["allocated_bytes.all.current"] == stats["allocated_bytes.all.current"], after
assert ctypes.string_at(keep, 4) == b"\x5a" * 4 and ctypes.string_at(keep + 4 * MiB - 1, 1) == b"\x5a"
pool.check_invariants()
c = counters()
assert c["ooms"] == 3 and c["failures"] == 3 and c["allocs"] == 1, c
assert "cannot allocate" in c["last_error"] and "capacity 64.00 MiB" in c["last_error"], c
# The program goes on: a request that fits is served.
ok = alloc(8 * MiB, 0)
assert pool.owns_address(ok)
free(ok, 8 * MiB, 0)
free(keep, 4 * MiB, 0)
pool.check_invariants()
assert pool.stats()["live_blocks"] == 0
pool.close()
""")


def test_unknown_devices_bad_sizes_and_a_second_pool_are_errors():
    run(r"""
import pytest
for device in (1, 5, 63, -1, 64, 1000):
    with pytest.raises(RuntimeError, match=f"cuda:{device}, a device no pool was installed for") as info:
        alloc(1024, device)
    assert not isinstance(info.value, torch.OutOfMemoryError)
with pytest.raises(RuntimeError, match="asked for -5 bytes"):
    alloc(-5, 0)
assert cap.register_native(pool, device=0) is route  # the same pool again
other = defrag.Pool("emulated", capacity="16MiB")
with pytest.raises(RuntimeError, match="already serves cuda:0"):
    cap.register_native(other, device=0)
second = cap.register_native(other, device=1)  # one pool per device
p1 = alloc(1000, 1)
assert other.owns_address(p1) and not pool.owns_address(p1)
assert second.counters()["allocs"] == 1 and route.counters()["allocs"] == 0
free(p1, 1000, 1)
assert other.stats()["live_blocks"] == 0 and second.counters()["frees"] == 1
with pytest.raises(ValueError, match="name the CUDA device index"):
    cap.register_native(defrag.Pool("emulated", capacity="8MiB"))
with pytest.raises(RuntimeError, match="this pool is on the emulated device"):
    cap.install_cuda(pool)
assert cap.installed() is None  # registered, but PyTorch was never handed the entry points
assert defrag.uninstall() is False
# A closed pool cannot serve: torch's OOM, saying why, and nothing else changes.
pool.close()
with pytest.raises(torch.OutOfMemoryError, match="it is closed or asleep"):
    alloc(1024, 0)
assert route.counters()["declined"] >= 1
""")


def test_a_foreign_free_is_counted_and_ignored():
    proc = run(r"""
ptr = alloc(4096, 0)
free(0xDEAD0000, 100, 0)  # never handed out
free(ptr, 4096, 0)
free(ptr, 4096, 0)  # a second free of the same block: foreign by now
free(12345, 1, 77)  # a device no pool serves
c = counters()
assert c["foreign_frees"] == 3 and c["frees"] == 1, c
assert "0xdead0000" in c["last_error"] or "0x3039" in c["last_error"], c
pool.check_invariants()
assert pool.stats()["live_blocks"] == 0
pool.close()
""")
    assert proc.stderr.count("which no installed pool handed out; ignored") == 3, proc.stderr


def test_the_ladder_maps_pages_from_the_entry():
    run(r"""
assert pool.stats()["reserved_bytes.all.current"] == 0  # nothing mapped yet
sizes = [5 * MiB, 3 * MiB + 17, 9 * MiB, 1 * MiB, 12 * MiB, 700, 6 * MiB]
ptrs = []
for i, n in enumerate(sizes):
    p = alloc(n, 0)
    ctypes.memset(p, i + 1, n)
    ptrs.append((p, n, i + 1))
c = counters()
assert c["asked"] >= 1 and c["allocs"] == len(sizes) and c["failures"] == 0, c
stats = pool.stats()
assert stats["reserved_bytes.all.current"] >= sum(sizes), stats
spans = sorted((p, p + n) for p, n, _ in ptrs)
assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "blocks overlap"
for p, n, mark in ptrs:
    assert ctypes.string_at(p, 1) == bytes([mark]) and ctypes.string_at(p + n - 1, 1) == bytes([mark])
pool.check_invariants()
# Free every other block: the holes left are smaller than the next request, which the ladder
# serves from fresh pages (stitched), not by moving the pinned blocks.
for p, n, _ in ptrs[::2]:
    free(p, n, 0)
big = alloc(20 * MiB, 0)
assert pool.owns_address(big) and pool.owns_address(big + 20 * MiB - 1)
ctypes.memset(big, 0xEE, 20 * MiB)
for p, n, mark in ptrs[1::2]:
    assert ctypes.string_at(p, 1) == bytes([mark]) and ctypes.string_at(p + n - 1, 1) == bytes([mark])
free(big, 20 * MiB, 0)
for p, n, _ in ptrs[1::2]:
    free(p, n, 0)
pool.check_invariants()
assert pool.stats()["live_blocks"] == 0
assert counters()["frees"] == len(sizes) + 1
pool.close()
""")


def test_threads_allocating_together_never_share_a_byte():
    run(r"""
errors = []
def churn(seed):
    try:
        live = []
        for i in range(300):
            n = 512 * (1 + (seed * 7 + i * 13) % 64)
            p = alloc(n, 0)
            ctypes.memset(p, seed, n)
            live.append((p, n))
            if len(live) > 8:
                q, m_ = live.pop(0)
                if ctypes.string_at(q, m_) != bytes([seed]) * m_:
                    errors.append(("overwritten", seed, hex(q)))
                free(q, m_, 0)
        for q, m_ in live:
            if ctypes.string_at(q, m_) != bytes([seed]) * m_:
                errors.append(("overwritten", seed, hex(q)))
            free(q, m_, 0)
    except BaseException as exc:
        errors.append(repr(exc))
threads = [threading.Thread(target=churn, args=(s,)) for s in range(1, 5)]
for t in threads: t.start()
for t in threads: t.join()
assert not errors, errors[:5]
c = counters()
assert c["allocs"] == c["frees"] == 1200 and c["failures"] == 0 and c["foreign_frees"] == 0, c
pool.check_invariants()
assert pool.stats()["live_blocks"] == 0
pool.close()
""")


def test_the_library_pytorch_dlopens_is_this_one():
    run(r"""
# What CUDAPluggableAllocator does: dlopen the path, dlsym the two names. dlopen of a loaded
# library returns it: the entry points found so serve the pools of this process.
lib = ctypes.CDLL(cap.native_library())
assert cap.native_library() == m.__file__
c_alloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)(
    ctypes.cast(lib.defrag_cuda_alloc, ctypes.c_void_p).value)
c_free = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)(
    ctypes.cast(lib.defrag_cuda_free, ctypes.c_void_p).value)
p = c_alloc(2 * MiB, 0, None)  # a request that succeeds throws nothing: ctypes can make it
assert p and pool.owns_address(p)
assert counters()["allocs"] == 1
c_free(p, 2 * MiB, 0, None)
assert counters()["frees"] == 1 and pool.stats()["live_blocks"] == 0
p = alloc(4096, 0, 0x1234)  # a stream other than the default: served, counted
assert counters()["other_stream_allocs"] == 1
free(p, 4096, 0, 0x1234)
pool.close()
""")


def test_the_entry_serves_while_the_pool_records_history_and_the_history_holds_its_blocks():
    """Recording used to turn every CUDA allocation into an OOM; now the entry's blocks are logged natively
    and the snapshot's trace holds each allocation and free, in order, with the bytes PyTorch asked for."""
    run(r"""
pool.record_history()
a = alloc(3000, 0)
b = alloc(5 * MiB, 0)  # pages must be mapped: the slow path, recorded by Python, between native events
free(a, 3000, 0)
c = alloc(100, 0)
trace = pool.snapshot()["device_traces"][0]
mine = [(e["action"], e["addr"], e["size"]) for e in trace if e["action"] in ("alloc", "free_completed")]
assert mine == [("alloc", a, 3000), ("alloc", b, 5 * MiB), ("free_completed", a, 3000), ("alloc", c, 100)], mine
assert any(e["action"] == "segment_map" for e in trace)
pool.record_history(False)
free(b, 5 * MiB, 0)
free(c, 100, 0)
assert route.counters()["ooms"] == 0
pool.check_invariants()
""")
