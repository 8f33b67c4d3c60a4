"""The backing: the one place that maps, unmaps, stitches and re-backs the pool's pages. No torch.

Every change to what backs a virtual page goes through a `Backing`:

- the ladder maps new pages for a placement (`map_for_placement`) and
  *stitches* a large request from the physical pages of empty mapped pages
  elsewhere (`donors`, then `unmap_empty`: how many is `defrag.page_growth`'s
  call), waiting for the device only when a donor may still be in use
  (`idle`);
- a compaction opens destination pages (`map`, `make_room`) and gives back
  what it emptied (`unmap_empty`);
- `trim` and `close` release what holds nothing (`trim`), and packing for
  an offload gives back what it emptied (`give_back`);
- sleep takes every device page away at the same addresses (`put_to_sleep`)
  and wake brings device pages back (`wake_pages`);
- offload and reload put other physical pages, with the bytes, under the
  same addresses (`reback`), and hand the old ones to the driver
  (`release_to_driver`).

Each operation keeps three things in step: the driver's mappings and the
store of physical pages (`defrag.vmm.AddressSpace`), the free space and
empty-page count in the core's native books (a mapped page with no block
is free space of its region's heap), and the history recorder. Each is
undone by the `vmm.Transaction` it is given, newest step first.

What it does not do: decide. Which pages, when, and whether a request may
have them is the caller's (the core's placement, `defrag.compactor`,
`defrag.residency`); the backing never touches a block.
"""

from __future__ import annotations

import collections
import logging

import numpy as np

from . import native
from .driver import Driver
from .errors import CudaError, CudaOutOfMemoryError
from .page_runs import mask_runs, page_runs, run_pages
from .units import ALIGNMENT
from .vmm import ASLEEP, ASLEEP_HANDLE, DEVICE, HOST, AddressSpace, Region, Transaction

PRIMARY, TWIN = 1, 2  # a page's role in a mesh (`Backing.roles`; native/books.h MeshRole)

_log = logging.getLogger("defrag")


class NoSpace(Exception):
    """No room for a placement or a mapping; the message says what was tried (the ladder goes on from here)."""


class Backing:
    """The pages under one core's regions, and the books' view of them (see the module docstring).

    `books`: the core's native books (each region's heap and page counts
    live there). `peaks`: the core's peaks (`reserved_bytes` is raised where
    pages are mapped). `history`: the core's history recorder, or None.
    """

    def __init__(self, driver: Driver, books, page_size: int, capacity_pages: int, peaks):
        self.driver = driver
        self.books = books
        self.page_size = page_size
        self.capacity_pages = capacity_pages
        self.space = AddressSpace(driver, page_size, capacity_pages)
        self.heaps: list = []  # per region: its native Heap (`defrag/native/heap.h`), owned by the books
        self.live_count: list[np.ndarray] = []  # per region: blocks per page (a view of the books' memory)
        self.mesh_ids: list[np.ndarray] = []  # per region: each page's mesh id, -1 for none (a view, like live_count)
        self.roles: list[np.ndarray] = []  # per region: 0 unmeshed, PRIMARY or TWIN (a view)
        # Per region: pages the device is done with: empty at the last synchronize this backing made, or
        # mapped since, and no block placed on them after (the books clear a page at every placement,
        # native ones included: a view of their memory). Unmapping only such pages needs no synchronize
        # (invariant 5 asks that the device be done with them, and it is).
        self.idle: list[np.ndarray] = []
        # Per region: how many stitches in a row each page has been empty at (0: holds a block, or
        # emptied since the last). Donors are taken oldest first: the same order whatever is known of
        # the device, and the older an empty page, the likelier a synchronize has passed since it held a
        # block (so `idle`), which lets stitching skip most synchronizes.
        self.empty_age: list[np.ndarray] = []
        self.peaks = peaks
        self.history = None

    # ------------------------------------------------------------------ regions and pages
    def add_region(self, npages: int) -> Region:
        """Reserve a region of `npages` virtual pages, none mapped, with its heap in the books."""
        region = self.space.reserve(npages)
        heap = native.load_module().Heap(region.base, region.size, ALIGNMENT)
        index = self.books.add_region(heap, region.base, npages)
        assert index == region.index, "the books' regions follow the address space's"
        self.heaps.append(heap)
        self.live_count.append(self.books.counts(index))
        self.mesh_ids.append(self.books.mesh_ids(index))
        self.roles.append(self.books.roles(index))
        self.idle.append(self.books.idle(index))
        self.empty_age.append(np.zeros(npages, dtype=np.int64))
        return region

    def _all_done(self) -> None:
        """The device has just finished everything queued (a synchronize): every page no block touches is idle."""
        for region, idle in zip(self.space.regions, self.idle):
            np.copyto(idle, self.untouched(region) & (region.handles != 0))

    def pages_of(self, block_or_addr, size=None) -> tuple[int, int]:
        """[first, end) page indices, in its region, of a block or of (address, size)."""
        if size is None:
            addr, size, region = block_or_addr.address, block_or_addr.size, block_or_addr.region
        else:
            addr, region = block_or_addr, self.space.region_of(block_or_addr)
        first = (addr - region.base) // self.page_size
        last = (addr + size - 1 - region.base) // self.page_size
        return first, last + 1

    def untouched(self, region: Region) -> np.ndarray:
        """One bool per page of `region`: no block touches it (mapped and empty, or unmapped) and it is in
        no mesh. A meshed page never joins a run of pages for a placement or a compaction's zone: a
        dormant twin or an empty primary shares its physical page with pages that hold data."""
        return (self.live_count[region.index] == 0) & (self.mesh_ids[region.index] < 0)

    @property
    def empty(self) -> int:
        """Mapped pages that no block touches (the books keep it as blocks come and go)."""
        return self.books.empty

    def free_physical(self) -> int:
        """Pages that could back a new request now: cached, creatable, or mapped but empty."""
        return self.space.store.available + self.books.empty

    def live_pages(self) -> int:
        """Pages that hold at least one block."""
        space = self.space
        if not space.host_mapped and not space.asleep:
            return space.mapped - self.books.empty  # blocks lie on mapped pages only; a mesh is one page
        plain = sum(int(((c > 0) & (m < 0)).sum()) for c, m in zip(self.live_count, self.mesh_ids))
        return plain + sum(1 for *_, live in self.books.meshes() if live > 0)

    def empty_mapped(self, keep: Region | None = None, keep_pages=()) -> list[tuple[Region, int]]:
        """Mapped pages that hold no block, except `keep_pages` of region `keep`
        (a request's or a wave's own destination pages, when looking for donors)."""
        return [(region, int(p)) for region, mask in self.empty_masks(keep, keep_pages)
                for p in np.flatnonzero(mask)]

    def empty_masks(self, keep: Region | None, keep_pages) -> list[tuple[Region, np.ndarray]]:
        """`empty_mapped` as one bool array per region: [(region, mask)], what `count_empty` and `donors`
        take as `masks` to look at the same pages once. A unit's pages are in only if all of them are
        (a unit is unmapped whole: one with a block, or a page kept, holds its empty pages mapped)."""
        out = []
        meshes = self.books.meshes()
        dead = [(m[1], m[2]) for m in meshes if m[4] == 0]  # `unmap_empty` dissolves them first
        for region in self.space.regions:
            mask = region.handles != 0
            mask &= self.live_count[region.index] == 0
            if meshes:  # else no page is in a mesh: `untouched` is the live count's alone
                mask &= self.mesh_ids[region.index] < 0
            for index, primary in dead:
                if index == region.index:
                    mask[primary] = True
            if region is keep:
                mask[np.fromiter(keep_pages, dtype=np.int64)] = False
            if self.space.store.units:  # a unit leaves whole: its pages only if all of them are in
                at = np.flatnonzero(mask)
                mask[at] = region.whole_units(at)
            out.append((region, mask))
        return out

    def count_empty(self, keep: Region | None = None, keep_pages=(), masks=None) -> int:
        """`len(empty_mapped(keep, keep_pages))`, without listing them (`masks`: `empty_masks(keep,
        keep_pages)` when the caller has them)."""
        masks = self.empty_masks(keep, keep_pages) if masks is None else masks
        return sum(int(np.count_nonzero(mask)) for _, mask in masks)

    def first_unmapped_page(self) -> tuple[Region, int]:
        """The first unmapped virtual page, reserving a region of the capacity's size when none is left."""
        for region in self.space.regions:
            free = np.flatnonzero(region.handles == 0)
            if free.size:
                return region, int(free[0])
        return self.add_region(self.capacity_pages), 0

    # ------------------------------------------------------------------ mapping and unmapping
    def map(self, region: Region, pages: list[int], txn: Transaction, *, unit_pages: int = 0) -> None:
        """Map `pages` of `region` (physical pages from the store) as free space of its heap; undone by `txn`.
        `unit_pages`: create the pages no cached handle backs in units of up to that many (`AddressSpace.map`).

        On failure nothing is mapped, except pages the driver would not unmap in the undo
        (`Space.map`'s `left_mapped`): those become mapped empty pages of the heap, as if mapped
        on purpose (a later trim unmaps them), so the books still match the device."""
        try:
            self.space.map(region, pages, txn, unit_pages=unit_pages)
        except CudaError as exc:
            left = getattr(exc, "left_mapped", None)
            if left is not None:
                self._add_mapped(*left)
            raise
        self._add_mapped(region, pages, txn)

    def _add_mapped(self, region: Region, pages: list[int], txn: Transaction | None = None) -> None:
        """Count freshly mapped `pages` as empty pages of the heap (free space), with their peak and
        history; with `txn`, undone there."""
        self.books.add_empty(len(pages))  # no block on a page that was unmapped
        # A handle is cached or created only once the device is done with it (unmapped after a synchronize).
        self.idle[region.index][pages] = True
        # Peaks are tracked where mapping happens, compaction transients included.
        reserved = self.space.mapped * self.page_size
        if reserved > self.peaks["reserved_bytes"]:
            self.peaks["reserved_bytes"] = reserved
        # Undo steps run newest first: this one unmaps and records it, so the
        # history sees the unmap; the vmm's own undo then finds nothing to do.
        if txn is not None:
            txn.on_rollback(self._unmap_recorded, region, list(pages))
        heap = self.heaps[region.index]
        for first, count in page_runs(pages):
            heap.insert_free(region.address(first), count * self.page_size)
            if txn is not None:
                txn.on_rollback(heap.remove_free, region.address(first), count * self.page_size)
        if self.history is not None:
            self.history.pages_mapped(region, pages)

    def _unmap_recorded(self, region: Region, pages: list[int], sync: bool = True) -> None:
        """Unmap pages that no block touches (they were counted empty), recording it; `sync=False`: the
        caller knows the device is done with them."""
        mapped = self.space.mapped
        try:
            self.space.unmap(region, pages, sync=sync)
        finally:
            self.books.add_empty(self.space.mapped - mapped)
            if self.history is not None:
                self.history.pages_unmapped(region, pages)

    def unmap_empty(self, pages: list[tuple[Region, int]], *, idle_known: bool = False) -> None:
        """Unmap mapped pages that hold no block; their physical pages become cached in the store (a unit
        is spent, released before the next creation). Pages of a unit not all listed stay mapped.
        A failed unmap leaves the pages it did not reach mapped, with their free space back in the heap.

        One synchronize first (invariant 5), after which every empty page is idle; none when
        `idle_known` and every page is idle (the caller vouches that the pages' `idle` is up to date:
        the books clear it at every placement, and only a synchronize made elsewhere goes unseen)."""
        self.books.flush_kept()  # an empty page's free space may sit in a range kept for reuse
        self.unmap_dormant()  # an empty mesh's primary becomes a plain empty page
        by_region: dict[int, list[int]] = collections.defaultdict(list)
        for region, page in pages:
            by_region[region.index].append(page)
        sync = not (idle_known and all(self.idle[i][plist].all() for i, plist in by_region.items()))
        if sync and by_region:
            self.driver.synchronize()
            self._all_done()
        for index, plist in by_region.items():
            region = self.space.regions[index]
            heap = self.heaps[index]
            if self.space.store.units:  # a part of a unit stays mapped (empty): units leave whole
                plist = np.asarray(plist, dtype=np.int64)[region.whole_units(plist)].tolist()
            for first, count in page_runs(plist):  # consecutive empty pages are one free range
                heap.remove_free(region.address(first), count * self.page_size)
            try:
                self._unmap_recorded(region, plist, sync=False)
            finally:
                for i in np.flatnonzero(region.handles[plist]).tolist():  # pages the unmap did not reach
                    heap.insert_free(region.address(plist[i]), self.page_size)

    def map_for_placement(self, region: Region, pages: list[int], txn: Transaction, *, unit_pages: int = 0) -> None:
        """`map` for a placement: when the device runs out of memory before the pool reaches its
        capacity (other users of the device), spare units are released and the pages created one
        by one, then empty mapped pages elsewhere are unmapped to back `pages` from cached handles
        (single pages only: a unit's handle backs nothing else). NoSpace when even that cannot cover
        them."""
        store = self.space.store
        try:
            self.map(region, pages, txn, unit_pages=unit_pages)
            return
        except CudaOutOfMemoryError as exc:
            error = exc
        # A page the failed attempt's undo could not unmap is mapped already, an empty page of the heap
        # (`map`'s left_mapped): it serves as it is.
        pages = [p for p in pages if not region.handles[p]]
        if store.spare_pages:  # units held unmapped: released, the device has their room for single pages
            store.release_spare()
            try:
                self.map(region, pages, txn)
                return
            except CudaOutOfMemoryError as exc:
                error = exc
        # Stats stop counting pages the device will not give until a later creation succeeds.
        store.device_full = True
        donors = [(r, p) for r, p in self.empty_mapped(region, pages) if r.unit_start[p] < 0]
        need = len(pages) - len(store.cached)
        if need <= len(donors):
            if need > 0:
                self.unmap_empty(donors[:need])
            self.map(region, pages, txn)  # from cached handles only: the device is not asked
            return
        raise NoSpace(f"the device has no free memory for {len(pages)} more page(s) ({error.name})") from error

    def age_empty(self) -> None:
        """A stitch is done: every page empty now is one stitch older, every other page 0."""
        for region, mask in self.empty_masks(None, ()):
            age = self.empty_age[region.index]
            age += 1
            age *= mask

    def donors(self, keep: Region, keep_pages, count: int, masks=None) -> list[tuple[Region, int]]:
        """The first `count` of `empty_mapped(keep, keep_pages)` in donor order: the pages empty at the
        most stitches in a row first (`empty_age`), then those of the shortest runs of empty pages,
        then by address. A long run of empty pages holds a later large block in place, with no driver
        call; a lone empty page serves only what fits beside its neighbours' blocks. On the serving
        trace (`traces.random_serving`) this order needs a synchronize at one stitch in four, where
        shortest runs alone needed one at every other, for about as many pages mapped."""
        regions, pages, lengths, ages = [], [], [], []
        for region, mask in self.empty_masks(keep, keep_pages) if masks is None else masks:
            starts, stops = mask_runs(mask)
            if not starts.size:
                continue
            page = np.flatnonzero(mask)
            regions.append(np.full(len(page), region.index))
            pages.append(page)
            lengths.append(np.repeat(stops - starts, stops - starts))
            ages.append(self.empty_age[region.index][page])
        if not pages:
            return []
        regions, pages, lengths, ages = map(np.concatenate, (regions, pages, lengths, ages))
        order = np.lexsort((pages, regions, lengths, -ages))[:count]
        regions, pages = regions[order], pages[order]
        if self.space.store.units:  # a unit leaves whole: its other pages come along
            regions, pages = _complete_units(self.space.regions, regions, pages)
        space = self.space.regions
        return [(space[r], p) for r, p in zip(regions.tolist(), pages.tolist())]

    def make_room(self, region: Region, keep_pages, needed: int) -> None:
        """Before mapping `needed` pages of `region` (`keep_pages`, destinations included): unmap as
        many empty mapped pages elsewhere first, so mapped pages never grow; the rest comes from
        cached or new physical pages. NoSpace (nothing unmapped) when even that is not enough."""
        if needed <= 0:
            return
        donors = self.empty_mapped(region, keep_pages)
        available = self.space.store.available
        if available + len(donors) < needed:
            raise NoSpace(f"needs {needed} new pages but only {available + len(donors)} physical pages are free")
        self.unmap_empty(with_whole_units(donors[:needed]))

    def trim(self) -> int:
        """Unmap every page that holds no block and release every cached physical page to the driver;
        returns the bytes released."""
        self.unmap_empty(self.empty_mapped())
        return self.space.store.trim(0) * self.page_size

    def give_back(self, pages: list[tuple[Region, int]]) -> int:
        """Unmap these empty mapped pages and release their physical pages to the driver; one the driver
        refuses stays cached (reused first, released by `trim`). Returns how many stayed."""
        keep = len(self.space.store.cached)
        self.unmap_empty(pages)
        return self._trim_cache_to(keep)[0]

    def release_to_driver(self, handles: list[int]) -> int:
        """Give physical pages no mapping uses back to the driver, through the store: one the driver
        refuses stays cached (reused first, released by `trim`). Returns how many stayed (logged)."""
        keep = len(self.space.store.cached)
        self.space.store.put(handles)
        kept, error = self._trim_cache_to(keep)
        if kept:
            _log.warning("defrag: the driver refused to release %d device page(s) (%s); they stay cached in "
                         "the pool (trim() retries)", kept, str(error))
        return kept

    def _trim_cache_to(self, keep: int) -> tuple[int, CudaError | None]:
        """Release cached physical pages beyond the first `keep`: (how many beyond stayed, the driver's
        refusal) when the driver refuses one, else (0, None)."""
        store = self.space.store
        try:
            store.trim(keep)
        except CudaError as exc:
            return len(store.cached) - keep, exc
        return 0, None

    # ------------------------------------------------------------------ meshes (docs/meshing.md)
    def meshes(self) -> list[tuple[int, int, int, list[int], int]]:
        """Every mesh as (id, region index, primary page, twin pages, blocks on its pages)."""
        return self.books.meshes()

    def live_pieces(self, region: Region, page: int) -> list[tuple[int, int]]:
        """(offset in the page, length) of the bytes of `page` its heap holds allocated: its blocks' pieces
        (ranges kept for reuse too, unless flushed)."""
        base = region.address(page)
        return [(lo - base, n) for lo, n in self.heaps[region.index].live_pieces_in(base, base + self.page_size)]

    def mesh(self, region: Region, primary: int, twins: list[int], copy, txn: Transaction) -> list[int]:
        """Map the physical page of `primary` at every page of `twins` too, after copying each twin's live
        pieces to the same offsets of the primary page; returns the twins' old handles, which the
        caller gives back (store or driver) once `txn` commits. The books must be held and settled.

        Checks first (the books' own: every member holds blocks, the twins' pieces are disjoint and free
        on the primary; ValueError before any change), then the books (the twins manage only their
        pieces), synchronize, `copy(moves)` of (src, dst, nbytes), synchronize, and the remap: each
        twin's own handle unmapped (kept, with its bytes) and the primary's mapped there. Every step is
        undone by `txn`: the twins get their own pages back, bytes intact, and the books are as before.
        No physical page is needed at any point."""
        space, driver = self.space, self.driver
        self.books.flush_kept()  # a kept range is allocated in its heap, but not live: it must not be copied
        for p in (primary, *twins):
            if not region.handles[p] or region.backing[p] != DEVICE:
                raise ValueError(f"page {p} of region {region.index} is not a mapped device page")
            if region.unit_start[p] >= 0:
                raise ValueError(f"page {p} of region {region.index} is part of a unit, which never meshes")
        moves = [(region.address(t) + off, region.address(primary) + off, n)
                 for t in twins for off, n in self.live_pieces(region, t)]
        try:
            self.books.mesh(region.index, primary, list(twins))
        except (ValueError, TypeError) as exc:
            raise ValueError(str(exc)) from None
        for t in reversed(twins):
            txn.on_rollback(self.books.split, region.index, t)
        driver.synchronize()  # queued kernels may still write the twins' blocks
        if moves:
            copy(moves)
        driver.synchronize()
        handle = int(region.handles[primary])
        olds = [space.detach(region, t, txn) for t in sorted(twins)]
        space.alias(region, sorted(twins), handle, txn)
        return olds

    def split(self, region: Region, twin: int, txn: Transaction) -> None:
        """Give twin page `twin` a physical page of its own (from the store), holding a copy of the shared
        page, and take it out of its mesh. Undone by `txn`. The books must be held and settled."""
        space, driver, P = self.space, self.driver, self.page_size
        if self.roles[region.index][twin] != TWIN:
            raise ValueError(f"page {twin} of region {region.index} is not a twin of a mesh")
        if self.live_count[region.index][twin] == 0:
            raise ValueError(f"page {twin} of region {region.index} holds no block (unmap_dormant drops it)")
        primary = next(m[2] for m in self.books.meshes() if twin in m[3] and m[1] == region.index)
        handle = space.store.take(1, txn)[0]
        scratch, teardown = self._map_scratch([handle], txn)
        txn.on_rollback(driver.synchronize)  # undone newest first: before the scratch is unmapped
        driver.synchronize()
        driver.copy(scratch, region.address(twin), P)
        driver.synchronize()
        teardown()
        space.detach(region, twin, txn)
        space.attach(region, twin, handle)
        txn.on_rollback(space.unattach, region, twin)  # the store's own undo takes the handle back
        self.books.split(region.index, twin)
        txn.on_rollback(self.books.mesh, region.index, primary, [twin])

    def unmap_dormant(self) -> int:
        """Unmap twin pages that hold no block (dormant: they manage no byte), promoting a twin to primary
        where the primary holds none, so a mesh never outlives its last two pages with data (a mesh with
        no data left dissolves into one empty page). Needs a synchronize and driver calls, which the
        native release path never makes: callers are the places that synchronize anyway. Returns how
        many were unmapped."""
        meshes = self.books.meshes()
        if not meshes:
            return 0
        self.books.flush_kept()
        for _, index, primary, twins, _ in meshes:
            counts = self.live_count[index]
            if counts[primary] == 0:
                busy = [t for t in twins if counts[t]]
                if busy:
                    self.books.promote(index, busy[0])
        dormant = [(self.space.regions[index], t) for _, index, _, twins, _ in self.books.meshes()
                   for t in twins if self.live_count[index][t] == 0]
        for region, t in dormant:
            self.space.unmap(region, [t])  # the primary keeps the handle: only the alias goes
            self.books.drop_dormant(region.index, t)
        return len(dormant)

    # ------------------------------------------------------------------ sleep and wake
    def put_to_sleep(self, txn: Transaction) -> list[int]:
        """Unmap every device page and mark it asleep (the books keep its free space and blocks); returns
        the physical handles, which still hold the bytes until released. Undone by `txn`: each page's
        own handle is mapped back."""
        P, space, driver = self.page_size, self.space, self.driver
        pages = [(region, int(p)) for region in space.regions
                 for p in np.flatnonzero((region.handles != 0) & (region.backing == DEVICE))]
        unmapped: list[tuple[Region, int, int]] = []  # (region, page, handle)
        txn.on_rollback(self._remap_own, unmapped)
        for region, page in pages:
            handle = int(region.handles[page])
            mapping = region.mapping_of(page)  # a unit is unmapped whole, at its first page
            if page == mapping.start:
                driver.unmap(region.address(page), len(mapping) * P)
                space.unmap_calls += 1
            region.handles[page], region.backing[page] = ASLEEP_HANDLE, ASLEEP
            if page == mapping.stop - 1:
                region.clear_units(mapping.start, len(mapping))
            space.unref(handle, to_store=False)  # kept in `unmapped`, mapped again at wake
            space.asleep += 1
            unmapped.append((region, page, handle))
        return [h for _, _, h in unmapped]

    def _remap_own(self, unmapped: list) -> None:
        """Undo of `put_to_sleep`: map each page's own handle (its bytes intact) again."""
        space, driver, P = self.space, self.driver, self.page_size
        by_region = collections.defaultdict(list)
        units = space.store.units
        while unmapped:
            region, page, handle = unmapped[-1]
            unit = units.get(handle)
            if unit is None:
                driver.map(region.address(page), P, handle)
                mapping = [(page, handle)]
            else:  # a unit's pages were unmapped together, in order: mapped back together
                _, index, n = unit
                first = page - index
                driver.map(region.address(first), n * P, unit[0])
                mapping = [(e[1], e[2]) for e in unmapped[-n:]]
                region.set_unit(first, n)
            space.map_calls += 1
            for page, handle in mapping:
                unmapped.pop()
                region.handles[page], region.backing[page] = handle, DEVICE
                space.ref(handle)
                space.asleep -= 1
                by_region[region.index].append(page)
        for index, pages in by_region.items():
            region = space.regions[index]
            for first, count in page_runs(pages):
                driver.set_access(region.address(first), count * P)

    def wake_pages(self, txn: Transaction) -> int:
        """Map a device page (cached first, then new) at every page asleep; returns how many. Undone
        by `txn`: the pages are unmapped and asleep again."""
        space, woken = self.space, 0
        for region in space.regions:
            pages = np.flatnonzero(region.backing == ASLEEP).tolist()
            if not pages:
                continue
            region.handles[pages] = 0
            region.backing[pages] = DEVICE
            space.asleep -= len(pages)
            txn.on_rollback(self._back_to_sleep, region, pages)
            try:
                space.map(region, pages, txn)
            except CudaError as exc:
                left = getattr(exc, "left_mapped", None)
                if left is not None:  # the undo could not unmap them: once more, since a sleeping pool maps nothing
                    space.unmap(*left)
                raise
            woken += len(pages)
        return woken

    def _back_to_sleep(self, region: Region, pages: list[int]) -> None:
        """Undo of `wake_pages`' first step: these (unmapped again) pages are asleep once more. A page
        still mapped (the driver refused every unmap) keeps its handle: the books say what the device
        has, and the next wake copies the saved bytes back over it."""
        pages = [p for p in pages if not region.handles[p]]
        region.handles[pages] = ASLEEP_HANDLE
        region.backing[pages] = ASLEEP
        self.space.asleep += len(pages)

    # ------------------------------------------------------------------ breaking units
    def partly_used_units(self, keep: Region | None = None, keep_pages=()) -> list[tuple[Region, int, int, int]]:
        """Units whose pages partly hold blocks: [(region, first page, used pages, empty pages)], fewest
        used pages first, then most empty. None with a page in `keep_pages` of region `keep` (a
        request's own window). What `break_units` can free (the empty pages), at the cost of the used
        ones."""
        out = []
        for region in self.space.regions:
            parts = self._unit_parts(region)
            if parts is None:
                continue
            firsts, lens, used = parts
            partial = (used > 0) & (used < lens)
            if region is keep and len(keep_pages) and partial.any():
                kept = np.zeros(region.npages + 1, dtype=np.int64)
                kept[np.fromiter(keep_pages, dtype=np.int64) + 1] = 1
                kept = np.cumsum(kept)
                partial &= kept[firsts + lens] == kept[firsts]
            at = np.flatnonzero(partial)
            out.extend((region, f, u, n - u) for f, n, u in
                       zip(firsts[at].tolist(), lens[at].tolist(), used[at].tolist()))
        out.sort(key=lambda u: (u[2], -u[3]))
        return out

    def _unit_parts(self, region: Region):
        """(first page, pages, pages holding a block) of each mapped unit of `region`, as arrays; None
        for a region without units."""
        firsts, lens, members = region.units()
        if not firsts.size:
            return None
        held = self.live_count[region.index][members] > 0
        return firsts, lens, np.add.reduceat(held, np.cumsum(lens) - lens, dtype=np.int64)

    def stranded_in_units(self) -> int:
        """Empty pages of units that blocks still hold (what only breaking them frees)."""
        total = 0
        for region in self.space.regions:
            parts = self._unit_parts(region)
            if parts is not None:
                _, lens, used = parts
                total += int(((lens - used) * ((used > 0) & (used < lens))).sum())
        return total

    def break_units(self, units: list[tuple[Region, int]], txn: Transaction) -> int:
        """Break each unit (region, its first page) of `units`: a single page of its own, with its bytes,
        under each of its pages that holds a block, and the unit unmapped whole, its empty pages
        unmapped and the unit spare (released where a creation needs its room). Returns how many
        pages that frees (the units' empty pages). A failure on the way is undone by `txn`: each unit
        is mapped back whole (its handle holds every byte), the single pages go back to the store.
        Once it returns, the books are updated with no undo: the caller commits `txn` at once, with
        no later step in it. ValueError, before any change, for a unit not partly used
        (`partly_used_units`).

        What the caller vouches for: no page of a unit is in a mesh or asleep, and no other thread
        writes to a block on one between the copy and the swap (`Scope.mesh_blocker`, as for a mesh);
        the store holds a page for each used page (`PageStore.available`). The device is synchronized
        once before the copies and once after (they run on the legacy stream), however many units.
        The used pages' blocks and free ranges stay as they are; the empty pages' free space leaves
        the heap."""
        space, driver, P = self.space, self.driver, self.page_size
        plans = []
        for region, first in units:
            mapping = region.mapping_of(first)
            if first != mapping.start or len(mapping) < 2:
                raise ValueError(f"page {first} of region {region.index} is not the first page of a unit")
            pages = np.arange(first, first + len(mapping))
            used_mask = self.live_count[region.index][pages] > 0
            used, empty = pages[used_mask].tolist(), pages[~used_mask].tolist()
            if not used or not empty:
                raise ValueError(f"the unit at page {first} of region {region.index} is not partly used")
            plans.append((region, first, len(mapping), used, empty))
        if not plans:
            return 0
        self.books.flush_kept()  # an empty page's free space may sit in a range kept for reuse
        handles = space.store.take(sum(len(plan[3]) for plan in plans), txn)
        scratch, teardown = self._map_scratch(handles, txn)
        txn.on_rollback(driver.synchronize)  # undone newest first: before the scratch is unmapped
        driver.synchronize()
        self._all_done()
        at = 0
        for region, _, _, used, _ in plans:
            for start, count in page_runs(used):  # consecutive used pages lie side by side in the scratch
                driver.copy(scratch + at * P, region.address(start), count * P)
                at += count
        driver.synchronize()
        at = 0
        for region, first, n, used, empty in plans:
            heap = self.heaps[region.index]
            for start, count in page_runs(empty):
                heap.remove_free(region.address(start), count * P)
                txn.on_rollback(heap.insert_free, region.address(start), count * P)
            unit_handle = space.store.units[int(region.handles[first])][0]
            driver.unmap(region.address(first), n * P)
            space.unmap_calls += 1
            txn.on_rollback(self._remap_unit, region, first, n, unit_handle)
            mapped: list[int] = []  # this unit's single pages, unmapped by an undo before it maps the unit back
            txn.on_rollback(_unmap_each, driver, mapped, P)
            vas = [region.address(page) for page in used]
            done = 0
            try:
                driver.map_each(vas, P, handles[at:at + len(used)])
                done = len(used)
            except BaseException as exc:
                done = getattr(exc, "mapped", 0)
                raise
            finally:
                mapped.extend(vas[:done])
                space.map_calls += done
            at += len(used)
            for start, count in page_runs(used):
                driver.set_access(region.address(start), count * P)
        teardown()
        # The device matches the books from here on: nothing below fails.
        at, freed = 0, 0
        for region, first, n, used, empty in plans:
            mine = handles[at:at + len(used)]
            at += len(used)
            old = region.handles[first:first + n].tolist()
            region.clear_units(first, n)
            region.handles[empty] = 0
            region.handles[used] = mine
            self.idle[region.index][empty] = False
            space.ref_all(mine)
            space.unref_all(old)  # the unit's ids back together: it is spare
            self.books.add_empty(-len(empty))
            if self.history is not None:
                self.history.pages_unmapped(region, empty)
            freed += len(empty)
        handles.clear()  # the pages' own from here on (a rollback gives back nothing)
        return freed

    def _remap_unit(self, region: Region, first: int, n: int, unit_handle: int) -> None:
        """Undo of `break_units`' unmap of a unit: mapped back whole, with access."""
        self.driver.map(region.address(first), n * self.page_size, unit_handle)
        self.space.map_calls += 1
        self.driver.set_access(region.address(first), n * self.page_size)

    # ------------------------------------------------------------------ re-backing (offload, reload)
    def reback(self, region: Region, pages: list[int], handles: list[int], to: int, txn: Transaction) -> list[int]:
        """Put `handles` (one per page; `to` is their kind, `vmm.DEVICE` or `vmm.HOST`) under `pages` of
        `region` with their bytes; returns the old handles, which the caller releases.

        Copy first (each page into its new handle, mapped at a scratch
        address), then swap (unmap the old mapping, map the new handle at the
        same address), then grant access. Undone by `txn` until it commits:
        the old handles are mapped back (they still hold every byte).

        The device is synchronized before the copy (the copy runs on the legacy
        stream, which does not wait for non-blocking streams: a write still in
        flight there would land in the old page after the copy read it, and be
        lost with that page) and, on rollback, before the scratch range is
        unmapped (copies into it may still run).
        """
        space, driver, P = self.space, self.driver, self.page_size
        if (region.unit_start[pages] >= 0).any():
            raise ValueError(f"region {region.index}: a page of a unit is re-backed only with its whole unit, "
                             f"which this does not do (offload packs blocks off units first)")
        scratch, teardown = self._map_scratch(handles, txn)
        txn.on_rollback(driver.synchronize)  # undone newest first: before the scratch is unmapped
        driver.synchronize()
        for i, page in enumerate(pages):
            driver.copy(scratch + i * P, region.address(page), P)
        driver.synchronize()
        swapped: list = []  # [page, old handle, old backing, new handle mapped at the page?]
        txn.on_rollback(self._unswap, region, swapped, to)
        olds = []
        for page, h in zip(pages, handles):
            old, was = int(region.handles[page]), int(region.backing[page])
            entry = [page, old, was, False]
            driver.unmap(region.address(page), P)
            space.unmap_calls += 1
            swapped.append(entry)
            driver.map(region.address(page), P, h)
            space.map_calls += 1
            entry[3] = True
            region.handles[page], region.backing[page] = h, to
            self._count(was, -1, old)
            self._count(to, +1, h)
            olds.append(old)
        for first, count in page_runs(pages):
            driver.set_access(region.address(first), count * P)
        teardown()
        return olds

    def _count(self, backing: int, delta: int, handle: int) -> None:
        """A re-backed page's handle of kind `backing` mapped (+1) or unmapped (-1) there."""
        if backing == HOST:
            self.space.host_mapped += delta
        elif delta > 0:
            self.space.ref(handle)
        else:
            self.space.unref(handle, to_store=False)

    def _unswap(self, region: Region, swapped: list, to: int) -> None:
        """Undo of `reback`'s swap: the old handles go back under their pages."""
        driver, P = self.driver, self.page_size
        restored = []
        while swapped:
            page, old, was, mapped_new = swapped[-1]
            va = region.address(page)
            if mapped_new:
                driver.unmap(va, P)
                self._count(to, -1, int(region.handles[page]))
                region.handles[page], region.backing[page] = old, was
                self._count(was, +1, old)
                swapped[-1][3] = False
            driver.map(va, P, old)
            swapped.pop()
            restored.append(page)
        for first, count in page_runs(restored):
            driver.set_access(region.address(first), count * P)

    def _map_scratch(self, handles: list[int], txn: Transaction):
        """Map `handles` side by side in a fresh reservation (undone by `txn`).

        Returns (its base, `teardown()`): teardown unmaps and frees it now, after
        which its undo steps find nothing left to do.
        """
        driver, P = self.driver, self.page_size
        n = len(handles)
        scratch = driver.reserve(n * P, P if P & (P - 1) == 0 else driver.granularity)
        reserved = [scratch]
        txn.on_rollback(_free_scratch, driver, reserved, n * P)
        staged: list[int] = []
        txn.on_rollback(_unmap_each, driver, staged, P)
        vas = [scratch + i * P for i in range(n)]
        done = 0
        try:
            driver.map_each(vas, P, handles)
            done = n
        except BaseException as exc:
            done = getattr(exc, "mapped", 0)
            raise
        finally:
            staged.extend(vas[:done])
        driver.set_access(scratch, n * P)

        def teardown() -> None:
            if staged:  # one cuMemUnmap covers the whole mappings side by side
                driver.unmap(scratch, n * P)
                staged.clear()
            _free_scratch(driver, reserved, n * P)
        return scratch, teardown


def _unmap_each(driver, vas: list[int], size: int) -> None:
    while vas:
        driver.unmap(vas[-1], size)
        vas.pop()


def _free_scratch(driver, reserved: list[int], size: int) -> None:
    while reserved:
        driver.free_address(reserved[-1], size)
        reserved.pop()


def _complete_units(regions, index: np.ndarray, pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(region index, page) arrays with the other pages of every unit they touch added after them, in
    address order (`regions`: indexable by region index)."""
    extra_index, extra_pages = [index], [pages]
    for i in np.unique(index).tolist():
        region = regions[i]
        listed = pages[index == i]
        starts = region.unit_start[listed]
        inunit = starts >= 0
        if not inunit.any():
            continue
        firsts = np.unique(starts[inunit])
        more = np.setdiff1d(run_pages(firsts, region.unit_len[firsts]), listed)
        extra_index.append(np.full(len(more), i, dtype=index.dtype))
        extra_pages.append(more)
    if len(extra_pages) == 1:
        return index, pages
    return np.concatenate(extra_index), np.concatenate(extra_pages)


def with_whole_units(pages: list[tuple[Region, int]]) -> list[tuple[Region, int]]:
    """`pages` with the other pages of every unit they touch added (after them, in address order): what
    unmapping them takes."""
    if not pages:
        return list(pages)
    regions = {region.index: region for region, _ in pages}
    index = np.fromiter((region.index for region, _ in pages), dtype=np.int64, count=len(pages))
    listed = np.fromiter((page for _, page in pages), dtype=np.int64, count=len(pages))
    index, listed = _complete_units(regions, index, listed)
    return [(regions[i], p) for i, p in zip(index.tolist(), listed.tolist())]
