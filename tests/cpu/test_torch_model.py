"""The model of PyTorch's caching allocator (defrag.traces.torch_model) against hand-computed cases.

Each layout below is worked out from PyTorch's rules (c10/cuda/CUDACachingAllocator.cpp): 512 B
rounding, small (<= 1 MiB) and large pools, 2 MiB / 20 MiB / rounded-to-2-MiB segments, best fit,
the split thresholds, coalescing, the OOM ladder, expandable segments' 2 MiB / 20 MiB pages.
"""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from defrag.cli import main as cli_main
from defrag.replay import TORCH_MODELS, format_table, min_capacity, replay_model, run_all
from defrag.traces import ALLOC, FREE, PHASE, Trace, checkerboard, llm_serving
from defrag.traces.torch_model import (
    CachingAllocatorModel, allocation_size, round_size, roundup_power2_next_division)

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def layout(model: CachingAllocatorModel) -> list[list[tuple[int, int, str]]]:
    """Each segment's blocks as (offset MiB-or-bytes, size, state), low address first."""
    model.check_invariants()
    return [seg["blocks"] for seg in model.segments()]


def reserved(model: CachingAllocatorModel) -> int:
    return model.stats()["reserved_bytes.all.current"]


# ---------------------------------------------------------------------- sizes
def test_rounding_and_segment_sizes():
    assert [round_size(n) for n in (1, 511, 512, 513, 1000, 1024, 1025)] == [512, 512, 512, 1024, 1024, 1024, 1536]
    # roundup_power2_divisions (off by default): PyTorch's own example, 1200 with 4 divisions -> 1280.
    assert roundup_power2_next_division(1200, 4) == 1280
    assert roundup_power2_next_division(4096, 4) == 4096
    assert round_size(5000, 4) == 5120 and round_size(1200, 4) == 1536  # 1200 <= 512 x 4: plain 512 rounding

    def power2_div(size, div_factor):  # the expectation in PyTorch's test_allocator_settings (test_cuda.py)
        pow2 = 1
        while pow2 < size:
            pow2 *= 2
        if pow2 == size:
            return pow2
        step, ret = pow2 // 2 // div_factor, pow2 // 2
        while ret < size:
            ret += step
        return ret

    assert round_size(84 * MiB, 4) == power2_div(84 * MiB, 4) == 96 * MiB  # that test's 21 Mi floats
    rng = random.Random(3)
    for divisions in (2, 4, 8, 16):
        for size in [rng.randint(512 * divisions + 1, 1 << 34) for _ in range(300)] + [1 << 20, 3 << 20]:
            assert round_size(size, divisions) == power2_div(size, divisions), (size, divisions)
    assert allocation_size(512) == 2 * MiB and allocation_size(MiB) == 2 * MiB  # small pool: 2 MiB segments
    assert allocation_size(MiB + 512) == 20 * MiB and allocation_size(10 * MiB - 512) == 20 * MiB
    assert allocation_size(10 * MiB) == 10 * MiB and allocation_size(10 * MiB + 512) == 12 * MiB  # kRoundLarge


def test_small_and_large_pools_get_their_own_segments():
    m = CachingAllocatorModel(GiB)
    a, b, c = m.malloc(MiB), m.malloc(MiB), m.malloc(MiB)  # small pool: two per 2 MiB segment
    d = m.malloc(MiB + 1)  # large pool: rounds to MiB + 512, a 20 MiB segment
    e = m.malloc(24 * MiB + 3)  # >= 10 MiB and more than the 19 MiB free: its own segment, rounded to 2 MiB
    assert layout(m) == [
        [(0, MiB, "allocated"), (MiB, MiB, "allocated")],
        [(0, MiB, "allocated"), (MiB, MiB, "free")],
        [(0, MiB + 512, "allocated"), (MiB + 512, 19 * MiB - 512, "free")],
        [(0, 24 * MiB + 512, "allocated"), (24 * MiB + 512, 2 * MiB - 512, "free")],
    ]
    assert reserved(m) == (2 + 2 + 20 + 26) * MiB
    assert m.stats()["segment.all.current"] == 4
    assert d.segment.small is False and a.segment.small is True and e.segment is not d.segment
    assert a.segment is b.segment and c.segment is not a.segment
    # Best fit within each pool only: 12 MiB goes into the 19 MiB free at the end of d's segment ...
    assert m.malloc(12 * MiB).segment is d.segment
    # ... a small request into c's segment, then a new 2 MiB one, never into the large pool's free space.
    assert m.malloc(600 * KiB).segment is c.segment
    f = m.malloc(600 * KiB)
    assert f.segment.small and f.segment not in (a.segment, c.segment) and reserved(m) == (2 + 2 + 20 + 26 + 2) * MiB


def test_split_thresholds():
    m = CachingAllocatorModel(GiB)
    whole = m.malloc(19 * MiB)  # large pool: 1 MiB left is not > 1 MiB (kSmallSize): the block stays whole
    assert layout(m) == [[(0, 20 * MiB, "allocated")]]
    assert m.stats()["allocated_bytes.all.current"] == 20 * MiB  # counted whole, as PyTorch counts block->size
    split = m.malloc(18 * MiB + 512 * KiB)  # 1.5 MiB left: split
    assert layout(m)[1] == [(0, 18 * MiB + 512 * KiB, "allocated"), (18 * MiB + 512 * KiB, 3 * MiB // 2, "free")]
    # Small pool: a remainder of 512 B is enough to split.
    s1 = m.malloc(MiB)
    s2 = m.malloc(MiB - 512)
    assert layout(m)[2] == [(0, MiB, "allocated"), (MiB, MiB - 512, "allocated"), (2 * MiB - 512, 512, "free")]
    m.free(whole), m.free(split), m.free(s1), m.free(s2)
    assert [len(seg) for seg in layout(m)] == [1, 1, 1]  # everything coalesced back


def test_best_fit_takes_the_smallest_block_then_the_lowest_address():
    m = CachingAllocatorModel(GiB)
    blocks = [m.malloc(12 * MiB), m.malloc(16 * MiB), m.malloc(12 * MiB), m.malloc(14 * MiB)]
    for b in blocks:
        m.free(b)
    # Free whole segments of 12, 16, 12 and 14 MiB: a 13 MiB request takes the 14 MiB one, whole (the 1 MiB
    # left is not more than 1 MiB).
    x = m.malloc(13 * MiB)
    assert x.segment is blocks[3].segment and x.size == 14 * MiB
    y = m.malloc(11 * MiB)  # two 12 MiB segments: the lower address wins
    assert y.segment is blocks[0].segment and y.size == 12 * MiB


def test_free_coalesces_with_neighbours_and_empty_cache_releases_whole_segments_only():
    m = CachingAllocatorModel(GiB)
    a, b, c = m.malloc(4 * MiB), m.malloc(4 * MiB), m.malloc(4 * MiB)
    assert layout(m) == [[(0, 4 * MiB, "allocated"), (4 * MiB, 4 * MiB, "allocated"),
                          (8 * MiB, 4 * MiB, "allocated"), (12 * MiB, 8 * MiB, "free")]]
    m.free(b)
    m.empty_cache()  # the segment still holds a and c: nothing goes back
    assert reserved(m) == 20 * MiB
    assert layout(m)[0][1] == (4 * MiB, 4 * MiB, "free")
    m.free(a)  # merges with b
    assert layout(m)[0][:2] == [(0, 8 * MiB, "free"), (8 * MiB, 4 * MiB, "allocated")]
    m.free(c)  # merges with both sides: one free block, the whole segment
    assert layout(m) == [[(0, 20 * MiB, "free")]]
    m.empty_cache()
    assert reserved(m) == 0 and m.segments() == [] and m.stats()["reserved_bytes.all.peak"] == 20 * MiB


def test_oom_releases_cached_segments_and_retries():
    m = CachingAllocatorModel(22 * MiB)
    a = m.malloc(12 * MiB)
    m.free(a)  # a cached 12 MiB segment
    b = m.malloc(14 * MiB)  # 12 + 14 > 22: release the cache, retry: fits
    assert b is not None and reserved(m) == 14 * MiB
    st = m.stats()
    assert (st["num_alloc_retries"], st["num_ooms"], st["num_device_free"]) == (1, 0, 1)
    assert st["reserved_bytes.all.peak"] == 14 * MiB  # never 26 MiB
    assert m.malloc(10 * MiB) is None  # 14 + 10 > 22 and nothing cached: an OOM after a second retry
    st = m.stats()
    assert (st["num_alloc_retries"], st["num_ooms"]) == (2, 1)
    small = m.malloc(1000)  # still room for a small segment: 14 + 2 <= 22
    assert small is not None and reserved(m) == 16 * MiB


def test_oom_keeps_partly_used_segments():
    m = CachingAllocatorModel(40 * MiB)
    a, b = m.malloc(2 * MiB), m.malloc(2 * MiB)  # one 20 MiB segment, 16 MiB free at its end
    m.free(a)
    assert m.malloc(22 * MiB) is None  # 20 + 22 > 40; the segment is split (b lives): it cannot go back
    assert reserved(m) == 20 * MiB and m.stats()["num_ooms"] == 1
    m.free(b)
    assert m.malloc(22 * MiB) is not None  # now the whole segment is released on the way: 0 + 22 <= 40
    assert reserved(m) == 22 * MiB


def test_max_split_size_oversize_blocks():
    m = CachingAllocatorModel(200 * MiB, max_split_size=40 * MiB)
    big = m.malloc(50 * MiB)
    m.free(big)
    # A request under max_split_size never takes an oversize block: a new segment.
    x = m.malloc(30 * MiB)
    assert x.segment is not big.segment and reserved(m) == 80 * MiB
    # An oversize request takes an oversize block within 20 MiB of its size, whole (no split).
    y = m.malloc(45 * MiB)
    assert y.segment is big.segment and y.size == 50 * MiB
    m.free(y), m.free(x)
    with pytest.raises(ValueError):
        CachingAllocatorModel(GiB, max_split_size=20 * MiB)  # PyTorch requires more than 20 MiB


def test_max_split_size_frees_one_oversize_segment_before_the_full_release():
    m = CachingAllocatorModel(100 * MiB, max_split_size=40 * MiB)
    big = m.malloc(80 * MiB)
    small = m.malloc(1000)  # a cached 2 MiB small-pool segment once freed
    m.free(big), m.free(small)
    y = m.malloc(50 * MiB)  # 80 >= 50 + 20: not taken; 80 + 2 + 50 > 100: release_available frees the 80 MiB one
    assert y is not None
    st = m.stats()
    assert st["num_alloc_retries"] == 0  # served before release_cached_blocks
    assert reserved(m) == (2 + 50) * MiB  # the small segment stays cached


# ---------------------------------------------------------------------- expandable segments
def test_expandable_segments_grow_by_pages_and_release_whole_free_pages():
    m = CachingAllocatorModel(100 * MiB, expandable_segments=True)
    a = m.malloc(3 * MiB)  # maps one 20 MiB page of the large pool's segment
    assert reserved(m) == 20 * MiB
    b = m.malloc(30 * MiB)  # 17 MiB free at the end + one more page
    assert reserved(m) == 40 * MiB
    c = m.malloc(5 * MiB)  # fits in the 7 MiB left; a remainder of 512 B or more is always split off
    segs = layout(m)
    assert len(segs) == 1 and segs[0][:4] == [(0, 3 * MiB, "allocated"), (3 * MiB, 30 * MiB, "allocated"),
                                             (33 * MiB, 5 * MiB, "allocated"), (38 * MiB, 2 * MiB, "free")]
    assert segs[0][4][2] == "unmapped"
    m.free(b)
    m.empty_cache()  # the free block [3, 33) MiB holds no whole page: nothing to unmap
    assert reserved(m) == 40 * MiB
    m.free(a)  # [0, 33) MiB free: page [0, 20) is unmappable, [20, 33) stays mapped under c's page
    m.empty_cache()
    assert reserved(m) == 20 * MiB
    assert layout(m)[0][:4] == [(0, 20 * MiB, "unmapped"), (20 * MiB, 13 * MiB, "free"),
                                (33 * MiB, 5 * MiB, "allocated"), (38 * MiB, 2 * MiB, "free")]
    # Growing again fills the hole at the lowest address first, merged with the free space after it.
    d = m.malloc(15 * MiB)
    assert d.addr == c.segment.base and reserved(m) == 40 * MiB
    m.free(c), m.free(d)
    m.empty_cache()  # nothing mapped any more: the segment gives its address range back
    assert reserved(m) == 0 and m.segments() == []


def test_expandable_small_pool_uses_2_mib_pages():
    m = CachingAllocatorModel(100 * MiB, expandable_segments=True)
    blocks = [m.malloc(MiB) for _ in range(3)]
    assert reserved(m) == 4 * MiB  # three 1 MiB blocks: two pages of 2 MiB, in one small-pool segment
    assert len({b.segment.base for b in blocks}) == 1 and blocks[0].segment.small
    assert m.malloc(2 * MiB) is not None and reserved(m) == 24 * MiB  # large pool: its own segment, 20 MiB pages


def test_expandable_oom_unmaps_free_pages_and_retries():
    m = CachingAllocatorModel(80 * MiB, expandable_segments=True)
    a = m.malloc(30 * MiB)  # two pages
    b = m.malloc(5 * MiB)  # [30, 35)
    m.free(a)
    c = m.malloc(50 * MiB)  # 40 + 50 > 80: unmap page [0, 20), retry at the end: [35, 85), three more pages
    assert c is not None and c.addr == b.segment.base + 35 * MiB
    st = m.stats()
    assert (st["num_alloc_retries"], st["num_ooms"], st["reserved_bytes.all.current"]) == (1, 0, 80 * MiB)
    assert layout(m)[0][:5] == [(0, 20 * MiB, "unmapped"), (20 * MiB, 10 * MiB, "free"),
                                (30 * MiB, 5 * MiB, "allocated"), (35 * MiB, 50 * MiB, "allocated"),
                                (85 * MiB, 15 * MiB, "free")]
    assert m.malloc(30 * MiB) is None and m.stats()["num_ooms"] == 1


def test_expandable_with_a_larger_device_maps_past_the_fraction_like_pytorch():
    """With set_per_process_memory_fraction on a larger GPU, PyTorch checks reserved + allocation size
    against the limit but maps whole 20 MiB pages: reserved can end up to one page past it."""
    capped = CachingAllocatorModel(30 * MiB, expandable_segments=True, device_memory=GiB)
    assert capped.malloc(22 * MiB) is not None  # 0 + 22 <= 30, and two pages get mapped
    assert reserved(capped) == 40 * MiB
    exact = CachingAllocatorModel(30 * MiB, expandable_segments=True)  # a device of exactly 30 MiB
    assert exact.malloc(22 * MiB) is None and reserved(exact) == 0


# ---------------------------------------------------------------------- properties
_sizes = st.one_of(st.integers(1, 1 * MiB), st.integers(MiB + 1, 12 * MiB), st.integers(12 * MiB, 64 * MiB))
_ops = st.lists(st.tuples(st.sampled_from(["alloc", "alloc", "alloc", "free", "free", "empty"]), _sizes,
                          st.integers(0, 10**6)), min_size=1, max_size=120)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_ops, capacity_mib=st.integers(4, 256), expandable=st.booleans(), mss=st.sampled_from([None, 40, 64]))
def test_property_books_balance_and_reserved_stays_within_capacity(ops, capacity_mib, expandable, mss):
    capacity = capacity_mib * MiB
    m = CachingAllocatorModel(capacity, expandable_segments=expandable,
                              max_split_size=None if mss is None else mss * MiB)
    live: list = []
    live_bytes = peak_live = 0
    for op, size, pick in ops:
        if op == "alloc":
            b = m.malloc(size)
            if b is None:
                if not expandable:  # the last retry failed the limit: nothing cached could have helped
                    assert reserved(m) + allocation_size(round_size(size)) > capacity
            else:
                live.append((b, size))
                live_bytes += round_size(size)
                peak_live = max(peak_live, live_bytes)
        elif op == "free" and live:
            b, size = live.pop(pick % len(live))
            m.free(b)
            live_bytes -= round_size(size)
        elif op == "empty":
            m.empty_cache()
        m.check_invariants()
        s = m.stats()
        assert s["reserved_bytes.all.current"] <= capacity
        assert s["allocated_bytes.all.current"] >= live_bytes
        assert s["reserved_bytes.all.current"] >= s["allocated_bytes.all.current"]
    s = m.stats()
    assert s["reserved_bytes.all.peak"] <= capacity
    assert s["reserved_bytes.all.peak"] >= s["allocated_bytes.all.peak"] >= peak_live


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), expandable=st.booleans(), slack=st.floats(0.9, 2.0))
def test_property_replays_peak_reserved_at_least_peak_live(seed, expandable, slack):
    rng = random.Random(seed)
    trace, live = Trace(name="random"), []
    for i in range(300):
        if live and rng.random() < 0.45:
            trace.free(live.pop(rng.randrange(len(live))))
        else:
            trace.alloc(i, rng.choice([rng.randint(1, 900_000), rng.randint(MiB, 30 * MiB)]))
            live.append(i)
        if i % 50 == 0:
            trace.phase(f"p{i}")
    peak = trace.stats().peak_live_bytes
    capacity = int(peak * slack) // (2 * MiB) * (2 * MiB) + 2 * MiB
    r = replay_model(trace, capacity, expandable=expandable)
    assert r.peak_reserved_bytes <= capacity
    if r.completed:
        assert r.peak_reserved_bytes >= r.peak_live_bytes >= peak


# ---------------------------------------------------------------------- replays
def _tiny_trace() -> Trace:
    return Trace([(ALLOC, 0, 1000), (ALLOC, 1, 3 * MiB), (PHASE, "p"), (FREE, 0), (ALLOC, 2, 12 * MiB),
                  (FREE, 1), (FREE, 2)], name="tiny")


def test_replay_model_figures_are_the_hand_computed_ones():
    trace = _tiny_trace()
    native = replay_model(trace, GiB)
    # A 2 MiB small segment for 1000 B, a 20 MiB segment for 3 MiB (split: 17 MiB free), and the 12 MiB
    # request is served from those 17 MiB (best fit, split again): 22 MiB reserved, 15 MiB live at most.
    assert (native.allocator, native.peak_reserved_bytes, native.ooms) == ("torch (model)", 22 * MiB, 0)
    assert native.peak_live_bytes == 15 * MiB
    expandable = replay_model(trace, GiB, expandable=True)
    assert (expandable.allocator, expandable.peak_reserved_bytes) == ("torch-expandable (model)", 22 * MiB)
    # At 21 MiB the small segment and the 20 MiB one cannot both exist: the 3 MiB request fails.
    tight = replay_model(trace, 21 * MiB)
    assert tight.ooms == 1 and tight.failed_bytes == 3 * MiB and not tight.completed


def test_min_capacity_for_the_models_is_exact_in_2_mib_steps():
    trace = checkerboard(total_bytes=16 * MiB, rounds=1)
    for name, expandable in TORCH_MODELS.items():
        mc = min_capacity(trace, allocator=name)
        assert mc.exact and mc.bytes % (2 * MiB) == 0
        assert replay_model(trace, mc.bytes, expandable=expandable).completed
        assert not replay_model(trace, mc.failed_below, expandable=expandable).completed
    with pytest.raises(ValueError, match="unknown allocator"):
        min_capacity(trace, allocator="jemalloc")


def test_the_dry_table_has_the_model_rows():
    trace = checkerboard(total_bytes=32 * MiB, rounds=2)
    results, skipped = run_all(trace, 64 * MiB, dry=True, baselines=False)
    names = [r.allocator for r in results]
    assert names == ["defrag", "defrag-no-compaction", "defrag-mesh", "torch (model)", "torch-expandable (model)"]
    rows = {r.allocator: r for r in results}
    for name in TORCH_MODELS:
        r = rows[name]
        assert r.dry and r.completed and r.min_capacity is not None and r.min_capacity.exact
        assert r.peak_reserved_bytes >= r.peak_live_bytes >= trace.stats().peak_live_bytes
        assert r.min_capacity.bytes <= r.capacity
    # Checkerboard: the small pool keeps the freed holes, the large requests need new segments.
    assert rows["torch (model)"].min_capacity.bytes > rows["defrag"].min_capacity.bytes
    table = format_table(results, skipped)
    lines = table.splitlines()
    assert lines[0].startswith("allocator") and any(l.startswith("torch (model) ") for l in lines)
    assert any(l.startswith("torch-expandable (model) ") for l in lines)
    assert "(model) (dry)" not in table and "defrag (dry)" in table


def test_cli_dry_replay_prints_and_writes_the_model_rows(tmp_path, capsys):
    path = checkerboard(total_bytes=16 * MiB, rounds=1).save(tmp_path / "cb.jsonl")
    out = tmp_path / "r.json"
    assert cli_main(["replay", str(path), "--capacity", "64MiB", "--dry", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "torch (model)" in text and "torch-expandable (model)" in text
    rows = {r["allocator"]: r for r in json.loads(out.read_text())["results"]}
    assert set(TORCH_MODELS) <= set(rows)
    assert all(rows[n]["dry"] and rows[n]["ooms"] == 0 and rows[n]["min_capacity"]["exact"] for n in TORCH_MODELS)


def test_an_80_gib_class_trace_replays_through_the_models_in_seconds():
    trace = llm_serving(steps=18000, kv_bytes_per_token=160 * KiB, weights_bytes=40 * GiB, hidden=8192,
                        vocab=128000, max_batch=64)
    assert len(trace.events) > 140_000
    live = trace.stats().peak_live_bytes
    for expandable in (False, True):
        r = replay_model(trace, 80 * GiB, expandable=expandable)
        assert r.completed and r.seconds < 20
        assert live <= r.peak_live_bytes <= r.peak_reserved_bytes <= 80 * GiB
