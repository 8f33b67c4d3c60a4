"""Tests for defrag.mesh_planner: bitmaps from live pieces, and the choice of meshes over them.

A plan is checked against its promises on every input (`check_plan`): members of a group never
share a set bit, a page is in one group at most, the primary is the fullest member, the counts add
up, the cost rule holds, and no plan beats the lower bound on pages. Hypothesis draws the pages
as live pieces on small pages (128 granules) so that meshes, overlaps and ties are all common.
"""
from __future__ import annotations

import ast
import math
import pathlib
import random
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import defrag.mesh_planner as mesh_planner
from defrag.mesh_planner import MAX_COPY_PER_PAGE, MeshGroup, MeshPlan, page_bitmaps, plan_meshes

G = 512  # granule
SMALL = 128 * G  # a 64 KiB page: 128 granules, 2 words
BIG = 2 << 20  # the GPU page: 4096 granules, 64 words
SETTINGS = settings(deadline=None, max_examples=200, suppress_health_check=[HealthCheck.too_slow])


def bits(bitmaps: np.ndarray) -> np.ndarray:
    return np.unpackbits(bitmaps.view(np.uint8), axis=1, bitorder="little").sum(axis=1)


def check_plan(plan: MeshPlan, bm: np.ndarray, live: np.ndarray, *, max_copy: int = MAX_COPY_PER_PAGE) -> None:
    """Every promise of plan_meshes that does not depend on how good the plan is."""
    units = bm.shape[1] * 64
    pops = bits(bm)
    seen: set[int] = set()
    for g in plan.groups:
        assert isinstance(g, MeshGroup) and g.twins, g
        members = g.members
        assert list(g.twins) == sorted(g.twins)
        assert not seen & set(members), f"a page in two groups: {g}"
        assert len(set(members)) == len(members)
        seen |= set(members)
        union = np.zeros(bm.shape[1], dtype=np.uint64)
        for p in members:
            assert 0 < pops[p] < units, f"page {p} is empty or full but meshed"
            assert not (union & bm[p]).any(), f"page {p} overlaps another member of {g}"
            union |= bm[p]
        top = max(int(live[p]) for p in members)
        assert live[g.primary] == top and g.primary == min(p for p in members if live[p] == top), g
        assert g.copied_bytes == sum(int(live[p]) for p in g.twins)
        assert g.copied_bytes <= max_copy * len(g.twins), f"the cost rule lets {g} through"
    assert plan.freed_pages == sum(len(g.twins) for g in plan.groups)
    assert plan.copied_bytes == sum(g.copied_bytes for g in plan.groups)
    costs = [(g.copied_bytes / len(g.twins), g.primary) for g in plan.groups]
    assert costs == sorted(costs), "groups are not cheapest first"
    # Never worse than no meshing, and never better than possible: the meshed pages still hold every bit.
    held = int((pops > 0).sum())
    assert 0 <= plan.freed_pages <= held - math.ceil(int(pops.sum()) / units)
    assert plan.seconds >= 0


# ---------------------------------------------------------------- drawing pages

@st.composite
def layouts(draw, max_pages: int = 40):
    """(bitmaps, live bytes, pieces) of up to `max_pages` small pages: a few runs of granules per page,
    often repeated from an earlier page (identical pages never mesh), sometimes full or empty."""
    n = draw(st.integers(1, max_pages))
    pieces, live = [], []
    shapes: list[list[tuple[int, int]]] = []
    for p in range(n):
        kind = draw(st.sampled_from(["runs", "runs", "runs", "again", "full", "empty"]))
        if kind == "again" and shapes:
            runs = shapes[draw(st.integers(0, len(shapes) - 1))]
        elif kind == "full":
            runs = [(0, SMALL)]
        elif kind == "empty":
            runs = []
        else:
            runs = []
            for _ in range(draw(st.integers(1, 3))):
                start = draw(st.integers(0, 127)) * G + draw(st.sampled_from([0, 0, 16, 500]))
                length = draw(st.integers(1, 40 * G))
                runs.append((start, min(length, SMALL - start)))
        shapes.append(runs)
        pieces += [(p, off, ln) for off, ln in runs if ln > 0]
        live.append(sum(ln for _, ln in runs))
    bm = page_bitmaps(pieces, SMALL, G, pages=n)
    return bm, np.array(live, dtype=np.int64), pieces


# ---------------------------------------------------------------- page_bitmaps

def reference_bitmaps(pieces, page_size: int, granule: int, n: int) -> np.ndarray:
    units = page_size // granule
    flags = np.zeros((n, units), dtype=np.uint8)
    for p, off, ln in pieces:
        flags[p, off // granule:-(-(off + ln) // granule)] = 1
    return np.packbits(flags, axis=1, bitorder="little").view(np.uint64)


@SETTINGS
@given(layouts())
def test_page_bitmaps_match_a_granule_by_granule_reference(layout):
    bm, _, pieces = layout
    assert bm.dtype == np.uint64 and bm.shape[1] == SMALL // G // 64
    assert np.array_equal(bm, reference_bitmaps(pieces, SMALL, G, len(bm)))


def test_page_bitmaps_round_outward_to_the_granule():
    bm = page_bitmaps([(0, 1, 1), (1, 511, 2), (2, 512, 512), (3, 63 * G + 5, G), (4, 0, BIG)], BIG)
    assert bm.shape == (5, 64)
    assert bm[0, 0] == 1 and not bm[0, 1:].any()                # a byte inside granule 0
    assert bm[1, 0] == 0b11 and not bm[1, 1:].any()             # two bytes across granules 0 and 1
    assert bm[2, 0] == 0b10                                     # exactly granule 1
    assert bm[3, 0] == 1 << 63 and bm[3, 1] == 1 and not bm[3, 2:].any()  # across a word boundary
    assert (bm[4] == np.uint64(2**64 - 1)).all()                # the whole page
    assert page_bitmaps(np.array([[1, 0, G]]), BIG, pages=4).shape == (4, 64)
    assert page_bitmaps([], SMALL, pages=3).shape == (3, 2) and not page_bitmaps([], SMALL, pages=3).any()
    assert page_bitmaps([], SMALL).shape == (0, 2)


@pytest.mark.parametrize("piece", [(0, SMALL - G, G + 1), (0, -1, 10), (0, 0, 0), (-1, 0, 10), (3, 0, 10)])
def test_page_bitmaps_refuse_a_piece_outside_its_page(piece):
    with pytest.raises(ValueError, match="outside"):
        page_bitmaps([piece], SMALL, pages=3)


@pytest.mark.parametrize("page_size, granule", [(G * 64 * 2 + G, G), (G * 32, G), (0, G), (SMALL, 0)])
def test_page_bitmaps_refuse_a_page_that_is_not_whole_words(page_size, granule):
    with pytest.raises(ValueError, match="multiple"):
        page_bitmaps([], page_size, granule)


# ---------------------------------------------------------------- plan_meshes: promises

@SETTINGS
@given(layouts(), st.integers(1, 6), st.integers(0, 3), st.sampled_from([0, 2 * G, 8 * G, MAX_COPY_PER_PAGE]))
def test_every_plan_keeps_its_promises(layout, probes, seed, max_copy):
    bm, live, _ = layout
    plan = plan_meshes(bm, live, max_probes=probes, seed=seed, max_copy_per_page=max_copy)
    check_plan(plan, bm, live, max_copy=max_copy)


@SETTINGS
@given(layouts())
def test_a_disjoint_pair_always_yields_a_mesh_when_every_open_mesh_is_tried(layout):
    bm, live, _ = layout
    pops = bits(bm)
    cand = [p for p in range(len(bm)) if 0 < pops[p] < SMALL // G]
    pair = any(not (bm[a] & bm[b]).any() for i, a in enumerate(cand) for b in cand[i + 1:])
    plan = plan_meshes(bm, live, max_probes=len(bm))
    assert (plan.freed_pages > 0) == pair


@SETTINGS
@given(layouts(), st.integers(0, 3))
def test_the_plan_is_deterministic_and_does_not_depend_on_input_order(layout, seed):
    bm, live, _ = layout
    plan = plan_meshes(bm, live, seed=seed, max_probes=3)
    again = plan_meshes(bm.copy(), live.copy(), seed=seed, max_probes=3)
    assert (plan.groups, plan.freed_pages, plan.copied_bytes) == (again.groups, again.freed_pages, again.copied_bytes)
    perm = np.random.default_rng(seed).permutation(len(bm))
    shuffled = plan_meshes(bm[perm], live[perm], seed=seed, max_probes=3)
    assert (shuffled.freed_pages, shuffled.copied_bytes) == (plan.freed_pages, plan.copied_bytes)

    def shape(p, bmap, lv):  # groups up to interchanging identical pages and equally full members
        return Counter(tuple(sorted(int(lv[m]) for m in g.members)) for g in p.groups)
    assert shape(shuffled, bm[perm], live[perm]) == shape(plan, bm, live)


@SETTINGS
@given(layouts(), st.integers(0, 12))
def test_free_at_least_takes_the_cheapest_prefix(layout, k):
    bm, live, _ = layout
    full = plan_meshes(bm, live)
    some = plan_meshes(bm, live, free_at_least=k)
    check_plan(some, bm, live)
    assert some.groups == full.groups[:len(some.groups)], "not the cheapest groups of the full plan"
    assert some.freed_pages >= min(k, full.freed_pages)
    if some.groups:
        assert some.freed_pages - len(some.groups[-1].twins) < k, "took a group after k pages were freed"


# ---------------------------------------------------------------- plan_meshes: cases

def halves(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Even pages: the first half live (second half free); odd pages: the second half live."""
    pieces = [(p, 0 if p % 2 == 0 else BIG // 2, BIG // 2) for p in range(n)]
    return page_bitmaps(pieces, BIG), np.full(n, BIG // 2, dtype=np.int64)


def test_complementary_halves_of_32_pages_mesh_into_16_pairs():
    bm, live = halves(32)
    plan = plan_meshes(bm, live)
    check_plan(plan, bm, live)
    assert len(plan.groups) == 16 and plan.freed_pages == 16 and plan.copied_bytes == 16 * (BIG // 2)
    for g in plan.groups:
        assert len(g.twins) == 1 and (g.primary + g.twins[0]) % 2 == 1, f"{g} is not an even page and an odd one"
        assert g.primary < g.twins[0]  # equal live bytes: the lowest index keeps its page


def test_identical_pages_never_mesh():
    pieces = [(p, off, 20 * G) for p in range(50) for off in (0, 700 * G, 3000 * G)]
    bm = page_bitmaps(pieces, BIG)
    plan = plan_meshes(bm, np.full(50, 60 * G, dtype=np.int64))
    assert plan.groups == () and plan.freed_pages == 0 and plan.copied_bytes == 0


def test_full_and_empty_pages_are_never_candidates():
    # A full page, an empty one, and a page with one granule live: only the last could mesh, with nothing.
    bm = page_bitmaps([(0, 0, BIG), (2, 0, G)], BIG, pages=3)
    plan = plan_meshes(bm, np.array([BIG, 0, G]))
    assert plan.groups == ()
    # Two sparse pages beside them do mesh, and neither the full nor the empty page joins.
    bm = page_bitmaps([(0, 0, BIG), (2, 0, G), (3, G, G)], BIG, pages=4)
    plan = plan_meshes(bm, np.array([BIG, 0, G, G]))
    assert [g.members for g in plan.groups] == [(2, 3)]


def test_the_cost_rule_rejects_a_group_that_copies_too_much():
    bm, live = halves(2)
    assert plan_meshes(bm, live, max_copy_per_page=BIG // 2).freed_pages == 1  # exactly at the bound
    plan = plan_meshes(bm, live, max_copy_per_page=BIG // 2 - 1)
    assert plan.groups == () and plan.freed_pages == 0


def test_the_cost_rule_keeps_the_cheap_twins_of_a_dear_group():
    # One mesh of three: 50 % live (primary), 30 % and 10 % at disjoint offsets.
    unit = 400 * G
    bm = page_bitmaps([(0, 0, 5 * unit), (1, 5 * unit, 3 * unit), (2, 8 * unit, unit)], BIG)
    live = np.array([5 * unit, 3 * unit, unit])
    assert plan_meshes(bm, live).groups == (MeshGroup(0, (1, 2), 4 * unit),)
    assert plan_meshes(bm, live, max_copy_per_page=2 * unit).groups == (MeshGroup(0, (1, 2), 4 * unit),)  # 2 a page
    # Just under 2 units a page, the pair costs too much on average: the dearer twin goes, the cheap one stays.
    assert plan_meshes(bm, live, max_copy_per_page=2 * unit - 1).groups == (MeshGroup(0, (2,), unit),)
    assert plan_meshes(bm, live, max_copy_per_page=unit - 1).groups == ()


def test_free_at_least_picks_the_groups_that_copy_least():
    # Eight primaries live in their first half; eight twins live from the middle, each a different size.
    # Twins overlap each other and primaries overlap each other, so the meshes are (primary, twin) pairs.
    sizes = [7, 3, 5, 1, 8, 2, 6, 4]
    pieces = [(p, 0, BIG // 2) for p in range(8)] + [(8 + k, BIG // 2, s * 16 * G) for k, s in enumerate(sizes)]
    bm = page_bitmaps(pieces, BIG)
    live = np.array([BIG // 2] * 8 + [s * 16 * G for s in sizes])
    everything = plan_meshes(bm, live)
    assert everything.freed_pages == 8
    plan = plan_meshes(bm, live, free_at_least=3)
    assert plan.freed_pages == 3
    assert sorted(g.copied_bytes // (16 * G) for g in plan.groups) == [1, 2, 3]
    assert plan_meshes(bm, live, free_at_least=0).groups == ()
    assert plan_meshes(bm, live, free_at_least=100).groups == everything.groups


def test_probes_are_bounded_and_counted():
    # 300 identical pages: none fits another, so page k probes min(k, max_probes) open meshes.
    n, probes = 300, 8
    bm = page_bitmaps([(p, 0, 40 * G) for p in range(n)], SMALL)
    pops = bits(bm).astype(np.int64)
    mesh_of, made = mesh_planner._greedy(bm, pops, np.arange(n), probes, 0)
    assert made == sum(min(k, probes) for k in range(n))
    assert len(set(mesh_of.tolist())) == n


@pytest.mark.parametrize("n", [1, 2, 257, 2000])
def test_one_probe_per_page_still_gives_a_valid_plan(n):
    rng = random.Random(n)
    pieces = [(p, rng.randrange(0, 100) * G, rng.randrange(1, 28) * G) for p in range(n)]
    bm = page_bitmaps(pieces, SMALL, pages=n)
    live = bits(bm).astype(np.int64) * G
    plan = plan_meshes(bm, live, max_probes=1)
    check_plan(plan, bm, live)
    _, made = mesh_planner._greedy(bm, bits(bm).astype(np.int64), np.arange(n), 1, 0)
    assert made <= n
    if n >= 257:
        assert plan.freed_pages > 0  # even one probe finds meshes among sparse pages


def test_bad_inputs_are_refused_with_their_reason():
    bm, live = halves(4)
    with pytest.raises(ValueError, match="uint64"):
        plan_meshes(bm.astype(np.int64), live)
    with pytest.raises(ValueError, match="uint64"):
        plan_meshes(bm[0], live)
    with pytest.raises(ValueError, match="one count per page"):
        plan_meshes(bm, live[:3])
    with pytest.raises(ValueError, match="non-negative"):
        plan_meshes(bm, -live)
    with pytest.raises(ValueError, match="non-negative"):
        plan_meshes(bm, live.astype(float))
    with pytest.raises(ValueError, match="max_probes"):
        plan_meshes(bm, live, max_probes=0)
    with pytest.raises(ValueError, match="free_at_least"):
        plan_meshes(bm, live, free_at_least=-1)
    with pytest.raises(ValueError, match="max_copy_per_page"):
        plan_meshes(bm, live, max_copy_per_page=-1)
    empty = plan_meshes(np.zeros((0, 64), np.uint64), np.zeros(0, np.int64))
    assert empty.groups == () and empty.freed_pages == 0


def test_the_mesh_planner_is_pure():
    """numpy and the standard library only: the other layers import it, it imports none of them."""
    tree = ast.parse(pathlib.Path(mesh_planner.__file__).read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert names <= {"numpy", "time", "dataclasses", "__future__"}, names
