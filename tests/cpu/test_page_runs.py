"""Runs of consecutive pages (`defrag.page_runs`): the one helper the vmm, the history and the planner
share."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from defrag.page_runs import mask_runs, page_run_arrays, page_runs


@given(st.lists(st.integers(0, 300), max_size=120))
def test_runs_cover_exactly_the_pages_in_order_and_never_touch(pages):
    runs = page_runs(pages)
    covered = [p for first, count in runs for p in range(first, first + count)]
    assert covered == sorted(set(pages))
    assert all(count >= 1 for _, count in runs)
    assert all(a[0] + a[1] < b[0] for a, b in zip(runs, runs[1:]))  # a gap between runs: they are maximal
    first, count = page_run_arrays(np.array(sorted(set(pages)), dtype=np.int64))
    assert list(zip(first.tolist(), count.tolist())) == runs


@given(st.lists(st.booleans(), max_size=80))
def test_a_masks_runs_are_its_true_pages_as_maximal_runs(bits):
    mask = np.array(bits, dtype=bool)
    starts, stops = mask_runs(mask)
    assert starts.dtype == stops.dtype == np.int64
    assert list(zip(starts.tolist(), (stops - starts).tolist())) == page_runs(np.flatnonzero(mask).tolist())
