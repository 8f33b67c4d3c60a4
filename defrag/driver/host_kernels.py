"""Kernels on the emulated device: host twins that run where a GPU would run a module's code.

A GPU loads a module image (a cubin) and launches its functions; the emulated
device has no SMs, so its module images name *host twins* instead: Python
functions registered here under a kernel's name, each doing on host memory
what the kernel does on a GPU, from the same packed parameters a
`cuLaunchKernel` would pass. So the code that loads a module, queries its
occupancy, packs parameters, stages tables and launches runs unchanged on a
machine without a GPU, and its mistakes show as wrong bytes.

- `register(HostKernel(...))` makes a twin known (the process's registry);
- `module_image(*names)` is the image `cuModuleLoadData` accepts for them
  (any other image is CUDA_ERROR_INVALID_IMAGE, as a corrupt cubin is);
- `occupancy(registers, block)` is the emulated device's answer to
  `cuOccupancyMaxActiveBlocksPerMultiprocessor`: an sm_90 SM's limits
  (65,536 registers allocated per warp in units of 256, 2,048 threads, 32
  blocks), without shared memory or the register file's finer rules.

A twin is called as `run(memory, params)`: `params` is the tuple of the
launch's 8-byte parameter values (read when the launch is issued, as the
driver copies them then), `memory` a `KernelMemory` over the device (the
device's access rule, then views and copies of the ranges it allows). It
returns False, touching nothing, where a range it would touch is not device
memory with access (the launch's synchronize then reports
CUDA_ERROR_ILLEGAL_ADDRESS, as a GPU does).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

IMAGE_MAGIC = b"defrag-emulated-module\0"
SM_REGISTERS = 65_536  # sm_90: registers per SM
SM_THREADS = 2_048  # resident threads per SM
SM_BLOCKS = 32  # resident blocks per SM
REGISTER_UNIT = 256  # registers are allocated per warp in units of this
MAX_BLOCK = 1_024  # threads per block


@dataclass(frozen=True)
class HostKernel:
    """A kernel's host twin: `name` (the entry a module image names), `run(memory, params) -> bool`,
    how many 8-byte parameters a launch passes, and the registers per thread its GPU build uses (what
    the emulated occupancy and cuFuncGetAttribute answer)."""

    name: str
    run: Callable
    params: int
    registers: int


_lock = threading.Lock()
_registry: dict[str, HostKernel] = {}


def register(kernel: HostKernel) -> None:
    """Make `kernel` loadable by name (a later registration of the same name replaces it)."""
    if kernel.params < 0 or kernel.registers < 1:
        raise ValueError(f"a host kernel needs params >= 0 and registers >= 1, got {kernel}")
    with _lock:
        _registry[kernel.name] = kernel


def module_image(*names: str) -> bytes:
    """The module image of the host twins `names` (registered or not: loading checks)."""
    if not names or any(not n or "\0" in n for n in names):
        raise ValueError(f"a module image names one or more kernels, got {names!r}")
    return IMAGE_MAGIC + b"\0".join(n.encode() for n in names)


def load(image) -> dict[str, HostKernel] | None:
    """The twins an image names, by name; None when it is not such an image or names an unknown twin."""
    try:
        data = bytes(image)
    except TypeError:
        return None
    if not data.startswith(IMAGE_MAGIC):
        return None
    names = data[len(IMAGE_MAGIC):].split(b"\0")
    with _lock:
        found = {n.decode(errors="replace"): _registry.get(n.decode(errors="replace")) for n in names}
    if not found or None in found.values():
        return None
    return found


def occupancy(registers: int, block: int) -> int:
    """Resident blocks of `block` threads per SM for a kernel of `registers` per thread (0: cannot run)."""
    if not 1 <= block <= MAX_BLOCK:
        return 0
    warps = -(-block // 32)
    per_warp = -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
    by_registers = SM_REGISTERS // (per_warp * warps)
    return max(0, min(by_registers, SM_THREADS // (warps * 32), SM_BLOCKS))


class KernelMemory:
    """What a host twin may do with device memory: `accessible(ptr, nbytes, write)` (the device's own
    rule: mapped with access, or a cuMemAlloc buffer), then, on ranges it checked so, `view(ptr,
    nbytes)` (a writable memoryview) and `copy(dst, src, nbytes)`. A twin checks before it touches:
    a GPU kernel touching an unmapped address faults, a host process would crash."""

    def __init__(self, device_accessible: Callable, copy: Callable, view: Callable):
        self._accessible, self.copy, self.view = device_accessible, copy, view

    def accessible(self, ptr: int, nbytes: int, write: bool) -> bool:
        return nbytes >= 0 and self._accessible(ptr, nbytes, write)
