"""`AllocatorSegments`: the pool's raw segments, handed to PyTorch's own allocator.

A part of `defrag.pool.Pool`, built over the pool's
`defrag.pool_context.PoolContext`: `alloc_segment`, `free_segment` and
`segments`, which `defrag.capture`'s `TorchAllocator` calls (through `Pool`)
to let PyTorch sub-allocate inside pool pages. It keeps the segments handed
out (`SegmentInfo` on their blocks) and their totals for `stats` (`totals`). A
segment belongs to no thread and never moves; its bytes count as allocated.
The contracts are the docstrings of `Pool`'s methods of the same names.

What it uses of the context: `core` (its `gate`, `release`, `drain`,
`closed`, `history`), `enter()` (the start of a mutating call),
`allocate(nbytes, compact=..., stream=...)` (the ladder) and
`release_if_idle()` (everything back to the driver once nothing lives after
`close`).
"""

from __future__ import annotations

from .core import Block
from .pool_context import SegmentInfo


class AllocatorSegments:
    """A `Pool`'s raw segments for PyTorch's allocator (see the module docstring)."""

    def __init__(self, context):
        self.context = context
        self._by_address: dict[int, Block] = {}  # address -> segment handed to PyTorch's allocator

    def alloc_segment(self, nbytes: int, stream: int = 0, *, compact: bool = True) -> int:
        nbytes = int(nbytes)
        if nbytes <= 0:
            raise ValueError(f"a segment needs at least one byte, got {nbytes}")
        context = self.context
        core = context.core
        with core.gate:
            context.enter()
            block = context.allocate(nbytes, compact=compact, stream=int(stream))
            block.info = SegmentInfo()
            block.owner, block.shared = None, True
            self._by_address[block.address] = block
            if core.history is not None:
                core.history.block_allocated(block)
            return block.address

    def free_segment(self, address: int) -> bool:
        core = self.context.core
        with core.gate:
            block = self._by_address.pop(int(address), None)
            if block is None:
                return False
            core.release(block)
            core.drain()
            if core.closed:
                self.context.release_if_idle()
            return True

    def segments(self) -> list[tuple[int, int]]:
        with self.context.core.gate:
            return sorted((b.address, b.nbytes) for b in self._by_address.values())

    def totals(self) -> dict:
        """`stats`' figures of the segments handed out (gate held): `segments` (how many) and
        `segment_bytes` (their rounded sizes)."""
        return {"segments": len(self._by_address), "segment_bytes": sum(b.size for b in self._by_address.values())}
