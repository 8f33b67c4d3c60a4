"""`AccountingPool`: the pool's placement and compaction policy over integers, with no memory.

A dry replay (``defrag replay --dry``) needs the figures a `defrag.Pool`
would produce (peak live, peak mapped, OOMs, bytes moved) for traces far
larger than this machine: an 80 GiB snapshot has 40,960 pages of 2 MiB,
more than the emulated driver's one memfd per page allows open, and a real
pool spends most of its time in torch and ctypes glue. This class replays
the same decisions on plain integers:

- the same `defrag.heap.Heap` per virtual region (best fit, 512-byte blocks);
- sub-page blocks go into free space of mapped pages, else one more page is
  mapped: the lowest unmapped page of the first region that has one;
- blocks of a page or more start on a page boundary, in the shortest run of
  pages holding no live block that fits (ties: fewest unmapped pages in the
  window, then the first run), stitched with free physical pages: cached or
  creatable ones first, then pages unmapped from empty mapped pages
  elsewhere, first in address order; a new region when no run is long enough;
- pages stay mapped when they empty, until stitching needs their physical
  page or a compaction ends (it unmaps every empty page);
- compaction: `defrag.planner.plan_compaction` per region with new pages
  capped by the free physical pages, wave by wave: physical room made by
  unmapping empty pages that are not destinations, destination pages mapped
  and carved before the sources are freed (so the transient peak of mapped
  pages is counted), every empty page unmapped at the end;
- on a failed placement with ``auto_compact``: compact when packing could
  make room (a sub-page request needs that many free bytes, a larger one
  that many free pages), then retry once; otherwise an OOM.

It mirrors `defrag.pool.Pool` and `defrag.compactor` as of this writing;
`tests/cpu/test_replay.py` checks that both give the same peaks and OOM
counts on every generator. It does not model: pinned or unmovable blocks,
CUDA stream-ordered frees, driver failures, or the time anything takes.
"""

from __future__ import annotations

import numpy as np
from sortedcontainers import SortedDict, SortedList

from ..heap import ALIGNMENT, Heap
from ..planner import LiveBlock, plan_compaction, plan_hole

_REGION_STRIDE = 1 << 52  # fake, disjoint base addresses for the regions' heaps


class _NoSpace(Exception):
    pass


class CompactionCapacityError(RuntimeError):
    """A compaction wave needed more physical pages than can be freed (the pool's CompactionError)."""


class _Region:
    """One virtual region: per-page state as arrays, plus indexes kept up to date on every change.

    - ``mapped`` (bool) and ``live`` (live blocks touching the page) per page;
    - ``runs`` / ``by_len``: the maximal runs of pages with no live block,
      by start and by (length, start), for "shortest run that fits";
    - ``empty``: mapped pages with no live block (the stitching donors).
    Invariant (as in the pool): an unmapped page has no live block.
    """

    def __init__(self, index: int, base: int, npages: int):
        self.index, self.base, self.npages = index, base, npages
        self.mapped = np.zeros(npages, dtype=bool)
        self.live = np.zeros(npages, dtype=np.int64)
        self.runs = SortedDict({0: npages})
        self.by_len = SortedList([(npages, 0)])
        self.empty = np.zeros(npages, dtype=bool)

    def take_run(self, a: int, b: int) -> None:
        """Pages [a, b), inside one free run, now hold live data."""
        i = self.runs.bisect_right(a) - 1
        start, length = self.runs.peekitem(i)
        del self.runs[start]
        self.by_len.remove((length, start))
        if a > start:
            self.runs[start] = a - start
            self.by_len.add((a - start, start))
        if b < start + length:
            self.runs[b] = start + length - b
            self.by_len.add((start + length - b, b))

    def give_run(self, a: int, b: int) -> None:
        """Pages [a, b) hold no live data any more: merge them into the free runs."""
        i = self.runs.bisect_left(a)
        if i > 0:
            start, length = self.runs.peekitem(i - 1)
            if start + length == a:
                del self.runs[start]
                self.by_len.remove((length, start))
                a = start
        length = self.runs.get(b)
        if length is not None:
            del self.runs[b]
            self.by_len.remove((length, b))
            b += length
        self.runs[a] = b - a
        self.by_len.add((b - a, a))


class AccountingPool:
    """A `defrag.Pool` without memory: same placement, stitching and compaction decisions.

    ``alloc(key, nbytes)`` returns False (and counts an OOM) where the pool
    would raise OutOfMemoryError; ``free(key)``; ``compact()``; ``stats()``
    with the pool's key names for what it models.
    """

    def __init__(self, capacity: int, page_size: int = 2 << 20, auto_compact: bool = True, *,
                 virtual_factor: int = 2):
        if page_size <= 0 or page_size % ALIGNMENT:
            raise ValueError(f"page_size must be a positive multiple of {ALIGNMENT}, got {page_size}")
        if capacity < page_size:
            raise ValueError(f"capacity {capacity} is smaller than one page ({page_size})")
        self.page_size = P = page_size
        self.capacity_pages = capacity // P
        self.capacity = self.capacity_pages * P
        self.auto_compact = bool(auto_compact)
        self._regions: list[_Region] = []
        self._heaps: list[Heap] = []
        self._blocks: dict = {}  # key -> (region index, address, size, nbytes)
        self._cached = 0  # physical pages not mapped anywhere
        self._total = 0  # physical pages created (cached + mapped)
        self._mapped = 0
        self._empty = 0  # mapped pages with no live block, all regions
        self.allocated = 0
        self.peak_allocated = 0
        self.peak_mapped = 0
        self.counters = dict.fromkeys(
            ("num_ooms", "num_alloc_retries", "num_allocs", "num_frees", "num_compactions",
             "num_compactions.explicit", "num_compactions.automatic", "compaction.moved_bytes",
             "compaction.moved_tensors", "compaction.released_pages", "map_calls", "unmap_calls"), 0)
        self._add_region(self.capacity_pages * max(1, int(virtual_factor)))

    # ------------------------------------------------------------------ pages
    def _add_region(self, npages: int) -> _Region:
        region = _Region(len(self._regions), (len(self._regions) + 1) * _REGION_STRIDE, npages)
        if npages * self.page_size >= _REGION_STRIDE:
            raise ValueError("region too large for the accounting model's address layout")
        self._regions.append(region)
        self._heaps.append(Heap(region.base, npages * self.page_size, ALIGNMENT))
        return region

    @property
    def _available(self) -> int:
        """Physical pages obtainable without unmapping: cached plus creatable."""
        return self._cached + self.capacity_pages - self._total

    def _map(self, region: _Region, pages) -> None:
        """Map unmapped pages (sorted indices) with cached or new physical pages, as free heap space."""
        runs = _runs(pages)
        n = sum(count for _, count in runs)
        if n == 0:
            return
        if n > self._available:
            raise CompactionCapacityError(f"asked for {n} pages but only {self._available} are available")
        reuse = min(n, self._cached)
        self._cached -= reuse
        self._total += n - reuse
        heap, P = self._heaps[region.index], self.page_size
        for first, count in runs:
            region.mapped[first:first + count] = True
            region.empty[first:first + count] = True  # an unmapped page holds no live block
            heap.insert_free(region.base + first * P, count * P)
        self._empty += n
        self._mapped += n
        self.counters["map_calls"] += n
        if self._mapped > self.peak_mapped:
            self.peak_mapped = self._mapped

    def _unmap(self, region: _Region, pages) -> None:
        """Unmap empty mapped pages (sorted indices); their physical pages become cached."""
        runs = _runs(pages)
        n = sum(count for _, count in runs)
        if n == 0:
            return
        heap, P = self._heaps[region.index], self.page_size
        for first, count in runs:
            heap.remove_free(region.base + first * P, count * P)
            region.mapped[first:first + count] = False
            region.empty[first:first + count] = False
        self._empty -= n
        self._mapped -= n
        self._cached += n
        self.counters["unmap_calls"] += n

    def _empty_pages(self, region: _Region) -> np.ndarray:
        return np.flatnonzero(region.empty)

    # ------------------------------------------------------------------ blocks
    def _pages_of(self, region: _Region, address: int, size: int) -> tuple[int, int]:
        first = (address - region.base) // self.page_size
        return first, (address + size - 1 - region.base) // self.page_size + 1

    def _carve(self, region: _Region, address: int, size: int) -> None:
        """Count a new live block on its pages (the heap already holds it)."""
        first, end = self._pages_of(region, address, size)
        live = region.live
        live[first:end] += 1
        for a, n in _flipped_runs(live, first, end, 1):
            region.take_run(a, a + n)
            region.empty[a:a + n] = False
            self._empty -= n

    def _uncarve(self, region: _Region, address: int, size: int) -> None:
        """Free a live block in the heap and on its pages."""
        self._heaps[region.index].free(address)
        first, end = self._pages_of(region, address, size)
        live = region.live
        live[first:end] -= 1
        for a, n in _flipped_runs(live, first, end, 0):
            region.give_run(a, a + n)
            region.empty[a:a + n] = True
            self._empty += n

    def _place(self, size: int) -> tuple[_Region, int]:
        if size < self.page_size:
            return self._place_small(size)
        return self._place_large(size)

    def _place_small(self, size: int) -> tuple[_Region, int]:
        for region, heap in zip(self._regions, self._heaps):
            address = heap.allocate(size)
            if address is not None:
                self._carve(region, address, size)
                return region, address
        if self._available < 1:
            raise _NoSpace()
        for region in self._regions:
            page = int(np.argmin(region.mapped))  # the first unmapped page, if any
            if not region.mapped[page]:
                break
        else:
            region, page = self._add_region(self.capacity_pages), 0
        self._map(region, [page])
        address = self._heaps[region.index].allocate_at(region.base + page * self.page_size, size)
        self._carve(region, address, size)
        return region, address

    def _place_large(self, size: int) -> tuple[_Region, int]:
        k = -(-size // self.page_size)
        if k > self._available + self._empty:
            raise _NoSpace()
        best = None  # (run length, unmapped pages in window, region, start)
        for region in self._regions:
            by_len, mapped = region.by_len, region.mapped
            i = by_len.bisect_left((k, -1))
            if i == len(by_len):
                continue
            length = by_len[i][0]
            # Runs of the shortest fitting length, in address order: fewest unmapped pages wins, then the first.
            for run_length, start in by_len.islice(i):
                if run_length != length:
                    break
                unmapped = k - int(np.count_nonzero(mapped[start:start + k]))
                if best is None or (length, unmapped) < best[:2]:
                    best = (length, unmapped, region, start)
                if unmapped == 0:
                    break
        if best is None:
            region, start = self._add_region(max(k, self.capacity_pages)), 0
        else:
            region, start = best[2], best[3]
        to_map = start + np.flatnonzero(~region.mapped[start:start + k])
        shortfall = len(to_map) - self._available
        if shortfall > 0:
            # Stitching: take physical pages from empty mapped pages elsewhere, in address order.
            for donor in self._regions:
                if shortfall <= 0:
                    break
                pages = np.flatnonzero(donor.empty)
                if donor is region:
                    pages = pages[(pages < start) | (pages >= start + k)]
                pages = pages[:shortfall]
                self._unmap(donor, pages)
                shortfall -= len(pages)
        self._map(region, to_map)
        address = self._heaps[region.index].allocate_at(region.base + start * self.page_size, size)
        self._carve(region, address, size)
        return region, address

    # ------------------------------------------------------------------ public
    def alloc(self, key, nbytes: int) -> bool:
        """Place a block of `nbytes` under `key`; False (an OOM, counted) where the pool would raise."""
        if key in self._blocks:
            raise KeyError(f"block {key!r} is already live")
        size = -(-int(nbytes) // ALIGNMENT) * ALIGNMENT
        try:
            region, address = self._place(size)
        except _NoSpace:
            self.counters["num_alloc_retries"] += 1
            placed = self._rescue(size)
            if placed is None:
                self.counters["num_ooms"] += 1
                return False
            region, address = placed
        self._blocks[key] = (region.index, address, size, int(nbytes))
        self.allocated += size
        self.counters["num_allocs"] += 1
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        return True

    def free(self, key) -> None:
        """Free the block `key` (KeyError if it is not live). Its pages stay mapped."""
        index, address, size, _ = self._blocks.pop(key)
        self._uncarve(self._regions[index], address, size)
        self.allocated -= size
        self.counters["num_frees"] += 1

    def _rescue(self, size: int):
        """The pool's automatic compaction: only when packing could make room; then retry once."""
        if not self.auto_compact:
            return None
        if size < self.page_size:
            if size > self.capacity - self.allocated:  # a sub-page request needs a hole: packed, free bytes gather
                return None
        elif -(-size // self.page_size) > self.capacity_pages - -(-self.allocated // self.page_size):
            return None
        self.counters["num_alloc_retries"] += 1
        try:
            self.compact(automatic=True)
        except CompactionCapacityError:
            return None
        try:
            return self._place(size)
        except _NoSpace:
            pass
        if size >= self.page_size:
            return None
        # As the pool: every page is needed but the free bytes are split; merge two holes.
        for region in self._regions:
            blocks = [LiveBlock(key, address - region.base, bsize, True)
                      for key, (index, address, bsize, _) in self._blocks.items() if index == region.index]
            free = [(off - region.base, sz) for off, sz in self._heaps[region.index].free_ranges()]
            plan = plan_hole(blocks, free, size, page_size=self.page_size, span=region.npages * self.page_size)
            if plan is None:
                continue
            moved = self._run_wave(region, plan.waves[0])
            c = self.counters
            c["num_compactions"] += 1
            c["num_compactions.automatic"] += 1
            c["compaction.moved_bytes"] += moved
            try:
                return self._place(size)
            except _NoSpace:
                return None
        return None

    def compact(self, *, automatic: bool = False, release: bool | None = None) -> int:
        """Run the pool's compaction on the model; returns the bytes moved.

        Raises CompactionCapacityError where the pool raises CompactionError (a
        wave's destinations need more physical pages than can be freed); the
        waves before it stay done and empty pages are released, as in the pool.
        """
        by_region: dict[int, list] = {}
        for key, (index, address, size, _) in self._blocks.items():
            by_region.setdefault(index, []).append((address, size, key))
        plans = []
        for region in self._regions:
            blocks = sorted(by_region.get(region.index, ()))
            if not blocks:
                continue
            # As the compactor: destinations on untouched pages are backed by empty mapped
            # pages, plus cached/creatable ones for a rescue.
            plan = plan_compaction([LiveBlock(key, address - region.base, size, True)
                                    for address, size, key in blocks],
                                   page_size=self.page_size, span=region.npages * self.page_size,
                                   max_new_pages=self._empty + (self._available if automatic else 0))
            if not plan.empty:
                plans.append((region, plan))
        moved = 0
        try:
            for region, plan in plans:
                for wave in plan.waves:
                    moved += self._run_wave(region, wave)
        finally:
            mapped_before_release = self._mapped
            if release if release is not None else not automatic:  # the pool: automatic ones keep pages mapped
                for region in self._regions:
                    self._unmap(region, self._empty_pages(region))
            c = self.counters
            c["num_compactions"] += 1
            c["num_compactions.automatic" if automatic else "num_compactions.explicit"] += 1
            c["compaction.moved_bytes"] += moved
            c["compaction.released_pages"] += mapped_before_release - self._mapped
        return moved

    def _run_wave(self, region: _Region, wave) -> int:
        P, heap = self.page_size, self._heaps[region.index]
        # Prepare: make physical room (unmapping empty pages that are not destinations),
        # map destination pages, carve destinations (sources stay live).
        dest_pages = {p for m in wave for p in range(m.dst // P, (m.dst + m.size - 1) // P + 1)}
        to_map = sorted(p for p in dest_pages if not region.mapped[p])
        if to_map:  # as the compactor: donors (empty mapped pages) first, so mapped pages never grow
            donors = [(r, p) for r in self._regions for p in self._empty_pages(r).tolist()
                      if not (r is region and p in dest_pages)]
            if len(donors) + self._available < len(to_map):
                raise CompactionCapacityError(f"the plan needs {len(to_map)} new pages but only "
                                              f"{self._available + len(donors)} physical pages are free")
            for r in self._regions:
                self._unmap(r, [p for d, p in donors[:len(to_map)] if d is r])
        self._map(region, to_map)
        for m in wave:
            heap.allocate_at(region.base + m.dst, m.size)
            self._carve(region, region.base + m.dst, m.size)
        # Swap, then release the sources.
        moved = 0
        for m in wave:
            index, address, size, nbytes = self._blocks[m.key]
            self._uncarve(region, address, size)
            self._blocks[m.key] = (index, region.base + m.dst, size, nbytes)
            moved += nbytes  # as the compactor counts: the storage's bytes
            self.counters["compaction.moved_tensors"] += 1
        return moved

    def stats(self) -> dict:
        """The pool's figures that the model tracks, under `Pool.stats()` key names."""
        P = self.page_size
        out = {
            "allocated_bytes.all.current": self.allocated,
            "allocated_bytes.all.peak": self.peak_allocated,
            "reserved_bytes.all.current": self._mapped * P,
            "reserved_bytes.all.peak": self.peak_mapped * P,
            "pages.mapped": self._mapped,
            "pages.cached": self._cached,
            "pages.total": self._total,
            "pages.empty": self._empty,
            "pages.capacity": self.capacity_pages,
            "page_size": P,
            "capacity_bytes": self.capacity,
            "live_blocks": len(self._blocks),
            "regions": len(self._regions),
        }
        out.update(self.counters)
        return out

    def check_invariants(self) -> None:
        """Raise AssertionError if the model's books disagree (a test aid)."""
        P = self.page_size
        counts = [np.zeros(r.npages, dtype=np.int64) for r in self._regions]
        total = 0
        for index, address, size, _ in self._blocks.values():
            region = self._regions[index]
            first, end = self._pages_of(region, address, size)
            assert region.mapped[first:end].all(), f"block at {address:#x} touches an unmapped page"
            counts[index][first:end] += 1
            total += size
        for region, heap, expect in zip(self._regions, self._heaps, counts):
            heap.check_invariants()
            assert np.array_equal(region.live, expect), f"page live counts of region {region.index} disagree"
            assert not (region.live > 0)[~region.mapped].any(), "a live block on an unmapped page"
            starts, lengths = _free_runs(region.live == 0)
            assert dict(zip(starts.tolist(), lengths.tolist())) == dict(region.runs), "free-run index is stale"
            assert sorted((n, s) for s, n in region.runs.items()) == list(region.by_len), "run length index is stale"
            assert np.array_equal(region.empty, region.mapped & (region.live == 0)), "empty-page index is stale"
        assert self._empty == sum(int(r.empty.sum()) for r in self._regions)
        assert total == self.allocated
        heap_free = sum(h.free_bytes() for h in self._heaps)
        assert total + heap_free == self._mapped * P, "allocated + free inside mapped pages != mapped bytes"
        assert self._total <= self.capacity_pages and self._mapped + self._cached == self._total


def _free_runs(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(starts, lengths) of the runs of True in a boolean array."""
    padded = np.concatenate(([False], mask, [False])).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    starts, ends = edges[0::2], edges[1::2]
    return starts, ends - starts


def _flipped_runs(live: np.ndarray, first: int, end: int, value: int) -> list[tuple[int, int]]:
    """Runs (first, count) of pages in [first, end) whose live count is now `value` (they just changed state)."""
    if end - first <= 2:
        return _runs([p for p in range(first, end) if live[p] == value])
    hit = live[first:end] == value
    if hit.all():
        return [(first, end - first)]
    return _runs((first + np.flatnonzero(hit)).tolist())


def _runs(pages) -> list[tuple[int, int]]:
    """Sorted page indices (list or array) -> (first, count) runs of consecutive pages."""
    if isinstance(pages, np.ndarray):
        pages = pages.tolist()
    if not pages:
        return []
    if pages[-1] - pages[0] + 1 == len(pages):  # the common case: one contiguous range
        return [(pages[0], len(pages))]
    runs: list[list[int]] = []
    for p in pages:
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1][1] += 1
        else:
            runs.append([p, 1])
    return [(a, n) for a, n in runs]


__all__ = ["AccountingPool", "CompactionCapacityError"]
