"""batched_move: one kernel launch that performs a whole wave of moves."""

from __future__ import annotations

import numpy as np

from ._tables import WORD, as_table, check_wave, segment_table
from .arena import arena_words


def batched_move(arena, moves, *, stream=None, validate: bool = False) -> None:
    """Copy every (src_offset, dst_offset, nbytes) of ``moves`` inside ``arena`` in ONE launch.

    ``moves`` is an integer array of shape (n, 3), offsets relative to the
    arena start; all three values must be multiples of 16 and every range must
    lie inside the arena (checked always: a bad row raises ValueError before
    anything is launched). Zero-byte moves are skipped; no moves, no launch.

    Precondition (the caller's, normally the planner's): within one wave no
    destination overlaps any source or any other destination, so the copies
    can run in any order and in parallel. A move whose own source and
    destination overlap violates it too. ``validate=True`` checks this on the
    host (O(n log n)) and raises ValueError naming the offending pair; without
    it a violating wave produces unspecified bytes in the overlapped ranges.

    Asynchronous: returns once the (small) segment table is copied and the
    kernel is enqueued on ``stream`` (a numba stream, e.g.
    ``cuda.external_stream(torch.cuda.current_stream().cuda_stream)``; None =
    the default stream). The caller synchronizes before trusting or freeing
    anything. Under the simulator the launch runs to completion before
    returning. Does not check that the arena memory is mapped.

    The segment table (24 bytes per move) is a fresh numba device array that
    is dropped on return; numba defers device frees and frees with
    cuMemFree, which does not release memory a running kernel still reads.
    """
    words, nbytes = arena_words(arena)
    table = as_table(moves, 3, "moves", nbytes)
    if validate:
        check_wave(table)
    segments, total = segment_table(table[:, 0] // WORD, table[:, 1] // WORD, table[:, 2] // WORD)
    if total == 0:
        return

    from . import _device

    stream = _device.as_stream(stream)
    blocks, threads, chunk = _device.launch_dims(total)
    d_segments = _device.cuda.to_device(segments, stream=stream)
    _device.move_kernel[blocks, threads, stream](
        words, d_segments, np.int64(segments.shape[1] - 1), np.int64(total), np.int64(chunk)
    )
