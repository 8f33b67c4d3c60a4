"""Heap: best fit, split, coalesce, free-space insert/remove, and misuse errors.

Every test runs on both heaps: the native one (defrag/native/heap.h, the pool's)
and its Python model (tests/cpu/heap_model.py). The stateful test drives each
against a byte-exact model (one state per 512-byte unit) and checks every
invariant after every step.
"""
import time

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from defrag.errors import HeapError
from defrag.units import ALIGNMENT

from .heap_model import Heap as ModelHeap
from .test_native_heap import native_heap_class

A = ALIGNMENT
BASE = 1 << 21          # non-zero base, so offset/base mix-ups show
UNITS = 48              # span in alignment units
PAGE_UNITS = 4          # the pool asks "is this page empty?" per page


@pytest.fixture(params=["model", "native"])
def Heap(request):
    """The heap class under test: each test runs on the Python model and on the native heap."""
    return ModelHeap if request.param == "model" else native_heap_class()


def force_path(h, bulk: bool):
    """Make the model take its one-pass batch path (bulk) or one call per block; the native heap has one path."""
    if isinstance(h, ModelHeap):
        h._bulk_pays = lambda n: bulk


def snapshot(h):
    return (h.free_ranges(), h.live_blocks(), h.free_bytes(), h.live_bytes(), h.largest_free())


def expect_error(h, fn, *args):
    """fn(*args) raises HeapError and leaves the heap exactly as it was."""
    before = snapshot(h)
    with pytest.raises(HeapError):
        fn(*args)
    assert snapshot(h) == before
    h.check_invariants()


# -- examples -----------------------------------------------------------------------

def test_new_heap_has_no_free_space(Heap):
    h = Heap(0, 8 * A)
    assert h.free_ranges() == [] and h.allocate(1) is None and h.largest_free() == 0


def test_allocate_rounds_up_and_takes_low_end(Heap):
    h = Heap(0, 8 * A)
    h.insert_free(0, 8 * A)
    assert h.allocate(1) == 0 and h.block_size(0) == A
    assert h.allocate(A + 1) == A and h.block_size(A) == 2 * A
    assert h.free_ranges() == [(3 * A, 5 * A)]
    assert (h.free_bytes(), h.live_bytes()) == (5 * A, 3 * A)


def test_best_fit_picks_smallest_then_lowest(Heap):
    h = Heap(0, 32 * A)
    for off, n in [(0, 4), (5, 2), (8, 3), (12, 2), (15, 8)]:
        h.insert_free(off * A, n * A)
    assert h.allocate(2 * A) == 5 * A        # two size-2 ranges: the lower one
    assert h.allocate(2 * A) == 12 * A
    assert h.allocate(3 * A) == 8 * A        # exact fit beats the larger 4
    assert h.allocate(5 * A) == 15 * A       # only the 8 fits
    assert h.free_ranges() == [(0, 4 * A), (20 * A, 3 * A)]


def test_free_coalesces_both_sides(Heap):
    h = Heap(0, 8 * A)
    h.insert_free(0, 8 * A)
    a, b, c = h.allocate(A), h.allocate(A), h.allocate(A)
    h.free(a)
    h.free(c)
    assert h.free_ranges() == [(0, A), (2 * A, 6 * A)]
    assert h.free(b) == A
    assert h.free_ranges() == [(0, 8 * A)]


def test_insert_free_coalesces_with_neighbours(Heap):
    h = Heap(0, 8 * A)
    h.insert_free(0, 2 * A)
    h.insert_free(4 * A, 2 * A)
    h.insert_free(2 * A, 2 * A)
    assert h.free_ranges() == [(0, 6 * A)]
    h.insert_free(6 * A, 2 * A)
    assert h.free_ranges() == [(0, 8 * A)]


def test_remove_free_splits_and_allocate_at_carves(Heap):
    h = Heap(0, 16 * A)
    h.insert_free(0, 16 * A)
    h.remove_free(4 * A, 4 * A)
    assert h.free_ranges() == [(0, 4 * A), (8 * A, 8 * A)]
    assert h.allocate_at(10 * A, A + 7) == 10 * A and h.block_size(10 * A) == 2 * A
    assert h.free_ranges() == [(0, 4 * A), (8 * A, 2 * A), (12 * A, 4 * A)]
    expect_error(h, h.allocate_at, 3 * A, 2 * A)    # runs into removed space
    expect_error(h, h.remove_free, 9 * A, 2 * A)    # runs into the live block


def test_free_bytes_in_answers_page_emptiness(Heap):
    h = Heap(0, 16 * A)
    h.insert_free(0, 16 * A)
    blk = h.allocate_at(5 * A, A)
    assert h.free_bytes_in(0, 4 * A) == 4 * A          # empty page
    assert h.free_bytes_in(4 * A, 8 * A) == 3 * A      # holds the block
    assert h.free_bytes_in(A // 2, 5 * A + 1) == 5 * A - A // 2
    h.free(blk)
    assert h.free_bytes_in(4 * A, 8 * A) == 4 * A


def test_misuse_raises_and_changes_nothing(Heap):
    h = Heap(BASE, 16 * A)
    h.insert_free(BASE, 8 * A)
    blk = h.allocate(A)
    expect_error(h, h.allocate, 0)
    expect_error(h, h.allocate, -A)
    expect_error(h, h.free, blk + A)                  # not a block start
    expect_error(h, h.free, BASE + 12 * A)            # never inserted
    expect_error(h, h.insert_free, BASE + 7 * A, 2 * A)  # overlaps free space
    expect_error(h, h.insert_free, blk, A)            # overlaps a live block
    expect_error(h, h.insert_free, BASE + 8 * A + 1, A)  # misaligned offset
    expect_error(h, h.insert_free, BASE + 8 * A, A + 1)  # misaligned size
    expect_error(h, h.insert_free, BASE + 8 * A, 0)
    expect_error(h, h.insert_free, BASE - A, A)        # below the span
    expect_error(h, h.insert_free, BASE + 15 * A, 2 * A)  # past the span
    expect_error(h, h.remove_free, BASE + 6 * A, 4 * A)  # half unmanaged
    expect_error(h, h.allocate_at, BASE + A + 1, A)   # misaligned
    expect_error(h, h.block_size, BASE + 12 * A)
    h.free(blk)
    expect_error(h, h.free, blk)                      # double free
    with pytest.raises(TypeError):
        h.allocate(1.5)


@pytest.mark.parametrize("args", [(0, 0), (1, A), (0, A + 1), (0, A, 0)])
def test_bad_construction(Heap, args):
    with pytest.raises(HeapError):
        Heap(*args)


@pytest.mark.parametrize("corrupt", [
    lambda h: h._free.__setitem__(0, A),                        # size index out of sync
    lambda h: h._add_range(8 * A, A),                            # touches its neighbour
    lambda h: h._live.__setitem__(5 * A, A),                    # live block over free space
    lambda h: setattr(h, "_live_bytes", h._live_bytes + A),     # counter off
])
def test_check_invariants_catches_corruption(corrupt):
    """The model only: the native heap's books are out of Python's reach (same checks, in heap.h)."""
    h = ModelHeap(0, 16 * A)
    h.insert_free(0, 8 * A)
    h.insert_free(9 * A, 4 * A)
    h.allocate_at(10 * A, A)
    h.check_invariants()
    corrupt(h)
    with pytest.raises(HeapError):
        h.check_invariants()


def test_100k_allocate_free_mixed(Heap):
    """Churn with many live blocks; prints the rate (not asserted: tests never time)."""
    import random
    rng = random.Random(0)
    h = Heap(0, 1 << 40)
    h.insert_free(0, 1 << 40)
    live = []
    t0 = time.perf_counter()
    for _ in range(100_000):
        if live and rng.random() < 0.45:
            h.free(live.pop(rng.randrange(len(live))))
        else:
            live.append(h.allocate(rng.randrange(1, 1 << 20)))
    dt = time.perf_counter() - t0
    print(f"\nheap: 100k allocate/free in {dt:.3f} s ({dt / 1e5 * 1e6:.1f} us/op), "
          f"{len(live)} live, {len(h.free_ranges())} free ranges")
    h.check_invariants()
    for off in live:
        h.free(off)
    assert h.free_ranges() == [(0, 1 << 40)] and h.live_bytes() == 0


# -- stateful: the heap against a unit-exact model ------------------------------------

UNMANAGED, FREE = None, "free"

units = st.integers(-2, UNITS + 2)       # a few out-of-span values on purpose
lengths = st.integers(1, 12)
sizes = st.one_of(st.integers(1, 12 * A), st.sampled_from([A, 2 * A, 3 * A]))


class HeapMachine(RuleBasedStateMachine):
    def new_heap(self, base, span):
        return ModelHeap(base, span)

    def __init__(self):
        super().__init__()
        self.heap = self.new_heap(BASE, UNITS * A)
        self.model = [UNMANAGED] * UNITS   # per unit: UNMANAGED, FREE, or the owning block's offset
        self.blocks = {}                    # offset -> rounded size
        self.managed = 0                    # inserted minus removed bytes

    # model helpers
    def addr(self, u):
        return BASE + u * A

    def in_span(self, u, n):
        return 0 <= u and u + n <= UNITS

    def all_are(self, u, n, state):
        return self.in_span(u, n) and all(s == state for s in self.model[u:u + n])

    def set(self, u, n, state):
        self.model[u:u + n] = [state] * n

    def model_free_ranges(self):
        out, u = [], 0
        while u < UNITS:
            if self.model[u] is FREE:
                v = u
                while v < UNITS and self.model[v] is FREE:
                    v += 1
                out.append((self.addr(u), (v - u) * A))
                u = v
            else:
                u += 1
        return out

    # rules
    @rule(u=units, n=lengths)
    def insert_free(self, u, n):
        if self.all_are(u, n, UNMANAGED):
            self.heap.insert_free(self.addr(u), n * A)
            self.set(u, n, FREE)
            self.managed += n * A
        else:
            expect_error(self.heap, self.heap.insert_free, self.addr(u), n * A)

    @rule(u=units, n=lengths)
    def remove_free(self, u, n):
        if self.all_are(u, n, FREE):
            self.heap.remove_free(self.addr(u), n * A)
            self.set(u, n, UNMANAGED)
            self.managed -= n * A
        else:
            expect_error(self.heap, self.heap.remove_free, self.addr(u), n * A)

    @rule(size=sizes)
    def allocate(self, size):
        n = -(-size // A)
        fits = [(sz, off) for off, sz in self.model_free_ranges() if sz >= n * A]
        got = self.heap.allocate(size)
        if not fits:
            assert got is None
            return
        assert got == min(fits)[1], "not the smallest fitting range (lowest offset on ties)"
        u = (got - BASE) // A
        self.set(u, n, got)
        self.blocks[got] = n * A

    @rule(u=units, size=sizes)
    def allocate_at(self, u, size):
        n = -(-size // A)
        if self.all_are(u, n, FREE):
            assert self.heap.allocate_at(self.addr(u), size) == self.addr(u)
            self.set(u, n, self.addr(u))
            self.blocks[self.addr(u)] = n * A
        else:
            expect_error(self.heap, self.heap.allocate_at, self.addr(u), size)

    @precondition(lambda self: self.blocks)
    @rule(data=st.data())
    def free(self, data):
        off = data.draw(st.sampled_from(sorted(self.blocks)))
        size = self.blocks.pop(off)
        assert self.heap.free(off) == size
        self.set((off - BASE) // A, size // A, FREE)
        expect_error(self.heap, self.heap.free, off)           # double free

    @rule(u=units, shift=st.sampled_from([0, 1, A // 2]))
    def free_unknown(self, u, shift):
        off = self.addr(u) + shift
        if shift == 0 and off in self.blocks:
            return
        expect_error(self.heap, self.heap.free, off)

    @rule(u=units, n=lengths, off_by=st.integers(1, A - 1))
    def misaligned_calls(self, u, n, off_by):
        expect_error(self.heap, self.heap.insert_free, self.addr(u) + off_by, n * A)
        expect_error(self.heap, self.heap.insert_free, self.addr(u), n * A + off_by)
        expect_error(self.heap, self.heap.remove_free, self.addr(u) + off_by, n * A)
        expect_error(self.heap, self.heap.allocate_at, self.addr(u) + off_by, n * A)

    @rule(start=st.integers(-A, UNITS * A + A), length=st.integers(0, 10 * A))
    def free_bytes_in_any_range(self, start, length):
        lo, hi = BASE + start, BASE + start + length
        want = sum(max(0, min(hi, o + s) - max(lo, o)) for o, s in self.model_free_ranges())
        assert self.heap.free_bytes_in(lo, hi) == want
        if length:
            assert self.heap.is_free(lo, length) == (want == length)

    # invariants, checked after every step
    @invariant()
    def matches_model(self):
        h = self.heap
        h.check_invariants()
        free = self.model_free_ranges()
        assert h.free_ranges() == free                 # also: coalesced, since the model's runs are maximal
        assert h.live_blocks() == sorted(self.blocks.items())
        assert all(o % A == 0 and s % A == 0 for o, s in free + h.live_blocks())
        assert h.free_bytes() == sum(s for _, s in free)
        assert h.live_bytes() == sum(self.blocks.values())
        assert h.free_bytes() + h.live_bytes() == h.managed_bytes() == self.managed
        assert h.largest_free() == max((s for _, s in free), default=0)
        for p in range(0, UNITS, PAGE_UNITS):
            page_free = sum(s is FREE for s in self.model[p:p + PAGE_UNITS]) * A
            assert h.free_bytes_in(self.addr(p), self.addr(p + PAGE_UNITS)) == page_free
        for off, size in self.blocks.items():
            assert h.block_size(off) == size


class NativeHeapMachine(HeapMachine):
    def new_heap(self, base, span):
        return native_heap_class()(base, span)


for machine in (HeapMachine, NativeHeapMachine):
    machine.TestCase.settings = settings(
        max_examples=150, stateful_step_count=40, deadline=None,
        suppress_health_check=[HealthCheck.too_slow])
TestHeapMachine = HeapMachine.TestCase
TestNativeHeapMachine = NativeHeapMachine.TestCase


# ---------------------------------------------------------------- batches
def _single(h, takes, frees):
    for off, size in takes:
        h.allocate_at(off, size)
    for off in frees:
        h.free(off)


@pytest.mark.parametrize("seed", range(60))
def test_batches_equal_one_call_per_block(Heap, seed):
    """allocate_many_at / free_many end exactly where the single calls do, with the bulk path forced."""
    import random
    rng = random.Random(seed)

    def build():
        h = Heap(BASE, 64 * A)
        h.insert_free(BASE, 64 * A)
        rng2 = random.Random(seed)
        live = [o for o in (h.allocate(rng2.randint(1, 4) * A) for _ in range(rng2.randint(0, 20))) if o is not None]
        for off in rng2.sample(live, rng2.randint(0, len(live))):
            h.free(off)
            live.remove(off)
        return h, live

    a, live = build()
    b, _ = build()
    takes = []
    for start, length in a.free_ranges():
        cursor = start
        while cursor < start + length and rng.random() < 0.7:
            size = rng.randint(1, 3) * A
            if cursor + size > start + length:
                break
            takes.append((cursor, size))
            cursor += size + rng.randint(0, 2) * A
    frees = rng.sample(live, rng.randint(0, len(live)))
    _single(a, takes, frees)
    force_path(b, True)  # the one-pass path even for small batches
    b.allocate_many_at(takes)
    b.free_many(frees)
    assert snapshot(a) == snapshot(b)
    b.check_invariants()
    for bulk in (True, False):  # both in one call, as a compaction wave does
        c, _ = build()
        force_path(c, bulk)
        c.exchange(frees, takes)
        assert snapshot(a) == snapshot(c)
        c.check_invariants()


@pytest.mark.parametrize("bulk", [True, False])
def test_batch_misuse_raises_and_changes_nothing(Heap, bulk):
    h = Heap(BASE, 64 * A)
    h.insert_free(BASE, 64 * A)
    x = h.allocate(4 * A)
    y = h.allocate(4 * A)
    force_path(h, bulk)
    expect_error(h, h.allocate_many_at, [(BASE + 10 * A, A), (x, A)])             # one is live
    expect_error(h, h.allocate_many_at, [(BASE + 10 * A, 2 * A), (BASE + 11 * A, A)])  # they overlap
    expect_error(h, h.allocate_many_at, [(BASE + 10 * A, A), (BASE + 64 * A, A)])  # outside the span
    expect_error(h, h.allocate_many_at, [(BASE + 10 * A + 1, A)])                  # misaligned
    expect_error(h, h.free_many, [x, x])                                          # twice
    expect_error(h, h.free_many, [x, BASE + 20 * A])                              # not live
    expect_error(h, h.exchange, [x], [(x, A)])                                     # takes what it frees
    expect_error(h, h.exchange, [BASE + 20 * A], [(BASE + 10 * A, A)])             # frees what is not live
    expect_error(h, h.exchange, [x], [(BASE + 10 * A, A), (BASE + 10 * A, A)])     # takes one range twice
    h.free_many([x, y])
    assert h.free_ranges() == [(BASE, 64 * A)] and h.live_blocks() == []
