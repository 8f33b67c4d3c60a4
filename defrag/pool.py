"""`Pool`: the torch face of the core: a page-mapped heap whose tensors are ordinary torch tensors.

Placement, release, page accounting and the allocation ladder live in
`defrag.core`, the compaction protocol in `defrag.compactor`; the pool turns
blocks into torch storages and back, and rewrites a moved block's storage
(`_TorchMover`, in `defrag.pool_context`).

`Pool` is composed of parts, one object each, all built over the pool's one
`PoolContext` (`defrag.pool_context`: the core, the device, the mover, the
fast path, and the handful of operations the parts share); each public method
of a part's concept is one line here that hands the call to its part:
`defrag.pool_ownership` (`TensorOwnership`: `owns`, `pin`, `share`,
`claim`, `record_stream`, `adopt`), `defrag.pool_residency`
(`PoolResidency`: `sleep`, `wake`, `offload`, `reload`),
`defrag.pool_meshing` (`PoolMeshing`: `mesh`, `unmesh`, `trim`'s meshing
step), `defrag.pool_segments` (`AllocatorSegments`: raw segments for
PyTorch's allocator) and `defrag.pool_observability` (`PoolObservability`:
`stats`, `layout`, `record_history`). `capture` and `release_cached` hand the
pool itself to `defrag.capture`, `snapshot` and `summary` to `defrag.stats`.
This module keeps the pool's life (creation, fast path, release, `trim`,
`close`) and compaction (`compact`, `live_tensors`).

Lifetime. Each block is owned by the torch storage over it: a storage made in
C++ over the block's record in the pool's native books (`defrag.native`),
whose deleter releases the record there in whatever thread torch frees it (at
once, or, while a thread is inside a pool call, when it leaves). On CUDA a
released block that other streams used (`record_stream`) is reused only after
an event on each of them completed; one its own stream alone used is reusable
by that stream at once. Pages left with no live block stay mapped ("empty")
until their physical page is needed elsewhere, `trim()`, a compaction or
`close()`; the device is synchronized before any unmap.

Threads (the contract; `defrag.threads` has the mechanism). Every public
method holds the pool's lock, so pool calls from several threads are
serialized. Every block belongs to the thread that allocated, adopted or
claimed it, and a compaction, explicit or automatic, moves a block only when
no other thread can be using it: blocks of the calling thread; blocks of
threads that are waiting inside a call to this pool (they run none of their
own code until the compaction is over); and, only when no other thread that
used the pool is running, every unpinned block (shared ones and those of
ended threads included). A tensor made by one thread and used by another
must be handed over: `pool.claim(t)` in the thread that takes it over, or
`pool.share(t)` when several threads use it (a shared block moves only when
no other thread that used the pool runs). The pool's own methods (`zeros`,
`full`, `adopt`, ...) finish writing a tensor before returning, and the
block is the caller's meanwhile, so no other thread's compaction sees it
half-made. `compact(threads="own")` moves only the caller's blocks;
`compact(threads="all")` insists on moving everything and raises
`ConcurrencyError` while another thread that used the pool still runs.
What the pool cannot see: a tensor handed to another thread without
`claim`/`share` (its owner's compactions may move it under the other
thread), and raw `data_ptr()`s kept by any thread (pin those tensors).
"""

from __future__ import annotations

import itertools
import logging
import math
import traceback
import weakref
from dataclasses import dataclass

import torch

from . import copying, cpu_allocator, fastpath, owners, residency
from . import stats as observe
from . import tensors as tz
from . import threads
from .capture import capture as capture_block
from .capture import release_cached as release_captured
from .compactor import CompactionReport, compact_core
from .core import Block, Core
from .driver import Driver, open_driver
from .errors import PoolAsleepError, PoolClosedError, StaleAccessError
from .mesher import MeshReport
from .oom import OutOfMemoryError, refused_inside_allocator
from .pool_context import PoolContext, TensorInfo
from .pool_context import safe_point as contexts_safe_point
from .pool_meshing import PoolMeshing
from .pool_observability import PoolObservability
from .pool_ownership import TensorOwnership
from .pool_residency import PoolResidency
from .pool_segments import AllocatorSegments
from .units import format_bytes, parse_size

_log = logging.getLogger("defrag")
_open_pools: "weakref.WeakSet[Pool]" = weakref.WeakSet()
_pool_ids = itertools.count(1)
# A CUDA device's default stream, known without asking torch (whose stream queries initialize its
# CUDA allocator): c10 numbers it 0 (StreamIdType DEFAULT, index 0).
DEFAULT_STREAM_ID = 0


def _weakly(method):
    """A plain function calling the bound `method` through a weak reference to its object (it returns
    None once the object is gone): a callback native code keeps must not keep the pool alive."""
    ref = weakref.WeakMethod(method)

    def call(*args):
        bound = ref()
        return None if bound is None else bound(*args)
    return call


def _context_list(name: str, doc: str) -> property:
    """A `Pool` property over the list `name` of its `PoolContext` (read it, append to it, or replace it)."""
    return property(lambda pool: getattr(pool._context, name),
                    lambda pool, value: setattr(pool._context, name, value), doc=doc)


def _let_go(core: Core) -> None:
    """The end of a pool's memory (its finalizer: closed and idle, or collected): its native code serves
    nothing more and keeps no reference to it, and every handle, mapping and reservation goes back."""
    if core.fast is not None:
        core.fast.close()
    core.books.close()
    core.books.set_keeper(None, None)
    core.space.release_all()


def open_pools() -> list["Pool"]:
    """Every pool of this process that is not closed."""
    return [p for p in list(_open_pools) if not p.closed]


def save_snapshot(path, pool: "Pool | None" = None) -> str:
    """Pickle a snapshot to `path` for `python -m torch.cuda._memory_viz` or pytorch.org/memory_viz.

    `pool=None` saves every open pool of the process merged into one snapshot
    (like PyTorch's, which covers every segment of the process; pools on one
    device share its trace, ordered by time). Raises ValueError when there is
    no open pool. The pickle uses protocol 4 and plain types only, which is
    what the browser viewer's unpickler reads. Returns the path as a string.
    """
    if pool is None:
        pools = open_pools()
        if not pools:
            raise ValueError("save_snapshot: no open pool to save (pass pool=...)")
        data = observe.merge_snapshots([p.snapshot() for p in sorted(pools, key=lambda p: p.id)])
    else:
        data = pool.snapshot()
    return observe.write_snapshot(path, data)


def compact(*, verify: bool = False, progress: bool | None = None, engine: str | None = None,
            release: bool = False, threads: str | None = None, mesh: bool = True) -> list[CompactionReport]:
    """Compact every open pool of this process (same options as `Pool.compact`); one report per pool.

    Pools are compacted one after the other; an error in one propagates
    after the pools before it were compacted (each compaction is
    all-or-nothing per wave on its own).
    """
    pools = open_pools()
    with safe_point(pools):
        return [p.compact(verify=verify, progress=progress, engine=engine, release=release, threads=threads, mesh=mesh)
                for p in pools]


def safe_point(pools):
    """With-block: a safe point for `pools` (the caller runs no torch operation, and no other thread may be
    in the middle of one): the owners of their PyTorch-made blocks are matched once for all of them, and
    compactions inside may move those blocks (`defrag.pool_context.safe_point`)."""
    return contexts_safe_point([p._context for p in pools])


ALLOCATOR_ORIGIN = 2  # books.h Origin kAllocator: placed for PyTorch's allocator entries


def _native_face_maker(regions: list, torch_blocks_move):
    """`Core.make_face` for a pool whose native code places blocks (`pool.empty`'s fast path, threads
    Python never saw, PyTorch's allocator entries): the Block of such a block, made when Python first
    asks for it. No owner (a thread Python never saw, PyTorch's allocator): pinned, since that code
    holds the raw pointer and a move would leave it stale. No storage (PyTorch's allocator made the
    block: torch builds the storage itself): origin "allocator"."""
    from torch.multiprocessing.reductions import StorageWeakRef

    def make(address, size, nbytes, region, origin, owner, weak, dtype, shape):
        if origin == ALLOCATOR_ORIGIN:  # its owner is found at safe points (defrag.owners), not kept here
            info = TensorInfo(dtype, shape, None, "allocator")
            pins = 0 if torch_blocks_move() else 1
            return Block(address, size, nbytes, regions[region], pins=pins, owner=None, info=info)
        storage_ref = StorageWeakRef.from_weakref(weak) if weak else None
        info = TensorInfo(dtype, shape, storage_ref, "empty" if storage_ref is not None else "allocator")
        return Block(address, size, nbytes, regions[region], pins=int(owner is None), owner=owner, info=info)
    return make


@dataclass(frozen=True)
class LiveTensor:
    """What the compactor sees of one live block (`Pool.live_tensors()`)."""

    address: int
    nbytes: int
    block_bytes: int
    dtype: torch.dtype | None
    shape: tuple[int, ...] | None
    pinned: bool
    movable: bool
    reason: str  # why not movable ("" when movable)
    owner: str = ""  # "thread 'name'", "an ended thread" or "shared"
    meshed: bool = False  # a page under it shares its physical page with other pages (a mesh: `Pool.mesh`)


class Pool:
    """A VMM-backed tensor pool whose live tensors the compactor can move.

    `device`: "cuda:N", "emulated", None (first GPU if one works, else the
    emulated device) or a `defrag.driver.Driver`. `capacity`: bytes or a string
    such as "8GiB"; physical pages are created lazily up to it. `page_size`: a
    multiple of the device granularity (default: the granularity, 2 MiB on
    H100/H200). `auto_compact`: compact and retry when an allocation fails but
    enough memory is stranded in half-used pages; `auto_mesh`: then, before
    raising, also let pages whose live bytes are disjoint share physical pages
    (`Pool.mesh`).

    `min_compact_interval`: seconds that must pass between two automatic
    compactions (an allocation failing sooner raises instead of compacting
    again). `virtual_factor`: the first virtual reservation spans this many
    times the capacity (more regions are reserved when a request finds no
    long enough run of free virtual pages).

    On the emulated device tensors are CPU tensors over emulated device memory
    (`pool.device` is `cpu`); on a GPU they are CUDA tensors. `pool.core` is
    the torch-free core underneath (read it, do not change it).

    Threads: a compaction moves only tensors no other thread can be using (the
    calling thread's, those of threads waiting inside a pool call, and every
    unpinned one when no other thread that used the pool runs); hand a tensor
    to another thread with `claim` (one new user) or `share` (several). The
    module docstring states the whole contract.
    """

    def __init__(self, device=None, capacity="8GiB", page_size=None, auto_compact=True, *,
                 min_compact_interval: float = 0.0, virtual_factor: int = 2, auto_mesh: bool = True):
        capacity_bytes = parse_size(capacity, what="capacity")
        self.driver: Driver = open_driver(device)
        if self.driver.kind not in ("cuda", "emulated"):
            raise ValueError(f"a Pool makes torch tensors, which need device memory; the {self.driver.kind} "
                             f"device has none (use defrag.dry.DryPool)")
        granularity = self.driver.granularity
        if page_size is None:
            page_size = granularity
        else:
            page_size = parse_size(page_size, what="page_size")
            if page_size <= 0 or page_size % granularity:
                raise ValueError(f"page_size must be a positive multiple of the device granularity "
                                 f"({format_bytes(granularity)}), got {page_size}")
        if capacity_bytes < page_size:
            raise ValueError(f"capacity {format_bytes(capacity_bytes)} is smaller than one page ({format_bytes(page_size)})")
        self.id = next(_pool_ids)
        self.kind = self.driver.kind
        self.device = torch.device("cpu") if self.kind == "emulated" else torch.device("cuda", self.driver.ordinal)
        swap_mode = tz.swap_mode()  # fixed for the pool's life, like the storages it made
        self.core = Core(self.driver, capacity_pages=capacity_bytes // page_size, page_size=page_size,
                         auto_compact=auto_compact, min_compact_interval=min_compact_interval,
                         virtual_factor=virtual_factor, label=f"pool #{self.id}", auto_mesh=auto_mesh)
        if self.kind == "cuda" and self.driver.on_libcuda:
            # Releases other streams used wait for their events; reuse across streams is fenced.
            self.core.books.set_streams("cuda", self.driver.context_handle)
        # Holds the address space, not the pool: it runs when the pool is collected or closed idle.
        finalizer = weakref.finalize(self, _let_go, self.core)
        finalizer.atexit = False
        # What the parts share; a Python-path storage's death calls this pool's `_on_release`.
        self._context = context = PoolContext(self.id, self.core, self.device, swap_mode,
                                              on_release=self._on_release, finalizer=finalizer)
        # The books keep this pool alive while a storage of theirs lives, and tell it of every release
        # after close (`_release_after_close`), through a weak reference (no cycle).
        self._close_hook = _weakly(self._release_after_close)  # kept here: the books only borrow it
        self.core.books.set_keeper(self, self._close_hook)
        if self.kind == "cuda":
            copying.prepare(self.driver)  # the move kernel loads (or compiles, once per machine) in the background
        # The parts, each over the context (and the parts it builds on).
        self._ownership = TensorOwnership(context, open_pools)
        self._residency = PoolResidency(context, self._ownership)
        self._meshing = PoolMeshing(context)
        self._allocator_segments = AllocatorSegments(context)
        self._observability = PoolObservability(context, self._allocator_segments)
        # The allocation fast path (defrag.fastpath) over the core's native books; whenever it
        # declines, the Python path.
        if fastpath.setting() != "off":
            with self.core.gate:
                self._attach_fast()
        _open_pools.add(self)

    # ------------------------------------------------------------------ basics
    @property
    def closed(self) -> bool:
        return self.core.closed

    @property
    def page_size(self) -> int:
        return self.core.page_size

    @property
    def capacity(self) -> int:
        return self.core.capacity

    @property
    def capacity_pages(self) -> int:
        return self.core.capacity_pages

    @property
    def auto_compact(self) -> bool:
        return self.core.auto_compact

    @auto_compact.setter
    def auto_compact(self, value: bool) -> None:
        self.core.auto_compact = bool(value)

    @property
    def auto_mesh(self) -> bool:
        return self.core.auto_mesh

    @auto_mesh.setter
    def auto_mesh(self, value: bool) -> None:
        self.core.auto_mesh = bool(value)

    @property
    def min_compact_interval(self) -> float:
        return self.core.min_compact_interval

    @min_compact_interval.setter
    def min_compact_interval(self, value: float) -> None:
        self.core.min_compact_interval = float(value)

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{sum(1 for _ in self.core.blocks())} blocks"
        return (f"<defrag.Pool #{self.id} {self.kind} capacity={format_bytes(self.capacity)} "
                f"page={format_bytes(self.page_size)} {state}>")

    # The hook lists live on the context (its `allocate` and `relieve` run them); these read, append
    # to or replace them there.
    on_compact = _context_list("on_compact", "Callbacks `f(report)` after every compaction (a list: append to it).")
    on_oom = _context_list("on_oom", "Callbacks `f(error)` with the `OutOfMemoryError` just before an allocation "
                                     "raises it.")
    on_pressure = _context_list("on_pressure", "Callables run (outside the lock) before an explicit compaction or "
                                               "trim, to hand back memory cached elsewhere (`pool.capture()` adds "
                                               "PyTorch's cached segments).")

    # ------------------------------------------------------------------ the fast path
    def _attach_fast(self) -> None:
        """Let the native fast path serve `empty` and make this pool's storages (gate held)."""
        context = self._context
        if not context.can_swap:
            return  # "rebind" mode must know every tensor it made
        try:
            # The default stream is known without asking torch (see PoolContext.current_stream): its c10 id is 0.
            cpp = fastpath.wait().FastPath(
                self.core.books, threads.owner_ref, list(tz.SUPPORTED_DTYPES), self.device.type,
                self.device.index or 0, self.driver.stale_probe_fd(), DEFAULT_STREAM_ID)
        except Exception:  # never fatal: the Python path does everything the fast path does
            _log.warning("defrag: the allocation fast path could not attach to %s; using the Python path\n%s",
                         self.core.label, traceback.format_exc())
            return
        self.core.fast = cpp
        self.core.make_face = _native_face_maker(self.core.space.regions, _weakly(self._movable_torch_blocks))
        cpp.set_room(_weakly(self._room))
        if type(self).empty is Pool.empty:  # a subclass's own empty() stays in charge
            # `pool.empty` straight into C++ (the same as `Pool.empty`, without its Python frame).
            self.empty = cpp.bind_empty(Pool._empty_after_miss, weakref.ref(self))
        context.update_fast()

    def _room(self, nbytes: int, origin: int, stream: int = 0):
        """Place a block of `nbytes` for `stream` through the ladder for native code that could not place
        it (the fast path's room, `FastPath.set_room`: called with the GIL by a thread Python never saw,
        origin 1, or by PyTorch's CPU or CUDA allocator entries, origin 2, which then attach the block).
        Its face is pinned and belongs to no thread: PyTorch, or a C++ thread, holds its raw pointer.

        Returns (address, its Block); else a str, the pool's explained OOM (raised to the program as
        torch.OutOfMemoryError); else None: the pool does not serve it (closed, asleep, the fast path
        off). For PyTorch's allocator the ladder stops before compacting: PyTorch may allocate in the
        middle of an op whose inputs' addresses it has read (an output, a workspace), so moving pool
        tensors there is unsafe. Never raises (it is called across the C boundary)."""
        allocator = origin == 2
        try:
            context = self._context
            fast = context.fast
            if fast is None or not (fast.serves_allocator if allocator else fast.enabled):
                return None
            with self.core.gate:
                context.enter()
                block = context.allocate(nbytes, compact=not allocator, stream=stream)
                # PyTorch's CPU allocator's block moves only at a safe point (defrag.owners); a C++
                # thread's, or one PyTorch's CUDA allocator wraps in a DataPtr of its own, never does.
                block.pins, block.owner = (0 if allocator and self._movable_torch_blocks() else 1), None
                block.info = TensorInfo(None if allocator else torch.uint8, (nbytes,), None,
                                        "allocator" if allocator else "empty")
            return block.address, block
        except OutOfMemoryError as exc:
            if not allocator:
                return str(exc)
            return refused_inside_allocator(exc)
        except StaleAccessError as exc:
            return str(exc)
        except (PoolClosedError, PoolAsleepError):
            return None
        except Exception as exc:
            _log.error("defrag: placing a block for native code failed\n%s", traceback.format_exc())
            return f"defrag: making room for {nbytes} bytes failed: {exc!r}"

    def _movable_torch_blocks(self) -> bool:
        """Whether PyTorch's blocks in this pool can move at safe points: this pool is PyTorch's CPU
        allocator, whose DataPtrs the owner match recognizes (defrag.owners). The CUDA routes' DataPtrs
        are PyTorch's own (the pluggable route) or the backend's: those blocks stay pinned."""
        return cpu_allocator.installed() is self

    # ------------------------------------------------------------------ release
    def _on_release(self, block: Block) -> None:
        """Runs when torch drops a Python-path block's owner (the fast path off): any thread, any time.
        Releases it in the books (at once, or when the thread inside the gate leaves); after close,
        also gives back what nothing uses any more."""
        self.core.release(block)
        if self.core.closed:
            self._release_after_close()

    def _release_after_close(self) -> None:
        """A block died after close: give everything back once nothing lives (the books' close hook calls
        this too, with the GIL). When the block died inside one of this pool's own calls on this thread
        (the collector ran there), after that call."""
        if self.core.gate.run_outside(self._release_after_close):
            return
        with self.core.gate:
            self.core.drain()
            self._context.release_if_idle()

    # ------------------------------------------------------------------ public: creation
    def empty(self, *shape, dtype: torch.dtype | None = None, requires_grad: bool = False) -> torch.Tensor:
        """An uninitialized tensor over pool memory (an ordinary torch tensor).

        Zero-element tensors hold no pool memory: they are plain `torch.empty`
        results on `pool.device`. Any size mapped free space holds is served
        by the C++ fast path when it is attached (`defrag.fastpath`).
        """
        fast = self._context.fast
        if fast is not None and not requires_grad:
            tensor = fast.empty(shape, dtype)
            if tensor is not None:
                return tensor
        return self._empty_after_miss(*shape, dtype=dtype, requires_grad=requires_grad)

    def _empty_after_miss(self, *shape, dtype: torch.dtype | None = None, requires_grad: bool = False):
        """`empty` once the fast path declined (also the fallback of the C function `_attach_fast` binds
        as this pool's `empty`): the Python path, the ladder, errors included."""
        if len(shape) == 1 and not isinstance(shape[0], int):
            shape = shape[0]
        shape = tz.check_shape(shape)
        return self._new_tensor(shape, tz.contiguous_strides(shape), dtype, requires_grad)

    def empty_strided(self, size, stride, *, dtype: torch.dtype | None = None,
                      requires_grad: bool = False) -> torch.Tensor:
        """Like `torch.empty_strided`: an uninitialized tensor of `size` with `stride`, over one pool block
        just large enough for the elements those strides reach."""
        size = tz.check_shape(size)
        stride = tz.check_shape(stride)
        if len(stride) != len(size):
            raise ValueError(f"empty_strided: {len(size)} sizes but {len(stride)} strides")
        return self._new_tensor(size, stride, dtype, requires_grad)

    def _new_tensor(self, shape: tuple, stride: tuple, dtype, requires_grad: bool) -> torch.Tensor:
        """A tensor over a new block placed through the ladder (the block placed once: the fast path, when
        attached, makes the tensor over that very block)."""
        dtype = tz.check_dtype(dtype if dtype is not None else torch.get_default_dtype())
        if len(shape) == 1 and stride[0] == 1:
            elements = shape[0]
        else:
            elements = 0 if 0 in shape else 1 + sum((n - 1) * st for n, st in zip(shape, stride))
        nbytes = elements * dtype.itemsize
        context = self._context
        with self.core.gate:
            context.enter()
            if nbytes == 0:
                return torch.empty_strided(shape, stride, dtype=dtype, device=self.device,
                                           requires_grad=requires_grad)
            block = context.allocate(nbytes, stream=context.current_stream())
            tensor = context.tensor_for(block, dtype, shape, stride)
            if self.core.history is not None:
                self.core.history.block_allocated(block)
        if not context.can_swap:  # "rebind" mode only: otherwise no weakref on users' tensors (swap_tensors works)
            block.info.tensors.append(weakref.ref(tensor))
        if requires_grad:
            tensor.requires_grad_(True)
        return tensor

    def zeros(self, *shape, dtype=None, requires_grad=False) -> torch.Tensor:
        """Like `empty`, filled with zeros."""
        t = self.empty(*shape, dtype=dtype)
        with torch.no_grad():
            t.zero_()
        return t.requires_grad_(requires_grad)

    def full(self, shape, fill_value, *, dtype=None, requires_grad=False) -> torch.Tensor:
        """Like `empty`, filled with `fill_value`; without `dtype`, inferred from it as `torch.full` does."""
        if dtype is None:
            dtype = torch.tensor(fill_value).dtype
        t = self.empty(shape, dtype=dtype)
        with torch.no_grad():
            t.fill_(fill_value)
        return t.requires_grad_(requires_grad)

    def empty_like(self, other: torch.Tensor, *, dtype=None, requires_grad=False) -> torch.Tensor:
        """A contiguous uninitialized tensor with `other`'s shape (and dtype unless given)."""
        if not isinstance(other, torch.Tensor):
            raise TypeError(f"empty_like needs a tensor, got {type(other).__name__}")
        return self.empty(tuple(other.shape), dtype=dtype or other.dtype, requires_grad=requires_grad)

    def zeros_like(self, other: torch.Tensor, *, dtype=None, requires_grad=False) -> torch.Tensor:
        """A contiguous zero-filled tensor with `other`'s shape (and dtype unless given)."""
        t = self.empty_like(other, dtype=dtype)
        with torch.no_grad():
            t.zero_()
        return t.requires_grad_(requires_grad)

    def resize_(self, tensor: torch.Tensor, *shape) -> torch.Tensor:
        """Resize a pool tensor in place, as `tensor.resize_(*shape)` does, growing it inside the pool.

        torch's own `resize_` (and `out=` into a too-small pool tensor) cannot
        grow a pool tensor: its storage is memory the pool lent, which torch
        cannot reallocate ("Trying to resize storage that is not resizable").
        Here a shape that fits the storage is applied by torch; a larger one
        gets a new pool block holding the old bytes (the rest uninitialized),
        and `tensor` (the same Python object) is set to it. Other views of the
        old storage keep the old memory, which is freed when they die.
        Returns `tensor`.
        """
        if len(shape) == 1 and not isinstance(shape[0], int):
            shape = shape[0]
        shape = tz.check_shape(shape)
        with self.core.gate:
            self._context.enter()
            self._ownership.block_of(tensor, "resize_")
        need = (tensor.storage_offset() + math.prod(shape)) * tensor.element_size()
        if need <= tensor.untyped_storage().nbytes():
            with torch.no_grad():
                return tensor.resize_(shape)
        fresh = self.empty(shape, dtype=tensor.dtype)
        old = tensor.detach().reshape(-1) if tensor.is_contiguous() else tensor.detach().contiguous().reshape(-1)
        with torch.no_grad():
            fresh.view(-1)[:old.numel()].copy_(old)
            tensor.set_(fresh.untyped_storage(), 0, shape, tz.contiguous_strides(shape))
        return tensor

    # ------------------------------------------------------------------ ownership (TensorOwnership)
    def owns_address(self, ptr: int) -> bool:
        """Whether `ptr` lies in this pool's virtual address space."""
        return self._ownership.owns_address(ptr)

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor`'s storage is a live block of this pool."""
        return self._ownership.owns(tensor)

    def pin(self, tensor: torch.Tensor) -> None:
        """Keep `tensor`'s storage where it is: compaction never moves a pinned block.

        Pins count: each `pin` needs an `unpin`. Pinning a tensor that is not
        in this pool raises ValueError and changes nothing.
        """
        self._ownership.pin(tensor)

    def unpin(self, tensor: torch.Tensor) -> None:
        """Undo one `pin`. ValueError if the tensor is not pinned."""
        self._ownership.unpin(tensor)

    def share(self, tensor: torch.Tensor) -> None:
        """Declare that several threads use `tensor`: no thread owns its block any more.

        A shared block is never moved by a compaction that other running
        threads could overlap (the default, or `threads="own"`); it moves only
        when no other thread that used the pool runs. Use it for tensors
        handed to other threads that keep using them (weights read by worker
        threads, a cache filled by one thread and read by another). `claim`
        undoes it.
        """
        self._ownership.share(tensor)

    def claim(self, tensor: torch.Tensor) -> None:
        """Make the calling thread the only user of `tensor`: its own compactions may move it.

        For hand-offs: a batch made by a loader thread and from now on used only
        by this one, or a shared tensor no other thread touches any more. The
        previous owner's compactions stop moving it.
        """
        self._ownership.claim(tensor)

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        """Declare that `tensor` is used on `stream`: its block is reused only after
        that stream's work queued before the free has completed (CUDA). A no-op
        on the emulated device, where every operation is synchronous."""
        self._ownership.record_stream(tensor, stream)

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
        return self._ownership.adopt(obj)

    # ------------------------------------------------------------------ residency (PoolResidency)
    @property
    def asleep(self) -> bool:
        """Whether the pool sleeps (between `sleep()` and `wake()`)."""
        return self._residency.asleep

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
        return self._residency.sleep(discard=discard, progress=progress)

    def wake(self, *, progress: bool | None = None) -> "residency.ResidencyReport":
        """Map device pages where the pool slept and copy every kept byte back (see `sleep`).

        `ResidencyError` when the pool is awake. When the device cannot
        supply the pages (or any driver call fails) the pool stays asleep
        with every byte kept, and the error says so: call it again later.
        `StaleAccessError` (the pool still asleep, nothing changed) when a
        tensor of the pool was touched while it slept (emulated device): the
        access read zeros or lost its write, and is reported once, here.
        """
        return self._residency.wake(progress=progress)

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
        return self._residency.offload(tensors, pack=pack, progress=progress)

    def reload(self, tensors=None, *, progress: bool | None = None) -> "residency.ResidencyReport":
        """Bring offloaded tensors' pages back to device memory (None: every offloaded page).

        Every tensor on those pages comes back; tensors that are not
        offloaded are left alone. Needs a free device page per page (the
        pool's capacity); `ResidencyError` otherwise, with nothing changed.
        Returns a `ResidencyReport`.
        """
        return self._residency.reload(tensors, progress=progress)

    # ------------------------------------------------------------------ meshing (PoolMeshing)
    def mesh(self, *, release: bool = False, threads: str | None = None, engine: str | None = None) -> MeshReport:
        """Share physical pages between pages whose live bytes are disjoint at page offsets, moving no
        tensor (every address stays; pinned tensors and PyTorch-owned blocks too): each group's live
        bytes are copied into one physical page mapped at every page of the group, and the others'
        physical pages are freed (cached; released to the device with `release=True`).
        `threads` and `engine` as for `compact`. A driver fault rolls back the group it hit (every byte and
        mapping as before) and is raised. Returns a `defrag.mesher.MeshReport`."""
        return self._meshing.mesh(release=release, threads=threads, engine=engine)

    def unmesh(self) -> int:
        """Give every meshed page a physical page of its own again (bytes intact); returns how many.
        ValueError (nothing changed for the rest) when the pool has too few free physical pages."""
        return self._meshing.unmesh()

    # ------------------------------------------------------------------ raw segments for PyTorch's allocator (AllocatorSegments), capture
    def alloc_segment(self, nbytes: int, stream: int = 0, *, compact: bool = True) -> int:
        """Raw device memory for PyTorch's allocator: `nbytes` in pool pages; returns its address.

        Climbs the same ladder as `empty` (empty mapped pages, stitching, then
        compacting this pool's movable tensors) and raises OutOfMemoryError
        when nothing helps. Makes no torch allocation: a compaction here only
        copies with the driver or the numba kernel and swaps storages. The
        segment belongs to no thread and never moves; `free_segment` gives it
        back. `stream`: the CUDA stream PyTorch allocates it for. `compact`:
        False stops the ladder before compacting (see `defrag.capture`).
        """
        return self._allocator_segments.alloc_segment(nbytes, stream, compact=compact)

    def free_segment(self, address: int) -> bool:
        """Give back a segment from `alloc_segment`; False (and nothing changes) if `address` is not one.

        Works after `close()` too (PyTorch may free its cached segments late).
        On CUDA the range is reused at once on the segment's stream; another stream waits for it on the
        device first (the books' fence).
        """
        return self._allocator_segments.free_segment(address)

    def segments(self) -> list[tuple[int, int]]:
        """(address, bytes) of every segment handed to PyTorch's allocator and not given back."""
        return self._allocator_segments.segments()

    def capture(self, *, allocator=None):
        """`with pool.capture():` routes this thread's PyTorch CUDA allocations to pool pages (see `defrag.capture`)."""
        return capture_block(self, allocator=allocator)

    def release_cached(self) -> int:
        """Hand back to the pool the segments PyTorch caches for `capture()` blocks and no longer uses, through
        every allocator the pool was captured with (`defrag.capture.release_cached`); their bytes."""
        return release_captured(self)

    # ------------------------------------------------------------------ observability (PoolObservability), snapshots
    def stats(self) -> dict:
        """Counters and gauges; PyTorch's key grammar where PyTorch has the key.

        `allocated_bytes.all.*`: bytes in live blocks (rounded to 512);
        `reserved_bytes.all.*`: mapped physical bytes; `active_bytes.all.*`:
        allocated plus blocks released but waiting on stream events;
        `pages.{mapped,cached,total,empty}`; `stranded_bytes`: free bytes inside
        pages that hold live data (what compaction can recover);
        `largest_free_bytes`: the largest request that succeeds now without
        compaction; `fragmentation`: stranded / reserved.
        """
        return self._observability.stats()

    def reset_peak_stats(self) -> None:
        """Reset every `*.peak` statistic to its current value (like `torch.cuda.reset_peak_memory_stats`)."""
        self._observability.reset_peak_stats()

    def check_invariants(self) -> None:
        """Raise AssertionError if any of DESIGN.md's pool invariants is broken (a test aid); see `Core`."""
        self._observability.check_invariants()

    def layout(self) -> dict:
        """A plain-dict picture of the pool (for `defrag.viz` and snapshots).

        `regions`: base, npages and a per-page state ("unmapped", "empty" for a
        mapped page holding no block, "live"); `blocks`: every block with its
        address, size (rounded), nbytes, region index, pinned, dtype, shape and
        state ("live", "retired" or "pending-free"); plus page_size, capacity
        and cached pages.
        """
        return self._observability.layout()

    def record_history(self, enabled: bool = True, *, max_entries: int = 100_000, stacks: bool = True) -> None:
        """Start (or stop) recording alloc/free/map/unmap/compaction events for `snapshot()`.

        `stacks`: record the Python frames that led to each allocation and OOM
        (the caller's frames, not defrag's), as `torch.cuda.memory.
        _record_memory_history(stacks="python")` does; they show in the
        trace entries and in the snapshot's blocks. Costs a few microseconds
        per allocation while recording.
        """
        self._observability.record_history(enabled, max_entries=max_entries, stacks=stacks)

    def snapshot(self) -> dict:
        """The pool in the format of `torch.cuda.memory._snapshot()` (segments and device_traces)."""
        return observe.snapshot(self)

    def summary(self) -> str:
        """A human-readable table in the spirit of `torch.cuda.memory_summary()`."""
        return observe.summary(self.stats(), self)

    # ------------------------------------------------------------------ inspection
    def live_tensors(self) -> list[LiveTensor]:
        """Every live block, in address order, as a `compact()` called from this thread sees it (a safe
        point: the owners of PyTorch-made blocks are matched first, `defrag.owners`)."""
        with safe_point([self]), self.core.gate:
            self.core.drain()
            scope = self.core.scope(None)
            out = []
            backing = self.core.backing
            for block in sorted(self.core.blocks(), key=lambda b: b.address):
                if block.retired:
                    continue
                reason = scope.blocker(block, self._context.mover.can_rewrite)
                info = block.info
                first, end = backing.pages_of(block)
                meshed = bool((backing.mesh_ids[block.region.index][first:end] >= 0).any())
                out.append(LiveTensor(block.address, block.nbytes, block.size, getattr(info, "dtype", None),
                                      getattr(info, "shape", None), block.pins > 0, not reason, reason,
                                      "shared" if block.shared else threads.describe(block.owner), meshed))
            return out

    # ------------------------------------------------------------------ trim / close
    def trim(self, *, mesh: bool = True) -> int:
        """Unmap pages that hold no block and release every cached physical page.

        Returns the number of bytes handed back to the driver. Live tensors are
        never moved. First (`mesh=True`, the default), pages whose live bytes
        are disjoint share physical pages (`Pool.mesh`), so that trim gives
        back the most; a driver fault there rolls that mesh back and is logged.
        """
        self._context.relieve()
        with self.core.gate:
            self.core.check_open()
            return (self._meshing.mesh_to_release() if mesh else 0) + self.core.trim()

    def close(self) -> None:
        """Close the pool: no new allocations; memory goes back to the driver.

        Closing never unmaps memory under a live tensor: pages still holding
        live tensors stay mapped until the last of those tensors dies, then
        everything is released automatically. Idempotent.
        """
        if not self.core.closed:
            cpu_allocator.uninstall_pool(self)  # before the gate: PyTorch's allocations stop coming here first
        with self.core.gate:
            if self.core.closed:
                return
            residency.close(self.core)  # holds of offloaded tensors, fillers, a sleep's host buffer
            self.core.drain()
            self.core.wait_pending()
            self.core.closed = True
            if self._context.fast is not None:
                self._context.fast.close()  # no more fast allocations
            self.core.books.close()  # later releases call _release_after_close
            _open_pools.discard(self)
            self._context.release_if_idle()

    # ------------------------------------------------------------------ compaction
    def compact(self, *, verify: bool = False, progress: bool | None = None, engine: str | None = None,
                release: bool = False, threads: str | None = None, mesh: bool = True) -> CompactionReport:
        """Move live tensors so that the pages they strand become free; see `defrag.compactor`.

        `verify`: compare checksums of every moved block; `progress`: a progress
        bar (None: only for large compactions); `engine`: "auto" (GPU default:
        the move kernel, and the copy engine for the largest moves; see
        `defrag.copying`), "kernel", "memmove" (emulated default) or "driver"; `release`: also
        unmap every empty page at the end (default False: emptied pages stay
        mapped and free, so the next request needs no driver call; a request
        that needs their physical page unmaps them then, and `trim()` returns
        them to the device). A compaction never frees device memory by itself:
        its unmapped pages' handles stay cached in the pool.

        `threads` says whose tensors may move (the module docstring has the
        contract): None (default) moves the calling thread's own tensors,
        those of threads waiting inside a call to this pool, and every
        unpinned tensor when no other thread that used the pool still runs;
        "own" only the caller's; "all" every unpinned one, shared ones
        included, and raises ConcurrencyError (changing nothing) while another
        thread that used the pool still runs.
        `mesh` (default True): after the moves, the pages of tensors that
        could not move (pinned ones, other threads', PyTorch's own blocks under
        `defrag.install`) share physical pages where their live bytes are
        disjoint at page offsets (`Pool.mesh`; no tensor moves, no address
        changes). Nothing is meshed when every tensor could move.
        Returns a `CompactionReport`.
        """
        self._context.relieve()
        with safe_point([self]), self.core.gate:
            self.core.check_open()
            scope = self.core.scope(threads)
            return compact_core(self.core, self._context.mover, verify=verify, progress=progress, engine=engine,
                                automatic=False, release=release, scope=scope, callbacks=self.on_compact, mesh=mesh)
