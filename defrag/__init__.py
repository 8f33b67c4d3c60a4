"""defrag: ends fragmentation out-of-memory errors on NVIDIA GPUs.

Tensors live in a `Pool` backed by CUDA virtual memory management; `compact()`
moves live tensors so that the physical pages they strand become free, and the
pool stitches free pages into one virtual range for a large request.
"""

from .compactor import CompactionError, CompactionReport, compact
from .errors import (ConcurrencyError, CudaError, CudaOutOfMemoryError, OutOfMemoryError, PoolClosedError,
                     StaleAccessError)
from .pool import LiveTensor, Pool, open_pools
from .retry import retry_on_oom
from .stats import save_snapshot
from .units import format_bytes, parse_size

__version__ = "0.1.0"

__all__ = [
    "Pool", "compact", "retry_on_oom", "save_snapshot", "CompactionReport", "CompactionError", "LiveTensor", "open_pools",
    "ConcurrencyError", "CudaError", "CudaOutOfMemoryError", "OutOfMemoryError", "PoolClosedError", "StaleAccessError",
    "parse_size", "format_bytes",
]
