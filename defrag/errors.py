"""The two error types defrag raises: one for the driver, one for the user.

`CudaError` carries the CUDA error name and code of a failed driver call (on the
real driver and on the emulation alike). `OutOfMemoryError` is what a user sees
when a pool cannot satisfy a request; it subclasses `torch.OutOfMemoryError` so
existing `except torch.OutOfMemoryError` handlers keep working.
"""

from __future__ import annotations

import torch


class CudaError(RuntimeError):
    """A CUDA driver call returned something other than CUDA_SUCCESS.

    Attributes: `name` (e.g. "CUDA_ERROR_INVALID_VALUE"), `code` (the integer
    CUresult) and `call` (the driver function, e.g. "cuMemMap").
    """

    def __init__(self, call: str, name: str, code: int, detail: str = ""):
        self.call = call
        self.name = name
        self.code = int(code)
        message = f"{call} failed: {name} ({self.code})"
        if detail:
            message += f": {detail}"
        super().__init__(message)


class CudaOutOfMemoryError(CudaError):
    """The driver itself is out of physical memory (CUDA_ERROR_OUT_OF_MEMORY)."""


class OutOfMemoryError(torch.OutOfMemoryError):
    """A pool could not satisfy an allocation request.

    The message names the request, the capacity, what is live, what is stranded
    in half-used pages, what is pinned, and what was already tried. The same
    figures are available as attributes (`requested`, `capacity`, `live`,
    `stranded`, `pinned`, `tried`).
    """

    def __init__(self, message: str, **figures):
        super().__init__(message)
        self.requested = figures.get("requested")
        self.capacity = figures.get("capacity")
        self.live = figures.get("live")
        self.stranded = figures.get("stranded")
        self.pinned = figures.get("pinned")
        self.tried = tuple(figures.get("tried", ()))


class PoolClosedError(RuntimeError):
    """An operation was attempted on a pool after `close()`."""


class ConcurrencyError(RuntimeError):
    """A pool call would break the thread contract (see `Pool`): for instance
    `compact(threads="all")` while other threads that use the pool still run.
    Raised before anything changes."""


class StaleAccessError(ConcurrencyError):
    """Memory of the pool's device was read or written after its page was unmapped.

    Raised (once per detection) by the next pool call on the emulated device,
    where such an access is recorded instead of crashing the process; on a GPU
    the same access is an illegal-address error raised by CUDA itself. The pool
    itself is intact; the stale access read zeros and its writes were dropped.
    """
