"""`PoolResidency`: where the pool's bytes live: device pages, host memory, or (asleep) nowhere mapped.

A part of `defrag.pool.Pool`, built over the pool's
`defrag.pool_context.PoolContext`: the torch-facing half of `sleep`/`wake`
(every device page released, every address kept) and `offload`/`reload`
(chosen tensors' pages backed by host memory at the same addresses). It turns
the caller's tensors into blocks and hands them to `defrag.residency`, which
holds the machinery over the `Core` (torch-free). The contracts are the
docstrings of `Pool`'s methods of the same names.

What it uses of the context: `core` (its `gate`, `space`, `scope`), `mover`
(the compaction callbacks, for `offload`'s packing), `enter()` (the start of
a mutating call) and `update_fast()` (the fast path serves only while the
pool is awake); and of the pool's `TensorOwnership`, given apart,
`block_of(tensor, what)` and `tensors_in(obj)` (a tensor, module, optimizer
or container as a list of tensors).
"""

from __future__ import annotations

import torch

from . import residency
from . import tensors as tz


class PoolResidency:
    """A `Pool`'s `sleep`, `wake`, `offload` and `reload` (see the module docstring)."""

    def __init__(self, context, ownership):
        self.context = context
        self.ownership = ownership

    @property
    def asleep(self) -> bool:
        return self.context.core.space.sleeping

    def sleep(self, *, discard=(), progress: bool | None = None) -> "residency.ResidencyReport":
        context = self.context
        with context.core.gate:
            context.enter()
            blocks = [self.ownership.block_of(t, "sleep(discard=...)") for t in self._residency_tensors(discard)]
            try:
                return residency.sleep(context.core, discard=blocks, progress=progress)
            finally:
                context.update_fast()

    def wake(self, *, progress: bool | None = None) -> "residency.ResidencyReport":
        context = self.context
        with context.core.gate:
            try:
                return residency.wake(context.core, progress=progress)
            finally:
                context.update_fast()

    def offload(self, tensors, *, pack: bool = True, progress: bool | None = None) -> "residency.ResidencyReport":
        context = self.context
        core = context.core
        with core.gate:
            context.enter()
            blocks = []
            for t in self._residency_tensors(tensors):
                block = self.ownership.block_of(t, "offload")
                if block not in blocks:
                    blocks.append(block)
            keep = lambda block: tz.strong_storage(block.info.storage_ref)  # noqa: E731
            return residency.offload(core, context.mover, blocks, keep=keep, scope=core.scope(None),
                                     pack=pack, progress=progress)

    def reload(self, tensors=None, *, progress: bool | None = None) -> "residency.ResidencyReport":
        context = self.context
        with context.core.gate:
            context.enter()
            blocks = None
            if tensors is not None:
                blocks = [self.ownership.block_of(t, "reload") for t in self._residency_tensors(tensors)]
            return residency.reload(context.core, blocks, progress=progress)

    def _residency_tensors(self, obj) -> list[torch.Tensor]:
        if obj is None or (isinstance(obj, (list, tuple, dict)) and not obj):
            return []
        return self.ownership.tensors_in(obj)
