"""The native best fit (defrag/native/planner.h) against its Python model, `defrag.planner._best_fit_python`.

The planner's `_best_fit` is the native `best_fit`; plans must stay byte
for byte what the Python placement made, so every example asserts the same
int64 array from both. The model places runs of equal items and runs into a
hole of a page or more several at a time and skips items with a bisect; the
native code places one item at a time: `test_the_examples_take_every_shortcut`
checks that the generated inputs really take those shortcuts (else the
comparison would not cover them).
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

import defrag.planner as planner
from defrag.planner import _best_fit_python, plan_arrays

SETTINGS = settings(deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])


def native_best_fit():
    from defrag.native import load_module

    return load_module().best_fit


def both(hole_s, hole_e, sizes, unit, cap):
    """Both results, asserted equal (values and dtype int64)."""
    hole_s, hole_e, sizes = (np.asarray(a, dtype=np.int64) for a in (hole_s, hole_e, sizes))
    want = _best_fit_python(hole_s, hole_e, sizes, unit, cap)
    got = native_best_fit()(hole_s, hole_e, sizes, unit, cap)
    assert got.dtype == np.int64 and got.shape == want.shape
    if not np.array_equal(got, want):
        bad = np.flatnonzero(got != want)
        pytest.fail(f"{bad.size} of {sizes.size} items differ; first at item {bad[0]}: native {got[bad[0]]}, "
                    f"model {want[bad[0]]} (size {sizes[bad[0]]}, unit {unit}, cap {cap}, {hole_s.size} holes)")
    return got


# --------------------------------------------------------------------------
# Generated inputs
# --------------------------------------------------------------------------

# Caps around the model's 64-bit words (one word, two, a page of 4096 units); 1 << 23 is past the
# native dense buckets (2^22 lengths), so its examples with long holes run the native map buckets.
CAPS = [1, 2, 5, 63, 64, 65, 130, 512, 4096, 1 << 23]


def make_case(seed: int, unit: int, cap: int, n_holes: int, n_items: int, style: str):
    """(hole_s, hole_e, sizes) from a numpy generator: equal-length holes, empty ones, holes of cap or
    more, unaligned and negative bounds, runs of equal items, items of cap or more."""
    rng = np.random.default_rng(seed)
    # Hole lengths in units: a few distinct short lengths (many equal holes), any short length,
    # empty or reversed holes, holes of cap or more (a few, some long enough for prefix runs).
    few = rng.integers(1, max(cap, 2), size=3)
    kind = rng.choice(5, size=n_holes, p=[0.4, 0.3, 0.1, 0.1, 0.1] if style != "big" else [0.2, 0.2, 0.1, 0.3, 0.2])
    lens = np.where(kind == 0, few[rng.integers(0, 3, n_holes)],
           np.where(kind == 1, rng.integers(1, max(cap, 2), n_holes),
           np.where(kind == 2, rng.integers(-2, 1, n_holes),
           np.where(kind == 3, cap + rng.integers(0, 3 * cap + 1, n_holes),
                    cap + rng.integers(0, 200, n_holes) * rng.integers(1, 8, n_holes)))))
    if cap > 1 << 22:  # long enough for the native map buckets, not all of cap or more
        lens = np.where(rng.random(n_holes) < 0.3, rng.integers(1 << 22, cap + 1000, n_holes), lens % 5000)
    gaps = rng.integers(0, 4, n_holes)
    starts = np.cumsum(np.abs(lens) + gaps) - np.abs(lens)
    order = rng.permutation(n_holes) if style == "shuffled" else np.arange(n_holes)
    base = int(rng.integers(-3, 1000)) if style != "negative" else -int(rng.integers(1, 50))
    hole_s = (starts[order] + base) * unit
    hole_e = hole_s + lens[order] * unit
    if unit > 1 and style in ("unaligned", "negative"):  # bounds off the unit: both round down
        hole_s = hole_s + rng.integers(0, unit, n_holes)
        hole_e = hole_e + rng.integers(0, unit, n_holes)
    # Items in units: runs of equal lengths, some of cap or more, some short (fit many per hole).
    n_runs = max(1, n_items // int(rng.choice([1, 3, 50, 400])))
    run_lens = np.concatenate((rng.integers(1, max(cap, 2), n_runs),
                               rng.integers(1, min(cap, 4) + 1, n_runs // 2 + 1),
                               cap + rng.integers(0, 3, 2)))
    counts = rng.multinomial(n_items, rng.dirichlet(np.ones(run_lens.size)))
    units = np.repeat(run_lens, counts)
    sizes = units * unit + (rng.integers(0, unit, units.size) if unit > 1 and style == "unaligned" else 0)
    sizes = np.sort(sizes)[::-1].copy()
    return hole_s.astype(np.int64), hole_e.astype(np.int64), sizes.astype(np.int64)


cases = st.tuples(
    st.integers(0, 2**32 - 1),
    st.sampled_from([512, 1, 64]),
    st.sampled_from(CAPS),
    st.one_of(st.integers(0, 70), st.integers(60, 3000)),          # around the model's 64-hole bucketing switch
    st.one_of(st.integers(0, 100), st.integers(100, 5000)),
    st.sampled_from(["plain", "shuffled", "big", "unaligned", "negative"]),
)


@SETTINGS
@given(cases)
@example((1, 512, 4096, 900, 3000, "plain"))
@example((2, 1, 64, 65, 4000, "big"))
@example((3, 512, 1 << 23, 300, 2000, "shuffled"))
def test_native_best_fit_is_the_model(case):
    seed, unit, cap, n_holes, n_items, style = case
    both(*make_case(seed, unit, cap, n_holes, n_items, style), unit, cap)


@SETTINGS
@given(holes=st.lists(st.tuples(st.integers(-3, 40), st.integers(-2, 30)), max_size=40),
       items=st.lists(st.integers(1, 40), max_size=60),
       unit=st.sampled_from([1, 512]), cap=st.integers(1, 70))
def test_small_cases_are_the_model(holes, items, unit, cap):
    """Hypothesis-shrinkable inputs: (start, length) holes in units, item lengths in units."""
    hole_s = np.array([s * unit for s, _ in holes], np.int64)
    hole_e = np.array([(s + n) * unit for s, n in holes], np.int64)
    both(hole_s, hole_e, np.array(sorted(items, reverse=True), np.int64) * unit, unit, cap)


def test_the_examples_take_every_shortcut(monkeypatch):
    """The generated cases run the model's run placements (and its other paths), so the equality above covers them."""
    seen = {"equal run, one hole": 0, "equal run, whole holes": 0, "big hole, one item": 0,
            "big hole, prefix sum": 0}
    carve, fill = planner._carve_equal_run, planner._fill_big_hole

    def counting_carve(units, i, b, *rest):
        j, top = carve(units, i, b, *rest)
        seen["equal run, whole holes" if j - i > b // units[i] else "equal run, one hole"] += 1
        return j, top

    def counting_fill(units, units_arr, i, *rest):
        j, top, window = fill(units, units_arr, i, *rest)
        seen["big hole, prefix sum" if j - i > 1 else "big hole, one item"] += 1
        return j, top, window

    monkeypatch.setattr(planner, "_carve_equal_run", counting_carve)
    monkeypatch.setattr(planner, "_fill_big_hole", counting_fill)
    for seed in range(40):
        for style in ("plain", "big", "unaligned"):
            both(*make_case(seed, 512, 4096 if seed % 2 else 64, 900, 3000, style), 512, 4096 if seed % 2 else 64)
    assert all(seen.values()), seen


# --------------------------------------------------------------------------
# Hand-made cases
# --------------------------------------------------------------------------


def test_hand_made_cases():
    u = 512
    # Best fit: the shortest bucket; equal lengths: the last given first; remnants reused.
    assert both([0, 10 * u, 20 * u], [4 * u, 13 * u, 23 * u], [3 * u, 2 * u, 1 * u], u, 8).tolist() == [
        20 * u, 10 * u, 12 * u]
    # A hole of cap or more is carved from its front, the first given first; its remnant then joins
    # the buckets (here it is the best fit of the last item).
    assert both([100 * u, 0], [110 * u, 9 * u], [3 * u, 3 * u, 1 * u], u, 8).tolist() == [100 * u, 103 * u, 106 * u]
    # Items of cap or more are never placed; items longer than every hole neither; empty holes dropped.
    assert both([0, 50 * u], [8 * u, 50 * u], [8 * u, 5 * u, 9 * u // 2], u, 8).tolist() == [-1, 0, -1]
    # Nothing at all.
    assert both([], [], [], u, 8).tolist() == []
    assert both([], [], [u, u], u, 8).tolist() == [-1, -1]
    # Negative starts give -1 (the model's out >= 0 test) though the hole is used.
    assert both([-4 * u, 0], [0, 2 * u], [2 * u, 2 * u, 2 * u], u, 8).tolist() == [0, -1, -1]


def test_bad_arguments_raise_value_error():
    best_fit = native_best_fit()
    z = np.zeros(0, np.int64)
    one = np.array([512], np.int64)
    with pytest.raises(ValueError, match="unit"):
        best_fit(z, z, one, 0, 8)
    with pytest.raises(ValueError, match="cap"):
        best_fit(z, z, one, 512, 0)
    with pytest.raises(ValueError, match="negative"):
        best_fit(z, z, np.array([-512]), 512, 8)
    with pytest.raises(ValueError, match="non-increasing"):
        best_fit(z, z, np.array([512, 1024]), 512, 8)
    with pytest.raises(ValueError, match="same length"):
        best_fit(one, z, one, 512, 8)
    with pytest.raises(ValueError, match="1-d"):
        best_fit(z, z, np.zeros((1, 1), np.int64), 512, 8)


def test_any_integer_arrays_are_taken():
    """int32, lists and non-contiguous views convert (forcecast, c_style)."""
    s = np.arange(0, 40 * 512, 4 * 512, dtype=np.int64)
    e = s + np.arange(1, 11) * 256
    sizes = np.array([2048, 1024, 1024, 512, 512, 512], np.int64)
    want = _best_fit_python(s, e, sizes, 512, 8)
    got = native_best_fit()(s.astype(np.int32), e.tolist(), np.repeat(sizes, 2)[::2], 512, 8)
    assert np.array_equal(got, want)


# --------------------------------------------------------------------------
# Whole plans
# --------------------------------------------------------------------------


@pytest.mark.parametrize("n, seed", [(900, 0), (5000, 1), (20000, 2)])
def test_plans_are_the_same_with_the_model(monkeypatch, n, seed):
    from defrag.benchmarks.bench_planner import PAGE, fragmented_arrays

    _, off, size, movable, span = fragmented_arrays(n, seed)
    native_plan = plan_arrays(off, size, movable, page_size=PAGE, span=span)
    monkeypatch.setattr(planner, "_best_fit", _best_fit_python)
    model_plan = plan_arrays(off, size, movable, page_size=PAGE, span=span)
    assert native_plan == model_plan and len(native_plan)
