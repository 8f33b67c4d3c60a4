"""The pool's side of the C ABI that PyTorch's CUDA allocator backend uses (native/pool_abi.h), over an
emulated pool.

The pool is registered for device 0 through `defrag.allocator_install.register_native`, as `install_cuda` does
before it hands PyTorch the backend; the ABI's functions are then called through ctypes
(`defrag.cuda_backend.pool_abi()`), as the backend calls them through dlsym: C functions that never
throw, called with the GIL released. Each answer is checked against the pool's own `stats()` and
against bytes written through the blocks. A registration lasts as long as the process, so each
scenario runs in a subprocess (a crash fails the test instead of killing pytest).
"""

from __future__ import annotations

import subprocess

import pytest

from defrag import fastpath

from ..forked import run_clean

pytestmark = pytest.mark.skipif(fastpath.setting() == "off", reason="DEFRAG_FASTPATH=0: no native entry points")

PRELUDE = r"""
import ctypes, threading, torch, defrag
from defrag import allocator_install as cap, cuda_backend as cb
MiB = 1 << 20
OK, OOM, ERROR, NO_POOL, BUSY = range(5)
pool = defrag.Pool("emulated", capacity="64MiB", auto_compact=False)
P = pool.page_size
lib = cb.pool_abi()

def register():
    return cap.register_native(pool, device=0)

def stats(device=0):
    s = cb.PoolStats()
    s.struct_size = ctypes.sizeof(s)
    status = lib.defrag_pool_stats(device, ctypes.byref(s))
    return status, s

def alloc(n, device=0):
    out, why = ctypes.c_void_p(), ctypes.create_string_buffer(4096)
    status = lib.defrag_pool_alloc(device, n, None, ctypes.byref(out), why, len(why))
    return status, out.value, why.value.decode()

def free(ptr, device=0):
    where = ctypes.c_int32(-7)
    size = lib.defrag_pool_free(device, ptr, ctypes.byref(where))
    return size, where.value
"""


def run(body: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return run_clean(PRELUDE + body + "\nprint('ok')\n", ends_with="ok", timeout=timeout)  # its own process


def test_the_abi_version_and_the_stats_struct_match_this_checkout():
    run(r"""
assert lib.defrag_pool_abi_version() == 2
assert lib.defrag_pool_stats_size() == ctypes.sizeof(cb.PoolStats) == 8 * len(cb.PoolStats._fields_)
with open("defrag/native/pool_abi.h") as f:
    header = f.read()
body = header[header.index("typedef struct DefragPoolStats"):header.index("} DefragPoolStats;")]
fields = [line.split()[1].rstrip(";") for line in body.splitlines() if line.strip().startswith("int64_t")]
assert fields == [name for name, _ in cb.PoolStats._fields_], fields
""")


def test_a_device_without_a_pool_is_no_pool_and_nothing_changes():
    run(r"""
assert stats(0)[0] == NO_POOL and stats(5)[0] == NO_POOL and stats(999)[0] == NO_POOL
status, ptr, why = alloc(4096, device=3)
assert (status, ptr) == (NO_POOL, None) and "cuda:3" in why and "no pool" in why, (status, why)
fraction = ctypes.c_double(-1)
assert lib.defrag_pool_memory_fraction(2, ctypes.byref(fraction)) == NO_POOL and fraction.value == -1
assert lib.defrag_pool_reset_peaks(2) == NO_POOL and lib.defrag_pool_empty_cache(2, None) == NO_POOL
assert free(0x1000) == (-1, -7)  # a pointer no pool made: ignored, counted
assert pool.stats()["num_allocs"] == 0
""")


def test_stats_are_the_pools_own_figures_through_allocations_and_frees():
    run(r"""
register()
status, s = stats()
assert status == OK and s.allocated_bytes == 0 and s.live_blocks == 0, (status, s.allocated_bytes)
ptrs = []
for n in (3 * MiB + 100, 1000, 5 * MiB):
    status, ptr, why = alloc(n)
    assert status == OK and pool.owns_address(ptr) and pool.owns_address(ptr + n - 1), (status, why)
    ctypes.memset(ptr, 0x5A, n)  # emulated device memory is host memory: the block is really there
    ptrs.append((ptr, n))
status, s = stats()
mine = pool.stats()
pairs = {"allocated_bytes": "allocated_bytes.all.current", "allocated_bytes_peak": "allocated_bytes.all.peak",
         "active_bytes": "active_bytes.all.current", "reserved_bytes": "reserved_bytes.all.current",
         "reserved_bytes_peak": "reserved_bytes.all.peak", "requested_bytes": "requested_bytes.all.current",
         "inactive_split_bytes": "stranded_bytes", "live_blocks": "live_blocks", "num_allocs": "num_allocs",
         "num_frees": "num_frees", "num_ooms": "num_ooms", "num_device_alloc": "num_device_alloc",
         "mapped_pages": "pages.mapped", "page_size": "page_size", "capacity_bytes": "capacity_bytes",
         "largest_mapped_free": "largest_mapped_free_bytes"}
for field, key in pairs.items():
    assert getattr(s, field) == mine[key], (field, getattr(s, field), key, mine[key])
rounded = sum(-(-n // 512) * 512 for _, n in ptrs)
assert s.allocated_bytes == rounded and s.requested_bytes == sum(n for _, n in ptrs) and s.live_blocks == 3
assert s.device_total_bytes == pool.driver.total_memory and s.capacity_bytes == 64 * MiB
# A free gives the block back, says its size as the pool counted it and the device whose pool made it.
size, device = free(ptrs[0][0])
assert (size, device) == (-(-ptrs[0][1] // 512) * 512, 0)
assert free(ptrs[0][0]) == (-1, -7)  # twice: not the pool's any more
status, s = stats()
assert s.allocated_bytes == rounded - size and s.allocated_bytes_peak == rounded and s.num_frees == 1
assert s.allocated_bytes == pool.stats()["allocated_bytes.all.current"]
# An older caller's shorter struct: only the fields it knows are written.
short = (ctypes.c_int64 * 3)(16, -1, -1)
assert lib.defrag_pool_stats(0, ctypes.cast(short, ctypes.POINTER(cb.PoolStats))) == OK
assert short[0] == 16 and short[1] == s.allocated_bytes and short[2] == -1
for ptr, _ in ptrs[1:]:
    free(ptr)
pool.check_invariants()
""")


def test_peaks_and_accumulated_counters_reset_without_touching_the_pools_own_counts():
    run(r"""
register()
a = alloc(8 * MiB)[1]
b = alloc(1 * MiB)[1]
free(a)
status, s = stats()
assert s.allocated_bytes_peak == 9 * MiB and s.allocated_bytes == 1 * MiB
assert lib.defrag_pool_reset_peaks(0) == OK
status, s = stats()
assert s.allocated_bytes_peak == s.allocated_bytes == 1 * MiB, s.allocated_bytes_peak
assert s.reserved_bytes_peak == s.reserved_bytes
assert pool.stats()["allocated_bytes.all.peak"] == 1 * MiB  # the pool's own peak: the same figure
assert (s.num_allocs, s.num_frees) == (2, 1)
assert lib.defrag_pool_reset_accumulated(0) == OK
status, s = stats()
assert (s.num_allocs, s.num_frees, s.num_ooms) == (0, 0, 0)
assert (pool.stats()["num_allocs"], pool.stats()["num_frees"]) == (2, 1)  # not the pool's
alloc(4096)
status, s = stats()
assert s.num_allocs == 1 and s.live_blocks == 2
""")


def test_cache_info_is_the_largest_block_servable_without_mapping():
    run(r"""
register()
keep = [alloc(P // 2)[1] for _ in range(4)]  # two pages of two blocks each; every other one freed
free(keep[1]); free(keep[3])
largest = ctypes.c_int64(-1)
assert lib.defrag_pool_largest_block(0, ctypes.byref(largest)) == OK
heaps = max(h.largest_free() for h in pool.core.backing.heaps)
assert largest.value == heaps == pool.stats()["largest_mapped_free_bytes"] and 0 < largest.value < 2 * P
reserved = stats()[1].reserved_bytes
status, ptr, why = alloc(largest.value)  # served from mapped pages: nothing mapped
assert status == OK and stats()[1].reserved_bytes == reserved, why
assert lib.defrag_pool_largest_block(0, ctypes.byref(largest)) == OK and largest.value == P // 2  # the other hole
status, ptr, why = alloc(largest.value + 512)  # one step more than that: a page must be mapped
assert status == OK and stats()[1].reserved_bytes > reserved, why
""")


def test_empty_cache_gives_the_empty_pages_back_and_keeps_live_bytes():
    run(r"""
register()
live = alloc(P // 4)[1]
ctypes.memset(live, 0x33, P // 4)
gone = [alloc(3 * P)[1] for _ in range(2)]
for ptr in gone:
    free(ptr)
before = stats()[1].reserved_bytes
assert before >= 7 * P, before
released = ctypes.c_int64(-1)
assert lib.defrag_pool_empty_cache(0, ctypes.byref(released)) == OK
after = stats()[1].reserved_bytes
assert after == P and released.value == before - after, (before, after, released.value)
assert pool.stats()["reserved_bytes.all.current"] == P and pool.stats()["pages.cached"] == 0
assert ctypes.string_at(live, P // 4) == b"\x33" * (P // 4)  # the live block kept its page and bytes
pool.check_invariants()
""")


def test_memory_fraction_is_the_capacity_over_the_device_and_cannot_shrink():
    run(r"""
register()
fraction = ctypes.c_double()
assert lib.defrag_pool_memory_fraction(0, ctypes.byref(fraction)) == OK
assert fraction.value == pool.capacity / pool.driver.total_memory
why = ctypes.create_string_buffer(4096)
assert lib.defrag_pool_set_memory_fraction(0, 1.0, why, len(why)) == OK
assert lib.defrag_pool_set_memory_fraction(0, fraction.value, why, len(why)) == OK  # the capacity itself
small = fraction.value / 2
assert lib.defrag_pool_set_memory_fraction(0, small, why, len(why)) == ERROR
text = why.value.decode()
assert "capacity" in text and "defrag run --capacity" in text and "cuda:0" in text, text
for bad in (0.0, -0.5, 1.5, float("nan")):
    assert lib.defrag_pool_set_memory_fraction(0, bad, why, len(why)) == ERROR, bad
    assert "(0, 1]" in why.value.decode()
assert pool.capacity == 64 * MiB  # unchanged
""")


def test_an_allocation_the_pool_cannot_serve_says_what_it_tried_and_changes_nothing():
    run(r"""
register()
kept = alloc(MiB)[1]
before = pool.stats()
status, ptr, why = alloc(1 << 30)
assert status == OOM and ptr is None, status
assert "cannot allocate 1.00 GiB" in why and "tried:" in why and "capacity 64.00 MiB" in why, why
status, ptr, why = alloc(1 << 63)  # more than any pool can hold
assert status == OOM and "more than any pool can hold" in why
after = pool.stats()
assert after["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]
assert after["live_blocks"] == before["live_blocks"] == 1
out = ctypes.c_void_p()
assert lib.defrag_pool_alloc(0, 4096, None, None, None, 0) == ERROR  # nowhere to put the address
pool.check_invariants()
""")


def test_the_pools_own_code_gets_busy_instead_of_a_recursion_into_its_gate():
    run(r"""
register()
ptr = alloc(4096)[1]
with pool.core.gate:  # this thread holds the pool's gate (and its books): asking the pool would recurse
    status, s = stats()
    largest = ctypes.c_int64(-1)
    assert status == BUSY and lib.defrag_pool_largest_block(0, ctypes.byref(largest)) == BUSY
    assert lib.defrag_pool_empty_cache(0, None) == BUSY and lib.defrag_pool_reset_peaks(0) == BUSY
    assert largest.value == -1
# Another thread meanwhile is answered as soon as the gate is free.
answers = []
with pool.core.gate:
    t = threading.Thread(target=lambda: answers.append(stats()[0]))
    t.start()
    t.join(0.2)
    assert t.is_alive()  # waits for the gate, holding no lock of the pool's
t.join(30)
assert answers == [OK]
# The memory fraction is known natively once asked.
fraction = ctypes.c_double()
assert lib.defrag_pool_memory_fraction(0, ctypes.byref(fraction)) == OK
with pool.core.gate:
    assert lib.defrag_pool_memory_fraction(0, ctypes.byref(fraction)) == OK
free(ptr)
""")


def test_record_stream_makes_the_free_wait_for_that_stream_in_the_books():
    """PyTorch's recordStream through the ABI (fake streams: no GPU here): the block's free waits in the
    pool's books for an event on the recorded stream, its range reused only once that stream finished;
    a block no other stream used is reused at once. Unknown pointers are NO_POOL."""
    run(r"""
pool.core.books.set_streams("fake")
register()
A, B = 0x1000, 0x2000
status, ptr, _ = alloc(4096)
assert status == OK and ptr
assert lib.defrag_pool_record_stream(0, ptr, B) == OK
assert lib.defrag_pool_record_stream(0, ptr + 512, B) == NO_POOL  # not a block's start
assert lib.defrag_pool_record_stream(1, ptr, B) == NO_POOL  # no pool on cuda:1
size, _ = free(ptr)
assert size == 4096 and pool.core.books.pending == 1
assert stats()[1].active_bytes == 4096 and stats()[1].allocated_bytes == 0
status, other, _ = alloc(4096)
assert status == OK and other != ptr  # B may still use it
free(other)  # no other stream used it: kept for its size at once
status, again, _ = alloc(4096)
assert again == other and pool.core.books.pending == 1
pool.core.books.fake_finish(B)
status, third, _ = alloc(4096)  # B finished: the pending free is applied first, and its range reused
assert third == ptr and pool.core.books.pending == 0, (hex(third), hex(ptr))
free(again); free(third)
pool.check_invariants()
assert stats()[1].active_bytes == 0
""")
