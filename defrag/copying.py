"""Copying byte ranges inside a pool's device memory: the compaction's moves and the mesher's pieces. No torch.

`copy_ranges(core, stream, engine, moves)` copies (src, dst, nbytes) triples
whose destinations overlap no source, with one of `ENGINES`: "memmove" (the
emulated device's host memory), "driver" (the driver's copy, on `stream`) or
"kernel" (the batched-move kernel: on a GPU, or the simulator on the
emulated device). The caller synchronizes.
"""

from __future__ import annotations

import ctypes

import numpy as np

ENGINES = ("memmove", "driver", "kernel")


def default_engine(kind: str) -> str:
    """The copy engine a device kind uses unless told otherwise."""
    return {"cuda": "kernel", "emulated": "memmove"}.get(kind, "driver")


def copy_ranges(core, stream: int, engine: str, moves: list[tuple[int, int, int]]) -> None:
    """Copy (src, dst, nbytes) triples; no destination overlaps a source."""
    if engine == "memmove":
        for src, dst, n in moves:
            ctypes.memmove(dst, src, n)
    elif engine == "driver":
        for src, dst, n in moves:
            core.driver.copy(dst, src, n, stream)
    else:
        from .kernels import batched_move, device_arena
        base, span, rel = relative(moves)
        arena = device_arena(base, span)
        batched_move(arena, rel, stream=kernel_stream(core, stream))


def relative(moves):
    """Moves (whole 512-byte blocks) as an int64 (n, 3) table relative to the
    smallest arena covering them."""
    lo = min(min(s, d) for s, d, _ in moves)
    hi = max(max(s, d) + n for s, d, n in moves)
    lo -= lo % 512
    table = np.array([(s - lo, d - lo, n) for s, d, n in moves], dtype=np.int64)
    span = -(-(hi - lo) // 512) * 512
    return lo, span, table


def kernel_stream(core, handle: int):
    """The numba stream the kernels run on: `handle` (0: the default stream) on a GPU, None elsewhere."""
    if core.kind != "cuda":
        return None
    from numba import cuda
    return cuda.external_stream(handle) if handle else cuda.default_stream()
