"""The allocation fast path: `pool.empty()` of any size that mapped free space holds, in one C++ call.

The pool's books are native (`defrag.native`, `Core.books`). The fast path
(`native/module.cpp`) serves `pool.empty()` from them directly: the books
place the block exactly as the core would when no page must be mapped (a
freed range kept for the same size, else best fit), the tensor is made with
`at::for_blob`, and its storage gets a deleter that gives the range back to
the books (or, once the core has seen the block, queues its release) without
the GIL. A program that allocates dozens of sizes interleaved then runs no
Python allocator code until a page must be mapped.

The core stays the only authority over what it has seen. The C++ side
places only while no thread waits at or holds the pool's gate; the core
learns what it did at its next safe point (`FastPath.sync`, called with the
gate held from `Core.drain` and `Core.flush_reuse`): every block made since,
with a weak reference to its storage and its owner thread, every release of
a block it had seen, and the counters (allocations, frees, the peak of
allocated bytes in between). Anything unusual (pages to map, zero elements,
`requires_grad`, a non-default CUDA stream, a stale access to report,
history recording, a sleeping or closed pool, the "rebind" storage mode)
declines to the Python path, which does it all, errors included.

The books themselves are native for every pool (`defrag.native`); the fast
path is only the tensor-making half. `DEFRAG_FASTPATH=0` turns it off (every
`pool.empty()` then takes the Python path, over the same native books).
"""

from __future__ import annotations

from . import native, settings
from .core import Block, UnseenRange

module = None  # the native module once a pool loaded it (read without a lock: set once)


def setting() -> str:
    """DEFRAG_FASTPATH as "off" or "on" (the default); `SettingError` for a value that is neither
    (`defrag.settings`)."""
    return "on" if settings.fastpath() else "off"


def wait():
    """The native module, loaded (built first if needed: `defrag.native.load_module`), or None when the
    fast path is off. NativeBuildError if it cannot be built."""
    global module
    if setting() == "off":
        return None
    module = native.load_module()
    return module


def status() -> str:
    """"ready", "off", or the native module's own status (`defrag.native.status`)."""
    if setting() == "off":
        return "off"
    return native.status()


class FastPath:
    """One pool's fast path as the core's front (`Core.front`).

    `cpp` is the C++ object (`empty`, `bind_empty`, `storage`, `storages`, `rebase`, `native_empty`, `churn`, `collect`,
    `collect_released`, `queue_python`, `close`, `live`, `enabled`, `hits`,
    `misses`) over the core's native books (`Core.books`).
    `make_info(dtype, shape, storage_ref)` builds the face's `Block.info` for
    a block made in C++. Guarantees after `sync(core)`: the core holds a
    Block for every live block made since the previous sync, its counters
    and peaks count them, and every release of a block the core has seen is
    queued on the core.
    """

    __slots__ = ("cpp", "make_info", "_by_serial", "_by_token", "__weakref__")

    def __init__(self, cpp, make_info):
        self.cpp = cpp
        self.make_info = make_info
        self._by_serial: dict[int, Block] = {}  # blocks made in C++ that the core has seen, until released
        self._by_token: dict[int, Block] = {}  # blocks of the Python path released, until synced

    def storages_over(self, blocks: list) -> list:
        """`storage_over` for every block of `blocks`, in one C++ call (a compaction wave's destinations)."""
        storages, first = self.cpp.storages([b.address for b in blocks], [b.nbytes for b in blocks])
        self._by_serial.update(zip(range(first, first + len(blocks)), blocks))
        return storages

    def rebase(self, users: list, addresses: list[int], olds: list) -> int:
        """A compaction wave's commit in one C++ call (`cpp.rebase`): each storage of `users` takes
        the memory at the same index of `addresses` from the block at the same index of `olds`
        (its old range already back in the books); no temporary storage, no release to apply later.
        Each storage keeps its serial, so its block (re-addressed by the caller) stays the one its
        release names. -1 when done; i when users[i] is not at olds[i] as a block of its size
        (nothing changed); -2 when some user's memory was not made by this fast path (nothing
        changed: swap through temporaries)."""
        return self.cpp.rebase(users, addresses, [old.address for old in olds], [old.nbytes for old in olds])

    def storage_over(self, block: Block):
        """A torch UntypedStorage over `block` whose death queues the block's release (the face's
        `Pool._storage_over`, without a Python owner or weakref hook)."""
        storage, serial = self.cpp.storage(block.address, block.nbytes)
        self._by_serial[serial] = block
        return storage

    # -- the front (Core.front's protocol)
    def release(self, block: Block) -> None:
        """A block of the Python path was released (any thread): queue it in order with the C++ releases."""
        self._by_token[id(block)] = block
        self.cpp.queue_python(id(block))

    def sync(self, core, *, made_too: bool = True) -> None:
        """Record what the C++ side did and queue its releases on the core in order (gate held).
        `made_too=False`: only the releases (see `Core.drain`). While the core records history, the
        allocator entries' logged events go to its recorder after the collection and before the
        releases are queued: every release handed over now was logged before the collection, so its
        free is in the trace before any reuse of its range that this drain makes possible."""
        history = core.history
        if made_too:
            made, released, allocs, frees, peak = self.cpp.collect()
        else:
            made = None
            released, peak = self.cpp.collect_released()
            core.note_peak(peak)  # before the releases lower the count it is measured from
        if history is not None:
            history.absorb(*self.cpp.take_events())
        if made or (made_too and (allocs or frees)):
            from torch.multiprocessing.reductions import StorageWeakRef

            blocks = []
            regions = core.regions
            for address, size, nbytes, region, serial, owner, weak, dtype, shape in made:
                # No owner: made by a thread Python never saw (`native_empty`) or by PyTorch's CPU allocator
                # (`defrag.install`), which may be using it: pinned, so that no compaction moves it.
                block = Block(address, size, nbytes, regions[region], pins=owner is None, owner=owner)
                # No storage (weak 0): PyTorch's CPU allocator made it; torch builds the storage itself.
                block.info = self.make_info(dtype, shape, StorageWeakRef.from_weakref(weak) if weak else None)
                self._by_serial[serial] = block
                blocks.append(block)
            core.record_made(blocks, allocs, frees, peak)
        if released:
            items = []
            for entry in released:
                kind = entry[0]
                if kind == 0:
                    item = self._by_serial.pop(entry[1], None)
                elif kind == 1:
                    item = self._by_token.pop(entry[1], None)
                else:
                    item = UnseenRange(*entry[1:])  # a range to keep at its turn
                if item is not None:
                    items.append(item)
            core.requeue(items)
        # Until the core's next drain applies them, the C++ side must not place (see `settled`).
        self.cpp.backlog = core.has_backlog()

    def settled(self) -> None:
        """The core applied every release it was handed (end of `Core.drain`)."""
        self.cpp.backlog = False
