"""The pool's address space and physical pages, over a `defrag.driver.Driver`.

- `PageStore` owns physical pages: one driver handle per page, created lazily
  up to a capacity and reused; pages that are not mapped anywhere are *cached*
  and handed out again before any new one is created. `trim()` returns cached
  pages to the driver. A large placement's new pages may come as *units*
  instead: one driver handle for a run of pages, mapped with one cuMemMap and
  unmapped only whole, kept whole once empty (*spare*) for the next unit of
  its size (`PageStore.take_unit`; when, is `defrag.page_growth`'s call).
- `Region` is one virtual reservation cut into pages; it records which handle
  backs each virtual page (0 where none) and which pages each mapped unit spans.
- `AddressSpace` owns the regions and the store and does the multi-step work:
  mapping a set of pages (each page its own mapping, so one can later be
  unmapped alone, or a unit per run; access granted once per contiguous run)
  and unmapping them (never a part of a unit).

Every multi-step operation is a transaction: if any driver call fails half-way,
the pages mapped so far are unmapped and their handles go back to the store,
so nothing is left behind. Unmapping synchronizes the device first, because
cuMemUnmap does not wait for queued kernels the way cudaFree does.

Residency (the transactions are in `defrag.residency`): a page's
`Region.backing` says what is behind it. `DEVICE`: a device page (or nothing,
where the handle is 0). `HOST`: a host-located page mapped at the same address
(`pool.offload`); not in the store, not in `mapped`, counted in `host_mapped`.
`ASLEEP`: the page was mapped when the pool went to sleep and will be mapped
again at wake; nothing is mapped there now (its handle is `ASLEEP_HANDLE`),
counted in `asleep`. `book_pages` counts every page the books treat as
mapped (device + host + asleep); `mapped` (and so `reserved_bytes`) counts
device pages only.

Meshes (docs/meshing.md): one device handle may be mapped at several virtual
pages (`alias`). `refs[h]` counts the virtual pages mapping device handle `h`;
`mapped` counts distinct device handles (so `reserved_bytes` counts a shared
physical page once) and `aliases` the mappings beyond the first of each. A
handle goes back to the store only at its last unmap: putting back a handle
still mapped elsewhere would hand a live page to the next `map`.

Nothing here knows about blocks or tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .driver import Driver
from .errors import CudaError
from .page_runs import page_runs, run_pages

# What backs a virtual page (Region.backing); see the module docstring.
DEVICE, HOST, ASLEEP = 0, 1, 2
ASLEEP_HANDLE = -1  # Region.handles of an ASLEEP page: nonzero (the books hold it), but no driver handle


class Transaction:
    """Undo steps registered as work proceeds; `rollback()` runs them newest first.

    Rollback is best effort: an undo step that itself fails is recorded in
    `undo_errors` (and the remaining steps still run) instead of masking the
    original error.
    """

    def __init__(self):
        self._undo: list = []
        self.undo_errors: list[BaseException] = []

    def on_rollback(self, fn, *args) -> None:
        self._undo.append((fn, args))

    def commit(self) -> None:
        self._undo.clear()

    def rollback(self) -> None:
        while self._undo:
            fn, args = self._undo.pop()
            try:
                fn(*args)
            except CudaError as exc:
                self.undo_errors.append(exc)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.commit()
        else:
            self.rollback()
        return False


class PageStore:
    """Physical pages of one size: created lazily up to `max_pages`, then reused.

    A page is named by an id: a single page's id is its driver handle; the pages of a *unit* (one
    driver handle of several pages, `take_unit`) get ids of their own, negative, below
    `ASLEEP_HANDLE`. A unit is mapped with one cuMemMap and unmapped whole (CUDA maps a handle from
    its first byte only, and one cuMemUnmap cannot split one mapping). Once all its pages are back
    (`put`) it is *spare*: held, like a cached page, and mapped again whole by the next `take_unit` of
    its size; released to the driver when single pages must be created and the capacity leaves no
    room for them otherwise, or at `trim`. A spare unit never backs single pages."""

    def __init__(self, driver: Driver, page_size: int, max_pages: int):
        self.driver = driver
        self.page_size = page_size
        self.max_pages = max_pages
        self.cached: list[int] = []  # handles not mapped anywhere
        self.total = 0  # pages held (mapped, cached, and the pages of spare units)
        self.created = 0  # cumulative cuMemCreate calls that succeeded
        self.device_full = False  # the device refused a page below max_pages (until a creation succeeds)
        self.units: dict[int, tuple[int, int, int]] = {}  # unit page id -> (driver handle, index, pages)
        self._returned: dict[int, int] = {}  # unit driver handle -> its pages back in the store
        self.spare: dict[int, list[list[int]]] = {}  # pages -> the page ids of each spare unit of that size
        self.spare_pages = 0  # pages of the spare units
        self._next_id = ASLEEP_HANDLE - 1

    @property
    def creatable(self) -> int:
        return self.max_pages - self.total

    @property
    def unmapped(self) -> int:
        """Pages held and mapped nowhere: cached, and the pages of spare units."""
        return len(self.cached) + self.spare_pages

    @property
    def available(self) -> int:
        """Pages obtainable without unmapping anything: cached, spare (a unit released makes room for
        new pages) and creatable."""
        return self.unmapped + self.creatable

    def take(self, n: int, txn: Transaction) -> list[int]:
        """Take `n` handles (cached first, then new ones, releasing spare units where the capacity asks);
        undone by `txn` rollback.

        Raises CudaOutOfMemoryError if the driver refuses to create a page, and
        ValueError if `n` exceeds what the store may hold (callers check first).
        """
        if n > self.available:
            raise ValueError(f"asked for {n} pages but only {self.available} are available")
        handles = []
        txn.on_rollback(self._give_back, handles)
        reuse = min(n, len(self.cached))
        for _ in range(reuse):
            handles.append(self.cached.pop())
        self.release_spare(n - reuse - self.creatable)
        made: list[int] = []
        try:
            made = self.driver.create_each(self.page_size, n - reuse)
        except BaseException as exc:
            made = getattr(exc, "created", [])  # made before the refusal: they roll back with the rest
            raise
        finally:
            if made:
                self.device_full = False
                self.total += len(made)
                self.created += len(made)
                handles.extend(made)
        return handles

    def take_unit(self, n: int, txn: Transaction) -> list[int]:
        """A unit of `n` pages (see the class docstring): a spare one of that size, else a new driver
        handle of `n` pages. Returns its page ids in address order, in a list that `txn`'s rollback
        puts back (the unit is spare again): the caller empties it once the ids are its own (mapped).
        Raises CudaOutOfMemoryError if the driver refuses, ValueError beyond what may be held."""
        spare = self.spare.get(n)
        if spare:
            ids = spare.pop()
            self.spare_pages -= n
            self._returned[self.units[ids[0]][0]] = 0
        else:
            if n > self.creatable + self.spare_pages:
                raise ValueError(f"asked for a unit of {n} pages but only {self.creatable + self.spare_pages} "
                                 f"may be created")
            self.release_spare(n - self.creatable)
            handle = self.driver.create(n * self.page_size)
            self.device_full = False
            self.total += n
            self.created += 1
            ids = list(range(self._next_id, self._next_id - n, -1))
            self._next_id -= n
            for index, page_id in enumerate(ids):
                self.units[page_id] = (handle, index, n)
            self._returned[handle] = 0
        txn.on_rollback(self._give_back, ids)
        return ids

    def release_spare(self, pages: int | None = None) -> None:
        """Release spare units, largest first, until `pages` more pages may be created (all of them when
        they hold fewer, or `pages` is None). A unit the driver refuses stays spare and the error
        propagates."""
        if pages is None:
            pages = self.spare_pages
        if pages <= 0 or not self.spare_pages:
            return
        for size in sorted(self.spare, reverse=True):
            units = self.spare[size]
            while units and pages > 0:
                self._release_unit(units[-1])
                units.pop()
                pages -= size
        self.spare = {size: units for size, units in self.spare.items() if units}

    def _release_unit(self, ids: list[int]) -> None:
        handle, _, n = self.units[ids[0]]
        self.driver.release(handle)
        for page_id in ids:
            del self.units[page_id]
        self.total -= n
        self.spare_pages -= n

    def _give_back(self, handles: list[int]) -> None:
        self.put(handles)
        handles.clear()

    def put(self, handles) -> None:
        """Return handles that are no longer mapped anywhere (a unit is spare once all its pages are back)."""
        units = self.units
        if not units:
            self.cached.extend(handles)
            return
        for handle in handles:
            unit = units.get(handle)
            if unit is None:
                self.cached.append(handle)
                continue
            driver_handle, index, n = unit
            back = self._returned[driver_handle] + 1
            self._returned[driver_handle] = back
            if back == n:
                del self._returned[driver_handle]
                first = handle + index  # ids count down from the unit's first page
                self.spare.setdefault(n, []).append(list(range(first, first - n, -1)))
                self.spare_pages += n

    def trim(self, keep: int = 0) -> int:
        """Release every spare unit, and cached handles beyond the first `keep`; returns how many pages
        were released. Raises the driver's refusal (what it refused stays held)."""
        before = self.total
        try:
            self.release_spare(self.spare_pages)
            while len(self.cached) > keep:
                handle = self.cached.pop()
                try:
                    self.driver.release(handle)
                except CudaError:
                    self.cached.append(handle)
                    raise
                self.total -= 1
        finally:
            released = before - self.total
        return released


@dataclass
class Region:
    """One virtual reservation of `npages` pages starting at `base`."""

    index: int
    base: int
    npages: int
    page_size: int
    handles: np.ndarray = field(default=None)  # int64 per page; 0 = unmapped
    backing: np.ndarray = field(default=None)  # int8 per page: DEVICE, HOST or ASLEEP
    unit_start: np.ndarray = field(default=None)  # int64 per page: first page of its mapped unit, -1 for none
    unit_len: np.ndarray = field(default=None)  # int64 per page: pages of its mapped unit, 0 for none
    units_version: int = 0  # bumped at every change of the units (`units` caches by it)
    _units: tuple = field(default=None, repr=False, compare=False)
    _units_at: int = field(default=-1, repr=False, compare=False)

    def __post_init__(self):
        if self.handles is None:
            self.handles = np.zeros(self.npages, dtype=np.int64)
        if self.backing is None:
            self.backing = np.zeros(self.npages, dtype=np.int8)
        if self.unit_start is None:
            self.unit_start = np.full(self.npages, -1, dtype=np.int64)
        if self.unit_len is None:
            self.unit_len = np.zeros(self.npages, dtype=np.int64)

    def set_unit(self, first: int, n: int) -> None:
        """Pages [first, first + n) are one mapped unit (`PageStore.take_unit`)."""
        self.unit_start[first:first + n] = first
        self.unit_len[first:first + n] = n
        self.units_version += 1

    def clear_units(self, first: int, n: int) -> None:
        """Pages [first, first + n) are in no mapped unit (unmapped, or never were)."""
        self.unit_start[first:first + n] = -1
        self.unit_len[first:first + n] = 0
        self.units_version += 1

    def clear_unit_pages(self, pages: np.ndarray) -> None:
        """`clear_units` for an index array of pages (whole units, or pages in none)."""
        self.unit_start[pages] = -1
        self.unit_len[pages] = 0
        self.units_version += 1

    def units(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(first page, pages) of each mapped unit in address order, and every page of them in order, as
        arrays (cached until the units change)."""
        if self._units_at != self.units_version:
            firsts = np.flatnonzero(self.unit_start == np.arange(self.npages))
            lens = self.unit_len[firsts]
            members = run_pages(firsts, lens)
            self._units, self._units_at = (firsts, lens, members), self.units_version
        return self._units

    def mapping_of(self, page: int) -> range:
        """The pages mapped with `page` by one cuMemMap: its unit's, or the page alone."""
        start = int(self.unit_start[page])
        return range(page, page + 1) if start < 0 else range(start, start + int(self.unit_len[page]))

    def whole_units(self, pages) -> np.ndarray:
        """One bool per page of `pages`: False for the pages of a unit that `pages` holds only a part of
        (a unit is unmapped only whole); True for the rest."""
        pages = np.asarray(pages, dtype=np.int64)
        starts = self.unit_start[pages]
        inunit = starts >= 0
        if not inunit.any():
            return np.ones(len(pages), dtype=bool)
        listed = np.bincount(starts[inunit], minlength=self.npages)
        whole = listed[starts[inunit]] == self.unit_len[pages][inunit]
        out = np.ones(len(pages), dtype=bool)
        out[np.flatnonzero(inunit)[~whole]] = False
        return out

    @property
    def size(self) -> int:
        return self.npages * self.page_size

    @property
    def end(self) -> int:
        return self.base + self.size

    def address(self, page: int) -> int:
        return self.base + page * self.page_size

    def page_of(self, address: int) -> int:
        return (address - self.base) // self.page_size

    def contains(self, address: int, size: int = 1) -> bool:
        return self.base <= address and address + size <= self.end

    def mapped_pages(self) -> list[int]:
        return np.flatnonzero(self.handles).tolist()


class AddressSpace:
    """Regions of reserved virtual memory and the physical pages mapped into them."""

    def __init__(self, driver: Driver, page_size: int, max_pages: int):
        if page_size % driver.granularity:
            raise ValueError(f"page_size {page_size} is not a multiple of the device granularity {driver.granularity}")
        self.driver = driver
        self.page_size = page_size
        self.store = PageStore(driver, page_size, max_pages)
        self.regions: list[Region] = []
        self.mapped = 0  # distinct device handles currently mapped, all regions
        self.refs: dict[int, int] = {}  # device handle -> virtual pages mapping it (meshes map one at several)
        self.aliases = 0  # device mappings beyond each handle's first (meshes' twin pages)
        self.map_calls = 0
        self.unmap_calls = 0
        # Residency (see the module docstring and defrag.residency).
        self.host_mapped = 0  # pages backed by host-located handles
        self.asleep = 0  # pages released by sleep, mapped again at wake
        self.sleeping = False  # between a pool's sleep() and wake()
        self.residency = None  # defrag.residency's state; release_all calls its release()

    @property
    def book_pages(self) -> int:
        """Pages the books treat as mapped: device pages, host-located pages and pages asleep."""
        return self.mapped + self.host_mapped + self.asleep

    def reserve(self, npages: int) -> Region:
        """Reserve a new region of `npages` pages (page-aligned)."""
        # Page-aligned when the page size is a power of two (the driver wants a
        # power-of-two alignment); granularity-aligned otherwise, which is all a
        # mapping needs.
        ps = self.page_size
        alignment = ps if ps & (ps - 1) == 0 else self.driver.granularity
        base = self.driver.reserve(npages * ps, alignment)
        region = Region(len(self.regions), base, npages, self.page_size)
        self.regions.append(region)
        return region

    def region_of(self, address: int) -> Region | None:
        for region in self.regions:
            if region.contains(address):
                return region
        return None

    def map(self, region: Region, pages: list[int], txn: Transaction | None = None, *, unit_pages: int = 0) -> None:
        """Back each (unmapped) page with a handle from the store and grant access.

        One cuMemMap per page (so a page can later be unmapped alone), one
        cuMemSetAccess per run of consecutive pages. With `unit_pages` >= 2,
        the pages the store's cached handles do not back are created in
        units (`PageStore.take_unit`) of up to `unit_pages` consecutive pages,
        one cuMemMap each; such pages are unmapped only with the rest of their
        unit (`_unmap_mapped` refuses a part). All or nothing: on failure
        every page mapped here is unmapped again and its handle returned to
        the store, then the error propagates. With an outer `txn`, that undo is
        also registered there, for callers with more steps after this one.

        If the driver also refuses an unmap of that undo, the page stays
        mapped, with its access granted again: the error then carries
        `left_mapped` = (region, pages), mapped and accessible, which the
        caller must count as mapped empty pages (`Backing.map` does).
        """
        if not pages:
            return
        for p in pages:
            if region.handles[p]:
                raise ValueError(f"page {p} of region {region.index} is already mapped")
        left: list[int] = []
        try:
            self._map_pages(region, pages, left, unit_pages)
        except CudaError as exc:
            if left:
                exc.left_mapped = (region, sorted(left))
            raise
        if txn is not None:
            txn.on_rollback(self.unmap, region, list(pages))

    def _map_pages(self, region: Region, pages: list[int], left: list[int], unit_pages: int = 0) -> None:
        """`map`'s steps in a transaction of their own, undone by `_undo_map` (which lists in `left` the
        pages it could not unmap)."""
        with Transaction() as inner:
            order = sorted(pages)
            units: list[tuple[int, int]] = []  # (first page, pages) of each unit to create
            if unit_pages > 1:
                reuse = min(len(order), len(self.store.cached))
                singles = order[:reuse]
                for first, count in page_runs(order[reuse:]):
                    for start in range(first, first + count, unit_pages):
                        n = min(unit_pages, first + count - start)
                        if n > 1:
                            units.append((start, n))
                        else:
                            singles.append(start)
                order = sorted(singles)
            done: list[int] = []
            handles = self.store.take(len(order), inner)
            inner.on_rollback(self._undo_map, region, done, left)
            for first, n in units:
                self._map_unit(region, first, n, inner, done)
            # Handed over before mapping: from here on a page's undo, not the store's, gives its handle
            # back (never both); the handles of pages a failure left unmapped go back to the store.
            mine = handles[::-1]
            handles.clear()
            mapped = 0
            try:
                if order:
                    vas = (region.base + np.asarray(order, dtype=np.int64) * self.page_size).tolist()
                    self.driver.map_each(vas, self.page_size, mine)
                mapped = len(order)
            except BaseException as exc:  # a CudaError, or anything from the host side: `mapped` says how far
                mapped = getattr(exc, "mapped", 0)
                self.store.put(mine[mapped:])
                raise
            finally:
                if mapped:
                    region.handles[order[:mapped]] = mine[:mapped]
                    self.ref_all(mine[:mapped])
                    done.extend(order[:mapped])
                self.map_calls += mapped
            for first, count in page_runs(pages):
                self.driver.set_access(region.address(first), count * self.page_size)

    def _map_unit(self, region: Region, first: int, n: int, txn: Transaction, done: list[int]) -> None:
        """Create a unit of `n` pages and map it at pages [first, first + n) of `region` with one cuMemMap;
        its pages join `done` (whose undo unmaps them whole). Access is the caller's."""
        ids = self.store.take_unit(n, txn)
        self.driver.map(region.address(first), n * self.page_size, self.store.units[ids[0]][0])
        self.map_calls += 1
        region.handles[first:first + n] = ids
        region.set_unit(first, n)
        self.ref_all(list(ids))
        done.extend(range(first, first + n))
        ids.clear()  # the pages' undo, not the store's, gives them back from here on

    def _undo_map(self, region: Region, pages: list[int], left: list[int]) -> None:
        """`map`'s undo: unmap every page it mapped, handles back to the store. A page the driver will
        not unmap stays mapped: its access is granted again and it goes in `left` (usable memory the
        caller must account for); every page is tried, then the first error propagates (into the
        transaction's `undo_errors`). A page whose access cannot be granted either stays mapped with
        no access, recorded as mapped: the heap never offers it."""
        first = None
        while pages:
            mapping = list(region.mapping_of(pages[0]))  # a unit's pages are unmapped together
            try:
                self._unmap_mapped(region, list(mapping), False)
            except CudaError as exc:
                first = first or exc
                try:
                    self.driver.set_access(region.address(mapping[0]), len(mapping) * self.page_size)
                    left.extend(mapping)
                except CudaError:
                    pass
            pages[:] = [p for p in pages if p not in mapping]
        if first is not None:
            raise first

    def _unmap_mapped(self, region: Region, pages: list[int], sync: bool) -> None:
        """Unmap these mapped pages and return their handles (device ones to the store, host ones to
        the driver); each page leaves `pages` once its books say unmapped.

        One cuMemUnmap per run of consecutive pages: one call may cover several whole mappings
        (never a part of one; checked on a GPU by tests/gpu/test_driver_gpu.py), and an unmap costs
        about as much as a map, so a batch of donors given back costs a call per run, not per page.
        A failed call leaves its run mapped and in `pages` (runs before it stay unmapped) and the
        error propagates."""
        if self.store.units and not region.whole_units(pages).all():
            raise ValueError(f"region {region.index}: these pages hold a part of a unit, which is unmapped only whole")
        if sync:
            self.driver.synchronize()
        done: set[int] = set()
        try:
            if self.asleep:
                for page in pages:
                    if region.backing[page] == ASLEEP:  # nothing mapped there (sleep released it): only the books
                        region.handles[page], region.backing[page] = 0, DEVICE
                        self.asleep -= 1
                        done.add(page)
            runs = page_runs(p for p in pages if p not in done)
            # One batch of unmaps for every run; run by run where host pages may need releasing after
            # their run (a refused release stops the runs after it, which stay mapped).
            step = 1 if self.host_mapped else max(len(runs), 1)
            for k in range(0, len(runs), step):
                self._unmap_runs(region, runs[k:k + step], done)
        finally:
            pages[:] = [p for p in pages if p not in done]

    def _unmap_runs(self, region: Region, runs: list[tuple[int, int]], done: set[int]) -> None:
        """`_unmap_mapped`'s unmaps of these (first page, count) runs, one cuMemUnmap each in one batch; each
        run unmapped is recorded (and its pages added to `done`) even when a later one fails."""
        unmapped = 0
        try:
            self.driver.unmap_each([(region.address(first), count * self.page_size) for first, count in runs])
            unmapped = len(runs)
        except BaseException as exc:
            unmapped = getattr(exc, "mapped", 0)
            raise
        finally:
            if not self.host_mapped and unmapped:  # device pages only: the runs' books in one pass
                firsts = np.fromiter((f for f, _ in runs[:unmapped]), dtype=np.int64, count=unmapped)
                counts = np.fromiter((c for _, c in runs[:unmapped]), dtype=np.int64, count=unmapped)
                pages = run_pages(firsts, counts)
                handles = region.handles[pages].tolist()
                region.handles[pages] = 0
                region.clear_unit_pages(pages)
                self.unmap_calls += unmapped
                self.unref_all(handles)
                done.update(pages.tolist())
                runs = []
            for first, count in runs[:unmapped]:
                self.unmap_calls += 1
                run = slice(first, first + count)
                handles = region.handles[run].tolist()
                host = region.backing[run] == HOST
                region.handles[run] = 0
                region.clear_units(first, count)
                hosts = []
                if host.any():  # a host-located handle never enters the device store
                    region.backing[run][host] = DEVICE
                    self.host_mapped -= int(host.sum())
                    hosts = [h for h, on_host in zip(handles, host.tolist()) if on_host]
                    handles = [h for h, on_host in zip(handles, host.tolist()) if not on_host]
                self.unref_all(handles)
                done.update(range(first, first + count))
                error = None
                for handle in hosts:
                    try:
                        self.driver.release(handle)
                    except CudaError as exc:
                        error = error or exc
                if error is not None:
                    raise error

    def ref(self, handle: int) -> None:
        """One more virtual page maps device `handle`: its first mapping counts it in `mapped`, later
        ones in `aliases`. The one place that counts a mapping (with `unref`)."""
        n = self.refs.get(handle, 0) + 1
        self.refs[handle] = n
        if n == 1:
            self.mapped += 1
        else:
            self.aliases += 1

    def ref_all(self, handles: list[int]) -> None:
        """`ref` of each handle, in one pass where none is mapped yet (handles from the store)."""
        refs = self.refs
        if len(handles) > 1 and refs.keys().isdisjoint(handles) and len(set(handles)) == len(handles):
            refs.update(dict.fromkeys(handles, 1))
            self.mapped += len(handles)
            return
        for handle in handles:
            self.ref(handle)

    def unref_all(self, handles: list[int]) -> None:
        """`unref(handle, to_store=True)` of each handle, in one pass where each is its handle's last
        mapping (no mesh shares it): they go to the store together."""
        refs = self.refs
        if len(handles) > 1 and not self.aliases:
            for handle in handles:
                del refs[handle]
            self.mapped -= len(handles)
            self.store.put(handles)
            return
        for handle in handles:
            self.unref(handle, to_store=True)

    def unref(self, handle: int, *, to_store: bool) -> None:
        """One virtual page stopped mapping device `handle`: at its last mapping it is no longer mapped
        (to the store with `to_store`, else the caller keeps it); before that, one alias less."""
        left = self.refs[handle] - 1
        if left:
            self.refs[handle] = left
            self.aliases -= 1
            return
        del self.refs[handle]
        self.mapped -= 1
        if to_store:
            self.store.put([handle])

    def alias(self, region: Region, pages: list[int], handle: int, txn: Transaction) -> None:
        """Map device `handle`, already mapped elsewhere, at each (unmapped) page too; one SetAccess per
        run. Undone by `txn` (the aliases are unmapped; the handle stays where it was)."""
        for p in pages:
            if region.handles[p]:
                raise ValueError(f"page {p} of region {region.index} is already mapped")
        if not self.refs.get(handle):
            raise ValueError(f"handle {handle:#x} is not mapped anywhere: nothing to alias")
        if handle in self.store.units:
            raise ValueError("a unit's page is never aliased: CUDA maps a handle from its first byte only")
        done: list[int] = []
        txn.on_rollback(self._unmap_mapped, region, done, False)
        for page in sorted(pages):
            self.driver.map(region.address(page), self.page_size, handle)
            self.map_calls += 1
            region.handles[page] = handle
            self.ref(handle)
            done.append(page)
        for first, count in page_runs(pages):
            self.driver.set_access(region.address(first), count * self.page_size)

    def detach(self, region: Region, page: int, txn: Transaction) -> int:
        """Unmap device page `page` and return its handle, which the caller keeps (not the store): it still
        holds the page's bytes. Undone by `txn`: the handle is mapped back, with access."""
        handle = int(region.handles[page])
        if not handle or region.backing[page] != DEVICE:
            raise ValueError(f"page {page} of region {region.index} is not a mapped device page")
        if region.unit_start[page] >= 0:
            raise ValueError(f"page {page} of region {region.index} is part of a unit: it is unmapped only whole")
        self.driver.unmap(region.address(page), self.page_size)
        self.unmap_calls += 1
        region.handles[page] = 0
        self.unref(handle, to_store=False)
        txn.on_rollback(self.attach, region, page, handle)
        return handle

    def attach(self, region: Region, page: int, handle: int) -> None:
        """Map a handle no store or page holds at unmapped `page`, with access (`detach`'s undo; a
        split's new page). A handle already mapped elsewhere takes `alias` instead."""
        va = region.address(page)
        self.driver.map(va, self.page_size, handle)
        self.map_calls += 1
        try:
            self.driver.set_access(va, self.page_size)
        except CudaError:
            self.driver.unmap(va, self.page_size)  # all or nothing
            self.unmap_calls += 1
            raise
        region.handles[page] = handle
        self.ref(handle)

    def unattach(self, region: Region, page: int) -> None:
        """Unmap `page`, whose handle the caller (a store transaction's undo) takes back: `attach`'s undo."""
        handle = int(region.handles[page])
        self.driver.unmap(region.address(page), self.page_size)
        self.unmap_calls += 1
        region.handles[page] = 0
        self.unref(handle, to_store=False)

    def unmap(self, region: Region, pages: list[int], *, sync: bool = True) -> None:
        """Synchronize, then unmap each page and return its handle to the store (cached).

        The caller guarantees no live data remains on these pages; `sync=False` only where it also
        knows the device is done with them (invariant 5). If a driver call fails part-way, the pages
        already unmapped stay unmapped (their state is recorded page by page) and the error propagates.
        """
        if not len(pages):
            return
        pages = np.asarray(pages, dtype=np.int64)
        pages = pages[region.handles[pages] != 0].tolist()
        if not pages:
            return
        if sync:
            self.driver.synchronize()
        self._unmap_mapped(region, pages, False)

    def release_all(self) -> None:
        """Unmap every page, release every handle and free every reservation."""
        if self.residency is not None:
            self.residency.release()  # host buffers of a sleep, references held for offloads
        if any(r.handles.any() for r in self.regions):
            self.driver.synchronize()
        for region in self.regions:
            self._unmap_mapped(region, region.mapped_pages(), False)
        self.store.trim(0)
        while self.regions:
            region = self.regions[-1]
            self.driver.free_address(region.base, region.size)
            self.regions.pop()
