"""Torch glue: storages over pool memory, and rewriting a storage's data pointer.

A pool block becomes an ordinary `torch.UntypedStorage` through an *owner*
object that the storage keeps alive for exactly as long as any tensor or view
uses it. When the last one dies, PyTorch drops the owner and a `ReleaseHook`
(a weak reference to it, kept alive by the pool with the block) tells the
pool the block is free.

- Emulated device: the owner is a ctypes array over the block's host address,
  wrapped by `torch.frombuffer` (a CPU storage).
- CUDA: the owner exposes `__cuda_array_interface__`; `torch.as_tensor` makes
  a CUDA storage that holds the owner.

Moving a storage (compaction, adopt) exchanges its memory with a temporary
storage's (`swap_data`): the user's storage takes the new pointer and the new
owner, and the temporary takes the old ones, so every tensor and view of the
user's storage follows and the old block is freed when the temporary dies.
How, is `swap_mode()`:

- "native": `UntypedStorage._swap_data_ptr_` (torch >= 2.12);
- "extension": older torch; a one-function C++ extension does the same
  exchange (`defrag.storage_ext`, built on first need, never at import);
- "rebind": neither (no compiler, or `DEFRAG_NO_STORAGE_EXT=1`): a storage
  moves only when the pool knows every tensor over it (`rebind_proof`), and
  those are re-pointed with `set_` (`rebind`); views pin their blocks.

`DEFRAG_FORCE_NO_SWAP_DATA_PTR=1` ignores the native method (tests of the
old-torch paths). This module does not decide what may move; the pool does.
"""

from __future__ import annotations

import ctypes
import logging
import math
import threading
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from . import settings, storage_ext

_log = logging.getLogger("defrag")

# Whether this torch has `UntypedStorage._swap_data_ptr_` (>= 2.12). A fact about
# torch, not a policy: ask `swap_mode()` / `can_swap_storages()` what the pool may do.
NATIVE_SWAP_DATA_PTR = hasattr(torch.UntypedStorage, "_swap_data_ptr_")
# Deprecated alias of NATIVE_SWAP_DATA_PTR, kept while callers move to can_swap_storages().
HAS_SWAP_DATA_PTR = NATIVE_SWAP_DATA_PTR

# dtypes a pool hands out: anything with a fixed item size that torch can view
# raw bytes as. Quantized and sparse layouts are refused with a clear error.
_UNSUPPORTED = {getattr(torch, n) for n in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4") if hasattr(torch, n)}
# Every dtype `check_dtype` accepts (the fast path serves exactly these).
SUPPORTED_DTYPES = tuple(d for d in {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
                         if d not in _UNSUPPORTED)


class _CudaBuffer:
    """Owner of a CUDA block, seen by torch through `__cuda_array_interface__`."""

    __slots__ = ("__cuda_array_interface__", "__weakref__")

    def __init__(self, ptr: int, nbytes: int):
        # No "stream" key: the pool orders work itself; torch must not sync here.
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3, "strides": None,
        }


class ReleaseHook(weakref.ref):
    """A weak reference to a storage's owner that calls `on_release(key)` once, when the owner dies.

    The caller must keep the hook alive at least as long as the owner (the
    pool keeps it on the block): a weak reference that dies first never
    fires. Cheaper than `weakref.finalize` (no registry, no atexit pass), and
    like it never fires while the owner lives, at interpreter exit included.
    """

    __slots__ = ("on_release", "key")

    def __new__(cls, owner, on_release, key):
        self = super().__new__(cls, owner, _fire)
        self.on_release, self.key = on_release, key
        return self

    def __init__(self, owner, on_release, key):
        super().__init__(owner, _fire)


def _fire(hook: ReleaseHook) -> None:
    hook.on_release(hook.key)


def storage_over(kind: str, device: torch.device, ptr: int, nbytes: int, on_release,
                 key=None) -> tuple[torch.UntypedStorage, ReleaseHook]:
    """An UntypedStorage of `nbytes` at `ptr`, and the hook that runs `on_release(key)` when torch drops it.

    Guarantees `on_release` runs exactly once, when the last storage/tensor
    referencing this memory dies (possibly on another thread, e.g. autograd's),
    and never while anything still uses it, provided the caller keeps the
    returned hook alive until then. It must be cheap and must not take locks
    that the dying thread may hold: the pool only queues the release.
    """
    if nbytes <= 0:
        raise ValueError("a pool storage needs at least one byte")
    if kind == "emulated":
        owner = _bytes_at(ptr, nbytes)
        return torch.frombuffer(owner, dtype=torch.uint8).untyped_storage(), ReleaseHook(owner, on_release, key)
    owner = _CudaBuffer(ptr, nbytes)
    return torch.as_tensor(owner, device=device).untyped_storage(), ReleaseHook(owner, on_release, key)


def _bytes_at(ptr: int, nbytes: int):
    """A ctypes byte array over host memory at `ptr` (the emulated device's owner object)."""
    return (ctypes.c_uint8 * nbytes).from_address(ptr)


def tensor_at(kind: str, device: torch.device, ptr: int, nbytes: int, dtype: torch.dtype, shape: tuple,
              stride: tuple, on_release, key=None) -> tuple[torch.Tensor, ReleaseHook]:
    """A tensor of `shape`/`stride`/`dtype` over its own storage of `nbytes` at `ptr`, and its release hook.

    The same guarantees as `storage_over` (and the same storage), made in
    fewer steps on the emulated device: `torch.frombuffer` with the dtype
    gives the tensor at once when it is one-dimensional and dense. No
    autograd base; `nbytes` must be a multiple of the item size.
    """
    if kind == "emulated" and nbytes > 0:
        owner = _bytes_at(ptr, nbytes)
        hook = ReleaseHook(owner, on_release, key)
        t = torch.frombuffer(owner, dtype=dtype)
        if len(shape) != 1 or stride[0] != 1 or shape[0] * dtype.itemsize != nbytes:
            t.set_(t.untyped_storage(), 0, shape, stride)
        return t, hook
    storage, hook = storage_over(kind, device, ptr, nbytes, on_release, key)
    return tensor_over(storage, dtype, shape, device, stride), hook


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    if len(shape) == 1:
        return (1,)
    strides, acc = [], 1
    for dim in reversed(shape):
        strides.append(acc)
        acc *= max(dim, 1)
    return tuple(reversed(strides))


def check_shape(shape) -> tuple[int, ...]:
    """Normalize a shape; ValueError for negative, non-integer or overflowing sizes."""
    if type(shape) is int:
        shape = (shape,)
    if type(shape) is tuple and all(type(d) is int and d >= 0 for d in shape) and math.prod(shape) < 1 << 62:
        return shape  # the common case: plain non-negative ints
    if isinstance(shape, int):
        shape = (shape,)
    try:
        dims = tuple(shape)
    except TypeError:
        raise ValueError(f"shape must be an int or a sequence of ints, got {shape!r}") from None
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, int) and not (isinstance(d, torch.SymInt)):
            raise ValueError(f"shape must contain ints, got {shape!r}")
        if d < 0:
            raise ValueError(f"negative dimension {d} in shape {tuple(dims)}")
    if math.prod(dims) >= 1 << 62:
        raise ValueError(f"shape {tuple(dims)} has too many elements")
    return tuple(int(d) for d in dims)


def check_dtype(dtype) -> torch.dtype:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    if dtype in _UNSUPPORTED:
        raise TypeError(f"dtype {dtype} is not supported by the pool (quantized dtypes have no raw-byte view)")
    return dtype


def tensor_over(storage: torch.UntypedStorage, dtype: torch.dtype, shape: tuple[int, ...],
                device: torch.device, stride: tuple[int, ...] | None = None) -> torch.Tensor:
    """A tensor of `shape`/`dtype` over `storage` from byte 0 (contiguous unless `stride`; no autograd base)."""
    return torch.empty(0, dtype=dtype, device=device).set_(
        storage, 0, shape, contiguous_strides(shape) if stride is None else stride)


def weak_storage(storage: torch.UntypedStorage) -> StorageWeakRef:
    """A weak reference to the StorageImpl (not the Python wrapper, which is transient)."""
    return StorageWeakRef(storage)


def strong_storage(ref: StorageWeakRef) -> torch.UntypedStorage | None:
    """The storage behind `ref`, or None once it has died (torch's lock of the weak pointer says which)."""
    return torch.UntypedStorage._new_with_weak_ptr(ref.cdata)


def storage_use_count(storage: torch.UntypedStorage) -> int:
    """How many C++ references the StorageImpl has (tensors, Python wrappers, ...)."""
    return torch._C._storage_Use_Count(storage._cdata)


def rebind_proof(storage: torch.UntypedStorage, known: list[torch.Tensor]) -> bool:
    """Whether `known` are provably the only tensors over `storage` (the "rebind" fallback).

    True iff the StorageImpl's use count is exactly one per known tensor plus
    the caller's own `storage` reference: then no view, autograd-saved copy or
    other holder exists, and rebinding `known` with `set_` moves every user.
    """
    return bool(known) and storage_use_count(storage) == len(known) + 1


def rebind(tensors: list[torch.Tensor], new: torch.UntypedStorage) -> None:
    """Point each tensor at `new` (same offset, size, stride), keeping its autograd version.

    The fallback when `swap_mode()` is "rebind". The version counter is
    restored so autograd does not mistake the move for an in-place change.
    """
    for t in tensors:
        version = t._version
        with torch.no_grad():
            t.set_(new, t.storage_offset(), t.size(), t.stride())
        _set_version(t, version)


def _set_version(t: torch.Tensor, version: int) -> None:
    setter = torch._C._autograd._unsafe_set_version_counter
    try:
        setter((t,), (version,))  # torch >= 2.5 takes sequences
    except TypeError:
        setter(t, version)


_modes: dict[tuple[bool, bool], str] = {}  # (force old torch, extension forbidden) -> mode
_modes_lock = threading.Lock()


def swap_mode() -> str:
    """How storages are moved here: "native", "extension" or "rebind" (see the module doc).

    Computed on the first call (on torch < 2.12 that builds the extension,
    about 10-30 s once per machine and torch version, then well under a
    second per process) and cached; thread-safe. Re-evaluated when
    DEFRAG_FORCE_NO_SWAP_DATA_PTR or DEFRAG_NO_STORAGE_EXT change, so tests can
    switch paths with the environment. Logs one WARNING when it is "rebind".
    """
    key = (settings.force_no_swap_data_ptr(), settings.no_storage_ext())
    mode = _modes.get(key)
    if mode is not None:
        return mode
    with _modes_lock:
        if (mode := _modes.get(key)) is not None:
            return mode
        force_old, forbidden = key
        why_old = (f"torch {torch.__version__} lacks UntypedStorage._swap_data_ptr_" if not NATIVE_SWAP_DATA_PTR
                   else "DEFRAG_FORCE_NO_SWAP_DATA_PTR is set")
        if NATIVE_SWAP_DATA_PTR and not force_old:
            mode = "native"
        elif forbidden:
            mode = "rebind"
            _log.warning("defrag: %s and the storage-swap extension is disabled (DEFRAG_NO_STORAGE_EXT); compaction "
                         "falls back to rebinding: views and autograd-saved tensors pin their blocks. To fix: unset "
                         "DEFRAG_NO_STORAGE_EXT, or use torch >= 2.12", why_old)
        elif storage_ext.load() is not None:
            mode = "extension"
        else:
            mode = "rebind"
            _log.warning("defrag: %s and the storage-swap extension could not be built (%s); compaction falls back to "
                         "rebinding: views and autograd-saved tensors pin their blocks. To fix: install what is missing "
                         "(g++, ninja, setuptools), or use torch >= 2.12", why_old, storage_ext.failure())
        _modes[key] = mode
        return mode


def can_swap_storages() -> bool:
    """Whether any storage can be moved with all its views following (`swap_data` works)."""
    return swap_mode() != "rebind"


def _forget_swap_mode() -> None:
    """Tests: recompute `swap_mode()` (and log again) on its next call; a built extension stays loaded."""
    with _modes_lock:
        _modes.clear()


def swap_data(user: torch.UntypedStorage, other: torch.UntypedStorage, mode: str | None = None, *,
              checked: bool = False) -> None:
    """Exchange data pointers (and deleters/owners) of two same-size storages.

    Every tensor and view over `user` sees `other`'s memory afterwards and vice
    versa; sizes, version counters and autograd state are untouched. Cannot
    fail half-way: one C++ call that only exchanges fields ("native" or
    "extension" mode). RuntimeError in "rebind" mode: use `rebind` there.
    Not safe while another thread uses either storage's memory. `mode`: a
    `swap_mode()` result the caller already holds (it reads the environment).
    `checked`: the caller has already checked both storages' sizes and devices.
    """
    if not checked:
        if user.nbytes() != other.nbytes():
            raise ValueError(f"cannot swap storages of {user.nbytes()} and {other.nbytes()} bytes")
        if user.device != other.device:
            raise ValueError(f"cannot swap storages on {user.device} and {other.device}")
    mode = mode or swap_mode()
    if mode == "native":
        user._swap_data_ptr_(other)
    elif mode == "extension":
        storage_ext.swap(user, other)
    else:
        raise RuntimeError("storages cannot be swapped here (swap_mode() is 'rebind'); rebind the tensors instead")
