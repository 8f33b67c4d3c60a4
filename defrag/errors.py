"""The errors defrag raises, except the user's out-of-memory error. No torch.

`CudaError` carries the CUDA error name and code of a failed driver call (on the
real driver and on the emulation alike). `OutOfMemoryError`, what a user sees
when a pool cannot satisfy a request, lives in `defrag.oom`: it subclasses
`torch.OutOfMemoryError`, and this module is imported by torch-free layers.
"""

from __future__ import annotations


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


class CompactionError(RuntimeError):
    """A compaction could not run (e.g. during CUDA graph capture) or failed and was rolled back."""


class CollectiveError(RuntimeError):
    """A collective of `defrag.distributed` failed on this rank.

    Either another rank failed before the exchange (`failed_ranks` maps its
    rank to its error) and no rank compacted, or the exchange itself failed
    (another rank never reached it within the process group's timeout, or
    exited): then `failed_ranks` is empty and the group may be out of step.
    `collective` names the call (e.g. "defrag.distributed.compact"), `rank`
    this process's rank in the group.
    """

    def __init__(self, message: str, *, collective: str = "", rank: int = -1, failed_ranks: dict | None = None):
        super().__init__(message)
        self.collective = collective
        self.rank = rank
        self.failed_ranks = dict(failed_ranks or {})


class NotSupportedError(RuntimeError):
    """The device or its driver lacks what a call needs (e.g. host-located VMM pages before CUDA 12.2)."""


class ResidencyError(RuntimeError):
    """A sleep, wake, offload or reload that does not fit the pool's state (waking an awake pool,
    sleeping twice, reloading what is not offloaded). Raised before anything changes."""


class PoolAsleepError(ResidencyError):
    """A pool call that needs device memory was made while the pool sleeps (`pool.sleep()`):
    call `pool.wake()` first. Raised before anything changes."""


class HeapError(ValueError):
    """Misuse of a heap (`defrag/native/heap.h`, the pool's best fit over integer offsets): double free,
    unknown block, overlap, bad size or alignment. The call changed nothing."""


class SettingError(ValueError):
    """An environment variable defrag reads (DEFRAG_*) holds a value it cannot use.

    The message is one line: the variable, what it holds and what it accepts.
    The `defrag` command prints it and exits 2, as for a bad argument.
    """


class NativeBuildError(RuntimeError):
    """defrag's native module (the pool's books and its allocation fast path, `defrag.native`) could not
    be built or imported on this machine. The message says why and what to install; nothing was made."""
