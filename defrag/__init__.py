"""defrag: ends fragmentation out-of-memory errors on NVIDIA GPUs.

Tensors live in a `Pool` backed by CUDA virtual memory management; `compact()`
moves live tensors so that the physical pages they strand become free, and the
pool stitches free pages into one virtual range for a large request.
"""

import os as _os


def _checkout_folders() -> None:
    """In a source checkout, `kernels/` and `benchmarks/` stand beside this package; a wheel ships them
    inside it as `defrag.kernels` and `defrag.benchmarks` (pyproject's package-dir). Search this very
    checkout's root for those subpackages, after this package's own folder, so that a copy of a checkout
    never loads them from another one (an editable install's mapping names the checkout it was made
    from). Nothing changes where they are inside the package (a wheel) or where there is no checkout."""
    here = _os.path.dirname(_os.path.abspath(__file__))
    root = _os.path.dirname(here)
    if _os.path.isdir(_os.path.join(here, "kernels")):
        return
    if all(_os.path.isfile(_os.path.join(root, name, "__init__.py")) for name in ("kernels", "benchmarks")):
        __path__.append(root)


_checkout_folders()

from .allocator_install import install, uninstall  # noqa: E402 (after the subpackages' search path)
from .capture import TorchAllocator  # noqa: E402
from .compactor import CompactionReport
from .errors import (CompactionError, ConcurrencyError, CudaError, CudaOutOfMemoryError, NativeBuildError,
                     NotSupportedError, PoolAsleepError, PoolClosedError, ResidencyError, SettingError,
                     StaleAccessError)
from .oom import OutOfMemoryError
from .owners import no_moves
from .pool import LiveTensor, Pool, compact, open_pools, save_snapshot
from .residency import ResidencyReport
from .retry import retry_on_oom
from .units import format_bytes, parse_size
from . import distributed
from .errors import CollectiveError

__version__ = "0.1.0"

__all__ = [
    "Pool", "compact", "no_moves", "retry_on_oom", "save_snapshot", "CompactionReport", "CompactionError", "LiveTensor", "open_pools",
    "ConcurrencyError", "CudaError", "CudaOutOfMemoryError", "OutOfMemoryError", "PoolClosedError", "StaleAccessError",
    "parse_size", "format_bytes", "TorchAllocator", "install", "uninstall",
    "distributed", "CollectiveError",
    "ResidencyReport", "ResidencyError", "PoolAsleepError", "NotSupportedError", "SettingError", "NativeBuildError",
]
