"""Tests for defrag.planner: plans are safe (checked by executing them on bytes), honest, and good."""
from __future__ import annotations

import dataclasses
import hashlib
import random
from contextlib import nullcontext

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import defrag.planner as planner
from defrag.planner import (
    ArrayPlan,
    LiveBlock,
    Move,
    Plan,
    PlanError,
    lower_bound_pages,
    plan_arrays,
    plan_compaction,
    plan_hole,
    plan_hole_arrays,
    plan_window_arrays,
    touched_pages,
    validate_arrays,
    validate_plan,
)

A = 512  # alignment
SETTINGS = settings(deadline=None, max_examples=250, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------
# Layout generators
# --------------------------------------------------------------------------


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
) -> tuple[list[LiveBlock], int]:
    """Blocks allocated back to back over ``pages - tail`` pages (blocks of a page
    or more start on a page boundary, smaller ones may straddle), then a random
    ``keep`` fraction of them kept live. Returns (blocks, span)."""
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
    blocks = [
        LiveBlock(("blk", i), o, s, movable=r.random() >= pinned)
        for i, (o, s) in enumerate(out)
        if r.random() < keep
    ]
    r.shuffle(blocks)  # the planner must not rely on input order
    return blocks, pages * page


def canonical(seed: int, *, page: int, pages: int, per_page: int, live_per_page: int) -> list[LiveBlock]:
    """Every page held ``per_page`` equal blocks; all but ``live_per_page`` of each were freed."""
    r = random.Random(seed)
    size = page // per_page
    slots = [(p, slot) for p in range(pages) for slot in sorted(r.sample(range(per_page), live_per_page))]
    return [LiveBlock(i, p * page + slot * size, size, True) for i, (p, slot) in enumerate(slots)]


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


# --------------------------------------------------------------------------
# Executing a plan on bytes
# --------------------------------------------------------------------------


def pattern(i: int, size: int) -> np.ndarray:
    """Bytes unique to block number ``i`` and to each 8-byte word within it."""
    words = np.arange(size // 8, dtype=np.uint64) + np.uint64(i + 1) * np.uint64(1 << 32)
    return words.view(np.uint8)


def execute(blocks: list[LiveBlock], plan: Plan, span: int, *, mode: str) -> None:
    """Run ``plan`` on a region filled with per-block patterns; check every block's bytes.

    ``mode="wave"``: per wave, read every source first, then write every
    destination (what one kernel launch does). ``mode="sequential"``: one
    memmove per move, in plan order. Sources are poisoned once read, so a
    later read of a vacated range is caught too.
    """
    mem = np.full(span, 0xEE, np.uint8)
    index = {b.key: i for i, b in enumerate(blocks)}
    for i, b in enumerate(blocks):
        mem[b.offset:b.offset + b.size] = pattern(i, b.size)
    for wave in plan.waves:
        if mode == "wave":
            data = [mem[m.src:m.src + m.size].copy() for m in wave]
            for m in wave:
                mem[m.src:m.src + m.size] = 0xDD
            for m, d in zip(wave, data):
                mem[m.dst:m.dst + m.size] = d
        else:
            for m in wave:
                d = mem[m.src:m.src + m.size].copy()
                mem[m.src:m.src + m.size] = 0xDD
                mem[m.dst:m.dst + m.size] = d
    final = {b.key: b.offset for b in blocks}
    final.update({m.key: m.dst for m in plan.moves})
    for b in blocks:
        got = mem[final[b.key]:final[b.key] + b.size]
        assert np.array_equal(got, pattern(index[b.key], b.size)), f"{mode}: bytes of {b.key!r} lost"


def final_layout(blocks: list[LiveBlock], plan: Plan) -> list[tuple[int, int]]:
    dst = {m.key: m.dst for m in plan.moves}
    return [(dst.get(b.key, b.offset), b.size) for b in blocks]


def check_plan(blocks: list[LiveBlock], plan: Plan, span: int) -> None:
    """Everything any plan must satisfy, checked independently of validate_plan."""
    validate_plan(blocks, plan, span=span)
    execute(blocks, plan, span, mode="wave")
    execute(blocks, plan, span, mode="sequential")
    page = plan.page_size
    assert plan.pages_before == touched_pages([(b.offset, b.size) for b in blocks], page)
    assert plan.pages_after == touched_pages(final_layout(blocks, plan), page)
    assert plan.pages_after <= plan.pages_before
    assert plan.pages_after >= lower_bound_pages(blocks, page_size=page) == plan.pages_lower_bound
    assert plan.moved_bytes == sum(m.size for m in plan.moves)
    by_key = {b.key: b for b in blocks}
    for m in plan.moves:
        b = by_key[m.key]
        assert b.movable and b.size < page, "pinned and large blocks never move"
        assert (m.src, m.size) == (b.offset, b.size)
    assert plan.empty == (not plan.moves)
    assert all(plan.waves), "no empty waves"
    if plan.empty:
        assert plan.pages_after == plan.pages_before


# --------------------------------------------------------------------------
# Properties on random layouts
# --------------------------------------------------------------------------


@SETTINGS
@given(layout_params)
def test_random_layouts_give_safe_plans(params):
    blocks, span = make_layout(**params)
    plan = plan_compaction(blocks, page_size=params["page"], span=span)
    check_plan(blocks, plan, span)


@SETTINGS
@given(layout_params)
def test_without_unmapped_pages_destinations_stay_in_touched_pages(params):
    blocks, span = make_layout(**params)
    page = params["page"]
    plan = plan_compaction(blocks, page_size=page, span=span, max_new_pages=0)
    check_plan(blocks, plan, span)
    before = {p for b in blocks for p in range(b.offset // page, (b.offset + b.size - 1) // page + 1)}
    for m in plan.moves:
        assert {m.dst // page, (m.dst + m.size - 1) // page} <= before


@SETTINGS
@given(layout_params)
def test_planning_is_deterministic_and_ignores_input_order(params):
    blocks, span = make_layout(**params)
    page = params["page"]
    a = plan_compaction(blocks, page_size=page, span=span)
    b = plan_compaction(sorted(blocks, key=lambda b: b.offset), page_size=page, span=span)
    assert a == b


# --------------------------------------------------------------------------
# Reaching the lower bound
# --------------------------------------------------------------------------


@pytest.mark.parametrize("pages, page", [(4, 2 << 20), (64, 65536), (1000, 16384)])
def test_canonical_fragmentation_reaches_ceil_live_over_page(pages, page):
    blocks = canonical(7, page=page, pages=pages, per_page=4, live_per_page=1)
    span = pages * page
    plan = plan_compaction(blocks, page_size=page, span=span)
    check_plan(blocks, plan, span)
    live = sum(b.size for b in blocks)
    assert plan.pages_before == pages
    assert plan.pages_after == -(-live // page) == -(-pages // 4)
    # Holes of kept pages are free now: one wave, and only the evacuated blocks move.
    assert len(plan.waves) == 1
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
    blocks = canonical(seed, page=page, pages=pages, per_page=per_page, live_per_page=live_per_page)
    span = pages * page
    plan = plan_compaction(blocks, page_size=page, span=span)
    check_plan(blocks, plan, span)
    assert plan.pages_after == -(-sum(b.size for b in blocks) // page)


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
    blocks, span = make_layout(
        seed, page=page, pages=pages + tail, style="divisor", keep=keep, large=large, tail=tail
    )
    plan = plan_compaction(blocks, page_size=page, span=span)
    check_plan(blocks, plan, span)
    assert plan.pages_after == lower_bound_pages(blocks, page_size=page)


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), pages=st.integers(1, 64), keep=st.floats(0.02, 1.0))
def test_uniform_tiny_blocks_reach_lower_bound(seed, pages, keep):
    r = random.Random(seed)
    page = 8192
    blocks = [LiveBlock(i, i * A, A, True) for i in range(pages * page // A) if r.random() < keep]
    plan = plan_compaction(blocks, page_size=page, span=pages * page)
    check_plan(blocks, plan, pages * page)
    assert plan.pages_after == -(-len(blocks) * A // page)


def test_pinned_pages_are_kept_and_filled_first():
    page = 8192
    # Page 0 holds one pinned block; pages 1..3 hold one movable block each.
    blocks = [LiveBlock("pin", 0, A, False)] + [LiveBlock(i, i * page, A, True) for i in (1, 2, 3)]
    plan = plan_compaction(blocks, page_size=page, span=4 * page)
    check_plan(blocks, plan, 4 * page)
    assert plan.pages_after == 1
    assert all(m.dst < page for m in plan.moves)


# --------------------------------------------------------------------------
# Small cases and objectives
# --------------------------------------------------------------------------


def test_empty_and_already_compact_layouts_give_empty_plans():
    page = 4096
    assert plan_compaction([], page_size=page, span=0).empty
    blocks = [LiveBlock(i, i * 1024, 1024, True) for i in range(10)]  # 2.5 pages, packed
    plan = plan_compaction(blocks, page_size=page, span=8 * page)
    assert plan.empty and plan.pages_before == plan.pages_after == 3 and plan.moves == ()


def test_no_plan_when_no_page_can_be_freed():
    page = 4096
    # Every page has a pinned block: nothing can be released.
    blocks = [LiveBlock(("p", i), i * page, A, False) for i in range(4)]
    blocks += [LiveBlock(("m", i), i * page + 2048, A, True) for i in range(4)]
    plan = plan_compaction(blocks, page_size=page, span=8 * page)
    assert plan.empty and plan.pages_after == plan.pages_before == 4


def test_large_blocks_stay_and_their_tails_take_small_blocks():
    page = 4096
    blocks = [
        LiveBlock("big", 0, page + 2048, True),  # tail: [6144, 8192)
        LiveBlock("a", 3 * page, 1024, True),
        LiveBlock("b", 5 * page + 1024, 1024, True),
    ]
    plan = plan_compaction(blocks, page_size=page, span=8 * page)
    check_plan(blocks, plan, 8 * page)
    assert plan.pages_after == 2
    assert {m.key for m in plan.moves} == {"a", "b"}
    assert all(page + 2048 <= m.dst < 2 * page for m in plan.moves)


def test_straddling_block_is_moved_off_an_evacuated_page():
    page = 4096
    blocks = [
        LiveBlock("dense", 0, 3072, True),
        LiveBlock("straddle", 2 * page - 1024, 2048, True),  # pages 1 and 2
    ]
    plan = plan_compaction(blocks, page_size=page, span=4 * page)
    check_plan(blocks, plan, 4 * page)
    assert plan.pages_after == 2 and plan.pages_before == 3


def test_moves_are_plain_move_values():
    page = 4096
    blocks = [LiveBlock("k", 3 * page, 1024, True), LiveBlock("j", 0, 1024, True)]
    plan = plan_compaction(blocks, page_size=page, span=4 * page)
    (m,) = plan.moves
    assert m == Move("k", 3 * page, m.dst, 1024) and hash(m) == hash(Move("k", 3 * page, m.dst, 1024))
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.dst = 0  # type: ignore[misc]
    assert plan.moves == tuple(x for w in plan.waves for x in w)


def test_later_waves_reuse_space_vacated_by_earlier_ones():
    # Without unmapped pages, blocks that fit no hole that is free now wait
    # for pages (or parts of kept pages) that earlier waves emptied.
    multi = 0
    for seed in range(40):
        blocks, span = make_layout(seed, page=16384, pages=24, style="coarse", keep=0.5)
        plan = plan_compaction(blocks, page_size=16384, span=span, max_new_pages=0)
        check_plan(blocks, plan, span)
        multi += len(plan.waves) > 1
    assert multi  # the wave machinery was exercised


# --------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------


BAD_INPUTS = [
    ([LiveBlock(1, 0, 1024, True), LiveBlock(2, 512, 512, True)], {}),  # overlap
    ([LiveBlock(1, 256, 512, True)], {}),  # misaligned offset
    ([LiveBlock(1, 0, 700, True)], {}),  # misaligned size
    ([LiveBlock(1, 0, 0, True)], {}),  # empty block
    ([LiveBlock(1, -512, 512, True)], {}),  # before the region
    ([LiveBlock(1, 16384 - 512, 1024, True)], {}),  # past the span
    ([LiveBlock(1, 0, 512, True), LiveBlock(1, 1024, 512, True)], {}),  # duplicate key
    ([], {"page_size": 1000}),  # page not a multiple of the alignment
    ([], {"span": 4096 * 3 + 512}),  # span not a multiple of the page
    ([], {"alignment": 0}),
    ([], {"max_new_pages": -1}),
]


@pytest.mark.parametrize("blocks, kwargs", BAD_INPUTS)
def test_bad_input_raises_plan_error(blocks, kwargs):
    args = {"page_size": 4096, "span": 16384, **kwargs}
    with pytest.raises(PlanError):
        plan_compaction(blocks, **args)
    # validate_plan checks its input the same way.
    args.pop("max_new_pages", None)
    page = args.pop("page_size")
    with pytest.raises(PlanError) if "max_new_pages" not in kwargs else nullcontext():
        validate_plan(blocks, Plan((), page, 0, 0, 0), **args)


# --------------------------------------------------------------------------
# validate_plan catches unsafe plans
# --------------------------------------------------------------------------

PAGE = 4096
BLOCKS = [
    LiveBlock("a", 0, 1024, True),
    LiveBlock("b", 1024, 1024, True),
    LiveBlock("pin", 2048, 1024, False),
    LiveBlock("c", PAGE, 1024, True),
    LiveBlock("d", 2 * PAGE, 1024, True),
    LiveBlock("big", 4 * PAGE, PAGE, True),
]
SPAN = 8 * PAGE


def plan_of(*waves: list[tuple], before=None, after=None, moved=None) -> Plan:
    by_key = {b.key: b for b in BLOCKS}
    ws = tuple(tuple(Move(k, by_key[k].offset, d, by_key[k].size) for k, d in w) for w in waves)
    layout = {b.key: (b.offset, b.size) for b in BLOCKS}
    for w in ws:
        for m in w:
            layout[m.key] = (m.dst, m.size)
    return Plan(
        ws,
        PAGE,
        touched_pages([(b.offset, b.size) for b in BLOCKS], PAGE) if before is None else before,
        touched_pages(layout.values(), PAGE) if after is None else after,
        sum(m.size for w in ws for m in w) if moved is None else moved,
    )


def test_validate_accepts_a_safe_hand_written_plan():
    # c -> hole of page 0 (wave 1); d -> where c was (wave 2).
    validate_plan(BLOCKS, plan_of([("c", 3072)], [("d", PAGE)]), span=SPAN)


UNSAFE_PLANS = [
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
    (plan_of([("c", 3072)], []), "empty wave"),
    (plan_of([("c", 3072)], after=4), "wrong pages_after"),
    (plan_of([("c", 3072)], moved=0), "wrong moved_bytes"),
    (Plan(((Move("zzz", 0, 3072, 1024),),), PAGE, 4, 4, 1024), "unknown block"),
    (Plan(((Move("c", PAGE, 3072, 512),),), PAGE, 4, 3, 512), "wrong size"),
    (Plan(((Move("c", 0, 3072, 1024),),), PAGE, 4, 3, 1024), "wrong source"),
]


@pytest.mark.parametrize("plan, why", UNSAFE_PLANS)
def test_validate_rejects_unsafe_plans(plan, why):
    with pytest.raises(PlanError):
        validate_plan(BLOCKS, plan, span=SPAN)


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


@SETTINGS
@given(
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 3000)), max_size=30),
    st.sampled_from([512, 1000, 4096]),
)
def test_touched_pages_matches_brute_force(layout, page):
    expect = {p for o, s in layout if s for p in range(o // page, (o + s - 1) // page + 1)}
    assert touched_pages(layout, page) == len(expect)


def test_lower_bound_counts_forced_pages_and_live_bytes():
    page = 4096
    pinned_everywhere = [LiveBlock(i, i * page, A, False) for i in range(5)]
    assert lower_bound_pages(pinned_everywhere, page_size=page) == 5
    packed = [LiveBlock(i, i * 2048, 2048, True) for i in range(5)]  # 10 KiB
    assert lower_bound_pages(packed, page_size=page) == 3


def test_plan_hole_merges_two_free_ranges_with_one_move():
    page = 64 * 1024
    # One page: blocks of 1 KiB everywhere except two 1 KiB holes around the block at 2 KiB,
    # and a 1 KiB hole at the end where that block can go.
    offsets = [o for o in range(0, page, 1024) if o not in (1024, 3072, page - 1024)]
    blocks = [LiveBlock(o, o, 1024, True) for o in offsets]
    free = [(1024, 1024), (3072, 1024), (page - 1024, 1024)]
    plan = plan_hole(blocks, free, 3072, page_size=page, span=page)
    assert plan is not None and len(plan.moves) == 1
    move = plan.moves[0]
    assert (move.src, move.dst, move.size) == (2048, page - 1024, 1024)
    assert plan.pages_after == plan.pages_before == 1
    # Pinned in the middle, or holes too small together: no plan.
    pinned = [LiveBlock(b.key, b.offset, b.size, b.offset != 2048) for b in blocks]
    assert plan_hole(pinned, free, 3072, page_size=page, span=page) is None
    assert plan_hole(blocks, free, 3584, page_size=page, span=page) is None


# --------------------------------------------------------------------------
# The array form: plan_arrays / ArrayPlan / validate_arrays / plan_hole_arrays
# --------------------------------------------------------------------------


def arrays_of(blocks: list[LiveBlock]) -> tuple[list, np.ndarray, np.ndarray, np.ndarray]:
    """Keys and the parallel arrays of ``blocks`` (index i = blocks[i])."""
    return (
        [b.key for b in blocks],
        np.array([b.offset for b in blocks], np.int64),
        np.array([b.size for b in blocks], np.int64),
        np.array([b.movable for b in blocks], bool),
    )


def check_arrays(off: np.ndarray, size: np.ndarray, movable: np.ndarray, plan: ArrayPlan, span: int) -> None:
    """What every planner-made ArrayPlan promises, checked independently of validate_arrays."""
    validate_arrays(off, size, movable, plan, span=span)
    n = len(plan)
    for name in ("index", "src", "dst", "size", "wave"):
        a = getattr(plan, name)
        assert a.dtype == np.int64 and a.shape == (n,) and not a.flags.writeable
    assert plan.empty == (n == 0) and plan.moved_bytes == int(plan.size.sum())
    assert len(set(plan.index.tolist())) == n
    assert np.array_equal(plan.src, off[plan.index]) and np.array_equal(plan.size, size[plan.index])
    assert movable[plan.index].all() and (plan.size < plan.page_size).all()
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


params_with_budget = layout_params.flatmap(
    lambda p: st.sampled_from([None, 0, 1, 3]).map(lambda mnp: (p, mnp))
)


@SETTINGS
@given(params_with_budget, st.randoms(use_true_random=False))
def test_array_plan_is_the_object_plan(pm, rnd):
    params, max_new_pages = pm
    blocks, span = make_layout(**params)
    page = params["page"]
    keys, off, size, movable = arrays_of(blocks)
    arrays = plan_arrays(off, size, movable, page_size=page, span=span, max_new_pages=max_new_pages)
    plan = plan_compaction(blocks, page_size=page, span=span, max_new_pages=max_new_pages)
    assert arrays.to_plan(keys) == plan
    assert (len(arrays), arrays.waves, arrays.empty) == (len(plan.moves), len(plan.waves), plan.empty)
    assert [b - a for a, b in arrays.wave_slices()] == [len(w) for w in plan.waves]
    assert arrays.pages_lower_bound == plan.pages_lower_bound == lower_bound_pages(blocks, page_size=page)
    check_arrays(off, size, movable, arrays, span)
    validate_plan(blocks, arrays, span=span)
    # Input order does not matter: the keys follow their blocks.
    perm = np.array(rnd.sample(range(len(blocks)), len(blocks)), np.int64)
    shuffled = plan_arrays(off[perm], size[perm], movable[perm], page_size=page, span=span,
                           max_new_pages=max_new_pages)
    assert np.array_equal(perm[shuffled.index], arrays.index)
    assert dataclasses.replace(shuffled, index=arrays.index) == arrays


@SETTINGS
@given(params_with_budget)
def test_page_tables_and_binary_search_make_the_same_plan(pm):
    # Regions much sparser than their blocks use binary search instead of
    # per-page tables; force that path and compare.
    params, max_new_pages = pm
    blocks, span = make_layout(**params)
    _, off, size, movable = arrays_of(blocks)
    args = dict(page_size=params["page"], span=span, max_new_pages=max_new_pages)
    expect = plan_arrays(off, size, movable, **args)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(planner, "_TABLE_RATIO", 0)
        mp.setattr(planner, "_TABLE_MIN", 0)
        assert plan_arrays(off, size, movable, **args) == expect


def test_arrays_plan_a_sparse_region_without_page_tables():
    page = 4096
    span = page << 30  # 4 TiB, 2^30 pages: too many for a page table
    blocks = [LiveBlock(i, (i * 7919 % 4096) * (page << 16) + 512 * (i % 4), 512, True) for i in range(64)]
    blocks += [LiveBlock(("x", i), i * page, 1024, True) for i in range(1, 9)]
    keys, off, size, movable = arrays_of(blocks)
    plan = plan_arrays(off, size, movable, page_size=page, span=span)
    check_arrays(off, size, movable, plan, span)
    assert plan.pages_after < plan.pages_before
    assert plan.to_plan(keys) == plan_compaction(blocks, page_size=page, span=span)


def _digest(plan: ArrayPlan) -> tuple:
    rows = np.stack([plan.index, plan.src, plan.dst, plan.size, plan.wave], axis=1)
    return (plan.pages_before, plan.pages_after, plan.moved_bytes, len(plan), plan.waves,
            hashlib.sha256(np.ascontiguousarray(rows, np.int64).tobytes()).hexdigest()[:16])


#: Plans of the planner before it worked on arrays (the object planner of
#: issue 12), on fixed layouts: (pages before, after, bytes moved, moves,
#: waves, sha256 of the (index, src, dst, size, wave) rows). The array
#: planner must make exactly these plans.
OLD_PLANS = [
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


@pytest.mark.parametrize("case, max_new_pages, expect", OLD_PLANS)
def test_array_planner_makes_the_old_planners_plans(case, max_new_pages, expect):
    if case[0] == "layout":
        _, seed, style = case
        page = 16384
        blocks, span = make_layout(seed, page=page, pages=40, style=style, keep=0.5, pinned=0.05, large=0.05, tail=3)
        keys, off, size, movable = arrays_of(blocks)
    else:
        from defrag.benchmarks.bench_planner import PAGE as page, fragmented_arrays

        _, n, seed = case
        keys, off, size, movable, span = fragmented_arrays(n, seed)
    plan = plan_arrays(off, size, movable, page_size=page, span=span, max_new_pages=max_new_pages)
    check_arrays(off, size, movable, plan, span)
    assert _digest(plan) == expect


# ArrayPlan and validate_arrays


def arrays_plan_of(plan: Plan, blocks=BLOCKS) -> ArrayPlan:
    """``plan`` in array form (unknown keys get index 99)."""
    pos = {b.key: i for i, b in enumerate(blocks)}
    rows = [(pos.get(m.key, 99), m.src, m.dst, m.size, w) for w, wave in enumerate(plan.waves, 1) for m in wave]
    a = np.array(rows, np.int64).reshape(-1, 5).T
    return ArrayPlan(*a, plan.page_size, plan.pages_before, plan.pages_after, plan.moved_bytes)


def test_validate_arrays_accepts_a_safe_hand_written_plan():
    plan = arrays_plan_of(plan_of([("c", 3072)], [("d", PAGE)]))
    _, off, size, movable = arrays_of(BLOCKS)
    validate_arrays(off, size, movable, plan, span=SPAN)
    validate_plan(BLOCKS, plan, span=SPAN)
    assert plan.wave_slices() == [(0, 1), (1, 2)] and plan.waves == 2 and len(plan) == 2
    assert plan.to_plan([b.key for b in BLOCKS]) == plan_of([("c", 3072)], [("d", PAGE)])


def _unsafe_array_plans():
    for plan, why in UNSAFE_PLANS:
        if why != "empty wave":  # an array plan has no way to spell an empty last wave
            yield pytest.param(arrays_plan_of(plan), None, id=why)
    good = arrays_plan_of(plan_of([("c", 3072)], [("d", PAGE)]))
    yield pytest.param(dataclasses.replace(good, wave=np.array([2, 1])), "wave order", id="waves out of order")
    yield pytest.param(dataclasses.replace(good, wave=np.array([2, 2])), "wave 1 is empty", id="wave 1 empty")
    yield pytest.param(dataclasses.replace(good, wave=np.array([1, 3])), "wave 2 is empty", id="wave 2 empty")
    yield pytest.param(dataclasses.replace(good, index=np.array([3, -1])), "unknown block", id="negative index")
    yield pytest.param(dataclasses.replace(good, index=np.array([3, 3])), "moves twice", id="index repeats")


@pytest.mark.parametrize("plan, match", list(_unsafe_array_plans()))
def test_validate_arrays_rejects_unsafe_plans(plan, match):
    _, off, size, movable = arrays_of(BLOCKS)
    with pytest.raises(PlanError, match=match):
        validate_arrays(off, size, movable, plan, span=SPAN)
    with pytest.raises(PlanError, match=match):
        validate_plan(BLOCKS, plan, span=SPAN)


def test_array_plan_values():
    e = np.empty(0, np.int64)
    empty = ArrayPlan(e, e, e, e, e, 4096, 3, 3, 0)
    assert empty.empty and not empty and empty.waves == 0 and empty.wave_slices() == [] and empty.pages_freed == 0
    assert empty.to_plan() == Plan((), 4096, 3, 3, 0)
    one = ArrayPlan([0], [4096], [0], [512], [1], 4096, 2, 1, 512, 1)
    assert one == ArrayPlan(np.array([0]), [4096], [0], [512], [1], 4096, 2, 1, 512, 1) != empty
    assert one.to_plan(["k"]) == Plan(((Move("k", 4096, 0, 512),),), 4096, 2, 1, 512, 1)
    assert one.to_plan().moves == (Move(0, 4096, 0, 512),)
    with pytest.raises(ValueError):
        one.dst[0] = 512  # read-only
    with pytest.raises(dataclasses.FrozenInstanceError):
        one.pages_after = 0  # type: ignore[misc]
    with pytest.raises(PlanError):
        ArrayPlan([0, 1], [0], [0], [512], [1], 4096, 1, 1, 512)  # lengths differ
    with pytest.raises(PlanError):
        ArrayPlan([0], [0.5], [0], [512], [1], 4096, 1, 1, 512)  # not integers


@pytest.mark.parametrize(
    "blocks, kwargs",
    [c for c in BAD_INPUTS if len({b.key for b in c[0]}) == len(c[0])],  # arrays have no duplicate keys
)
def test_bad_array_input_raises_plan_error(blocks, kwargs):
    _, off, size, movable = arrays_of(blocks)
    with pytest.raises(PlanError):
        plan_arrays(off, size, movable, **{"page_size": 4096, "span": 16384, **kwargs})


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


# plan_hole in both forms


def reference_plan_hole(blocks, free, size, page):
    """The hole planner of issue 12 as one loop (key, src, dst) or None, plus:
    a block of a page or more needs a free range starting on a page boundary."""
    by_offset = {b.offset: b for b in blocks}
    best = None
    for (a_off, a_sz), (b_off, b_sz) in zip(free, free[1:]):
        blk = by_offset.get(a_off + a_sz)
        if blk is None or not blk.movable or a_off + a_sz + blk.size != b_off or a_sz + blk.size + b_sz < size:
            continue
        if best is not None and blk.size >= best[0]:
            continue
        fits = sorted((sz, o) for o, sz in free if sz >= blk.size and o not in (a_off, b_off)
                      and (blk.size < page or o % page == 0))
        if fits:
            best = (blk.size, blk, fits[0][1])
    return None if best is None else (best[1].key, best[1].offset, best[2])


def free_ranges(blocks, span):
    out, pos = [], 0
    for b in sorted(blocks, key=lambda b: b.offset):
        if b.offset > pos:
            out.append((pos, b.offset - pos))
        pos = b.offset + b.size
    return out + ([(pos, span - pos)] if pos < span else [])


@SETTINGS
@given(layout_params, st.sampled_from([512, 1024, 2048, 4096, 8192, 32768]))
def test_plan_hole_forms_agree_with_the_reference(params, size):
    params = {**params, "tail": 0, "keep": max(params["keep"], 0.3)}
    blocks, span = make_layout(**params)
    page = params["page"]
    free = free_ranges(blocks, span)
    plan = plan_hole(blocks, free, size, page_size=page, span=span)
    expect = reference_plan_hole(blocks, free, size, page)
    keys, off, sz, movable = arrays_of(blocks)
    fo = np.array([o for o, _ in free], np.int64)
    fs = np.array([s for _, s in free], np.int64)
    arrays = plan_hole_arrays(off, sz, movable, fo, fs, size, page_size=page, span=span)
    if expect is None:
        assert plan is None and arrays is None
        return
    (m,) = plan.moves
    assert (m.key, m.src, m.dst) == expect and len(plan.waves) == 1
    assert arrays.to_plan(keys) == plan
    validate_plan(blocks, plan, span=span)  # pages_after may exceed pages_before: the free range may be on a new page
    execute(blocks, plan, span, mode="wave")
    validate_arrays(off, sz, movable, arrays, span=span)


def test_plan_hole_moves_a_large_block_only_to_a_page_boundary():
    page = 4096
    big = LiveBlock("big", page + 1024, page, True)  # between [page, +1024) and [2 * page + 1024, +1024)
    blocks = [LiveBlock("a", 0, page, False), big, LiveBlock("b", 2 * page + 2048, 2048, False),
              LiveBlock("c", 3 * page + 512, 512, False)]
    # Free: [page, +1024), [2 * page + 1024, +1024), [3 * page, +512), [3 * page + 1024, ...)
    free = free_ranges(blocks, 8 * page)
    assert free[3] == (3 * page + 1024, 5 * page - 1024)
    # The best-fitting free range [3 * page + 1024, ...) holds the block but not
    # on a page boundary: no plan (the planner of issue 12 raised PlanError).
    assert plan_hole(blocks, free, 3 * 1024, page_size=page, span=8 * page) is None
    # With a free page boundary at 4 * page it goes there.
    free = free[:3] + [(3 * page + 1024, page - 1024), (4 * page, 4 * page)]
    plan = plan_hole(blocks, free, 3 * 1024, page_size=page, span=8 * page)
    assert plan.moves == (Move("big", page + 1024, 4 * page, page),)


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
    free = [(o, n) for o, n in free_ranges([LiveBlock(i, o, s, True) for i, (o, s) in enumerate(blocks)], span)]
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
