"""Runs of consecutive pages (`defrag.page_runs`): the one helper the vmm, the history and the planner
share."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from defrag.page_runs import mask_runs, page_run_arrays, page_runs, run_pages


@given(st.lists(st.integers(0, 300), max_size=120))
def test_runs_cover_exactly_the_pages_in_order_and_never_touch(pages):
    runs = page_runs(pages)
    covered = [p for first, count in runs for p in range(first, first + count)]
    assert covered == sorted(set(pages))
    assert all(count >= 1 for _, count in runs)
    assert all(a[0] + a[1] < b[0] for a, b in zip(runs, runs[1:]))  # a gap between runs: they are maximal
    first, count = page_run_arrays(np.array(sorted(set(pages)), dtype=np.int64))
    assert list(zip(first.tolist(), count.tolist())) == runs


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 3000), min_size=513, max_size=1500))
def test_long_lists_take_numpy_and_give_the_same_plain_int_runs(pages):
    """Over 512 pages `page_runs` takes numpy's passes instead of its loop: the same runs, as Python ints."""
    runs = page_runs(np.array(pages, dtype=np.int64))
    first, count = page_run_arrays(np.array(sorted(set(pages)), dtype=np.int64))
    assert runs == list(zip(first.tolist(), count.tolist()))
    assert all(type(a) is int and type(b) is int for a, b in runs)


@given(st.lists(st.booleans(), max_size=80))
def test_a_masks_runs_are_its_true_pages_as_maximal_runs(bits):
    mask = np.array(bits, dtype=bool)
    starts, stops = mask_runs(mask)
    assert starts.dtype == stops.dtype == np.int64
    assert list(zip(starts.tolist(), (stops - starts).tolist())) == page_runs(np.flatnonzero(mask).tolist())


@given(st.sets(st.integers(0, 3000), max_size=200))
def test_run_pages_gives_back_the_pages_its_runs_came_from(pages):
    ordered = np.array(sorted(pages), dtype=np.int64)
    firsts, counts = page_run_arrays(ordered)
    back = run_pages(firsts, counts)
    assert back.dtype == np.int64 and back.tolist() == ordered.tolist()
