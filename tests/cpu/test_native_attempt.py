"""The native planner region (defrag/native/plan_attempt.h) against its Python model.

`plan_arrays` runs `_Planner`'s page bookkeeping, attempts and waves in C++
(`PlanRegion`); `_plan_arrays(..., native_attempts=False)` runs the numpy
model (`_init_python`, `attempt_python`, `waves_python`). Compactions must
make byte for byte the plans the model makes, so every example asserts that
both give the same ArrayPlan: every move array and every figure.
`test_the_examples_take_every_path` checks that the layouts reach the paths
that matter (drops, retries, rounds after wave 1, zone pages, the mapped
hint, regions too sparse for a page table), else the equality would not
cover them.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import defrag.planner as planner
from defrag.planner import plan_arrays

from .test_planner import canonical, layout_params, make_layout

SETTINGS = settings(deadline=None, max_examples=200, suppress_health_check=[HealthCheck.too_slow])
A = 512


def both(offsets, sizes, movable, *, page_size, span, max_new_pages=None, mapped=None):
    """The native plan, asserted identical to the model's, field by field."""
    kw = dict(page_size=page_size, span=span, max_new_pages=max_new_pages, mapped=mapped)
    got = plan_arrays(offsets, sizes, movable, **kw)
    want = planner._plan_arrays(offsets, sizes, movable, alignment=planner.ALIGNMENT, native_attempts=False, **kw)
    for name in planner._MOVE_ARRAYS:
        g, w = getattr(got, name), getattr(want, name)
        assert g.dtype == w.dtype == np.int64 and np.array_equal(g, w), f"{name} differs"
    figures = ("page_size", "pages_before", "pages_after", "moved_bytes", "pages_lower_bound", "hole")
    assert [getattr(got, f) for f in figures] == [getattr(want, f) for f in figures]
    assert got == want
    return got


def random_layout(seed: int):
    """Blocks of mixed sizes (some of a page or more, some pinned) over a region with untouched pages,
    some of them mapped; the page size, span, budget and hint vary with the seed."""
    rng = np.random.default_rng(seed)
    page = int(rng.choice([4096, 16384, 65536, 2 << 20]))
    g = page // A
    pages = int(rng.integers(1, 120))
    style = rng.choice(["tiny", "small", "mixed", "coarse", "equal"])
    unit = int(rng.integers(1, max(2, g // 4)))
    out, off, limit = [], 0, pages * page
    while True:
        if rng.random() < 0.03:
            size = page * int(rng.integers(1, 3)) + A * int(rng.integers(0, g))
            off = -(-off // page) * page if rng.random() < 0.7 else off
        elif style == "tiny":
            size = A * int(rng.integers(1, 3))
        elif style == "small":
            size = A * int(rng.integers(1, max(2, g // 8)))
        elif style == "mixed":
            size = A * int(rng.choice([1, 2, 3, max(1, g // 4), max(1, g // 2), g - 1]))
        elif style == "coarse":
            size = A * int(rng.integers(1, g))
        else:
            size = A * unit
        if off + size > limit:
            break
        out.append((off, size))
        off += size + (A * int(rng.integers(1, g)) if rng.random() < 0.05 else 0)
    keep = rng.random(len(out)) < rng.uniform(0.05, 0.9)
    rows = [r for r, k in zip(out, keep) if k] or out[:1]
    perm = rng.permutation(len(rows))
    offsets = np.array([rows[i][0] for i in perm], np.int64)
    sizes = np.array([rows[i][1] for i in perm], np.int64)
    movable = rng.random(len(rows)) >= rng.choice([0.0, 0.0, 0.05, 0.3])
    extra = int(rng.choice([0, 1, 5, 40]))
    if rng.random() < 0.1:
        extra = 9 * pages + (1 << 16)  # too sparse for a page table: binary searches
    span = (pages + extra) * page
    max_new_pages = rng.choice([None, 0, 1, 3, 1000])
    mapped = None
    if rng.random() < 0.5:
        mapped = rng.random(span // page) < rng.uniform(0.1, 0.9)
    return offsets, sizes, movable, dict(page_size=page, span=span, max_new_pages=max_new_pages, mapped=mapped)


@pytest.mark.parametrize("seed", range(300))
def test_random_layouts_plan_as_the_model(seed):
    offsets, sizes, movable, kw = random_layout(seed)
    both(offsets, sizes, movable, **kw)


@SETTINGS
@given(layout_params, st.sampled_from([None, 0, 1, 3]), st.booleans(), st.integers(0, 2**32 - 1))
def test_planner_test_layouts_plan_as_the_model(params, max_new_pages, hinted, seed):
    lay = make_layout(**params)
    mapped = np.random.default_rng(seed).random(lay.span // params["page"]) < 0.5 if hinted else None
    both(lay.offsets, lay.sizes, lay.movable, page_size=params["page"], span=lay.span,
         max_new_pages=max_new_pages, mapped=mapped)


@pytest.mark.parametrize("pages, page, per_page, live", [(4, 2 << 20, 8, 3), (64, 65536, 16, 5), (300, 16384, 4, 1)])
def test_canonical_layouts_plan_as_the_model(pages, page, per_page, live):
    lay = canonical(7, page=page, pages=pages, per_page=per_page, live_per_page=live)
    assert len(both(lay.offsets, lay.sizes, lay.movable, page_size=page, span=lay.span))


@pytest.mark.parametrize("n, seed, max_new_pages", [(900, 0, None), (900, 0, 0), (5000, 1, None), (20000, 2, 0)])
def test_bench_layouts_plan_as_the_model(n, seed, max_new_pages):
    from defrag.benchmarks.bench_planner import PAGE, fragmented_arrays

    _, off, size, movable, span = fragmented_arrays(n, seed)
    assert len(both(off, size, movable, page_size=PAGE, span=span, max_new_pages=max_new_pages))


def test_empty_and_compact_layouts_plan_as_the_model():
    page = 65536
    z = np.zeros(0, np.int64)
    assert both(z, z, np.zeros(0, bool), page_size=page, span=4 * page).empty
    assert both(np.array([0, A]), np.array([A, A]), np.ones(2, bool), page_size=page, span=4 * page).empty


def test_the_examples_take_every_path(monkeypatch):
    """The model, run on the random layouts, drops kept pages, retries, places in later rounds, opens
    zone pages, uses the hint and plans without page tables: the equality above covers those paths."""
    seen = dict.fromkeys(["drop", "retry", "round 3+", "zone page", "mapped", "no page table"], 0)
    drop, attempt = planner._Planner._drop, planner._Planner.attempt_python

    def counting_drop(self, kept, *rest):
        before = int(kept.sum())
        out = drop(self, kept, *rest)
        seen["drop"] += int(kept.sum()) < before
        return out

    def counting_attempt(self, kept):
        r = attempt(self, kept)
        self.attempts = getattr(self, "attempts", 0) + 1
        seen["retry"] += self.attempts > 1
        seen["round 3+"] += r.rounds >= 3
        seen["zone page"] += bool(r.dst.size and (~np.isin(r.dst // self.P, self.touched)).any())
        seen["no page table"] += self.tpos is None
        return r

    monkeypatch.setattr(planner._Planner, "_drop", counting_drop)
    monkeypatch.setattr(planner._Planner, "attempt_python", counting_attempt)
    for seed in range(300):
        offsets, sizes, movable, kw = random_layout(seed)
        seen["mapped"] += kw["mapped"] is not None and kw["max_new_pages"] != 0
        planner._plan_arrays(offsets, sizes, movable, alignment=A, native_attempts=False, **kw)
    assert all(seen.values()), seen
