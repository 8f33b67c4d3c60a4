"""fill: one kernel launch that sets byte ranges of an arena to one value."""

from __future__ import annotations

import numpy as np

from ._tables import WORD, as_table, segment_table
from .arena import arena_words


def fill(arena, ranges, value: int, *, stream=None) -> None:
    """Set every byte of each (offset, nbytes) range of ``ranges`` to ``value`` in ONE launch.

    ``ranges`` is an integer array of shape (n, 2); offsets and sizes must be
    multiples of 16 and inside the arena (ValueError otherwise, before any
    launch). ``value`` is a byte, 0..255. Ranges may overlap (they all write
    the same value). Asynchronous on ``stream`` like :func:`batched_move`; no
    non-empty ranges, no launch.
    """
    value = int(value)
    if not 0 <= value <= 0xFF:
        raise ValueError(f"value must be a byte (0..255), got {value}")
    words, nbytes = arena_words(arena)
    table = as_table(ranges, 2, "ranges", nbytes)
    offsets = table[:, 0] // WORD
    segments, total = segment_table(offsets, np.zeros_like(offsets), table[:, 1] // WORD)
    if total == 0:
        return

    from . import _device

    stream = _device.as_stream(stream)
    blocks, threads, chunk = _device.launch_dims(total)
    d_segments = _device.cuda.to_device(segments, stream=stream)
    pattern = np.uint64(value * 0x0101010101010101)
    _device.fill_kernel[blocks, threads, stream](
        words, d_segments, np.int64(segments.shape[1] - 1), np.int64(total), np.int64(chunk), pattern
    )
