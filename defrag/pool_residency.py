"""`PoolResidency`: where the pool's bytes live: device pages, host memory, or (asleep) nowhere mapped.

A part of `defrag.pool.Pool` (a mixin it inherits): the torch-facing half of
`sleep`/`wake` (every device page released, every address kept)
and `offload`/`reload` (chosen tensors' pages backed by host memory at the
same addresses). It turns the caller's tensors into blocks and hands them to
`defrag.residency`, which holds the machinery over the `Core` (torch-free).

What it relies on from the `Pool`: `core` (its `gate`, `space`, `scope`),
from its `_context` (`defrag.pool_context.PoolContext`) `mover` (the
compaction callbacks, for `offload`'s packing), `enter()` (the start of a
mutating call) and `update_fast()` (the fast path serves only while the
pool is awake), and, from its `_ownership` (`TensorOwnership`),
`block_of(tensor, what)` and `tensors_in(obj)` (a tensor, module, optimizer
or container as a list of tensors).
"""

from __future__ import annotations

import torch

from . import residency
from . import tensors as tz


class PoolResidency:
    """The `Pool`'s `sleep`, `wake`, `offload` and `reload` (see the module docstring)."""

    # ------------------------------------------------------------------ sleep / wake / offload / reload
    @property
    def asleep(self) -> bool:
        """Whether the pool sleeps (between `sleep()` and `wake()`)."""
        return self.core.space.sleeping

    def sleep(self, *, discard=(), progress: bool | None = None) -> "residency.ResidencyReport":
        """Release every device page and keep every address: tensors keep their pointers, not their memory.

        Copies the bytes of every live tensor to one pinned host buffer,
        unmaps and releases every device page (cached ones too), and keeps
        the reservations, the tensors, their views and their `data_ptr()`s.
        `wake()` maps device pages at the same addresses and copies the bytes
        back, so views, raw pointers and captured CUDA graphs stay valid.

        `discard`: tensors (or modules, lists, dicts of them, as for `adopt`)
        whose bytes need not survive, such as a KV cache: they are not
        copied and read zeros after `wake()`. `progress`: a progress bar
        (None: only above 256 MiB).

        While asleep, pool calls that need device memory (`empty`, `adopt`,
        `compact`, `pin`, `offload`, `trim`, ...) raise `PoolAsleepError`;
        `stats()`, `summary()`, `layout()`, `snapshot()`, `live_tensors()`,
        `wake()` and `close()` work. The pool cannot see kernels: touching a
        sleeping tensor reads unmapped memory (a CUDA illegal-address error on
        a GPU; zeros and a `StaleAccessError` at the next pool call on the
        emulated device). Offloaded tensors stay host-backed and usable.
        A driver fault before the last page is unmapped restores everything
        (same pages, same bytes) and raises. `ResidencyError` when already
        asleep. Returns a `ResidencyReport`.
        """
        with self.core.gate:
            self._context.enter()
            blocks = [self._ownership.block_of(t, "sleep(discard=...)") for t in self._residency_tensors(discard)]
            try:
                return residency.sleep(self.core, discard=blocks, progress=progress)
            finally:
                self._context.update_fast()

    def wake(self, *, progress: bool | None = None) -> "residency.ResidencyReport":
        """Map device pages where the pool slept and copy every kept byte back (see `sleep`).

        `ResidencyError` when the pool is awake. When the device cannot
        supply the pages (or any driver call fails) the pool stays asleep
        with every byte kept, and the error says so: call it again later.
        `StaleAccessError` (the pool still asleep, nothing changed) when a
        tensor of the pool was touched while it slept (emulated device): the
        access read zeros or lost its write, and is reported once, here.
        """
        with self.core.gate:
            try:
                return residency.wake(self.core, progress=progress)
            finally:
                self._context.update_fast()

    def offload(self, tensors, *, pack: bool = True, progress: bool | None = None) -> "residency.ResidencyReport":
        """Back these tensors' pages with host memory at the same addresses; their device pages are freed.

        The tensors stay readable and writable where they are, over the bus:
        slower, but from the offload until after the reload no pointer
        changes (views, `data_ptr()`s and captured graphs stay valid). Pages
        are the unit: tensors that share a page with tensors that stay are
        first packed into pages of their own (a compaction move: views
        follow, but a raw pointer taken before `offload` is stale; with
        `pack=False` that is a `ResidencyError` instead, nothing moved), so
        that no other tensor goes to host memory with them; the space left in
        those pages is held unused. Offloaded tensors never move; `reload(tensors)` brings their
        pages back (with every tensor on them). The pool keeps each offloaded
        tensor's storage alive until it is reloaded (or the pool closes), so
        dropping one frees its memory at the next `reload()`.

        `tensors`: a tensor, module, optimizer, or list/tuple/dict of them (as
        for `adopt`). Errors, with nothing offloaded: `ValueError` for a
        pinned tensor, or one that is not in this pool; `NotSupportedError`
        where the driver has no host-located pages (CUDA before 12.2, or a
        device without host NUMA VMM support); `PoolAsleepError` while asleep.
        Returns a `ResidencyReport`.
        """
        with self.core.gate:
            self._context.enter()
            blocks = []
            for t in self._residency_tensors(tensors):
                block = self._ownership.block_of(t, "offload")
                if block not in blocks:
                    blocks.append(block)
            keep = lambda block: tz.strong_storage(block.info.storage_ref)  # noqa: E731
            return residency.offload(self.core, self._context.mover, blocks, keep=keep, scope=self.core.scope(None),
                                     pack=pack, progress=progress)

    def reload(self, tensors=None, *, progress: bool | None = None) -> "residency.ResidencyReport":
        """Bring offloaded tensors' pages back to device memory (None: every offloaded page).

        Every tensor on those pages comes back; tensors that are not
        offloaded are left alone. Needs a free device page per page (the
        pool's capacity); `ResidencyError` otherwise, with nothing changed.
        Returns a `ResidencyReport`.
        """
        with self.core.gate:
            self._context.enter()
            blocks = None
            if tensors is not None:
                blocks = [self._ownership.block_of(t, "reload") for t in self._residency_tensors(tensors)]
            return residency.reload(self.core, blocks, progress=progress)

    def _residency_tensors(self, obj) -> list[torch.Tensor]:
        if obj is None or (isinstance(obj, (list, tuple, dict)) and not obj):
            return []
        return self._ownership.tensors_in(obj)
