"""PyTorch's CUDA allocations in a pool's segments: `TorchAllocator` (ctypes trampolines) and `capture`.

PyTorch's pluggable-allocator interface is two C functions,
``void* alloc(ssize_t size, int device, cudaStream_t stream)`` and
``void free(void* ptr, ssize_t size, int device, cudaStream_t stream)``.
`TorchAllocator(pool)` builds both as ctypes trampolines over
`Pool.alloc_segment` / `Pool.free_segment`, so PyTorch's own allocations
(activations, gradients, workspaces) draw on the same physical pages as the
pool's tensors, through the same ladder (empty pages, stitching, then
compacting the pool's movable tensors) before a request fails.

`capture(pool)` (`with pool.capture():`): the calling thread's CUDA
allocations go to a `torch.cuda.MemPool` whose allocator is the
`TorchAllocator`. PyTorch's caching allocator stays in charge and asks us
only for *segments* (2 MiB for requests up to 1 MiB, 20 MiB for 1-10 MiB,
larger ones rounded up to 2 MiB) and sub-allocates tensors inside them; a
NULL return becomes PyTorch's own `torch.OutOfMemoryError`.

Making a pool PyTorch's allocator for the whole process (`defrag.install`)
is `defrag.allocator_install`'s: native entry points over the pool's books,
with this module's `TorchAllocator` as the fallback for a pool without the
native fast path.

The rules the trampolines keep (PyTorch holds raw function pointers and calls
them from any thread, autograd's included, while holding the caching
allocator's mutex):

- they live as long as the process (`_KEEP`), and each holds its allocator,
  which holds its pool: a pool PyTorch may still call into is never collected;
- no exception crosses the C boundary: it is logged (logger "defrag", with
  the formatted traceback), counted (`errors`), and alloc returns NULL;
- the device's primary context is made current on the calling thread first;
- a pointer that is not one of the pool's segments is logged and ignored;
- nothing inside allocates through torch or waits on anything a thread
  blocked on PyTorch's allocator mutex could hold; Python's cyclic garbage
  collector is paused meanwhile (a collection there could free caching-
  allocator tensors, re-entering PyTorch's allocator in the middle of its
  own malloc, or run a `__del__` that allocates).

Segments never move (PyTorch sub-allocates inside them; the pool cannot know
their users). Their bytes count as allocated in `pool.stats()`
(`segments`, `segment_bytes`), and `layout()` / `snapshot()` show them as
blocks of kind "segment".

Cached segments. Freed tensors stay in PyTorch's cache inside their segment;
a MemPool's cached segments go back only when the MemPool is destroyed and
`torch.cuda.empty_cache()` runs (`torch.cuda.empty_cache()` alone does not
free a live MemPool's cache), and destroying a MemPool that still holds live
tensors is unsafe on some PyTorch versions. So `capture` routes into
*generations*: one MemPool per concurrent capturing thread, reused by later
capture blocks, until `release_cached()` retires it; a retired MemPool is
destroyed (and its cached segments come back to the pool) once no capture
block uses it and it holds no live tensor. Call `release_cached()` (or
`pool.compact()`, where the pool runs its pressure hooks) between steps.

This module imports no `defrag.pool`: it sees a pool only through its public
methods (`alloc_segment`, `free_segment`, `segments`, `driver`, `kind`,
`device`, `closed`, `id`), so `Pool.capture()` can use it.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import sys
import threading
import traceback

import torch

from .errors import PoolClosedError
from .oom import OutOfMemoryError

__all__ = ["TorchAllocator", "capture", "release_cached", "in_callback", "require_cuda", "keep_for_process",
           "ALLOC_FN", "FREE_FN"]

_log = logging.getLogger("defrag")

#: ``void* alloc(ssize_t size, int device, cudaStream_t stream)``
ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
#: ``void free(void* ptr, ssize_t size, int device, cudaStream_t stream)``
FREE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)

# Everything PyTorch was handed a raw pointer to (trampolines with their allocator, C++ allocators,
# allocator handles): none is ever freed (`keep_for_process`).
_KEEP: list = []
_registry = threading.Lock()
_by_pool: dict[int, "TorchAllocator"] = {}  # pool.id -> the allocator capture/install use
# pool.id -> every allocator PyTorch was routed through for that pool (for_pool's and any passed to
# capture): `release_cached(pool)` hands back what each caches.
_routed: dict[int, list["TorchAllocator"]] = {}
_is_finalizing = sys.is_finalizing  # bound now: `sys` may be half torn down when late frees arrive

# Callbacks in flight: per thread (in_callback) and process-wide (the paused garbage collector).
_local = threading.local()
_gc_lock = threading.Lock()
_gc_state = {"depth": 0, "was_enabled": False}


def keep_for_process(obj) -> None:
    """Keep `obj` alive until the process ends: PyTorch holds a raw pointer into it and may call it late."""
    _KEEP.append(obj)


def in_callback() -> bool:
    """Whether the calling thread is inside one of defrag's allocator callbacks (PyTorch is mid-malloc/free)."""
    return getattr(_local, "depth", 0) > 0


def _callback_begins() -> None:
    _local.depth = getattr(_local, "depth", 0) + 1
    with _gc_lock:
        if _gc_state["depth"] == 0:
            _gc_state["was_enabled"] = gc.isenabled()
            if _gc_state["was_enabled"]:
                gc.disable()
        _gc_state["depth"] += 1


def _callback_ends() -> None:
    with _gc_lock:
        _gc_state["depth"] -= 1
        if _gc_state["depth"] == 0 and _gc_state["was_enabled"]:
            gc.enable()
    _local.depth -= 1


class TorchAllocator:
    """The pool as a PyTorch pluggable allocator: C entry points `alloc_ptr` and `free_ptr` (ints).

    `alloc` hands out a pool segment (`pool.alloc_segment`: the pool's ladder,
    automatic compaction included) and returns NULL (counted in `failures`)
    when the pool cannot serve it; `free` gives a segment back and ignores
    (logs, counts in `foreign_frees`) a pointer the pool did not hand out.
    Neither ever raises into PyTorch: an unexpected exception is logged with
    its traceback and counted in `errors` (alloc then returns NULL).

    Holds `pool` strongly, and the trampolines (kept for the life of the
    process) hold this object: PyTorch may call them at any time. Counters:
    `allocs`, `frees`, `failures` (NULL returns for a request of one byte or
    more), `errors` (exceptions caught), `foreign_frees`; `last_error` is the
    message of the last failure. `TorchAllocator.for_pool(pool)` is the one
    `capture` and `install` use.
    """

    def __init__(self, pool, *, compact_in_callback: bool = False):
        missing = [n for n in ("alloc_segment", "free_segment", "segments", "driver", "kind", "id") if not hasattr(pool, n)]
        if missing:
            raise TypeError(f"TorchAllocator needs a defrag.Pool (it lacks {', '.join(missing)}), got {type(pool).__name__}")
        self.pool = pool
        # PyTorch may ask for a segment in the middle of an op whose inputs' addresses it
        # has already read (a reduction's scratch buffer, cuBLAS's workspace): a compaction
        # there could move those inputs under the kernel. So by default the callback climbs
        # the ladder without compacting (empty mapped pages, stitching) and returns NULL;
        # `defrag.retry_on_oom(pool)` then compacts at the op boundary, the op's tensors
        # pinned, and retries. True: compact inside the callback too (safe when the ops
        # in the capture block allocate before reading pool tensors, e.g. factories).
        self.compact_in_callback = bool(compact_in_callback)
        self.allocs = self.frees = self.failures = self.errors = self.foreign_frees = 0
        self.last_error = ""
        self._count_lock = threading.Lock()
        self._route_lock = threading.Lock()
        self._native = None  # torch._C._cuda_CUDAAllocator, made on first use and kept
        self._open: list = []  # MemPools a capture block may enter
        self._busy: list = []  # MemPools a capture block is in now
        self._retired: list = []  # MemPools waiting to be destroyed (release_cached)
        alloc, free = ALLOC_FN(self._alloc), FREE_FN(self._free)
        keep_for_process((self, alloc, free))
        self._alloc_fn, self._free_fn = alloc, free

    @classmethod
    def for_pool(cls, pool, *, create: bool = True) -> "TorchAllocator | None":
        """The allocator `capture` and `install` use for `pool` (one per pool, made on first use).

        With `create=False`, None when there is none yet.
        """
        with _registry:
            allocator = _by_pool.get(pool.id)
            if allocator is None and create:
                allocator = _by_pool[pool.id] = cls(pool)
                _remember(allocator)
            return allocator

    # ------------------------------------------------------------------ the C face
    @property
    def alloc_ptr(self) -> int:
        """Address of ``void* alloc(ssize_t size, int device, cudaStream_t stream)``."""
        return ctypes.cast(self._alloc_fn, ctypes.c_void_p).value

    @property
    def free_ptr(self) -> int:
        """Address of ``void free(void* ptr, ssize_t size, int device, cudaStream_t stream)``."""
        return ctypes.cast(self._free_fn, ctypes.c_void_p).value

    def counters(self) -> dict:
        """allocs, frees, failures, errors, foreign_frees and last_error, read together."""
        with self._count_lock:
            return {"allocs": self.allocs, "frees": self.frees, "failures": self.failures, "errors": self.errors,
                    "foreign_frees": self.foreign_frees, "last_error": self.last_error}

    def __repr__(self) -> str:
        c = self.counters()
        return (f"<defrag.TorchAllocator pool #{self.pool.id} allocs={c['allocs']} frees={c['frees']} "
                f"failures={c['failures']} errors={c['errors']} foreign_frees={c['foreign_frees']}>")

    def _count(self, name: str, message: str | None = None) -> None:
        with self._count_lock:
            setattr(self, name, getattr(self, name) + 1)
            if message is not None:
                self.last_error = message

    def _alloc(self, size, device, stream):
        try:
            if _is_finalizing():
                return None
            _callback_begins()
            try:
                return self._allocate(size, device, stream)
            finally:
                _callback_ends()
        except BaseException:  # noqa: BLE001 - nothing may cross the C boundary
            self._caught("alloc", f"size={size} device={device}")
            return None

    def _allocate(self, size: int, device: int, stream) -> int | None:
        pool = self.pool
        if size == 0:
            return None  # an empty tensor: NULL is the answer PyTorch expects, not a failure
        if size < 0:
            return self._refuse(f"defrag: PyTorch asked pool #{pool.id} for {size} bytes; returned NULL")
        if device >= 0 and device != pool.driver.ordinal:
            return self._refuse(f"defrag: PyTorch asked pool #{pool.id} (on {pool.device}) for memory on device "
                                f"{device}; returned NULL (a pool serves one device)")
        pool.driver.make_current()
        try:
            address = pool.alloc_segment(size, stream or 0, compact=self.compact_in_callback)
        except OutOfMemoryError as exc:
            return self._refuse(f"defrag: a {size}-byte segment for PyTorch's allocator does not fit; returned NULL. {exc}")
        except PoolClosedError as exc:
            return self._refuse(f"defrag: PyTorch asked a closed pool for {size} bytes; returned NULL ({exc})")
        self._count("allocs")
        return address

    def _refuse(self, message: str) -> None:
        self._count("failures", message)
        _log.warning("%s", message)
        return None

    def _free(self, ptr, size, device, stream):
        try:
            if not ptr or _is_finalizing():
                return
            _callback_begins()
            try:
                self._release(ptr, size)
            finally:
                _callback_ends()
        except BaseException:  # noqa: BLE001 - nothing may cross the C boundary
            self._caught("free", f"ptr={ptr:#x} size={size}" if isinstance(ptr, int) else f"ptr={ptr!r}")

    def _release(self, ptr: int, size: int) -> None:
        pool = self.pool
        try:
            pool.driver.make_current()
        except Exception:  # noqa: BLE001 - still give the segment back: the bookkeeping needs no context
            self._caught("free (making the context current)", f"ptr={ptr:#x}")
        if pool.free_segment(ptr):
            self._count("frees")
        else:
            self._count("foreign_frees")
            _log.warning("defrag: PyTorch freed %#x (%d bytes), which is not a segment of pool #%d; ignored",
                         ptr, size, pool.id)

    def _caught(self, where: str, what: str) -> None:
        # The formatted traceback only: keeping the exception would keep its frames (and their tensors) alive.
        text = traceback.format_exc()
        try:
            message = f"defrag: an exception in the PyTorch allocator callback ({where}, {what}) was caught"
            with self._count_lock:
                self.errors += 1
                if where == "alloc":
                    self.failures += 1
                self.last_error = message + ": " + text.strip().splitlines()[-1]
            _log.error("%s%s:\n%s", message, "; returned NULL" if where == "alloc" else "", text)
        except BaseException:  # noqa: BLE001 - even logging must not raise into C
            pass

    # ------------------------------------------------------------------ torch glue (CUDA only)
    def torch_allocator(self):
        """PyTorch's handle on these entry points (`torch._C._cuda_CUDAAllocator`), made once and kept.

        What `torch.cuda.MemPool(allocator)` takes. RuntimeError when this
        torch has no CUDA.
        """
        with self._route_lock:
            if self._native is None:
                make = getattr(torch._C, "_cuda_customAllocator", None)
                if make is None:
                    raise RuntimeError(f"torch {torch.__version__} was built without CUDA: it has no pluggable "
                                       "CUDA allocator to route")
                self._native = make(self.alloc_ptr, self.free_ptr)
                keep_for_process(self._native)  # a MemPool may hold only a raw pointer to it
            return self._native

    def _take_mempool(self):
        """A MemPool no capture block is using (made when none is free); marked busy."""
        native = self.torch_allocator()
        with self._route_lock:
            free = [m for m in self._open if all(m is not b for b in self._busy)]
            if free:
                mempool = free[0]
            else:
                with torch.cuda.device(self.pool.device):
                    mempool = torch.cuda.MemPool(native)
                self._open.append(mempool)
            self._busy.append(mempool)
            return mempool

    def _give_mempool(self, mempool) -> None:
        with self._route_lock:
            for i, m in enumerate(self._busy):
                if m is mempool:
                    del self._busy[i]
                    break

    def release_cached(self) -> int:
        """Give the segments PyTorch caches but no longer uses back to the pool; returns their bytes.

        Retires the MemPools capture blocks used so far (later blocks get new
        ones), destroys every retired MemPool that no capture block uses and
        that holds no live tensor (its cached segments come back through
        `free`), then runs `torch.cuda.empty_cache()`. A MemPool still
        holding a live tensor stays until a later call finds it empty.

        Call it between steps, from ordinary code: never from inside an
        allocator callback (it returns 0 there, PyTorch being mid-malloc), nor
        while holding the pool's lock (an `on_oom` or `on_compact` observer),
        since freeing a segment takes that lock while PyTorch holds its
        allocator mutex. A no-op (0) on the emulated device or before CUDA
        is initialized.
        """
        if in_callback():
            _log.warning("defrag: release_cached() called inside an allocator callback; ignored")
            return 0
        if self.pool.kind != "cuda" or not torch.cuda.is_initialized():
            return 0
        before = sum(n for _, n in self.pool.segments())
        with self._route_lock:
            self._retired.extend(self._open)
            self._open = []
            idle = [m for m in self._retired if all(m is not b for b in self._busy)]
        empty = [m for m in idle if _holds_no_tensor(m)]
        with self._route_lock:
            self._retired = [m for m in self._retired if all(m is not e for e in empty)]
        del idle
        empty.clear()  # ~MemPool: releases the pool and frees its cached segments (our `free`)
        torch.cuda.empty_cache()
        return max(before - sum(n for _, n in self.pool.segments()), 0)

    def mempools(self) -> dict:
        """How many MemPools are open (reusable), busy (in a capture block now) and retired (waiting)."""
        with self._route_lock:
            return {"open": len(self._open), "busy": len(self._busy), "retired": len(self._retired)}


def _holds_no_tensor(mempool) -> bool:
    """Whether every block in `mempool`'s segments is inactive (False when PyTorch cannot say)."""
    try:
        try:
            segments = mempool.snapshot(include_traces=False)
        except TypeError:
            segments = mempool.snapshot()
    except Exception:  # noqa: BLE001 - an older torch: keep the MemPool (safe), it just stays cached
        return False
    if isinstance(segments, dict):
        segments = segments.get("segments", [])
    return all(block.get("state") == "inactive" for seg in segments for block in seg.get("blocks", ()))


def _remember(allocator: TorchAllocator) -> None:
    """Note that PyTorch may route `allocator.pool`'s allocations through `allocator` (`_registry` held)."""
    routed = _routed.setdefault(allocator.pool.id, [])
    if all(a is not allocator for a in routed):
        routed.append(allocator)


def require_cuda(pool, what: str) -> None:
    """Raise unless `pool` is an open pool on a GPU that torch can use: RuntimeError (the emulated device,
    torch without CUDA) or PoolClosedError, with `what` (the caller's name) first in the message."""
    if pool.kind != "cuda":
        raise RuntimeError(
            f"{what} routes PyTorch's CUDA allocations; this pool is on the {pool.kind} device, whose tensors are "
            f"CPU tensors PyTorch's CUDA allocator never sees. Use a pool on a GPU (device='cuda:N'); on the "
            f"emulated device, call a TorchAllocator's alloc_ptr/free_ptr through ctypes to exercise it")
    if not torch.cuda.is_available():
        raise RuntimeError(f"{what} needs torch with CUDA, but torch {torch.__version__} cannot use the GPU "
                           "(torch.cuda.is_available() is False)")
    if pool.closed:
        raise PoolClosedError(f"{what}: pool #{pool.id} is closed")


def _pressure_hook(allocator: TorchAllocator) -> None:
    """Offer `release_cached` to the pool's pressure hooks, if the pool has them (`on_pressure`)."""
    hooks = getattr(allocator.pool, "on_pressure", None)
    if isinstance(hooks, list) and not any(getattr(h, "__self__", None) is allocator for h in hooks):
        hooks.append(allocator.release_cached)


@contextlib.contextmanager
def capture(pool, *, allocator: TorchAllocator | None = None):
    """Route the calling thread's PyTorch CUDA allocations to `pool`'s pages for the block (`Pool.capture()`).

    Yields the `TorchAllocator`. Through `torch.cuda.MemPool(allocator)` and
    `torch.cuda.use_mem_pool`: PyTorch's caching allocator asks the pool for
    segments and sub-allocates inside them; when the pool cannot serve one
    (after its ladder), PyTorch raises its `torch.OutOfMemoryError`.

    Limits: the calling thread only (backward runs on autograd's device
    thread unless `torch.autograd.set_multithreading_enabled(False)`);
    expandable segments are off inside the MemPool; freed tensors stay
    cached in PyTorch's segments until `release_cached()`; capture blocks of
    one pool nest (the inner one is a no-op), blocks of two pools do not
    (RuntimeError: PyTorch would route to the outer one). RuntimeError on
    the emulated device or without CUDA.
    """
    require_cuda(pool, "pool.capture()")
    if allocator is None:
        allocator = TorchAllocator.for_pool(pool)
    elif allocator.pool is not pool:
        raise ValueError(f"capture: the allocator serves pool #{allocator.pool.id}, not pool #{pool.id}")
    else:
        with _registry:
            _remember(allocator)
    routing = getattr(_local, "routing", None)
    if routing is not None:
        if routing is allocator:
            yield allocator  # nested in this thread: already routed
            return
        raise RuntimeError(f"capture: this thread already routes its allocations to pool #{routing.pool.id}; "
                           f"PyTorch would keep routing there, not to pool #{pool.id} (nest capture blocks of "
                           f"one pool only)")
    _pressure_hook(allocator)
    mempool = allocator._take_mempool()
    _local.routing = allocator
    try:
        with torch.cuda.use_mem_pool(mempool, device=pool.device):
            yield allocator
    finally:
        _local.routing = None
        allocator._give_mempool(mempool)


def release_cached(pool) -> int:
    """`TorchAllocator.release_cached()` of every allocator `pool` was captured or installed with (the
    pool's own, `TorchAllocator.for_pool`, and any passed to `capture(pool, allocator=...)`): the bytes
    they gave back, 0 when PyTorch was never routed to the pool."""
    with _registry:
        routed = list(_routed.get(pool.id, ()))
    return sum(allocator.release_cached() for allocator in routed)
