"""`defrag.install(pool)` on the emulated device: the pool as PyTorch's CPU allocator.

On the emulated device the pool's pages are host memory (memfd pages mapped
into this process) and its tensors are CPU tensors. Installing the pool makes
every CPU tensor the program allocates afterwards (parameters, gradients,
optimizer state, activations, temporaries) a block of the pool, through a
native `c10::Allocator` over the pool's native books
(`defrag/native/cpu_allocator.cpp`): no Python and no GIL on the hot path, the
GIL only when pages must be mapped, and a request the pool cannot serve raises
`torch.OutOfMemoryError` with the pool's explained OOM.

Limits of this first slice: the blocks it makes are pinned (PyTorch holds
their raw pointers; a compaction never moves them); storages made before
install keep their own memory; allocations made by the pool's own code, by a
forked child, while the pool sleeps or is closed, and by a
thread Python never saw while another thread runs the pool's code go to
PyTorch's previous allocator; `torch.profiler`'s memory view does not see the
pool's blocks.

This module imports no `defrag.pool` (the pool imports it: `Pool.close`
uninstalls first).
"""

from __future__ import annotations

import atexit
import logging
import threading

from .errors import NotSupportedError, PoolClosedError

__all__ = ["install", "uninstall", "installed", "counters"]

_log = logging.getLogger("defrag")
_lock = threading.Lock()
_installed = None  # the pool PyTorch's CPU allocations go to, or None
_atexit_registered = False


def install(pool):
    """Make `pool` (emulated device) PyTorch's CPU allocator for the whole process; returns the pool.

    Once per process at a time: RuntimeError while another pool is installed
    (the same pool again: a no-op), PoolClosedError for a closed pool,
    NotSupportedError when the pool has no native fast path (DEFRAG_FASTPATH=0
    or the "rebind" storage mode). `uninstall()` (or closing the pool, or the
    process exiting) restores PyTorch's previous allocator; tensors made
    meanwhile stay valid and go back to the pool when freed.
    """
    global _installed, _atexit_registered
    if pool.kind != "emulated":
        raise ValueError(f"cpu_allocator.install: pool #{pool.id} is on the {pool.kind} device, not the emulated one")
    with _lock:
        if _installed is not None:
            if _installed is pool:
                return pool
            raise RuntimeError(f"defrag.install: pool #{_installed.id} is already PyTorch's CPU allocator; "
                               f"call defrag.uninstall() first (a process has one)")
        if pool.closed:
            raise PoolClosedError(f"defrag.install: pool #{pool.id} is closed")
        fast = pool.core.fast  # the native FastPath (native/module.cpp)
        if fast is None:
            raise NotSupportedError(
                f"defrag.install: pool #{pool.id} has no native fast path (DEFRAG_FASTPATH=0 or the 'rebind' "
                f"storage mode), which PyTorch's CPU allocator is built on")
        from .fastpath import module

        module.install_cpu_allocator(fast)
        _installed = pool
        if not _atexit_registered:
            # Interpreter teardown allocates too: PyTorch's own allocator serves it, never a pool half torn down.
            atexit.register(uninstall)
            _atexit_registered = True
    _log.info("defrag: pool #%d is now PyTorch's CPU allocator (install)", pool.id)
    return pool


def uninstall() -> bool:
    """PyTorch's previous CPU allocator again; False when no pool was installed."""
    global _installed
    with _lock:
        if _installed is None:
            return False
        from .fastpath import module

        module.uninstall_cpu_allocator()
        pool, _installed = _installed, None
    _log.info("defrag: pool #%d is no longer PyTorch's CPU allocator (uninstall)", pool.id)
    return True


def uninstall_pool(pool) -> bool:
    """`uninstall()` if `pool` is the installed one (its close comes next)."""
    with _lock:
        mine = _installed is pool
    return uninstall() if mine else False


def installed():
    """The pool installed as PyTorch's CPU allocator, or None."""
    with _lock:
        return _installed


def counters() -> dict:
    """The allocator's process-wide counters: installed, current (PyTorch's CPU allocator is defrag's),
    forked_child, declined (served by the previous allocator after trying the pool), asked (trips to
    the pool's Python code), ooms, blocks (made for the installed pool, ever)."""
    from .fastpath import module

    if module is None:
        return {}
    return dict(module.cpu_allocator_counters())
