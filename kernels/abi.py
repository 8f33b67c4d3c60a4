"""The move kernel's launch parameters as the compiled kernel takes them (pure; no numba, no driver).

numba passes each argument of a kernel as flat 8-byte parameters: an array as
``meminfo, parent, nitems, itemsize, data, shape[ndim], strides[ndim]`` (the
first two unused: 0), an int64 as itself. So ``move_kernel(words, table, n,
total, chunk)`` with ``words`` a 1-D uint64 array and ``table`` a C-ordered
(3, m + 1) int64 array is 19 parameters (7 + 9 + 3). `MoveParams` packs them
into one buffer a `cuLaunchKernel` reads; `unpack` reads them back (the host
twin does, and tests). `kernels.image` checks the compiled entry has exactly
`PARAMS` 8-byte parameters before anything launches it this way.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

PARAMS = 19
WORDS_ITEM = 8  # the arena is passed as uint64: two items per 16-byte word
TABLE_ROWS = 3


@dataclass(frozen=True)
class Launch:
    """What one launch of the move kernel was given, read back from its parameters."""

    base: int  # the arena's first byte (words[0])
    arena_bytes: int
    table: int  # device address of the (3, m + 1) int64 segment table
    segments: int  # m
    table_strides: tuple[int, int]
    total_words: int
    chunk_words: int


class MoveParams:
    """One reusable parameter buffer: `address` is what cuLaunchKernel takes (an array of pointers to
    the 19 values), `set(...)` rewrites the values in place. Not thread-safe: one per launcher slot."""

    def __init__(self):
        self.values = (ctypes.c_uint64 * PARAMS)()
        base = ctypes.addressof(self.values)
        self.pointers = (ctypes.c_void_p * PARAMS)(*(base + 8 * i for i in range(PARAMS)))
        self.address = ctypes.addressof(self.pointers)
        v = self.values
        v[3] = WORDS_ITEM  # words: itemsize, stride
        v[6] = WORDS_ITEM
        v[10] = 8  # table: itemsize, rows, inner stride
        v[12] = TABLE_ROWS
        v[15] = 8

    def set(self, base: int, arena_bytes: int, table: int, segments: int, total_words: int, chunk_words: int) -> None:
        """The parameters of a launch over the arena [base, base + arena_bytes) (16-byte aligned, a
        multiple of 16 bytes), with the (3, segments + 1) table at device address `table`."""
        v = self.values
        items = arena_bytes // WORDS_ITEM
        v[2] = items
        v[4] = base
        v[5] = items
        cols = segments + 1
        v[9] = TABLE_ROWS * cols
        v[11] = table
        v[13] = cols
        v[14] = cols * 8
        v[16] = segments
        v[17] = total_words
        v[18] = chunk_words


def unpack(params) -> Launch:
    """The launch the 19 parameter values describe; ValueError where they are not a move kernel's
    (wrong count, item sizes, shapes or strides)."""
    p = [int(x) for x in params]
    if len(p) != PARAMS:
        raise ValueError(f"the move kernel takes {PARAMS} parameters, got {len(p)}")
    cols = p[13]
    if (p[3], p[5], p[6]) != (WORDS_ITEM, p[2], WORDS_ITEM) or p[10] != 8 or p[12] != TABLE_ROWS \
            or p[9] != TABLE_ROWS * cols or p[16] != cols - 1 or p[15] != 8:
        raise ValueError(f"not a move kernel's parameters: {p}")
    return Launch(base=p[4], arena_bytes=p[2] * WORDS_ITEM, table=p[11], segments=p[16],
                  table_strides=(p[14], p[15]), total_words=p[17], chunk_words=p[18])
