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

Lifetime. A face calls `release(block)` from any thread at any time (it only
queues); releases are applied at the next safe point (`drain()`, called at
the start of every face call with the gate held). A face may defer a release
until the device is done with the block (`defer`, stream events on CUDA).
Pages left with no live block stay mapped ("empty") until their physical page
is needed elsewhere, `trim()`, an explicit compaction or `release_all()`.

Threads: `gate` is the core's lock and knows which threads wait at it; every
block belongs to the thread that made it (`defrag.threads`), and `scope()`
says which blocks a compaction called from this thread may move (the
contract is written out in `defrag.pool`).
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from . import native, readout, threads
from .backing import Backing, NoSpace
from .driver import Driver
from .errors import CudaOutOfMemoryError, PoolAsleepError, PoolClosedError, StaleAccessError
from .heap import ALIGNMENT
from .page_growth import GrowthPolicy
from .readout import OutOfRoom
from .threads import Scope
from .units import format_bytes
from .vmm import Region, Transaction


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
    pending: bool = False  # released, waiting on the face's deferral (active, not allocated)
    owner: object = None  # weakref to the ThreadToken of the thread that allocated, adopted or claimed it
    shared: bool = False  # declared used by several threads: no thread owns it
    info: object = None  # the face's data about the block's user; follows the data when it moves
    deferral: tuple | list = ()  # the face's "device done with it" markers (have .query())
    keepalive: object = None  # the face's release hook for this range (dropped when the block is freed)
    offloaded: bool = False  # on host-located pages (defrag.residency): never moved until reloaded




class UnseenRange(NamedTuple):
    """In the release queue: the range of a block the core never recorded (the fast path made and
    freed it between two syncs), to keep for reuse at its turn among the queued Blocks."""

    size: int
    region: int  # index
    address: int


# Blocks of at least this many pages are packed end to end (a window starting in a free tail wins over
# an equally cheap page-aligned one); smaller ones start on a page boundary unless a tail saves a page.
# Measured on dry replays (smallest capacity, MiB): a 2.7B model's forward pass (a public
# cs336_2.7b_forward snapshot) 32,686 page-aligned -> 32,326 packed, under the 32,356 PyTorch's
# expandable segments need; the shared ctx128 training step 52,422 -> 52,310 (no compaction: -114). Packing
# every size instead strands tails that only sub-page blocks could use: two snapshots' smallest
# capacities without compaction grew by 2-3 pages; from 4 pages up, one (select_n, +2 pages) does.
PACK_PAGES = 4


def _spill_window(regions, heaps, page_size: int, size: int):
    """Where a block of `size` (under a page) that needs one new page anyway can start in the free tail
    of the last mapped page before an unmapped one and spill into it: (region, start address, the two
    pages), the largest such tail, or None. The same one page is mapped, and the free space after the
    block stays in one piece."""
    best = None
    for region, heap in zip(regions, heaps):
        mapped = region.handles != 0
        for q in np.flatnonzero(mapped[:-1] & ~mapped[1:]).tolist():
            run = heap.free_range_ending_at(region.address(q + 1))
            if run is None or run[1] >= size or run[1] + page_size < size:
                continue
            if best is None or run[1] > best[0]:
                first = (run[0] - region.base) // page_size
                best = (run[1], region, run[0], list(range(first, q + 2)))
    return None if best is None else best[1:]


def _cheapest_window(region, free_ranges, page_size: int, size: int):
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
    """
    P = page_size
    unmapped = region.handles == 0
    pieces = []
    if free_ranges:
        fr = np.asarray(free_ranges, dtype=np.int64).reshape(-1, 2)
        pieces.append(np.stack([fr[:, 0], fr[:, 0] + fr[:, 1]], axis=1))
    edges = np.flatnonzero(np.diff(np.concatenate(([False], unmapped, [False])).astype(np.int8)))
    if edges.size:
        pieces.append(np.stack([region.base + edges[0::2] * P, region.base + edges[1::2] * P], axis=1))
    if not pieces:
        return None
    pieces = np.concatenate(pieces)
    pieces = pieces[np.argsort(pieces[:, 0], kind="stable")]
    starts, ends = pieces[:, 0], pieces[:, 1]
    # Runs of touching pieces (pieces never overlap: the heap's free ranges lie on mapped pages).
    new_run = np.ones(len(pieces), dtype=bool)
    new_run[1:] = starts[1:] != ends[:-1]
    run_id = np.cumsum(new_run) - 1
    run_start = starts[new_run][run_id]
    run_end = ends[np.flatnonzero(np.append(new_run[1:], True))][run_id]
    cand = np.concatenate([starts, ends - size])
    lo, hi = np.concatenate([run_start, run_start]), np.concatenate([run_end, run_end])
    ok = (cand >= lo) & (cand + size <= hi)
    if not ok.any():
        return None
    cand = cand[ok]
    first = (cand - region.base) // P
    before = np.concatenate(([0], np.cumsum(unmapped)))
    need = before[(cand + size - 1 - region.base) // P + 1] - before[first]
    off_page = ((cand - region.base) % P != 0) if size < PACK_PAGES * P else np.zeros(len(cand), dtype=bool)
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
        self.gate = threads.Gate()  # the lock; knows which threads wait at it (see scope)
        self.defer = None  # face hook: block -> list of markers with .query(), or [] to free at once
        self.closed = False
        self._released: collections.deque[Block] = collections.deque()
        self.counters: collections.Counter = collections.Counter()
        self.peaks: collections.Counter = collections.Counter()
        # The books (native, `defrag/native/books.h`): every region's heap, page counts, the empty-page
        # count and the freed ranges kept for reuse. The fast path places and releases through them too.
        self.books = native.load_module().Books(page_size)
        # The pages under the regions: every map, unmap, stitch and re-backing (`defrag.backing`).
        self.backing = Backing(driver, self.books, page_size, capacity_pages, self.peaks)
        self.growth = GrowthPolicy() if growth is None else growth  # when placement grows, when it stitches
        self.space = self.backing.space
        self._heaps = self.backing.heaps  # per region: its native Heap (`defrag/native/heap.h`)
        self._blocks: dict[int, Block] = {}  # block address -> Block (live and retired)
        self._pending: list[Block] = []  # released, waiting on their deferral markers
        self.users = threads.Users(self.gate, label)  # the threads that used the core: each block's owner
        # A face's allocation fast path (`defrag.fastpath.FastPath`): `sync(core)` records
        # what it did since the last call. Called before the core reads anything.
        self.front = None
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

    def heap(self, region: Region):
        """The heap of `region` (free ranges; faces and the compactor read it, the core carves it),
        with every range kept for reuse back in it."""
        self.flush_reuse()
        return self._heaps[region.index]

    def free_ranges(self, region: Region) -> list[tuple[int, int]]:
        """(address, size) of every free range of `region`, ranges kept for reuse included."""
        return self.heap(region).free_ranges()

    def blocks(self):
        """Every block (live, retired, pending), unordered: a read-only view."""
        return self._blocks.values()

    def block_at(self, address: int) -> Block | None:
        """The live block starting at `address`, or None (retired and pending ones are not live)."""
        block = self._blocks.get(address)
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
        """What a compaction called from this thread may move now (the gate is held): `threads.Users.scope`."""
        return self.users.scope(mode)

    # ------------------------------------------------------------------ release queue
    def release(self, block: Block) -> None:
        """The block's user is gone (any thread, any time): queue it; applied at the next `drain()`."""
        front = self.front
        if front is not None:
            front.release(block)  # one order with the fast path's own releases
        else:
            self._released.append(block)

    def requeue(self, items: list) -> None:
        """A face's fast path hands over its releases in order (the gate is held): Blocks, and the
        `UnseenRange`s of blocks the core never recorded, to keep at their turn."""
        self._released.extend(items)

    def drain(self, *, made_too: bool = True) -> None:
        """Apply queued releases (a safe point: the gate is held), after recording what the face's fast
        path did. `made_too=False`: record only its releases, so that their ranges are kept for it
        again; the blocks it made stay unrecorded (the books count them on their pages; the core's
        blocks and counters do not yet), so nothing may read blocks or counters until the next full
        drain (a face's refill before it retries its fast path)."""
        if self.front is not None:
            self.front.sync(self, made_too=made_too)
        while self._released:
            block = self._released.popleft()
            if type(block) is UnseenRange:
                self.books.release_range(*block)
                continue
            if self._blocks.get(block.address) is not block:
                continue  # already gone (defensive: each owner releases once)
            # Retired ranges were synchronized before their data moved: free now.
            if self.defer is not None and not self.closed and not block.retired:
                markers = self.defer(block)
                if markers:
                    # Like PyTorch: a block waiting on stream events is active, not allocated.
                    self.bump("allocated_bytes", -block.size)
                    block.counted, block.pending, block.deferral = False, True, markers
                    self.counters["pending_bytes"] += block.size
                    self._pending.append(block)
                    continue
            self.free(block, keep=True)
        if self.front is not None:
            self.front.settled()
        if self._pending:
            still = []
            for block in self._pending:
                if all(m.query() for m in block.deferral):
                    self.free(block, keep=True)
                else:
                    still.append(block)
            self._pending = still

    def settle(self) -> None:
        """Make the books exact (the gate is held): queued releases applied, deferred ones waited for,
        ranges kept for reuse back in the heaps. Before a compaction plans, or residency picks pages."""
        self.drain()
        self.wait_pending()
        self.flush_reuse()

    def has_backlog(self) -> bool:
        """Whether releases wait in the queue for the next `drain`."""
        return bool(self._released)

    def wait_pending(self) -> None:
        """Wait for every deferred release still in flight (before declaring OOM, compacting, closing)."""
        if self._pending:
            self.driver.synchronize()
            for block in self._pending:
                self.free(block, keep=True)
            self._pending = []

    # ------------------------------------------------------------------ page accounting
    def _account(self, block: Block, delta: int) -> None:
        """Count `block` on (+1) or off (-1) its pages, keeping the empty-page count."""
        self.books.account(block.region.index, block.address, block.size, delta)
        if delta > 0:
            self.backing.touched(block.region.index, block.address, block.size)

    def _account_many(self, region: Region, addresses: list[int], sizes: list[int], delta) -> None:
        """`_account` for many blocks of one region at once (a compaction wave's), in one native call.
        `delta`: +1 or -1 for every block, or a list of them (one per block)."""
        deltas = [delta] * len(addresses) if isinstance(delta, int) else delta
        self.books.account_many(region.index, addresses, sizes, deltas)
        for address, size, d in zip(addresses, sizes, deltas):
            if d > 0:
                self.backing.touched(region.index, address, size)

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
        heap = self._heaps[region.index]
        sizes = [old.size for old in olds]
        frees = [old.address for old in olds] if vacate else []
        heap.exchange_lists(frees, addresses, sizes)
        txn.on_rollback(heap.exchange_lists, addresses, frees, sizes[:len(frees)])
        if vacate:
            self._account_many(region, addresses + frees, sizes + sizes, [+1] * len(sizes) + [-1] * len(sizes))
            txn.on_rollback(self._account_many, region, addresses + frees, sizes + sizes,
                            [-1] * len(sizes) + [+1] * len(sizes))
        else:
            self._account_many(region, addresses, sizes, +1)
            txn.on_rollback(self._account_many, region, addresses, sizes, -1)

    def record_moves(self, region: Region, olds: list[Block], addresses: list[int], txn: Transaction) -> list[Block]:
        """Destination blocks over the ranges `begin_moves` took, one per block of `olds` (same size and
        owner; retired and not counted until the commit swaps them in), dropped by `txn`'s undo."""
        blocks = [Block(address, old.size, old.nbytes, region, 0, True, False, False, old.owner)
                  for address, old in zip(addresses, olds)]
        self._blocks.update(zip(addresses, blocks))
        txn.on_rollback(self.forget, blocks)
        return blocks

    def move_to(self, blocks: list[Block], addresses: list[int]) -> None:
        """The commit of a wave whose owners took their new ranges in place: each block of `blocks`
        is now recorded at the address at the same index (taken by `begin_moves` with `vacate`),
        the same Block object with all its fields. Cannot fail."""
        records, history = self._blocks, self.history
        for block, address in zip(blocks, addresses):
            if records.get(block.address) is block:
                del records[block.address]
            if history is not None:
                history.block_moved(block.address, address, block.nbytes)
            block.address = address
            records[address] = block

    def forget(self, blocks: list[Block]) -> None:
        """Drop the records of blocks whose ranges `begin_moves` already settled with the heap and the
        pages (the gate is held): the old blocks it vacated, once their wave committed, or, as
        `record_moves`'s undo step, destination blocks never swapped in. Releases still queued for them then find
        nothing to do (`drain` frees a block only while the core still holds it)."""
        history = self.history
        for block in blocks:
            if self._blocks.get(block.address) is block:
                del self._blocks[block.address]
                block.keepalive = None
                if history is not None:
                    history.block_freed(block)

    def carve(self, region: Region, address: int, size: int, nbytes: int, *, counted: bool = True) -> Block:
        """Record a block over a range the heap has just allocated."""
        block = Block(address, size, nbytes, region, counted=counted, owner=self.user())
        self._blocks[address] = block
        self._account(block, +1)
        if counted:
            self._allocated(size)
            self.counters["num_allocs"] += 1
        return block

    def fill(self, region: Region, address: int, size: int, info) -> Block:
        """A block over the free range [address, address + size) with no user: retired (never moved),
        not counted; `free` gives the range back. For residency's fillers."""
        self._heaps[region.index].allocate_at(address, size)
        block = self.carve(region, address, size, 0, counted=False)
        block.retired, block.info = True, info
        return block

    def unplace(self, block: Block) -> None:
        """Undo the `carve` of a block nothing uses yet, keeping its range for the next request of its size
        (a face's fast path, which makes the user's tensor and counts the allocation itself)."""
        del self._blocks[block.address]
        self.books.release_range(block.size, block.region.index, block.address)
        self.counters["allocated_bytes"] -= block.size
        self.counters["num_allocs"] -= 1

    def _allocated(self, delta: int) -> None:
        """`bump("allocated_bytes", delta)`, unrolled: it runs twice per allocation."""
        c, peaks = self.counters, self.peaks
        allocated = c["allocated_bytes"] + delta
        c["allocated_bytes"] = allocated
        if allocated > peaks["allocated_bytes"]:
            peaks["allocated_bytes"] = allocated
        active = allocated + c["pending_bytes"]
        if active > peaks["active_bytes"]:
            peaks["active_bytes"] = active

    def free(self, block: Block, *, keep: bool = False) -> None:
        """Free a block's range (the gate is held; nothing may use it any more).

        It goes back to the heap at once, unless `keep` (the release path,
        `drain`, passes it; undo steps never do, since the steps after them
        expect the heap as it was). Then the range is kept carved for the
        next request of its exact size (`place` takes it without touching the
        heap: the common case of a training step or a decode loop, which
        frees and asks for the same sizes again). Everything else that reads or changes the heap's free
        space first returns every kept range to it (`flush_reuse`): a request
        of a size not kept, unmapping, compaction, statistics, layout and
        invariant checks. So kept ranges never make the pool map a page,
        never leave a hole uncoalesced for a request of another size, and
        never make a statistic wrong. Pages and counters count the range as
        free at once.
        """
        if keep:
            self.books.release_range(block.size, block.region.index, block.address)
        else:
            self.books.free(block.region.index, block.address)  # a piece on a mesh's twin page goes to its primary
            self._account(block, -1)
        block.keepalive = None
        del self._blocks[block.address]
        if block.counted:
            self._allocated(-block.size)
            self.counters["num_frees"] += 1
        elif block.pending:
            self.counters["pending_bytes"] -= block.size
            self.counters["num_frees"] += 1
        if self.history is not None:
            self.history.block_freed(block)

    def flush_reuse(self) -> None:
        """Give every range `free` kept for reuse back to the heap (coalescing it with its neighbours),
        after recording what the face's fast path did."""
        if self.front is not None:
            self.front.sync(self)
        released = self._released
        if released and any(type(item) is UnseenRange for item in released):
            # Ranges the fast path freed wait in the release queue: they go to the heap
            # now too (nothing else records them: no block, not kept).
            books = self.books
            for item in released:
                if type(item) is UnseenRange:
                    books.release_range(*item)
            blocks = [item for item in released if type(item) is not UnseenRange]
            released.clear()
            released.extend(blocks)
        self.books.flush_kept()

    def note_peak(self, peak: int) -> None:
        """Allocated bytes rose `peak` above the counters at some point (a face's fast path, between
        syncs): raise the peaks to match."""
        c, peaks = self.counters, self.peaks
        top = c["allocated_bytes"] + peak
        if top > peaks["allocated_bytes"]:
            peaks["allocated_bytes"] = top
        if top + c["pending_bytes"] > peaks["active_bytes"]:
            peaks["active_bytes"] = top + c["pending_bytes"]

    def record_made(self, blocks: list[Block], allocs: int, frees: int, peak: int) -> None:
        """What a face's fast path did since its last sync (the gate is held).

        `blocks`: the live blocks it carved from kept ranges, each with its
        owner and info; `allocs`, `frees`: how many it made and freed (blocks
        made and freed in between included); `peak`: the highest its allocated
        bytes rose above the count at its last sync. Afterwards pages,
        counters, peaks and the threads that used the core are as if `place`
        and `free` had run.
        """
        c = self.counters
        self.note_peak(peak)
        owners = {}  # by identity: a dead thread's weak reference cannot be hashed
        for block in blocks:  # the books counted them on their pages when they placed them
            self._blocks[block.address] = block
            c["allocated_bytes"] += block.size
            owners[id(block.owner)] = block.owner
        c["num_allocs"] += allocs
        c["num_frees"] += frees
        self.users.note(owners.values())

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

    def bump(self, key: str, delta: int) -> None:
        """Add `delta` to a counter, tracking its peak (and the active bytes' peak)."""
        c = self.counters
        c[key] += delta
        if c[key] > self.peaks[key]:
            self.peaks[key] = c[key]
        active = c["allocated_bytes"] + c["pending_bytes"]
        if active > self.peaks["active_bytes"]:
            self.peaks["active_bytes"] = active

    # ------------------------------------------------------------------ mapping
    @staticmethod
    def round(nbytes: int) -> int:
        return -(-nbytes // ALIGNMENT) * ALIGNMENT

    # ------------------------------------------------------------------ placement
    def place(self, nbytes: int) -> Block:
        """Place `nbytes` without compacting; NoSpace when it does not fit now."""
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
        tail = _spill_window(self.space.regions, self._heaps, self.page_size, size)
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
        if k > free_pages:
            raise NoSpace(f"needs {k} free pages, {free_pages} can be had")
        best = None
        for region, heap in zip(self.space.regions, self._heaps):
            found = _cheapest_window(region, heap.free_ranges(), self.page_size, size)
            if found is not None and (best is None or found[0] < best[0]):
                best = (*found, region)
        if best is None:
            region = self.add_region(max(k, self.capacity_pages))
            address, window = region.base, list(range(k))
        else:
            _, address, region = best
            window = list(range(*self.backing.pages_of(address, size)))
        to_map = [p for p in window if not region.handles[p]]
        if to_map:
            self._supply(region, window, len(to_map), size)
        with Transaction() as txn:
            self.backing.map_for_placement(region, to_map, txn)
            address = self._heaps[region.index].allocate_at(address, size)
        return self.carve(region, address, size, nbytes)

    def _supply(self, region: Region, window: list[int], need: int, size: int) -> None:
        """Before mapping `need` pages of `window` for a block of `size` bytes: unmap the donors the growth
        policy (`defrag.page_growth`) asks for, so that the store's cached and new handles back the rest.
        Within the budget nothing is unmapped; beyond it, empty mapped pages elsewhere (stitching)."""
        store, c = self.space.store, self.counters
        args = dict(mapped=self.space.mapped, live_bytes=c["allocated_bytes"] + c["pending_bytes"],
                    request_bytes=size, page_size=self.page_size, cached=len(store.cached),
                    creatable=store.creatable, capacity=self.capacity_pages)
        supply = self.growth.supply(need, donors=self.books.empty, **args)  # an upper bound: cheap
        if not supply.stitched:
            return
        backing = self.backing
        supply = self.growth.supply(need, donors=backing.count_empty(region, window), **args)
        # Which pages go is the same whatever is known of the device (a dry and a real pool place alike);
        # whether they wait for it is not: a face's native fast path places blocks the backing never
        # hears of, so there every batch waits.
        donors = backing.donors(region, window, supply.stitched + supply.give_back)
        backing.unmap_empty(donors, idle_known=self.front is None)
        backing.age_empty()

    # ------------------------------------------------------------------ the ladder
    def allocate(self, nbytes: int, rescue=None, describe=None) -> Block:
        """Place `nbytes`, climbing the ladder on failure; OutOfRoom when nothing helps.

        The ladder: place; wait for deferred releases and place again;
        `rescue(nbytes, tried)` (a face's automatic compaction, returning a
        Block or None); then OutOfRoom, whose message `describe(block)` helps
        write (the largest live blocks).
        """
        tried = []
        try:
            return self.place(nbytes)
        except NoSpace as exc:
            tried.append(f"placement ({exc})")
        self.counters["num_alloc_retries"] += 1
        if self._pending:
            self.wait_pending()
            tried.append("waiting for stream-ordered frees")
            try:
                return self.place(nbytes)
            except NoSpace:
                pass
        if rescue is not None:
            rescued = rescue(nbytes, tried)
            if rescued is not None:
                return rescued
        self.counters["num_ooms"] += 1
        if self.history is not None:
            self.history.oom(nbytes)
        raise self.out_of_room(nbytes, tried, describe)

    def out_of_room(self, nbytes: int, tried: list[str], describe=None) -> OutOfRoom:
        """The explained out-of-memory error for `nbytes` (`defrag.readout.out_of_room`)."""
        return readout.out_of_room(self, nbytes, tried, describe)

    # ------------------------------------------------------------------ statistics
    def reset_peaks(self) -> None:
        c = self.counters
        self.peaks.clear()
        self.peaks.update({"allocated_bytes": c["allocated_bytes"], "pending_bytes": c["pending_bytes"],
                           "active_bytes": c["allocated_bytes"] + c["pending_bytes"],
                           "reserved_bytes": self.space.mapped * self.page_size})

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
        return any(not b.retired for b in self._blocks.values())

    def give_back_idle(self) -> None:
        """After close, with blocks still live: unmap what holds none and release cached pages."""
        self.flush_reuse()
        self.backing.trim()
