"""Host-side preparation of kernel work tables (pure numpy; no numba, no torch).

Everything here runs before a launch: argument checks that guard against
corrupting memory outside the arena, the optional wave-precondition check, and
the flat segment table the kernels split into chunks.
"""

from __future__ import annotations

import numpy as np

#: Every offset and size handed to the kernels is a multiple of this (bytes).
WORD = 16


def as_table(rows, ncols: int, what: str, arena_bytes: int) -> np.ndarray:
    """Return ``rows`` as a C-contiguous int64 (n, ncols) array after checking it.

    Checks shape, integer dtype, non-negative values, 16-byte multiples, and that
    every described range ``[offset, offset + nbytes)`` (offset columns are all
    but the last; nbytes is the last column) lies inside the arena's
    ``arena_bytes`` bytes. Raises ValueError naming the first bad row; does not
    check overlaps (see :func:`check_wave`).
    """
    arr = np.asarray(rows)
    if arr.size == 0:
        return np.zeros((0, ncols), dtype=np.int64)
    if arr.ndim != 2 or arr.shape[1] != ncols:
        raise ValueError(f"{what} must have shape (n, {ncols}), got {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{what} must be integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{what} has values beyond int64")
    table = np.ascontiguousarray(arr, dtype=np.int64)

    bad = np.nonzero((table < 0).any(axis=1))[0]
    if bad.size:
        raise ValueError(f"{what} row {bad[0]} has a negative value: {table[bad[0]].tolist()}")
    bad = np.nonzero((table % WORD != 0).any(axis=1))[0]
    if bad.size:
        raise ValueError(
            f"{what} row {bad[0]} is not a multiple of {WORD} bytes: {table[bad[0]].tolist()}"
        )
    nbytes = table[:, -1]
    for col in range(ncols - 1):
        bad = np.nonzero(table[:, col] > arena_bytes - nbytes)[0]
        if bad.size:
            raise ValueError(
                f"{what} row {bad[0]} {table[bad[0]].tolist()} runs past the end of the "
                f"arena ({arena_bytes} bytes)"
            )
    return table


def check_wave(moves: np.ndarray) -> None:
    """Raise ValueError unless no destination overlaps any source or other destination.

    ``moves`` is a checked int64 (n, 3) table of (src, dst, nbytes). Ranges are
    half-open, so a destination that starts exactly where a source ends is fine.
    Sources may overlap each other (they are only read). Zero-byte moves touch
    nothing and are ignored. The message names the first offending pair found
    in address order (a move whose own source and destination overlap is
    reported as overlapping itself). O(n log n).
    """
    live = np.nonzero(moves[:, 2] > 0)[0]
    if live.size == 0:
        return
    m = moves[live]
    starts = np.concatenate([m[:, 0], m[:, 1]])
    ends = starts + np.concatenate([m[:, 2], m[:, 2]])
    is_dst = np.concatenate([np.zeros(live.size, bool), np.ones(live.size, bool)])
    index = np.concatenate([live, live])

    order = np.argsort(starts, kind="stable")
    starts, ends, is_dst, index = starts[order], ends[order], is_dst[order], index[order]

    # Intervals are sorted by start, so interval i overlaps an earlier one iff
    # that one ends after starts[i]; only the running maximum end matters.
    def prior_max(values: np.ndarray) -> np.ndarray:
        running = np.maximum.accumulate(values)
        return np.concatenate([[np.iinfo(np.int64).min], running[:-1]])

    prior_any = prior_max(ends)
    prior_dst = prior_max(np.where(is_dst, ends, np.iinfo(np.int64).min))
    clash = np.where(is_dst, starts < prior_any, starts < prior_dst)
    hits = np.nonzero(clash)[0]
    if hits.size == 0:
        return

    i = int(hits[0])
    earlier = np.nonzero((ends[:i] > starts[i]) & (is_dst[:i] | is_dst[i]))[0]
    j = int(earlier[0])

    def describe(k: int) -> str:
        kind = "destination" if is_dst[k] else "source"
        return f"{kind} of move {int(index[k])} [{int(starts[k])}, {int(ends[k])})"

    if index[i] == index[j]:
        raise ValueError(
            f"wave precondition violated: move {int(index[i])} overlaps itself "
            f"({describe(j)} and {describe(i)}); split it across waves"
        )
    raise ValueError(
        f"wave precondition violated: moves {int(index[j])} and {int(index[i])} overlap: "
        f"{describe(j)} and {describe(i)}"
    )


def segment_table(col_a: np.ndarray, col_b: np.ndarray, nwords: np.ndarray):
    """Build the (3, m + 1) int64 table the kernels walk.

    Row 0 holds ``col_a`` and row 1 ``col_b`` for the m segments with a non-zero
    ``nwords`` (16-byte words); row 2 is the exclusive prefix sum of their sizes
    (so ``table[2, m]`` is the total). Returns ``(table, total_words)``.
    Dropping empty segments keeps the prefix strictly increasing, which the
    kernels' binary search relies on.
    """
    keep = nwords > 0
    m = int(np.count_nonzero(keep))
    table = np.zeros((3, m + 1), dtype=np.int64)
    table[0, :m] = col_a[keep]
    table[1, :m] = col_b[keep]
    np.cumsum(nwords[keep], out=table[2, 1:])
    return table, int(table[2, m])
