"""The allocation fast path: `pool.empty()` of any size that mapped free space holds, in one C++ call.

The pool's books are native (`defrag.native`, `Core.books`) and hold the one
record of every block. The fast path (`native/module.cpp`, `FastPath`) is the
adaptor that makes torch tensors and storages over those records: it serves
`pool.empty()` from the books directly (they place the block exactly as the
core would when no page must be mapped: a freed range kept for the same size,
else best fit), makes the tensor with `at::for_blob`, and gives its storage a
deleter that releases the record in the books without the GIL. It also makes
the tensors and storages of blocks the core's ladder placed (`tensor_over`,
`storages`), so every pool tensor's release goes to the books the same way.
A program that allocates dozens of sizes interleaved then runs no Python
allocator code until a page must be mapped, and no release ever needs Python.

Anything unusual (pages to map, zero elements, `requires_grad`, a
non-default CUDA stream, a stale access to report, history recording, a
sleeping or closed pool, a thread inside the pool's lock, the "rebind"
storage mode) declines to the Python path, which does it all, errors included.

The books themselves are native for every pool (`defrag.native`); the fast
path is only the tensor-making half. `DEFRAG_FASTPATH=0` turns it off (every
`pool.empty()` then takes the Python path, over the same native books, and
its storages' releases come through Python owners). `DEFRAG_FASTPATH=wait`
(from when the build ran in the background) is the same as 1: the first pool
waits for the native build, as every pool does.
"""

from __future__ import annotations

from . import native, settings

module = None  # the native module once a pool loaded it (read without a lock: set once)


def setting() -> str:
    """DEFRAG_FASTPATH as "off" or "on" (the default; "wait" is on too: the first pool waits for the native
    build, as every pool does); `SettingError` for a value that is neither (`defrag.settings`)."""
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
