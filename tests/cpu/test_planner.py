"""Tests for defrag.planner: plans are safe (checked by executing them on bytes), honest, and good.

Every test drives the array entry points the compactor runs (`plan_arrays`, `plan_conveyor`,
`plan_hole_arrays`, `plan_window_arrays`) and `validate_arrays`. A layout is parallel arrays of live
blocks; a block's key is its index, as in the compactor.
"""
from __future__ import annotations

import dataclasses
import hashlib
import random
from typing import NamedTuple

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import defrag.planner as planner
from defrag.planner import (
    ArrayPlan,
    PlanError,
    plan_arrays,
    plan_hole_arrays,
    plan_window_arrays,
    validate_arrays,
)

A = 512  # alignment
SETTINGS = settings(deadline=None, max_examples=250, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------
# Layouts
# --------------------------------------------------------------------------


class Layout(NamedTuple):
    """Live blocks as the compactor gives them to the planner: block ``i`` is
    ``[offsets[i], offsets[i] + sizes[i])``, movable iff ``movable[i]``."""

    offsets: np.ndarray
    sizes: np.ndarray
    movable: np.ndarray
    span: int

    def plan(self, page: int, **kwargs) -> ArrayPlan:
        return plan_arrays(self.offsets, self.sizes, self.movable, page_size=page, span=self.span, **kwargs)

    def permuted(self, perm: np.ndarray) -> "Layout":
        return Layout(self.offsets[perm], self.sizes[perm], self.movable[perm], self.span)


def layout_of(rows, span: int) -> Layout:
    """``(offset, size, movable)`` rows as a :class:`Layout`."""
    rows = list(rows)
    return Layout(
        np.array([o for o, _, _ in rows], np.int64).reshape(-1),
        np.array([s for _, s, _ in rows], np.int64).reshape(-1),
        np.array([m for _, _, m in rows], bool).reshape(-1),
        span,
    )


def make_layout(
    seed: int,
    *,
    page: int,
    pages: int,
    style: str,
    keep: float,
    pinned: float = 0.0,
    large: float = 0.0,
    tail: int = 0,
) -> Layout:
    """Blocks allocated back to back over ``pages - tail`` pages (blocks of a page
    or more start on a page boundary, smaller ones may straddle), then a random
    ``keep`` fraction of them kept live, in random order."""
    r = random.Random(seed)
    g = page // A
    limit = (pages - tail) * page
    unit = g >> r.randint(1, g.bit_length() - 1)  # "divisor": one size dividing the page
    sizes = {
        "tiny": lambda: r.randint(1, 2),
        "small": lambda: r.randint(1, max(1, g // 4)),
        "coarse": lambda: r.randint(1, g - 1),
        "mixed": lambda: r.choice([1, 1, 2, 3, max(1, g // 4), max(1, g // 2), g - 1]),
        "divisor": lambda: unit,
    }[style]
    out, off = [], 0
    while True:
        if large and r.random() < large:
            # Whole pages or not: the tail of a large block is a hole others may use.
            size = page * r.randint(1, 3) + (0 if style == "divisor" else A * r.randint(0, g - 1))
            off = -(-off // page) * page
        else:
            size = A * sizes()
        if off + size > limit:
            break
        if r.random() < 0.05:  # an occasional gap that was never allocated
            off += A * (unit if style == "divisor" else r.randint(1, g))
            continue
        out.append((off, size))
        off += size
    rows = [(o, s, r.random() >= pinned) for o, s in out if r.random() < keep]
    r.shuffle(rows)  # the planner must not rely on input order
    return layout_of(rows, pages * page)


def canonical(seed: int, *, page: int, pages: int, per_page: int, live_per_page: int) -> Layout:
    """Every page held ``per_page`` equal blocks; all but ``live_per_page`` of each were freed."""
    r = random.Random(seed)
    size = page // per_page
    slots = [(p, slot) for p in range(pages) for slot in sorted(r.sample(range(per_page), live_per_page))]
    return layout_of([(p * page + slot * size, size, True) for p, slot in slots], pages * page)


layout_params = st.fixed_dictionaries(
    {
        "seed": st.integers(0, 2**32 - 1),
        "page": st.sampled_from([4096, 8192, 16384, 65536]),
        "pages": st.integers(1, 48),
        "style": st.sampled_from(["tiny", "small", "coarse", "mixed", "divisor"]),
        "keep": st.floats(0.02, 1.0),
        "pinned": st.sampled_from([0.0, 0.0, 0.05, 0.3]),
        "large": st.sampled_from([0.0, 0.0, 0.05, 0.2]),
        "tail": st.integers(0, 4),
    }
).map(lambda p: {**p, "tail": min(p["tail"], p["pages"] - 1)})

params_with_budget = layout_params.flatmap(
    lambda p: st.sampled_from([None, 0, 1, 3]).map(lambda mnp: (p, mnp))
)


# --------------------------------------------------------------------------
# Brute-force references
# --------------------------------------------------------------------------


def pages_of(offsets, sizes, page: int) -> set[int]:
    """Pages touched by the blocks ``(offsets[i], sizes[i])``, one page at a time."""
    return {p for o, s in zip(offsets, sizes) if s for p in range(o // page, (o + s - 1) // page + 1)}


def final_offsets(lay: Layout, plan: ArrayPlan) -> np.ndarray:
    final = lay.offsets.copy()
    final[plan.index] = plan.dst
    return final


def lower_bound(lay: Layout, page: int) -> int:
    """``max(|F|, ceil(live / page))``, ``F`` the pages of the blocks that never move (pinned, a page or more)."""
    fixed = ~lay.movable | (lay.sizes >= page)
    forced = pages_of(lay.offsets[fixed].tolist(), lay.sizes[fixed].tolist(), page)
    return max(len(forced), -(-int(lay.sizes.sum()) // page))


# --------------------------------------------------------------------------
# Executing a plan on bytes
# --------------------------------------------------------------------------


def pattern(i: int, size: int) -> np.ndarray:
    """Bytes unique to block number ``i`` and to each 8-byte word within it."""
    words = np.arange(size // 8, dtype=np.uint64) + np.uint64(i + 1) * np.uint64(1 << 32)
    return words.view(np.uint8)


def execute(lay: Layout, plan: ArrayPlan, *, mode: str) -> None:
    """Run ``plan`` on a region filled with per-block patterns; check every block's bytes.

    ``mode="wave"``: per wave, read every source first, then write every
    destination (what one kernel launch does). ``mode="sequential"``: one
    memmove per move, in plan order. Sources are poisoned once read, so a
    later read of a vacated range is caught too.
    """
    mem = np.full(lay.span, 0xEE, np.uint8)
    for i, (o, s) in enumerate(zip(lay.offsets.tolist(), lay.sizes.tolist())):
        mem[o:o + s] = pattern(i, s)
    moves = list(zip(plan.src.tolist(), plan.dst.tolist(), plan.size.tolist()))
    for w in sorted(set(plan.wave.tolist())):
        wave = [m for m, x in zip(moves, plan.wave.tolist()) if x == w]
        if mode == "wave":
            data = [mem[s:s + n].copy() for s, _, n in wave]
            for s, _, n in wave:
                mem[s:s + n] = 0xDD
            for (_, d, n), b in zip(wave, data):
                mem[d:d + n] = b
        else:
            for s, d, n in wave:
                b = mem[s:s + n].copy()
                mem[s:s + n] = 0xDD
                mem[d:d + n] = b
    for i, (o, s) in enumerate(zip(final_offsets(lay, plan).tolist(), lay.sizes.tolist())):
        assert np.array_equal(mem[o:o + s], pattern(i, s)), f"{mode}: bytes of block {i} lost"


def check_structure(lay: Layout, plan: ArrayPlan) -> None:
    """What every planner-made ArrayPlan promises about its arrays, checked independently of validate_arrays."""
    n = len(plan)
    for name in ("index", "src", "dst", "size", "wave"):
        a = getattr(plan, name)
        assert a.dtype == np.int64 and a.shape == (n,) and not a.flags.writeable
    assert plan.empty == (n == 0) and plan.moved_bytes == int(plan.size.sum())
    assert len(set(plan.index.tolist())) == n, "each block moves at most once"
    assert np.array_equal(plan.src, lay.offsets[plan.index]) and np.array_equal(plan.size, lay.sizes[plan.index])
    # Sorted by wave, then destination; waves 1..waves, none empty.
    assert np.array_equal(np.lexsort((plan.dst, plan.wave)), np.arange(n))
    assert sorted(set(plan.wave.tolist())) == list(range(1, plan.waves + 1))
    slices = plan.wave_slices()
    assert len(slices) == plan.waves and (not slices or (slices[0][0], slices[-1][1]) == (0, n))
    for w, (a, b) in enumerate(slices, start=1):
        assert b > a and (plan.wave[a:b] == w).all()
        # Within a wave no destination overlaps a source or another destination.
        d, e = plan.dst[a:b], plan.dst[a:b] + plan.size[a:b]
        assert (d[1:] >= e[:-1]).all()
        o = np.argsort(plan.src[a:b])
        s, se = plan.src[a:b][o], plan.src[a:b][o] + plan.size[a:b][o]
        first = np.searchsorted(se, d, side="right")  # first source ending after each destination starts
        assert not (s[np.minimum(first, s.size - 1)] < e)[first < s.size].any()


def check_plan(lay: Layout, plan: ArrayPlan) -> None:
    """Everything a plan_arrays plan must satisfy: validate_arrays, and the same independently, on bytes."""
    validate_arrays(lay.offsets, lay.sizes, lay.movable, plan, span=lay.span)
    check_structure(lay, plan)
    execute(lay, plan, mode="wave")
    execute(lay, plan, mode="sequential")
    page = plan.page_size
    assert plan.pages_before == len(pages_of(lay.offsets.tolist(), lay.sizes.tolist(), page))
    assert plan.pages_after == len(pages_of(final_offsets(lay, plan).tolist(), lay.sizes.tolist(), page))
    assert plan.pages_after <= plan.pages_before
    assert plan.pages_after >= lower_bound(lay, page) == plan.pages_lower_bound
    assert lay.movable[plan.index].all() and (plan.size < page).all(), "pinned and large blocks never move"
    if plan.empty:
        assert plan.pages_after == plan.pages_before


# --------------------------------------------------------------------------
# Properties on random layouts
# --------------------------------------------------------------------------


@SETTINGS
@given(params_with_budget)
def test_random_layouts_give_safe_plans(pm):
    params, max_new_pages = pm
    lay = make_layout(**params)
    check_plan(lay, lay.plan(params["page"], max_new_pages=max_new_pages))


@SETTINGS
@given(layout_params)
def test_without_unmapped_pages_destinations_stay_in_touched_pages(params):
    lay = make_layout(**params)
    page = params["page"]
    plan = lay.plan(page, max_new_pages=0)
    check_plan(lay, plan)
    before = pages_of(lay.offsets.tolist(), lay.sizes.tolist(), page)
    assert pages_of(plan.dst.tolist(), plan.size.tolist(), page) <= before


@SETTINGS
@given(params_with_budget, st.randoms(use_true_random=False))
def test_planning_is_deterministic_and_ignores_input_order(pm, rnd):
    params, max_new_pages = pm
    lay = make_layout(**params)
    page = params["page"]
    plan = lay.plan(page, max_new_pages=max_new_pages)
    assert lay.plan(page, max_new_pages=max_new_pages) == plan
    # Shuffled input: the same moves, each naming its block's new position.
    n = lay.offsets.size
    perm = np.array(rnd.sample(range(n), n), np.int64)
    shuffled = lay.permuted(perm).plan(page, max_new_pages=max_new_pages)
    assert np.array_equal(perm[shuffled.index], plan.index)
    assert dataclasses.replace(shuffled, index=plan.index) == plan


# --------------------------------------------------------------------------
# Reaching the lower bound
# --------------------------------------------------------------------------


@pytest.mark.parametrize("pages, page", [(4, 2 << 20), (64, 65536), (1000, 16384)])
def test_canonical_fragmentation_reaches_ceil_live_over_page(pages, page):
    lay = canonical(7, page=page, pages=pages, per_page=4, live_per_page=1)
    plan = lay.plan(page)
    check_plan(lay, plan)
    live = int(lay.sizes.sum())
    assert plan.pages_before == pages
    assert plan.pages_after == -(-live // page) == -(-pages // 4)
    # Holes of kept pages are free now: one wave, and only the evacuated blocks move.
    assert plan.waves == 1
    assert plan.moved_bytes == (pages - plan.pages_after) * (page // 4)


@SETTINGS
@given(
    seed=st.integers(0, 2**32 - 1),
    page=st.sampled_from([4096, 16384, 65536]),
    pages=st.integers(1, 80),
    per_page=st.sampled_from([2, 4, 8]),
    data=st.data(),
)
def test_canonical_family_reaches_lower_bound(seed, page, pages, per_page, data):
    live_per_page = data.draw(st.integers(1, per_page - 1))
    lay = canonical(seed, page=page, pages=pages, per_page=per_page, live_per_page=live_per_page)
    plan = lay.plan(page)
    check_plan(lay, plan)
    assert plan.pages_after == -(-int(lay.sizes.sum()) // page)


@SETTINGS
@given(
    seed=st.integers(0, 2**32 - 1),
    page=st.sampled_from([4096, 8192, 16384, 65536]),
    pages=st.integers(1, 64),
    keep=st.floats(0.02, 1.0),
    large=st.sampled_from([0.0, 0.05, 0.2]),
    tail=st.integers(0, 3),
)
def test_sizes_dividing_the_page_reach_lower_bound(seed, page, pages, keep, large, tail):
    # Blocks of one size page/2^k (down to 512 B) and whole-page large blocks,
    # packed then freed at random: every hole is a multiple of that size.
    lay = make_layout(seed, page=page, pages=pages + tail, style="divisor", keep=keep, large=large, tail=tail)
    plan = lay.plan(page)
    check_plan(lay, plan)
    assert plan.pages_after == lower_bound(lay, page)


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), pages=st.integers(1, 64), keep=st.floats(0.02, 1.0))
def test_uniform_tiny_blocks_reach_lower_bound(seed, pages, keep):
    r = random.Random(seed)
    page = 8192
    lay = layout_of([(i * A, A, True) for i in range(pages * page // A) if r.random() < keep], pages * page)
    plan = lay.plan(page)
    check_plan(lay, plan)
    assert plan.pages_after == -(-lay.offsets.size * A // page)


def test_pinned_pages_are_kept_and_filled_first():
    page = 8192
    # Page 0 holds one pinned block; pages 1..3 hold one movable block each.
    lay = layout_of([(0, A, False)] + [(i * page, A, True) for i in (1, 2, 3)], 4 * page)
    plan = lay.plan(page)
    check_plan(lay, plan)
    assert plan.pages_after == 1
    assert (plan.dst < page).all()


# --------------------------------------------------------------------------
# Small cases and objectives
# --------------------------------------------------------------------------


def test_empty_and_already_compact_layouts_give_empty_plans():
    page = 4096
    assert layout_of([], 0).plan(page).empty
    packed = layout_of([(i * 1024, 1024, True) for i in range(10)], 8 * page)  # 2.5 pages, packed
    plan = packed.plan(page)
    assert plan.empty and plan.pages_before == plan.pages_after == 3 and len(plan) == 0


def test_no_plan_when_no_page_can_be_freed():
    page = 4096
    # Every page has a pinned block: nothing can be released.
    lay = layout_of([(i * page, A, False) for i in range(4)] + [(i * page + 2048, A, True) for i in range(4)],
                    8 * page)
    plan = lay.plan(page)
    assert plan.empty and plan.pages_after == plan.pages_before == 4


def test_lower_bound_counts_forced_pages_and_live_bytes():
    page = 4096
    pinned_everywhere = layout_of([(i * page, A, False) for i in range(5)], 8 * page)
    assert pinned_everywhere.plan(page).pages_lower_bound == 5
    packed = layout_of([(i * 2048, 2048, True) for i in range(5)], 8 * page)  # 10 KiB
    assert packed.plan(page).pages_lower_bound == 3


def test_large_blocks_stay_and_their_tails_take_small_blocks():
    page = 4096
    names = ["big", "a", "b"]
    lay = layout_of([
        (0, page + 2048, True),  # tail: [6144, 8192)
        (3 * page, 1024, True),
        (5 * page + 1024, 1024, True),
    ], 8 * page)
    plan = lay.plan(page)
    check_plan(lay, plan)
    assert plan.pages_after == 2
    assert {names[i] for i in plan.index.tolist()} == {"a", "b"}
    assert ((page + 2048 <= plan.dst) & (plan.dst < 2 * page)).all()


def test_straddling_block_is_moved_off_an_evacuated_page():
    page = 4096
    lay = layout_of([
        (0, 3072, True),  # dense
        (2 * page - 1024, 2048, True),  # straddles pages 1 and 2
    ], 4 * page)
    plan = lay.plan(page)
    check_plan(lay, plan)
    assert plan.pages_after == 2 and plan.pages_before == 3


def test_later_waves_reuse_space_vacated_by_earlier_ones():
    # Without unmapped pages, blocks that fit no hole that is free now wait
    # for pages (or parts of kept pages) that earlier waves emptied.
    multi = 0
    for seed in range(40):
        lay = make_layout(seed, page=16384, pages=24, style="coarse", keep=0.5)
        plan = lay.plan(16384, max_new_pages=0)
        check_plan(lay, plan)
        multi += plan.waves > 1
    assert multi  # the wave machinery was exercised


@SETTINGS
@given(params_with_budget)
def test_page_tables_and_binary_search_make_the_same_plan(pm):
    # Regions much sparser than their blocks use binary search instead of
    # per-page tables; force that path and compare.
    params, max_new_pages = pm
    lay = make_layout(**params)
    expect = lay.plan(params["page"], max_new_pages=max_new_pages)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(planner, "_PAGE_TABLE_PAGES_PER_TOUCHED", 0)
        mp.setattr(planner, "_PAGE_TABLE_PAGES_ALWAYS", 0)
        assert lay.plan(params["page"], max_new_pages=max_new_pages) == expect


def test_a_sparse_region_is_planned_without_page_tables():
    page = 4096
    span = page << 30  # 4 TiB, 2^30 pages: too many for a page table
    rows = [((i * 7919 % 4096) * (page << 16) + 512 * (i % 4), 512, True) for i in range(64)]
    rows += [(i * page, 1024, True) for i in range(1, 9)]
    lay = layout_of(rows, span)
    plan = lay.plan(page)
    validate_arrays(lay.offsets, lay.sizes, lay.movable, plan, span=span)
    check_structure(lay, plan)
    assert plan.pages_after < plan.pages_before


def _digest(plan: ArrayPlan) -> tuple:
    rows = np.stack([plan.index, plan.src, plan.dst, plan.size, plan.wave], axis=1)
    return (plan.pages_before, plan.pages_after, plan.moved_bytes, len(plan), plan.waves,
            hashlib.sha256(np.ascontiguousarray(rows, np.int64).tobytes()).hexdigest()[:16])


#: Exact plans on fixed layouts: (pages before, after, bytes moved, moves,
#: waves, sha256 of the (index, src, dst, size, wave) rows). These are what
#: compaction runs; a change to the planner that changes any of them changes
#: the moves a compaction makes, and must say so here.
PINNED_PLANS = [
    (("layout", 0, "coarse"), None, (25, 13, 107008, 13, 2, "e0920fa9b63a60dc")),
    (("layout", 0, "coarse"), 0, (25, 13, 151040, 16, 2, "de286c2b00f963c8")),
    (("layout", 1, "mixed"), None, (25, 16, 65024, 21, 1, "9862c322215782d6")),
    (("layout", 1, "mixed"), 0, (25, 16, 65024, 21, 2, "af7e789e7f71123c")),
    (("layout", 2, "small"), None, (30, 12, 87040, 39, 2, "ff72d1303bdc364b")),
    (("layout", 2, "small"), 0, (30, 12, 87040, 39, 2, "61cf87964a226b10")),
    (("layout", 3, "divisor"), None, (24, 13, 65536, 16, 1, "f5debeecbcf21ad6")),
    (("layout", 3, "divisor"), 0, (24, 13, 65536, 16, 1, "f5debeecbcf21ad6")),
    (("layout", 4, "tiny"), None, (19, 7, 39424, 52, 1, "dced387932ec066f")),
    (("layout", 4, "tiny"), 0, (19, 7, 39424, 52, 1, "dced387932ec066f")),
    (("bench", 3000, 0), None, (890, 585, 352004096, 2020, 2, "04ba5ab1e0c19343")),
    (("bench", 3000, 0), 0, (890, 582, 322061312, 1898, 4, "a4aeec5c79025fc2")),
    (("bench", 20000, 1), None, (5389, 3393, 2600371200, 14126, 2, "2c9f8afc026a7b01")),
    (("bench", 20000, 1), 0, (5389, 3377, 2289344512, 12857, 4, "97c11dc67fa6b97f")),
]


@pytest.mark.parametrize("case, max_new_pages, expect", PINNED_PLANS)
def test_the_planner_makes_the_pinned_plans(case, max_new_pages, expect):
    if case[0] == "layout":
        _, seed, style = case
        page = 16384
        lay = make_layout(seed, page=page, pages=40, style=style, keep=0.5, pinned=0.05, large=0.05, tail=3)
    else:
        from defrag.benchmarks.bench_planner import PAGE as page, fragmented_arrays

        _, n, seed = case
        _, off, size, movable, span = fragmented_arrays(n, seed)
        lay = Layout(off, size, movable, span)
    plan = lay.plan(page, max_new_pages=max_new_pages)
    validate_arrays(lay.offsets, lay.sizes, lay.movable, plan, span=lay.span)
    check_structure(lay, plan)
    assert _digest(plan) == expect


# --------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------


BAD_INPUTS = [
    ([(0, 1024, True), (512, 512, True)], {}),  # overlap
    ([(256, 512, True)], {}),  # misaligned offset
    ([(0, 700, True)], {}),  # misaligned size
    ([(0, 0, True)], {}),  # empty block
    ([(-512, 512, True)], {}),  # before the region
    ([(16384 - 512, 1024, True)], {}),  # past the span
    ([], {"page_size": 1000}),  # page not a multiple of the alignment
    ([], {"span": 4096 * 3 + 512}),  # span not a multiple of the page
    ([], {"alignment": 0}),
    ([], {"max_new_pages": -1}),
]


@pytest.mark.parametrize("rows, kwargs", BAD_INPUTS)
def test_bad_input_raises_plan_error(rows, kwargs):
    args = {"page_size": 4096, "span": 16384, **kwargs}
    lay = layout_of(rows, args["span"])
    with pytest.raises(PlanError):
        plan_arrays(lay.offsets, lay.sizes, lay.movable, **args)
    if "max_new_pages" in kwargs:
        return
    # validate_arrays checks its input the same way.
    page = args.pop("page_size")
    e = np.empty(0, np.int64)
    with pytest.raises(PlanError):
        validate_arrays(lay.offsets, lay.sizes, lay.movable, ArrayPlan(e, e, e, e, e, page, 0, 0, 0), **args)


@pytest.mark.parametrize(
    "arrays",
    [
        ([0, 512], [512], [True, True]),  # lengths differ
        ([0.0], [512], [True]),  # offsets not integers
        ([[0]], [[512]], [[True]]),  # not 1-d
        ([0], [512], [0.5]),  # movable not booleans
    ],
)
def test_malformed_arrays_raise_plan_error(arrays):
    with pytest.raises(PlanError):
        plan_arrays(*(np.array(a) for a in arrays), page_size=4096, span=16384)


# --------------------------------------------------------------------------
# validate_arrays catches unsafe plans
# --------------------------------------------------------------------------

PAGE = 4096
NAMES = ["a", "b", "pin", "c", "d", "big"]
BLOCKS = layout_of([
    (0, 1024, True),
    (1024, 1024, True),
    (2048, 1024, False),
    (PAGE, 1024, True),
    (2 * PAGE, 1024, True),
    (4 * PAGE, PAGE, True),
], 8 * PAGE)
SPAN = BLOCKS.span


def plan_of(*waves: list[tuple], before=None, after=None, moved=None) -> ArrayPlan:
    """Moves ``(name, dst)`` of ``BLOCKS``, one list per wave, with honest page counts unless given."""
    rows = []
    for w, wave in enumerate(waves, start=1):
        for name, d in wave:
            i = NAMES.index(name)
            rows.append((i, int(BLOCKS.offsets[i]), d, int(BLOCKS.sizes[i]), w))
    a = np.array(rows, np.int64).reshape(-1, 5).T
    final = BLOCKS.offsets.copy()
    final[a[0]] = a[2]
    sizes = BLOCKS.sizes.tolist()
    return ArrayPlan(
        *a,
        PAGE,
        len(pages_of(BLOCKS.offsets.tolist(), sizes, PAGE)) if before is None else before,
        len(pages_of(final.tolist(), sizes, PAGE)) if after is None else after,
        int(a[3].sum()) if moved is None else moved,
    )


def test_validate_accepts_a_safe_hand_written_plan():
    # c -> hole of page 0 (wave 1); d -> where c was (wave 2).
    plan = plan_of([("c", 3072)], [("d", PAGE)])
    validate_arrays(BLOCKS.offsets, BLOCKS.sizes, BLOCKS.movable, plan, span=SPAN)
    assert plan.wave_slices() == [(0, 1), (1, 2)] and plan.waves == 2 and len(plan) == 2


def _unsafe_plans():
    c = NAMES.index("c")
    cases = [
        (plan_of([("pin", 3072)]), "pinned block moves"),
        (plan_of([("c", 3072)], [("c", PAGE + 2048)]), "block moves twice"),
        (plan_of([("c", 3072), ("d", 3072)]), "two destinations overlap"),
        (plan_of([("c", 2048)]), "lands on a pinned block"),
        (plan_of([("d", PAGE)]), "lands on a block that never moves"),
        (plan_of([("d", PAGE)], [("c", 3072)]), "lands on a block that moves only later"),
        (plan_of([("c", 3072), ("d", PAGE)]), "destination overlaps a source of the same wave"),
        (plan_of([("c", PAGE + 512)]), "overlaps its own source"),
        (plan_of([("c", 3072 + 256)]), "misaligned destination"),
        (plan_of([("big", 5 * PAGE + 512)]), "large block off a page boundary"),
        (plan_of([("d", SPAN - 512)]), "past the span"),
        (plan_of([("c", -1024)]), "before the region"),
        (plan_of([("c", 3072)], after=4), "wrong pages_after"),
        (plan_of([("c", 3072)], moved=0), "wrong moved_bytes"),
        (ArrayPlan([99], [0], [3072], [1024], [1], PAGE, 4, 4, 1024), "unknown block"),
        (ArrayPlan([c], [PAGE], [3072], [512], [1], PAGE, 4, 3, 512), "wrong size"),
        (ArrayPlan([c], [0], [3072], [1024], [1], PAGE, 4, 3, 1024), "wrong source"),
    ]
    for plan, why in cases:
        yield pytest.param(plan, None, id=why)
    good = plan_of([("c", 3072)], [("d", PAGE)])
    yield pytest.param(dataclasses.replace(good, wave=np.array([2, 1])), "wave order", id="waves out of order")
    yield pytest.param(dataclasses.replace(good, wave=np.array([2, 2])), "wave 1 is empty", id="wave 1 empty")
    yield pytest.param(dataclasses.replace(good, wave=np.array([1, 3])), "wave 2 is empty", id="wave 2 empty")
    yield pytest.param(dataclasses.replace(good, index=np.array([3, -1])), "unknown block", id="negative index")
    yield pytest.param(dataclasses.replace(good, index=np.array([3, 3])), "moves twice", id="index repeats")


@pytest.mark.parametrize("plan, match", list(_unsafe_plans()))
def test_validate_rejects_unsafe_plans(plan, match):
    with pytest.raises(PlanError, match=match):
        validate_arrays(BLOCKS.offsets, BLOCKS.sizes, BLOCKS.movable, plan, span=SPAN)


def test_array_plan_values():
    e = np.empty(0, np.int64)
    empty = ArrayPlan(e, e, e, e, e, 4096, 3, 3, 0)
    assert empty.empty and not empty and empty.waves == 0 and empty.wave_slices() == [] and empty.pages_freed == 0
    one = ArrayPlan([0], [4096], [0], [512], [1], 4096, 2, 1, 512, 1)
    assert one == ArrayPlan(np.array([0]), [4096], [0], [512], [1], 4096, 2, 1, 512, 1) != empty
    assert one.pages_freed == 1 and one.wave_slices() == [(0, 1)]
    with pytest.raises(ValueError):
        one.dst[0] = 512  # read-only
    with pytest.raises(dataclasses.FrozenInstanceError):
        one.pages_after = 0  # type: ignore[misc]
    with pytest.raises(PlanError):
        ArrayPlan([0, 1], [0], [0], [512], [1], 4096, 1, 1, 512)  # lengths differ
    with pytest.raises(PlanError):
        ArrayPlan([0], [0.5], [0], [512], [1], 4096, 1, 1, 512)  # not integers


@SETTINGS
@given(
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 3000)), max_size=30),
    st.sampled_from([512, 1000, 4096]),
)
def test_page_union_count_matches_brute_force(layout, page):
    # validate_arrays and the hole and window plans count pages with it.
    first = np.array([o // page for o, _ in layout], np.int64)
    last = np.array([(o + s - 1) // page for o, s in layout], np.int64)
    assert planner._page_union_count(first, last) == len(pages_of(*zip(*layout), page) if layout else ())


# --------------------------------------------------------------------------
# One move that merges two free ranges
# --------------------------------------------------------------------------


def free_ranges(lay: Layout) -> list[tuple[int, int]]:
    """``(offset, size)`` of the space between the blocks, in address order."""
    out, pos = [], 0
    for o, s in sorted(zip(lay.offsets.tolist(), lay.sizes.tolist())):
        if o > pos:
            out.append((pos, o - pos))
        pos = o + s
    return out + ([(pos, lay.span - pos)] if pos < lay.span else [])


def plan_hole(lay: Layout, free: list[tuple[int, int]], size: int, page: int) -> ArrayPlan | None:
    fo = np.array([o for o, _ in free], np.int64)
    fs = np.array([s for _, s in free], np.int64)
    return plan_hole_arrays(lay.offsets, lay.sizes, lay.movable, fo, fs, size, page_size=page, span=lay.span)


def reference_plan_hole(lay: Layout, free, size, page):
    """plan_hole_arrays' rule as one loop, ``(index, src, dst)`` or None: of the movable blocks lying
    exactly between two free ranges that together reach ``size``, the shortest (ties: the first pair)
    moves to the shortest other free range that holds it (ties: lowest address), which must start on a
    page boundary for a block of a page or more."""
    by_offset = {o: i for i, o in enumerate(lay.offsets.tolist())}
    best = None
    for (a_off, a_sz), (b_off, b_sz) in zip(free, free[1:]):
        i = by_offset.get(a_off + a_sz)
        if i is None:
            continue
        n = int(lay.sizes[i])
        if not lay.movable[i] or a_off + a_sz + n != b_off or a_sz + n + b_sz < size:
            continue
        if best is not None and n >= best[0]:
            continue
        fits = sorted((sz, o) for o, sz in free if sz >= n and o not in (a_off, b_off) and (n < page or o % page == 0))
        if fits:
            best = (n, i, fits[0][1])
    return None if best is None else (best[1], int(lay.offsets[best[1]]), best[2])


def test_plan_hole_merges_two_free_ranges_with_one_move():
    page = 64 * 1024
    # One page: blocks of 1 KiB everywhere except two 1 KiB holes around the block at 2 KiB,
    # and a 1 KiB hole at the end where that block can go.
    offsets = [o for o in range(0, page, 1024) if o not in (1024, 3072, page - 1024)]
    lay = layout_of([(o, 1024, True) for o in offsets], page)
    free = [(1024, 1024), (3072, 1024), (page - 1024, 1024)]
    plan = plan_hole(lay, free, 3072, page)
    assert plan is not None and len(plan) == 1 and plan.waves == 1
    assert (plan.src[0], plan.dst[0], plan.size[0]) == (2048, page - 1024, 1024)
    assert plan.index[0] == offsets.index(2048)
    assert plan.pages_after == plan.pages_before == 1
    # Pinned in the middle, or holes too small together: no plan.
    pinned = lay._replace(movable=lay.offsets != 2048)
    assert plan_hole(pinned, free, 3072, page) is None
    assert plan_hole(lay, free, 3584, page) is None


@SETTINGS
@given(layout_params, st.sampled_from([512, 1024, 2048, 4096, 8192, 32768]))
def test_plan_hole_agrees_with_the_reference(params, size):
    params = {**params, "tail": 0, "keep": max(params["keep"], 0.3)}
    lay = make_layout(**params)
    page = params["page"]
    free = free_ranges(lay)
    plan = plan_hole(lay, free, size, page)
    expect = reference_plan_hole(lay, free, size, page)
    if expect is None:
        assert plan is None
        return
    assert (len(plan), plan.waves) == (1, 1)
    assert (int(plan.index[0]), int(plan.src[0]), int(plan.dst[0])) == expect
    # pages_after may exceed pages_before: the free range may be on a new page.
    validate_arrays(lay.offsets, lay.sizes, lay.movable, plan, span=lay.span)
    check_structure(lay, plan)
    execute(lay, plan, mode="wave")


def test_plan_hole_moves_a_large_block_only_to_a_page_boundary():
    page = 4096
    # a, b, c pinned; big movable between [page, +1024) and [2 * page + 1024, +1024).
    lay = layout_of([(0, page, False), (page + 1024, page, True), (2 * page + 2048, 2048, False),
                     (3 * page + 512, 512, False)], 8 * page)
    # Free: [page, +1024), [2 * page + 1024, +1024), [3 * page, +512), [3 * page + 1024, ...)
    free = free_ranges(lay)
    assert free[3] == (3 * page + 1024, 5 * page - 1024)
    # The best-fitting free range [3 * page + 1024, ...) holds the block but not on a page boundary: no plan.
    assert plan_hole(lay, free, 3 * 1024, page) is None
    # With a free page boundary at 4 * page it goes there.
    free = free[:3] + [(3 * page + 1024, page - 1024), (4 * page, 4 * page)]
    plan = plan_hole(lay, free, 3 * 1024, page)
    assert (plan.index.tolist(), plan.src.tolist(), plan.dst.tolist(), plan.size.tolist()) == (
        [1], [page + 1024], [4 * page], [page])


# --------------------------------------------------------------------------
# The mapped-pages hint
# --------------------------------------------------------------------------


def test_mapped_untouched_pages_receive_destinations_before_unmapped_ones():
    """Eight pages hold one 40 KiB block each (5/8 of a page): none fits another's hole, so packing
    fills five zone pages. With `mapped`, the zone is the run of five mapped untouched pages (20-24),
    not the start of the longest untouched run (8); the page counts do not change."""
    page, n = 64 * 1024, 8
    span = 32 * page
    offsets = (np.arange(n) * page).astype(np.int64)
    sizes = np.full(n, 40 * 1024, np.int64)
    movable = np.ones(n, bool)
    mapped = np.zeros(32, bool)
    mapped[:n] = True
    mapped[20:25] = True
    plain = planner.plan_arrays(offsets, sizes, movable, page_size=page, span=span)
    hinted = planner.plan_arrays(offsets, sizes, movable, page_size=page, span=span, mapped=mapped)
    assert plain.pages_after == hinted.pages_after == 5
    assert set((plain.dst // page).tolist()) == set(range(8, 13))
    assert set((hinted.dst // page).tolist()) == set(range(20, 25))
    planner.validate_arrays(offsets, sizes, movable, hinted, span=span)
    with pytest.raises(planner.PlanError, match="one entry per page"):
        planner.plan_arrays(offsets, sizes, movable, page_size=page, span=span, mapped=mapped[:3])


@pytest.mark.parametrize("seed", range(40))
def test_the_mapped_hint_never_leaves_more_pages(seed):
    rng = np.random.default_rng(seed)
    page, npg = 65536, 64
    offs, sizes = [], []
    for p in range(40):
        cur = p * page
        while True:
            sz = int(rng.choice([512 * k for k in (1, 8, 24, 40, 64, 100, 128)]))
            if cur + sz > (p + 1) * page:
                break
            if rng.random() < 0.4:
                offs.append(cur)
                sizes.append(sz)
            cur += sz
    o, s = np.array(offs, np.int64), np.array(sizes, np.int64)
    m = np.ones(o.size, bool)
    mapped = np.zeros(npg, bool)
    mapped[:40] = True
    mapped[40:] = rng.random(npg - 40) < 0.3
    plain = planner.plan_arrays(o, s, m, page_size=page, span=npg * page)
    hinted = planner.plan_arrays(o, s, m, page_size=page, span=npg * page, mapped=mapped)
    assert hinted.pages_after <= plain.pages_after
    planner.validate_arrays(o, s, m, hinted, span=npg * page)


# --------------------------------------------------------------------------
# The conveyor: blocks of a page or more packed end to end
# --------------------------------------------------------------------------


def _conveyor(offsets, sizes, movable=None, *, pages=16, zone=None, max_pages=None, page=2 << 20):
    offsets, sizes = np.asarray(offsets, np.int64), np.asarray(sizes, np.int64)
    movable = np.ones(offsets.size, bool) if movable is None else np.asarray(movable, bool)
    zone_ok = np.ones(pages, bool) if zone is None else np.asarray(zone, bool)
    return planner.plan_conveyor(offsets, sizes, movable, page_size=page, span=pages * page, zone_ok=zone_ok,
                                 max_pages=pages if max_pages is None else max_pages)


def test_conveyor_packs_blocks_that_strand_tails_end_to_end():
    P, MiB = 2 << 20, 1 << 20
    plan = _conveyor([0, 2 * P, 4 * P, 6 * P], [3 * MiB] * 4)  # 1.5 pages each, on page boundaries
    assert len(plan) == 4 and plan.waves == 1
    assert sorted(plan.dst.tolist()) == [8 * P + k * 3 * MiB for k in range(4)]  # back to back from the zone
    assert (plan.pages_before, plan.pages_after, plan.moved_bytes) == (8, 6, 12 * MiB)


def test_conveyor_moves_nothing_that_would_not_free_a_page():
    P, MiB = 2 << 20, 1 << 20
    assert _conveyor([0, 2 * P], [2 * P, 2 * P]).empty                          # whole pages strand nothing
    assert _conveyor([0], [3 * MiB]).empty                                      # alone it needs its 2 pages again
    assert _conveyor([0, 2 * P], [3 * MiB] * 2).pages_after == 3                # two share a page: 4 -> 3
    assert _conveyor([0, 2 * P, 4 * P, 6 * P], [3 * MiB] * 4, max_pages=0).empty  # no zone allowed
    assert _conveyor([0, 2 * P, 4 * P, 6 * P], [3 * MiB] * 4, movable=[False] * 4).empty
    zone = np.zeros(16, bool)
    assert _conveyor([0, 2 * P, 4 * P, 6 * P], [3 * MiB] * 4, zone=zone).empty   # no page may take them


def test_conveyor_fills_only_the_zone_it_may_use():
    P, MiB = 2 << 20, 1 << 20
    zone = np.zeros(16, bool)
    zone[12:15] = True  # three pages: two of the blocks fit (3 pages), freeing their 4
    plan = _conveyor([0, 2 * P, 4 * P, 6 * P], [3 * MiB] * 4, zone=zone)
    assert len(plan) == 2 and plan.pages_after == 8 - 4 + 3
    assert all(12 * P <= d and d + s <= 15 * P for d, s in zip(plan.dst.tolist(), plan.size.tolist()))


@pytest.mark.parametrize("seed", range(30))
def test_conveyor_plans_are_safe(seed):
    """Random layouts: destinations inside allowed untouched pages, disjoint, never over a source."""
    rng = np.random.default_rng(seed)
    P = 64 * 1024
    pages = 64
    offs, sizes, cursor = [], [], 0
    while cursor < 40 * P:
        size = int(rng.choice([P + 512 * int(rng.integers(1, 120)), 512 * int(rng.integers(1, 100))]))
        if cursor + size > 40 * P:
            break
        if rng.random() < 0.7:
            offs.append(cursor)
            sizes.append(size)
        cursor += size + 512 * int(rng.integers(0, 40))
        cursor = -(-cursor // 512) * 512
    zone = rng.random(pages) < 0.8
    plan = _conveyor(offs, sizes, rng.random(len(offs)) < 0.9, pages=pages, zone=zone,
                     max_pages=int(rng.integers(0, 30)), page=P)
    if plan.empty:
        return
    srcs = sorted(zip(offs, sizes))
    dst = sorted(zip(plan.dst.tolist(), plan.size.tolist()))
    for (a, n), (b, _) in zip(dst, dst[1:]):
        assert a + n <= b
    for d, n in dst:
        assert all(zone[p] for p in range(d // P, (d + n - 1) // P + 1))
        assert all(d + n <= s or s + m <= d for s, m in srcs)
    assert plan.pages_after < plan.pages_before and plan.waves == 1


# --------------------------------------------------------------------------
# A window evacuated for a request of a page or more
# --------------------------------------------------------------------------


def _window(blocks, size, *, pages, mapped_pages, spare=0, page=2 << 20, movable=None):
    """plan_window_arrays over (offset, size) blocks, the free ranges being the mapped space no block covers."""
    span = pages * page
    off = np.array([o for o, _ in blocks], np.int64)
    sz = np.array([s for _, s in blocks], np.int64)
    mov = np.ones(len(blocks), bool) if movable is None else np.array(movable, bool)
    mapped = np.zeros(pages, bool)
    mapped[list(mapped_pages)] = True
    free = free_ranges(Layout(off, sz, mov, span))
    # Free ranges lie in mapped pages: cut them at page granularity.
    pieces = []
    for o, n in free:
        for p in range(o // page, (o + n - 1) // page + 1):
            if mapped[p]:
                a, b = max(o, p * page), min(o + n, (p + 1) * page)
                if pieces and pieces[-1][0] + pieces[-1][1] == a:
                    pieces[-1] = (pieces[-1][0], b - pieces[-1][0])
                else:
                    pieces.append((a, b - a))
    fo = np.array([o for o, _ in pieces], np.int64)
    fs = np.array([n for _, n in pieces], np.int64)
    plan = plan_window_arrays(off, sz, mov, fo, fs, size, page_size=page, span=span, mapped=mapped,
                              spare_pages=spare)
    return plan, (off, sz, mov, fo, fs, mapped, span)


def _check_window(plan, args, size, spare):
    """The plan is safe (one wave, destinations in free ranges, final layout disjoint), its window is free
    afterwards, and the window's unmapped pages can be backed."""
    off, sz, mov, fo, fs, mapped, span = args
    P = plan.page_size
    planner._validate(planner._layout(off, sz, mov, span=span, alignment=A), plan, span=span, alignment=A,
                      large_on_pages=False)
    assert plan.waves <= 1 and mov[plan.index].all()
    for d, n in zip(plan.dst.tolist(), plan.size.tolist()):
        assert any(o <= d and d + n <= o + s for o, s in zip(fo.tolist(), fs.tolist())), "destination not free"
    w, n = plan.hole
    assert n == size and 0 <= w and w + n <= span
    final = off.copy()
    final[plan.index] = plan.dst
    assert not ((final < w + n) & (final + sz > w)).any()
    count = np.zeros(span // P, np.int64)
    for o, s in zip(final.tolist(), sz.tolist()):
        count[o // P:(o + s - 1) // P + 1] += 1
    window = np.zeros(span // P, bool)
    window[w // P:(w + n - 1) // P + 1] = True
    donors = int((mapped & (count == 0) & ~window).sum())
    assert int((window & ~mapped).sum()) <= spare + donors


def test_plan_window_evacuates_the_only_window_that_can_hold_the_request():
    """Pinned X [0, 1.5P) leaves a free tail; movable Y fills pages 2-3; pinned Q fills pages 4-7; pages 8-9
    are mapped and empty; nothing else can be backed. A 2.5-page request fits only where X's tail, Y's
    pages and nothing more meet: Y moves into the empty pages."""
    P = 2 << 20
    blocks = [(0, 3 * P // 2), (2 * P, 2 * P), (4 * P, 4 * P)]
    size = 5 * P // 2
    plan, args = _window(blocks, size, pages=16, mapped_pages=range(10), movable=[False, True, False])
    assert plan.hole == (3 * P // 2, size)
    assert plan.index.tolist() == [1] and plan.dst.tolist() == [8 * P] and plan.moved_bytes == 2 * P
    assert (plan.pages_before, plan.pages_after) == (8, 8)
    _check_window(plan, args, size, 0)
    # One spare physical page: the free pages 8-9 and unmapped page 10 are a window that moves nothing.
    plan, args = _window(blocks, size, pages=16, mapped_pages=range(10), spare=1, movable=[False, True, False])
    assert plan.empty and plan.hole == (8 * P, size)
    _check_window(plan, args, size, 1)


def test_plan_window_puts_a_large_block_into_a_free_tail():
    """Y (1.5 pages) must leave the window; in the free tail of a pinned block it touches one page no block
    touches, on a page boundary two: with one empty page to spare, only the tail works."""
    P = 2 << 20
    # X [0, 1.5P) pinned, Y [2P, 3.5P) movable, Z [4P, 5.5P) pinned: tail [5.5P, 6P), page 6 empty.
    blocks = [(0, 3 * P // 2), (2 * P, 3 * P // 2), (4 * P, 3 * P // 2)]
    size = 5 * P // 2
    plan, args = _window(blocks, size, pages=8, mapped_pages=range(7), movable=[False, True, False])
    assert plan.hole == (3 * P // 2, size) and plan.dst.tolist() == [11 * P // 2]
    _check_window(plan, args, size, 0)


def test_plan_window_returns_none_when_no_window_can_be_emptied():
    P = 2 << 20
    blocks = [(0, 3 * P // 2), (2 * P, 2 * P), (4 * P, 4 * P)]
    size = 5 * P // 2
    # Y pinned too: nothing may move and no free window can be backed.
    plan, _ = _window(blocks, size, pages=16, mapped_pages=range(10), movable=[False, False, False])
    assert plan is None
    # Y movable but only 1.5 pages free elsewhere: it fits nowhere.
    plan, _ = _window(blocks, size, pages=10, mapped_pages=range(9), movable=[False, True, False])
    assert plan is None
    # Larger than the span.
    plan, _ = _window(blocks, 11 * P, pages=10, mapped_pages=range(10), movable=[False, True, False])
    assert plan is None
    with pytest.raises(PlanError):
        _window(blocks, size + 1, pages=16, mapped_pages=range(10))
    with pytest.raises(PlanError, match="mapped"):
        plan_window_arrays([0], [P], [True], [], [], P, page_size=P, span=4 * P, mapped=np.ones(3, bool),
                           spare_pages=0)


@pytest.mark.parametrize("seed", range(60))
def test_plan_window_plans_are_safe(seed):
    """Random layouts of mixed blocks (some pinned) over partly mapped pages: every plan is one safe wave
    into free ranges and leaves its window free and backable."""
    rng = np.random.default_rng(seed)
    P = 64 * 1024
    pages = 48
    blocks, cursor = [], 0
    while True:
        n = int(rng.choice([P + 512 * int(rng.integers(1, 200)), 512 * int(rng.integers(1, 120))]))
        if cursor + n > 46 * P:
            break
        if rng.random() < 0.85:
            blocks.append((cursor, n))
        cursor += n + 512 * int(rng.integers(0, 30))
    touched = set()
    for o, n in blocks:
        touched.update(range(o // P, (o + n - 1) // P + 1))
    mapped_pages = sorted(touched | {p for p in range(pages) if rng.random() < 0.1})
    movable = (rng.random(len(blocks)) < 0.9).tolist()
    size = int(P + 512 * int(rng.integers(0, 3 * P // 512)))
    spare = int(rng.integers(0, 2))
    plan, args = _window(blocks, size, pages=pages, mapped_pages=mapped_pages, spare=spare, page=P,
                         movable=movable)
    if plan is not None:
        _check_window(plan, args, size, spare)


# --------------------------------------------------------------------------
# Best fit against a one-item-at-a-time reference
# --------------------------------------------------------------------------


def reference_best_fit(hole_s, hole_e, sizes, unit, cap):
    """_best_fit's rule, one item at a time: the shortest hole shorter than ``cap`` units that fits
    (of equal ones the last given or made), else the front of the first hole of ``cap`` units or more."""
    big = [[s // unit, (e - s) // unit] for s, e in zip(hole_s, hole_e) if (e - s) // unit >= cap]
    stacks: dict[int, list[int]] = {}
    for s, e in zip(hole_s, hole_e):
        if 0 < (e - s) // unit < cap:
            stacks.setdefault((e - s) // unit, []).append(s // unit)
    out = []
    for z in sizes:
        g = z // unit
        fits = [b for b, st in stacks.items() if st and g <= b] if g < cap else []
        if fits:
            b = min(fits)
            start = stacks[b].pop()
            if b > g:
                stacks.setdefault(b - g, []).append(start + g)
        elif g < cap and big:
            start = big[0][0]
            big[0][0] += g
            big[0][1] -= g
            if big[0][1] < cap:
                s, ln = big.pop(0)
                if ln:
                    stacks.setdefault(ln, []).append(s)
        else:
            out.append(-1)
            continue
        out.append(start * unit)
    return out


@pytest.mark.parametrize("seed", range(60))
def test_best_fit_matches_one_at_a_time(seed):
    # Runs of equal items into equal holes (the compactor's usual case, placed a hole at a
    # time) as well as mixed ones.
    r = random.Random(seed)
    cap = r.choice([8, 64, 4096])
    lens = [r.choice([cap // 2, cap // 3 or 1, cap - 1, r.randint(1, 2 * cap)]) for _ in range(r.randint(0, 90))]
    if r.random() < 0.5:
        lens = [r.choice([cap - 1, cap // 2 + 1, 3 * cap // 4])] * len(lens)
    starts, at = [], 0
    for ln in lens:
        at += r.randint(0, 2)
        starts.append(at)
        at += ln
    choices = [max(1, cap // k) for k in (2, 3, 4, 5, 8)] + [1, cap - 1, cap, cap + 1]
    items = sorted((r.choice(choices[: r.randint(1, len(choices))]) for _ in range(r.randint(0, 300))), reverse=True)
    s = np.array(starts, np.int64) * A
    e = s + np.array(lens, np.int64) * A
    z = np.array(items, np.int64) * A
    got = planner._best_fit(s, e, z, A, cap)
    assert got.tolist() == reference_best_fit(s.tolist(), e.tolist(), z.tolist(), A, cap)
