"""`retry_on_oom`: compact the pools and retry a torch operation that ran out of memory.

For code that allocates through PyTorch's own allocator as well as through
pools. Inside the context, every torch operation (forward and backward, as
dispatched to ATen or to a custom op registered with `torch.library`) runs
under a `TorchDispatchMode`. When one raises an out-of-memory error (a pool's
`defrag.OutOfMemoryError` or PyTorch's `torch.OutOfMemoryError`), the mode

1. pins the operation's tensor arguments that live in the pools (an op that
   failed half-way may already have handed their pointers to a kernel);
2. compacts and trims every pool (trim hands free pages back to the driver,
   so PyTorch's allocator can use them too);
3. unpins them and retries the operation once. A second failure propagates.

When it is unsafe: code that keeps *raw device pointers* (`data_ptr()`, a
`__cuda_array_interface__` export, a CUDA graph, a custom kernel holding an
address) across its own allocations. A compaction triggered by one of those
allocations may move the memory such a pointer refers to. Tensors themselves
are always safe: they follow their storage.

What it costs: one Python-level dispatch per operation while the context is
active (typically a few microseconds per op on top of PyTorch's own
dispatch), nothing on the happy path beyond that; a compaction only when an
operation actually fails. Use it around the steps that may OOM, not around a
whole program.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .pool import Pool, open_pools


@contextmanager
def arguments_pinned(pools, tensors):
    """With-block: each of `tensors` (a failed operation's arguments) that lives in one of `pools` pinned
    there, since the operation may already have handed its address to a kernel; unpinned after, also
    when the block raises."""
    pinned = []
    try:
        for t in tensors:
            for pool in pools:
                if pool.owns(t):
                    pool.pin(t)
                    pinned.append((pool, t))
        yield
    finally:
        for pool, t in pinned:
            pool.unpin(t)


class retry_on_oom(TorchDispatchMode):
    """Context manager: on an out-of-memory error in any torch op, compact the pools and retry once.

    `pools`: the pools to compact (default: every open pool at the time of the
    failure). `retries` and `rescues` count what happened, for inspection.
    """

    def __init__(self, *pools: Pool):
        super().__init__()
        for p in pools:
            if not isinstance(p, Pool):
                raise TypeError(f"retry_on_oom takes defrag.Pool objects, got {type(p).__name__}")
        self.pools = pools
        self.retries = 0
        self.rescues = 0

    def _pools(self) -> list[Pool]:
        return [p for p in (self.pools or open_pools()) if not p.closed]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            return func(*args, **kwargs)
        except torch.OutOfMemoryError:
            pools = self._pools()
            if not pools:
                raise
            self.retries += 1
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            with arguments_pinned(pools, tensors):
                for pool in pools:
                    pool.compact()
                    pool.trim()
        result = func(*args, **kwargs)  # a second OOM propagates to the caller
        self.rescues += 1
        return result
