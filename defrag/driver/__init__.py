"""Driver layer: one adapter (`Driver`) over three implementations of one API.

- CUDA: cuda-python's `cuda.bindings.driver`, loaded only when a CUDA device is
  asked for (or probed for by `device=None`).
- Emulated: `EmulatedCuda`, the same calls on host memory (memfd pages mapped at
  fixed addresses), which never loads libcuda.
- Memory-less: `MemorylessCuda`, the emulated driver's rules and accounting
  with no bytes behind the addresses (dry replays of traces larger than RAM).

`open_driver(spec)` turns a device spec into a `Driver`:
`"cuda"`/`"cuda:N"`/`torch.device("cuda", N)` need a working driver (clear error
otherwise); `"emulated"` is this process's emulated device; `"memoryless"` is
this process's memory-less device; `None` is the first GPU when one works, else
the emulated device; a `Driver` is used as it is.
"""

from __future__ import annotations

import threading

from .. import settings
from .cuda import Driver, cuda_driver_usable
from .emulated import EmulatedCuda
from .faults import FaultInjector
from .memoryless import MemorylessCuda

__all__ = ["Driver", "EmulatedCuda", "MemorylessCuda", "FaultInjector", "open_driver", "cuda_driver_usable",
           "default_emulated_driver", "default_memoryless_driver", "DeviceUnavailableError"]


class DeviceUnavailableError(RuntimeError):
    """A CUDA device was asked for but no working CUDA driver/device is present."""


_lock = threading.Lock()
_cuda_drivers: dict[int, Driver] = {}
_shared: dict[str, Driver | None] = {}  # kind -> this process's emulated / memory-less device


def _shared_driver(kind: str) -> Driver:
    """This process's one device of `kind` ("emulated" or "memoryless"), sized by
    DEFRAG_<KIND>_CAPACITY (default 16GiB) and DEFRAG_<KIND>_GRANULARITY (default 2MiB).
    `SettingError` (nothing made) when either holds something unusable."""
    with _lock:
        if _shared.get(kind) is None:
            _shared[kind] = getattr(Driver, kind)(
                capacity=settings.device_size(kind, "capacity"),
                granularity=settings.device_size(kind, "granularity"))
        return _shared[kind]


def default_emulated_driver() -> Driver:
    """This process's emulated device (one per process, like a GPU).

    Its capacity and granularity come from DEFRAG_EMULATED_CAPACITY (default
    16GiB; memfd pages cost nothing until written) and
    DEFRAG_EMULATED_GRANULARITY (default 2MiB, as on H100/H200).
    """
    return _shared_driver("emulated")


def default_memoryless_driver() -> Driver:
    """This process's memory-less device (one per process, like the emulated one).

    Its capacity and granularity come from DEFRAG_MEMORYLESS_CAPACITY (default
    16GiB; it holds no memory, so any size works) and DEFRAG_MEMORYLESS_GRANULARITY
    (default 2MiB). A dry replay that needs its own size builds
    `Driver.memoryless(capacity=..., granularity=...)` instead.
    """
    return _shared_driver("memoryless")


def _cuda_driver(ordinal: int) -> Driver:
    with _lock:
        if ordinal not in _cuda_drivers:
            usable, reason = cuda_driver_usable()
            if not usable:
                raise DeviceUnavailableError(
                    f"device 'cuda:{ordinal}' needs a working CUDA driver and GPU, but {reason}. "
                    "Use device='emulated' (or device=None) to run on the CPU emulation.")
            _cuda_drivers[ordinal] = Driver.cuda(ordinal)
        return _cuda_drivers[ordinal]


def open_driver(spec=None) -> Driver:
    """Resolve a device spec to a `Driver` (see the module docstring)."""
    if isinstance(spec, Driver):
        return spec
    if spec is None:
        usable, _ = cuda_driver_usable()
        return _cuda_driver(0) if usable else default_emulated_driver()
    text = str(spec)  # accepts torch.device too
    if text == "emulated":
        return default_emulated_driver()
    if text == "memoryless":
        return default_memoryless_driver()
    if text == "cuda" or text.startswith("cuda:"):
        index = text.partition(":")[2] if ":" in text else "0"
        if not index.isdigit():
            raise ValueError(f"bad CUDA device {text!r}: expected 'cuda' or 'cuda:N'")
        return _cuda_driver(int(index))
    raise ValueError(f"unknown device {spec!r}: expected None, 'emulated', 'memoryless', 'cuda', 'cuda:N' "
                     "or a defrag Driver")
