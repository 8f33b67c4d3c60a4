"""The page growth policy (`defrag.page_growth`) and how placement follows it: grow within the budget,
stitch beyond it, give back in batches under one synchronize, roll back a failed multi-page map."""

from __future__ import annotations

import pytest
import torch
from cuda.bindings.driver import CUresult

from defrag.dry import DryPool
from defrag.errors import CudaError
from defrag.page_growth import SLACK, GrowthPolicy, StitchFirst, Supply
from defrag.traces import random_serving

MiB, GiB = 1 << 20, 1 << 30
P = 2 * MiB


# ---------------------------------------------------------------- the policy alone
def _supply(policy=GrowthPolicy(), *, need, mapped, live, request=None, cached=0, creatable=1000, donors=1000,
            capacity=1000):
    return policy.supply(need, mapped=mapped, live_bytes=live * P, request_bytes=(need if request is None
                                                                                  else request) * P,
                         page_size=P, cached=cached, creatable=creatable, donors=donors, capacity=capacity)


def test_the_budget_is_the_slack_over_live_bytes_and_the_request_rounded_down():
    policy = GrowthPolicy()
    assert policy.slack == SLACK == 1.10
    assert policy.budget(100 * P, 10 * P, P) == 121
    assert policy.budget(0, P, P) == 1  # a first page is always within it
    assert policy.budget(9 * P, P, P) == 11
    assert policy.budget(9 * P, P - 512, P) == 10  # 10.99 pages: mapped bytes never pass the slack


def test_within_the_budget_cached_pages_then_new_ones():
    assert _supply(need=10, mapped=100, live=100) == Supply(0, 10, 0, 0)
    assert _supply(need=10, mapped=100, live=100, cached=4) == Supply(4, 6, 0, 0)


def test_beyond_the_budget_the_rest_is_stitched_and_more_may_go_back_in_the_same_batch():
    # live 100 + request 10 -> budget 121; 115 mapped: 6 pages may grow, 4 are stitched.
    s = _supply(need=10, mapped=115, live=100)
    assert (s.cached, s.created, s.stitched) == (0, 6, 4)
    assert s.give_back == 0  # at the budget once mapped: nothing beyond it to give back
    # 130 mapped, 9 beyond the budget: none may grow, all 10 stitched, and the 9 beyond it may go back too.
    s = _supply(need=10, mapped=130, live=100)
    assert (s.created, s.stitched, s.give_back) == (0, 10, 9)
    # ... at most a batch of them, and only what donors there are beyond the stitched ones.
    s = _supply(GrowthPolicy(batch_pages=5), need=10, mapped=130, live=100)
    assert (s.stitched, s.give_back) == (10, 5)
    s = _supply(need=10, mapped=130, live=100, donors=12)
    assert (s.stitched, s.give_back) == (10, 2)


def test_cached_pages_serve_first_even_beyond_the_budget():
    # Cached handles were mapped pages given back earlier: mapping them again grows nothing the pool holds.
    assert _supply(need=10, mapped=130, live=100, cached=10) == Supply(10, 0, 0, 0)


def test_the_budget_never_fails_a_request_the_capacity_allows():
    s = _supply(need=10, mapped=130, live=100, donors=3)
    assert (s.stitched, s.created) == (3, 7)


def test_growth_stops_at_the_capacity_over_the_slack():
    # A pool its live bytes nearly fill: the budget would allow 11 pages, the capacity (100 / 1.1 = 90) none.
    s = _supply(need=10, mapped=90, live=90, capacity=100, creatable=10)
    assert (s.created, s.stitched) == (0, 10)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="slack must be at least 1.0"):
        GrowthPolicy(slack=0.9)
    with pytest.raises(ValueError, match="batch_pages must be at least 1"):
        GrowthPolicy(batch_pages=0)


# ---------------------------------------------------------------- placement under it
def _replay(trace, capacity, policy=None, on_step=None):
    pool = DryPool(capacity, P, auto_compact=False)
    if policy is not None:
        pool.core.growth = policy
    live = peak = 0
    sizes = {}
    for i, ev in enumerate(trace.events):
        if ev[0] == "alloc":
            assert pool.alloc(ev[1], ev[2]), f"event {i}: {ev}"
            sizes[ev[1]] = -(-ev[2] // 512) * 512
            live += sizes[ev[1]]
            peak = max(peak, live)
        else:
            pool.free(ev[1])
            live -= sizes.pop(ev[1])
        if on_step is not None:
            on_step(pool, live, peak)
    return pool, peak


@pytest.fixture(scope="module")
def small_serving():
    """The serving trace's three scales of sizes with 4 GiB live at most (the issue's has 60 GiB)."""
    return random_serving(seed=3, steps=20000, live_limit=4 * GiB)


def test_the_budget_holds_after_every_step(small_serving):
    def check(pool, live, peak):
        assert pool.core.space.mapped <= int(SLACK * peak // P), (pool.core.space.mapped, peak / P)

    pool, peak = _replay(small_serving, 8 * GiB, on_step=check)
    assert pool.stats()["reserved_bytes.all.peak"] <= SLACK * peak
    pool.check_invariants()


def test_driver_calls_on_a_small_serving_trace(small_serving):
    """The budget's point: fewer maps and synchronizes than stitching whenever cached pages fall short (the
    same windows, batched unmaps and idle donors otherwise, and no units in either), for at most 10% more
    reserved."""
    new, peak = _replay(small_serving, 8 * GiB, GrowthPolicy(unit_share=0))
    old, _ = _replay(small_serving, 8 * GiB, StitchFirst(unit_share=0))
    n, o = new.driver.faults.calls, old.driver.faults.calls
    # Measured: 35,570 maps, 1,130 unmaps, 134 synchronizes, 336 SetAccess against 56,051, 1,908, 260
    # and 518 stitching first; 2,773 pages created against 2,530.
    assert (n["cuMemMap"] + n["cuMemUnmap"]) * 10 <= (o["cuMemMap"] + o["cuMemUnmap"]) * 7, (n, o)
    assert n["cuCtxSynchronize"] * 10 <= o["cuCtxSynchronize"] * 6, (n, o)
    assert n["cuMemSetAccess"] * 50 <= n["cuMemMap"]  # one per run of pages, not one per page
    assert n["cuMemUnmap"] * 10 <= n["cuMemMap"]  # one per run of donors
    assert new.stats()["reserved_bytes.all.peak"] <= SLACK * peak
    new.check_invariants()


def test_units_cut_the_maps_of_a_small_serving_trace(small_serving):
    """Pages created in units (one handle, one cuMemMap for up to capacity / 1280 pages: 3 pages here) map
    and create far less than a handle per page, and reserve no more: the budget holds after every step.
    A unit emptied is kept whole and mapped again whole, not released and created again."""
    def check(pool, live, peak):
        assert pool.core.space.mapped <= int(SLACK * peak // P), (pool.core.space.mapped, peak / P)

    units, peak = _replay(small_serving, 8 * GiB, on_step=check)
    pages, _ = _replay(small_serving, 8 * GiB, GrowthPolicy(unit_share=0))
    u, p = units.driver.faults.calls, pages.driver.faults.calls
    # Measured: 24,041 maps, 1,788 unmaps, 1,104 creates, no release against 36,793, 1,147 and 2,773.
    assert (u["cuMemMap"] + u["cuMemUnmap"]) * 10 <= (p["cuMemMap"] + p["cuMemUnmap"]) * 8, (u, p)
    assert u["cuMemCreate"] * 2 <= p["cuMemCreate"], (u, p)
    assert u.get("cuMemRelease", 0) * 20 <= u["cuMemCreate"], u  # spare units mapped again, not churned
    assert units.stats()["reserved_bytes.all.peak"] <= SLACK * peak
    units.check_invariants()

def test_beyond_the_budget_large_requests_are_stitched():
    """A pool over its budget (half its pages emptied) backs a large request with empty pages elsewhere:
    no page is created, mapped pages do not grow, and the donors go back in one synchronize."""
    pool = DryPool(64 * P, P, auto_compact=False)
    for i in range(32):
        assert pool.alloc(i, P)
    for i in range(0, 32, 2):
        pool.free(i)  # 16 empty pages, no two adjacent: the budget is 17.6 pages of 16 live
    calls = pool.driver.faults.calls
    before = dict(calls)
    assert pool.alloc("big", 8 * P)
    made = {k: calls.get(k, 0) - before.get(k, 0) for k in calls}
    assert made.get("cuMemCreate", 0) == 0 and made["cuMemMap"] == 8
    st = pool.stats()
    # The 8 stitched pages and, under the same synchronize, the 6 beyond the budget of 26 pages: 16
    # live + 8 placed, 2 empty.
    assert st["pages.mapped"] == 26 and st["pages.empty"] == 2
    assert st["reserved_bytes.all.peak"] == 32 * P
    pool.check_invariants()


def test_within_the_budget_a_large_request_maps_new_pages_and_unmaps_nothing():
    pool = DryPool(64 * P, P, auto_compact=False)
    for i in range(20):
        assert pool.alloc(i, P)
    pool.free(3)  # one empty page: below the budget, it stays for what fits there
    before = dict(pool.driver.faults.calls)
    assert pool.alloc("big", 4 * P)
    calls = pool.driver.faults.calls
    assert calls["cuMemCreate"] - before["cuMemCreate"] == 4
    assert calls.get("cuMemUnmap", 0) == before.get("cuMemUnmap", 0)
    assert calls.get("cuCtxSynchronize", 0) == before.get("cuCtxSynchronize", 0)
    assert calls["cuMemSetAccess"] - before["cuMemSetAccess"] == 1  # one run of 4 pages, one SetAccess


def _record_calls(pool) -> list[str]:
    """Every driver call `pool` makes from now on, in order (a batch's calls as they are counted)."""
    order: list[str] = []
    faults = pool.driver.faults
    take, count = faults._take, faults.count

    def recording(name):
        order.append(name)
        return take(name)

    def counting(name, n):
        order.extend([name] * max(n, 0))
        return count(name, n)

    faults._take, faults.count = recording, counting
    return order


def test_donors_touched_since_the_last_synchronize_wait_for_the_device_and_idle_ones_do_not():
    """Invariant 5 without a synchronize per stitch: pages empty at the last synchronize, with no block
    placed on them since, are unmapped at once; a page that held a block since waits for one."""
    pool = DryPool(64 * P, P, auto_compact=False)
    pool.core.growth = GrowthPolicy(batch_pages=1)
    for i in range(32):
        assert pool.alloc(i, P)
    for i in range(0, 32, 2):
        pool.free(i)
    order = _record_calls(pool)
    assert pool.alloc("a", 4 * P)  # the first donors held blocks since the pool began: wait for the device
    unmaps = [i for i, name in enumerate(order) if name == "cuMemUnmap"]
    assert unmaps and "cuCtxSynchronize" in order[:unmaps[0]]
    del order[:]
    assert pool.alloc("b", 4 * P)  # donors empty at that synchronize and untouched since: no wait
    assert "cuMemUnmap" in order and "cuCtxSynchronize" not in order
    backing = pool.core.backing
    region = pool.core.space.regions[0]
    idle = [p for r, p in backing.empty_mapped() if backing.idle[0][p]]
    assert len(idle) >= 3
    # A block placed on an idle page and freed again: the device may use that page until the next synchronize.
    assert pool.alloc("touch", P // 2) and pool._blocks["touch"].address == region.address(idle[0])
    pool.free("touch")
    assert not backing.idle[0][idle[0]] and backing.idle[0][idle[1]]
    del order[:]
    backing.unmap_empty([(region, idle[1])], idle_known=True)
    assert order == ["cuCtxGetCurrent", "cuMemUnmap"]
    del order[:]
    backing.unmap_empty([(region, idle[0])], idle_known=True)
    assert order[:2] == ["cuCtxGetCurrent", "cuCtxSynchronize"] and "cuMemUnmap" in order
    # Without the caller's word that no block was placed behind the backing's back, always a synchronize.
    assert backing.idle[0][idle[2]]
    del order[:]
    backing.unmap_empty([(region, idle[2])], idle_known=False)
    assert "cuCtxSynchronize" in order
    pool.check_invariants()


@pytest.mark.parametrize("call,nth", [("cuMemMap", 1), ("cuMemMap", 3), ("cuMemMap", 6), ("cuMemSetAccess", 1),
                                      ("cuMemCreate", 2), ("cuMemUnmap", 1)])
def test_a_driver_fault_in_a_multi_page_map_leaves_the_pool_as_it_was(call, nth):
    """A large request maps its pages in one transaction (stitched donors, new pages, one SetAccess per
    run): a fault at any step leaves every mapping, handle and free range as before, and the same
    request succeeds afterwards."""
    pool = DryPool(64 * P, P, auto_compact=False)
    for i in range(32):
        assert pool.alloc(i, P)
    for i in range(0, 32, 4):
        pool.free(i)  # 8 empty pages: within the budget a request grows, beyond it stitches
    pool.core.growth = GrowthPolicy(slack=1.06)  # 36 pages live once placed: a budget of 38, 6 new pages
    pool.check_invariants()
    before = pool.stats()
    state = pool.driver.api.state()
    pool.driver.faults.inject(call, CUresult.CUDA_ERROR_UNKNOWN, nth=nth)
    with pytest.raises(CudaError) as info:
        pool.alloc("big", 12 * P)
    assert info.value.call == call
    pool.driver.faults.clear()
    pool.check_invariants()
    after = pool.stats()
    assert after["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]
    assert after["active_bytes.all.current"] == before["active_bytes.all.current"]
    # Donors unmapped before the fault stay unmapped (cached, with their free space gone from the heap):
    # the books say what the device has, and nothing else changed.
    api = pool.driver.api.state()
    assert api["mappings"] == pool.core.space.mapped and api["handles"] == pool.core.space.store.total
    assert after["pages.mapped"] <= before["pages.mapped"]
    assert pool.alloc("big", 12 * P)
    pool.check_invariants()
    pool.close()
    assert pool.driver.api.state() == {"handles": 0, "mappings": 0, "reservations": 0, "used_bytes": 0}


def test_large_blocks_pack_end_to_end_and_smaller_ones_start_on_a_page():
    """Where a free tail saves no page: a block of `PACK_PAGES` or more starts in it (blocks end to end, as
    in expandable segments), a smaller one on the next page boundary (the tail stays for sub-page
    blocks); where the tail saves a page, every size starts in it."""
    from defrag.core import PACK_PAGES

    assert PACK_PAGES == 4
    pool = DryPool(64 * P, P, auto_compact=False)
    assert pool.alloc("a", 3 * P - MiB // 2)  # pages 0-2, 0.5 MiB free at the end of page 2
    a = pool._blocks["a"].address
    assert pool.alloc("b", 3 * MiB)  # 2 pages either way: on the page boundary after a
    b = pool._blocks["b"].address
    assert b == a + 3 * P
    assert pool.alloc("c", 5 * P)  # 5 pages either way, from b's 1 MiB tail or from the next page: the tail
    assert pool._blocks["c"].address == b + 3 * MiB
    assert pool.alloc("d", 2 * P - MiB // 2)  # 2 pages from c's 1 MiB tail or from the next page: the page
    assert pool._blocks["d"].address == a + 10 * P
    pool.check_invariants()
    assert pool.stats()["pages.mapped"] == 12  # a on pages 0-2, b 3-4, c 4-9, d 10-11


@pytest.mark.parametrize("extra", [0, 512])
def test_a_block_whose_window_starts_in_a_used_pages_tail_needs_no_page_for_it(extra):
    """A block starting in the free tail of a page that another block holds needs a physical page for
    each of its other pages only: with exactly that many left it is placed (the quick count of free
    pages against the block's page count would refuse it); 512 bytes more need one page more than is
    left: NoSpace, and nothing changes."""
    pool = DryPool(4 * P, P, auto_compact=False)
    assert pool.alloc("a", MiB)  # page 0, its second half free; 3 pages left to create
    a = pool._blocks["a"].address
    before = pool.stats()
    fits = extra == 0
    assert pool.alloc("b", 3 * P + MiB + extra) == fits  # from a's tail over pages 1-3 (and a bit of 4)
    pool.check_invariants()
    after = pool.stats()
    if fits:
        assert pool._blocks["b"].address == a + MiB
        assert after["pages.mapped"] == 4
    else:
        assert after["pages.mapped"] == before["pages.mapped"] == 1
        assert after["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]

def test_a_request_no_region_holds_is_refused_before_a_new_region_is_reserved():
    """With no virtual room beyond the capacity, a request that fits no window of the region needs a new
    region whose every page needs a physical page: one short, NoSpace, and no reservation is left behind."""
    pool = DryPool(4 * P, P, auto_compact=False, virtual_factor=1)
    assert pool.alloc("a", MiB)  # page 0, its second half free; 3 pages left to create
    before = pool.driver.api.state()
    assert not pool.alloc("b", 3 * P + MiB + 512)  # 4 pages in a new region (a's tail and 3 pages: too short)
    assert pool.driver.api.state() == before and len(pool.core.space.regions) == 1
    pool.check_invariants()

def test_a_native_placement_marks_its_pages_in_use_too(make_pool):
    """The books clear a page's idle flag at every placement, the fast path's (no Python) included: a
    stitch may skip its synchronize only for pages nothing was placed on since the last one."""
    pool = make_pool("64MiB")
    if pool.core.fast is None:
        pytest.skip("no native fast path (DEFRAG_FASTPATH=0)")
    backing = pool.core.backing
    t = pool.empty(1 << 20, dtype=torch.uint8)
    page = backing.pages_of(t.data_ptr(), 1)[0]
    del t
    backing.idle[0][page] = True  # as a synchronize would leave an empty page
    hits = pool.core.fast.hits
    t = pool.empty(1 << 20, dtype=torch.uint8)  # the range kept for its size: placed natively
    assert pool.core.fast.hits == hits + 1 and backing.pages_of(t.data_ptr(), 1)[0] == page
    assert not backing.idle[0][page]
    del t
    assert not backing.idle[0][page]  # freed since: the device may still use it until a synchronize
    pool.check_invariants()
