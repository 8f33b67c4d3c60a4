"""`TensorOwnership`: which tensors are the pool's, and who may use them.

A part of `defrag.pool.Pool` (a mixin it inherits; no object of this class
alone makes sense). It holds the lookup from a tensor to its block (`owns`,
`owns_address`), the per-block rules a compaction obeys (`pin`/`unpin`),
the thread hand-offs (`share`, `claim`), the CUDA streams that delay a
block's reuse (`record_stream`), and `adopt`, which moves existing tensors
into the pool. The threads contract these methods serve is written out in
`defrag.pool`'s docstring.

What it relies on from the `Pool`: `core` (its `gate`, `owns_address`,
`user`, `free`, `history`), `device`, `kind`, `id`, `_other_owner(ptr)`
(the other open pool holding an address) and, from its `_context`
(`defrag.pool_context.PoolContext`), `can_swap` and `swap_mode` (how a
storage takes new memory), `enter()` (the start of a mutating call),
`allocate(nbytes)` (the ladder), `storage_for(block, dtype, shape,
origin)` (a storage over a new block, with its `TensorInfo`) and
`find(tensor)` (the block under a tensor).
"""

from __future__ import annotations

import itertools
import weakref

import torch

from . import tensors as tz
from .core import Block


class TensorOwnership:
    """The `Pool`'s tensors: lookup, pins, thread hand-offs, streams and `adopt` (see the module docstring)."""

    # ------------------------------------------------------------------ lookup
    def owns_address(self, ptr: int) -> bool:
        """Whether `ptr` lies in this pool's virtual address space."""
        return self.core.owns_address(ptr)

    def _require_own(self, tensor, what: str) -> Block:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{what} needs a tensor, got {type(tensor).__name__}")
        if tensor.device != self.device:
            raise ValueError(f"{what}: tensor is on {tensor.device}, this pool's tensors are on {self.device}")
        block = self._context.find(tensor)
        if block is None:
            if (other := self._other_owner(tensor.untyped_storage().data_ptr())) is not None:
                raise ValueError(f"{what}: tensor belongs to pool #{other.id}, not pool #{self.id}")
            raise ValueError(f"{what}: tensor is not in pool #{self.id} (use pool.adopt to move it in)")
        return block

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor`'s storage is a live block of this pool."""
        with self.core.gate:
            self.core.drain()
            return isinstance(tensor, torch.Tensor) and tensor.device == self.device and self._context.find(tensor) is not None

    # ------------------------------------------------------------------ pin / threads / streams
    def pin(self, tensor: torch.Tensor) -> None:
        """Keep `tensor`'s storage where it is: compaction never moves a pinned block.

        Pins count: each `pin` needs an `unpin`. Pinning a tensor that is not
        in this pool raises ValueError and changes nothing.
        """
        with self.core.gate:
            self._context.enter()
            self._require_own(tensor, "pin").pins += 1

    def unpin(self, tensor: torch.Tensor) -> None:
        """Undo one `pin`. ValueError if the tensor is not pinned."""
        with self.core.gate:
            self._context.enter()
            block = self._require_own(tensor, "unpin")
            if block.pins == 0:
                raise ValueError("unpin: tensor is not pinned")
            block.pins -= 1

    def share(self, tensor: torch.Tensor) -> None:
        """Declare that several threads use `tensor`: no thread owns its block any more.

        A shared block is never moved by a compaction that other running
        threads could overlap (the default, or `threads="own"`); it moves only
        when no other thread that used the pool runs. Use it for tensors
        handed to other threads that keep using them (weights read by worker
        threads, a cache filled by one thread and read by another). `claim`
        undoes it.
        """
        with self.core.gate:
            self._context.enter()
            block = self._require_own(tensor, "share")
            self.core.user()
            block.owner, block.shared = None, True

    def claim(self, tensor: torch.Tensor) -> None:
        """Make the calling thread the only user of `tensor`: its own compactions may move it.

        For hand-offs: a batch made by a loader thread and from now on used only
        by this one, or a shared tensor no other thread touches any more. The
        previous owner's compactions stop moving it.
        """
        with self.core.gate:
            self._context.enter()
            block = self._require_own(tensor, "claim")
            block.owner, block.shared = self.core.user(), False

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        """Declare that `tensor` is used on `stream`: its block is reused only after
        that stream's work queued before the free has completed (CUDA). A no-op
        on the emulated device, where every operation is synchronous."""
        with self.core.gate:
            self._context.enter()
            block = self._require_own(tensor, "record_stream")
            if self.kind == "cuda":
                self.core.books.record_stream(block.address, block, int(stream.cuda_stream))

    # ------------------------------------------------------------------ adopt
    def adopt(self, obj):
        """Move existing data into the pool, keeping the caller's objects.

        - a tensor: its storage is rewritten in place (the same Python object;
          every view follows) to point at pool memory holding the same bytes;
        - an `nn.Module`: its parameters (the same Parameter objects), buffers
          and existing `.grad`s;
        - an optimizer: its state tensors (on this pool's device; others, such
          as Adam's CPU `step` next to CUDA parameters, stay where they are);
        - a list, tuple or dict (a state dict, a KV cache) of any of these,
          nested as deep as you like.

        All or nothing: every block is placed before any storage is rewritten,
        so an out-of-memory error leaves every tensor where it was. Storages
        already in this pool are left alone; storages in another pool, or
        tensors on another device (for a tensor or module), raise ValueError.
        Returns `obj`.
        """
        tensors = self._adoptable(obj)
        with self.core.gate:
            self._context.enter()
            storages = {}
            s = t = new = None
            for t in tensors:
                s = t.untyped_storage()
                if s.nbytes() == 0 or self._context.find(t) is not None:
                    continue
                if (other := self._other_owner(s.data_ptr())) is not None:
                    raise ValueError(f"adopt: a tensor belongs to pool #{other.id}; it cannot be adopted by pool #{self.id}")
                if s.data_ptr() in storages:
                    if not self._context.can_swap:
                        raise ValueError("adopt: two tensors share a storage; torch < 2.12 can only adopt a storage "
                                         "whose one tensor is known (needs UntypedStorage._swap_data_ptr_)")
                    continue
                if not self._context.can_swap and tz.storage_use_count(s) != 2:  # `t` and `s` alone
                    raise ValueError(f"adopt: torch {torch.__version__} lacks UntypedStorage._swap_data_ptr_, and other "
                                     "tensors or views share this tensor's storage, so they could not follow it")
                storages[s.data_ptr()] = (s, t)
            placed, fresh = [], []
            try:
                for s, t in storages.values():
                    placed.append((self._context.allocate(s.nbytes()), s, t))
                fresh = [self._context.storage_for(block, t.dtype, tuple(t.shape), "adopt") for block, _, t in placed]
            except BaseException:
                for block, _, _ in placed:
                    self.core.free(block)
                raise
            # Past this point nothing can fail: copy, then swap pointers.
            for (block, s, _), new in zip(placed, fresh):
                new.copy_(s)
            for (block, s, t), new in zip(placed, fresh):
                if self._context.can_swap:
                    tz.swap_data(s, new, self._context.swap_mode)
                    block.info.storage_ref = tz.weak_storage(s)
                else:
                    tz.rebind([t], new)  # proven above: `t` is the storage's only tensor
                    block.info.tensors.append(weakref.ref(t))
                if self.core.history is not None:
                    self.core.history.block_allocated(block)
            del fresh, s, t, new  # the old memory goes back to its own allocator now
        return obj

    def _adoptable(self, obj) -> list[torch.Tensor]:
        if isinstance(obj, torch.Tensor):
            if obj.device != self.device:
                raise ValueError(f"adopt: tensor is on {obj.device}, this pool's tensors are on {self.device}")
            if obj.is_sparse or obj.layout != torch.strided:
                raise ValueError(f"adopt: only strided tensors can be adopted, got layout {obj.layout}")
            return [obj]
        if isinstance(obj, torch.nn.Module):
            found = []
            for name, t in itertools.chain(obj.named_parameters(), obj.named_buffers()):
                if t.device != self.device:
                    raise ValueError(f"adopt: {name} is on {t.device}, this pool's tensors are on {self.device}")
                found.append(t)
                if isinstance(t, torch.nn.Parameter) and t.grad is not None:
                    found.append(t.grad)
            return found
        if isinstance(obj, torch.optim.Optimizer):
            found = []
            for state in obj.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor) and value.device == self.device and value.layout == torch.strided:
                        found.append(value)
            return found
        if isinstance(obj, (list, tuple, dict)):
            items = obj.values() if isinstance(obj, dict) else obj
            return [t for item in items for t in self._adoptable(item)]
        raise TypeError(f"adopt takes a tensor, an nn.Module, an optimizer, or a list, tuple or dict of them, "
                        f"got {type(obj).__name__}")
