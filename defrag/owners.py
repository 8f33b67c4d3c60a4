"""Owners of what PyTorch allocated in a pool: found at safe points, so those tensors move too.

Under `defrag run` / `defrag.install` every tensor of the program is a block
PyTorch's allocator placed in the pool. PyTorch holds such a block's raw
address only while an operation runs; between operations the address lives in
the storage that owns the block (a `c10::StorageImpl`), read again at each
launch, so every tensor, view, autograd saved tensor and optimizer state over
that storage follows when the compactor rewrites it.

A *safe point* is a moment when no operation is in flight on any thread that
allocates from the pool: an explicit `pool.compact()` / `defrag.compact()`,
`pool.live_tensors()`, an optimizer step's end under `defrag run --compact-at
step`, the rescue of an operation that ran out of memory (`defrag run
--rescue`). There `match(pools)` walks the objects Python's collector tracks
(one `gc.get_objects()` for all pools; the walk itself is C++,
`FastPath.match_owners`) and finds, for each PyTorch-made block, the one
storage that owns it. The match lasts for the one compaction that asked for
it (`PoolContext.owners`); outside a safe point no PyTorch-made block moves.

What never moves, each with its reason (`Pool.live_tensors()`, the OOM message):

- a block no storage reachable from Python owns: workspaces, raw allocations,
  storages held only in C++ (autograd's saved tensors whose Python tensor is
  gone, a C++ extension's own tensors);
- a block another storage covers as well: memory exported and imported back
  (`torch.from_numpy(t.numpy())`, `torch.from_dlpack`), a copy-on-write clone;
- a block whose address was handed to another library, for the rest of its
  life: `t.numpy()` / `np.asarray(t)`, DLPack (`t.__dlpack__()`,
  `torch.utils.dlpack.to_dlpack`), `__cuda_array_interface__` (numba, CuPy),
  CUDA IPC (`torch.multiprocessing`): `patch_exports()` records each;
- every PyTorch-made block while another Python thread that allocates from the
  pool is running (it may be in the middle of an operation holding addresses);
- everything inside a `with defrag.no_moves():` block, and what `pool.pin` pins.

What breaks it: code that keeps `data_ptr()` (or any raw address) of a tensor
across a safe point and uses it afterwards. docs/guide.md says so.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from . import fastpath

# books.h OwnerState and Fixed, as the native match writes them (`owner_codes`: held + 4 * fixed).
OWNED, SHARED, NOT_MATCHED_CODE = 1, 2, 3
NUMPY, DLPACK, CUDA_ARRAY_INTERFACE, IPC, GRAPH = 1, 2, 3, 4, 5

HELD_REASONS = {
    0: ("no storage reachable from Python owns it (a workspace, a raw allocation, or a storage only C++ holds, "
        "such as autograd's saved tensors whose Python tensor is gone)"),
    SHARED: ("another storage covers its bytes too (memory exported and imported back, a copy-on-write clone, "
             "or a second storage over it)"),
}
FIXED_REASONS = {
    NUMPY: "exported to numpy (t.numpy() or np.asarray(t)): the array keeps its raw address",
    DLPACK: "exported through DLPack: the consumer keeps its raw address",
    CUDA_ARRAY_INTERFACE: "exported through __cuda_array_interface__ (numba, CuPy): the consumer keeps its raw address",
    IPC: "shared with another process (CUDA IPC): that process maps its address",
    GRAPH: "used by a CUDA graph, which keeps its address",
}
NOT_MATCHED = ("made by PyTorch's allocator, and no safe point matched its owner for this compaction "
               "(pool.compact(), defrag.compact() and the rescue of an operation do)")

_no_moves_lock = threading.Lock()
_no_moves_depth = 0


@contextmanager
def no_moves():
    """With-block: no compaction, explicit or automatic, moves any tensor of any pool while it runs
    (in any thread). Pages may still be meshed or handed back: no address changes. Nests."""
    global _no_moves_depth
    with _no_moves_lock:
        _no_moves_depth += 1
    try:
        yield
    finally:
        with _no_moves_lock:
            _no_moves_depth -= 1


def moves_forbidden() -> bool:
    """Whether some thread is inside `no_moves()` now."""
    return _no_moves_depth > 0


NO_MOVES_REASON = "a defrag.no_moves() block is running"


@dataclass
class OwnerMatch:
    """What one safe point found for one pool's PyTorch-made blocks (the verdicts live in the books'
    records, read back through `fast`)."""

    fast: object = None  # the pool's native FastPath
    busy: str = ""  # another allocating Python thread that runs ("" when none)
    tensors: int = 0  # Python tensors seen (all pools)
    storages: int = 0  # distinct storages they name (all pools)
    owned: int = 0  # PyTorch-made blocks of this pool with one owner found
    owned_bytes: int = 0
    shared: int = 0
    seconds: float = 0.0  # the match's wall time (the walk included)

    def verdict(self, address: int) -> str:
        """Why the PyTorch-made block at `address` may not move ("" when it may)."""
        return self.verdicts([address])[0]

    def verdicts(self, addresses: list) -> list:
        """`verdict` of each of `addresses`, in one call to the books."""
        return [self._reason(code) for code in self.fast.owner_codes(addresses)]

    def _reason(self, code: int) -> str:
        if code < 0:
            return "not a live block of PyTorch's allocator"
        fixed, held = code >> 2, code & 3
        if fixed:
            return FIXED_REASONS.get(fixed, "exported")
        if held == NOT_MATCHED_CODE:
            return NOT_MATCHED  # placed after the match
        if held != OWNED:
            return HELD_REASONS[held]
        return self.busy


def _busy_thread() -> str:
    """The reason PyTorch-made blocks may not move because another Python thread that allocated from a
    pool still runs ("" when none does)."""
    noted = set(fastpath.module.allocating_threads()) if fastpath.module is not None else set()
    if not noted:
        return ""
    me = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not me and thread.native_id in noted and thread.is_alive():
            return (f"made by PyTorch's allocator, and thread {thread.name!r}, which allocates from the pool too, "
                    f"is running: it may be in the middle of an operation that holds this address")
    return ""


def match(pools) -> dict:
    """Find the owners of every PyTorch-made block of `pools` (pools or their contexts: an `id` and a
    `core` each) at a safe point: the caller runs no operation, and no other thread may be inside one.
    Returns {pool id: OwnerMatch}; pools without a fast path (no PyTorch-made blocks) are left out.
    Changes nothing but the books' owner records."""
    # Only pools PyTorch's allocator was made to use hold PyTorch-made blocks: the others skip the walk.
    fasts = [(p.id, p.core.fast) for p in pools
             if p.core in _watched_cores and p.core.fast is not None and not p.core.closed]
    if not fasts:
        return {}
    start = time.perf_counter()
    busy = _busy_thread()
    objects = gc.get_objects()
    try:
        out = {}
        for pool_id, fast in fasts:
            tensors, storages, owned, owned_bytes, shared = fast.match_owners(objects)
            out[pool_id] = OwnerMatch(fast, busy, tensors, storages, owned, owned_bytes, shared)
    finally:
        del objects
    elapsed = time.perf_counter() - start
    for m in out.values():
        m.seconds = elapsed
    return out


# ---------------------------------------------------------------------- exports
_patched = False


_watched = weakref.WeakSet()  # the pools PyTorch's allocator was made to use (`watch`)
_watched_cores = weakref.WeakSet()  # their cores: what `match` walks for


def watch(pool) -> None:
    """`pool` may hold PyTorch-made blocks from now on (`defrag.install` calls it): safe points match
    their owners, and exports of their addresses are recorded."""
    patch_exports()
    _watched.add(pool)
    _watched_cores.add(pool.core)


def _mark(address: int, code: int) -> None:
    """The PyTorch-made block at `address`, in whichever watched pool holds it, never moves again."""
    for pool in list(_watched):
        fast = pool.core.fast
        if fast is not None and not pool.core.closed and fast.mark_fixed(address, code):
            return


def _fix(tensor, code: int) -> None:
    """Record that `tensor`'s block went to another library (never moves again). Never raises: an export
    must not fail because of defrag."""
    if not _watched:
        return
    try:
        _mark(tensor.untyped_storage().data_ptr(), code)
    except Exception:  # a tensor without storage (sparse, a wrapper subclass): nothing of ours
        pass


def patch_exports() -> None:
    """Make every export of a tensor's address that Python can see record it (`_fix`): `Tensor.numpy`
    (and so `__array__`), `Tensor.__dlpack__`, `torch.utils.dlpack.to_dlpack`,
    `Tensor.__cuda_array_interface__` and `UntypedStorage._share_cuda_`. Once per process; each export
    costs one storage lookup more. Not seen: exports made before this ran, and calls through a reference
    to one of those functions taken before it ran (`from torch.utils.dlpack import to_dlpack` before
    `defrag.install`); under `defrag run` it runs before the program's first line."""
    global _patched
    if _patched:
        return
    _patched = True
    import torch.utils.dlpack as dlpack

    def exporting(original, code):
        def export(*args, **kwargs):
            out = original(*args, **kwargs)
            if args:
                _fix(args[0], code)
            return out
        export.__name__ = getattr(original, "__name__", "export")
        export.__doc__ = getattr(original, "__doc__", None)
        export.__wrapped__ = original
        return export

    torch.Tensor.numpy = exporting(torch.Tensor.numpy, NUMPY)
    torch.Tensor.__dlpack__ = exporting(torch.Tensor.__dlpack__, DLPACK)
    for name in ("_to_dlpack", "_to_dlpack_versioned"):  # what __dlpack__ and to_dlpack call
        if hasattr(torch._C, name):
            setattr(torch._C, name, exporting(getattr(torch._C, name), DLPACK))
    dlpack.to_dlpack = exporting(dlpack.to_dlpack, DLPACK)
    if hasattr(torch, "to_dlpack"):
        torch.to_dlpack = dlpack.to_dlpack
    interface = torch.Tensor.__dict__.get("__cuda_array_interface__")
    if isinstance(interface, property) and interface.fget is not None:
        torch.Tensor.__cuda_array_interface__ = property(exporting(interface.fget, CUDA_ARRAY_INTERFACE))
    share = getattr(torch.UntypedStorage, "_share_cuda_", None)
    if share is not None:
        def share_cuda(storage, *args, **kwargs):
            out = share(storage, *args, **kwargs)
            if _watched:
                try:
                    _mark(storage.data_ptr(), IPC)
                except Exception:  # never fail the export because of defrag
                    pass
            return out
        torch.UntypedStorage._share_cuda_ = share_cuda
