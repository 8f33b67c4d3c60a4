"""The native heap (defrag/native/heap.h) against its Python model (tests/cpu/heap_model.py), call for call.

Every step runs one call on both and asserts the same result or the same
HeapError with the same message, then the same free ranges, live blocks and
counters, and both heaps' invariants. Batches are compared with the model's
one-call-per-range path for messages: the model's bulk path may name a
different range of the same bad batch, and the native heap has one path.
"""
import copy
import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from defrag.errors import HeapError

from .heap_model import Heap as ModelHeap


def native_heap_class():
    """The native Heap class, from defrag's one native module."""
    from defrag.native import load_module

    return load_module().Heap


def snapshot(h):
    return (h.free_ranges(), h.live_blocks(), h.free_bytes(), h.live_bytes(), h.largest_free(), h.managed_bytes())


def outcome(fn, *args):
    """What a call did: ("ok", its result) or ("HeapError", the message)."""
    try:
        return "ok", fn(*args)
    except HeapError as e:
        return "HeapError", str(e)


# (base, alignment, span in alignment units): a non-zero base, a small alignment, a negative base
CONFIGS = [(1 << 21, 512, 48), (0, 64, 40), (-64 * 16, 64, 32)]
units = st.integers(-2, 50)                          # some out of every span on purpose
shifts = st.sampled_from([0, 0, 0, 0, 1, 32])        # 1 and 32 misalign (alignments are 64 and 512)
lengths = st.integers(1, 12)


class DifferentialMachine(RuleBasedStateMachine):
    @initialize(config=st.sampled_from(CONFIGS), fill=st.sampled_from(["none", "free", "blocks"]),
                sizes=st.lists(st.integers(1, 3 * 512), max_size=16))
    def build(self, config, fill, sizes):
        """A new heap: no free space, or all of it free, or then some blocks carved (so steps start busy)."""
        self.base, self.a, self.units = config
        self.model = ModelHeap(self.base, self.units * self.a, self.a)
        self.native = native_heap_class()(self.base, self.units * self.a, self.a)
        if fill != "none":
            self.same("insert_free", self.base, self.units * self.a)
        if fill == "blocks":
            for size in sizes:
                self.same("allocate", size)

    def addr(self, u, shift=0):
        return self.base + u * self.a + shift

    def same(self, name, *args):
        want = outcome(getattr(self.model, name), *args)
        got = outcome(getattr(self.native, name), *args)
        assert got == want, f"{name}{args}: native {got}, model {want}"
        return got

    def same_batch(self, name, *args, native_name=None, native_args=None):
        """A batch call on both; the message as the model's one-call-per-range path words it.

        `native_name`/`native_args`: the native entry and its arguments when they differ from the model's.
        """
        one_by_one = copy.deepcopy(self.model)
        one_by_one._bulk_pays = lambda n: False
        reference = outcome(getattr(one_by_one, name), *args)
        want = outcome(getattr(self.model, name), *args)
        got = outcome(getattr(self.native, native_name or name), *(args if native_args is None else native_args))
        assert got[0] == want[0], f"{name}{args}: native {got}, model {want}"
        assert got == reference, f"{name}{args}: native {got}, model (one call per range) {reference}"
        assert snapshot(one_by_one) == snapshot(self.model)

    def draw_inside(self, data):
        """An aligned (offset, size) inside one free range, now and then one unit too long; or None."""
        free = self.model.free_ranges()
        if not free:
            return None
        start, length = data.draw(st.sampled_from(free))
        k = data.draw(st.integers(0, length // self.a - 1))
        n = data.draw(st.integers(1, length // self.a - k)) + (data.draw(st.integers(0, 5)) == 0)
        return start + k * self.a, n * self.a

    def draw_point(self, data):
        """An offset where something starts or ends: free ranges, live blocks, the span's ends."""
        points = [self.base, self.base + self.units * self.a]
        for o, s in self.model.free_ranges() + self.model.live_blocks():
            points += [o, o + s]
        return data.draw(st.sampled_from(points)) + data.draw(st.sampled_from([0, 0, -self.a, self.a, 1]))

    def draw_frees(self, data):
        live = [o for o, _ in self.model.live_blocks()]
        frees = data.draw(st.lists(st.sampled_from(live), unique=True)) if live else []
        extra = data.draw(st.integers(0, 5))
        if extra == 0:  # not a live block (or by chance one)
            frees.append(self.addr(data.draw(units), data.draw(shifts)))
        elif extra == 1 and frees:  # freed twice
            frees.append(frees[0])
        return data.draw(st.permutations(frees))

    def draw_takes(self, data):
        """Ranges carved from the free ranges (some running past their range), unrounded sizes, a wild one."""
        takes = []
        for start, length in self.model.free_ranges():
            cursor = start
            while cursor < start + length and data.draw(st.booleans()):
                n = data.draw(st.integers(1, 4))
                takes.append((cursor, n * self.a - data.draw(st.sampled_from([0, 0, 0, 1, self.a - 1]))))
                cursor += n * self.a + data.draw(st.integers(0, 2)) * self.a
        if data.draw(st.integers(0, 3)) == 0:  # maybe live, overlapping, outside, misaligned or not positive
            takes.append((self.addr(data.draw(units), data.draw(shifts)), data.draw(st.integers(-self.a, 4 * self.a))))
        return data.draw(st.permutations(takes))

    # -- free space

    @rule(u=units, n=lengths, shift=shifts, size_shift=shifts)
    def insert_free(self, u, n, shift, size_shift):
        self.same("insert_free", self.addr(u, shift), n * self.a + size_shift)

    @rule(data=st.data())
    def insert_free_where_unmanaged(self, data):
        """Fill a gap between managed extents (the random one mostly hits managed space)."""
        managed = sorted(self.model.free_ranges() + self.model.live_blocks())
        ends = [self.base] + [o + s for o, s in managed]
        starts = [o for o, _ in managed] + [self.base + self.units * self.a]
        gaps = [(e, s - e) for e, s in zip(ends, starts) if s > e]
        if gaps:
            start, length = data.draw(st.sampled_from(gaps))
            k = data.draw(st.integers(0, length // self.a - 1))
            n = data.draw(st.integers(1, length // self.a - k))
            self.same("insert_free", start + k * self.a, n * self.a)

    @rule(u=units, n=lengths, shift=shifts)
    def remove_free(self, u, n, shift):
        self.same("remove_free", self.addr(u, shift), n * self.a)

    @rule(data=st.data())
    def remove_free_inside(self, data):
        if (inside := self.draw_inside(data)) is not None:
            self.same("remove_free", *inside)

    # -- blocks

    @rule(size=st.one_of(st.integers(1, 6000), st.integers(-600, 0), st.sampled_from([64, 512, 1024, 1536])))
    def allocate(self, size):
        self.same("allocate", size)

    @rule(u=units, shift=shifts, size=st.integers(-64, 4000))
    def allocate_at(self, u, shift, size):
        self.same("allocate_at", self.addr(u, shift), size)

    @rule(data=st.data(), trim=st.sampled_from([0, 0, 1, 63]))
    def allocate_at_inside(self, data, trim):
        if (inside := self.draw_inside(data)) is not None:
            offset, size = inside
            self.same("allocate_at", offset, size - trim)  # an unrounded size rounds back up

    @rule(data=st.data())
    def free(self, data):
        live = [o for o, _ in self.model.live_blocks()]
        if live and data.draw(st.integers(0, 4)):
            offset = data.draw(st.sampled_from(live))
        else:
            offset = self.addr(data.draw(units), data.draw(shifts))
        self.same("free", offset)

    # -- batches

    @rule(data=st.data())
    def exchange(self, data):
        self.same_batch("exchange", self.draw_frees(data), self.draw_takes(data))

    @rule(data=st.data())
    def exchange_lists(self, data):
        """The compaction's entry: the takes as two lists, the same outcome as the model's exchange."""
        frees, takes = self.draw_frees(data), self.draw_takes(data)
        self.same_batch("exchange", frees, takes, native_name="exchange_lists",
                        native_args=(frees, [o for o, _ in takes], [n for _, n in takes]))

    @rule(data=st.data())
    def free_many(self, data):
        self.same_batch("free_many", self.draw_frees(data))

    @rule(data=st.data())
    def allocate_many_at(self, data):
        self.same_batch("allocate_many_at", self.draw_takes(data))

    # -- queries

    @rule(u=units, shift=shifts, length=st.integers(-64, 12 * 512))
    def queries(self, u, shift, length):
        at = self.addr(u, shift)
        self.same("free_bytes_in", at, at + length)
        self.same("is_free", at, length)
        self.same("free_range_ending_at", at)
        self.same("free_range_starting_at", at)
        self.same("block_size", at)
        self.same("round_size", length)

    @rule(data=st.data(), length=st.integers(1, 8 * 512))
    def queries_at_edges(self, data, length):
        at = self.draw_point(data)
        self.same("free_range_ending_at", at)
        self.same("free_range_starting_at", at)
        self.same("block_size", at)
        self.same("is_free", at, length)
        self.same("free_bytes_in", at, at + length)
        self.same("free_bytes_in", at - length, at)

    @invariant()
    def agree(self):
        if not hasattr(self, "model"):
            return
        self.model.check_invariants()
        self.native.check_invariants()
        assert snapshot(self.native) == snapshot(self.model)
        assert [self.native.block_size(o) for o, _ in self.model.live_blocks()] == [s for _, s in self.model.live_blocks()]
        page = 4 * self.a
        for start in range(self.base, self.base + self.units * self.a, page):
            assert self.native.free_bytes_in(start, start + page) == self.model.free_bytes_in(start, start + page)


DifferentialMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestDifferential = DifferentialMachine.TestCase


# -- a long walk over a large heap (deep trees, many blocks), seeds from hypothesis ----------

@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_long_random_walk_agrees(seed):
    rng = random.Random(seed)
    A = 512
    model, native = ModelHeap(0, 1 << 30), native_heap_class()(0, 1 << 30)
    for h in (model, native):
        h.insert_free(0, 1 << 29)
    live = []
    for step in range(4000):
        r = rng.random()
        if r < 0.4:
            size = rng.randrange(1, 1 << 16)
            got = native.allocate(size)
            assert got == model.allocate(size)
            if got is not None:
                live.append(got)
        elif r < 0.75 and live:
            offset = live.pop(rng.randrange(len(live)))
            assert native.free(offset) == model.free(offset)
        elif r < 0.8 and len(live) > 10:
            batch = [live.pop(rng.randrange(len(live))) for _ in range(rng.randrange(1, 10))]
            native.free_many(batch)
            model.free_many(batch)
        elif r < 0.85:
            free = model.free_ranges()
            takes = []
            for start, length in rng.sample(free, min(len(free), 12)):
                size = rng.randrange(1, length // A + 1) * A
                takes.append((start + rng.randrange(0, (length - size) // A + 1) * A, size))
            frees = [live.pop(rng.randrange(len(live))) for _ in range(min(len(live), rng.randrange(0, 12)))]
            native.exchange(frees, takes)
            model.exchange(frees, takes)
            live += [o for o, _ in takes]
        elif r < 0.9:  # map more, or unmap a free stretch
            offset = rng.randrange(0, 1 << 21) * A
            size = rng.randrange(1, 64) * A
            assert outcome(native.insert_free, offset, size) == outcome(model.insert_free, offset, size)
            free = model.free_ranges()
            if free:
                start, length = rng.choice(free)
                size = rng.randrange(1, length // A + 1) * A
                native.remove_free(start, size)
                model.remove_free(start, size)
        else:
            start = rng.randrange(0, 1 << 30)
            end = start + rng.randrange(0, 1 << 22)
            assert native.free_bytes_in(start, end) == model.free_bytes_in(start, end)
            assert native.largest_free() == model.largest_free()
        if step % 500 == 0:
            assert snapshot(native) == snapshot(model)
    assert snapshot(native) == snapshot(model)
    native.check_invariants()


# -- construction and the Python face ------------------------------------------------------

@pytest.mark.parametrize("args", [
    (0, 512), (1 << 21, 8 * 512), (0, 512, 64), (-1024, 2048, 512), (0, 0), (0, -512), (1, 512), (0, 513),
    (0, 512, 0), (0, 512, -8), (-1, 512), (0, 96, 3),
])
def test_construction_matches_model(args):
    native = native_heap_class()
    assert outcome(native, *args)[0] == outcome(ModelHeap, *args)[0]
    try:
        ModelHeap(*args)
    except HeapError as e:
        with pytest.raises(HeapError) as got:
            native(*args)
        assert str(got.value) == str(e)
        return
    h, m = native(*args), ModelHeap(*args)
    assert (h.base, h.span, h.alignment) == (m.base, m.span, m.alignment)


def test_keywords_and_defaults():
    Heap = native_heap_class()
    h = Heap(base=0, span=8 * 512)
    assert h.alignment == 512
    h.insert_free(offset=0, size=8 * 512)
    assert h.allocate(size=1) == 0 and h.allocate_at(offset=1024, size=512) == 1024
    assert h.block_size(offset=1024) == 512 and h.free(offset=1024) == 512
    h.exchange(frees=[0], takes=[(2048, 512)])
    h.free_many(offsets=[2048])
    h.allocate_many_at(ranges=[(0, 512)])
    assert h.free_bytes_in(start=0, end=1024) == 512 and h.is_free(offset=512, size=512)
    assert h.free_range_ending_at(end=8 * 512) == (512, 7 * 512)
    assert h.free_range_starting_at(start=512) == (512, 7 * 512) and h.round_size(size=5) == 512


def test_floats_raise_type_error_never_truncate():
    h = native_heap_class()(0, 16 * 512)
    h.insert_free(0, 16 * 512)
    h.allocate(512)
    calls = [
        (h.allocate, 512.0), (h.allocate_at, 1024.0, 512), (h.allocate_at, 1024, 512.0), (h.free, 0.0),
        (h.insert_free, 0.0, 512), (h.remove_free, 1024, 512.0), (h.block_size, 0.0), (h.round_size, 1.5),
        (h.is_free, 1024, 512.0), (h.free_bytes_in, 0.0, 512), (h.free_range_ending_at, 8192.0),
        (h.free_range_starting_at, 512.0), (h.free_many, [0.0]), (h.allocate_many_at, [(1024, 512.0)]),
        (h.exchange, [0.0], []), (h.exchange, [], [(1024.0, 512)]),
    ]
    before = snapshot(h)
    for fn, *args in calls:
        with pytest.raises(TypeError):
            fn(*args)
    with pytest.raises(TypeError):
        type(h)(0.0, 512)
    assert snapshot(h) == before


def test_ints_of_any_kind_and_iterables():
    np = pytest.importorskip("numpy")
    h = native_heap_class()(0, 16 * 512)
    h.insert_free(np.int64(0), np.int32(16 * 512))
    assert h.allocate(np.uint16(100)) == 0 and h.allocate(True) == 512
    h.allocate_many_at(iter([[2048, 512], (np.int64(4096), 512)]))       # any iterable of 2-item iterables
    h.exchange((o for o in [2048, 4096]), iter([(3072, 1024)]))
    h.free_many({0, 512})
    assert h.live_blocks() == [(3072, 1024)]
    with pytest.raises(ValueError, match="not enough values"):
        h.allocate_many_at([(0,)])
    with pytest.raises(OverflowError):
        h.allocate(1 << 70)
    h.check_invariants()


def test_heap_error_is_the_python_class():
    h = native_heap_class()(0, 8 * 512)
    with pytest.raises(HeapError, match=r"^no live block at offset 7 \(unknown or already freed\)$") as e:
        h.free(7)
    assert type(e.value) is HeapError and isinstance(e.value, ValueError)
    with pytest.raises(HeapError, match=r"^range \(0, 4608\) outside \[0, 4096\)$"):
        h.insert_free(0, 8 * 512 + 512)


def test_batch_errors_name_the_first_bad_range_in_order():
    """The native heap words a bad batch as one `allocate_at` per range would (the model's small-batch path)."""
    A = 512
    for Heap in (native_heap_class(), ModelHeap):
        h = Heap(0, 16 * A)
        h.insert_free(0, 4 * A)
        with pytest.raises(HeapError, match=r"^range \(0, 4096\) is not entirely free$"):
            h.allocate_many_at([(A, A), (0, 8 * A)])
        with pytest.raises(HeapError, match=r"^range \(512, 512\) is not entirely free$"):
            h.allocate_many_at([(0, 2 * A), (A, A)])
        with pytest.raises(HeapError, match=r"^size must be positive, got 0$"):
            h.allocate_many_at([(0, A), (A, 0)])
        with pytest.raises(HeapError, match=r"^block at offset 5 freed twice$"):
            h.exchange([5, 5], [(0, 0)])
        assert h.free_ranges() == [(0, 4 * A)] and h.live_blocks() == []


def test_exchange_lists_words_a_bad_batch_as_exchange():
    """The two-list entry checks and words a batch as `exchange` does: the first bad range in order,
    a range that is not free before a later one outside the span (the model's bulk path would name the
    later one; CI once drew this)."""
    A = 512
    h = native_heap_class()(0, 16 * A)
    h.insert_free(0, 4 * A)
    blocks = [h.allocate(A) for _ in range(3)]
    before = snapshot(h)
    message = r"^range \(0, 4096\) is not entirely free$"
    with pytest.raises(HeapError, match=message):
        h.exchange(blocks, [(0, 8 * A), (16 * A, 1)])
    with pytest.raises(HeapError, match=message):
        h.exchange_lists(blocks, [0, 16 * A], [8 * A, 1])
    with pytest.raises(ValueError, match="differ in length"):
        h.exchange_lists(blocks, [0], [])
    assert snapshot(h) == before


@pytest.mark.parametrize("seed", range(4))
def test_large_exchanges_agree_with_the_model_size_index_included(seed):
    """Batches of a compaction wave's size (hundreds of takes and frees) rebuild the native free ranges in one
    merge pass and leave the size index to be rebuilt at its next read: free ranges, live blocks, best
    fit, largest_free and the invariants then agree with the model's, takes splitting ranges included."""
    rng = random.Random(seed)
    A, units = 512, 4096
    native, model = native_heap_class()(0, units * A, A), ModelHeap(0, units * A, A)
    for h in (native, model):
        h.insert_free(0, units * A)
    live = []
    for _ in range(1200):
        n = rng.choice([1, 1, 2, 3, 8]) * A - rng.randrange(A)
        got = native.allocate(n)
        assert got == model.allocate(n)
        if got is not None:
            live.append(got)
    for step in range(6):
        frees = rng.sample(live, len(live) // 3)
        takes, cursor = [], 0
        for start, length in model.free_ranges():  # a wave's destinations: low ends, middles, two in one range
            if rng.random() < 0.6 and len(takes) < 400:
                size = A * rng.randint(1, max(1, min(4, length // A)))
                at = start if rng.random() < 0.5 else start + A * rng.randrange(0, (length - size) // A + 1)
                takes.append((at, size))
                if at + size + 2 * A <= start + length and rng.random() < 0.3:  # another, after a gap
                    takes.append((at + size + A, A * rng.randint(1, (start + length - at - size - A) // A)))
        assert outcome(native.exchange_lists, frees, [o for o, _ in takes], [n for _, n in takes]) == \
            outcome(model.exchange, frees, takes)
        live = [o for o in live if o not in set(frees)] + [o for o, _ in takes]
        assert snapshot(native) == snapshot(model)  # largest_free reads the rebuilt index
        for n in (A, 3 * A, 17 * A):  # best fit over the rebuilt index
            got = native.allocate(n)
            assert got == model.allocate(n)
            if got is not None:
                live.append(got)
        native.check_invariants()
        model.check_invariants()
