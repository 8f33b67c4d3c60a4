"""A memory-less CUDA driver: the emulated driver's rules and bookkeeping, no bytes.

`MemorylessCuda` is `EmulatedCuda` with every host-memory side effect
replaced by bookkeeping alone (its `host_memory` is an `AddressCounter`, a
`HostMemory` with no bytes), for dry replays of traces far larger than this
machine's RAM (80 GB-class workloads):

- handles, reservations, mappings, access flags, capacity accounting and every
  rule and error code are the emulated driver's own code, not a copy of it:
  the same calls fail with the same `CUresult`, `cuMemCreate` beyond capacity
  returns CUDA_ERROR_OUT_OF_MEMORY, a released handle lives until its last
  unmap, `state()` counts what is held, and `FaultInjector` (through `Driver`)
  works unchanged;
- a physical allocation holds no memory (no memfd), so capacity can be any size;
- reservations come from a virtual address counter, aligned like a real one,
  never overlapping or reused; they start at 2**48, above any address a Linux
  process maps (so a stray host access to one faults instead of corrupting
  memory) and end below 2**63 (they fit a signed 64-bit integer); a 1 TiB or
  64 TiB reservation costs nothing;
- cuMemMap, cuMemUnmap and cuMemSetAccess only update the bookkeeping;
- pinned host buffers (`cuMemAllocHost`) are addresses from the same
  counter, and host-located pages count in `host_used`, as on the emulated
  device;
- copies and memsets check that their ranges are mapped with access, exactly
  as on the emulated device, and then do nothing; a kernel launch checks its
  function and arguments and runs nothing; synchronization is a no-op
  and `touched_unmapped()` is always 0 (no host access can reach the device).

Nothing here may be read or written through its addresses: a face over this
driver must not build tensors over its memory (it has none).
"""

from __future__ import annotations

from .emulated import DEFAULT_CAPACITY, DEFAULT_GRANULARITY, DEFAULT_HOST_CAPACITY, EmulatedCuda
from .host_memory import HostMemory

__all__ = ["MemorylessCuda", "AddressCounter", "VA_START", "VA_LIMIT"]

VA_START = 1 << 48   # first address handed out: above every Linux user-space mapping (47-bit, or 56-bit opt-in)
VA_LIMIT = 1 << 63   # reservations end below this: addresses fit in int64
_NO_FD = -1          # what a physical allocation holds instead of a memfd


class AddressCounter(HostMemory):
    """The host side of a memory-less device: addresses from a counter, no bytes behind them.

    Every side effect of `HostMemory` is bookkeeping here: reservations and
    pinned buffers are handed out by the counter (aligned, never overlapping,
    never reused, one granule of guard between them); pages hold no memfd;
    map, unmap, protect, copy and fill do nothing; `touched_unmapped()` is
    always 0. `stale_probe_fd()` is still a real, empty file, so a fast path
    that fstat's it finds nothing to report.
    """

    def __init__(self, granularity: int, lock):
        super().__init__(granularity, lock)
        self._next_va = VA_START

    def create_page(self, size: int) -> int:
        return _NO_FD

    def release_page(self, fd: int) -> None:
        pass

    def alloc_pinned(self, size: int) -> int | None:
        # Pinned buffers come from the same counter: never overlapping, never reused, never touched.
        return self.reserve(-(-size // self.granularity) * self.granularity, self.granularity)

    def free_pinned(self, ptr: int, size: int) -> None:
        pass

    def alloc_linear(self, size: int) -> int | None:
        return self.alloc_pinned(size)  # an address from the counter, never touched

    def free_linear(self, ptr: int, size: int) -> None:
        pass

    runs_kernels = False  # no bytes: a launch checks its function and arguments, then does nothing
    maps_bytes = False  # `map` does nothing

    def view(self, ptr: int, nbytes: int):
        return None

    def reserve(self, size: int, alignment: int) -> int | None:
        """The counter's next `alignment`-aligned base for `size` bytes; None once VA_LIMIT is reached."""
        base = -(-self._next_va // alignment) * alignment
        if base + size > VA_LIMIT:
            return None  # address space exhausted: CUDA_ERROR_OUT_OF_MEMORY, as from the driver
        # One granule of guard between reservations: an overrun never lands in the next one.
        self._next_va = base + size + self.granularity
        return base

    def free_reserved(self, base: int, size: int) -> None:
        pass  # addresses are never reused

    def drop_tombstone(self) -> None:
        pass

    def privatize(self, ptr: int, size: int, fd: int, offset: int, prots: bytearray) -> None:
        """No bytes to keep apart in a forked child."""

    def map(self, ptr: int, size: int, fd: int, offset: int) -> None:
        pass

    def unmap(self, ptr: int, size: int) -> None:
        pass

    def protect(self, ptr: int, size: int, prot: int) -> None:
        pass

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        pass

    def fill(self, dst: int, value: int, nbytes: int) -> None:
        pass

    def touched_unmapped(self) -> int:
        """Always 0: no host access can reach a memory-less device's addresses."""
        return 0


class MemorylessCuda(EmulatedCuda):
    """One memory-less GPU: `EmulatedCuda`'s rules over a virtual address counter."""

    host_memory_class = AddressCounter

    def __init__(self, *, capacity: int = DEFAULT_CAPACITY, granularity: int = DEFAULT_GRANULARITY,
                 device_count: int = 1, name: str = "defrag memoryless device",
                 host_capacity: int = DEFAULT_HOST_CAPACITY, host_pages: bool = True):
        super().__init__(capacity=capacity, granularity=granularity, device_count=device_count, name=name,
                         host_capacity=host_capacity, host_pages=host_pages)
