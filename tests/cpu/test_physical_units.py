"""Units: the new pages of a large placement created as one driver handle per run of pages (one cuMemCreate,
one cuMemMap), unmapped only whole, kept whole once empty (spare) and mapped again whole."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from cuda.bindings.driver import CUresult

import defrag
from defrag.driver import Driver
from defrag.dry import DryPool
from defrag.errors import CudaError
from defrag.mesher import candidates
from defrag.page_growth import GrowthPolicy
from defrag.vmm import HOST, Transaction

from .conftest import KiB, MiB, check_pattern, fill_pattern

P = 2 * MiB


def _dry(units_of: int = 4, pages: int = 64, ceiling: float = 1.0) -> DryPool:
    """A dry pool of `pages` pages whose placements of 2 units' worth or more create units of `units_of`
    (while mapped pages stay within `ceiling` of the capacity: all the way, unless a test says)."""
    pool = DryPool(pages * P, P, auto_compact=False)
    pool.core.growth = GrowthPolicy(unit_share=pages // units_of, unit_ceiling=ceiling)
    return pool


def _calls(pool) -> dict:
    return dict(pool.driver.faults.calls)


def _made(pool, before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in pool.driver.faults.calls.items() if v != before.get(k, 0)}


def _units(region) -> list[tuple[int, int]]:
    """(first page, pages) of each mapped unit of `region`."""
    firsts = np.flatnonzero((region.unit_start >= 0) & (region.unit_start == np.arange(region.npages)))
    return [(int(f), int(region.unit_len[f])) for f in firsts]


def test_the_unit_size_follows_the_capacity_and_small_placements_take_single_pages():
    policy = GrowthPolicy()
    assert policy.unit_pages_for(64, 40960) == 32  # an 80 GiB pool of 2 MiB pages: 64 MiB units
    assert policy.unit_pages_for(63, 40960) == 0  # fewer than two units' worth: a handle per page
    assert policy.unit_pages_for(1000, 2000) == 0  # a unit of one page is a page
    assert GrowthPolicy(unit_share=0).unit_pages_for(10 ** 6, 10 ** 6) == 0
    with pytest.raises(ValueError, match="unit_share"):
        GrowthPolicy(unit_share=-1)
    with pytest.raises(ValueError, match="unit_min"):
        GrowthPolicy(unit_min=0)


def test_a_large_placement_maps_each_run_of_new_pages_as_units():
    pool = _dry()
    before = _calls(pool)
    assert pool.alloc("a", 10 * P)  # 10 new pages: units of 4, 4 and 2
    made = _made(pool, before)
    assert made["cuMemCreate"] == 3 and made["cuMemMap"] == 3 and made["cuMemSetAccess"] == 1
    region = pool.core.space.regions[0]
    assert _units(region) == [(0, 4), (4, 4), (8, 2)]
    before = _calls(pool)
    assert pool.alloc("b", 3 * P)  # 3 pages: under two units' worth, a handle each
    assert _made(pool, before)["cuMemCreate"] == 3 and _made(pool, before)["cuMemMap"] == 3
    st = pool.stats()
    assert st["pages.mapped"] == 13 and st["pages.total"] == 13 and st["reserved_bytes.all.current"] == 13 * P
    pool.check_invariants()


def test_a_unit_is_unmapped_only_whole_and_a_part_stays_mapped():
    pool = _dry()
    assert pool.alloc("a", 8 * P)
    pool.free("a")
    core, region = pool.core, pool.core.space.regions[0]
    state, before = pool.driver.api.state(), _calls(pool)
    with pytest.raises(ValueError, match="part of a unit"):
        core.space.unmap(region, [1, 2])
    assert pool.driver.api.state() == state and "cuMemUnmap" not in _made(pool, before)
    core.backing.unmap_empty([(region, 0), (region, 1), (region, 4), (region, 5), (region, 6), (region, 7)])
    assert _units(region) == [(0, 4)]  # the second unit went whole, the first stayed: listed in part
    assert pool.stats()["pages.mapped"] == 4 and pool.stats()["pages.cached"] == 4
    assert "cuMemRelease" not in _made(pool, before)  # kept: a spare unit
    pool.check_invariants()


def test_a_partly_used_unit_lends_no_donor_and_an_empty_one_goes_whole():
    pool = _dry()
    assert pool.alloc("a", 8 * P)  # units at pages 0-3 and 4-7
    assert pool.alloc("b", 8 * P)  # units at pages 8-11 and 12-15
    pool.free("a")
    assert pool.alloc("small", P // 2)  # on page 0: the first unit is partly used
    backing, region = pool.core.backing, pool.core.space.regions[0]
    assert pool._blocks["small"].address == region.address(0)
    empty = [p for r, p in backing.empty_mapped()]
    assert empty == [4, 5, 6, 7]  # pages 1-3 are empty, but their unit is not
    donors = backing.donors(None, (), 1)  # one page asked for: its whole unit comes
    assert sorted(p for _, p in donors) == [4, 5, 6, 7]
    pool.check_invariants()


def test_a_spare_unit_is_mapped_again_whole_and_trim_releases_it():
    pool = _dry()
    assert pool.alloc("a", 8 * P)
    pool.free("a")
    backing, region = pool.core.backing, pool.core.space.regions[0]
    backing.unmap_empty(backing.empty_mapped())
    assert pool.core.space.store.spare_pages == 8 and pool.stats()["pages.mapped"] == 0
    before = _calls(pool)
    assert pool.alloc("b", 8 * P)
    made = _made(pool, before)
    assert "cuMemCreate" not in made and made["cuMemMap"] == 2  # the two spare units, whole
    pool.free("b")
    before = _calls(pool)
    released = pool.core.trim()
    assert released == 8 * P and _made(pool, before)["cuMemRelease"] == 2
    st = pool.stats()
    assert st["pages.total"] == 0 and st["pages.cached"] == 0
    pool.check_invariants()


def test_single_pages_get_room_from_spare_units_released_when_the_capacity_asks():
    pool = _dry(pages=16)  # units of 4 pages
    assert pool.alloc("a", 16 * P)
    pool.free("a")
    backing = pool.core.backing
    backing.unmap_empty(backing.empty_mapped())
    assert pool.core.space.store.spare_pages == 16 and pool.core.space.store.creatable == 0
    for i in range(6):  # single pages: two spare units released to make room, the other two kept
        assert pool.alloc(i, P)
    store = pool.core.space.store
    assert store.spare_pages == 8 and store.total == 14 and pool.driver.faults.calls["cuMemRelease"] == 2
    pool.check_invariants()


@pytest.mark.parametrize("call,nth", [("cuMemCreate", 1), ("cuMemCreate", 3), ("cuMemMap", 1), ("cuMemMap", 2),
                                      ("cuMemMap", 3), ("cuMemSetAccess", 1)])
def test_a_driver_fault_while_mapping_units_leaves_the_pool_as_it_was(call, nth):
    pool = _dry()
    assert pool.alloc("x", P)
    before = pool.stats()
    state = pool.driver.api.state()
    pool.driver.faults.inject(call, CUresult.CUDA_ERROR_UNKNOWN, nth=nth)
    with pytest.raises(CudaError):
        pool.core.allocate(10 * P)
    pool.driver.faults.clear()
    after = pool.stats()
    for key in ("pages.mapped", "reserved_bytes.all.current", "allocated_bytes.all.current", "pages.empty"):
        assert after[key] == before[key], key
    assert all(not r.unit_start[r.handles == 0].size or (r.unit_start[r.handles == 0] < 0).all()
               for r in pool.core.space.regions)
    store = pool.core.space.store
    assert pool.driver.api.state()["mappings"] == state["mappings"]
    assert store.total == store.spare_pages + len(store.cached) + pool.core.space.mapped
    pool.check_invariants()
    assert pool.alloc("y", 10 * P)  # and it succeeds afterwards
    pool.check_invariants()


def _unit_pool(make_pool):
    """An emulated pool of 256 pages of 64 KiB whose placements of 16 pages or more create units of 8."""
    pool = make_pool("16MiB", auto_compact=False)
    pool.core.growth = GrowthPolicy(unit_share=32)
    return pool


def test_sleep_unmaps_units_whole_and_wake_brings_every_byte_back(make_pool):
    pool = _unit_pool(make_pool)
    ts = [pool.empty((n,), dtype=torch.uint8) for n in (3 * MiB // 2, 5000, MiB)]
    for i, t in enumerate(ts):
        fill_pattern(t, i)
    region = pool.core.space.regions[0]
    assert len(_units(region)) == 5  # 24 pages in 8s, then 16 in 8s
    calls = pool.driver.faults.calls
    unmaps = calls.get("cuMemUnmap", 0)
    pool.sleep()
    assert calls["cuMemUnmap"] - unmaps == 5 + 1  # a call per unit, and the single page
    assert pool.driver.api.used == 0 and _units(region) == []
    pool.check_invariants()
    pool.wake()
    assert all(check_pattern(t, i) for i, t in enumerate(ts))
    pool.check_invariants()


def test_a_fault_in_sleep_maps_the_units_back_whole_with_their_bytes(make_pool):
    pool = _unit_pool(make_pool)
    t = pool.empty((2 * MiB,), dtype=torch.uint8)
    fill_pattern(t, 3)
    region = pool.core.space.regions[0]
    units = _units(region)
    pool.driver.faults.inject("cuMemUnmap", nth=3)
    with pytest.raises(CudaError):
        pool.sleep()
    pool.driver.faults.clear()
    assert not pool.asleep and _units(region) == units
    assert check_pattern(t, 3)
    pool.check_invariants()


def test_offload_packs_a_tensor_off_its_units_first(make_pool):
    pool = _unit_pool(make_pool)
    cold = pool.empty((MiB,), dtype=torch.uint8)  # 16 pages: two units of 8
    hot = pool.empty((MiB,), dtype=torch.uint8)
    fill_pattern(cold, 1)
    fill_pattern(hot, 2)
    region = pool.core.space.regions[0]
    assert _units(region)
    report = pool.offload(cold)
    assert report.moved_tensors == 1
    page = region.page_of(cold.data_ptr())
    assert region.backing[page] == HOST and region.unit_start[page] < 0
    assert check_pattern(cold, 1) and check_pattern(hot, 2)
    pool.check_invariants()
    pool.reload(cold)
    assert check_pattern(cold, 1)
    pool.check_invariants()


def test_a_units_pages_never_mesh_or_rebacked_alone(make_pool):
    pool = _unit_pool(make_pool)
    ts = [pool.empty((n,), dtype=torch.uint8) for n in (MiB, 100, 100)]
    region = pool.core.space.regions[0]
    unit_pages = set(np.flatnonzero(region.unit_start >= 0).tolist())
    assert unit_pages
    pages, _, _ = candidates(pool.core, region, pool.core.scope(None))
    assert not unit_pages & set(pages)
    with pytest.raises(ValueError, match="unit"):
        with Transaction() as txn:
            pool.core.backing.reback(region, [min(unit_pages)], [0], HOST, txn)
    pool.check_invariants()
    del ts


def test_past_the_ceiling_the_pool_makes_no_more_units():
    pool = _dry(units_of=4, pages=64, ceiling=0.5)
    assert pool.alloc("a", 16 * P) and pool.alloc("b", 16 * P)  # 32 pages mapped: at the ceiling, units
    region = pool.core.space.regions[0]
    assert len(_units(region)) == 8 and not pool.core.units_closed
    before = _calls(pool)
    assert pool.alloc("c", 8 * P)  # 40 pages would pass it: a handle per page, and no unit from now on
    assert _made(pool, before)["cuMemCreate"] == 8 and pool.core.units_closed
    pool.free("c")
    pool.free("a")
    assert pool.alloc("d", 8 * P) and len(_units(region)) == 8  # the free units' pages hold it
    with pytest.raises(ValueError, match="unit_ceiling"):
        GrowthPolicy(unit_ceiling=0)
    pool.check_invariants()


def _stranding_pool(make_pool):
    """An emulated pool of 24 pages of 64 KiB: units [0, 8) and [8, 16), single pages [16, 24) under `b`,
    and of the first unit only page 4 used (by `c`): 7 pages that unit strands, 8 the other holds
    empty, and no free run of addresses in [0, 24) long enough for 14 pages."""
    pool = make_pool("1536KiB", auto_compact=False)
    pool.core.growth = GrowthPolicy(unit_share=3, unit_ceiling=1.0)  # units of 8 for placements of 16 pages
    P = pool.page_size
    a = pool.empty((16 * P,), dtype=torch.uint8)
    b = pool.empty((8 * P,), dtype=torch.uint8)
    region = pool.core.space.regions[0]
    assert _units(region) == [(0, 8), (8, 8)] and region.page_of(b.data_ptr()) == 16
    del a
    c1 = pool.empty((4 * P,), dtype=torch.uint8)
    c = pool.empty((P,), dtype=torch.uint8)
    assert region.page_of(c1.data_ptr()) == 0 and region.page_of(c.data_ptr()) == 4
    del c1
    fill_pattern(b, 1)
    fill_pattern(c, 2)
    return pool, region, b, c


def test_a_placement_breaks_a_partly_used_unit_for_the_pages_it_strands(make_pool):
    pool, region, b, c = _stranding_pool(make_pool)
    P = pool.page_size
    before = _calls(pool)
    d = pool.empty((14 * P,), dtype=torch.uint8)  # 15 pages are free, 7 of them only by breaking [0, 8)
    made = _made(pool, before)
    assert region.page_of(d.data_ptr()) >= 24 and _units(region) == []
    assert region.handles[4] > 0 and region.unit_start[4] < 0  # c's page: a single page of its own
    assert check_pattern(b, 1) and check_pattern(c, 2)
    assert made["cuMemcpyDtoDAsync"] == 1  # c's page, the one used page of the unit broken
    st = pool.stats()
    assert st["pages.total"] <= 24 and st["units.broken"] == 1 and st["units.freed_pages"] == 7
    fill_pattern(d, 3)
    assert check_pattern(c, 2) and check_pattern(b, 1)
    pool.check_invariants()


@pytest.mark.parametrize("call,nth", [("cuMemcpyDtoDAsync", 1), ("cuMemUnmap", 2), ("cuMemMap", 1), ("cuMemSetAccess", 2)])
def test_a_driver_fault_while_breaking_a_unit_leaves_it_whole_with_its_bytes(make_pool, call, nth):
    pool, region, b, c = _stranding_pool(make_pool)
    P = pool.page_size
    units = _units(region)
    pool.driver.faults.inject(call, CUresult.CUDA_ERROR_UNKNOWN, nth=nth)
    with pytest.raises(torch.OutOfMemoryError):
        pool.empty((14 * P,), dtype=torch.uint8)
    pool.driver.faults.clear()
    assert region.unit_start[4] == 0 and (0, 8) in _units(region) and units[0] == (0, 8)
    assert check_pattern(b, 1) and check_pattern(c, 2)
    pool.check_invariants()
    d = pool.empty((14 * P,), dtype=torch.uint8)  # the next try breaks it
    assert check_pattern(b, 1) and check_pattern(c, 2) and d.numel() == 14 * P
    pool.check_invariants()


def test_past_the_ceiling_what_units_strand_is_freed_at_the_next_placement_that_stitches():
    pool = _dry(units_of=4, pages=64, ceiling=0.5)
    assert pool.alloc("a", 16 * P) and pool.alloc("b", 16 * P)
    region = pool.core.space.regions[0]
    pool.free("a")
    assert pool.alloc("s", P // 2)  # half of page 0: 3 empty pages in the first unit
    assert pool.core.backing.stranded_in_units() == 3 and (0, 4) in _units(region)
    before = _calls(pool)
    assert pool.alloc("c", 20 * P)  # past the ceiling and the budget, it stitches: that unit is broken first
    made = _made(pool, before)
    assert pool.core.units_closed and (0, 4) not in _units(region)
    assert region.unit_start[0] < 0 and region.handles[0] != 0 and not region.handles[1:4].any()
    assert pool.core.backing.stranded_in_units() == 0
    assert made["cuMemUnmap"] >= 1 and made["cuCtxSynchronize"] >= 2
    pool.check_invariants()


THREAD_HOLDS = r"""
import sys, threading, torch, defrag
sys.path.insert(0, "tests")
from cpu.test_physical_units import _stranding_pool
from defrag.driver import Driver
def make(capacity, **kw):
    drv = Driver.emulated(capacity=4 * defrag.parse_size(capacity), granularity=64 * 1024)
    return defrag.Pool(device=drv, capacity=capacity, **kw)
pool, region, b, c = _stranding_pool(make)
P = pool.page_size
used, done = threading.Event(), threading.Event()
def worker():
    t = pool.empty((P // 4,), dtype=torch.uint8)  # this thread used the pool, and runs on
    used.set()
    done.wait()
    del t
w = threading.Thread(target=worker, name="busy-worker")
w.start()
used.wait()
try:
    pool.empty((14 * P,), dtype=torch.uint8)
    print("placed while busy")
except torch.OutOfMemoryError:
    print("refused while busy", int(region.unit_start[4]))
done.set()
w.join()
d = pool.empty((13 * P,), dtype=torch.uint8)
print("placed after", int(region.unit_start[4]), bool(torch.equal(c, c.clone())))
"""


def test_no_unit_is_broken_while_another_thread_that_used_the_pool_runs():
    """A break copies blocks' pages: another running thread's write between the copy and the swap would
    be lost, so none is broken then (the placement fails as it would without breaking); once the
    thread is gone, the same request breaks the unit."""
    out = subprocess.run([sys.executable, "-c", THREAD_HOLDS], capture_output=True, text=True, timeout=300,
                         env={**os.environ}, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.split("\n")
    assert "refused while busy 0" in lines, out.stdout
    assert any(line.startswith("placed after -1") for line in lines), out.stdout


def test_reload_unmaps_empty_units_whole_for_its_pages(make_pool):
    """Reload takes device pages from empty mapped pages when the store has none: a unit among them goes
    whole (a part of one would free nothing), and the tensor comes back with its bytes."""
    pool = _unit_pool(make_pool)
    P = pool.page_size
    big = pool.empty((16 * P,), dtype=torch.uint8)  # pages [0, 16): two units of 8
    cold = pool.empty((P,), dtype=torch.uint8)
    fill_pattern(cold, 5)
    region = pool.core.space.regions[0]
    assert _units(region) == [(0, 8), (8, 8)]
    pool.offload(cold)
    store = pool.core.space.store
    rest = []
    while store.available > 0:
        rest.append(pool.empty((P,), dtype=torch.uint8))
    del big  # 16 empty pages, all in units: the only pages a reload can have
    pool.reload(cold)
    assert check_pattern(cold, 5) and (0, 8) not in _units(region)
    pool.check_invariants()


def test_a_device_full_retry_skips_the_pages_its_failed_attempt_left_mapped():
    """The device refuses pages below the pool's capacity and the failed attempt's undo cannot unmap one
    of its units: the retry with single pages maps only the pages still unmapped, and the request ends
    in an OOM that says why, with the books matching the device."""
    drv = Driver.emulated(capacity=16 * 64 * KiB, granularity=64 * KiB)  # a device of 16 pages
    pool = defrag.Pool(device=drv, capacity="16MiB", auto_compact=False)
    pool.core.growth = GrowthPolicy(unit_share=32, unit_ceiling=1.0)  # units of 8 for placements of 16 pages
    pool.driver.faults.inject("cuMemUnmap", CUresult.CUDA_ERROR_UNKNOWN, nth=1)
    with pytest.raises(torch.OutOfMemoryError, match="device has no free memory"):
        pool.empty((24 * pool.page_size,), dtype=torch.uint8)
    pool.driver.faults.clear()
    pool.check_invariants()
    region = pool.core.space.regions[0]
    assert _units(region) == [(0, 8)] and pool.stats()["pages.mapped"] == 8  # the unit its undo left mapped
    assert drv.api.state()["mappings"] == 1
    t = pool.empty((8 * pool.page_size,), dtype=torch.uint8)  # those pages serve as they are
    fill_pattern(t, 4)
    assert check_pattern(t, 4) and region.page_of(t.data_ptr()) == 0
    pool.check_invariants()
    del t
    pool.close()


def test_no_unit_is_broken_while_a_cuda_graph_is_captured(make_pool):
    """A break synchronizes the device, which would invalidate a capture: during one the request fails
    as it would without breaking, and the unit is untouched; after it, the same request breaks it."""
    pool, region, b, c = _stranding_pool(make_pool)
    P = pool.page_size
    pool.driver.api.capturing = True
    try:
        with pytest.raises(torch.OutOfMemoryError):
            pool.empty((14 * P,), dtype=torch.uint8)
    finally:
        pool.driver.api.capturing = False
    assert (0, 8) in _units(region) and pool.stats()["units.broken"] == 0
    d = pool.empty((14 * P,), dtype=torch.uint8)
    assert pool.stats()["units.broken"] == 1 and check_pattern(b, 1) and check_pattern(c, 2)
    del d
    pool.check_invariants()
