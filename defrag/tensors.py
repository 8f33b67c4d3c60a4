"""Torch glue: storages over pool memory, and rewriting a storage's data pointer.

A pool block becomes an ordinary `torch.UntypedStorage` through an *owner*
object that the storage keeps alive for exactly as long as any tensor or view
uses it. When the last one dies, PyTorch drops the owner and a
`weakref.finalize` on it tells the pool the block is free.

- Emulated device: the owner is a ctypes array over the block's host address,
  wrapped by `torch.frombuffer` (a CPU storage).
- CUDA: the owner exposes `__cuda_array_interface__`; `torch.as_tensor` makes
  a CUDA storage that holds the owner.

Moving a storage (compaction, adopt) uses `UntypedStorage._swap_data_ptr_`
(torch >= 2.12): the user's storage takes the new pointer and the new owner,
and a temporary storage takes the old ones, so every tensor and view of the
user's storage follows and the old block is freed when the temporary dies.
This module does not decide what may move; the pool does.
"""

from __future__ import annotations

import ctypes
import math
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef

HAS_SWAP_DATA_PTR = hasattr(torch.UntypedStorage, "_swap_data_ptr_")

# dtypes a pool hands out: anything with a fixed item size that torch can view
# raw bytes as. Quantized and sparse layouts are refused with a clear error.
_UNSUPPORTED = {getattr(torch, n) for n in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4") if hasattr(torch, n)}


class _CudaBuffer:
    """Owner of a CUDA block, seen by torch through `__cuda_array_interface__`."""

    __slots__ = ("__cuda_array_interface__", "__weakref__")

    def __init__(self, ptr: int, nbytes: int):
        # No "stream" key: the pool orders work itself; torch must not sync here.
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3, "strides": None,
        }


def storage_over(kind: str, device: torch.device, ptr: int, nbytes: int, on_release) -> torch.UntypedStorage:
    """An UntypedStorage of `nbytes` at `ptr`; `on_release()` runs when torch drops it.

    Guarantees `on_release` runs exactly once, when the last storage/tensor
    referencing this memory dies (possibly on another thread, e.g. autograd's),
    and never while anything still uses it. It must be cheap and must not take
    locks that the dying thread may hold: the pool only queues the release.
    """
    if nbytes <= 0:
        raise ValueError("a pool storage needs at least one byte")
    if kind == "emulated":
        owner = (ctypes.c_uint8 * nbytes).from_address(ptr)
        _release_with(owner, on_release)
        return torch.frombuffer(owner, dtype=torch.uint8).untyped_storage()
    owner = _CudaBuffer(ptr, nbytes)
    _release_with(owner, on_release)
    return torch.as_tensor(owner, device=device).untyped_storage()


def _release_with(owner, on_release) -> None:
    # Not at interpreter exit: tensors still alive then keep using the memory
    # until the process is gone, so their blocks must not be released early.
    weakref.finalize(owner, on_release).atexit = False


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for dim in reversed(shape):
        strides.append(acc)
        acc *= max(dim, 1)
    return tuple(reversed(strides))


def check_shape(shape) -> tuple[int, ...]:
    """Normalize a shape; ValueError for negative, non-integer or overflowing sizes."""
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
                device: torch.device) -> torch.Tensor:
    """A contiguous tensor of `shape`/`dtype` over `storage` from byte 0 (no autograd base)."""
    return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, shape, contiguous_strides(shape))


def weak_storage(storage: torch.UntypedStorage) -> StorageWeakRef:
    """A weak reference to the StorageImpl (not the Python wrapper, which is transient)."""
    return StorageWeakRef(storage)


def strong_storage(ref: StorageWeakRef) -> torch.UntypedStorage | None:
    """The storage behind `ref`, or None once it has died."""
    if ref.expired():
        return None
    return torch.UntypedStorage._new_with_weak_ptr(ref.cdata)


def storage_use_count(storage: torch.UntypedStorage) -> int:
    """How many C++ references the StorageImpl has (tensors, Python wrappers, ...)."""
    return torch._C._storage_Use_Count(storage._cdata)


def rebind_proof(storage: torch.UntypedStorage, known: list[torch.Tensor]) -> bool:
    """Whether `known` are provably the only tensors over `storage` (the torch < 2.12 fallback).

    True iff the StorageImpl's use count is exactly one per known tensor plus
    the caller's own `storage` reference: then no view, autograd-saved copy or
    other holder exists, and rebinding `known` with `set_` moves every user.
    """
    return bool(known) and storage_use_count(storage) == len(known) + 1


def rebind(tensors: list[torch.Tensor], new: torch.UntypedStorage) -> None:
    """Point each tensor at `new` (same offset, size, stride), keeping its autograd version.

    The fallback for torch without `_swap_data_ptr_`. The version counter is
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


def swap_data(user: torch.UntypedStorage, other: torch.UntypedStorage) -> None:
    """Exchange data pointers (and deleters/owners) of two same-size storages.

    Every tensor and view over `user` sees `other`'s memory afterwards and vice
    versa. Cannot fail half-way: it is one C++ call that only exchanges fields.
    """
    if user.nbytes() != other.nbytes():
        raise ValueError(f"cannot swap storages of {user.nbytes()} and {other.nbytes()} bytes")
    user._swap_data_ptr_(other)
