"""`AllocatorSegments`: the pool's raw segments, handed to PyTorch's own allocator.

A part of `defrag.pool.Pool` (a mixin it inherits): `alloc_segment`,
`free_segment` and `segments`, which `defrag.capture`'s `TorchAllocator`
calls to let PyTorch sub-allocate inside pool pages, and `capture` /
`release_cached`, the `Pool` entry points to that module. A segment belongs
to no thread and never moves (`SegmentInfo`, what the pool keeps on its
block); its bytes count as allocated.

What it relies on from the `Pool`: `core` (its `gate`, `release`, `drain`,
`closed`, `history`), `_segments` (address -> segment block, made by
`Pool.__init__`; `stats` reports it) and, from its `_context`
(`defrag.pool_context.PoolContext`), `enter()` (the start of a mutating
call), `allocate(nbytes, compact=...)` (the ladder) and
`release_if_idle()` (everything back to the driver once nothing lives
after `close`).
"""

from __future__ import annotations

from .capture import capture as capture_block
from .capture import release_cached as release_captured
from .pool_context import SegmentInfo


class AllocatorSegments:
    """The `Pool`'s raw segments for PyTorch's allocator (see the module docstring)."""

    # ------------------------------------------------------------------ raw segments (PyTorch's allocator)
    def alloc_segment(self, nbytes: int, stream: int = 0, *, compact: bool = True) -> int:
        """Raw device memory for PyTorch's allocator: `nbytes` in pool pages; returns its address.

        Climbs the same ladder as `empty` (empty mapped pages, stitching, then
        compacting this pool's movable tensors) and raises OutOfMemoryError
        when nothing helps. Makes no torch allocation: a compaction here only
        copies with the driver or the numba kernel and swaps storages. The
        segment belongs to no thread and never moves; `free_segment` gives it
        back. `stream`: the CUDA stream PyTorch allocates it for. `compact`:
        False stops the ladder before compacting (see `defrag.capture`).
        """
        nbytes = int(nbytes)
        if nbytes <= 0:
            raise ValueError(f"a segment needs at least one byte, got {nbytes}")
        with self.core.gate:
            self._context.enter()
            block = self._context.allocate(nbytes, compact=compact, stream=int(stream))
            block.info = SegmentInfo()
            block.owner, block.shared = None, True
            self._segments[block.address] = block
            if self.core.history is not None:
                self.core.history.block_allocated(block)
            return block.address

    def free_segment(self, address: int) -> bool:
        """Give back a segment from `alloc_segment`; False (and nothing changes) if `address` is not one.

        Works after `close()` too (PyTorch may free its cached segments late).
        On CUDA the range is reused at once on the segment's stream; another stream waits for it on the
        device first (the books' fence).
        """
        with self.core.gate:
            block = self._segments.pop(int(address), None)
            if block is None:
                return False
            self.core.release(block)
            self.core.drain()
            if self.core.closed:
                self._context.release_if_idle()
            return True

    def segments(self) -> list[tuple[int, int]]:
        """(address, bytes) of every segment handed to PyTorch's allocator and not given back."""
        with self.core.gate:
            return sorted((b.address, b.nbytes) for b in self._segments.values())

    # ------------------------------------------------------------------ PyTorch's own allocations
    def capture(self, *, allocator=None):
        """`with pool.capture():` routes this thread's PyTorch CUDA allocations to pool pages (see `defrag.capture`)."""
        return capture_block(self, allocator=allocator)

    def release_cached(self) -> int:
        """Hand back to the pool the segments PyTorch caches for `capture()` blocks and no longer uses, through
        every allocator the pool was captured with (`defrag.capture.release_cached`); their bytes."""
        return release_captured(self)
