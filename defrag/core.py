"""The core: blocks over pages, placement, release, accounting and the allocation ladder. No torch.

`Core` knows addresses, pages and blocks. It runs over any `defrag.driver.Driver`
(CUDA, emulated, memory-less) and is shared by every face (`defrag.pool.Pool`
for torch tensors, `defrag.dry.DryPool` for dry replays, and PyTorch's
pluggable allocator). What a block *is* to its user (a torch storage, a trace
key, a segment handed to PyTorch) is the face's business: the core keeps the
face's `info` on the block and moves it along when a compaction moves the
block's data (`defrag.compactor`, which calls back into the face to rewrite
the owner).

Layout. The core reserves virtual regions and maps physical pages into them
(`defrag.vmm`). Inside mapped pages a best-fit heap (one per region, in the
core's native books, `Core.books`: `defrag/native/books.h` over `heap.h`)
places blocks at 512-byte granularity:

- a block smaller than a page goes into free space of pages that are already
  mapped; only when none fits is one more page mapped, and the block then
  starts in the free tail of the last mapped page before it when there is
  one (spilling into the new page), so that the free space after it stays
  in one piece;
- a block of a page or more goes, best fit, into mapped free space at any
  512-byte boundary when some holds it (typically the free tail of a partly
  used page joined to empty pages); else in the window of free space and
  unmapped pages that needs the fewest pages mapped (`_cheapest_window`).
  Those pages are backed as `defrag.page_growth` says: cached physical
  pages, then new ones while mapped pages stay within 1.10 x what is live,
  then empty mapped pages unmapped elsewhere (*stitching*). Such a request
  fails only when the free physical pages cannot cover it (a new region is
  reserved when no window fits).
- freed ranges are kept carved per size and reused by the next request of
  that size without touching the heap (`free`, `flush_reuse`).

Records. The native books (`Core.books`, `defrag/native/books.h`) hold the one
record of every block: where it is, its state and the counters, whoever placed
it (this core's ladder, or a face's native code: `pool.empty`'s fast path,
PyTorch's allocator entries) and whoever releases it. What a block is to its
face (a `Block` with the face's `info`, its owner thread, its pins) hangs off
its record; the books make a `Block` for a block native code placed only when
Python first asks (`blocks`, the face's `make_face`). The core keeps no list of
blocks of its own.

Moves. A compaction (`defrag.compactor`) changes blocks' records only through
`Core.waves`, a `WaveBooks`: a wave's destinations taken before its copy
(`begin_moves`), then its commit (`move_to`, or `record_moves`, `swap_in` and
`forget`).

Lifetime. A block's release (`release(block)` from Python, or a storage's
deleter in any thread) goes to the books: applied at once (its range kept for
the next request of its size), or queued while a thread is inside the gate and
applied when it leaves. On CUDA a block other streams used waits for an event
on each of them first (`defrag/native/streams.h`). Pages left with no live
block stay mapped ("empty") until their physical page is needed elsewhere,
`trim()`, an explicit compaction or `release_all()`.

Threads: `gate` is the core's lock and knows which threads wait at it; every
block belongs to the thread that made it (`defrag.threads`), and `scope()`
says which blocks a compaction called from this thread may move (the
contract is written out in `defrag.pool`).
"""

from __future__ import annotations

import collections
import logging
import math
from dataclasses import dataclass

import numpy as np

from . import native, readout, threads
from .backing import Backing, NoSpace
from .driver import Driver
from .errors import CudaError, CudaOutOfMemoryError, PoolAsleepError, PoolClosedError, StaleAccessError
from .movability import Scope, Users
from .page_growth import GrowthPolicy
from .page_runs import mask_runs
from .readout import OutOfRoom
from .units import ALIGNMENT, format_bytes
from .vmm import Region, Transaction

_log = logging.getLogger("defrag")


@dataclass(eq=False, slots=True)
class Block:
    """One carved heap range: where it is, whose it is, and the face's `info` about its user."""

    address: int
    size: int  # rounded to ALIGNMENT: what the heap holds
    nbytes: int  # what the user asked for
    region: Region
    pins: int = 0
    retired: bool = False  # an old location whose data has moved (or a destination not yet swapped in)
    counted: bool = True  # in allocated_bytes (compaction destinations count only once swapped in)
    pending: bool = False  # released, waiting for other streams to finish with it (active, not allocated)
    owner: object = None  # weakref to the ThreadToken of the thread that allocated, adopted or claimed it
    shared: bool = False  # declared used by several threads: no thread owns it
    info: object = None  # the face's data about the block's user; follows the data when it moves
    keepalive: object = None  # the face's release hook for this range (dropped when the block is freed)
    offloaded: bool = False  # on host-located pages (defrag.residency): never moved until reloaded



# Blocks of at least this many pages are packed end to end (a window starting in a free tail wins over
# an equally cheap page-aligned one); smaller ones start on a page boundary unless a tail saves a page.
# Measured on dry replays (smallest capacity, MiB): a 2.7B model's forward pass (a public
# cs336_2.7b_forward snapshot) 32,686 page-aligned -> 32,326 packed, under the 32,356 PyTorch's
# expandable segments need; the shared ctx128 training step 52,422 -> 52,310 (no compaction: -114). Packing
# every size instead strands tails that only sub-page blocks could use: two snapshots' smallest
# capacities without compaction grew by 2-3 pages; from 4 pages up, one (select_n, +2 pages) does.
PACK_PAGES = 4


def _spill_window(regions, heaps, page_size: int, size: int, roles=None):
    """Where a block of `size` (under a page) that needs one new page anyway can start in the free tail
    of the last mapped page before an unmapped one and spill into it: (region, start address, the two
    pages), the largest such tail, or None. The same one page is mapped, and the free space after the
    block stays in one piece. Never the tail of a meshed page (`roles`: per region, a page's mesh role,
    0 for none): meshed pages never join a run of pages."""
    best = None
    for region, heap in zip(regions, heaps):
        mapped = region.handles != 0
        if roles is not None:
            mapped = mapped & (roles[region.index] == 0)
        for q in np.flatnonzero(mapped[:-1] & (region.handles[1:] == 0)).tolist():
            run = heap.free_range_ending_at(region.address(q + 1))
            if run is None or run[1] >= size or run[1] + page_size < size:
                continue
            if best is None or run[1] > best[0]:
                first = (run[0] - region.base) // page_size
                best = (run[1], region, run[0], list(range(first, q + 2)))
    return None if best is None else best[1:]


def _outside_pages(starts: np.ndarray, ends: np.ndarray, excluded: np.ndarray, base: int, P: int):
    """The ranges [starts, ends) of a region at `base` with the pages marked in `excluded` cut out."""
    before = np.concatenate(([0], np.cumsum(excluded)))
    first, last = (starts - base) // P, (ends - 1 - base) // P
    touched = before[last + 1] > before[first]
    if not touched.any():
        return starts, ends
    out_s, out_e = starts[~touched].tolist(), ends[~touched].tolist()
    for s, e, a, b in zip(starts[touched].tolist(), ends[touched].tolist(), first[touched].tolist(),
                          last[touched].tolist()):
        cursor = s
        for page in (a + np.flatnonzero(excluded[a:b + 1])).tolist():
            page_start = base + page * P
            if cursor < page_start:
                out_s.append(cursor)
                out_e.append(page_start)
            cursor = page_start + P
        if cursor < e:
            out_s.append(cursor)
            out_e.append(e)
    return np.asarray(out_s, dtype=np.int64), np.asarray(out_e, dtype=np.int64)


def _cheapest_window(region, free_ranges, page_size: int, size: int, meshed=None):
    """Where in `region` a block of `size` bytes needs the fewest pages mapped: (key, address) with key =
    (unmapped pages, starts off a page boundary, address), or None when no window fits.

    A block may lie on free bytes of mapped pages (`free_ranges`, the
    heap's) and on unmapped pages, wherever they touch: the free tail of a
    partly used page continued into the unmapped run after it, an unmapped
    gap that stitching left between two free ranges, a run of untouched
    pages. Over such a run, the count of unmapped pages under a sliding
    window changes only where a piece starts or ends, so the windows that
    start where a piece starts or end where one ends are the only
    candidates. Among equally cheap ones the lowest address wins, so a
    block of `PACK_PAGES` or more starts in the free tail before it and
    blocks lie end to end, as in expandable segments; a smaller block
    starts on a page boundary when that costs no extra page, leaving the
    tail to sub-page blocks (see `PACK_PAGES`).

    Never over a meshed page (`meshed`: a bool per page of the region):
    meshed pages never join a run of pages, and a placement that stitches
    may promote a mesh's twin and unmap the primary under the window
    (`Backing.unmap_dormant`).
    """
    P, base = page_size, region.base
    run_starts, run_stops = mask_runs(region.handles == 0)  # the runs of unmapped pages
    starts = ends = np.empty(0, dtype=np.int64)
    if len(free_ranges):
        fr = np.asarray(free_ranges, dtype=np.int64).reshape(-1, 2)
        starts, ends = fr[:, 0], fr[:, 0] + fr[:, 1]
        if meshed is not None and meshed.any():
            starts, ends = _outside_pages(starts, ends, meshed, base, P)
    if run_starts.size:
        starts = np.concatenate([starts, base + run_starts * P])
        ends = np.concatenate([ends, base + run_stops * P])
    if not starts.size:
        return None
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    # Runs of touching pieces (pieces never overlap: the heap's free ranges lie on mapped pages).
    new_run = np.ones(len(starts), dtype=bool)
    new_run[1:] = starts[1:] != ends[:-1]
    run_id = np.cumsum(new_run) - 1
    run_start = starts[new_run][run_id]
    run_end = ends[np.append(new_run[1:], True)][run_id]
    cand = np.concatenate([starts, ends - size])
    lo, hi = np.concatenate([run_start, run_start]), np.concatenate([run_end, run_end])
    ok = (cand >= lo) & (cand + size <= hi)
    if not ok.any():
        return None
    cand = cand[ok]
    # Unmapped pages in each window [first page, end page), from the unmapped runs' lengths (no pass
    # over every page of the region): before(p) = the pages of the runs before p, plus the part of
    # the run p falls in.
    counted = np.zeros(run_starts.size + 1, dtype=np.int64)
    np.cumsum(run_stops - run_starts, out=counted[1:])

    def before(p):
        k = np.searchsorted(run_starts, p)  # runs starting before page p
        prev = np.maximum(k - 1, 0)
        inside = np.minimum(p, run_stops[prev]) - run_starts[prev] if run_starts.size else 0
        return np.where(k > 0, counted[prev] + inside, 0)

    need = before((cand + size - 1 - base) // P + 1) - before((cand - base) // P)
    off_page = ((cand - base) % P != 0) if size < PACK_PAGES * P else np.zeros(len(cand), dtype=bool)
    best = np.lexsort((cand, off_page, need))[0]
    return (int(need[best]), bool(off_page[best]), int(cand[best])), int(cand[best])


class Core:
    """Blocks over a page-mapped address space: placement, release, accounting, the ladder.

    `capacity_pages` physical pages of `page_size` bytes are created lazily
    on `driver`. `virtual_factor`: the first virtual reservation spans this
    many times the capacity. `auto_compact`, `min_compact_interval`: the
    ladder's automatic compaction (run by the `rescue` callback a face passes
    to `allocate`); `auto_mesh`: whether that rescue also meshes
    (`defrag.mesher`) before the ladder reports an OOM.
    """

    def __init__(self, driver: Driver, *, capacity_pages: int, page_size: int, auto_compact: bool = True,
                 min_compact_interval: float = 0.0, virtual_factor: int = 2, label: str = "pool",
                 auto_mesh: bool = True, growth: GrowthPolicy | None = None):
        self.driver = driver
        self.kind = driver.kind
        self.page_size = page_size
        self.capacity_pages = capacity_pages
        self.capacity = capacity_pages * page_size
        self.auto_compact = bool(auto_compact)
        self.auto_mesh = bool(auto_mesh)
        self.min_compact_interval = float(min_compact_interval)
        self.last_auto_compact = -math.inf
        self.label = label  # how messages name this core ("pool #3")
        self.closed = False
        # Policy counters (ladder climbs, OOMs, compactions, ...); the block counters are the books'.
        self.counters: collections.Counter = collections.Counter()
        self.peaks: collections.Counter = collections.Counter()
        # The books (native, `defrag/native/books.h`): the record of every block, every region's heap,
        # page counts, the empty-page count, the freed ranges kept for reuse, the release queue and the
        # block counters. Native placements and releases go through them too.
        self.books = native.load_module().Books(page_size)
        self.gate = threads.Gate(self.books)  # the lock (the books'); knows which threads wait at it
        # The pages under the regions: every map, unmap, stitch and re-backing (`defrag.backing`).
        self.backing = Backing(driver, self.books, page_size, capacity_pages, self.peaks)
        self.growth = GrowthPolicy() if growth is None else growth  # when placement grows, when it stitches
        self.units_closed = False  # set once mapped pages pass the units' ceiling (`GrowthPolicy.unit_ceiling`)
        self._placing_stream = 0  # the stream `place` places for (a unit break checks it for graph capture)
        self.space = self.backing.space
        self._heaps = self.backing.heaps  # per region: its native Heap (`defrag/native/heap.h`)
        self.waves = WaveBooks(self.books, self.backing)  # a compaction wave's books (`defrag.compactor`)
        self.users = Users(self.gate, label)  # the threads that used the core: each block's owner
        # A face whose native code places blocks (`pool.empty`'s fast path, PyTorch's allocator entries)
        # sets these: `make_face(address, size, nbytes, region, origin, owner, weak_storage, dtype, shape)`
        # makes the Block of such a block when Python first asks for it, and `fast` is the native
        # FastPath it uses (its dtype objects).
        self.make_face = None
        self.fast = None
        npages = self.capacity_pages * max(1, int(virtual_factor))
        try:
            self.add_region(npages)
        except CudaOutOfMemoryError as exc:
            raise ValueError(
                f"{label}: capacity {format_bytes(self.capacity)} needs {format_bytes(npages * page_size)} of "
                f"virtual address space ({max(1, int(virtual_factor))} x the capacity), which the {driver.kind} "
                f"device cannot reserve ({exc.name}); the device has {format_bytes(driver.total_memory)} of "
                f"memory in all: ask for a capacity up to that") from None

    # ------------------------------------------------------------------ read-only views
    @property
    def regions(self) -> list[Region]:
        return self.space.regions

    @property
    def allocated_bytes(self) -> int:
        """Bytes of counted blocks now (the books' counter)."""
        return self.books.counters()["allocated_bytes"]

    def heap(self, region: Region):
        """The heap of `region` (free ranges; faces and the compactor read it, the core carves it),
        with every range kept for reuse back in it."""
        self.flush_reuse()
        return self._heaps[region.index]

    def free_ranges(self, region: Region) -> list[tuple[int, int]]:
        """(address, size) of every free range of `region`, ranges kept for reuse included."""
        return self.heap(region).free_ranges()

    def unmanaged_ranges(self, region: Region) -> list[tuple[int, int]]:
        """(address, size) of the bytes of `region`'s meshed pages that its heap does not manage (a twin's
        page minus its pieces; on a primary, its twins' pieces): neither free nor covered by a block of
        `region`, so a planner that takes unoccupied bytes as free must take them as occupied. Empty
        when nothing is meshed."""
        return self.books.unmanaged_in(region.index, 0, region.npages)

    def blocks(self, region: Region | None = None) -> list[Block]:
        """Every block (live, retired, pending) of `region` (None: of every region), unordered: the
        faces of the books' records, made now for blocks native code placed. The gate is held (so no
        record goes meanwhile); the list is the caller's, the Blocks are the books'."""
        return self.books.faces(-1 if region is None else region.index, self.make_face, self.fast)

    def block_at(self, address: int) -> Block | None:
        """The live block starting at `address`, or None (retired and pending ones are not live)."""
        block = self.books.face_at(address)
        if block is None and self.books.has_faceless(address):
            self.blocks(self.space.region_of(address))  # native code placed it: its face is made now
            block = self.books.face_at(address)
        return None if block is None or block.retired or block.pending else block

    def owns_address(self, ptr: int) -> bool:
        return any(r.contains(ptr) for r in self.space.regions)

    def add_region(self, npages: int) -> Region:
        return self.backing.add_region(npages)

    @property
    def history(self):
        """A `defrag.stats.HistoryRecorder` while recording, else None (the backing records pages with it)."""
        return self.backing.history

    @history.setter
    def history(self, recorder) -> None:
        self.backing.history = recorder
        self.books.set_recording(recorder is not None)  # the books log what native code places and every free

    def check_open(self) -> None:
        """PoolClosedError after close; StaleAccessError if unmapped memory was touched (emulated
        device); PoolAsleepError while the pool sleeps."""
        if self.closed:
            raise PoolClosedError(f"{self.label} is closed")
        self.check_untouched()
        if self.space.sleeping:
            raise PoolAsleepError(
                f"{self.label} is asleep (pool.sleep()): its tensors have no device memory until pool.wake(). "
                f"Only stats(), summary(), layout(), snapshot(), live_tensors(), wake() and close() work now")

    def check_untouched(self) -> None:
        """StaleAccessError if unmapped memory of this device was read or written since the last check.

        The emulated device records such accesses (a GPU raises its own
        illegal-address error instead); the count is reset by the check, so
        each access is reported once, at the first pool call after it. The
        message names the likely cause: the pool being asleep, else a
        compaction that moved what a thread was still using.
        """
        touched = self.driver.touched_unmapped()
        if not touched:
            return
        if self.space.sleeping:
            raise StaleAccessError(
                f"{format_bytes(touched)} of {self.label}'s memory was read or written while the pool was asleep "
                f"(pool.sleep() unmapped every device page): those reads saw zeros and those writes were dropped. "
                f"The bytes sleep() kept are intact and come back with pool.wake(); use the pool's tensors only "
                f"after wake(). The pool is still asleep.")
        raise StaleAccessError(
            f"{format_bytes(touched)} of unmapped {self.kind} device memory was read or written since the "
            f"last pool call: a thread kept using an address after a compaction moved what was there and "
            f"its page was unmapped (on a GPU: an illegal-address error). Those reads saw zeros and those "
            f"writes were dropped; the pool's tensors are intact. Usual cause: a tensor handed to another "
            f"thread without pool.claim(t) or pool.share(t), or a raw data_ptr() kept (pin such tensors).")

    # ------------------------------------------------------------------ threads
    def user(self):
        """The calling thread's owner reference, remembering that this thread used the core."""
        return self.users.current()

    def scope(self, mode=None) -> Scope:
        """What a compaction called from this thread may move now (the gate is held): `movability.Users.scope`."""
        return self.users.scope(mode)

    # ------------------------------------------------------------------ releases
    def release(self, block: Block) -> None:
        """The block's user is gone (any thread holding the GIL, any time): its record is released in the
        books, at once or, while a thread is inside the gate, when it leaves. Nothing for a block the
        books no longer hold (a compaction forgot it)."""
        self.books.release(block.address, block)

    def drain(self) -> None:
        """A safe point (the gate is held): releases queued while the gate was held applied,
        stream-ordered ones whose streams finished applied, the threads that placed blocks natively
        noted, and what the books logged for the history taken in order."""
        books = self.books
        books.apply_queued()
        if books.pending:
            books.poll_pending()
        owners = books.take_owners()
        if owners:
            self.users.note(owners)
        if self.history is not None:
            self.history.catch_up()

    def settle(self) -> None:
        """Make the books exact (the gate is held): queued releases applied, stream-ordered ones waited
        for, ranges kept for reuse back in the heaps. Before a compaction plans, or residency picks pages."""
        self.drain()
        self.wait_pending()
        self.flush_reuse()

    def has_backlog(self) -> bool:
        """Whether releases wait in the books' queue for the gate to be let go."""
        return self.books.queued > 0

    def wait_pending(self) -> None:
        """Wait for every stream-ordered release still in flight (before declaring OOM, compacting,
        closing): the device is synchronized, then their ranges are free."""
        if self.books.pending:
            self.driver.synchronize()
            self.books.synchronized()

    def carve(self, region: Region, address: int, size: int, nbytes: int, *, counted: bool = True) -> Block:
        """Record a block over a range the heap has just allocated (counted on its pages and, if
        `counted`, in the allocation counters), owned by the calling thread."""
        block = Block(address, size, nbytes, region, counted=counted, owner=self.user())
        self.books.add(block, region.index, address, size, nbytes, counted)
        return block

    def fill(self, region: Region, address: int, size: int, info) -> Block:
        """A block over the free range [address, address + size) with no user: retired (never moved),
        not counted; `free` gives the range back. For residency's fillers."""
        self._heaps[region.index].allocate_at(address, size)
        block = Block(address, size, 0, region, retired=True, counted=False, owner=self.user(), info=info)
        self.books.add(block, region.index, address, size, 0, False, True)
        return block

    def free(self, block: Block, *, keep: bool = False) -> None:
        """Free a block's range now (the gate is held; nothing may use it any more; no storage of the
        face's native code may name it): its record leaves the books.

        It goes back to the heap at once, unless `keep`: then the range is
        kept carved for the next request of its exact size (`place` takes it
        without touching the heap: the common case of a training step or a
        decode loop, which frees and asks for the same sizes again; every
        release takes this path). Everything else that reads or changes the
        heap's free space first returns every kept range to it
        (`flush_reuse`): a request of a size not kept, unmapping, compaction,
        statistics, layout and invariant checks. So kept ranges never make the
        pool map a page, never leave a hole uncoalesced for a request of
        another size, and never make a statistic wrong. Pages and counters
        count the range as free at once.
        """
        self.books.drop(block.address, block, keep)
        block.keepalive = None

    def flush_reuse(self) -> None:
        """Give every range kept for reuse back to the heap (coalescing it with its neighbours)."""
        self.books.flush_kept()

    def record_compaction(self, report) -> None:
        """Count a finished (or partly committed) compaction's `CompactionReport` in the counters and history."""
        c = self.counters
        c["num_compactions"] += 1
        c["num_compactions.automatic" if report.automatic else "num_compactions.explicit"] += 1
        c["compaction.moved_bytes"] += report.moved_bytes
        c["compaction.moved_tensors"] += report.moved_tensors
        c["compaction.released_pages"] += report.released_pages
        if self.history is not None:
            self.history.compacted(report)

    # ------------------------------------------------------------------ mapping
    @staticmethod
    def round(nbytes: int) -> int:
        return -(-nbytes // ALIGNMENT) * ALIGNMENT

    # ------------------------------------------------------------------ placement
    def place(self, nbytes: int, stream: int = 0) -> Block:
        """Place `nbytes` for `stream` (CUDA; 0 the default stream) without compacting; NoSpace when it
        does not fit now. Ranges other streams freed are ordered before `stream`'s use first (the
        books' fence; where it cannot be recorded, the device is synchronized)."""
        if not self.books.fence(stream):
            self.driver.synchronize()
            self.books.synchronized()
        self._placing_stream = stream
        try:
            block = self._place(nbytes)
        finally:
            self._placing_stream = 0
        if stream:
            self.books.set_stream(block.address, block, stream)
        return block

    def _place(self, nbytes: int) -> Block:
        size = self.round(nbytes)
        kept = self.books.take(size)
        if kept is not None:
            return self.carve(self.space.regions[kept[0]], kept[1], size, nbytes)
        # A size not kept: every kept range goes back first, so best fit sees the
        # coalesced free space (leftovers next to kept ranges would fragment it).
        self.flush_reuse()
        if size < self.page_size:
            return self._place_small(size, nbytes)
        return self._place_large(size, nbytes)

    def _place_small(self, size: int, nbytes: int) -> Block:
        for region, heap in zip(self.space.regions, self._heaps):
            address = heap.allocate(size)
            if address is not None:
                return self.carve(region, address, size, nbytes)
        if self.space.store.available < 1:
            raise NoSpace("no free space in mapped pages and no physical page left")
        tail = _spill_window(self.space.regions, self._heaps, self.page_size, size, self.backing.roles)
        if tail is not None:
            region, address, window = tail
            pages = [p for p in window if not region.handles[p]]
        else:
            region, page = self.backing.first_unmapped_page()
            address, pages = region.address(page), [page]
        with Transaction() as txn:
            self.backing.map_for_placement(region, pages, txn)
            address = self._heaps[region.index].allocate_at(address, size)
        return self.carve(region, address, size, nbytes)

    def _place_large(self, size: int, nbytes: int) -> Block:
        """Place a block of a page or more.

        First mapped free space at any 512-byte boundary, best fit (the free
        tail of a partly used page joined to empty pages after it holds the
        block with no mapping, and the block does not strand its own last
        page's tail). Else the window that needs the fewest pages mapped
        (`_cheapest_window`): free space and unmapped pages side by side, so
        the free space next to an unmapped run is used in place.
        """
        for region, heap in zip(self.space.regions, self._heaps):
            address = heap.allocate(size)
            if address is not None:
                return self.carve(region, address, size, nbytes)
        k = -(-size // self.page_size)
        free_pages = self.backing.free_physical()
        if k - 2 > free_pages:  # a window's first and last pages may be other blocks' (`_supply` counts exactly)
            raise NoSpace(f"needs {k} free pages, {free_pages} can be had")
        best = None
        meshes = bool(self.books.meshes())  # else no page has a mesh role: no mask to pass
        for region, heap in zip(self.space.regions, self._heaps):
            roles = self.backing.roles[region.index]
            free = np.frombuffer(heap.free_ranges_bytes(), dtype=np.int64).reshape(-1, 2)
            found = _cheapest_window(region, free, self.page_size, size, (roles != 0) if meshes else None)
            if found is not None and (best is None or found[0] < best[0]):
                best = (*found, region)
        if best is None:
            if k > free_pages:  # every page of a new region needs one: refused before reserving it
                raise NoSpace(f"needs {k} free pages, {free_pages} can be had")
            region = self.add_region(max(k, self.capacity_pages))
            address, window = region.base, list(range(k))
        else:
            _, address, region = best
            window = list(range(*self.backing.pages_of(address, size)))
        to_map = (window[0] + np.flatnonzero(region.handles[window[0]:window[-1] + 1] == 0)).tolist()
        if to_map:
            self._supply(region, window, len(to_map), size)
        with Transaction() as txn:
            self.backing.map_for_placement(region, to_map, txn, unit_pages=0 if self.units_closed else self.growth.unit_pages_for(len(to_map), self.capacity_pages, self.space.mapped))
            address = self._heaps[region.index].allocate_at(address, size)
        return self.carve(region, address, size, nbytes)

    def _supply(self, region: Region, window: list[int], need: int, size: int) -> None:
        """Before mapping `need` pages of `window` for a block of `size` bytes: unmap the donors the growth
        policy (`defrag.page_growth`) asks for, so that the store's cached and new handles back the rest.
        Within the budget nothing is unmapped; beyond it, empty mapped pages elsewhere (stitching).
        Units that blocks hold in part are broken first when the placement stitches past the units'
        ceiling, or when the request is short without their pages (`_break_units`).
        NoSpace when the store and the empty pages outside `window` together hold fewer than `need`
        pages (the ladder's quick count of free pages lets through a window whose first and last pages
        other blocks hold: those need no physical page). Nothing is unmapped then, except what a break
        did: units broken, and the empty pages that gave their used pages new ones, stay so (their
        blocks and bytes are where they were)."""
        store = self.space.store
        backing = self.backing
        broke = 0
        # The policy's view is the pool's before any break: what a break frees is for this placement to
        # take (donors, the store), not room to grow into (a view taken after the break needed 3 MiB more
        # on average at the serving trace's smallest capacities, four seeds: docs/benchmarks.md).
        args = self._growth_args(size)
        if not self.units_closed and self.growth.beyond_unit_ceiling(self.space.mapped + need, self.capacity_pages):
            self.units_closed = True  # near its capacity once, the pool makes no more units
        supply = self.growth.supply(need, donors=self.books.empty, **args)  # an upper bound
        if not supply.stitched and need <= store.available:
            return
        # Past the ceiling, a placement that stitches (it synchronizes anyway) first frees, in one batch,
        # what units strand.
        if self.units_closed and store.units:
            broke = self._break_units(region, window)
        masks = backing.empty_masks(region, window)  # the same pages for the count and the choice
        donors = backing.count_empty(masks=masks)
        if need > store.available + donors and store.units and broke >= 0:  # not again after a fault
            self._break_units(region, window, need - store.available - donors)
            masks = backing.empty_masks(region, window)  # donors it unmapped are in the store now
            donors = backing.count_empty(masks=masks)
        if need > store.available + donors:
            raise NoSpace(f"needs {need} new pages, {store.available + donors} can be had")
        supply = self.growth.supply(need, donors=donors, **args)
        # Which pages go is the same whatever is known of the device (a dry and a real pool place alike);
        # whether they wait for it is not: a face's native fast path places blocks the backing never
        # hears of, so there every batch waits.
        donors = backing.donors(region, window, supply.stitched + supply.give_back, masks)
        backing.unmap_empty(donors, idle_known=True)  # every placement, native or not, clears `idle`
        backing.age_empty()

    def _growth_args(self, size: int) -> dict:
        """The growth policy's view of the pool now, for a request of `size` bytes."""
        store, c = self.space.store, self.books.counters()  # the block counters are the books'
        return dict(mapped=self.space.mapped, live_bytes=c["allocated_bytes"] + c["pending_bytes"],
                    request_bytes=size, page_size=self.page_size, cached=len(store.cached),
                    creatable=store.creatable + store.spare_pages, capacity=self.capacity_pages)

    def _break_units(self, region: Region, window: list[int], short: int | None = None) -> int:
        """Free physical pages stranded in partly used units outside `window` by breaking them
        (`Backing.break_units`, in one batch): all of them, or with `short` the fewest that free
        `short` pages, fewest used pages first (each needs a page per used page, from the store or
        from empty pages elsewhere, and frees its empty ones). Only while no other thread that used
        the pool runs (a write between the copy and the swap would be lost: the mesh's rule) and no
        CUDA graph is captured (it synchronizes). Returns the pages freed, or -1 after a driver fault,
        which rolls the batch back and is logged (the pages stay stranded, nothing is lost)."""
        backing, store = self.backing, self.space.store
        units = backing.partly_used_units(region, window)
        if not units or not self.scope(None).everything or self._capturing():
            return 0
        masks = backing.empty_masks(region, window)
        spendable = store.available + backing.count_empty(masks=masks)
        chosen, used_total, freed = [], 0, 0
        for unit_region, first, used, empty in units:
            if short is not None and freed >= short:
                break
            if used_total + used > spendable:
                continue
            chosen.append((unit_region, first))
            used_total += used
            freed += empty
        if not chosen:
            return 0
        txn = Transaction()
        try:
            if used_total > store.available:  # the used pages' new pages come from empty pages elsewhere
                backing.unmap_empty(backing.donors(region, window, used_total - store.available, masks))
            with txn:
                freed = backing.break_units(chosen, txn)
        except CudaError as exc:
            if txn.undo_errors:  # a unit could not be mapped back: its blocks' bytes are not where the books say
                raise
            _log.warning("defrag: breaking %d units failed (rolled back): %s", len(chosen), str(exc))  # no frame kept
            return -1
        self.counters["units.broken"] += len(chosen)
        self.counters["units.freed_pages"] += freed
        return freed

    def break_stranded_units(self) -> int:
        """Break every unit that blocks hold in part (`_break_units`, nothing kept out): for a rescue that
        works on single pages (meshing). Returns the pages freed (-1 after a driver fault, rolled back)."""
        return self._break_units(None, []) if self.space.store.units else 0

    def _capturing(self) -> bool:
        """Whether a CUDA graph is being captured on the legacy stream or the stream being placed for (a
        break synchronizes, which would invalidate the capture); True where the driver refuses to say
        (an implicit capture: a blocking stream capturing, asked about the legacy stream)."""
        try:
            return any(self.driver.is_capturing(s) for s in {0, self._placing_stream})
        except CudaError:
            return True

    # ------------------------------------------------------------------ the ladder
    def allocate(self, nbytes: int, rescue=None, describe=None, stream: int = 0, *, can_rewrite=None) -> Block:
        """Place `nbytes` for `stream`, climbing the ladder on failure; OutOfRoom when nothing helps.

        The ladder: place; wait for stream-ordered releases and place again;
        `rescue(nbytes, tried)` (a face's automatic compaction, returning a
        Block or None); then OutOfRoom, whose message `describe(block)` helps
        write (the largest live blocks); `can_rewrite(block)`, the face's verdict of what could move
        (`Mover.can_rewrite`), its figures of what a compaction could free.
        """
        tried = []
        try:
            return self.place(nbytes, stream)
        except NoSpace as exc:
            tried.append(f"placement ({exc})")
        self.counters["num_alloc_retries"] += 1
        if self.books.pending:
            self.wait_pending()
            tried.append("waiting for stream-ordered frees")
            try:
                return self.place(nbytes, stream)
            except NoSpace:
                pass
        if rescue is not None:
            rescued = rescue(nbytes, tried)
            if rescued is not None:
                return rescued
        self.counters["num_ooms"] += 1
        if self.history is not None:
            self.history.oom(nbytes)
        raise self.out_of_room(nbytes, tried, describe, can_rewrite)

    def out_of_room(self, nbytes: int, tried: list[str], describe=None, can_rewrite=None) -> OutOfRoom:
        """The explained out-of-memory error for `nbytes` (`defrag.readout.out_of_room`)."""
        return readout.out_of_room(self, nbytes, tried, describe, can_rewrite)

    # ------------------------------------------------------------------ statistics
    def reset_peaks(self) -> None:
        """Every peak back to its current value (the books' block counters and the core's own)."""
        self.books.reset_peaks()
        self.peaks.clear()
        self.peaks.update({"reserved_bytes": self.space.mapped * self.page_size})

    def stranded(self) -> tuple[int, float]:
        """(`stranded_bytes`, `fragmentation`) as `stats_locked` gives them, without the other figures:
        free bytes in the heaps (ranges kept for reuse returned first) beyond the empty mapped
        pages, and their share of the mapped bytes."""
        self.flush_reuse()
        stranded = sum(h.free_bytes() for h in self._heaps) - self.books.empty * self.page_size
        reserved = self.space.mapped * self.page_size
        return stranded, (stranded / reserved if reserved else 0.0)

    def stats_locked(self) -> dict:
        """Counters and gauges in PyTorch's key grammar (the gate is held; `defrag.readout.stats`)."""
        return readout.stats(self)

    def layout(self) -> dict:
        """A plain-dict picture of the core (`defrag.readout.layout`)."""
        return readout.layout(self)

    def check_invariants(self) -> None:
        """AssertionError if an invariant of the books is broken (`defrag.readout.check_invariants`)."""
        readout.check_invariants(self)

    # ------------------------------------------------------------------ trim / close
    def trim(self) -> int:
        """Unmap pages that hold no block and release every cached physical page; returns bytes released."""
        self.drain()
        self.wait_pending()
        self.flush_reuse()
        return self.backing.trim()

    def has_live_blocks(self) -> bool:
        return any(not b.retired for b in self.blocks())

    def give_back_idle(self) -> None:
        """After close, with blocks still live: unmap what holds none and release cached pages."""
        self.flush_reuse()
        self.backing.trim()


class WaveBooks:
    """A compaction wave's books (`Core.waves`): the one interface through which `defrag.compactor`
    changes blocks' records.

    A wave moves blocks of one region, with the core's gate held throughout.
    Its books change in two steps:

    1. `begin_moves`, before the copy: every destination range taken in the
       heap and counted on its pages in one batch (with `vacate`, every old
       range given back at once), undone by the wave's `Transaction`;
    2. the commit, one of two ways:
       - `move_to`, when the face moved every owner in place: each old block
         re-addressed to its destination (the same `Block`, all its fields);
       - `record_moves` (destination blocks, retired and not counted; undone
         by the transaction), then `swap_in` for each move (the destination
         takes its old block's place) and `forget` for the old blocks whose
         ranges `begin_moves` vacated.

    `move_to` and `swap_in` record each move in the history while one is
    recorded. Nothing here copies a byte, maps a page or calls the face: the
    compactor does that between these steps.
    """

    def __init__(self, books, backing: Backing):
        self._books = books
        self._backing = backing  # its heaps (one per region) and its history recorder

    def begin_moves(self, region: Region, olds: list[Block], addresses: list[int], txn: Transaction, *,
                    vacate: bool) -> None:
        """The heap and page books of a compaction wave before its commit, in one batch, undone by
        `txn`: the range at each of `addresses` is taken for the block of `olds` at the same index
        (same size). With `vacate`, the old ranges also go back to the heap and off their pages now;
        the old blocks stay recorded (their owners still use them). No block is recorded at the new
        ranges: the commit either re-addresses the old blocks (`move_to`) or records destination
        blocks (`record_moves`).

        Vacating early is for a wave whose face lets go of the old ranges at the commit: the
        wave's copy still reads them, but nothing can allocate them before the gate is released,
        and on the emulated device all of this runs before the copy leaves the host's caches cold.
        """
        heap = self._backing.heaps[region.index]
        sizes = [old.size for old in olds]
        frees = [old.address for old in olds] if vacate else []
        heap.exchange_lists(frees, addresses, sizes)
        txn.on_rollback(heap.exchange_lists, addresses, frees, sizes[:len(frees)])
        if vacate:
            self._account(region, addresses + frees, sizes + sizes, [+1] * len(sizes) + [-1] * len(sizes))
            txn.on_rollback(self._account, region, addresses + frees, sizes + sizes,
                            [-1] * len(sizes) + [+1] * len(sizes))
        else:
            self._account(region, addresses, sizes, +1)
            txn.on_rollback(self._account, region, addresses, sizes, -1)

    def _account(self, region: Region, addresses: list[int], sizes: list[int], delta) -> None:
        """Count blocks of one region on (+1) or off (-1) their pages, keeping the empty-page count, in
        one native call. `delta`: +1 or -1 for every block, or a list of them (one per block)."""
        deltas = [delta] * len(addresses) if isinstance(delta, int) else delta
        self._books.account_many(region.index, addresses, sizes, deltas)


    def record_moves(self, region: Region, olds: list[Block], addresses: list[int], txn: Transaction) -> list[Block]:
        """Destination blocks over the ranges `begin_moves` took, one per block of `olds` (same size and
        owner; retired and not counted until the commit swaps them in: `swap_in`), recorded in the books
        without touching the heap or the pages again; `txn`'s undo forgets them."""
        blocks = []
        txn.on_rollback(self.forget, blocks)
        add, index = self._books.add, region.index
        for address, old in zip(addresses, olds):
            block = Block(address, old.size, old.nbytes, region, 0, True, False, False, old.owner)
            add(block, index, address, old.size, old.nbytes, False, True, 0, True)
            blocks.append(block)
        return blocks

    def swap_in(self, old: Block, new: Block) -> None:
        """The commit of one move through a destination (`record_moves`): `new` takes `old`'s place
        (its pins, owner, sharing and info; live and counted), `old` is retired and not counted; the
        history records the move. Cannot fail."""
        self._books.exchange_state(old.address, old, new.address, new)
        new.retired, new.counted = False, True
        old.counted = False
        new.pins, new.owner, new.shared, new.info = old.pins, old.owner, old.shared, old.info
        old.retired = True
        history = self._backing.history
        if history is not None:
            history.block_moved(old.address, new.address, new.nbytes)

    def move_to(self, blocks: list[Block], addresses: list[int]) -> None:
        """The commit of a wave whose owners took their new ranges in place: each block of `blocks`
        is now recorded at the address at the same index (taken by `begin_moves` with `vacate`),
        the same Block object with all its fields. Cannot fail once the books' check passed (it
        raises before any change)."""
        self._books.move([block.address for block in blocks], blocks, addresses)
        history = self._backing.history
        for block, address in zip(blocks, addresses):
            if history is not None:
                history.block_moved(block.address, address, block.nbytes)
            block.address = address

    def forget(self, blocks: list[Block]) -> None:
        """Drop the records of blocks whose ranges `begin_moves` already settled with the heap and the
        pages: the old blocks it vacated, once their wave committed, or, as `record_moves`'s undo step,
        destination blocks never swapped in. A release still to come for one of them (its user's old
        storage dying) then finds nothing to do."""
        self._books.forget([block.address for block in blocks], blocks)
        for block in blocks:
            block.keepalive = None
