"""The Python heap: the reference model of the native heap (defrag/native/heap.h), for tests only.

Best-fit allocator over integer virtual offsets: blocks, split, coalesce. The
native class must match it call for call (results, errors and their messages,
free ranges, live blocks, counters); tests/cpu/test_native_heap.py checks that,
and tests/cpu/test_heap.py runs against both.
"""
from __future__ import annotations

from bisect import bisect_right
from operator import add, eq, index, itemgetter

from sortedcontainers import SortedDict, SortedList

from defrag.errors import HeapError
from defrag.units import ALIGNMENT

__all__ = ["ALIGNMENT", "Heap", "HeapError"]


class Heap:
    """Best-fit free-range allocator over [base, base+span).

    Guarantees: free ranges are kept sorted, disjoint, aligned and coalesced (no
    two touch); live blocks never overlap each other or free space; every
    failing call raises HeapError and leaves the heap unchanged. `allocate`,
    `allocate_at`, `insert_free` and `remove_free` are O(log n); `free` is
    O(log n) for the free ranges and O(1) for the live blocks (a plain dict:
    `live_blocks()` sorts them).
    Does not: touch memory, know which pages are mapped, or move blocks.
    A new heap has no free space until `insert_free` is called.
    """

    def __init__(self, base: int, span: int, alignment: int = ALIGNMENT):
        if alignment <= 0:
            raise HeapError(f"alignment must be positive, got {alignment}")
        if base % alignment or span <= 0 or span % alignment:
            raise HeapError(f"base {base} and span {span} must be positive multiples of {alignment}")
        self.base, self.span, self.alignment = base, span, alignment
        self._free = SortedDict()       # offset -> size of each free range
        self._by_size = SortedList()    # (size, offset) of each free range, for best fit
        # offset -> rounded size of each live block: a plain dict (allocation and release need no
        # order); what `insert_free` must not overlap is kept as `_managed` instead.
        self._live: dict[int, int] = {}
        # Coalesced extents of everything inserted and not removed (free space and live blocks):
        # offset -> size. Only `insert_free` and `remove_free` change it (mapping and unmapping).
        self._managed = SortedDict()
        self._free_bytes = 0
        self._live_bytes = 0

    # -- sizes and validation --------------------------------------------------

    def round_size(self, size: int) -> int:
        """Size rounded up to the alignment; HeapError if size is not positive."""
        if index(size) <= 0:  # index(): TypeError for floats, which would round silently
            raise HeapError(f"size must be positive, got {size}")
        return -(-size // self.alignment) * self.alignment

    def _check_range(self, offset: int, size: int) -> None:
        if index(size) <= 0 or index(offset) % self.alignment or size % self.alignment:
            raise HeapError(f"range ({offset}, {size}) must be a positive size aligned to {self.alignment}")
        if offset < self.base or offset + size > self.base + self.span:
            raise HeapError(f"range ({offset}, {size}) outside [{self.base}, {self.base + self.span})")

    @staticmethod
    def _overlapping(ranges: SortedDict, offset: int, end: int) -> tuple[int, int] | None:
        """The last range in `ranges` starting before `end` if it overlaps [offset, end)."""
        i = ranges.bisect_left(end) - 1
        if i >= 0:
            start, size = ranges.peekitem(i)
            if start + size > offset:
                return start, size
        return None

    def _containing_free(self, offset: int, size: int) -> tuple[int, int] | None:
        """The free range holding all of [offset, offset+size), or None."""
        i = self._free.bisect_right(offset) - 1
        if i >= 0:
            start, length = self._free.peekitem(i)
            if start + length >= offset + size:
                return start, length
        return None

    # -- free-range primitives (no validation) -----------------------------------

    def _add_range(self, offset: int, size: int) -> None:
        self._free[offset] = size
        self._by_size.add((size, offset))
        self._free_bytes += size

    def _drop_range(self, offset: int) -> int:
        size = self._free.pop(offset)
        self._by_size.remove((size, offset))
        self._free_bytes -= size
        return size

    def _add_coalesced(self, offset: int, size: int) -> None:
        """Add a free range, merging with a free neighbour on either side."""
        end = offset + size
        if end in self._free:
            size += self._drop_range(end)
        i = self._free.bisect_left(offset) - 1
        if i >= 0:
            left, left_size = self._free.peekitem(i)
            if left + left_size == offset:
                self._drop_range(left)
                offset, size = left, size + left_size
        self._add_range(offset, size)

    def _carve(self, start: int, length: int, offset: int, size: int) -> None:
        """Take [offset, offset+size) out of free range (start, length), keeping the remnants."""
        self._drop_range(start)
        if offset > start:
            self._add_range(start, offset - start)
        if offset + size < start + length:
            self._add_range(offset + size, start + length - offset - size)

    # -- free space: the pool maps and unmaps pages ---------------------------------

    def insert_free(self, offset: int, size: int) -> None:
        """Add [offset, offset+size) as free space, coalescing with free neighbours.

        HeapError if misaligned, outside the span, or overlapping free space or a
        live block. Does not check that the range is backed by mapped pages.
        """
        self._check_range(offset, size)
        end = offset + size
        if (hit := self._overlapping(self._free, offset, end)) is not None:
            raise HeapError(f"range ({offset}, {size}) overlaps free range {hit}")
        if self._overlapping(self._managed, offset, end) is not None:  # then a live block (error path: a scan)
            hit = min((o, s) for o, s in self._live.items() if o < end and o + s > offset)
            raise HeapError(f"range ({offset}, {size}) overlaps live block {hit}")
        self._add_coalesced(offset, size)
        # Managed extents: coalesce with the extents that touch it on either side.
        managed = self._managed
        if end in managed:
            size += managed.pop(end)
        i = managed.bisect_left(offset) - 1
        if i >= 0:
            left, left_size = managed.peekitem(i)
            if left + left_size == offset:
                offset, size = left, size + left_size
        managed[offset] = size

    def remove_free(self, offset: int, size: int) -> None:
        """Take [offset, offset+size), which must be entirely free, out of the free set.

        Splits the free range holding it. HeapError if misaligned or if any byte
        is live or was never inserted.
        """
        self._check_range(offset, size)
        if (hit := self._containing_free(offset, size)) is None:
            raise HeapError(f"range ({offset}, {size}) is not entirely free")
        self._carve(*hit, offset, size)
        # The managed extent holding it (free space is managed) loses it too.
        managed = self._managed
        start, length = managed.peekitem(managed.bisect_right(offset) - 1)
        del managed[start]
        if offset > start:
            managed[start] = offset - start
        if offset + size < start + length:
            managed[offset + size] = start + length - offset - size

    # -- blocks ---------------------------------------------------------------------

    def allocate(self, size: int) -> int | None:
        """Carve a block of `size` rounded up to the alignment; returns its offset or None.

        Best fit: the smallest free range that fits, the lowest offset among equal
        sizes; the block takes the low end of that range. None when no single free
        range fits (free space may still add up to more). O(log n).
        """
        size = self.round_size(size)
        i = self._by_size.bisect_left((size,))
        if i == len(self._by_size):
            return None
        length, start = self._by_size[i]
        self._carve(start, length, start, size)
        self._live[start] = size
        self._live_bytes += size
        return start

    def allocate_at(self, offset: int, size: int) -> int:
        """Carve a block at exactly `offset`; returns `offset`.

        HeapError if `offset` is misaligned or [offset, offset+rounded size) is not
        inside one free range. Used to place a block where a plan says it goes.
        """
        size = self.round_size(size)
        self._check_range(offset, size)
        if (hit := self._containing_free(offset, size)) is None:
            raise HeapError(f"range ({offset}, {size}) is not entirely free")
        self._carve(*hit, offset, size)
        self._live[offset] = size
        self._live_bytes += size
        return offset

    def free(self, offset: int) -> int:
        """Free the live block at `offset`, coalescing; returns its rounded size.

        HeapError if no live block starts at `offset` (unknown or double free).
        """
        size = self._live.pop(offset, None)
        if size is None:
            raise HeapError(f"no live block at offset {offset} (unknown or already freed)")
        self._live_bytes -= size
        self._add_coalesced(offset, size)
        return size

    # -- batches: one pass over the free ranges instead of one update per block --------

    def _bulk_pays(self, n: int) -> bool:
        """Whether rebuilding the free-range index beats `n` single updates (each O(log n))."""
        return n >= 8 and 8 * n >= len(self._free)

    def _reset_free(self, ranges: list[tuple[int, int]]) -> None:
        """Rebuild the free-range index from sorted, disjoint, coalesced (offset, size) pairs."""
        self._free = SortedDict(ranges)
        self._by_size = SortedList(zip(map(_second, ranges), map(_first, ranges)))
        self._free_bytes = sum(map(_second, ranges))

    def allocate_many_at(self, ranges) -> None:
        """`allocate_at` for every (offset, size) of `ranges`, all or nothing.

        HeapError (nothing changed) if one is misaligned, not inside a free
        range, or overlaps another. O(n + free ranges) when there are many;
        else one `allocate_at` each.
        """
        self.exchange((), ranges)

    def free_many(self, offsets) -> None:
        """`free` every live block at `offsets`, coalescing, all or nothing (HeapError: nothing changed).

        O(n + free ranges) when there are many; else one `free` each.
        """
        self.exchange(offsets, ())

    def exchange(self, frees, takes) -> None:
        """`allocate_many_at(takes)` then `free_many(frees)`, all or nothing, in one pass over the free
        ranges (a compaction wave: its destinations taken, its old ranges given back).

        Every range of `takes` must be free before the frees (none may use what
        `frees` gives back). HeapError, with nothing changed, on any misuse
        either call would refuse. O(n + free ranges) when there are many; else
        one `allocate_at` and `free` each.
        """
        frees = self._checked_frees(frees)
        todo = self._checked_takes(takes)
        if not self._bulk_pays(len(todo) + len(frees)):
            done = []
            try:
                for offset, size in todo:
                    done.append(self.allocate_at(offset, size))
            except HeapError:
                for offset in done:
                    self.free(offset)
                raise
            for offset in frees:  # live, and not among the takes (each was free): cannot fail
                self.free(offset)
            return
        remaining = self._free_after_taking(todo) if todo else list(dict.items(self._free))
        live = self._live
        freed = list(zip(frees, map(live.pop, frees)))
        live.update(todo)
        self._live_bytes += sum(map(_second, todo)) - sum(map(_second, freed))
        if freed:
            # Freed blocks and free ranges are disjoint, so their offsets differ:
            # one sort (in C) orders them, one pass coalesces.
            remaining = _coalesced(sorted(freed + remaining))
        self._reset_free(remaining)

    def _checked_frees(self, offsets) -> list[int]:
        """`offsets` sorted, each a distinct live block (else HeapError)."""
        offsets = sorted(offsets)
        if not offsets:
            return offsets
        if len(set(offsets)) != len(offsets):
            twice = next(a for a, b in zip(offsets, offsets[1:]) if a == b)
            raise HeapError(f"block at offset {twice} freed twice")
        live = self._live
        if not all(map(live.__contains__, offsets)):
            missing = next(o for o in offsets if o not in live)
            raise HeapError(f"no live block at offset {missing} (unknown or already freed)")
        return offsets

    def _checked_takes(self, ranges) -> list[tuple[int, int]]:
        """(offset, size) ranges sorted, sizes rounded (HeapError for a size that is not positive)."""
        todo = sorted(ranges)
        sizes = list(map(_second, todo))
        align = self.alignment
        # Sizes the caller already rounded (a compaction's are block sizes) are checked in C;
        # anything else goes through round_size, one by one.
        if sizes and not (set(map(type, sizes)) == {int} and min(sizes) > 0 and not any(map(align.__rmod__, sizes))):
            todo = sorted((offset, self.round_size(size)) for offset, size in todo)
        return todo

    def _free_after_taking(self, todo: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The free ranges left once the sorted `todo` ranges are taken; HeapError (nothing changed)
        if one is misaligned, outside the span, not inside a free range, or overlaps another.

        O(log n) per range taken plus one copy of the free ranges in C: ranges no take touches are
        copied as they are. Types, alignment and bounds are checked for the whole batch in C first.
        """
        offsets = list(map(_first, todo))
        sizes = list(map(_second, todo))
        align = self.alignment
        if (set(map(type, offsets)) != {int} or any(map(align.__rmod__, offsets)) or offsets[0] < self.base
                or max(map(add, offsets, sizes)) > self.base + self.span):
            for offset, size in todo:
                self._check_range(offset, size)  # raises, naming the first bad range
        starts = sorted(dict.keys(self._free))  # in C (the SortedDict's own key view yields in Python)
        lengths = list(map(self._free.__getitem__, starts))
        out = []
        copied = 0  # free ranges before this index are in `out` or replaced by their remnants
        j, n = 0, len(todo)
        while j < n:
            i = bisect_right(starts, offsets[j]) - 1
            if i < copied:  # before the range the previous take ended in (overlaps it), or no range
                raise HeapError(f"range {todo[j]} is not entirely free")
            out += zip(starts[copied:i], lengths[copied:i])
            cursor = starts[i]
            end = cursor + lengths[i]
            while j < n and offsets[j] < end:  # every take inside this free range, in order
                offset = offsets[j]
                if offset < cursor:  # overlaps the previous take
                    raise HeapError(f"range {todo[j]} is not entirely free")
                if offset > cursor:
                    out.append((cursor, offset - cursor))
                cursor = offset + sizes[j]
                j += 1
            if cursor > end:  # the last take runs past its free range
                raise HeapError(f"range {todo[j - 1]} is not entirely free")
            if cursor < end:
                out.append((cursor, end - cursor))
            copied = i + 1
        out += zip(starts[copied:], lengths[copied:])
        return out

    def block_size(self, offset: int) -> int:
        """Rounded size of the live block at `offset`; HeapError if there is none."""
        if offset not in self._live:
            raise HeapError(f"no live block at offset {offset}")
        return self._live[offset]

    # -- queries --------------------------------------------------------------------

    def is_free(self, offset: int, size: int) -> bool:
        """True if every byte of [offset, offset+size) is free; HeapError if size <= 0."""
        if size <= 0:
            raise HeapError(f"size must be positive, got {size}")
        return self._containing_free(offset, size) is not None

    def free_range_ending_at(self, end: int) -> tuple[int, int] | None:
        """The free range that ends exactly at `end`, as (offset, size), or None. O(log n)."""
        hit = self._containing_free(end - 1, 1)
        return hit if hit is not None and hit[0] + hit[1] == end else None

    def free_range_starting_at(self, start: int) -> tuple[int, int] | None:
        """The free range that starts exactly at `start`, as (offset, size), or None. O(log n)."""
        size = self._free.get(start)
        return None if size is None else (start, size)

    def free_ranges(self) -> list[tuple[int, int]]:
        """Free ranges as sorted (offset, size) pairs."""
        return list(self._free.items())

    def live_blocks(self) -> list[tuple[int, int]]:
        """Live blocks as sorted (offset, rounded size) pairs. O(n log n)."""
        return sorted(self._live.items())

    def free_bytes(self) -> int:
        return self._free_bytes

    def live_bytes(self) -> int:
        return self._live_bytes

    def managed_bytes(self) -> int:
        """Free plus live bytes: everything inserted minus everything removed."""
        return self._free_bytes + self._live_bytes

    def largest_free(self) -> int:
        """Size of the largest free range (the largest `allocate` that succeeds), or 0."""
        return self._by_size[-1][0] if self._by_size else 0

    def free_bytes_in(self, start: int, end: int) -> int:
        """Free bytes intersecting [start, end). O(log n + ranges touched).

        A page is empty exactly when this equals its size.
        """
        total = 0
        i = max(self._free.bisect_right(start) - 1, 0)
        for offset in self._free.islice(i):
            if offset >= end:
                break
            total += max(0, min(end, offset + self._free[offset]) - max(start, offset))
        return total

    def check_invariants(self) -> None:
        """Raise HeapError if any structural invariant is broken. O(n); for tests."""
        def fail(why: str):
            raise HeapError(f"heap invariant broken: {why}")

        if sorted((s, o) for o, s in self._free.items()) != list(self._by_size):
            fail("size index out of sync with free ranges")
        prev_end = None
        for offset, size in self._free.items():
            if size <= 0 or offset % self.alignment or size % self.alignment:
                fail(f"free range ({offset}, {size}) empty or misaligned")
            if offset < self.base or offset + size > self.base + self.span:
                fail(f"free range ({offset}, {size}) outside the span")
            if prev_end is not None and offset <= prev_end:
                fail(f"free range ({offset}, {size}) overlaps or touches its left neighbour")
            prev_end = offset + size
        prev_end = None
        for offset, size in sorted(self._live.items()):
            if size <= 0 or offset % self.alignment or size % self.alignment:
                fail(f"live block ({offset}, {size}) empty or misaligned")
            if offset < self.base or offset + size > self.base + self.span:
                fail(f"live block ({offset}, {size}) outside the span")
            if prev_end is not None and offset < prev_end:
                fail(f"live block ({offset}, {size}) overlaps its left neighbour")
            if self.free_bytes_in(offset, offset + size):
                fail(f"live block ({offset}, {size}) overlaps free space")
            prev_end = offset + size
        if self._free_bytes != sum(self._free.values()) or self._live_bytes != sum(self._live.values()):
            fail("byte counters do not add up")
        everything = sorted(list(self._free.items()) + list(self._live.items()))
        if list(self._managed.items()) != (_coalesced(everything) if everything else []):
            fail("managed extents are not the free ranges and live blocks, coalesced")


_first = itemgetter(0)
_second = itemgetter(1)


def _coalesced(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, disjoint (offset, size) ranges with every touching pair merged (the pairwise
    comparisons run in C; Python loops over the merged ranges only)."""
    starts = list(map(_first, ranges))
    ends = list(map(add, starts, map(_second, ranges)))
    breaks = [i for i, touching in enumerate(map(eq, ends, starts[1:]), 1) if not touching]
    if len(breaks) == len(ranges) - 1:
        return ranges
    firsts = [0] + breaks
    lasts = [i - 1 for i in breaks] + [len(ranges) - 1]
    return [(starts[a], ends[b] - starts[a]) for a, b in zip(firsts, lasts)]

