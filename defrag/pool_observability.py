"""`PoolObservability`: what the pool shows of itself: counters, layout, history.

A part of `defrag.pool.Pool`, built over the pool's
`defrag.pool_context.PoolContext`: `stats`, `reset_peak_stats`,
`check_invariants`, `layout` and `record_history`. It reads the core's books
and counters and changes no block or page; the formats (PyTorch's snapshot,
the summary table, the history ring buffer) live in `defrag.stats`, which
`Pool.snapshot` and `Pool.summary` call with the pool itself. The contracts
are the docstrings of `Pool`'s methods of the same names.

What it uses of the context: `core` (its `gate`, `drain`, `stats_locked`,
`reset_peaks`, `check_invariants`, `layout`, `history`), `id`, `device` and
`update_fast()` (the fast path serves only while no history is recorded); and
of the pool's `AllocatorSegments`, given apart, `totals()`.
"""

from __future__ import annotations

from . import stats as observe


class PoolObservability:
    """A `Pool`'s counters, layout and history (see the module docstring)."""

    def __init__(self, context, segments):
        self.context = context
        self.segments = segments

    def stats(self) -> dict:
        core = self.context.core
        with core.gate:
            core.drain()
            stats = core.stats_locked()
            stats.update(self.segments.totals())
            # PyTorch's own tensors (defrag.install) moved at safe points (defrag.owners), ever.
            stats["compaction.torch_moved_tensors"] = self.context.torch_moved_blocks
            stats["compaction.torch_moved_bytes"] = self.context.torch_moved_bytes
            return stats

    def reset_peak_stats(self) -> None:
        core = self.context.core
        with core.gate:
            core.drain()
            core.reset_peaks()

    def check_invariants(self) -> None:
        core = self.context.core
        with core.gate:
            core.check_invariants()

    def layout(self) -> dict:
        context = self.context
        with context.core.gate:
            context.core.drain()
            return {"pool": context.id, "device": str(context.device), **context.core.layout()}

    def record_history(self, enabled: bool = True, *, max_entries: int = 100_000, stacks: bool = True) -> None:
        context = self.context
        core = context.core
        with core.gate:
            core.drain()
            core.history = (observe.HistoryRecorder(core, max_entries=max_entries, stacks=stacks)
                            if enabled else None)
            context.update_fast()
