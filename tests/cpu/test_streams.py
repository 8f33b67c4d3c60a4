"""Stream-ordered reuse in the books (`defrag/native/streams.h`), driven by fake streams on a machine
without a GPU: the events and waits a CUDA pool would make, counted, with their effect on placement.

PyTorch's rules, over one set of books: a block freed on the stream it was placed for is reusable at
once (no event); a block other streams used (`record_stream`) waits for an event on each of them; a
range one stream freed is placed for another only after that stream waits for the freeing one on
the device (a fence, no host wait). A program on one stream never records an event.
"""

from __future__ import annotations

import pytest

from defrag import fastpath
from defrag.core import Core
from defrag.driver import Driver

from ..forked import run_python

MiB = 1 << 20
PAGE = 64 * 1024
A, B, C = 0x1000, 0x2000, 0x3000  # three fake stream handles


def fake_core(pages: int = 16) -> Core:
    core = Core(Driver.memoryless(capacity=pages * PAGE, granularity=PAGE), capacity_pages=pages, page_size=PAGE,
                auto_compact=False)
    core.books.set_streams("fake")
    return core


def alloc(core: Core, nbytes: int, stream: int):
    with core.gate:
        core.drain()
        return core.allocate(nbytes, stream=stream)


def release(core: Core, block) -> None:
    with core.gate:
        core.release(block)
    # the release waited in the books' queue while the gate was held: applied as it was let go


def test_a_block_freed_on_its_own_stream_is_reused_at_once_without_an_event():
    core = fake_core()
    first = alloc(core, 4096, A)
    release(core, first)
    again = alloc(core, 4096, A)
    assert again.address == first.address  # the range kept for its size, at once
    events = core.books.fake_events()
    assert events["recorded"] == 0 and events["waits"] == []
    assert core.books.pending == 0
    core.check_invariants()


def test_a_block_other_streams_used_waits_for_their_events():
    core = fake_core()
    block = alloc(core, 4096, A)
    core.books.record_stream(block.address, block, B)
    core.books.record_stream(block.address, block, C)
    core.books.record_stream(block.address, block, A)  # its own stream: nothing to wait for
    release(core, block)
    assert core.books.pending == 1 and core.books.fake_events()["recorded"] == 2
    stats = core.stats_locked()
    assert stats["allocated_bytes.all.current"] == 0 and stats["active_bytes.all.current"] == 4096
    assert [b.pending for b in core.blocks()] == [True]  # active, not allocated, and never moved
    other = alloc(core, 4096, A)
    assert other.address != block.address  # not reused while B and C may still read it
    core.books.fake_finish(B)
    with core.gate:
        core.drain()
    assert core.books.pending == 1  # C still runs
    core.books.fake_finish(C)
    with core.gate:
        core.drain()
    assert core.books.pending == 0 and core.books.fake_events()["destroyed"] == 2
    assert alloc(core, 4096, A).address == block.address  # free now
    stats = core.stats_locked()
    assert stats["active_bytes.all.current"] == stats["allocated_bytes.all.current"] == 2 * 4096
    core.check_invariants()


def test_waiting_for_pending_releases_synchronizes_and_frees_them():
    core = fake_core()
    block = alloc(core, 8192, A)
    core.books.record_stream(block.address, block, B)
    release(core, block)
    assert core.books.pending == 1
    with core.gate:
        core.wait_pending()  # the OOM ladder's step and a compaction's start
    assert core.books.pending == 0
    assert core.stats_locked()["active_bytes.all.current"] == 0
    core.check_invariants()


def test_a_range_freed_by_one_stream_is_placed_for_another_only_after_a_fence():
    core = fake_core()
    block = alloc(core, 4096, A)
    release(core, block)
    # B takes the range A freed: B first waits (on the device) for A's work up to now.
    taken = alloc(core, 4096, B)
    assert taken.address == block.address
    assert core.books.fake_events()["waits"] == [(B, A)]
    # Nothing freed since: B's next placement needs no fence, and A's own placements never do.
    alloc(core, 4096, B)
    alloc(core, 4096, A)
    assert core.books.fake_events()["waits"] == [(B, A)]
    # B frees: A's next placement waits for B; a device synchronize makes every earlier free safe.
    release(core, taken)
    alloc(core, 4096, A)
    assert core.books.fake_events()["waits"] == [(B, A), (A, B)]
    release(core, core.blocks()[0])
    core.books.synchronized()
    alloc(core, 4096, B)
    alloc(core, 4096, C)
    assert core.books.fake_events()["waits"] == [(B, A), (A, B)]
    core.check_invariants()


def test_streams_cannot_change_once_the_books_hold_blocks():
    core = fake_core()
    alloc(core, 4096, A)
    with pytest.raises(RuntimeError, match="hold blocks already"):
        core.books.set_streams("none")
    with pytest.raises(ValueError, match="none, cuda or fake"):
        Core(Driver.memoryless(capacity=4 * PAGE, granularity=PAGE), capacity_pages=4,
             page_size=PAGE).books.set_streams("maybe")


@pytest.mark.skipif(fastpath.setting() == "off", reason="DEFRAG_FASTPATH=0: no native entry points")
def test_the_cuda_entry_points_keep_the_stream_rules_natively():
    """PyTorch's allocation entry (`defrag_cuda_alloc`, here through its test hook over an emulated pool
    with fake streams): one stream reuses at once with no event, another stream is fenced first, and
    no trip to Python is needed for any of it."""
    script = r"""
import defrag
from defrag import allocator_install as cap, fastpath
pool = defrag.Pool("emulated", capacity="64MiB", auto_compact=False)
pool.core.books.set_streams("fake")
route = cap.register_native(pool, device=0)
m = fastpath.module
A, B = 0x1000, 0x2000
warm = m.cuda_allocator_call(4096, 0, A)       # maps a page: the one trip to the pool's Python code
m.cuda_allocator_free(warm, 4096, 0, A)
asked = route.counters()["asked"]
ptrs = [m.cuda_allocator_call(4096, 0, A) for _ in range(100)]
for p in ptrs:
    m.cuda_allocator_free(p, 4096, 0, A)
again = m.cuda_allocator_call(4096, 0, A)
assert again == ptrs[-1], (hex(again), hex(ptrs[-1]))  # last freed, first reused: the same stream, at once
assert pool.core.books.fake_events()["waits"] == []
other = m.cuda_allocator_call(4096, 0, B)
assert pool.core.books.fake_events()["waits"] == [(B, A)]
assert route.counters()["asked"] == asked  # nothing of this needed Python
m.cuda_allocator_free(again, 4096, 0, A)
m.cuda_allocator_free(other, 4096, 0, B)
pool.check_invariants()
assert pool.stats()["allocated_bytes.all.current"] == 0
print("ok")
"""
    proc = run_python(script, timeout=240)  # a process of its own, forked (tests/forked.py)
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("ok"), proc.stderr[-3000:]
