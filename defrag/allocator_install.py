"""Make a pool PyTorch's allocator for the whole process: `install`, `install_cuda`, `CudaInstall`.

`install(pool)` by the pool's device:

- emulated: PyTorch's CPU allocator (`defrag.cpu_allocator`, native, undone
  by `uninstall()`);
- CUDA (`install_cuda`): `torch.cuda.memory.change_current_allocator`,
  process-wide, before PyTorch's first CUDA allocation: every CUDA tensor is
  one pool block. Natively (`CudaInstall`): defrag's CUDA allocator backend
  (`defrag.cuda_backend`, a `CUDAAllocator` that answers PyTorch's
  statistics, snapshots and graphs from the pool) where it can be built,
  else PyTorch's `CUDAPluggableAllocator` over the entry points
  `defrag_cuda_alloc` / `defrag_cuda_free` of defrag's own native module
  (`native/cuda_allocator.cpp`, found by the loaded module's path,
  `native_library()`); both over the pool's native books, sharing the CPU
  allocator's ladder (`native/pool_allocator.h`): no Python on the hot
  path, and a request the pool cannot serve raises torch.OutOfMemoryError
  with the pool's explained OOM. A pool without the native fast path falls
  back to `defrag.capture`'s ctypes `TorchAllocator`, where PyTorch does
  not check for NULL: a failed allocation there is a crash later, not an
  exception.

What PyTorch is handed lives as long as the process (`capture.keep_for_process`:
it keeps raw pointers), and a pool a route serves is kept alive by its `CudaInstall`.
The state here (which route serves which device, what PyTorch's CUDA
allocator is now) is process-wide, under `_registry`. This module imports no
`defrag.pool`: it sees a pool through its public attributes and its native
FastPath (`pool.core.fast`), as `defrag.cpu_allocator` does.
"""

from __future__ import annotations

import logging
import threading

import torch

from .capture import TorchAllocator, keep_for_process, require_cuda
from .errors import PoolClosedError

__all__ = ["CudaInstall", "install", "install_cuda", "installed", "native_library", "register_native", "uninstall"]

_log = logging.getLogger("defrag")

_registry = threading.Lock()
_installed: TorchAllocator | None = None  # the ctypes fallback, when it is PyTorch's CUDA allocator


class _Handle:
    """What `torch.cuda.memory.change_current_allocator` takes: an object whose `allocator()` is the C++ one."""

    def __init__(self, native):
        self.native = native

    def allocator(self):
        return self.native




def install(pool):
    """Make `pool` PyTorch's allocator for the whole process, by the pool's device.

    Emulated device: PyTorch's CPU allocator (`defrag.cpu_allocator.install`:
    native, every CPU tensor made afterwards lives in the pool, a real
    torch.OutOfMemoryError, undone by `defrag.uninstall()`); returns the pool.
    CUDA: `install_cuda` below; returns its `CudaInstall` (native) or
    `TorchAllocator` (the ctypes fallback).
    """
    from .owners import watch

    watch(pool)  # exports of PyTorch-made blocks' addresses are recorded: those never move
    if pool.kind == "emulated":
        from . import cpu_allocator

        return cpu_allocator.install(pool)
    return install_cuda(pool)


def uninstall() -> bool:
    """Undo `install` of an emulated pool (PyTorch's previous CPU allocator again); False when none was
    installed. RuntimeError while a pool is PyTorch's CUDA allocator (that cannot be undone)."""
    from . import cpu_allocator

    if cpu_allocator.uninstall():
        return True
    if installed() is not None:
        raise RuntimeError("defrag.uninstall: a pool is PyTorch's CUDA allocator, which cannot be undone")
    return False


class CudaInstall:
    """A pool serving one CUDA device through defrag's native allocation (`install_cuda`'s native route).

    `route` says how PyTorch reaches it: ``"backend"``, defrag's own CUDA
    allocator backend (`defrag.cuda_backend`: a `CUDAAllocator` that also
    answers PyTorch's statistics, snapshots, history, `empty_cache`, memory
    fractions, `record_stream`, CUDA graphs and MemPools from the pool), or
    ``"pluggable"``, PyTorch's `CUDAPluggableAllocator` over the entry points
    `defrag_cuda_alloc` / `defrag_cuda_free` (allocations only); `backend_note`
    says why the backend was not used (None when it was). Both place blocks
    in the pool's books with no Python and no GIL, exactly as the fast path
    does; the GIL only when pages must be mapped (the pool's ladder). A
    request the pool cannot serve raises torch.OutOfMemoryError with the
    pool's explained OOM. `pool`, `device` (the CUDA device index it serves);
    `counters()` reads the entry's counters. Made by `register_native`, for
    the life of the process (it cannot be undone).
    """

    def __init__(self, pool, device: int):
        self.pool, self.device = pool, int(device)
        self.route: str | None = None  # set when PyTorch is handed the route (install_cuda)
        self.backend_note: str | None = None

    def counters(self) -> dict:
        """The entry's counters for this device: allocs and frees (blocks handed out and given back),
        failures (errors thrown to PyTorch), ooms (of them, OutOfMemoryErrors), declined (requests the
        pool could not serve now: closed, asleep...), asked (trips to the pool's
        Python code), other_stream_allocs (allocations for a stream other than the default one),
        foreign_frees (process-wide: frees of pointers no installed pool handed out), last_error
        (process-wide), installed, forked_child; with the backend, also `backend` (its own counters:
        PyTorch's blocks by small/large, blocks held for other streams, graphs' private pools)."""
        from . import fastpath

        out = dict(fastpath.module.cuda_allocator_counters(self.device))
        if self.route == "backend":
            from . import cuda_backend

            out["backend"] = dict(cuda_backend.load().counters(self.device))
        return out

    def __repr__(self) -> str:
        c = self.counters()
        return (f"<defrag.allocator_install.CudaInstall pool #{self.pool.id} cuda:{self.device} route={self.route} "
                f"allocs={c['allocs']} frees={c['frees']} failures={c['failures']} "
                f"foreign_frees={c['foreign_frees']}>")


_routes: dict[int, CudaInstall] = {}  # device index -> the native route serving it (for the life of the process)
_native_current: str | None = None  # PyTorch's CUDA allocator now: "backend", "pluggable" or None (not ours)


def native_library() -> str:
    """The path of defrag's native module, the library that exports `defrag_cuda_alloc` / `defrag_cuda_free`.

    dlopen of an already-loaded library's path returns that library, so
    PyTorch's `CUDAPluggableAllocator` finds the very entry points whose
    books this process's pools use. NativeBuildError if the module cannot be had.
    """
    from . import native

    return native.load_module().__file__


def _fast_path(pool):
    """The pool's native FastPath (`Core.fast`), or None (DEFRAG_FASTPATH=0, "rebind" mode)."""
    return getattr(getattr(pool, "core", None), "fast", None)


def register_native(pool, device: int | None = None) -> CudaInstall:
    """Make defrag's native CUDA entry points serve `device` from `pool`, for the life of the process.

    The registration `install_cuda` makes before it hands the entry points to
    PyTorch (`change_current_allocator`, which this does not call: on the
    emulated device, tests call the entry points through the native module's
    `cuda_allocator_call` / `cuda_allocator_free` hooks). `device`: the
    pool's own CUDA index by default; any index for an emulated pool (a
    rehearsal). One pool per device (the same pool again returns its route;
    another raises RuntimeError); NotSupportedError for a pool without the
    native fast path; PoolClosedError for a closed pool. The pool is then
    kept alive by the route (the lease its blocks need), closed or not.
    """
    from .errors import NotSupportedError

    if device is None:
        if pool.kind != "cuda":
            raise ValueError(f"register_native: pool #{pool.id} is on the {pool.kind} device; name the CUDA "
                             "device index it should serve")
        device = pool.device.index or 0
    device = int(device)
    if pool.kind == "cuda" and device != (pool.device.index or 0):
        raise ValueError(f"register_native: pool #{pool.id} is on {pool.device}; it cannot serve cuda:{device}")
    with _registry:
        route = _routes.get(device)
        if route is not None:
            if route.pool is pool:
                return route
            raise RuntimeError(f"defrag.install: pool #{route.pool.id} already serves cuda:{device} (one pool per "
                               f"device, for the life of the process)")
        if pool.closed:
            raise PoolClosedError(f"defrag.install: pool #{pool.id} is closed")
        fast = _fast_path(pool)
        if fast is None:
            raise NotSupportedError(f"defrag.install: pool #{pool.id} has no native fast path (DEFRAG_FASTPATH=0 "
                                    f"or the 'rebind' storage mode), which the native CUDA allocator is built on")
        from . import fastpath

        fastpath.module.register_cuda_pool(fast, device)
        route = _routes[device] = CudaInstall(pool, device)
    return route


def install_cuda(pool) -> "CudaInstall | TorchAllocator":
    """Make `pool` PyTorch's CUDA allocator for its device, for the whole process; returns the route.

    Native route (the pool has the native fast path): every CUDA tensor is
    one pool block, placed with no Python and no GIL unless pages must be
    mapped, pinned (PyTorch holds its raw pointer: it never moves). A request
    the pool cannot serve raises torch.OutOfMemoryError with the pool's
    explained OOM, and the program can go on. PyTorch reaches the pool
    through defrag's CUDA allocator backend where it can be had
    (`defrag.cuda_backend`, torch >= 2.4 with CUDA, built on the first
    install: `torch.cuda.memory_stats` and friends, `cacheInfo`, snapshots
    and history, the OOM observer, `empty_cache`, memory fractions,
    `record_stream`, CUDA graphs and MemPools are then answered from the
    pool; CUDA IPC raises one clear error), else through PyTorch's
    `CUDAPluggableAllocator` over defrag's own library (`native_library()`,
    entry points `defrag_cuda_alloc` / `defrag_cuda_free`: allocations only;
    PyTorch's statistics, snapshots and `empty_cache` then raise "does not
    yet support"; `pool.stats()` works). The returned `CudaInstall`'s `route`
    says which, `backend_note` why not the backend. One pool per device:
    pools on other GPUs may be installed later (the same pool again returns
    its `CudaInstall`; a second pool for one device raises RuntimeError), and
    an allocation on a device with no pool raises RuntimeError.

    Fallback (no native fast path: DEFRAG_FASTPATH=0, "rebind" mode): the
    ctypes `TorchAllocator` (one Python call per allocation, ~90 us), one
    pool per process; PyTorch does not check its NULL return on this path,
    so a request the pool cannot serve crashes later instead of raising
    (leave headroom, watch its `failures` and the "defrag" log). Returns the
    `TorchAllocator`.

    All: the first install must run before PyTorch's first CUDA allocation
    (RuntimeError otherwise: PyTorch cannot swap an initialized allocator);
    nothing can undo it. Does not: move the blocks PyTorch holds, serve a
    sleeping or closed pool (its allocations raise). Block reuse between
    CUDA streams: the backend holds a block that `record_stream` named until
    those streams finish with it, as PyTorch does; the pluggable route
    reuses a freed block at once (exact for one stream per device).
    """
    global _installed, _native_current
    require_cuda(pool, "defrag.install(pool)")
    device = pool.device.index or 0
    with _registry:
        fallback, native_current, route = _installed, _native_current, _routes.get(device)
    if fallback is not None:
        if fallback.pool is pool:
            return fallback
        raise RuntimeError(f"defrag.install: pool #{fallback.pool.id} is already PyTorch's allocator (through "
                           f"ctypes, one pool per process)")
    if route is not None and native_current:
        return register_native(pool)  # the same pool again: its route; another: RuntimeError
    fast = _fast_path(pool)
    if fast is None and native_current:
        raise RuntimeError(f"defrag.install: pool #{pool.id} has no native fast path, and PyTorch's CUDA allocator "
                           f"is already defrag's native one (which serves only pools that have it)")
    if fast is None:
        return _install_fallback(pool)
    # Registered first: a refusal there (a closed pool, another pool on this device, no install slot left)
    # leaves PyTorch's allocator as it was. If PyTorch then refuses the switch, the route stays registered
    # but unused (`installed()` says None) until an install that PyTorch accepts.
    route = register_native(pool)
    if native_current == "backend":
        from . import cuda_backend

        cuda_backend.install(pool, device)  # the backend is PyTorch's already: it serves this device's snapshots too
        route.route = "backend"
    elif native_current == "pluggable":
        route.route, route.backend_note = "pluggable", "PyTorch's allocator was already the pluggable route"
    else:
        note = _install_backend(pool, device)
        if note is None:
            route.route = "backend"
        else:
            _change_allocator(torch.cuda.memory.CUDAPluggableAllocator(native_library(), "defrag_cuda_alloc",
                                                                       "defrag_cuda_free"))
            route.route, route.backend_note = "pluggable", note
        with _registry:
            _native_current = route.route
    _log.info("defrag: pool #%d now serves PyTorch's CUDA allocations on cuda:%d (install, %s)", pool.id, device,
              route.route if route.backend_note is None else f"{route.route}: {route.backend_note}")
    return route


def _install_backend(pool, device: int) -> str | None:
    """Make defrag's CUDA allocator backend PyTorch's (`defrag.cuda_backend`); None when done, else why it
    could not be had (the caller installs the pluggable route instead). RuntimeError, as
    `_change_allocator`'s, when PyTorch's allocator is already in use."""
    from . import cuda_backend
    from .errors import NativeBuildError

    try:
        cuda_backend.install(pool, device)
    except NativeBuildError as exc:
        _log.warning("defrag: %s; PyTorch's memory statistics, snapshots and CUDA graphs will not work "
                     "(the pluggable allocator route serves allocations only)", exc)
        return str(exc)
    except RuntimeError as exc:
        if "initialized" in str(exc):
            raise RuntimeError(f"defrag.install(pool) must run before PyTorch's first CUDA allocation (PyTorch: "
                               f"{exc}); call it first thing, or route a block with `with pool.capture():` "
                               "instead") from None
        _log.warning("defrag: the CUDA allocator backend could not be installed (%s); using the pluggable "
                     "allocator route", exc)
        return f"the backend could not be installed: {exc}"
    return None


def _change_allocator(handle) -> None:
    """`change_current_allocator(handle)`, kept alive for the process (PyTorch keeps a raw pointer)."""
    try:
        torch.cuda.memory.change_current_allocator(handle)
    except RuntimeError as exc:
        raise RuntimeError(f"defrag.install(pool) must run before PyTorch's first CUDA allocation (PyTorch: {exc}); "
                           "call it first thing, or route a block with `with pool.capture():` instead") from None
    keep_for_process(handle)


def _install_fallback(pool) -> TorchAllocator:
    global _installed
    allocator = TorchAllocator.for_pool(pool)
    _change_allocator(_Handle(allocator.torch_allocator()))
    with _registry:
        _installed = allocator
    _log.info("defrag: pool #%d is now PyTorch's CUDA allocator (install, ctypes fallback)", pool.id)
    return allocator


def installed(device: int | None = None) -> "CudaInstall | TorchAllocator | None":
    """What `install_cuda` made PyTorch's for `device` (None: the ctypes fallback, else the native route
    installed first), or None."""
    with _registry:
        if _installed is not None:
            return _installed
        if not _native_current:  # routes registered without PyTorch (register_native alone) are not installs
            return None
        if device is not None:
            return _routes.get(int(device))
        return next(iter(_routes.values()), None)
