"""defrag: ends fragmentation out-of-memory errors on NVIDIA GPUs.

Tensors live in a `Pool` backed by CUDA virtual memory management; `compact()`
moves live tensors so that the physical pages they strand become free, and the
pool stitches free pages into one virtual range for a large request.
"""

from .capture import TorchAllocator, install, uninstall
from .compactor import CompactionReport
from .errors import (CompactionError, ConcurrencyError, CudaError, CudaOutOfMemoryError, NativeBuildError,
                     NotSupportedError, PoolAsleepError, PoolClosedError, ResidencyError, SettingError,
                     StaleAccessError)
from .oom import OutOfMemoryError
from .pool import LiveTensor, Pool, compact, open_pools, save_snapshot
from .residency import ResidencyReport
from .retry import retry_on_oom
from .units import format_bytes, parse_size
from . import distributed
from .errors import CollectiveError

__version__ = "0.1.0"

__all__ = [
    "Pool", "compact", "retry_on_oom", "save_snapshot", "CompactionReport", "CompactionError", "LiveTensor", "open_pools",
    "ConcurrencyError", "CudaError", "CudaOutOfMemoryError", "OutOfMemoryError", "PoolClosedError", "StaleAccessError",
    "parse_size", "format_bytes", "TorchAllocator", "install", "uninstall",
    "distributed", "CollectiveError",
    "ResidencyReport", "ResidencyError", "PoolAsleepError", "NotSupportedError", "SettingError", "NativeBuildError",
]
