"""Sleep, wake, offload and reload: take device pages away from blocks and give them back at the same addresses. No torch.

The pool owns its virtual addresses, so it can change what backs them
without changing a pointer: every view, raw `data_ptr()` and captured CUDA
graph stays valid across these calls (they only have to wait for the bytes).

- **sleep / wake** (`sleep`, `wake`): sleep copies the bytes of every live
  block on device pages to one pinned host buffer (`Driver.alloc_host`,
  `cuMemAllocHost`; one queued copy per run of neighbouring blocks, then one
  synchronize), unmaps every device page and releases every handle (the
  pages cached by the store too), and keeps the reservations and the books
  (heap, blocks, page counts) exactly as they were; the pages are `ASLEEP`
  (see `defrag.vmm`). Wake maps device pages at the same addresses and copies
  the bytes back. Blocks named in `discard` are not copied: they come back
  filled with zeros. While asleep the core refuses every call that needs
  device memory (`Core.check_open` raises `PoolAsleepError`); a kernel the
  pool cannot see that touches a sleeping tensor reads unmapped memory (on a
  GPU an illegal-address error; on the emulated device zeros, reported as a
  `StaleAccessError` at the next pool call). Pages already offloaded stay
  host-backed and addressable through a sleep.
- **offload / reload** (`offload`, `reload`): the pages under some blocks
  are backed by host-located physical pages (`Driver.create(host=True)`:
  `cuMemCreate` with a host NUMA location) mapped at the same addresses, so
  the blocks stay readable and writable by the device (over the bus), and the
  device pages are released to the driver. Pages are the unit: the blocks
  are first packed into pages of their own (`compactor.move_blocks`), so no
  other block rides along, and the free space left in those pages is filled
  with *filler* blocks so that nothing new is placed in host memory.
  Offloaded blocks never move (`movability.Scope.blocker`), and the face's hold on each
  keeps it alive until it is reloaded, so a host page never becomes an
  empty page the core could hand out. Reload swaps device pages back under
  whole pages (every block on them comes back) and drops the holds.

What backs each page changes only through the core's backing
(`defrag.backing`: `put_to_sleep`, `wake_pages`, `reback`,
`release_to_driver`); this module decides what to copy and when, and keeps
the fillers and holds. Every step is a transaction (`vmm.Transaction`): a driver fault at any call
leaves every block's bytes and the books as they were. The device handles a
sleep or an offload gives up are released only after the new state is
complete (copy first, then swap, then free); a driver that refuses one of
those releases leaves the handle cached in the store (counted in
`pages.cached`, reused first, released by `trim()`), logged and counted in
the report's `kept_pages`, without undoing the finished operation.

Nothing here knows about tensors: the face resolves its objects to blocks
and passes a `keep(block)` callback that returns a strong reference to the
block's owner (for torch: its storage).
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from .backing import with_whole_units
from .compactor import PROGRESS_BYTES, Mover, PhaseTimer, move_blocks, progress_bar
from .core import Block, Core, Scope
from .errors import CudaError, NotSupportedError, PoolClosedError, ResidencyError
from .units import format_bytes
from .vmm import DEVICE, HOST, Region, Transaction

_log = logging.getLogger("defrag")


@dataclass
class ResidencyReport:
    """What one sleep, wake, offload or reload did. `phases` holds seconds per step."""

    action: str
    pages: int = 0  # pages whose backing changed
    tensors: int = 0  # blocks whose bytes changed place (or were kept/dropped by a sleep)
    copied_bytes: int = 0  # bytes copied between device and host memory
    discarded_bytes: int = 0  # sleep(discard=...): bytes not kept (zeros at wake)
    moved_tensors: int = 0  # offload: blocks packed into pages of their own first
    moved_bytes: int = 0
    kept_pages: int = 0  # handles the driver refused to release (kept cached; trim() retries)
    page_size: int = 0
    seconds: float = 0.0
    phases: dict = field(default_factory=dict)

    def __str__(self) -> str:
        phases = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.phases.items())
        parts = [f"{self.action}: {self.pages} pages ({format_bytes(self.pages * self.page_size)})",
                 f"{self.tensors} tensors, {format_bytes(self.copied_bytes)} copied"]
        if self.discarded_bytes:
            parts.append(f"{format_bytes(self.discarded_bytes)} discarded")
        if self.moved_tensors:
            parts.append(f"{self.moved_tensors} tensors ({format_bytes(self.moved_bytes)}) packed first")
        if self.kept_pages:
            parts.append(f"{self.kept_pages} pages the driver would not release, kept cached")
        return "; ".join(parts) + f"; {self.seconds * 1e3:.1f} ms [{phases}]"

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class _Filler:
    """`Block.info` of a filler: free space on a host page, held so nothing new lands in host memory."""

    kind = "filler"


class Residency:
    """One core's residency state, kept on `core.space.residency` (`vmm.AddressSpace.release_all`
    calls `release()`)."""

    def __init__(self, core: Core):
        self.driver = core.driver
        self.buffer = 0  # the pinned host buffer holding a sleep's bytes (0: none)
        self.saved: list[tuple[int, int, int]] = []  # (address, size, offset in buffer) kept over a sleep
        self.discarded: list[tuple[int, int]] = []  # (address, size) a sleep did not keep: zeros at wake
        self.holds: dict[int, object] = {}  # offloaded block address -> the face's strong reference
        self.fillers: dict[tuple[int, int], list[Block]] = collections.defaultdict(list)  # (region, page) -> fillers
        self.stray_host: list[int] = []  # host handles the driver refused to release; retried later

    def release(self) -> None:
        """The address space is going away: free the sleep's buffer, drop holds. Never raises."""
        self.holds.clear()
        if self.buffer:
            try:
                self.driver.free_host(self.buffer)
            except CudaError as exc:
                _log.error("defrag: could not free a sleeping pool's host buffer: %s", str(exc))
            self.buffer, self.saved, self.discarded = 0, [], []
        self.stray_host = _release_quietly(self.driver, self.stray_host)


def state(core: Core) -> Residency:
    """The core's `Residency`, made on first use."""
    if core.space.residency is None:
        core.space.residency = Residency(core)
    return core.space.residency


def _release_quietly(driver, handles: list[int]) -> list[int]:
    """Release each handle; returns those the driver refused (logged)."""
    kept = []
    for h in handles:
        try:
            driver.release(h)
        except CudaError as exc:
            _log.warning("defrag: the driver refused to release a host page (%s); retried at the next reload", str(exc))
            kept.append(h)
    return kept


def _peak(core: Core, key: str, value: int) -> None:
    if value > core.peaks[key]:
        core.peaks[key] = value


def _release_to_driver(core: Core, handles: list[int], report: ResidencyReport) -> None:
    """After a committed sleep or offload: give these device handles back to the driver
    (`Backing.release_to_driver`; one it refuses stays cached, counted in `kept_pages`)."""
    report.kept_pages = core.backing.release_to_driver(handles)


# ---------------------------------------------------------------------- sleep / wake
def runs(saved: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """(address, size, buffer offset) entries, in address order, with every entry that continues the one
    before it both in device memory and in the buffer merged into it: one copy per run of neighbours."""
    out: list[list[int]] = []
    for address, size, offset in saved:
        if out and out[-1][0] + out[-1][1] == address and out[-1][2] + out[-1][1] == offset:
            out[-1][1] += size
        else:
            out.append([address, size, offset])
    return [tuple(r) for r in out]


def sleep(core: Core, *, discard=(), progress: bool | None = None) -> ResidencyReport:
    """Copy every live block on device pages to host memory, release every device page; keep the books.

    `discard`: blocks whose bytes need not survive (they read zeros after
    `wake`). Raises ResidencyError (nothing changes) when already asleep. On
    any failure before the last device page is unmapped everything is
    restored (same handles, same bytes) and the error propagates.
    """
    space, driver, P = core.space, core.driver, core.page_size
    if space.sleeping:
        raise ResidencyError(f"{core.label} is already asleep: pool.wake() first")
    if core.backing.meshes():
        # v1: waking would need a physical page per virtual page of every mesh (docs/meshing.md).
        raise ResidencyError(f"{core.label} has meshed pages (pages sharing physical memory): pool.unmesh() "
                             f"first; nothing was put to sleep")
    res = state(core)
    report = ResidencyReport("sleep", page_size=P)
    t0 = time.perf_counter()
    core.settle()
    with PhaseTimer(report.phases, "sync"):
        driver.synchronize()
    # 1. What holds nothing goes first (a failure here leaves an awake, consistent pool).
    with PhaseTimer(report.phases, "trim"):
        core.backing.trim()
    dropped = {b.address for b in discard}
    blocks = sorted((b for b in core.blocks() if not b.retired and not b.offloaded), key=lambda b: b.address)
    keep = [b for b in blocks if b.address not in dropped]
    lost = [b for b in blocks if b.address in dropped]
    total = sum(b.size for b in keep)
    buffer, saved, handles = 0, [], []
    bar = progress_bar(total, progress, "defrag sleep", large=total > PROGRESS_BYTES)
    try:
        with Transaction() as txn:
            # 2. Copy out, into one pinned host buffer: blocks packed in address order, so neighbours
            # are one copy; all queued, then one synchronize.
            with PhaseTimer(report.phases, "copy"):
                if total:
                    buffer = driver.alloc_host(total)
                    txn.on_rollback(driver.free_host, buffer)
                offset = 0
                for b in keep:
                    saved.append((b.address, b.size, offset))
                    offset += b.size
                for address, size, at in runs(saved):
                    driver.copy_to_host_async(buffer + at, address, size)
                    bar.update(size)
                driver.synchronize()
            # 3. Unmap every device page; undone by mapping the same handle again.
            with PhaseTimer(report.phases, "unmap"):
                handles = core.backing.put_to_sleep(txn)
    finally:
        bar.close()
    space.sleeping = True
    res.buffer, res.saved, res.discarded = buffer, saved, [(b.address, b.size) for b in lost]
    # 4. Release the handles (the bytes are in the host buffer now).
    with PhaseTimer(report.phases, "release"):
        _release_to_driver(core, handles, report)
    report.pages = len(handles)
    report.tensors = len(blocks)
    report.copied_bytes = total
    report.discarded_bytes = sum(b.size for b in lost)
    report.seconds = time.perf_counter() - t0
    core.counters["num_sleeps"] += 1
    core.counters["sleep.host_bytes"] = total
    _peak(core, "sleeping_bytes", space.asleep * P)
    return report


def wake(core: Core, *, progress: bool | None = None) -> ResidencyReport:
    """Map device pages where the pool slept and copy the bytes back; the pool is awake again.

    ResidencyError when the pool is awake; StaleAccessError (nothing changes)
    when a tensor of the pool was touched while it slept. On any failure
    (the device out of memory included) every page is unmapped again, the
    handles taken are released (best effort), the host buffer is kept and
    the pool stays asleep.
    """
    space, driver, P = core.space, core.driver, core.page_size
    if core.closed:
        raise PoolClosedError(f"{core.label} is closed")
    if not space.sleeping:
        raise ResidencyError(f"{core.label} is awake: wake() follows sleep()")
    core.check_untouched()  # a tensor touched while asleep is reported here, before anything changes
    res = state(core)
    report = ResidencyReport("wake", page_size=P)
    t0 = time.perf_counter()
    total = sum(size for _, size, _ in res.saved)
    bar = progress_bar(total, progress, "defrag wake", large=total > PROGRESS_BYTES)
    try:
        with Transaction() as txn:
            # 1. Map device pages (from the store: cached first, then new) where the pool slept.
            with PhaseTimer(report.phases, "map"):
                report.pages = core.backing.wake_pages(txn)
            # 2. Copy the bytes back (neighbours in one copy, all queued, one synchronize); what sleep
            # discarded reads zeros.
            with PhaseTimer(report.phases, "copy"):
                for address, size, offset in runs(res.saved):
                    driver.copy_from_host_async(address, res.buffer + offset, size)
                    bar.update(size)
                for address, size in res.discarded:
                    driver.memset(address, 0, size)
                driver.synchronize()
            # 3. Last: free the buffer (a failure leaves the pool asleep with its bytes).
            if res.buffer:
                driver.free_host(res.buffer)
    except BaseException as exc:
        try:
            space.store.trim(0)  # a sleeping pool holds no device page
        except CudaError:
            pass
        if isinstance(exc, CudaError):
            exc.add_note(f"{core.label} stays asleep with every tensor's bytes kept: pool.wake() again "
                         f"(after freeing device memory if the device was full)")
        raise
    finally:
        bar.close()
    report.tensors = len(res.saved) + len(res.discarded)
    report.copied_bytes = total
    report.discarded_bytes = sum(size for _, size in res.discarded)
    res.buffer, res.saved, res.discarded = 0, [], []
    space.sleeping = False
    core.counters["num_wakes"] += 1
    core.counters["sleep.host_bytes"] = 0
    _peak(core, "reserved_bytes", space.mapped * P)
    report.seconds = time.perf_counter() - t0
    return report


# ---------------------------------------------------------------------- offload / reload
def _touched(core: Core, blocks) -> dict[int, set[int]]:
    """region index -> pages touched by `blocks`."""
    out = collections.defaultdict(set)
    for b in blocks:
        first, end = core.backing.pages_of(b)
        out[b.region.index].update(range(first, end))
    return out


def _free_run(core: Core, region: Region, k: int) -> int | None:
    """The first page of a run of `k` pages of `region` that no block touches and no unit maps (a
    unit's page is never re-backed alone), or None."""
    used = region.unit_start >= 0
    for b in core.blocks():
        if b.region is region:
            first, end = core.backing.pages_of(b)
            used[first:end] = True
    free = np.concatenate(([False], ~used, [False])).astype(np.int8)
    edges = np.flatnonzero(np.diff(free))
    for start, end in zip(edges[0::2].tolist(), edges[1::2].tolist()):
        if end - start >= k:
            return start
    return None


def _pack(core: Core, mover: Mover, cold: list[Block], scope: Scope, engine, report: ResidencyReport,
          pack: bool = True) -> list[Block]:
    """Move the cold blocks that share a page with any other block into a run of pages of their own.

    Returns the cold blocks as they are afterwards (a moved block is a new `Block`)."""
    cold = list(cold)
    P = core.page_size
    cold_ids = {id(b) for b in cold}
    by_region = collections.defaultdict(list)
    for b in cold:
        by_region[b.region.index].append(b)
    for index, blocks in by_region.items():
        region = core.regions[index]
        pages = _touched(core, blocks)[index]
        shared = set()
        for other in core.blocks():
            if other.region is region and id(other) not in cold_ids:
                first, end = core.backing.pages_of(other)
                shared.update(p for p in range(first, end) if p in pages)
        # A unit's page is re-backed only with its whole unit, which offload never does: its blocks move.
        shared.update(p for p in pages if region.unit_start[p] >= 0)
        if not shared:
            continue
        # Every cold block touching a shared page moves, and so (transitively, through pages
        # those share with other cold blocks) does none other: the rest keep pages of their own.
        movers = [b for b in blocks if any(p in shared for p in range(*core.backing.pages_of(b)))]
        if not pack:
            raise ResidencyError(f"offload(pack=False): {len(movers)} of these tensors share pages with tensors "
                                 f"that stay on the device, or lie in pages created as one unit; nothing was "
                                 f"offloaded (pack=True moves them first)")
        for b in movers:
            why = scope.blocker(b, mover.can_rewrite)
            if why:
                raise ResidencyError(
                    f"offload: a {format_bytes(b.nbytes)} tensor shares a page with tensors that stay on the "
                    f"device and cannot be packed into pages of its own ({why}); nothing was offloaded")
        movers.sort(key=lambda b: (-(b.size >= P), b.address))
        cursor, dests = 0, []
        for b in movers:
            if b.size >= P:
                cursor = -(-cursor // P) * P
            dests.append(cursor)
            cursor += b.size
        k = -(-cursor // P)
        start = _free_run(core, region, k)
        if start is None:
            raise ResidencyError(f"offload: no run of {k} free virtual pages in region {index} to pack the "
                                 f"tensors into; nothing was offloaded")
        base = region.address(start)
        vacated = set()
        for b in movers:
            vacated.update(range(*core.backing.pages_of(b)))
        moved = move_blocks(core, mover, [(b, base + d) for b, d in zip(movers, dests)], engine=engine, scope=scope)
        report.moved_tensors += moved.moved_tensors
        report.moved_bytes += moved.moved_bytes
        now = {id(b): core.block_at(base + d) for b, d in zip(movers, dests)}
        cold = [now.get(id(b), b) for b in cold]
        # Pages the packing emptied go back to the driver too (not pages that were empty before).
        emptied = [(r, p) for r, p in core.backing.empty_mapped() if r is region and p in vacated]
        if emptied:
            core.backing.give_back(emptied)  # a page the driver refuses stays cached: usable, trim() retries
    return cold


def _fill(core: Core, region: Region, page: int, res: Residency, txn: Transaction) -> None:
    """Hold the free space of one page with filler blocks (undone by `txn`)."""
    P = core.page_size
    lo, hi = region.address(page), region.address(page) + P
    for off, size in core.free_ranges(region):
        a, b = max(off, lo), min(off + size, hi)
        if a >= b:
            continue
        filler = core.fill(region, a, b - a, _Filler())
        res.fillers[(region.index, page)].append(filler)
        txn.on_rollback(_unfill, core, res, region.index, page, filler)


def _unfill(core: Core, res: Residency, index: int, page: int, filler: Block) -> None:
    core.free(filler)
    fillers = res.fillers.get((index, page))
    if fillers and filler in fillers:
        fillers.remove(filler)
        if not fillers:
            del res.fillers[(index, page)]


def offload(core: Core, mover: Mover, blocks, *, keep, scope: Scope | None = None, engine: str | None = None,
            pack: bool = True, progress: bool | None = None) -> ResidencyReport:
    """Back the pages under `blocks` with host-located pages at the same addresses; release their device pages.

    `keep(block)`: the face's strong reference to the block's owner, held
    until the block is reloaded. Blocks already offloaded are skipped.
    Errors before anything changes: ValueError for a pinned block;
    NotSupportedError where the driver has no host-located pages (or their
    granularity does not divide the page size); ResidencyError when a block
    that shares a page with others cannot be packed into pages of its own.
    Packing moves blocks like a compaction (the face rewrites their owners;
    raw addresses taken before change); `pack=False` refuses instead
    (ResidencyError) when a block shares a page with one that stays. Packing
    moves may be done when a later step fails; they change no block's bytes.
    See the module docstring.
    """
    space, driver, P = core.space, core.driver, core.page_size
    res = state(core)
    report = ResidencyReport("offload", page_size=P)
    t0 = time.perf_counter()
    cold = []
    for b in blocks:
        if b.pins:
            raise ValueError(f"offload: a pinned tensor ({format_bytes(b.nbytes)}) cannot be offloaded; pinned "
                             f"tensors stay where they are (pool.unpin it first); nothing was offloaded")
        if not b.offloaded and b not in cold:
            cold.append(b)
    if not cold:
        return report
    for b in cold:
        first, end = core.backing.pages_of(b)
        if (core.backing.mesh_ids[b.region.index][first:end] >= 0).any():
            # v1: re-backing one page of a mesh would break it, and packing cannot move its blocks.
            raise ResidencyError("offload: a tensor lies on meshed pages (sharing physical memory): "
                                 "pool.unmesh() first; nothing was offloaded")
    supported, why = driver.host_pages_supported()
    if not supported:
        raise NotSupportedError(f"offload needs host-located VMM pages, which this device does not offer: {why}. "
                                f"(pool.sleep() works without them: it copies to pinned host buffers.)")
    if P % driver.host_granularity:
        raise NotSupportedError(f"offload: the pool's page size ({format_bytes(P)}) is not a multiple of the host "
                                f"page granularity ({format_bytes(driver.host_granularity)})")
    scope = scope if scope is not None else core.scope(None)
    core.settle()
    # 1. Pack: the cold blocks get pages no other block touches.
    with PhaseTimer(report.phases, "pack"):
        cold = _pack(core, mover, cold, scope, engine, report, pack)
    cold_ids = {id(b) for b in cold}
    touched = _touched(core, cold)
    for index, pages in touched.items():
        for other in core.blocks():
            if other.region.index == index and id(other) not in cold_ids:
                first, end = core.backing.pages_of(other)
                if any(p in pages for p in range(first, end)):  # packing guarantees this never happens
                    raise ResidencyError("offload: packing left a cold tensor sharing a page; nothing was offloaded")
    total = sum(len(p) for p in touched.values()) * P
    bar = progress_bar(total, progress, "defrag offload", large=total > PROGRESS_BYTES)
    olds: list[int] = []
    try:
        with Transaction() as txn:
            for index, page_set in touched.items():
                region, pages = core.regions[index], sorted(page_set)
                # 2. Fill the free space of those pages: nothing new is placed in host memory.
                with PhaseTimer(report.phases, "fill"):
                    for page in pages:
                        _fill(core, region, page, res, txn)
                # 3. Host-located pages under them, bytes copied, at the same addresses.
                with PhaseTimer(report.phases, "swap"):
                    hosts: list[int] = []
                    txn.on_rollback(_release_all, driver, hosts)
                    for _ in pages:
                        hosts.append(driver.create(P, host=True))
                    # Undone newest first: the swap (new handles unmapped), the scratch, then `hosts` released.
                    olds += core.backing.reback(region, pages, list(hosts), HOST, txn)
                report.pages += len(pages)
                bar.update(len(pages) * P)
    finally:
        bar.close()
    for b in cold:
        b.offloaded = True
        res.holds[b.address] = keep(b)
    # 4. Release the device pages to the driver.
    with PhaseTimer(report.phases, "release"):
        _release_to_driver(core, olds, report)
    report.tensors = len(cold)
    report.copied_bytes = report.pages * P
    report.seconds = time.perf_counter() - t0
    core.counters["num_offloads"] += 1
    core.counters["offload.moved_bytes"] += report.moved_bytes
    _peak(core, "offloaded_bytes", space.host_mapped * P)
    return report


def _release_all(driver, handles: list[int]) -> None:
    """Undo step: release handles created for a swap that did not happen.

    A handle the driver refuses stays in `handles`, and the error goes to the
    transaction, which records it in `undo_errors` without masking the original one.
    """
    while handles:
        driver.release(handles[-1])
        handles.pop()


def reload(core: Core, blocks=None, *, progress: bool | None = None) -> ResidencyReport:
    """Back the pages under offloaded `blocks` (None: every offloaded page) with device pages again.

    Pages are the unit: every block on those pages comes back. Blocks that
    are not offloaded are skipped. Needs a free device page per host page
    (empty mapped pages are unmapped to supply them first); ResidencyError
    when there are too few, before anything changes. On any failure every
    page stays host-backed with its bytes.
    """
    space, driver, P = core.space, core.driver, core.page_size
    res = state(core)
    report = ResidencyReport("reload", page_size=P)
    t0 = time.perf_counter()
    core.drain()
    if blocks is None:
        touched = {r.index: set(np.flatnonzero(r.backing == HOST).tolist()) for r in space.regions}
    else:
        touched = _touched(core, [b for b in blocks if b.offloaded])
    touched = {i: sorted(p for p in pages if core.regions[i].backing[p] == HOST) for i, pages in touched.items()}
    touched = {i: pages for i, pages in touched.items() if pages}
    need = sum(len(p) for p in touched.values())
    if not need:
        return report
    # Device pages for them: cached or creatable first, then empty mapped pages unmapped.
    short = need - space.store.available
    if short > 0:
        donors = core.backing.empty_mapped()
        if len(donors) < short:
            raise ResidencyError(
                f"reload needs {need} device pages ({format_bytes(need * P)}) but only "
                f"{space.store.available + len(donors)} are free in the pool: free or offload other tensors "
                f"first; nothing was reloaded")
        core.backing.unmap_empty(with_whole_units(donors[:short]))  # a unit leaves whole, or not at all
    bar = progress_bar(need * P, progress, "defrag reload", large=need * P > PROGRESS_BYTES)
    olds: list[int] = []
    back: list[Block] = []
    try:
        with Transaction() as txn:
            for index, pages in touched.items():
                region = core.regions[index]
                with PhaseTimer(report.phases, "swap"):
                    # Undone newest first: the swap (new handles unmapped), the scratch, then the
                    # store's own undo puts `handles` back in its cache.
                    handles = space.store.take(len(pages), txn)
                    olds += core.backing.reback(region, pages, list(handles), DEVICE, txn)
                report.pages += len(pages)
                bar.update(len(pages) * P)
    finally:
        bar.close()
    # Committed: the fillers go, the blocks on those pages are device-resident and movable again.
    for index, pages in touched.items():
        for page in pages:
            for filler in res.fillers.pop((index, page), []):
                core.free(filler)
    page_sets = {i: set(p) for i, p in touched.items()}
    for b in list(core.blocks()):
        if b.offloaded and b.region.index in page_sets:
            first, end = core.backing.pages_of(b)
            if any(p in page_sets[b.region.index] for p in range(first, end)):
                b.offloaded = False
                back.append(b)
    report.tensors = len(back)
    report.copied_bytes = need * P
    drop = [res.holds.pop(b.address, None) for b in back]
    res.stray_host = _release_quietly(driver, res.stray_host + olds)
    report.kept_pages = len(res.stray_host)
    del drop  # the holds go: blocks whose tensors died meanwhile are released now
    core.drain()
    report.seconds = time.perf_counter() - t0
    core.counters["num_reloads"] += 1
    return report


def close(core: Core) -> None:
    """The pool closes: drop the holds, free the fillers and a sleep's buffer (its bytes are lost).

    Pages stay as they are; `AddressSpace.release_all` handles host-backed and
    asleep pages when the last block goes.
    """
    res = core.space.residency
    if res is None:
        return
    res.holds.clear()
    for fillers in res.fillers.values():
        for filler in fillers:
            core.free(filler)
    res.fillers.clear()
    space = core.space
    space.sleeping = False
    res.release()
