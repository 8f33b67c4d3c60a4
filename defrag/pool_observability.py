"""`PoolObservability`: what the pool shows of itself: counters, layout, history, snapshots.

A part of `defrag.pool.Pool` (a mixin it inherits): `stats`,
`reset_peak_stats`, `check_invariants`, `layout`, `record_history`,
`snapshot` and `summary`. It reads the core's books and counters and changes
no block or page; the formats (PyTorch's snapshot, the summary table, the
history ring buffer) live in `defrag.stats`.

What it relies on from the `Pool`: `core` (its `gate`, `drain`,
`stats_locked`, `reset_peaks`, `check_invariants`, `layout`, `history`),
`id`, `device`, `_allocator_segments` (the pool's `AllocatorSegments`:
`totals()`) and, from its `_context` (`defrag.pool_context.PoolContext`),
`update_fast()` (the fast path serves only while no history is recorded).
"""

from __future__ import annotations

from . import stats as observe


class PoolObservability:
    """The `Pool`'s counters, layout, history and snapshots (see the module docstring)."""

    # ------------------------------------------------------------------ counters
    def stats(self) -> dict:
        """Counters and gauges; PyTorch's key grammar where PyTorch has the key.

        `allocated_bytes.all.*`: bytes in live blocks (rounded to 512);
        `reserved_bytes.all.*`: mapped physical bytes; `active_bytes.all.*`:
        allocated plus blocks released but waiting on stream events;
        `pages.{mapped,cached,total,empty}`; `stranded_bytes`: free bytes inside
        pages that hold live data (what compaction can recover);
        `largest_free_bytes`: the largest request that succeeds now without
        compaction; `fragmentation`: stranded / reserved.
        """
        with self.core.gate:
            self.core.drain()
            stats = self.core.stats_locked()
            stats.update(self._allocator_segments.totals())
            return stats

    def reset_peak_stats(self) -> None:
        """Reset every `*.peak` statistic to its current value (like `torch.cuda.reset_peak_memory_stats`)."""
        with self.core.gate:
            self.core.drain()
            self.core.reset_peaks()

    def check_invariants(self) -> None:
        """Raise AssertionError if any of DESIGN.md's pool invariants is broken (a test aid); see `Core`."""
        with self.core.gate:
            self.core.check_invariants()

    # ------------------------------------------------------------------ layout, history, snapshots
    def layout(self) -> dict:
        """A plain-dict picture of the pool (for `defrag.viz` and snapshots).

        `regions`: base, npages and a per-page state ("unmapped", "empty" for a
        mapped page holding no block, "live"); `blocks`: every block with its
        address, size (rounded), nbytes, region index, pinned, dtype, shape and
        state ("live", "retired" or "pending-free"); plus page_size, capacity
        and cached pages.
        """
        with self.core.gate:
            self.core.drain()
            return {"pool": self.id, "device": str(self.device), **self.core.layout()}

    def record_history(self, enabled: bool = True, *, max_entries: int = 100_000, stacks: bool = True) -> None:
        """Start (or stop) recording alloc/free/map/unmap/compaction events for `snapshot()`.

        `stacks`: record the Python frames that led to each allocation and OOM
        (the caller's frames, not defrag's), as `torch.cuda.memory.
        _record_memory_history(stacks="python")` does; they show in the
        trace entries and in the snapshot's blocks. Costs a few microseconds
        per allocation while recording.
        """
        with self.core.gate:
            self.core.drain()
            self.core.history = (observe.HistoryRecorder(self.core, max_entries=max_entries, stacks=stacks)
                                 if enabled else None)
            self._context.update_fast()

    def snapshot(self) -> dict:
        """The pool in the format of `torch.cuda.memory._snapshot()` (segments and device_traces)."""
        return observe.snapshot(self)

    def summary(self) -> str:
        """A human-readable table in the spirit of `torch.cuda.memory_summary()`."""
        return observe.summary(self.stats(), self)
