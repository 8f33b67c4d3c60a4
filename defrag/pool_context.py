"""`PoolContext`: what the parts of a `defrag.pool.Pool` share, and the face's data on its blocks.

`Pool` is composed of parts, one object each, every one built over the same
`PoolContext`: `TensorOwnership` (`defrag.pool_ownership`), `PoolResidency`
(`defrag.pool_residency`), `PoolMeshing` (`defrag.pool_meshing`),
`AllocatorSegments` (`defrag.pool_segments`) and `PoolObservability`
(`defrag.pool_observability`). A part reaches the pool only through its
context (and the parts it is given), never through `Pool`. The context holds:

- what the pool is: `id`, `core` (the torch-free `defrag.core.Core`),
  `device`, `kind`, and how a storage takes new memory (`swap_mode`,
  `can_swap`), fixed for the pool's life;
- `mover` (`_TorchMover`, the compaction's callbacks for torch storages) and
  `fast` (the native `FastPath` over the core's books, the core's own
  `Core.fast`; None while the Python path serves alone);
- the pool's hook lists `on_compact`, `on_oom` and `on_pressure` (the very
  lists `Pool` shows);
- the operations every part builds on: `enter` (the start of a mutating
  call), `allocate` (the ladder, ending in `OutOfMemoryError`),
  `storage_for` / `tensor_for` / `storage_over` (a storage or tensor over a
  block), `find` (the block of a tensor), `release_if_idle` (everything back
  to the driver once nothing lives after close), `update_fast` (whether the
  fast path may serve), `current_stream` and `relieve` (the `on_pressure`
  hooks).

Every operation expects the core's gate held, except `current_stream` and
`relieve` (which runs the hooks outside it). The context knows nothing of the
other open pools, of `Pool`'s public methods, or of the parts.

`TensorInfo` and `SegmentInfo` are what the torch face keeps on a block
(`Block.info`): a user's storage, or a raw segment handed to PyTorch's
allocator.
"""

from __future__ import annotations

import logging
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from . import fastpath
from . import owners as owners_
from . import tensors as tz
from .capture import in_callback
from .compactor import rescue
from .core import Block, Core, OutOfRoom
from .oom import OutOfMemoryError

_log = logging.getLogger("defrag")
# A CUDA device's default stream, known without asking torch (whose stream queries initialize its
# CUDA allocator): its cudaStream_t is the legacy default stream, 0.
DEFAULT_STREAM_HANDLE = 0


@dataclass(eq=False, slots=True)
class TensorInfo:
    """What the torch face keeps on a block (`Block.info`): its storage and what it was made as."""

    dtype: torch.dtype | None = None
    shape: tuple[int, ...] | None = None
    storage_ref: object | None = None  # StorageWeakRef to the user's storage
    origin: str = "empty"  # empty | adopt | allocator (PyTorch's CPU or CUDA allocator made it: defrag.install)
    tensors: list = field(default_factory=list)  # weakrefs to the tensors the pool made ("rebind" mode only)
    kind: str = "tensor"


@dataclass(eq=False)
class SegmentInfo:
    """What the torch face keeps on a raw segment handed to PyTorch's allocator (`Pool.alloc_segment`).

    PyTorch sub-allocates tensors inside a segment, so the pool cannot know
    who uses it: a segment never moves. Its bytes count as allocated.
    """

    kind: str = "segment"


def _owner_ref(info):
    """The weak reference to the storage that owns a block with face data `info`, or None where nothing
    can be held: no data, a segment of PyTorch's allocator (PyTorch sub-allocates inside it), or no
    storage recorded."""
    return None if info is None or isinstance(info, SegmentInfo) else info.storage_ref


class PoolContext:
    """What the parts of one `Pool` share: its core and device, its mover and fast path, its hooks, and
    the handful of operations every part builds on (see the module docstring).

    `on_release(block)`: what a Python-path storage's death calls (the pool's
    release hook: the block's release, then, after close, the pool's own
    giving back). `finalizer`: the pool's `weakref.finalize` that gives the
    address space back; `release_if_idle` runs it once, when nothing lives
    after close.
    """

    def __init__(self, pool_id: int, core: Core, device: torch.device, swap_mode: str, *, on_release, finalizer):
        self.id = pool_id
        self.core = core
        self.device = device
        self.kind = core.kind
        # How a moved storage takes its new memory, fixed for the pool's life: torch's
        # _swap_data_ptr_, else defrag's small extension (built on first use, once per
        # machine), else rebinding the tensors the pool knows (views pin blocks).
        self.swap_mode = swap_mode
        self.can_swap = swap_mode != "rebind"
        self.on_compact: list = []  # callbacks(report) after every compaction
        self.on_oom: list = []  # callbacks(OutOfMemoryError) before an allocation raises it
        # Callables run (outside the lock) before an explicit compaction or trim, to hand
        # back memory cached elsewhere (pool.capture() adds PyTorch's cached segments).
        self.on_pressure: list = []
        self.on_release = on_release
        self.finalizer = finalizer
        self.mover = _TorchMover(self)
        # The owners of PyTorch-made blocks found by the safe point of the compaction running now
        # (`defrag.owners.match`; gate held); None outside one: then no PyTorch-made block moves.
        self.owners: owners_.OwnerMatch | None = None
        # PyTorch-made blocks moved, ever (the summary line and `--report` count them).
        self.torch_moved_blocks = 0
        self.torch_moved_bytes = 0

    @property
    def fast(self):
        """The native `FastPath` that makes this pool's storages and serves `empty` (the core's, set when
        it attaches), or None: the Python path serves alone."""
        return self.core.fast

    # ------------------------------------------------------------------ calls
    def enter(self) -> None:
        """The start of every mutating call (gate held): open, no stale access, releases applied."""
        self.core.check_open()
        self.core.drain()

    def relieve(self) -> None:
        """Run the `on_pressure` hooks, outside the lock (never from inside PyTorch's allocator)."""
        if in_callback():
            return
        for hook in list(self.on_pressure):
            try:
                hook()
            except Exception:  # a hook that fails must not stop the compaction or trim it helps
                _log.error("defrag: an on_pressure hook raised; ignored\n%s", traceback.format_exc())

    def current_stream(self) -> int:
        """The cudaStream_t torch runs on now (0 on the emulated device).

        Asks torch only once torch has initialized CUDA itself: its stream
        queries initialize its CUDA allocator, after which `defrag.install`
        can no longer replace it. Before that no stream can have been made
        current (making a torch stream initializes CUDA), so the answer is
        the default stream.
        """
        if self.kind == "cuda" and torch.cuda.is_initialized():
            return torch.cuda.current_stream(self.device).cuda_stream
        return DEFAULT_STREAM_HANDLE

    def update_fast(self) -> None:
        """Let the fast path serve only while nothing needs the Python path's eyes (gate held). PyTorch's
        allocator entries (`defrag.install`) keep serving while the pool records history: the books log
        their blocks for the recorder."""
        if self.fast is not None:
            core, cpp = self.core, self.fast
            serves = not (core.closed or core.space.sleeping)
            cpp.enabled = serves and core.history is None
            cpp.serves_allocator = serves

    def release_if_idle(self) -> None:
        """After close (gate held): everything back to the driver once no block lives (the pool's
        finalizer, exactly once); while some live, what holds none."""
        if self.core.has_live_blocks() or self.finalizer is None:
            if any(True for _ in self.core.blocks()):
                self.core.give_back_idle()  # keep what is live; give back the rest now
            return
        self.finalizer()  # the address space's release_all, exactly once
        self.finalizer = None

    # ------------------------------------------------------------------ allocation
    def allocate(self, nbytes: int, *, compact: bool = True, stream: int = 0) -> Block:
        """Place `nbytes` for `stream` (the ladder, with automatic compaction); OutOfMemoryError when
        nothing helps."""
        try:
            return self.core.allocate(nbytes, self._rescue if compact else None, self._describe, stream,
                                      can_rewrite=self.mover.can_rewrite)
        except OutOfRoom as room:
            error = OutOfMemoryError(room.message, **room.figures)
        for observer in list(self.on_oom):
            try:
                observer(error)
            except Exception:  # an observer must not replace the OOM the caller is about to get
                _log.error("defrag: an on_oom observer raised; ignored\n%s", traceback.format_exc())
        raise error

    def _rescue(self, nbytes: int, tried: list[str]) -> Block | None:
        # The automatic trigger of a Python caller (pool.empty and the like): a safe point for PyTorch's
        # blocks too.
        with safe_point([self]):
            return rescue(self.core, self.mover, nbytes, tried, self.on_compact)

    def _describe(self, block: Block) -> str:
        info = block.info
        if info is None:
            return ""
        if isinstance(info, SegmentInfo):
            return "(a segment of PyTorch's allocator)"
        if getattr(info, "origin", None) == "allocator":  # defrag.install: the pool is PyTorch's allocator
            return "(PyTorch's CUDA allocator)" if self.kind == "cuda" else "(PyTorch's CPU allocator)"
        dtype = str(info.dtype).replace("torch.", "") if info.dtype else ""
        return f"{dtype}{list(info.shape) if info.shape is not None else ''}"

    # ------------------------------------------------------------------ storages and tensors over blocks
    def storage_over(self, block: Block) -> torch.UntypedStorage:
        """A storage over `block` whose death releases it (made in C++ over the block's record, or, the fast
        path off, one whose release hook the block keeps)."""
        if self.fast is not None:
            return self.fast.storages([block.address], [block], [block.nbytes])[0]
        storage, block.keepalive = tz.storage_over(self.kind, self.device, block.address, block.nbytes,
                                                   self.on_release, block)
        return storage

    def _record(self, block: Block, dtype, shape, storage: torch.UntypedStorage, origin: str) -> None:
        """The block's TensorInfo for the user's storage over it."""
        block.info = TensorInfo(dtype, shape, tz.weak_storage(storage), origin)

    def storage_for(self, block: Block, dtype, shape, origin: str = "empty") -> torch.UntypedStorage:
        """The user's storage over a new block, with the block's TensorInfo."""
        storage = self.storage_over(block)
        self._record(block, dtype, shape, storage, origin)
        return storage

    def tensor_for(self, block: Block, dtype, shape: tuple, stride: tuple) -> torch.Tensor:
        """The user's tensor over a new block (its own storage), with the block's TensorInfo. On failure the
        block is released (its storage may have been made and died already)."""
        try:
            if self.fast is not None:
                tensor = self.fast.tensor_over(block.address, block, list(shape), list(stride), dtype)
            else:
                tensor, block.keepalive = tz.tensor_at(self.kind, self.device, block.address, block.nbytes, dtype,
                                                       shape, stride, self.on_release, block)
        except BaseException:
            self.core.release(block)
            raise
        self._record(block, dtype, shape, tensor.untyped_storage(), "empty")
        return tensor

    def find(self, tensor: torch.Tensor) -> Block | None:
        """The live block under `tensor`'s storage, or None if it is not pool memory.

        Pool storages always start at their block's address, so this is one lookup.
        """
        return self.core.block_at(tensor.untyped_storage().data_ptr())


@contextmanager
def safe_point(contexts):
    """With-block: a safe point for the pools of `contexts` (the caller runs no torch operation, and no
    other thread may be in the middle of one): the owners of their PyTorch-made blocks are matched once
    for all of them (`defrag.owners.match`; pools PyTorch's allocator never used are skipped there) and
    held on each context's `owners` for the compactions inside. A context already inside a safe point
    keeps its match."""
    fresh = [context for context in contexts if context.owners is None]
    found = owners_.match(fresh) if fresh else {}
    for context in fresh:
        context.owners = found.get(context.id)
    try:
        yield
    finally:
        for context in fresh:
            context.owners = None


class _TorchMover:
    """The compaction's callbacks for torch storages (see `defrag.compactor.Mover`), over a pool's context."""

    def __init__(self, context: PoolContext):
        self.context = context

    def stream(self) -> int:
        return self.context.current_stream()

    def can_rewrite(self, block: Block) -> str:
        info = block.info
        if isinstance(info, SegmentInfo):
            return "a segment of PyTorch's allocator (capture): PyTorch sub-allocates inside it, so it never moves"
        if owners_.moves_forbidden():
            return owners_.NO_MOVES_REASON
        if self._torch_made(block):
            return self._torch_made_verdicts([block])[0]
        if info is None or info.storage_ref is None or info.storage_ref.expired():
            return "its storage is being released"
        if not self.context.can_swap and self.rebindable(block) is None:
            return ("torch < 2.12 lacks UntypedStorage._swap_data_ptr_ (and the storage-swap extension could not "
                    "be built), and views or other references to this storage exist that the pool cannot rewrite")
        return ""

    @staticmethod
    def _torch_made(block: Block) -> bool:
        info = block.info
        return isinstance(info, TensorInfo) and info.origin == "allocator"

    def rebindable(self, block: Block, storage=None) -> list | None:
        """Rebind mode: the tensors to rebind, if they are provably all users of the storage.

        Pass the caller's own strong `storage` reference if it holds one (it is
        the one reference the proof allows besides the tensors).
        """
        storage = storage if storage is not None else tz.strong_storage(block.info.storage_ref)
        if storage is None:
            return None
        known = [t for t in (r() for r in block.info.tensors) if t is not None]
        return known if tz.rebind_proof(storage, known) else None

    def grip(self, block: Block):
        return self.grip_all([block])[0]

    def grippable(self, blocks: list) -> list:
        # `grip_all`'s verdict without the storages: whether each has an owner to grip.
        if owners_.moves_forbidden():
            return [False] * len(blocks)
        verdicts = self._torch_made_verdicts(blocks)
        return [(not verdicts[i]) if i in verdicts else _owner_ref(block.info) is not None
                for i, block in enumerate(blocks)]

    def _torch_made_verdicts(self, blocks: list) -> dict:
        """{index: why it may not move ("" when it may)} for the PyTorch-made blocks among `blocks`, in one
        call to the books. Such a block moves only where the safe point's match found its one owner (which
        the compaction rewrites in place, `FastPath.rebase`) and no raw copy of its address is known."""
        made = [i for i, block in enumerate(blocks) if self._torch_made(block)]
        if not made:
            return {}
        owners = self.context.owners
        if owners is None:
            return dict.fromkeys(made, owners_.NOT_MATCHED)
        if not self.context.can_swap:
            return dict.fromkeys(made, "made by PyTorch's allocator, and torch < 2.12 lacks "
                                       "UntypedStorage._swap_data_ptr_ (and the storage-swap extension could "
                                       "not be built)")
        return dict(zip(made, owners.verdicts([blocks[i].address for i in made])))

    def grip_all(self, blocks: list) -> list:
        # `can_rewrite`'s verdict included: a segment or a dead storage has no grip. PyTorch-made blocks:
        # the storages the safe point's match found (one native call for all of them).
        if owners_.moves_forbidden():
            return [None] * len(blocks)
        lock = torch.UntypedStorage._new_with_weak_ptr  # `tz.strong_storage`, inlined
        swap = self.context.can_swap
        verdicts = self._torch_made_verdicts(blocks)
        made = [i for i, why in verdicts.items() if not why]
        owned = {}
        if made:
            found = self.context.fast.owner_storages([blocks[i].address for i in made])
            owned = {i: storage for i, storage in zip(made, found) if storage is not None}
        grips = []
        for index, block in enumerate(blocks):
            if index in verdicts:  # PyTorch-made
                storage = owned.get(index)
                grips.append(None if storage is None or not swap else (storage, None))
                continue
            ref = _owner_ref(block.info)
            storage = None if ref is None else lock(ref.cdata)
            if storage is None:
                grips.append(None)
            elif swap:
                grips.append((storage, None))
            else:
                rebind = self.rebindable(block, storage)
                grips.append(None if rebind is None else (storage, rebind))
        return grips

    def destinations(self, blocks: list) -> list:
        context = self.context
        if context.fast is not None:
            return context.fast.storages([block.address for block in blocks], blocks,
                                         [block.nbytes for block in blocks])
        return [context.storage_over(block) for block in blocks]

    def _rebases(self) -> bool:
        # The owners take their new memory in place (`FastPath.rebase`) where the fast path made it
        # and the old ranges go back to the books at once (`lets_go`).
        return self.context.fast is not None and self.lets_go()

    def check(self, old: Block, held, dest) -> bool:
        user = held[0]
        return user.nbytes() == dest.nbytes() and user.data_ptr() == old.address

    def lets_go(self) -> bool:
        # Swapped: the temporary `dest` owns each old range alone, and dies with the compaction's
        # references. Rebind mode: the old storage dies only once every reference to it is gone.
        return self.context.can_swap

    def move_in_place(self, olds: list, addresses: list, grips: list) -> int | None:
        # One C++ call for the whole wave: every owner rebased in place (`FastPath.rebase`). None
        # where some owner's memory was not the fast path's: the wave then swaps with temporaries.
        if not self._rebases():
            return None
        failed = self.rebase_all([grip[0] for grip in grips], addresses, olds)
        if failed == -1:
            self._count_torch_made(olds)
        return None if failed == -2 else failed

    def _count_torch_made(self, olds: list) -> None:
        made = [old.nbytes for old in olds if self._torch_made(old)]
        self.context.torch_moved_blocks += len(made)
        self.context.torch_moved_bytes += sum(made)

    def rebase_all(self, users: list, addresses: list, olds: list) -> int:
        """`FastPath.rebase` for a wave: each storage of `users` takes the memory at the same index of
        `addresses` from the block at the same index of `olds` (checked first; see the C++ source):
        -1 when done, i when users[i] changed, -2 when some user's memory is not the fast path's."""
        return self.context.fast.rebase(users, addresses, [old.address for old in olds], [old.nbytes for old in olds])

    def commit_all(self, dests) -> int | None:
        # One C++ call for the whole wave where torch has it (`swap_storages`: `_swap_data_ptr_` per
        # pair after every check); else move by move.
        swap_all = getattr(fastpath.module, "swap_storages", None) if self.context.swap_mode == "native" else None
        if swap_all is None:
            return None
        failed = swap_all([held[0] for _, _, held, _ in dests], [dest for _, _, _, dest in dests],
                          [old.address for old, _, _, _ in dests])
        if failed == -1:
            self._count_torch_made([old for old, _, _, _ in dests])
        return failed

    def commit(self, old: Block, new: Block, held, dest) -> None:
        user, rebind = held
        if rebind is None:
            # `new` is now the user's block; `old` is owned by the temporary `dest`. Sizes were
            # checked by `check`; `dest` was made on the pool's device.
            tz.swap_data(user, dest, self.context.swap_mode, checked=True)
            self._count_torch_made([old])
        else:
            # Rebind mode: the known tensors (provably all users) take `dest`;
            # `old` dies with the old storage once the compaction's references go.
            tz.rebind(rebind, dest)
            info = old.info
            new.info = TensorInfo(info.dtype, info.shape, tz.weak_storage(dest), info.origin, info.tensors)
            old.info = None
