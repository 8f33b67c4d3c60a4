"""`TensorOwnership`: which tensors are the pool's, and who may use them.

A part of `defrag.pool.Pool`, built over the pool's
`defrag.pool_context.PoolContext`. It holds the lookup from a tensor to its
block (`owns`, `owns_address`, `block_of`), the per-block rules a compaction
obeys (`pin`/`unpin`), the thread hand-offs (`share`, `claim`), the CUDA
streams that delay a block's reuse (`record_stream`), and `adopt`, which
moves existing tensors into the pool (`tensors_in`: what `adopt` takes, as a
list of tensors). The threads contract these methods serve is written out in
`defrag.pool`'s docstring, their contracts on `Pool`'s methods of the same
names.

What it uses of the context: `core` (its `gate`, `owns_address`, `user`,
`free`, `history`, `books.record_stream`), `id`, `device`, `kind`,
`can_swap` and `swap_mode` (how a storage takes new memory), `enter()` (the
start of a mutating call), `allocate(nbytes)` (the ladder),
`storage_for(block, dtype, shape, origin)` (a storage over a new block, with
its `TensorInfo`) and `find(tensor)`; and, given apart, `open_pools` (every
open pool, to name the one a foreign tensor belongs to).
"""

from __future__ import annotations

import itertools
import weakref

import torch

from . import tensors as tz
from .core import Block


class TensorOwnership:
    """A `Pool`'s tensors: lookup, pins, thread hand-offs, streams and `adopt` (see the module docstring).

    Each public method is the body of `Pool`'s method of the same name, whose
    docstring states its contract; the gate is taken here.
    """

    def __init__(self, context, open_pools):
        self.context = context
        self.open_pools = open_pools

    # ------------------------------------------------------------------ lookup
    def owns_address(self, ptr: int) -> bool:
        return self.context.core.owns_address(ptr)

    def block_of(self, tensor, what: str) -> Block:
        """The live block of this pool under `tensor` (gate held), or the error that names why there is
        none for `what`: TypeError (not a tensor), ValueError (another device, another pool, no pool)."""
        context = self.context
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{what} needs a tensor, got {type(tensor).__name__}")
        if tensor.device != context.device:
            raise ValueError(f"{what}: tensor is on {tensor.device}, this pool's tensors are on {context.device}")
        block = context.find(tensor)
        if block is None:
            if (other := self._other_owner(tensor.untyped_storage().data_ptr())) is not None:
                raise ValueError(f"{what}: tensor belongs to pool #{other.id}, not pool #{context.id}")
            raise ValueError(f"{what}: tensor is not in pool #{context.id} (use pool.adopt to move it in)")
        return block

    def _other_owner(self, ptr: int):
        """The other open pool whose address space holds `ptr`, if any."""
        core = self.context.core
        return next((p for p in self.open_pools() if p.core is not core and p.owns_address(ptr)), None)

    def owns(self, tensor: torch.Tensor) -> bool:
        context = self.context
        with context.core.gate:
            context.core.drain()
            return (isinstance(tensor, torch.Tensor) and tensor.device == context.device
                    and context.find(tensor) is not None)

    # ------------------------------------------------------------------ pin / threads / streams
    def pin(self, tensor: torch.Tensor) -> None:
        with self.context.core.gate:
            self.context.enter()
            self.block_of(tensor, "pin").pins += 1

    def unpin(self, tensor: torch.Tensor) -> None:
        with self.context.core.gate:
            self.context.enter()
            block = self.block_of(tensor, "unpin")
            if block.pins == 0:
                raise ValueError("unpin: tensor is not pinned")
            block.pins -= 1

    def share(self, tensor: torch.Tensor) -> None:
        core = self.context.core
        with core.gate:
            self.context.enter()
            block = self.block_of(tensor, "share")
            core.user()
            block.owner, block.shared = None, True

    def claim(self, tensor: torch.Tensor) -> None:
        core = self.context.core
        with core.gate:
            self.context.enter()
            block = self.block_of(tensor, "claim")
            block.owner, block.shared = core.user(), False

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        context = self.context
        with context.core.gate:
            context.enter()
            block = self.block_of(tensor, "record_stream")
            if context.kind == "cuda":
                context.core.books.record_stream(block.address, block, int(stream.cuda_stream))

    # ------------------------------------------------------------------ adopt
    def adopt(self, obj):
        context = self.context
        core = context.core
        tensors = self.tensors_in(obj)
        with core.gate:
            context.enter()
            storages = {}
            s = t = new = None
            for t in tensors:
                s = t.untyped_storage()
                if s.nbytes() == 0 or context.find(t) is not None:
                    continue
                if (other := self._other_owner(s.data_ptr())) is not None:
                    raise ValueError(f"adopt: a tensor belongs to pool #{other.id}; it cannot be adopted by pool #{context.id}")
                if s.data_ptr() in storages:
                    if not context.can_swap:
                        raise ValueError("adopt: two tensors share a storage; torch < 2.12 can only adopt a storage "
                                         "whose one tensor is known (needs UntypedStorage._swap_data_ptr_)")
                    continue
                if not context.can_swap and tz.storage_use_count(s) != 2:  # `t` and `s` alone
                    raise ValueError(f"adopt: torch {torch.__version__} lacks UntypedStorage._swap_data_ptr_, and other "
                                     "tensors or views share this tensor's storage, so they could not follow it")
                storages[s.data_ptr()] = (s, t)
            placed, fresh = [], []
            try:
                for s, t in storages.values():
                    placed.append((context.allocate(s.nbytes()), s, t))
                fresh = [context.storage_for(block, t.dtype, tuple(t.shape), "adopt") for block, _, t in placed]
            except BaseException:
                for block, _, _ in placed:
                    core.free(block)
                raise
            # Past this point nothing can fail: copy, then swap pointers.
            for (block, s, _), new in zip(placed, fresh):
                new.copy_(s)
            for (block, s, t), new in zip(placed, fresh):
                if context.can_swap:
                    tz.swap_data(s, new, context.swap_mode)
                    block.info.storage_ref = tz.weak_storage(s)
                else:
                    tz.rebind([t], new)  # proven above: `t` is the storage's only tensor
                    block.info.tensors.append(weakref.ref(t))
                if core.history is not None:
                    core.history.block_allocated(block)
            del fresh, s, t, new  # the old memory goes back to its own allocator now
        return obj

    def tensors_in(self, obj) -> list[torch.Tensor]:
        """The tensors `adopt` takes from `obj` (a tensor, module, optimizer, or a list, tuple or dict of them,
        nested), checked as `adopt` checks them (ValueError, TypeError); no lock needed."""
        device = self.context.device
        if isinstance(obj, torch.Tensor):
            if obj.device != device:
                raise ValueError(f"adopt: tensor is on {obj.device}, this pool's tensors are on {device}")
            if obj.is_sparse or obj.layout != torch.strided:
                raise ValueError(f"adopt: only strided tensors can be adopted, got layout {obj.layout}")
            return _with_storage(obj, "tensor")
        if isinstance(obj, torch.nn.Module):
            found = []
            for name, t in itertools.chain(obj.named_parameters(), obj.named_buffers()):
                if t.device != device:
                    raise ValueError(f"adopt: {name} is on {t.device}, this pool's tensors are on {device}")
                found += _with_storage(t, name)
                if isinstance(t, torch.nn.Parameter) and t.grad is not None:
                    found += _with_storage(t.grad, f"{name}.grad")
            return found
        if isinstance(obj, torch.optim.Optimizer):
            found = []
            for state in obj.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.device == device and value.layout == torch.strided:
                        found += _with_storage(value, f"optimizer state {key!r}")
            return found
        if isinstance(obj, (list, tuple, dict)):
            items = obj.values() if isinstance(obj, dict) else obj
            return [t for item in items for t in self.tensors_in(item)]
        raise TypeError(f"adopt takes a tensor, an nn.Module, an optimizer, or a list, tuple or dict of them, "
                        f"got {type(obj).__name__}")


def _with_storage(t: torch.Tensor, what: str) -> list[torch.Tensor]:
    """The tensors whose storages hold `t`'s bytes: `t` itself, or for a wrapper tensor subclass, which has no
    storage of its own (DTensor, as FSDP2's `fully_shard` and tensor parallelism make them), the tensors it
    wraps (`__tensor_flatten__`: a DTensor's local shard, `t.to_local()`), which `adopt` moves, the wrapper
    following them. ValueError naming `what` for any other tensor whose storage cannot be read."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()  # may name other things too (a DTensor's device_mesh)
        inner = [(name, getattr(t, name)) for name in names]
        return [x for name, v in inner if isinstance(v, torch.Tensor) for x in _with_storage(v, f"{what}.{name}")]
    try:
        t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        raise ValueError(f"adopt: {what} is a {type(t).__name__} whose storage cannot be read (a tensor subclass "
                         "that wraps others, as DTensor does for FSDP2); adopt the tensors it wraps, e.g. "
                         "t.to_local() for a DTensor") from None
    return [t]
