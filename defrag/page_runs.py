"""Runs of consecutive page indices: how the vmm maps, unmaps and grants access (one call per run), how
the history names mapped ranges, and how the planner turns pages into byte intervals. Pure: numpy only."""

from __future__ import annotations

import numpy as np


def page_run_arrays(pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A sorted array of distinct page indices -> (first page, page count) of each run of consecutive
    pages, in order, as int64 arrays."""
    pages = np.asarray(pages, dtype=np.int64)
    if pages.size == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    breaks = np.flatnonzero(pages[1:] - pages[:-1] != 1)
    starts = np.concatenate(([0], breaks + 1))
    ends = np.concatenate((breaks + 1, [pages.size]))
    return pages[starts], ends - starts


def run_pages(firsts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """(first page, page count) of each run -> every page of the runs, run by run, as an int64 array
    (the inverse of `page_run_arrays`)."""
    firsts = np.asarray(firsts, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    return np.repeat(firsts - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))


def mask_runs(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A bool per page -> (starts, stops): the [start, stop) page indices of each run of True, in order,
    as int64 arrays."""
    padded = np.zeros(mask.size + 2, dtype=np.int8)
    padded[1:-1] = mask
    edges = np.flatnonzero(padded[1:] != padded[:-1])
    return edges[0::2], edges[1::2]


def page_runs(pages) -> list[tuple[int, int]]:
    """Page indices (any order, repeats allowed) -> sorted (first, count) runs of consecutive pages."""
    ordered = sorted(pages.tolist() if isinstance(pages, np.ndarray) else pages)
    if len(ordered) > 512:  # numpy's passes win over a Python loop on long lists
        first, count = page_run_arrays(np.unique(np.asarray(ordered, dtype=np.int64)))
        return list(zip(first.tolist(), count.tolist()))
    runs: list[tuple[int, int]] = []
    if not ordered:
        return runs
    first = prev = int(ordered[0])
    for p in ordered:
        if p - prev > 1:  # a gap (a repeat, p == prev, stays in the run)
            runs.append((first, int(prev) - first + 1))
            first = int(p)
        prev = p
    runs.append((first, int(prev) - first + 1))
    return runs
