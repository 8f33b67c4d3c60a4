"""`Driver.map_each`: a batch of cuMemMap calls that is, to everyone who can look, those calls one by one.

A batch on an emulated or memory-less device runs under one hold of the
device's lock, checks a run of pages against the reservations once and records
it with one insertion. What it must not change: which calls succeed, the error
of the first that fails, how many calls the device and the fault plan count,
when a planned fault fires, and what is mapped afterwards. Each test runs the
same calls both ways on two fresh devices and compares them.
"""
from __future__ import annotations

import pytest
from cuda.bindings import driver as cu
from hypothesis import given, settings
from hypothesis import strategies as st

from defrag.driver import Driver
from defrag.errors import CudaError

G = 2 << 20
CAP = 64 * G
KINDS = ("emulated", "memoryless")


def _device(kind: str) -> tuple[Driver, int, list[int]]:
    """A device with one 32-page reservation, 24 handles (the last 4 released again) and pages 5 and 6
    mapped already."""
    d = getattr(Driver, kind)(capacity=CAP, granularity=G)
    base = d.reserve(32 * G, G)
    handles = [d.create(G) for _ in range(24)]
    d.map(base + 5 * G, G, handles[0])
    d.map(base + 6 * G, G, handles[1])
    for h in handles[20:]:
        d.release(h)
    return d, base, handles


def _close(d: Driver) -> None:
    d.api.close()
    d.close()


def _mapped(d: Driver) -> list[tuple[int, int, int]]:
    maps, _ = d.api._addresses.in_address_order()
    return [(m.va, m.size, m.handle) for m in maps]


def _one_by_one(d: Driver, vas, handles) -> tuple[int, str | None]:
    for i, (va, h) in enumerate(zip(vas, handles)):
        try:
            d.map(va, G, h)
        except CudaError as exc:
            return i, exc.name
    return len(vas), None


def _batched(d: Driver, vas, handles) -> tuple[int, str | None]:
    try:
        d.map_each(vas, G, handles)
    except CudaError as exc:
        return exc.mapped, exc.name
    return len(vas), None


def _both(kind: str, pages: list[int], which: list[int], fault: int | None, outside: int | None = None):
    """Map `pages` (page numbers of the reservation; -1: an address outside it) with handles `which`
    (indices of the device's handles; -1: a handle that never existed) both ways, a fault planned on the
    `fault`-th cuMemMap of the calls when given; returns what each way saw."""
    seen = []
    for way in (_one_by_one, _batched):
        d, base, handles = _device(kind)
        try:
            vas = [base + p * G if p >= 0 else base + 40 * G for p in pages]
            hs = [handles[w] if w >= 0 else 0xDEAD000 for w in which]
            if fault is not None:
                d.faults.inject("cuMemMap", cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY, nth=fault)
            before_dev = d.api.calls.get("cuMemMap", 0)
            before_plan = d.faults.calls.get("cuMemMap", 0)
            result = way(d, vas, hs)
            seen.append((result, _mapped(d), d.api.calls.get("cuMemMap", 0) - before_dev,
                         d.faults.calls.get("cuMemMap", 0) - before_plan, d.faults.pending(),
                         list(d.faults.injected), d.api.state()))
        finally:
            _close(d)
    return seen


@pytest.mark.parametrize("kind", KINDS)
def test_a_clean_batch_maps_every_page_and_counts_one_call_each(kind):
    (single, batched) = _both(kind, [8, 9, 10, 11, 20, 21, 0], [2, 3, 4, 5, 6, 7, 8], None)
    assert single == batched
    (mapped, error), maps, device_calls, plan_calls, *_ = batched
    assert (mapped, error) == (7, None)
    assert device_calls == plan_calls == 7
    assert len(maps) == 2 + 7


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("nth", [1, 3, 7])
def test_a_planned_fault_stops_the_batch_at_that_call_with_nothing_after_it_mapped(kind, nth):
    pages = [8, 9, 10, 11, 12, 13, 14]
    single, batched = _both(kind, pages, list(range(2, 9)), nth)
    assert single == batched
    (mapped, error), maps, device_calls, plan_calls, pending, injected, _ = batched
    assert (mapped, error) == (nth - 1, "CUDA_ERROR_OUT_OF_MEMORY")
    assert len(maps) == 2 + nth - 1  # nothing at or after the faulted call
    assert (device_calls, plan_calls, pending) == (nth - 1, nth, 0)
    assert injected == [("cuMemMap", "CUDA_ERROR_OUT_OF_MEMORY")]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("pages, which, where", [
    ([3, 4, 5, 7], [2, 3, 4, 5], 2),        # page 5 is mapped already: the third call fails
    ([8, 9, 10], [2, 20, 4], 1),            # handle 20 was released
    ([8, 9, 10], [2, 3, -1], 2),            # a handle that never existed
    ([-1, 9], [2, 3], 0),                   # an address outside every reservation
])
def test_a_call_that_breaks_a_rule_fails_as_it_would_alone(kind, pages, which, where):
    single, batched = _both(kind, pages, which, None)
    assert single == batched
    (mapped, error), _, device_calls, plan_calls, *_ = batched
    assert (mapped, error) == (where, "CUDA_ERROR_INVALID_VALUE")
    assert device_calls == plan_calls == where + 1


@settings(max_examples=60, deadline=None)
@given(pages=st.lists(st.integers(-1, 31), min_size=0, max_size=12),
       picks=st.lists(st.integers(-1, 23), min_size=12, max_size=12),
       fault=st.one_of(st.none(), st.integers(1, 13)))
def test_a_batch_is_its_calls_one_by_one(pages, picks, fault):
    """Any addresses (in or out of order, repeated, mapped, outside), any handles (released, unknown,
    repeated), any planned fault: the same outcome, mappings, counts and fired faults."""
    single, batched = _both("memoryless", pages, picks[:len(pages)], fault)
    assert single == batched


def _flaky_host(d: Driver, monkeypatch, name: str, fails_after: int, error: OSError):
    """Make the device's host side `name` (map, unmap, create_page) raise `error` once `fails_after` calls
    have passed; returns the real method."""
    host = d.api.host_memory
    real, passed = getattr(host, name), []

    def flaky(*args):
        if len(passed) == fails_after:
            raise error
        passed.append(args)
        return real(*args)

    monkeypatch.setattr(host, name, flaky)
    return real


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fails_at", [0, 2, 5])
def test_a_host_failure_mid_batch_leaves_the_books_whole_and_the_map_rolled_back(kind, fails_at, monkeypatch):
    """An mmap that fails inside a batch (the host side, not a CUDA error): the pages before it are mapped
    and recorded on the device, as the calls one by one would leave them, the error carries how many, and
    the vmm's map rolls all of it back with every handle in its store and the device's books consistent."""
    from defrag.vmm import AddressSpace

    d = getattr(Driver, kind)(capacity=CAP, granularity=G)
    try:
        space = AddressSpace(d, G, 16)
        region = space.reserve(16)
        host = d.api.host_memory
        real_map = _flaky_host(d, monkeypatch, "map", fails_at, OSError(12, "Cannot allocate memory"))
        monkeypatch.setattr(host, "maps_bytes", True)  # a memory-less host's map does nothing: call it anyway
        before = d.faults.calls.get("cuMemMap", 0)
        with pytest.raises(OSError) as raised:
            space.map(region, list(range(3, 9)))
        assert raised.value.mapped == fails_at
        assert d.faults.calls["cuMemMap"] - before == d.api.calls["cuMemMap"] == fails_at + 1
        assert (region.handles == 0).all() and space.mapped == 0
        assert d.api.state()["mappings"] == 0 and len(space.store.cached) == space.store.total == 6
        monkeypatch.setattr(host, "map", real_map)
        space.map(region, list(range(3, 9)))  # the handles serve again
        assert d.api.state()["mappings"] == 6 and space.mapped == 6
    finally:
        d.api.close()
        d.close()


def test_a_proxy_over_the_device_sees_each_call_of_a_batch():
    """A proxy in front of the device API (a recorder, a tracer) is not the device: the batch sends it one
    cuMemMap per page, each with the arguments a single map would give."""
    from defrag.driver import EmulatedCuda

    from .test_driver import Recorder

    api = EmulatedCuda(capacity=CAP, granularity=G)
    rec = Recorder(api)
    d = Driver.emulated(api=rec)
    try:
        base = d.reserve(8 * G, G)
        hs = [d.create(G) for _ in range(3)]
        d.map_each([base + G, base + 2 * G, base + 5 * G], G, hs)
        maps = [args for name, args in rec.log if name == "cuMemMap"]
        assert maps == [(base + G, G, 0, hs[0], 0), (base + 2 * G, G, 0, hs[1], 0), (base + 5 * G, G, 0, hs[2], 0)]
    finally:
        api.close()
        d.close()


# ---------------------------------------------------------------- create_each: a batch of cuMemCreate


def _creates_both(kind: str, n: int, fault: int | None, capacity_pages: int):
    """Create `n` pages one by one and as a batch, on fresh devices of `capacity_pages` pages (two already
    created), a fault planned on the `fault`-th cuMemCreate when given; what each way saw."""
    seen = []
    for batched in (False, True):
        d = getattr(Driver, kind)(capacity=capacity_pages * G, granularity=G)
        try:
            first = [d.create(G) for _ in range(2)]
            if fault is not None:
                d.faults.inject("cuMemCreate", cu.CUresult.CUDA_ERROR_UNKNOWN, nth=fault)
            made, error = [], None
            try:
                if batched:
                    made = d.create_each(G, n)
                else:
                    for _ in range(n):
                        made.append(d.create(G))
            except CudaError as exc:
                error = exc.name
                if batched:
                    assert exc.mapped == len(exc.created)
                    made = exc.created
            for h in made:  # every handle made is real and distinct from the others
                d.release(h)
            seen.append((len(made), len(set(made) | set(first)), error, d.api.calls["cuMemCreate"],
                         d.faults.calls["cuMemCreate"], d.faults.pending(), list(d.faults.injected),
                         d.api.state()))
        finally:
            _close(d)
    return seen


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n, fault, capacity_pages, made, error", [
    (6, None, 16, 6, None),                          # every one made, counted one call each
    (6, 3, 16, 2, "CUDA_ERROR_UNKNOWN"),             # the planned fault stops the third
    (6, 7, 16, 6, None),                             # a fault beyond the batch stays planned
    (6, None, 5, 3, "CUDA_ERROR_OUT_OF_MEMORY"),     # the device fills after three more
])
def test_a_batch_of_creates_is_its_calls_one_by_one(kind, n, fault, capacity_pages, made, error):
    single, batched = _creates_both(kind, n, fault, capacity_pages)
    assert single == batched
    assert batched[:3] == (made, made + 2, error)
    assert batched[3] == made + 2 + (error is not None) - (error == "CUDA_ERROR_UNKNOWN")  # a fault never reaches the device


def test_the_store_gives_back_the_pages_a_refused_batch_made():
    """A creation refused part-way through a map: the pages made before it go back to the store with the
    rest (cached, none leaked), nothing is mapped, and they serve the next map."""
    from defrag.vmm import AddressSpace

    d = Driver.memoryless(capacity=CAP, granularity=G)
    try:
        space = AddressSpace(d, G, 16)
        region = space.reserve(16)
        d.faults.inject("cuMemCreate", cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY, nth=4)
        with pytest.raises(CudaError):
            space.map(region, list(range(6)))
        assert space.mapped == 0 and (region.handles == 0).all()
        assert len(space.store.cached) == space.store.total == space.store.created == 3
        assert d.api.state()["handles"] == 3
        space.map(region, list(range(6)))
        assert space.mapped == 6 and space.store.created == 6 and not space.store.cached
    finally:
        _close(d)


# ---------------------------------------------------------------- unmap_each: a batch of cuMemUnmap


def _unmaps_both(kind: str, ranges: list[tuple[int, int]], fault: int | None):
    """Unmap `ranges` ((first page, pages) of a reservation whose pages 0-11 are mapped one handle each)
    one by one and as a batch, a fault planned on the `fault`-th cuMemUnmap when given; what each way saw."""
    seen = []
    for batched in (False, True):
        d = getattr(Driver, kind)(capacity=CAP, granularity=G)
        try:
            base = d.reserve(32 * G, G)
            d.map_each([base + p * G for p in range(12)], G, [d.create(G) for _ in range(12)])
            if fault is not None:
                d.faults.inject("cuMemUnmap", cu.CUresult.CUDA_ERROR_UNKNOWN, nth=fault)
            vas = [(base + first * G, count * G) for first, count in ranges]
            done, error = len(vas), None
            try:
                if batched:
                    d.unmap_each(vas)
                else:
                    for i, (va, size) in enumerate(vas):
                        done = i
                        d.unmap(va, size)
                    done = len(vas)
            except CudaError as exc:
                error = exc.name
                if batched:
                    done = exc.mapped
            seen.append((done, error, _mapped(d), d.api.calls.get("cuMemUnmap", 0),
                         d.faults.calls.get("cuMemUnmap", 0), d.faults.pending(), d.api.state()))
        finally:
            _close(d)
    return seen


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ranges, fault, done, error", [
    ([(0, 3), (5, 1), (8, 4)], None, 3, None),                          # whole mappings, several per call
    ([(0, 3), (5, 1), (8, 4)], 2, 1, "CUDA_ERROR_UNKNOWN"),             # the planned fault stops the second
    ([(0, 2), (6, 1), (20, 1), (9, 1)], None, 2, "CUDA_ERROR_INVALID_VALUE"),  # nothing mapped at page 20
])
def test_a_batch_of_unmaps_is_its_calls_one_by_one(kind, ranges, fault, done, error):
    single, batched = _unmaps_both(kind, ranges, fault)
    assert single == batched
    assert batched[:2] == (done, error)
    assert len(batched[2]) == 12 - sum(count for _, count in ranges[:done])


@pytest.mark.parametrize("kind", KINDS)
def test_a_host_failure_mid_create_batch_loses_no_handle(kind, monkeypatch):
    """The host side refusing a page mid-batch (memfd_create out of descriptors, not a CUDA error): the
    handles made before it reach the store, which rolls them back into its cache with the rest; nothing is
    mapped, the device and the plan count the same calls, and a trim gives every handle back."""
    from defrag.vmm import AddressSpace

    d = getattr(Driver, kind)(capacity=CAP, granularity=G)
    try:
        space = AddressSpace(d, G, 16)
        region = space.reserve(16)
        _flaky_host(d, monkeypatch, "create_page", 2, OSError(24, "Too many open files"))
        with pytest.raises(OSError):
            space.map(region, list(range(5)))
        assert (region.handles == 0).all() and space.mapped == 0
        assert len(space.store.cached) == space.store.total == 2 and d.api.state()["handles"] == 2
        assert d.faults.calls["cuMemCreate"] == d.api.calls["cuMemCreate"] == 3
        assert space.store.trim(0) == 2 and d.api.state()["handles"] == 0 and d.api.used == 0
    finally:
        _close(d)


@pytest.mark.parametrize("kind", KINDS)
def test_a_host_failure_mid_unmap_batch_leaves_the_books_agreeing_with_the_device(kind, monkeypatch):
    """The host side failing the second of three runs' unmaps (an mmap refused, not a CUDA error): the first
    run is unmapped on the device and in the vmm's books, the other two stay mapped in both, the device and
    the plan count the same calls, and unmapping again finishes the job."""
    from defrag.vmm import AddressSpace

    d = getattr(Driver, kind)(capacity=CAP, granularity=G)
    try:
        space = AddressSpace(d, G, 16)
        region = space.reserve(16)
        space.map(region, [0, 1, 4, 5, 8, 9])
        real_unmap = _flaky_host(d, monkeypatch, "unmap", 1, OSError(12, "Cannot allocate memory"))
        with pytest.raises(OSError):
            space.unmap(region, [0, 1, 4, 5, 8, 9], sync=False)
        assert region.handles[[0, 1]].tolist() == [0, 0] and (region.handles[[4, 5, 8, 9]] != 0).all()
        assert [m.va for m in d.api._addresses.in_address_order()[0]] == [region.address(p) for p in (4, 5, 8, 9)]
        assert d.faults.calls["cuMemUnmap"] == d.api.calls["cuMemUnmap"] == 2
        assert space.mapped == 4 and len(space.store.cached) == 2
        monkeypatch.setattr(d.api.host_memory, "unmap", real_unmap)
        space.unmap(region, [4, 5, 8, 9], sync=False)
        assert space.mapped == 0 and len(space.store.cached) == 6 and d.api.state()["mappings"] == 0
    finally:
        _close(d)
