"""The allocation fast path: `pool.empty()` of a size the pool keeps, in one C++ call.

The core keeps every freed range carved for the next request of its size
(`defrag.core.Core.free`). With the fast path attached, those kept ranges live
in a small C++ object (`fastpath.cpp`) that serves `pool.empty()` from them
directly: it pops a range, makes the tensor with `at::for_blob`, and gives its
storage a deleter that puts the range back (or, once the core has seen the
block, queues its release) without the GIL. A training step or a decode loop,
which frees and asks for the same sizes again, then never runs the Python
allocator: about as fast as `torch.empty`.

The core stays the only authority. The C++ side only hands out ranges the
core kept, and only while no thread waits at or holds the pool's gate; the
core learns what it did at its next safe point (`FastPath.sync`, called with
the gate held from `Core.drain` and `Core.flush_reuse`, so before it reads
pages, blocks or counters): every block made since, with a weak reference to
its storage and its owner thread, every release of a block it had seen, and
the counters (allocations, frees, the peak of allocated bytes in between).
Anything unusual (another size, zero elements, `requires_grad`, a non-default
CUDA stream, a stale access to report, history recording, a sleeping or
closed pool, the "rebind" storage mode) declines to the Python path, which
does it all, errors included.

Building: `request()` starts compiling the extension in a child process the
first time a pool is created (about 15-60 s once per machine and torch
version; later processes import the built library, about 0.1 s). Pools use
the Python path until it is built, then import it and attach at their next
call (`poll()`).
`DEFRAG_FASTPATH=0` turns it off; `DEFRAG_FASTPATH=wait` makes the first pool
wait for the build instead (benchmarks and tests use `wait()`).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading

from .core import Block
from .extensions import CppExtension, missing_tools

_log = logging.getLogger("defrag")

_SOURCE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fastpath.cpp")


def _source() -> str:
    with open(_SOURCE_PATH) as f:
        return f.read()


_EXTENSION = CppExtension("defrag_fastpath", "fastpath", _source(), "the allocation fast path", "about 30-60 s")
_lock = threading.Lock()
_builder: threading.Thread | None = None  # the background build, once started
module = None  # the built extension once loaded (read without a lock: set once)
# True once the extension can be imported without building (or was): pools then call `poll()`.
importable = False


def setting() -> str:
    """DEFRAG_FASTPATH as one of "off", "wait", "background" (the default)."""
    value = os.environ.get("DEFRAG_FASTPATH", "").strip().lower()
    if value in ("0", "off", "false", "no"):
        return "off"
    return "wait" if value == "wait" else "background"


def request():
    """The extension, imported now if it is built; else start building it and return None.

    Imports only ever run in the calling thread (about 0.1 s, once per
    process): a daemon thread inside a C++ module's import when the
    interpreter exits could abort the process. The background thread only
    waits for the build, which runs in a child process of its own session,
    so a short script that exits mid-build leaves no half build or stale
    lock behind (the child finishes; the next process imports it). Never
    raises; blocks only to import, or with DEFRAG_FASTPATH=wait to build.
    """
    global _builder, importable
    if module is not None:
        return module
    mode = setting()
    if mode == "off":
        return None
    if mode == "wait" or _EXTENSION.is_built():
        return wait()
    with _lock:
        if _builder is None and missing_tools() is None:
            _builder = threading.Thread(target=_build_in_a_child, name="defrag-fastpath-build", daemon=True)
            _builder.start()
        elif _builder is None:
            importable = True  # nothing to build with: `poll()` records why, once
    return None


def _build_in_a_child() -> None:
    global importable
    try:
        subprocess.run([sys.executable, "-c", "import defrag.fastpath as f; f._EXTENSION.load()"],
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       start_new_session=True, timeout=1800, check=False)
    except (OSError, subprocess.SubprocessError):
        pass
    finally:
        importable = True  # built, or `poll()` finds out why not (a failed build leaves its marker)


def poll():
    """The extension if it is loaded, or can be now that the background build ended (imported in the
    calling thread); else None. Pools call it at their calls while `importable` is set."""
    global importable
    if module is None and importable:
        importable = False
        return wait(build=False)
    return module


def wait(timeout: float | None = None, *, build: bool = True):
    """The extension, loaded now (waiting up to `timeout` for a background build, or building it in
    this process unless `build=False`); None if it cannot be had (`status()` says why)."""
    global module
    if module is not None or setting() == "off":
        return module
    builder = _builder
    if builder is not None and builder.is_alive():
        builder.join(timeout)
        if builder.is_alive():
            return None
    with _lock:
        if module is None and _EXTENSION.failure() is None:
            loaded = _EXTENSION.load(build=build)
            if loaded is None:
                _log.info("defrag: the allocation fast path is unavailable (%s); pools use the Python path",
                          _EXTENSION.failure())
            module = loaded
    return module


def status() -> str:
    """"ready", "off", "building", "built, not loaded yet" (a pool loads it at its next call),
    "not started" or "unavailable: <why>"."""
    if module is not None:
        return "ready"
    if setting() == "off":
        return "off"
    if _EXTENSION.failure() is not None:
        return f"unavailable: {_EXTENSION.failure()}"
    if _builder is not None and _builder.is_alive():
        return "building"
    return "built, not loaded yet" if _EXTENSION.is_built() else "not started"


class FastPath:
    """One pool's fast path as the core's front (`Core.front`).

    `cpp` is the C++ object (`empty`, `storage`, `put`, `take`, `take_all`,
    `kept_count`, `collect`, `collect_released`, `queue_python`, `close`,
    `live`, `enabled`, `hits`, `misses`); it is also the core's kept ranges
    (`Core.kept`: the four methods of `core.KeptRanges`).
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
        `made_too=False`: only the releases (see `Core.drain`)."""
        if made_too:
            made, released, allocs, frees, peak = self.cpp.collect()
        else:
            made, released = None, self.cpp.collect_released()
        if made or (made_too and (allocs or frees)):
            from torch.multiprocessing.reductions import StorageWeakRef

            blocks = []
            regions = core.regions
            for address, size, nbytes, region, serial, owner, weak, dtype, shape in made:
                block = Block(address, size, nbytes, regions[region], owner=owner)
                block.info = self.make_info(dtype, shape, StorageWeakRef.from_weakref(weak))
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
                    item = entry[1:]  # (size, region, address): a range to keep at its turn
                if item is not None:
                    items.append(item)
            core.requeue(items)
