"""`Pool`: a page-mapped heap whose tensors are ordinary torch tensors.

Layout. The pool reserves virtual regions and maps physical pages into them
(`defrag.vmm`). Inside mapped pages a best-fit heap (`defrag.heap`, one per
region) places blocks at 512-byte granularity:

- a block smaller than a page goes into free space of pages that are already
  mapped; only when none fits is one more page mapped;
- a block of a page or more starts on a page boundary, in a run of virtual
  pages that hold no live data, and is *stitched*: the run is backed by any
  free physical pages, wherever they were mapped before. Such a request fails
  only when the free physical pages cannot cover it (a new region is reserved
  when no run of free virtual pages is long enough).

Lifetime. Each block is owned by the torch storage over it (`defrag.tensors`):
when the last tensor or view of the storage dies, the block's release is
*queued* (from whatever thread, possibly inside a pool call through garbage
collection) and applied at the next safe point: the start of any pool call.
On CUDA a released block is reused only after an event recorded on every
stream that used it has completed (`record_stream`). Pages left with no live
block stay mapped ("empty") until their physical page is needed elsewhere,
`trim()`, a compaction or `close()`; the device is synchronized before any
unmap.

Threads (the contract; `defrag.threads` has the mechanism). Every public
method holds the pool's lock, so pool calls from several threads are
serialized. Every block belongs to the thread that allocated, adopted or
claimed it, and a compaction, explicit or automatic, moves a block only when
no other thread can be using it: blocks of the calling thread; blocks of
threads that are waiting inside a call to this pool (they run none of their
own code until the compaction is over); and, only when no other thread that
used the pool is running, every unpinned block (shared ones and those of
ended threads included). A tensor made by one thread and used by another
must be handed over: `pool.claim(t)` in the thread that takes it over, or
`pool.share(t)` when several threads use it (a shared block moves only when
no other thread that used the pool runs). The pool's own methods (`zeros`,
`full`, `adopt`, ...) finish writing a tensor before returning, and the
block is the caller's meanwhile, so no other thread's compaction sees it
half-made. `compact(threads="own")` moves only the caller's blocks;
`compact(threads="all")` insists on moving everything and raises
`ConcurrencyError` while another thread that used the pool still runs.
What the pool cannot see: a tensor handed to another thread without
`claim`/`share` (its owner's compactions may move it under the other
thread), and raw `data_ptr()`s kept by any thread (pin those tensors).
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import traceback
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from . import tensors as tz
from . import threads
from .driver import Driver, open_driver
from .errors import ConcurrencyError, CudaOutOfMemoryError, OutOfMemoryError, PoolClosedError, StaleAccessError
from .heap import ALIGNMENT, Heap
from .units import format_bytes, parse_size
from .vmm import AddressSpace, Region, Transaction

_log = logging.getLogger("defrag")
_open_pools: "weakref.WeakSet[Pool]" = weakref.WeakSet()
_pool_ids = itertools.count(1)


def open_pools() -> list["Pool"]:
    """Every pool of this process that is not closed."""
    return [p for p in list(_open_pools) if not p.closed]


@dataclass(eq=False)
class Allocation:
    """One carved heap range and the storage that owns it."""

    address: int
    size: int  # rounded to ALIGNMENT: what the heap holds
    nbytes: int  # the storage's size
    region: Region
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] | None = None
    storage_ref: object | None = None  # StorageWeakRef to the user's storage
    pins: int = 0
    origin: str = "empty"  # empty | adopt | compact
    streams: set = field(default_factory=set)  # CUDA streams that used it (record_stream)
    alloc_stream: int = 0
    retired: bool = False  # an old location whose data has moved; released when its owner dies
    counted: bool = True  # in allocated_bytes (compaction destinations count only once swapped in)
    pending: bool = False  # CUDA: released, waiting on stream events before reuse (active, not allocated)
    tensors: list = field(default_factory=list)  # weakrefs to the tensors the pool made ("rebind" mode only)
    owner: object = None  # weakref to the ThreadToken of the thread that allocated, adopted or claimed it
    shared: bool = False  # declared used by several threads (pool.share): no thread owns it


@dataclass(frozen=True)
class LiveTensor:
    """What the compactor sees of one live block (`Pool.live_tensors()`)."""

    address: int
    nbytes: int
    block_bytes: int
    dtype: torch.dtype | None
    shape: tuple[int, ...] | None
    pinned: bool
    movable: bool
    reason: str  # why not movable ("" when movable)
    owner: str = ""  # "thread 'name'", "an ended thread" or "shared"


@dataclass(frozen=True)
class _Scope:
    """Which blocks one compaction may move (see `Pool._scope`)."""

    mine: object  # the caller's owner reference (defrag.threads.owner_ref())
    idle: frozenset  # token ids of other threads parked at the pool's gate: their blocks may move
    everything: bool  # no other thread that used the pool is running: every unpinned block may move


THREAD_MODES = (None, "own", "all")


class _NoSpace(Exception):
    """Internal: placement failed; carries what was tried."""


def _page_runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """(start, length) of each run of True in a boolean array."""
    if not mask.any():
        return []
    padded = np.concatenate(([False], mask, [False])).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    starts, ends = edges[0::2], edges[1::2]
    return list(zip(starts.tolist(), (ends - starts).tolist()))


class Pool:
    """A VMM-backed tensor pool whose live tensors the compactor can move.

    `device`: "cuda:N", "emulated", None (first GPU if one works, else the
    emulated device) or a `defrag.driver.Driver`. `capacity`: bytes or a string
    such as "8GiB"; physical pages are created lazily up to it. `page_size`: a
    multiple of the device granularity (default: the granularity, 2 MiB on
    H100/H200). `auto_compact`: compact and retry when an allocation fails but
    enough memory is stranded in half-used pages.

    `min_compact_interval`: seconds that must pass between two automatic
    compactions (an allocation failing sooner raises instead of compacting
    again). `virtual_factor`: the first virtual reservation spans this many
    times the capacity (more regions are reserved when a request finds no
    long enough run of free virtual pages).

    On the emulated device tensors are CPU tensors over emulated device memory
    (`pool.device` is `cpu`); on a GPU they are CUDA tensors.

    Threads: a compaction moves only tensors no other thread can be using (the
    calling thread's, those of threads waiting inside a pool call, and every
    unpinned one when no other thread that used the pool runs); hand a tensor
    to another thread with `claim` (one new user) or `share` (several). The
    module docstring states the whole contract.
    """

    def __init__(self, device=None, capacity="8GiB", page_size=None, auto_compact=True, *,
                 min_compact_interval: float = 0.0, virtual_factor: int = 2):
        capacity_bytes = parse_size(capacity, what="capacity")
        self.driver: Driver = open_driver(device)
        granularity = self.driver.granularity
        if page_size is None:
            page_size = granularity
        else:
            page_size = parse_size(page_size, what="page_size")
            if page_size <= 0 or page_size % granularity:
                raise ValueError(f"page_size must be a positive multiple of the device granularity "
                                 f"({format_bytes(granularity)}), got {page_size}")
        if capacity_bytes < page_size:
            raise ValueError(f"capacity {format_bytes(capacity_bytes)} is smaller than one page ({format_bytes(page_size)})")
        self.id = next(_pool_ids)
        self.page_size = page_size
        self.capacity_pages = capacity_bytes // page_size
        self.capacity = self.capacity_pages * page_size
        self.auto_compact = bool(auto_compact)
        self.min_compact_interval = float(min_compact_interval)
        self.kind = self.driver.kind
        self.device = torch.device("cpu") if self.kind == "emulated" else torch.device("cuda", self.driver.ordinal)
        self.on_compact: list = []  # callbacks(report) after every compaction
        self.on_oom: list = []  # callbacks(OutOfMemoryError) before an allocation raises it
        # How a moved storage takes its new memory, fixed for the pool's life: torch's
        # _swap_data_ptr_, else defrag's small extension (built here on first use, once
        # per machine), else rebinding the tensors the pool knows (views pin blocks).
        self._can_swap = tz.can_swap_storages()

        self._gate = threads.Gate()  # the pool's lock; knows which threads wait at it (see _scope)
        self._released: collections.deque[Allocation] = collections.deque()
        self._space = AddressSpace(self.driver, page_size, self.capacity_pages)
        self._heaps: list[Heap] = []
        self._live_count: list[np.ndarray] = []  # per region: live (or retired) blocks touching each page
        self._blocks: dict[int, Allocation] = {}  # block address -> Allocation (live and retired)
        self._threads: dict[int, object] = {}  # token id -> owner ref of every thread that used the pool
        self._pending: list[tuple[Allocation, list]] = []  # CUDA: released, waiting on events
        self._closed = False
        self._counters = collections.Counter()
        self._peaks = collections.Counter()
        self._history = None  # trace recorder (record_history); see defrag.stats
        self._last_auto_compact = -math.inf
        self._add_region(self.capacity_pages * max(1, int(virtual_factor)))
        self._finalizer = weakref.finalize(self, AddressSpace.release_all, self._space)
        self._finalizer.atexit = False
        _open_pools.add(self)

    # ------------------------------------------------------------------ basics
    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._blocks)} blocks"
        return (f"<defrag.Pool #{self.id} {self.kind} capacity={format_bytes(self.capacity)} "
                f"page={format_bytes(self.page_size)} {state}>")

    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosedError(f"pool #{self.id} is closed")
        touched = self.driver.touched_unmapped()
        if touched:
            raise StaleAccessError(
                f"{format_bytes(touched)} of unmapped {self.kind} device memory was read or written since the "
                f"last pool call: a thread kept using an address after a compaction moved what was there and "
                f"its page was unmapped (on a GPU: an illegal-address error). Those reads saw zeros and those "
                f"writes were dropped; the pool's tensors are intact. Usual cause: a tensor handed to another "
                f"thread without pool.claim(t) or pool.share(t), or a raw data_ptr() kept (pin such tensors).")

    def _add_region(self, npages: int) -> Region:
        region = self._space.reserve(npages)
        self._heaps.append(Heap(region.base, region.size, ALIGNMENT))
        self._live_count.append(np.zeros(npages, dtype=np.int64))
        return region

    # ------------------------------------------------------------------ threads
    def _user(self):
        """The calling thread's owner reference, remembering that this thread used the pool."""
        token = threads.current_token()
        if token.id not in self._threads:
            self._threads[token.id] = token.ref
        return token.ref

    def _other_live_threads(self, mine) -> list:
        """Owner references of the other threads that used the pool and still run (forgets ended ones)."""
        others = []
        for tid, ref in list(self._threads.items()):
            if not threads.is_alive(ref):
                del self._threads[tid]
            elif ref is not mine:
                others.append(ref)
        return others

    def _scope(self, mode) -> _Scope:
        """What a compaction called from this thread may move now (the gate is held).

        A thread is *busy* when it used the pool, still runs, and is not
        parked at this pool's gate (see `defrag.threads.Gate`). None: the
        caller's blocks and those of parked threads, plus blocks of ended
        threads and shared blocks when no other thread is busy; "own": the
        caller's blocks only; "all": every unpinned block, refused with
        ConcurrencyError while another thread is busy.
        """
        if mode not in THREAD_MODES:
            raise ValueError(f"threads must be None, 'own' or 'all', got {mode!r}")
        mine = self._user()
        if mode == "own":
            return _Scope(mine, frozenset(), everything=False)
        idle, busy = set(), []
        for ref in self._other_live_threads(mine):
            if self._gate.parked(ref):
                idle.add(ref().id)
            else:
                busy.append(ref)
        if mode == "all" and busy:
            names = ", ".join(threads.describe(r) for r in busy[:5]) + (" ..." if len(busy) > 5 else "")
            raise ConcurrencyError(
                f"compact(threads='all') needs every other thread that used pool #{self.id} to have ended "
                f"(or to wait inside a pool call), but {len(busy)} still run ({names}): join them first, "
                f"or call pool.compact() in each thread to move its own tensors")
        return _Scope(mine, frozenset(idle), everything=not busy)

    # ------------------------------------------------------------------ release queue
    def _on_release(self, alloc: Allocation) -> None:
        """Runs when torch drops a block's owner: any thread, any time. Only queues,
        except after close, when nothing else will come to drain the queue."""
        self._released.append(alloc)
        if self._closed:
            with self._gate:
                self._drain()
                self._release_if_idle()

    def _drain(self) -> None:
        """Apply queued releases (a safe point: the lock is held)."""
        while self._released:
            alloc = self._released.popleft()
            if self._blocks.get(alloc.address) is not alloc:
                continue  # already gone (defensive: each owner releases once)
            # Retired ranges were synchronized before their data moved: free now.
            if self.kind == "cuda" and not self._closed and not alloc.retired:
                events = []
                for stream in {alloc.alloc_stream, *alloc.streams}:
                    event = torch.cuda.Event()
                    event.record(torch.cuda.ExternalStream(stream, device=self.device) if stream else
                                 torch.cuda.default_stream(self.device))
                    events.append(event)
                # Like PyTorch: a block waiting on stream events is active, not allocated.
                self._bump("allocated_bytes", -alloc.size)
                alloc.counted, alloc.pending = False, True
                self._counters["pending_bytes"] += alloc.size
                self._pending.append((alloc, events))
                continue
            self._free(alloc)
        if self._pending:
            still = []
            for alloc, events in self._pending:
                if all(e.query() for e in events):
                    self._free(alloc)
                else:
                    still.append((alloc, events))
            self._pending = still

    def _wait_pending(self) -> None:
        """Wait for every stream-ordered release still in flight (before declaring OOM)."""
        if self._pending:
            self.driver.synchronize()
            for alloc, _ in self._pending:
                self._free(alloc)
            self._pending = []

    # ------------------------------------------------------------------ page accounting
    def _pages_of(self, alloc_or_addr, size=None) -> tuple[int, int]:
        if size is None:
            addr, size, region = alloc_or_addr.address, alloc_or_addr.size, alloc_or_addr.region
        else:
            addr, region = alloc_or_addr, self._space.region_of(alloc_or_addr)
        first = (addr - region.base) // self.page_size
        last = (addr + size - 1 - region.base) // self.page_size
        return first, last + 1

    def _account(self, alloc: Allocation, delta: int) -> None:
        first, end = self._pages_of(alloc)
        counts = self._live_count[alloc.region.index]
        if end == first + 1:
            counts[first] += delta  # the common case, without a slice
        else:
            counts[first:end] += delta

    def _carve(self, region: Region, address: int, size: int, nbytes: int, *, counted: bool = True) -> Allocation:
        alloc = Allocation(address, size, nbytes, region, counted=counted, owner=self._user())
        self._blocks[address] = alloc
        self._account(alloc, +1)
        if counted:
            self._bump("allocated_bytes", size)
            self._counters["num_allocs"] += 1
        return alloc

    def _free(self, alloc: Allocation) -> None:
        heap = self._heaps[alloc.region.index]
        heap.free(alloc.address)
        self._account(alloc, -1)
        del self._blocks[alloc.address]
        if alloc.counted:
            self._bump("allocated_bytes", -alloc.size)
            self._counters["num_frees"] += 1
        elif alloc.pending:
            self._counters["pending_bytes"] -= alloc.size
            self._counters["num_frees"] += 1
        if self._history is not None:
            self._history.block_freed(alloc)

    def _bump(self, key: str, delta: int) -> None:
        c = self._counters
        c[key] += delta
        if c[key] > self._peaks[key]:
            self._peaks[key] = c[key]
        active = c["allocated_bytes"] + c["pending_bytes"]
        if active > self._peaks["active_bytes"]:
            self._peaks["active_bytes"] = active

    # ------------------------------------------------------------------ placement
    def _round(self, nbytes: int) -> int:
        return -(-nbytes // ALIGNMENT) * ALIGNMENT

    def _empty_mapped_pages(self, keep: Region | None = None, keep_pages=()) -> list[tuple[Region, int]]:
        """Mapped pages that hold no block, except `keep_pages` of region `keep`
        (a request's or a wave's own destination pages, when looking for donors)."""
        out = []
        for region in self._space.regions:
            mask = (region.handles != 0) & (self._live_count[region.index] == 0)
            if region is keep:
                mask[np.fromiter(keep_pages, dtype=np.int64)] = False
            out.extend((region, int(p)) for p in np.flatnonzero(mask))
        return out

    def _unmap_recorded(self, region: Region, pages: list[int]) -> None:
        try:
            self._space.unmap(region, pages)
        finally:
            if self._history is not None:
                self._history.pages_unmapped(region, pages)

    def _unmap_empty(self, pages: list[tuple[Region, int]]) -> None:
        """Unmap mapped pages that hold no block; their handles become cached."""
        by_region: dict[int, list[int]] = collections.defaultdict(list)
        for region, page in pages:
            heap = self._heaps[region.index]
            heap.remove_free(region.address(page), self.page_size)
            by_region[region.index].append(page)
        for index, plist in by_region.items():
            region = self._space.regions[index]
            try:
                self._unmap_recorded(region, plist)
            finally:
                # Whatever stayed mapped (a failed unmap) gets its free range back.
                for page in plist:
                    if region.handles[page]:
                        self._heaps[index].insert_free(region.address(page), self.page_size)

    def _map_into_heap(self, region: Region, pages: list[int], txn: Transaction) -> None:
        self._space.map(region, pages, txn)
        # Peaks are tracked where mapping happens, compaction transients included.
        reserved = self._space.mapped * self.page_size
        if reserved > self._peaks["reserved_bytes"]:
            self._peaks["reserved_bytes"] = reserved
        # Undo steps run newest first: this one unmaps and records it, so the
        # history sees the unmap; the vmm's own undo then finds nothing to do.
        txn.on_rollback(self._unmap_recorded, region, list(pages))
        heap = self._heaps[region.index]
        for page in pages:
            heap.insert_free(region.address(page), self.page_size)
            txn.on_rollback(heap.remove_free, region.address(page), self.page_size)
        if self._history is not None:
            self._history.pages_mapped(region, pages)

    def _live_pages(self) -> int:
        """Pages that hold at least one block."""
        return int(sum(int((c > 0).sum()) for c in self._live_count))

    def _empty_page_count(self) -> int:
        return int(sum(int(((r.handles != 0) & (c == 0)).sum()) for r, c in zip(self._space.regions, self._live_count)))

    def _free_physical_pages(self) -> int:
        """Pages that could back a new request now: cached, creatable, or mapped but empty."""
        return self._space.store.available + self._empty_page_count()

    def _place(self, nbytes: int) -> Allocation:
        size = self._round(nbytes)
        if size < self.page_size:
            return self._place_small(size, nbytes)
        return self._place_large(size, nbytes)

    def _place_small(self, size: int, nbytes: int) -> Allocation:
        for region, heap in zip(self._space.regions, self._heaps):
            address = heap.allocate(size)
            if address is not None:
                return self._carve(region, address, size, nbytes)
        if self._space.store.available < 1:
            raise _NoSpace("no free space in mapped pages and no physical page left")
        region, page = self._first_unmapped_page()
        with Transaction() as txn:
            self._map_new(region, [page], txn)
            address = self._heaps[region.index].allocate_at(region.address(page), size)
        return self._carve(region, address, size, nbytes)

    def _map_new(self, region: Region, pages: list[int], txn: Transaction) -> None:
        """Map pages for a placement; the device running out of memory is a placement failure."""
        try:
            self._map_into_heap(region, pages, txn)
            return
        except CudaOutOfMemoryError as exc:
            # The GPU filled up before the pool reached its capacity (other users of
            # the device). Stats stop counting pages the device will not give
            # until a later creation succeeds; pages the pool already holds,
            # mapped but empty, can back this request: unmap enough and map again.
            self._space.store.device_full = True
            error = exc
        donors = self._empty_mapped_pages(region, pages)
        need = len(pages) - len(self._space.store.cached)
        if 0 < need <= len(donors):
            self._unmap_empty(donors[:need])
            self._map_into_heap(region, pages, txn)  # from cached handles only: the device is not asked
            return
        raise _NoSpace(f"the device has no free memory for {len(pages)} more page(s) ({error.name})") from error

    def _first_unmapped_page(self) -> tuple[Region, int]:
        for region in self._space.regions:
            free = np.flatnonzero(region.handles == 0)
            if free.size:
                return region, int(free[0])
        region = self._add_region(self.capacity_pages)
        return region, 0

    def _place_large(self, size: int, nbytes: int) -> Allocation:
        k = -(-size // self.page_size)
        free_pages = self._free_physical_pages()
        if k > free_pages:
            raise _NoSpace(f"needs {k} free pages, {free_pages} can be had")
        best = None  # (run length, unmapped pages in window, region, start)
        for region in self._space.regions:
            available = self._live_count[region.index] == 0
            for start, length in _page_runs(available):
                if length < k:
                    continue
                unmapped = int((region.handles[start:start + k] == 0).sum())
                key = (length, unmapped)
                if best is None or key < best[:2]:
                    best = (length, unmapped, region, start)
        if best is None:
            region, start = self._add_region(max(k, self.capacity_pages)), 0
        else:
            region, start = best[2], best[3]
        window = list(range(start, start + k))
        to_map = [p for p in window if not region.handles[p]]
        shortfall = len(to_map) - self._space.store.available
        if shortfall > 0:
            # Stitching: take physical pages from empty mapped pages elsewhere.
            donors = self._empty_mapped_pages(region, window)[:shortfall]
            self._unmap_empty(donors)
        with Transaction() as txn:
            self._map_new(region, to_map, txn)
            address = self._heaps[region.index].allocate_at(region.address(start), size)
        return self._carve(region, address, size, nbytes)

    # ------------------------------------------------------------------ allocation entry
    def _allocate(self, nbytes: int) -> Allocation:
        """Place `nbytes`, climbing the ladder on failure; raises OutOfMemoryError."""
        tried = []
        try:
            return self._place(nbytes)
        except _NoSpace as exc:
            tried.append(f"placement ({exc})")
        self._counters["num_alloc_retries"] += 1
        if self._pending:
            self._wait_pending()
            tried.append("waiting for stream-ordered frees")
            try:
                return self._place(nbytes)
            except _NoSpace:
                pass
        rescued = self._rescue(nbytes, tried)
        if rescued is not None:
            return rescued
        self._counters["num_ooms"] += 1
        if self._history is not None:
            self._history.oom(nbytes)
        error = self._oom_error(nbytes, tried)
        for observer in list(self.on_oom):
            try:
                observer(error)
            except Exception:  # an observer must not replace the OOM the caller is about to get
                _log.error("defrag: an on_oom observer raised; ignored\n%s", traceback.format_exc())
        raise error

    def _rescue(self, nbytes: int, tried: list[str]) -> Allocation | None:
        """Automatic compaction (see defrag.compactor); None when it cannot help."""
        from .compactor import auto_compact_for
        return auto_compact_for(self, nbytes, tried)

    def _oom_error(self, nbytes: int, tried: list[str]) -> OutOfMemoryError:
        st = self._stats_locked()
        pinned = sum(a.size for a in self._blocks.values() if a.pins)
        largest = sorted((a for a in self._blocks.values() if not a.retired), key=lambda a: (-a.nbytes, -a.pins))[:5]
        lines = [
            f"defrag pool #{self.id} ({self.kind}) cannot allocate {format_bytes(nbytes)} ({nbytes} bytes):",
            f"  capacity {format_bytes(self.capacity)}, live {format_bytes(st['allocated_bytes.all.current'])}, "
            f"stranded in half-used pages {format_bytes(st['stranded_bytes'])}, pinned {format_bytes(pinned)}, "
            f"largest request possible now {format_bytes(st['largest_free_bytes'])}.",
            "  tried: " + "; ".join(tried or ["placement"]),
        ]
        if largest:
            lines.append("  largest live tensors: " + ", ".join(
                f"{format_bytes(a.nbytes)} {str(a.dtype).replace('torch.', '') if a.dtype else ''}"
                f"{list(a.shape) if a.shape is not None else ''}{' (pinned)' if a.pins else ''}".strip()
                for a in largest))
        lines.append("  suggestion: " + self._oom_suggestion(nbytes, st["allocated_bytes.all.current"], pinned))
        return OutOfMemoryError("\n".join(lines), requested=nbytes, capacity=self.capacity,
                                live=st["allocated_bytes.all.current"], stranded=st["stranded_bytes"],
                                pinned=pinned, tried=tried)

    def _oom_suggestion(self, nbytes: int, live: int, pinned: int) -> str:
        """What would really make room for `nbytes`: only advice that is true of this pool and device."""
        device_total = self.driver.total_memory
        device_limited = self._space.store.device_full or self.capacity > device_total
        if nbytes > self.capacity:
            advice = f"the request is larger than the pool's capacity ({format_bytes(self.capacity)})"
            if nbytes > device_total:
                return advice + f" and than the whole device ({format_bytes(device_total)}): split the tensor."
            return advice + f": create the pool with capacity >= {format_bytes(nbytes)}."
        if device_limited and self._space.store.device_full:
            return (f"the device is the limit, not the pool: it has {format_bytes(device_total)} in all and gave "
                    f"no more pages (other pools, PyTorch's caching allocator or other processes hold the rest), "
                    f"so a larger capacity would not help; free memory held outside this pool "
                    f"(torch.cuda.empty_cache(), other pools' trim()) or ask for less.")
        free_after_compaction = self.capacity - self._pages_needed_if_packed(self._scope(None)) * self.page_size
        if nbytes <= free_after_compaction and not self.auto_compact:
            return "pool.compact() (or auto_compact=True) would make room for this request."
        steps = []
        if pinned:
            steps.append("unpin tensors you no longer need to keep in place")
        if live:
            steps.append("free tensors you no longer need")
        if self.capacity < device_total:
            steps.append(f"create the pool with a larger capacity (the device has {format_bytes(device_total)})")
        elif not steps:
            steps.append("ask for less: the pool already spans the whole device")
        return ", ".join(steps[:-1]) + (" or " if len(steps) > 1 else "") + steps[-1] + "."

    def _packing_floor(self, scope: _Scope) -> tuple[int, int]:
        """(pages touched by blocks that cannot move, bytes of blocks that can) for a compaction of `scope`."""
        pinned_pages = set()
        movable = 0
        for a in self._blocks.values():
            if a.pins or not self._movable(a, scope)[0]:
                first, end = self._pages_of(a)
                pinned_pages.update((a.region.index, p) for p in range(first, end))
            else:
                movable += a.size
        return len(pinned_pages), movable

    def _pages_needed_if_packed(self, scope: _Scope) -> int:
        """Lower bound of pages after a perfect compaction: movable bytes packed, plus pinned pages."""
        pinned_pages, movable = self._packing_floor(scope)
        return pinned_pages + -(-movable // self.page_size)

    # ------------------------------------------------------------------ public: creation
    def empty(self, *shape, dtype: torch.dtype | None = None, requires_grad: bool = False) -> torch.Tensor:
        """An uninitialized tensor over pool memory (an ordinary torch tensor).

        Zero-element tensors hold no pool memory: they are plain `torch.empty`
        results on `pool.device`.
        """
        if len(shape) == 1 and not isinstance(shape[0], int):
            shape = shape[0]
        shape = tz.check_shape(shape)
        return self._new_tensor(shape, tz.contiguous_strides(shape), dtype, requires_grad)

    def empty_strided(self, size, stride, *, dtype: torch.dtype | None = None,
                      requires_grad: bool = False) -> torch.Tensor:
        """Like `torch.empty_strided`: an uninitialized tensor of `size` with `stride`, over one pool block
        just large enough for the elements those strides reach."""
        size = tz.check_shape(size)
        stride = tz.check_shape(stride)
        if len(stride) != len(size):
            raise ValueError(f"empty_strided: {len(size)} sizes but {len(stride)} strides")
        return self._new_tensor(size, stride, dtype, requires_grad)

    def _new_tensor(self, shape: tuple, stride: tuple, dtype, requires_grad: bool) -> torch.Tensor:
        dtype = tz.check_dtype(dtype if dtype is not None else torch.get_default_dtype())
        elements = 0 if 0 in shape else 1 + sum((n - 1) * st for n, st in zip(shape, stride))
        nbytes = elements * dtype.itemsize
        with self._gate:
            self._check_open()
            self._drain()
            if nbytes == 0:
                return torch.empty_strided(shape, stride, dtype=dtype, device=self.device,
                                           requires_grad=requires_grad)
            alloc = self._allocate(nbytes)
            try:
                storage = self._storage_for(alloc)
            except BaseException:
                self._free(alloc)
                raise
            alloc.dtype, alloc.shape = dtype, shape
            if self._history is not None:
                self._history.block_allocated(alloc)
        tensor = tz.tensor_over(storage, dtype, shape, self.device, stride)
        if not self._can_swap:  # "rebind" mode only: otherwise no weakref on users' tensors (swap_tensors works)
            alloc.tensors.append(weakref.ref(tensor))
        if requires_grad:
            tensor.requires_grad_(True)
        return tensor

    def _storage_for(self, alloc: Allocation) -> torch.UntypedStorage:
        storage = tz.storage_over(self.kind, self.device, alloc.address, alloc.nbytes,
                                  lambda a=alloc: self._on_release(a))
        alloc.storage_ref = tz.weak_storage(storage)
        if self.kind == "cuda":
            alloc.alloc_stream = torch.cuda.current_stream(self.device).cuda_stream
        return storage

    def zeros(self, *shape, dtype=None, requires_grad=False) -> torch.Tensor:
        """Like `empty`, filled with zeros."""
        t = self.empty(*shape, dtype=dtype)
        with torch.no_grad():
            t.zero_()
        return t.requires_grad_(requires_grad)

    def full(self, shape, fill_value, *, dtype=None, requires_grad=False) -> torch.Tensor:
        """Like `empty`, filled with `fill_value`; without `dtype`, inferred from it as `torch.full` does."""
        if dtype is None:
            dtype = torch.tensor(fill_value).dtype
        t = self.empty(shape, dtype=dtype)
        with torch.no_grad():
            t.fill_(fill_value)
        return t.requires_grad_(requires_grad)

    def empty_like(self, other: torch.Tensor, *, dtype=None, requires_grad=False) -> torch.Tensor:
        """A contiguous uninitialized tensor with `other`'s shape (and dtype unless given)."""
        if not isinstance(other, torch.Tensor):
            raise TypeError(f"empty_like needs a tensor, got {type(other).__name__}")
        return self.empty(tuple(other.shape), dtype=dtype or other.dtype, requires_grad=requires_grad)

    def zeros_like(self, other: torch.Tensor, *, dtype=None, requires_grad=False) -> torch.Tensor:
        """A contiguous zero-filled tensor with `other`'s shape (and dtype unless given)."""
        t = self.empty_like(other, dtype=dtype)
        with torch.no_grad():
            t.zero_()
        return t.requires_grad_(requires_grad)

    def resize_(self, tensor: torch.Tensor, *shape) -> torch.Tensor:
        """Resize a pool tensor in place, as `tensor.resize_(*shape)` does, growing it inside the pool.

        torch's own `resize_` (and `out=` into a too-small pool tensor) cannot
        grow a pool tensor: its storage is memory the pool lent, which torch
        cannot reallocate ("Trying to resize storage that is not resizable").
        Here a shape that fits the storage is applied by torch; a larger one
        gets a new pool block holding the old bytes (the rest uninitialized),
        and `tensor` (the same Python object) is set to it. Other views of the
        old storage keep the old memory, which is freed when they die.
        Returns `tensor`.
        """
        if len(shape) == 1 and not isinstance(shape[0], int):
            shape = shape[0]
        shape = tz.check_shape(shape)
        with self._gate:
            self._require_own(tensor, "resize_")
        need = (tensor.storage_offset() + math.prod(shape)) * tensor.element_size()
        if need <= tensor.untyped_storage().nbytes():
            with torch.no_grad():
                return tensor.resize_(shape)
        fresh = self.empty(shape, dtype=tensor.dtype)
        old = tensor.detach().reshape(-1) if tensor.is_contiguous() else tensor.detach().contiguous().reshape(-1)
        with torch.no_grad():
            fresh.view(-1)[:old.numel()].copy_(old)
            tensor.set_(fresh.untyped_storage(), 0, shape, tz.contiguous_strides(shape))
        return tensor

    # ------------------------------------------------------------------ lookup
    def _find(self, tensor: torch.Tensor) -> Allocation | None:
        """The live block under `tensor`'s storage, or None if it is not pool memory.

        Pool storages always start at their block's address, so this is one lookup.
        """
        alloc = self._blocks.get(tensor.untyped_storage().data_ptr())
        return None if alloc is None or alloc.retired else alloc

    def _owns_address(self, ptr: int) -> bool:
        return any(r.contains(ptr) for r in self._space.regions)

    def _other_owner(self, ptr: int) -> "Pool | None":
        """The other open pool whose address space holds `ptr`, if any."""
        return next((p for p in open_pools() if p is not self and p._owns_address(ptr)), None)

    def _require_own(self, tensor, what: str) -> Allocation:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{what} needs a tensor, got {type(tensor).__name__}")
        if tensor.device != self.device:
            raise ValueError(f"{what}: tensor is on {tensor.device}, this pool's tensors are on {self.device}")
        alloc = self._find(tensor)
        if alloc is None:
            if (other := self._other_owner(tensor.untyped_storage().data_ptr())) is not None:
                raise ValueError(f"{what}: tensor belongs to pool #{other.id}, not pool #{self.id}")
            raise ValueError(f"{what}: tensor is not in pool #{self.id} (use pool.adopt to move it in)")
        return alloc

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor`'s storage is a live block of this pool."""
        with self._gate:
            self._drain()
            return isinstance(tensor, torch.Tensor) and tensor.device == self.device and self._find(tensor) is not None

    # ------------------------------------------------------------------ pin / streams
    def pin(self, tensor: torch.Tensor) -> None:
        """Keep `tensor`'s storage where it is: compaction never moves a pinned block.

        Pins count: each `pin` needs an `unpin`. Pinning a tensor that is not
        in this pool raises ValueError and changes nothing.
        """
        with self._gate:
            self._check_open()
            self._drain()
            self._require_own(tensor, "pin").pins += 1

    def unpin(self, tensor: torch.Tensor) -> None:
        """Undo one `pin`. ValueError if the tensor is not pinned."""
        with self._gate:
            self._check_open()
            self._drain()
            alloc = self._require_own(tensor, "unpin")
            if alloc.pins == 0:
                raise ValueError("unpin: tensor is not pinned")
            alloc.pins -= 1

    def share(self, tensor: torch.Tensor) -> None:
        """Declare that several threads use `tensor`: no thread owns its block any more.

        A shared block is never moved by a compaction that other running
        threads could overlap (the default, or `threads="own"`); it moves only
        with `compact(threads="all")`, which first checks that every other
        thread that used the pool has ended. Use it for tensors handed to
        other threads that keep using them (weights read by worker threads, a
        cache filled by one thread and read by another). `claim` undoes it.
        """
        with self._gate:
            self._check_open()
            self._drain()
            alloc = self._require_own(tensor, "share")
            self._user()
            alloc.owner, alloc.shared = None, True

    def claim(self, tensor: torch.Tensor) -> None:
        """Make the calling thread the only user of `tensor`: its own compactions may move it.

        For hand-offs: a batch made by a loader thread and from now on used only
        by this one, or a shared tensor no other thread touches any more. The
        previous owner's compactions stop moving it.
        """
        with self._gate:
            self._check_open()
            self._drain()
            alloc = self._require_own(tensor, "claim")
            alloc.owner, alloc.shared = self._user(), False

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        """Declare that `tensor` is used on `stream`: its block is reused only after
        that stream's work queued before the free has completed (CUDA). A no-op
        on the emulated device, where every operation is synchronous."""
        with self._gate:
            self._check_open()
            self._drain()
            alloc = self._require_own(tensor, "record_stream")
            if self.kind == "cuda":
                alloc.streams.add(int(stream.cuda_stream))

    # ------------------------------------------------------------------ adopt
    def adopt(self, obj):
        """Move existing data into the pool, keeping the caller's objects.

        - a tensor: its storage is rewritten in place (the same Python object;
          every view follows) to point at pool memory holding the same bytes;
        - an `nn.Module`: its parameters (the same Parameter objects), buffers
          and existing `.grad`s;
        - an optimizer: its state tensors (on this pool's device; others, such
          as Adam's CPU `step` next to CUDA parameters, stay where they are);
        - a list, tuple or dict (a state dict, a KV cache) of any of these,
          nested as deep as you like.

        All or nothing: every block is placed before any storage is rewritten,
        so an out-of-memory error leaves every tensor where it was. Storages
        already in this pool are left alone; storages in another pool, or
        tensors on another device (for a tensor or module), raise ValueError.
        Returns `obj`.
        """
        tensors = self._adoptable(obj)
        with self._gate:
            self._check_open()
            self._drain()
            storages = {}
            s = t = new = None
            for t in tensors:
                s = t.untyped_storage()
                if s.nbytes() == 0 or self._find(t) is not None:
                    continue
                if (other := self._other_owner(s.data_ptr())) is not None:
                    raise ValueError(f"adopt: a tensor belongs to pool #{other.id}; it cannot be adopted by pool #{self.id}")
                if s.data_ptr() in storages:
                    if not self._can_swap:
                        raise ValueError("adopt: two tensors share a storage; torch < 2.12 can only adopt a storage "
                                         "whose one tensor is known (needs UntypedStorage._swap_data_ptr_)")
                    continue
                if not self._can_swap and tz.storage_use_count(s) != 2:  # `t` and `s` alone
                    raise ValueError(f"adopt: torch {torch.__version__} lacks UntypedStorage._swap_data_ptr_, and other "
                                     "tensors or views share this tensor's storage, so they could not follow it")
                storages[s.data_ptr()] = (s, t)
            placed, fresh = [], []
            try:
                for s, t in storages.values():
                    alloc = self._allocate(s.nbytes())
                    placed.append((alloc, s, t))
                    alloc.dtype, alloc.shape, alloc.origin = t.dtype, tuple(t.shape), "adopt"
                fresh = [self._storage_for(alloc) for alloc, _, _ in placed]
            except BaseException:
                for alloc, _, _ in placed:
                    self._free(alloc)
                raise
            # Past this point nothing can fail: copy, then swap pointers.
            for (alloc, s, _), new in zip(placed, fresh):
                new.copy_(s)
            for (alloc, s, t), new in zip(placed, fresh):
                if self._can_swap:
                    tz.swap_data(s, new)
                    alloc.storage_ref = tz.weak_storage(s)
                else:
                    tz.rebind([t], new)  # proven above: `t` is the storage's only tensor
                    alloc.storage_ref = tz.weak_storage(new)
                    alloc.tensors.append(weakref.ref(t))
                if self._history is not None:
                    self._history.block_allocated(alloc)
            del fresh, s, t, new  # the old memory goes back to its own allocator now
        return obj

    def _adoptable(self, obj) -> list[torch.Tensor]:
        if isinstance(obj, torch.Tensor):
            if obj.device != self.device:
                raise ValueError(f"adopt: tensor is on {obj.device}, this pool's tensors are on {self.device}")
            if obj.is_sparse or obj.layout != torch.strided:
                raise ValueError(f"adopt: only strided tensors can be adopted, got layout {obj.layout}")
            return [obj]
        if isinstance(obj, torch.nn.Module):
            found = []
            for name, t in itertools.chain(obj.named_parameters(), obj.named_buffers()):
                if t.device != self.device:
                    raise ValueError(f"adopt: {name} is on {t.device}, this pool's tensors are on {self.device}")
                found.append(t)
                if isinstance(t, torch.nn.Parameter) and t.grad is not None:
                    found.append(t.grad)
            return found
        if isinstance(obj, torch.optim.Optimizer):
            found = []
            for state in obj.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor) and value.device == self.device and value.layout == torch.strided:
                        found.append(value)
            return found
        if isinstance(obj, (list, tuple, dict)):
            items = obj.values() if isinstance(obj, dict) else obj
            return [t for item in items for t in self._adoptable(item)]
        raise TypeError(f"adopt takes a tensor, an nn.Module, an optimizer, or a list, tuple or dict of them, "
                        f"got {type(obj).__name__}")

    # ------------------------------------------------------------------ inspection
    def _movable(self, alloc: Allocation, scope: _Scope) -> tuple[bool, str]:
        if alloc.pins:
            return False, "pinned"
        if alloc.retired:
            return False, "retired (awaiting release)"
        if scope.everything or alloc.owner is scope.mine:
            pass
        elif alloc.shared:
            return False, "shared between threads (pool.share), and another thread that used the pool is running"
        elif not threads.is_alive(alloc.owner):
            return False, ("its thread has ended, and another thread that used the pool is running (it may have "
                           "been handed the tensor: pool.claim(t) there makes it that thread's)")
        elif alloc.owner().id not in scope.idle:
            return False, (f"owned by {threads.describe(alloc.owner)}, which is running and may be using it: "
                           f"that thread's own compactions move it")
        if alloc.storage_ref is None or alloc.storage_ref.expired():
            return False, "its storage is being released"
        if not self._can_swap and self._rebindable(alloc) is None:
            return False, ("torch < 2.12 lacks UntypedStorage._swap_data_ptr_, and views or other references "
                           "to this storage exist that the pool cannot rewrite")
        return True, ""

    def _rebindable(self, alloc: Allocation, storage=None) -> list | None:
        """Torch < 2.12: the tensors to rebind, if they are provably all users of the storage.

        Pass the caller's own strong `storage` reference if it holds one (it is
        the one reference the proof allows besides the tensors).
        """
        storage = storage if storage is not None else tz.strong_storage(alloc.storage_ref)
        if storage is None:
            return None
        known = [t for t in (r() for r in alloc.tensors) if t is not None]
        return known if tz.rebind_proof(storage, known) else None

    def live_tensors(self) -> list[LiveTensor]:
        """Every live block, in address order, as a `compact()` called from this thread sees it."""
        with self._gate:
            self._drain()
            scope = self._scope(None)
            out = []
            for _, alloc in sorted(self._blocks.items()):
                if alloc.retired:
                    continue
                movable, reason = self._movable(alloc, scope)
                out.append(LiveTensor(alloc.address, alloc.nbytes, alloc.size, alloc.dtype, alloc.shape,
                                      alloc.pins > 0, movable, reason,
                                      "shared" if alloc.shared else threads.describe(alloc.owner)))
            return out

    def reset_peak_stats(self) -> None:
        """Reset every `*.peak` statistic to its current value (like `torch.cuda.reset_peak_memory_stats`)."""
        with self._gate:
            self._drain()
            c = self._counters
            self._peaks.clear()
            self._peaks.update({"allocated_bytes": c["allocated_bytes"], "pending_bytes": c["pending_bytes"],
                                "active_bytes": c["allocated_bytes"] + c["pending_bytes"],
                                "reserved_bytes": self._space.mapped * self.page_size})

    def stats(self) -> dict:
        """Counters and gauges; PyTorch's key grammar where PyTorch has the key.

        `allocated_bytes.all.*`: bytes in live blocks (rounded to 512);
        `reserved_bytes.all.*`: mapped physical bytes; `active_bytes.all.*`:
        allocated plus blocks released but waiting on stream events;
        `pages.{mapped,cached,total,empty}`; `stranded_bytes`: free bytes inside
        pages that hold live data (what compaction can recover);
        `largest_free_bytes`: the largest request that succeeds now without
        compaction; `fragmentation`: stranded / reserved.
        """
        with self._gate:
            self._drain()
            return self._stats_locked()

    def _stats_locked(self) -> dict:
        P = self.page_size
        allocated = self._counters["allocated_bytes"]
        pending = self._counters["pending_bytes"]
        mapped = self._space.mapped
        empty = self._empty_page_count()
        heap_free = sum(h.free_bytes() for h in self._heaps)
        stranded = heap_free - empty * P
        store = self._space.store
        free_pages = len(store.cached) + (0 if store.device_full else store.creatable) + empty
        if free_pages >= 1:
            largest = free_pages * P
        else:
            largest = max((h.largest_free() for h in self._heaps), default=0)
            largest = min(largest, P - ALIGNMENT)
        reserved = mapped * P
        self._peaks["reserved_bytes"] = max(self._peaks["reserved_bytes"], reserved)
        active = allocated + pending
        c = self._counters
        return {
            "allocated_bytes.all.current": allocated,
            "allocated_bytes.all.peak": self._peaks["allocated_bytes"],
            "active_bytes.all.current": active,
            "active_bytes.all.peak": self._peaks["active_bytes"],
            "reserved_bytes.all.current": reserved,
            "reserved_bytes.all.peak": self._peaks["reserved_bytes"],
            "requested_bytes.all.current": sum(a.nbytes for a in self._blocks.values()),
            "num_alloc_retries": c["num_alloc_retries"],
            "num_ooms": c["num_ooms"],
            "num_allocs": c["num_allocs"],
            "num_frees": c["num_frees"],
            "num_device_alloc": self._space.store.created,
            "num_device_free": self._space.store.created - self._space.store.total,
            "pages.mapped": mapped,
            "pages.cached": len(self._space.store.cached),
            "pages.total": self._space.store.total,
            "pages.empty": empty,
            "pages.capacity": self.capacity_pages,
            "page_size": P,
            "capacity_bytes": self.capacity,
            "free_inside_mapped_bytes": heap_free,
            "stranded_bytes": stranded,
            "largest_free_bytes": largest,
            "fragmentation": stranded / reserved if reserved else 0.0,
            "num_compactions": c["num_compactions"],
            "num_compactions.explicit": c["num_compactions.explicit"],
            "num_compactions.automatic": c["num_compactions.automatic"],
            "compaction.moved_bytes": c["compaction.moved_bytes"],
            "compaction.moved_tensors": c["compaction.moved_tensors"],
            "compaction.released_pages": c["compaction.released_pages"],
            "live_blocks": sum(1 for a in self._blocks.values() if not a.retired),
            "pinned_blocks": sum(1 for a in self._blocks.values() if a.pins),
            "regions": len(self._space.regions),
        }

    def check_invariants(self) -> None:
        """Raise AssertionError if any of DESIGN.md's pool invariants is broken (a test aid).

        Checks: blocks do not overlap; every byte of every block is mapped;
        allocated + free-inside-mapped == mapped bytes; page live counts match
        the blocks; heaps are internally consistent.
        """
        with self._gate:
            prev_end = None
            counts = [np.zeros_like(c) for c in self._live_count]
            for address, alloc in sorted(self._blocks.items()):
                assert address == alloc.address
                assert prev_end is None or address >= prev_end, f"blocks overlap at {address:#x}"
                prev_end = address + alloc.size
                first, end = self._pages_of(alloc)
                assert alloc.region.handles[first:end].all(), f"block at {address:#x} touches an unmapped page"
                counts[alloc.region.index][first:end] += 1
            for region, heap, expect, got in zip(self._space.regions, self._heaps, counts, self._live_count):
                heap.check_invariants()
                assert np.array_equal(expect, got), f"page live counts of region {region.index} disagree"
                for off, size in heap.free_ranges():
                    first, end = self._pages_of(off, size)
                    assert region.handles[first:end].all(), "free space recorded inside an unmapped page"
            allocated = sum(a.size for a in self._blocks.values())
            counted = sum(a.size for a in self._blocks.values() if a.counted)
            assert counted == self._counters["allocated_bytes"], "allocated counter disagrees with blocks"
            heap_free = sum(h.free_bytes() for h in self._heaps)
            assert allocated + heap_free == self._space.mapped * self.page_size, (
                f"allocated {allocated} + free {heap_free} != mapped {self._space.mapped * self.page_size}")
            assert self._space.store.total <= self.capacity_pages, "more physical pages than capacity"
            assert self._space.mapped + len(self._space.store.cached) == self._space.store.total

    # ------------------------------------------------------------------ trim / close
    def trim(self) -> int:
        """Unmap pages that hold no block and release every cached physical page.

        Returns the number of bytes handed back to the driver. Live tensors are
        never touched.
        """
        with self._gate:
            self._check_open()
            self._drain()
            self._wait_pending()
            self._unmap_empty(self._empty_mapped_pages())
            return self._space.store.trim(0) * self.page_size

    def close(self) -> None:
        """Close the pool: no new allocations; memory goes back to the driver.

        Closing never unmaps memory under a live tensor: pages still holding
        live tensors stay mapped until the last of those tensors dies, then
        everything is released automatically. Idempotent.
        """
        with self._gate:
            if self._closed:
                return
            self._drain()
            self._wait_pending()
            self._closed = True
            _open_pools.discard(self)
            self._release_if_idle()

    def _release_if_idle(self) -> None:
        if any(not a.retired for a in self._blocks.values()) or self._finalizer is None:
            if self._blocks:
                # Keep what is live; give back the rest now.
                self._unmap_empty(self._empty_mapped_pages())
                self._space.store.trim(0)
            return
        self._finalizer()  # AddressSpace.release_all, exactly once
        self._finalizer = None

    # ------------------------------------------------------------------ compaction
    def compact(self, *, verify: bool = False, progress: bool | None = None, engine: str | None = None,
                release: bool = True, threads: str | None = None):
        """Move live tensors so that the pages they strand become free; see `defrag.compactor`.

        `threads` says whose tensors may move (the class docstring has the
        contract): None (default) moves the calling thread's own tensors, and
        every unpinned tensor when no other thread that used the pool still
        runs; "own" only the caller's; "all" every unpinned one, shared ones
        included, and raises ConcurrencyError (changing nothing) while another
        thread that used the pool still runs.

        `verify`: compare checksums of every moved block; `progress`: a progress
        bar (None: only for large compactions); `engine`: "kernel" (GPU
        default), "memmove" (emulated default) or "driver"; `release`: unmap
        the emptied pages (else they stay mapped, empty and free for reuse).
        Returns a `CompactionReport`.
        """
        from .compactor import compact_pool
        with self._gate:
            self._check_open()
            scope = self._scope(threads)
            return compact_pool(self, verify=verify, progress=progress, engine=engine, automatic=False,
                                release=release, scope=scope)

    # ------------------------------------------------------------------ observability
    def layout(self) -> dict:
        """A plain-dict picture of the pool (for `defrag.viz` and snapshots).

        `regions`: base, npages and a per-page state ("unmapped", "empty" for a
        mapped page holding no block, "live"); `blocks`: every block with its
        address, size (rounded), nbytes, region index, pinned, dtype, shape and
        state ("live" or "retired"); plus page_size, capacity and cached pages.
        """
        with self._gate:
            self._drain()
            regions = []
            for region in self._space.regions:
                live = self._live_count[region.index] > 0
                mapped = region.handles != 0
                states = np.where(live, "live", np.where(mapped, "empty", "unmapped"))
                regions.append({"index": region.index, "base": region.base, "npages": region.npages,
                                "pages": states.tolist(),
                                "free_ranges": self._heaps[region.index].free_ranges()})
            blocks = [{"address": a.address, "size": a.size, "nbytes": a.nbytes, "region": a.region.index,
                       "pinned": a.pins > 0, "dtype": str(a.dtype).replace("torch.", "") if a.dtype else None,
                       "shape": list(a.shape) if a.shape is not None else None,
                       "state": "retired" if a.retired else ("live" if a.counted else "pending-free")}
                      for _, a in sorted(self._blocks.items())]
            return {"pool": self.id, "kind": self.kind, "device": str(self.device), "page_size": self.page_size,
                    "capacity": self.capacity, "cached_pages": len(self._space.store.cached),
                    "regions": regions, "blocks": blocks}

    def record_history(self, enabled: bool = True, *, max_entries: int = 100_000, stacks: bool = True) -> None:
        """Start (or stop) recording alloc/free/map/unmap/compaction events for `snapshot()`.

        `stacks`: record the Python frames that led to each allocation and OOM
        (the caller's frames, not defrag's), as `torch.cuda.memory.
        _record_memory_history(stacks="python")` does; they show in the
        trace entries and in the snapshot's blocks. Costs a few microseconds
        per allocation while recording.
        """
        from .stats import HistoryRecorder
        with self._gate:
            self._history = HistoryRecorder(self, max_entries=max_entries, stacks=stacks) if enabled else None

    def snapshot(self) -> dict:
        """The pool in the format of `torch.cuda.memory._snapshot()` (segments and device_traces)."""
        from .stats import snapshot
        with self._gate:
            self._drain()
            return snapshot(self)

    def summary(self) -> str:
        """A human-readable table in the spirit of `torch.cuda.memory_summary()`."""
        from .stats import summary
        return summary(self.stats(), self)
