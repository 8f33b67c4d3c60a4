"""Zero-copy numba views of raw device memory, and the backend probe.

numba is imported on first use, never at module import, so ``import
defrag.kernels`` stays cheap and works on machines with neither a GPU nor the
simulator. ``NUMBA_ENABLE_CUDASIM`` is read by numba when ``numba.cuda`` is
first imported; set it before anything imports numba.cuda.
"""

from __future__ import annotations

import ctypes
import functools
import os

import numpy as np

from defrag import settings

from ._tables import WORD


class KernelUnavailableError(RuntimeError):
    """Raised when a kernel is called but neither a CUDA GPU nor the simulator is usable."""


def preload_libnvvm(path: str | None = None) -> str | None:
    """Load the libNVVM named by `path` (default: $DEFRAG_LIBNVVM) before numba does; returns its path.

    cuda.pathfinder, which numba-cuda uses, takes a libNVVM that is already
    loaded before searching site-packages, the loader path and CUDA_HOME: so
    this is how to make numba use the libNVVM of a toolkit no newer than the
    driver (a newer one emits PTX the driver rejects). A no-op when neither
    names a library; OSError when the file cannot be loaded. Called before
    the first kernel compiles.
    """
    path = path or settings.libnvvm()
    if not path:
        return None
    ctypes.CDLL(path, mode=getattr(os, "RTLD_NOW", 2) | getattr(os, "RTLD_GLOBAL", 0x100))
    return path


@functools.lru_cache(maxsize=None)
def _probe() -> tuple[bool, str]:
    """Return ``(is_simulator, why_unavailable)``; ``why_unavailable`` is "" when usable."""
    preload_libnvvm()
    from numba import cuda

    if cuda.config.ENABLE_CUDASIM:
        return True, ""
    if cuda.is_available():
        return False, ""
    return False, (
        "defrag.kernels: no usable CUDA GPU (numba.cuda.is_available() is False) and "
        "the numba CUDA simulator is off. Run on a machine with an NVIDIA driver, or "
        "set NUMBA_ENABLE_CUDASIM=1 before numba.cuda is first imported to run the "
        "kernels on the CPU simulator."
    )


def is_simulator() -> bool:
    """True when numba.cuda is the CPU simulator. Imports numba.cuda."""
    return _probe()[0]


def require_backend() -> bool:
    """Return ``is_simulator()``, or raise KernelUnavailableError if no backend is usable."""
    sim, why = _probe()
    if why:
        raise KernelUnavailableError(why)
    return sim


def device_arena(ptr: int, nbytes: int):
    """Return a 1-D uint8 numba device array viewing ``[ptr, ptr + nbytes)``.

    The view neither copies nor owns the memory: the caller keeps it alive (and
    mapped) for as long as the view and any kernel using it may touch it.

    On a GPU this is ``cuda.from_cuda_array_interface(..., owner=None,
    sync=False)`` over the device address. Under the simulator ``ptr`` is a
    host address (e.g. an emulated VMM mapping): the bytes are wrapped
    zero-copy in the simulator's ``FakeCUDAArray``, because a plain numpy
    argument would be copied into the kernel and back out, losing writes that
    alias other views of the same memory.

    Raises KernelUnavailableError without a GPU or simulator, ValueError for a
    negative size or a null pointer with a non-zero size.
    """
    ptr, nbytes = int(ptr), int(nbytes)
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if ptr == 0 and nbytes:
        raise ValueError("ptr is null")
    sim = require_backend()
    from numba import cuda

    if sim:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        if nbytes:
            host = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))
        else:
            host = np.zeros(0, dtype=np.uint8)
        return FakeCUDAArray(host)

    desc = {
        "shape": (nbytes,),
        "typestr": "|u1",
        "data": (ptr, False),
        "strides": None,
        "version": 3,
    }
    return cuda.from_cuda_array_interface(desc, owner=None, sync=False)


def arena_words(arena):
    """Return ``(words, nbytes)``: a uint64 view of the arena's whole 16-byte words.

    ``words`` has two uint64 elements per 16-byte word and is what the kernels
    take; ``nbytes`` is the addressable size (the arena size rounded down to a
    multiple of 16). The arena must be a 1-D contiguous uint8 array (as
    returned by :func:`device_arena`; under the simulator a plain uint8 numpy
    array is accepted too) starting at a 16-byte-aligned address, so that
    every 16-byte access is naturally aligned.
    """
    sim = require_backend()
    from numba import cuda

    if sim:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        host = arena._ary if isinstance(arena, FakeCUDAArray) else arena
        if not isinstance(host, np.ndarray):
            raise TypeError(f"arena must be a device_arena() view, got {type(arena).__name__}")
        if host.dtype != np.uint8 or host.ndim != 1 or not host.flags.c_contiguous:
            raise TypeError(
                f"arena must be a 1-D contiguous uint8 array, got {host.dtype} "
                f"shape {host.shape}"
            )
        ptr = host.ctypes.data
        _check_aligned(ptr)
        usable = host.shape[0] // WORD * WORD
        return FakeCUDAArray(host[:usable].view(np.uint64)), usable

    cai = getattr(arena, "__cuda_array_interface__", None)
    if cai is None:
        raise TypeError(f"arena must be a CUDA array (device_arena()), got {type(arena).__name__}")
    shape = tuple(cai["shape"])
    strides = cai.get("strides")
    if cai["typestr"] not in ("|u1", "<u1") or len(shape) != 1 or strides not in (None, (1,)):
        raise TypeError(
            f"arena must be a 1-D contiguous uint8 array, got typestr {cai['typestr']} "
            f"shape {shape} strides {strides}"
        )
    ptr = int(cai["data"][0] or 0)
    usable = shape[0] // WORD * WORD
    if usable:
        _check_aligned(ptr)
    desc = {
        "shape": (usable // 8,),
        "typestr": "<u8",
        "data": (ptr, False),
        "strides": None,
        "version": 3,
    }
    return cuda.from_cuda_array_interface(desc, owner=arena, sync=False), usable


def _check_aligned(ptr: int) -> None:
    if ptr % WORD:
        raise ValueError(f"arena start {ptr:#x} is not {WORD}-byte aligned")
