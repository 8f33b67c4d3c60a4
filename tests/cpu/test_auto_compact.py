"""The automatic trigger: the allocation ladder, its controls, and retry_on_oom."""

from __future__ import annotations

import gc

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import defrag
from defrag.driver import Driver
from defrag.page_growth import GrowthPolicy

from .conftest import KiB, MiB, check_pattern, fill_pattern
from .test_compaction import fragment

PAGE = 64 * KiB


def test_a_fragmentation_oom_is_rescued_with_bytes_intact(make_pool):
    pool = make_pool("1MiB")  # auto_compact=True by default
    survivors = fragment(pool)
    views = {s: t[7:9] for s, t in survivors.items()}
    reports = []
    pool.on_compact.append(reports.append)
    big = pool.empty(pool.capacity // 2, dtype=torch.uint8)
    fill_pattern(big, 77)
    assert len(reports) == 1 and reports[0].automatic and reports[0].moved_tensors == 12
    assert all(check_pattern(t, s) for s, t in survivors.items()) and check_pattern(big, 77)
    for s, v in views.items():
        assert v.data_ptr() == survivors[s].data_ptr() + 7
    st_ = pool.stats()
    assert st_["num_compactions.automatic"] == 1 and st_["num_compactions.explicit"] == 0
    assert st_["num_compactions"] == 1 and st_["num_alloc_retries"] == 1 and st_["num_ooms"] == 0
    pool.check_invariants()


def test_auto_compact_off_raises(make_pool):
    pool = make_pool("1MiB", auto_compact=False)
    survivors = fragment(pool)
    with pytest.raises(defrag.OutOfMemoryError, match="automatic compaction is off"):
        pool.empty(pool.capacity // 2, dtype=torch.uint8)
    assert pool.stats()["num_compactions"] == 0 and pool.stats()["num_ooms"] == 1
    assert all(check_pattern(t, s) for s, t in survivors.items())


def test_a_hopeless_request_explains_itself_and_the_pool_stays_usable(make_pool):
    pool = make_pool("1MiB")
    survivors = fragment(pool)
    pool.pin(survivors[1])
    with pytest.raises(defrag.OutOfMemoryError) as info:
        pool.empty(15 * PAGE, dtype=torch.uint8)
    msg = str(info.value)
    assert "cannot allocate 960.00 KiB" in msg and "capacity 1.00 MiB" in msg
    assert "live 256.00 KiB" in msg and "stranded in half-used pages 768.00 KiB" in msg and "pinned 16.00 KiB" in msg
    assert "compaction cannot help" in msg and "largest live tensors" in msg and "suggestion" in msg
    assert pool.stats()["num_compactions"] == 0  # it did not compact in vain
    assert all(check_pattern(t, s) for s, t in survivors.items())
    t = pool.empty(8 * PAGE, dtype=torch.uint8)  # still usable: compacts and succeeds
    fill_pattern(t, 3)
    assert check_pattern(t, 3) and pool.stats()["num_compactions.automatic"] == 1


def test_min_interval_stops_thrashing(make_pool):
    pool = make_pool("1MiB", min_compact_interval=3600.0)
    survivors = fragment(pool)
    big = pool.empty(pool.capacity // 2, dtype=torch.uint8)  # first rescue compacts
    del big
    more = fragment(pool, n=32)  # fragment again
    with pytest.raises(defrag.OutOfMemoryError, match="automatic compaction skipped"):
        pool.empty(pool.capacity // 2, dtype=torch.uint8)
    assert pool.stats()["num_compactions.automatic"] == 1
    pool.compact()  # explicit compaction is never rate-limited
    assert pool.stats()["num_compactions.explicit"] == 1
    assert all(check_pattern(t, s) for s, t in survivors.items())
    assert all(check_pattern(t, s) for s, t in more.items())


def test_a_device_smaller_than_the_pool_is_an_oom_of_the_pool(make_pool):
    # The GPU fills (other users) before the pool reaches its capacity.
    pool = make_pool("2MiB", device_capacity=1 * MiB, auto_compact=False)
    ts = [pool.empty(PAGE, dtype=torch.uint8) for _ in range(16)]
    with pytest.raises(defrag.OutOfMemoryError, match="the device has no free memory") as info:
        pool.empty(PAGE, dtype=torch.uint8)
    assert not isinstance(info.value, defrag.CudaError)
    assert pool.stats()["num_ooms"] == 1
    assert pool.stats()["largest_free_bytes"] < PAGE  # no longer counts pages the device refused
    pool.check_invariants()
    del ts[0]
    assert pool.stats()["largest_free_bytes"] == PAGE
    pool.empty(PAGE, dtype=torch.uint8)  # a freed page is reused without asking the device


def test_a_full_device_reuses_the_pools_empty_mapped_pages(make_pool):
    pool = make_pool("2MiB", device_capacity=1 * MiB, auto_compact=False)
    # A slack roomy enough that the growth policy creates new pages for the request (at the default
    # 1.10 the pool, over its budget, stitches before asking the device: test_page_growth covers that):
    # here the device refuses them, and the empty mapped pages must back the request instead.
    pool.core.growth = GrowthPolicy(slack=4.0)
    ts = [pool.empty(PAGE, dtype=torch.uint8) for _ in range(16)]  # the device is full
    del ts[1::2]  # 8 empty mapped pages, no two adjacent
    big = pool.empty(4 * PAGE, dtype=torch.uint8)  # 4 unmapped virtual pages, backed by 4 of those
    fill_pattern(big, 2)
    assert check_pattern(big, 2) and len(ts) == 8
    st_ = pool.stats()
    assert st_["num_ooms"] == 0 and st_["pages.mapped"] == 16 and st_["pages.empty"] == 4  # 4 donated
    pool.check_invariants()


def test_a_device_oom_is_rescued_by_compaction(make_pool):
    pool = make_pool("2MiB", device_capacity=1 * MiB)
    survivors = fragment(pool)  # all 16 device pages mapped, 3/4 stranded
    big = pool.empty(8 * PAGE, dtype=torch.uint8)
    fill_pattern(big, 1)
    assert pool.stats()["num_compactions.automatic"] == 1
    assert check_pattern(big, 1) and all(check_pattern(t, s) for s, t in survivors.items())


def test_a_raising_on_compact_callback_does_not_break_the_allocation(make_pool, caplog):
    pool = make_pool("1MiB")
    survivors = fragment(pool)

    def broken(report):
        raise KeyError("oops")

    pool.on_compact.append(broken)
    big = pool.empty(pool.capacity // 2, dtype=torch.uint8)
    assert big.numel() == pool.capacity // 2 and "on_compact callback raised" in caplog.text
    assert all(check_pattern(t, s) for s, t in survivors.items())


# ---------------------------------------------------------------- retry_on_oom
_POOL_FOR_OP = {}


@torch.library.custom_op("defrag_test::scratch_sum", mutates_args=())
def scratch_sum(x: torch.Tensor, nbytes: int) -> torch.Tensor:
    """Needs a large scratch buffer from the pool (as a fused kernel's workspace would)."""
    scratch = _POOL_FOR_OP["pool"].empty(nbytes, dtype=torch.uint8)
    scratch.fill_(1)
    return x.sum().reshape(1) + scratch.sum().to(x.dtype)


def test_retry_on_oom_rescues_an_op_that_allocates_from_the_pool(make_pool):
    pool = make_pool("1MiB", auto_compact=False)
    _POOL_FOR_OP["pool"] = pool
    survivors = fragment(pool)
    x = pool.full((4,), 2.0)
    with pytest.raises(defrag.OutOfMemoryError):
        torch.ops.defrag_test.scratch_sum(x, 8 * PAGE)
    with defrag.retry_on_oom(pool) as mode:
        out = torch.ops.defrag_test.scratch_sum(x, 8 * PAGE)
    assert out.item() == 8.0 + 8 * PAGE
    assert mode.retries == 1 and mode.rescues == 1
    assert pool.stats()["num_compactions.explicit"] == 1
    assert all(check_pattern(t, s) for s, t in survivors.items())
    assert torch.equal(x, torch.full((4,), 2.0)) and pool.live_tensors()[0].pinned is False


def test_retry_on_oom_reraises_when_a_retry_cannot_help(make_pool):
    pool = make_pool("1MiB", auto_compact=False)
    _POOL_FOR_OP["pool"] = pool
    x = pool.full((4,), 2.0)
    with pytest.raises(defrag.OutOfMemoryError):
        with defrag.retry_on_oom(pool) as mode:
            torch.ops.defrag_test.scratch_sum(x, 2 * MiB)
    assert mode.retries == 1 and mode.rescues == 0
    assert torch.equal(x, torch.full((4,), 2.0))


def test_retry_on_oom_works_in_backward(make_pool):
    pool = make_pool("1MiB", auto_compact=False)
    _POOL_FOR_OP["pool"] = pool

    class NeedsScratchInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            s = torch.ops.defrag_test.scratch_sum(grad, 8 * PAGE)
            return grad * 2 + 0 * s

    survivors = fragment(pool)
    x = pool.full((4,), 1.0, requires_grad=True)
    with defrag.retry_on_oom(pool) as mode:
        NeedsScratchInBackward.apply(x).sum().backward()
    assert torch.equal(x.grad, torch.full((4,), 2.0)) and mode.rescues == 1
    assert all(check_pattern(t, s) for s, t in survivors.items())


def test_retry_on_oom_rejects_non_pools():
    with pytest.raises(TypeError):
        defrag.retry_on_oom("pool")


# ---------------------------------------------------------------- adversarial layouts
def _pinned_pages(pool) -> int:
    pages = set()
    for a in pool.core.blocks():
        if a.pins:
            first, end = pool.core.backing.pages_of(a)
            pages.update(range(first, end))
    return len(pages)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(block=st.sampled_from([512, 2048, 4096, 16 * KiB]), keep=st.floats(0.02, 0.7),
       pins=st.integers(0, 3), seed=st.integers(0, 2**31 - 1))
def test_every_rescuable_oom_is_rescued(block, keep, pins, seed):
    """Fill the pool with equal blocks, free a random subset, pin a few; the largest request
    with live + request <= capacity - pinned pages must succeed (by compacting)."""
    import random
    rng = random.Random(seed)
    drv = Driver.emulated(capacity=8 * MiB, granularity=PAGE)
    pool = defrag.Pool(device=drv, capacity="1MiB", auto_compact=False)
    live, big = {}, None
    try:
        for i in range(pool.capacity // block):
            live[i] = pool.empty(block, dtype=torch.uint8)
            fill_pattern(live[i], i)
        for i in rng.sample(sorted(live), k=int(len(live) * (1 - keep))):
            del live[i]
        for i in rng.sample(sorted(live), k=min(pins, len(live))):
            pool.pin(live[i])
        pool.auto_compact = True
        st_ = pool.stats()
        room = pool.capacity - _pinned_pages(pool) * PAGE - st_["allocated_bytes.all.current"]
        pages = room // PAGE
        if pages >= 1:
            big = pool.empty(pages * PAGE, dtype=torch.uint8)
            fill_pattern(big, -1)
            assert check_pattern(big, -1)
        assert all(check_pattern(t, s) for s, t in live.items())
        pool.check_invariants()
    finally:
        live.clear()
        big = None
        pool.close()
        if drv.api.state()["handles"]:
            gc.collect()  # ~0.1-0.2 s a collection, 60 examples: only when something is still held


def test_split_free_bytes_are_merged_into_a_hole(make_pool):
    """Every page is needed, but each page's free bytes are two 1 KiB holes around a 1 KiB block:
    no page can be emptied, yet moving one block makes a 3 KiB hole."""
    pool = make_pool("1MiB")
    pool.auto_compact = False
    ts = [pool.empty(1024, dtype=torch.uint8) for _ in range(1024)]  # 64 per page, 16 pages: full
    ts.sort(key=lambda t: t.data_ptr())
    for i, t in enumerate(ts):
        fill_pattern(t, i)
    survivors = {i: t for i, t in enumerate(ts) if i % 64 not in (1, 3)}
    del ts, t
    with pytest.raises(defrag.OutOfMemoryError):
        pool.empty(2560, dtype=torch.uint8)
    pool.auto_compact = True
    hole = pool.empty(2560, dtype=torch.uint8)
    fill_pattern(hole, -5)
    st_ = pool.stats()
    assert st_["compaction.moved_tensors"] == 1 and st_["pages.mapped"] == 16
    assert check_pattern(hole, -5) and all(check_pattern(t, s) for s, t in survivors.items())
    pool.check_invariants()


def _window_layout(pool_alloc, free, P):
    """X (1.5 pages) with a free tail, Y (2 pages), T (2 pages, freed: two empty mapped pages), Q (3.5 pages):
    ten pages mapped, no contiguous free range of 2.5 pages, two empty pages. The conveyor cannot free a page
    (moving X into the empty pages gains none) and nothing is shorter than a page."""
    for key, n in (("X", 3 * P // 2), ("Y", 2 * P), ("T", 2 * P), ("Q", 7 * P // 2)):
        assert pool_alloc(key, n), key
    free("T")


@pytest.mark.parametrize("virtual_factor", [1, 2])
def test_a_multi_page_request_is_rescued_by_evacuating_a_window(virtual_factor):
    """A 2.5-page request with live + request == capacity (two empty pages, three needed on their own).
    With no virtual space beyond the capacity, no placement and no automatic compaction serves it;
    evacuating a window does: Y moves into the empty pages and the request starts in X's free tail. With
    more, the placement itself serves it, with nothing moved: Q's free tail plus two unmapped pages
    backed by the empty ones (the tail's page is Q's, so it needs no physical page)."""
    from defrag.dry import DryPool

    P = 2 * MiB
    pool = DryPool(10 * P, P, auto_compact=False, virtual_factor=virtual_factor)
    base = pool.core.regions[0].base
    _window_layout(pool.alloc, pool.free, P)
    where = {k: b.address - base for k, b in pool._blocks.items()}
    assert where == {"X": 0, "Y": 2 * P, "Q": 6 * P}
    if virtual_factor == 2:
        assert pool.alloc("R", 5 * P // 2)
        where = {k: b.address - base for k, b in pool._blocks.items()}
        assert where == {"X": 0, "Y": 2 * P, "Q": 6 * P, "R": 19 * P // 2}
        st_ = pool.stats()
        assert st_["num_compactions.automatic"] == 0 and st_["pages.mapped"] == 10
        pool.check_invariants()
        pool.close()
        return
    assert not pool.alloc("before", 5 * P // 2)  # what the pool did before this rescue step existed
    pool.core.auto_compact = True
    assert pool.alloc("R", 5 * P // 2)
    pool.check_invariants()
    st_ = pool.stats()
    where = {k: b.address - base for k, b in pool._blocks.items()}
    assert where == {"X": 0, "Y": 4 * P, "Q": 6 * P, "R": 3 * P // 2}
    assert st_["compaction.moved_tensors"] == 1 and st_["compaction.moved_bytes"] == 2 * P
    assert st_["num_compactions.automatic"] == 2  # the ladder's compaction, then the window's
    assert st_["reserved_bytes.all.peak"] <= 10 * P and st_["pages.mapped"] == 10
    pool.free("R")
    pool.check_invariants()
    pool.close()

def test_a_window_rescue_keeps_every_byte(make_pool):
    """The same layout on the emulated device with tensors: the moved tensor keeps its bytes and its views."""
    pool = make_pool("640KiB", virtual_factor=1)  # ten pages of 64 KiB
    pool.auto_compact = False
    ts = {}

    def alloc(key, n):
        ts[key] = pool.empty(n, dtype=torch.uint8)
        return True

    _window_layout(alloc, ts.pop, PAGE)
    for i, (key, t) in enumerate(sorted(ts.items())):
        fill_pattern(t, i)
    view = ts["Y"][100:200]
    old = ts["Y"].data_ptr()
    with pytest.raises(defrag.OutOfMemoryError):
        pool.empty(5 * PAGE // 2, dtype=torch.uint8)
    pool.auto_compact = True
    big = pool.empty(5 * PAGE // 2, dtype=torch.uint8)
    fill_pattern(big, -3)
    assert ts["Y"].data_ptr() != old and view.data_ptr() == ts["Y"].data_ptr() + 100
    assert check_pattern(big, -3) and all(check_pattern(t, i) for i, (_, t) in enumerate(sorted(ts.items())))
    assert pool.stats()["num_ooms"] == 1
    pool.check_invariants()
