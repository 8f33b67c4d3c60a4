"""A CUDA driver emulated on host memory, call-compatible with `cuda.bindings.driver`.

`EmulatedCuda` implements the subset of the CUDA driver API that defrag uses,
with the same function names, the same argument types (cuda-python's own
`CUmemAllocationProp`, `CUmemAccessDesc`, `CUdeviceptr`, ...) and the same
`(CUresult, *outputs)` return tuples, so `defrag.driver.Driver` runs unchanged on
top of either.

It is an emulation of the mechanism, not a mock of the results:

- a physical allocation (`cuMemCreate`) is a memfd of the requested size;
- a reservation (`cuMemAddressReserve`) is a PROT_NONE, MAP_NORESERVE mapping,
  over-reserved and trimmed to the requested alignment;
- `cuMemMap` maps the memfd MAP_SHARED|MAP_FIXED into the reservation with no
  access; `cuMemSetAccess` is mprotect; `cuMemUnmap` maps a shared "tombstone"
  memfd over each unmapped granule, so that a stale access is recorded
  (`touched_unmapped()`) instead of killing the process (a GPU reports it as
  an illegal address; a host would segfault);
- copies are memmove, memset is memset; by default every call completes
  before it returns. Asynchrony is modelled where a test asks for it: with
  `async_work = True` device-to-device copies and memsets are queued and run
  at the next synchronize, and `defer_write` queues a write on a side stream
  that only a device-wide `cuCtxSynchronize` waits for (a kernel still in
  flight on another stream). Queued work whose target was unmapped meanwhile
  makes that synchronize return CUDA_ERROR_ILLEGAL_ADDRESS, as a GPU does;
- the current context is per thread, as in the driver: `cuCtxSetCurrent` /
  `cuCtxGetCurrent`; mapping, unmapping, access, copies, memsets, stream
  queries and synchronization fail with CUDA_ERROR_INVALID_CONTEXT on a
  thread with none, and a synchronize waits only for the current context's
  device.

It enforces the rules a GPU enforces and answers with the error a GPU answers:
granularity alignment of sizes and addresses; a `cuMemMap` offset of zero,
the only one CUDA accepts ("currently must be zero": a mapping always starts at
its handle's first byte, so a part of an allocation is mapped by giving it a
handle of its own); mapping only inside one
reservation and never over a mapped range; unmapping only whole mappings;
access only on mapped ranges; a device capacity beyond which `cuMemCreate`
returns CUDA_ERROR_OUT_OF_MEMORY; aliasing (one handle mapped at two addresses
shares its bytes); releasing a handle that is still mapped frees its memory only
at its last unmap. Copies and memsets over addresses that are not mapped with
access return CUDA_ERROR_INVALID_VALUE instead of faulting the process.

Every host-memory side effect goes through the `_host_*` methods at the end
of the class (create/release a page's memfd, reserve/free address space,
map/unmap/protect, copy/set bytes); everything else is bookkeeping and rules.
`defrag.driver.memoryless.MemorylessCuda` overrides only those methods, so the
memory-less device follows exactly these rules with no bytes behind them.

Host memory the device can use (issue 15: sleep, wake, offload) is a kind of
its own, with its own capacity (`host_capacity`), separate from the device's:

- host-located physical pages: `cuMemCreate` with a `CU_MEM_LOCATION_TYPE_HOST_NUMA`
  location (NUMA node 0) makes a page counted in `host_used`, never in `used`,
  mapped, accessed and copied like any other page (`host_pages=False` makes the
  device refuse them, as a driver older than CUDA 12.2 or a device without
  `CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED` does);
- pinned host buffers: `cuMemAllocHost` / `cuMemFreeHost`, and the copies
  `cuMemcpyDtoH` / `cuMemcpyHtoD` between them and mapped device memory (a
  host pointer outside every pinned buffer is refused with
  CUDA_ERROR_INVALID_VALUE, where a GPU would accept pageable memory: on the
  host a wrong pointer would crash the process).

What it does not emulate: asynchrony unless asked (above), multiple devices'
peer access, IPC handles, and the exact error codes of corner cases the CUDA
documentation leaves open (those return CUDA_ERROR_INVALID_VALUE).
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import itertools
import mmap
import os
import threading
from dataclasses import dataclass

from cuda.bindings import driver as cu

R = cu.CUresult
GiB = 1 << 30
MiB = 1 << 20

DEFAULT_GRANULARITY = 2 * MiB  # what H100/H200 report for CU_MEM_ALLOC_GRANULARITY_MINIMUM
DEFAULT_CAPACITY = 16 * GiB
DEFAULT_HOST_CAPACITY = 64 * GiB  # host-located pages and pinned buffers (memfd/mmap pages cost nothing until written)
HOST_NUMA_NODE = 0  # the one host NUMA node the emulated device offers
MEMFD_NAME = "defrag-emulated-page"

_PROT_NONE = 0
_PROT_READ = mmap.PROT_READ
_PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
_MAP_SHARED = mmap.MAP_SHARED
_MAP_PRIVATE = mmap.MAP_PRIVATE
_MAP_ANONYMOUS = mmap.MAP_ANONYMOUS
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)  # Linux: fault every page in at mmap time
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
# Without restype/argtypes ctypes truncates 64-bit pointers to int.
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.fallocate.restype = ctypes.c_int
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_FALLOC_PUNCH_HOLE = 0x01 | 0x02  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE
TOMBSTONE_NAME = "defrag-emulated-unmapped"
_libc.mprotect.restype = ctypes.c_int
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

# For each needed protection, a bytes.translate table that maps a granule's
# protection to 0 when it grants that access and to 1 when it does not.
_LACKS = {need: bytes(0 if p & need == need else 1 for p in range(256)) for need in (_PROT_READ, _PROT_RW)}


def _os_mmap(addr: int, size: int, prot: int, flags: int, fd: int = -1, offset: int = 0) -> int:
    result = _libc.mmap(addr or None, size, prot, flags, fd, offset)
    if result is None or result == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap failed: {os.strerror(err)}")
    return result


def _os_check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what} failed: {os.strerror(err)}")


@dataclass
class _Physical:
    fd: int
    size: int
    released: bool = False
    map_count: int = 0
    host: bool = False  # a host-located page (CU_MEM_LOCATION_TYPE_HOST_NUMA): counted in host_used


@dataclass
class _Mapping:
    va: int
    size: int
    handle: int
    offset: int
    prots: bytearray = None  # protection per granule of this mapping (SetAccess may cover part of it)


@dataclass
class _Reservation:
    base: int
    size: int


SIDE_STREAM = -1  # `defer_write`'s stream: only a device-wide synchronize waits for it
PRIMARY_CONTEXT_BASE = 0xC000  # device N's primary context is this + N (any nonzero id would do)


@dataclass
class _Queued:
    """Work queued on a device (see `async_work`, `defer_write`), run at a synchronize."""
    device: int
    stream: int
    run: object  # callable(): False where its target is no longer mapped with access


class EmulatedCuda:
    """One emulated GPU (or several identical ones) on host memory.

    Instances are independent: each has its own capacity, handles, reservations
    and fault plan, so tests can build a fresh device each. Thread-safe: every
    entry point holds one lock, like the driver's own serialization of VMM calls.
    """

    def __init__(self, *, capacity: int = DEFAULT_CAPACITY, granularity: int = DEFAULT_GRANULARITY,
                 device_count: int = 1, name: str = "defrag emulated device",
                 host_capacity: int = DEFAULT_HOST_CAPACITY, host_pages: bool = True,
                 host_numa_attributes: bool = True):
        page = mmap.PAGESIZE
        if granularity <= 0 or granularity % page:
            raise ValueError(f"granularity must be a positive multiple of the host page size ({page}), got {granularity}")
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = int(capacity)
        self.granularity = int(granularity)
        self.device_count = int(device_count)
        self.name = name
        self.used = 0  # bytes held by live physical allocations on the device
        if host_capacity < 0:
            raise ValueError(f"host_capacity must be >= 0, got {host_capacity}")
        self.host_capacity = int(host_capacity)  # host-located pages and pinned buffers, apart from `capacity`
        self.host_used = 0
        self.host_pages = bool(host_pages)  # whether cuMemCreate accepts a host NUMA location
        # False: the host NUMA attributes are unknown to this "driver" (CUDA_ERROR_INVALID_VALUE), as on
        # 12.x drivers older than those attributes, whatever `host_pages` says.
        self.host_numa_attributes = bool(host_numa_attributes)
        self._pinned: dict[int, int] = {}  # cuMemAllocHost base -> size
        self.capturing = False  # tests flip this to emulate CUDA graph capture
        self._lock = threading.RLock()
        self._initialized = False
        self._handles: dict[int, _Physical] = {}
        self._next_handle = itertools.count(0x1000)
        self._reservations: dict[int, _Reservation] = {}
        self._res_starts: list[int] = []
        self._mappings: dict[int, _Mapping] = {}
        self._map_starts: list[int] = []
        self._contexts: dict[int, int] = {}  # context id -> retain count
        self._thread = threading.local()  # .ctx: the calling thread's current context (0: none)
        self._ctx_handles: dict[int, object] = {}  # context id -> its CUcontext
        self.async_work = False  # tests: queue DtoD copies and memsets until a synchronize, as a GPU runs them
        self._queued: list[_Queued] = []
        self.late_faults = 0  # queued work that found its target unmapped (an illegal address on a GPU)
        self._closing = False
        self.calls: dict[str, int] = {}
        self._tombstone: int | None = None  # memfd mapped over every unmapped granule (see _bury)

    # ---------------------------------------------------------------- helpers
    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def _aligned(self, *values: int) -> bool:
        return all(int(v) % self.granularity == 0 for v in values)

    def _reservation_of(self, va: int, size: int) -> _Reservation | None:
        i = bisect.bisect_right(self._res_starts, va) - 1
        if i < 0:
            return None
        res = self._reservations[self._res_starts[i]]
        if va >= res.base and va + size <= res.base + res.size:
            return res
        return None

    def _mappings_in(self, va: int, size: int) -> list[_Mapping]:
        """Mappings intersecting [va, va+size), in address order."""
        i = bisect.bisect_right(self._map_starts, va) - 1
        i = max(i, 0)
        out = []
        end = va + size
        while i < len(self._map_starts):
            m = self._mappings[self._map_starts[i]]
            if m.va >= end:
                break
            if m.va + m.size > va:
                out.append(m)
            i += 1
        return out

    def _covering(self, va: int, size: int) -> list[_Mapping] | None:
        """The mappings that exactly tile [va, va+size) without gaps, else None."""
        maps = self._mappings_in(va, size)
        cursor = va
        for m in maps:
            if m.va > cursor:
                return None
            cursor = m.va + m.size
        if not maps or maps[0].va > va or cursor < va + size:
            return None
        return maps

    def _accessible(self, ptr: int, size: int, write: bool) -> bool:
        maps = self._covering(ptr, size)
        if maps is None:
            return False
        need = _PROT_RW if write else _PROT_READ
        g = self.granularity
        end = ptr + size
        for m in maps:
            first = (max(ptr, m.va) - m.va) // g
            last = (min(end, m.va + m.size) - 1 - m.va) // g
            if 1 in m.prots[first:last + 1].translate(_LACKS[need]):
                return False
        return True

    def _drop_physical(self, handle: int) -> None:
        phys = self._handles.pop(handle)
        self._host_release(phys.fd)
        if phys.host:
            self.host_used -= phys.size
        else:
            self.used -= phys.size

    @staticmethod
    def _int(value) -> int:
        return int(value)

    # ---------------------------------------------------------------- context
    def cuInit(self, flags):
        self._count("cuInit")
        with self._lock:
            self._initialized = True
        return (R.CUDA_SUCCESS,)

    def _need_init(self):
        return None if self._initialized else R.CUDA_ERROR_NOT_INITIALIZED

    def cuDeviceGetCount(self):
        self._count("cuDeviceGetCount")
        if (e := self._need_init()) is not None:
            return (e, 0)
        return (R.CUDA_SUCCESS, self.device_count)

    def cuDeviceGet(self, ordinal):
        self._count("cuDeviceGet")
        if (e := self._need_init()) is not None:
            return (e, cu.CUdevice(0))
        if not 0 <= int(ordinal) < self.device_count:
            return (R.CUDA_ERROR_INVALID_DEVICE, cu.CUdevice(0))
        return (R.CUDA_SUCCESS, cu.CUdevice(int(ordinal)))

    def cuDeviceGetName(self, length, dev):
        self._count("cuDeviceGetName")
        return (R.CUDA_SUCCESS, self.name.encode()[: int(length)])

    def cuDeviceTotalMem(self, dev):
        self._count("cuDeviceTotalMem")
        return (R.CUDA_SUCCESS, self.capacity)

    def cuDriverGetVersion(self):
        self._count("cuDriverGetVersion")
        return (R.CUDA_SUCCESS, 0)

    def cuDeviceGetAttribute(self, attrib, dev):
        """Only the attributes defrag asks about (host NUMA VMM support); others: CUDA_ERROR_INVALID_VALUE."""
        self._count("cuDeviceGetAttribute")
        if not isinstance(attrib, cu.CUdevice_attribute):
            raise TypeError(f"attrib must be a CUdevice_attribute, got {type(attrib).__name__}")
        if (e := self._need_init()) is not None:
            return (e, 0)
        if not 0 <= int(dev) < self.device_count:
            return (R.CUDA_ERROR_INVALID_DEVICE, 0)
        a = cu.CUdevice_attribute
        if not self.host_numa_attributes:
            return (R.CUDA_ERROR_INVALID_VALUE, 0)
        if attrib == a.CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID:
            return (R.CUDA_SUCCESS, HOST_NUMA_NODE if self.host_pages else -1)
        if attrib == a.CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED:
            return (R.CUDA_SUCCESS, int(self.host_pages))
        return (R.CUDA_ERROR_INVALID_VALUE, 0)

    def cuDevicePrimaryCtxRetain(self, dev):
        self._count("cuDevicePrimaryCtxRetain")
        if (e := self._need_init()) is not None:
            return (e, cu.CUcontext(0))
        with self._lock:
            ctx_id = PRIMARY_CONTEXT_BASE + int(dev)
            self._contexts[ctx_id] = self._contexts.get(ctx_id, 0) + 1
            return (R.CUDA_SUCCESS, self._context_handle(ctx_id))

    def _context_handle(self, ctx_id: int):
        """The one CUcontext of `ctx_id`, so a driver can tell its own context by identity."""
        handle = self._ctx_handles.get(ctx_id)
        if handle is None:
            handle = self._ctx_handles[ctx_id] = cu.CUcontext(ctx_id)
        return handle

    def cuDevicePrimaryCtxRelease(self, dev):
        self._count("cuDevicePrimaryCtxRelease")
        with self._lock:
            ctx_id = PRIMARY_CONTEXT_BASE + int(dev)
            if self._contexts.get(ctx_id, 0) <= 0:
                return (R.CUDA_ERROR_INVALID_CONTEXT,)
            self._contexts[ctx_id] -= 1
        return (R.CUDA_SUCCESS,)

    def cuCtxSetCurrent(self, ctx):
        self._count("cuCtxSetCurrent")
        if int(ctx) and int(ctx) not in self._contexts:
            return (R.CUDA_ERROR_INVALID_CONTEXT,)
        self._thread.ctx = int(ctx)
        return (R.CUDA_SUCCESS,)

    def cuCtxGetCurrent(self):
        self._count("cuCtxGetCurrent")
        return (R.CUDA_SUCCESS, self._context_handle(getattr(self._thread, "ctx", 0)))

    def _current_device(self) -> int | None:
        """The device whose context is current on the calling thread, None when none is."""
        if self._closing:
            return 0
        ctx = getattr(self._thread, "ctx", 0)
        return ctx - PRIMARY_CONTEXT_BASE if ctx in self._contexts else None

    def cuCtxSynchronize(self):
        self._count("cuCtxSynchronize")
        device = self._current_device()
        if device is None:
            return (R.CUDA_ERROR_INVALID_CONTEXT,)
        return self._run_queued(lambda q: q.device == device)

    def cuStreamSynchronize(self, stream):
        self._count("cuStreamSynchronize")
        device = self._current_device()
        if device is None:
            return (R.CUDA_ERROR_INVALID_CONTEXT,)
        stream = int(stream)
        return self._run_queued(lambda q: q.device == device and q.stream == stream)

    def _run_queued(self, chosen):
        """Run the queued work `chosen` selects, oldest first; CUDA_ERROR_ILLEGAL_ADDRESS if any of it
        found its target unmapped (the rest still runs, as other streams on a GPU would)."""
        with self._lock:
            run = [q for q in self._queued if chosen(q)]
            if not run:
                return (R.CUDA_SUCCESS,)
            self._queued = [q for q in self._queued if not chosen(q)]
            faults = sum(1 for q in run if not q.run())
            self.late_faults += faults
        return (R.CUDA_ERROR_ILLEGAL_ADDRESS,) if faults else (R.CUDA_SUCCESS,)

    def defer_write(self, ptr: int, data: bytes, device: int = 0) -> None:
        """Queue a write of `data` at `ptr` on a side stream of `device` (a test aid).

        It lands at that device's next `cuCtxSynchronize`, through whatever is
        mapped at `ptr` then, like a kernel still running on another stream;
        nothing else (a copy on the legacy stream, a stream synchronize)
        waits for it.
        """
        ptr = int(ptr)
        source = ctypes.create_string_buffer(bytes(data), len(data))

        def run() -> bool:
            if not self._accessible(ptr, len(source), True):
                return False
            self._host_copy(ptr, ctypes.addressof(source), len(source))  # a host effect, as every one is
            return True

        with self._lock:
            self._queued.append(_Queued(int(device), SIDE_STREAM, run))

    def queued(self) -> int:
        """How many queued operations have not run yet (a test aid)."""
        with self._lock:
            return len(self._queued)

    def cuStreamIsCapturing(self, stream):
        self._count("cuStreamIsCapturing")
        if self._current_device() is None:
            return (R.CUDA_ERROR_INVALID_CONTEXT, cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE)
        status = cu.CUstreamCaptureStatus
        return (R.CUDA_SUCCESS,
                status.CU_STREAM_CAPTURE_STATUS_ACTIVE if self.capturing else status.CU_STREAM_CAPTURE_STATUS_NONE)

    def cuMemGetInfo(self):
        self._count("cuMemGetInfo")
        if self._current_device() is None:
            return (R.CUDA_ERROR_INVALID_CONTEXT, 0, 0)
        with self._lock:
            return (R.CUDA_SUCCESS, self.capacity - self.used, self.capacity)

    # ---------------------------------------------------------------- physical
    def _check_prop(self, prop) -> bool:
        return self._prop_kind(prop) is not None

    def _prop_kind(self, prop) -> str | None:
        """"device" or "host" (a host NUMA location this device accepts), None for an invalid prop."""
        if not isinstance(prop, cu.CUmemAllocationProp):
            raise TypeError(f"prop must be a cuda.bindings.driver.CUmemAllocationProp, got {type(prop).__name__}")
        if prop.type != cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED:
            return None
        where = prop.location.type
        if where == cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE and 0 <= prop.location.id < self.device_count:
            return "device"
        if (where == cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA and self.host_pages
                and prop.location.id == HOST_NUMA_NODE):
            return "host"
        return None

    def cuMemGetAllocationGranularity(self, prop, option):
        self._count("cuMemGetAllocationGranularity")
        if not self._check_prop(prop):
            return (R.CUDA_ERROR_INVALID_VALUE, 0)
        if not isinstance(option, cu.CUmemAllocationGranularity_flags):
            raise TypeError("option must be a CUmemAllocationGranularity_flags")
        return (R.CUDA_SUCCESS, self.granularity)

    def cuMemCreate(self, size, prop, flags):
        self._count("cuMemCreate")
        size = int(size)
        with self._lock:
            if (e := self._need_init()) is not None:
                return (e, cu.CUmemGenericAllocationHandle(0))
            kind = self._prop_kind(prop)
            if kind is None or size <= 0 or not self._aligned(size) or int(flags) != 0:
                return (R.CUDA_ERROR_INVALID_VALUE, cu.CUmemGenericAllocationHandle(0))
            host = kind == "host"
            if (self.host_used + size > self.host_capacity) if host else (self.used + size > self.capacity):
                return (R.CUDA_ERROR_OUT_OF_MEMORY, cu.CUmemGenericAllocationHandle(0))
            fd = self._host_create(size)
            if fd is None:
                return (R.CUDA_ERROR_OUT_OF_MEMORY, cu.CUmemGenericAllocationHandle(0))
            handle = next(self._next_handle)
            self._handles[handle] = _Physical(fd=fd, size=size, host=host)
            if host:
                self.host_used += size
            else:
                self.used += size
            return (R.CUDA_SUCCESS, cu.CUmemGenericAllocationHandle(handle))

    def cuMemRelease(self, handle):
        self._count("cuMemRelease")
        handle = int(handle)
        with self._lock:
            phys = self._handles.get(handle)
            if phys is None or phys.released:
                return (R.CUDA_ERROR_INVALID_VALUE,)
            phys.released = True
            if phys.map_count == 0:
                self._drop_physical(handle)
            return (R.CUDA_SUCCESS,)

    # ---------------------------------------------------------------- virtual
    def cuMemAddressReserve(self, size, alignment, addr, flags):
        self._count("cuMemAddressReserve")
        size, alignment = int(size), int(alignment)
        with self._lock:
            if (e := self._need_init()) is not None:
                return (e, cu.CUdeviceptr(0))
            if alignment == 0:
                alignment = self.granularity
            if (size <= 0 or not self._aligned(size) or alignment & (alignment - 1)
                    or alignment % self.granularity or int(flags) != 0):
                return (R.CUDA_ERROR_INVALID_VALUE, cu.CUdeviceptr(0))
            base = self._host_reserve(size, alignment)  # the hint is ignored, as the driver may
            if base is None:
                return (R.CUDA_ERROR_OUT_OF_MEMORY, cu.CUdeviceptr(0))
            self._reservations[base] = _Reservation(base, size)
            bisect.insort(self._res_starts, base)
            return (R.CUDA_SUCCESS, cu.CUdeviceptr(base))

    def cuMemAddressFree(self, ptr, size):
        self._count("cuMemAddressFree")
        ptr, size = int(ptr), int(size)
        with self._lock:
            res = self._reservations.get(ptr)
            if res is None or res.size != size or self._mappings_in(ptr, size):
                return (R.CUDA_ERROR_INVALID_VALUE,)
            self._host_free(ptr, size)
            del self._reservations[ptr]
            del self._res_starts[bisect.bisect_left(self._res_starts, ptr)]
            if not self._reservations:
                self._host_idle()
            return (R.CUDA_SUCCESS,)

    def cuMemMap(self, ptr, size, offset, handle, flags):
        self._count("cuMemMap")
        ptr, size, offset, handle = int(ptr), int(size), int(offset), int(handle)
        if self._current_device() is None:
            return (R.CUDA_ERROR_INVALID_CONTEXT,)
        with self._lock:
            phys = self._handles.get(handle)
            if (phys is None or phys.released or size <= 0 or int(flags) != 0
                    or offset != 0  # CUDA: "offset currently must be zero"
                    or not self._aligned(ptr, size) or size > phys.size
                    or self._reservation_of(ptr, size) is None or self._mappings_in(ptr, size)):
                return (R.CUDA_ERROR_INVALID_VALUE,)
            self._host_map(ptr, size, phys.fd, offset)
            self._mappings[ptr] = _Mapping(ptr, size, handle, offset, bytearray(size // self.granularity))
            bisect.insort(self._map_starts, ptr)
            phys.map_count += 1
            return (R.CUDA_SUCCESS,)

    def cuMemUnmap(self, ptr, size):
        self._count("cuMemUnmap")
        ptr, size = int(ptr), int(size)
        if self._current_device() is None:
            return (R.CUDA_ERROR_INVALID_CONTEXT,)
        with self._lock:
            if size <= 0 or not self._aligned(ptr, size):
                return (R.CUDA_ERROR_INVALID_VALUE,)
            maps = self._covering(ptr, size)
            # One unmap may cover several whole mappings but never split one.
            if maps is None or maps[0].va != ptr or maps[-1].va + maps[-1].size != ptr + size:
                return (R.CUDA_ERROR_INVALID_VALUE,)
            self._host_unmap(ptr, size)
            # The mappings tile [ptr, ptr+size): their starts are adjacent in _map_starts.
            first = bisect.bisect_left(self._map_starts, ptr)
            del self._map_starts[first:first + len(maps)]
            for m in maps:
                del self._mappings[m.va]
                phys = self._handles[m.handle]
                phys.map_count -= 1
                if phys.released and phys.map_count == 0:
                    self._drop_physical(m.handle)
            return (R.CUDA_SUCCESS,)

    def cuMemSetAccess(self, ptr, size, desc, count):
        self._count("cuMemSetAccess")
        ptr, size, count = int(ptr), int(size), int(count)
        descs = list(desc)
        for d in descs:
            if not isinstance(d, cu.CUmemAccessDesc):
                raise TypeError(f"desc entries must be CUmemAccessDesc, got {type(d).__name__}")
        if self._current_device() is None:
            return (R.CUDA_ERROR_INVALID_CONTEXT,)
        with self._lock:
            if count != len(descs) or count < 1 or size <= 0 or not self._aligned(ptr, size):
                return (R.CUDA_ERROR_INVALID_VALUE,)
            maps = self._covering(ptr, size)
            if maps is None:
                return (R.CUDA_ERROR_INVALID_VALUE,)
            prot = None
            flags = cu.CUmemAccess_flags
            for d in descs:
                if (d.location.type != cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                        or not 0 <= d.location.id < self.device_count):
                    return (R.CUDA_ERROR_INVALID_DEVICE,)
                prot = {flags.CU_MEM_ACCESS_FLAGS_PROT_NONE: _PROT_NONE,
                        flags.CU_MEM_ACCESS_FLAGS_PROT_READ: _PROT_READ,
                        flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE: _PROT_RW}.get(d.flags)
                if prot is None:
                    return (R.CUDA_ERROR_INVALID_VALUE,)
            self._host_protect(ptr, size, prot)
            g = self.granularity
            for m in maps:
                # SetAccess may cover part of a mapping: record it per granule.
                first = (max(ptr, m.va) - m.va) // g
                last = (min(ptr + size, m.va + m.size) - m.va) // g
                m.prots[first:last] = bytes([prot]) * (last - first)
            return (R.CUDA_SUCCESS,)

    # ---------------------------------------------------------------- copies
    def cuMemcpyDtoDAsync(self, dst, src, nbytes, stream):
        self._count("cuMemcpyDtoDAsync")
        return self._memcpy(int(dst), int(src), int(nbytes), int(stream))

    def cuMemcpyDtoD(self, dst, src, nbytes):
        self._count("cuMemcpyDtoD")
        return self._memcpy(int(dst), int(src), int(nbytes), None)

    def _memcpy(self, dst: int, src: int, nbytes: int, stream: int | None):
        """A copy, checked now; run now, or queued on `stream` under `async_work` (None: synchronous)."""
        device = self._current_device()
        if device is None:
            return (R.CUDA_ERROR_INVALID_CONTEXT,)
        if nbytes == 0:
            return (R.CUDA_SUCCESS,)
        with self._lock:
            if nbytes < 0 or not self._accessible(src, nbytes, False) or not self._accessible(dst, nbytes, True):
                return (R.CUDA_ERROR_INVALID_VALUE,)

            def run() -> bool:
                if not (self._accessible(src, nbytes, False) and self._accessible(dst, nbytes, True)):
                    return False
                self._host_copy(dst, src, nbytes)
                return True
            return self._issue(device, stream, run)

    def _issue(self, device: int, stream: int | None, run):
        """Run `run` now, or queue it on `stream` when `async_work` is on (lock held)."""
        if self.async_work and stream is not None:
            self._queued.append(_Queued(device, stream, run))
        elif not run():
            return (R.CUDA_ERROR_ILLEGAL_ADDRESS,)
        return (R.CUDA_SUCCESS,)

    def cuMemsetD8Async(self, dst, value, nbytes, stream):
        self._count("cuMemsetD8Async")
        dst, nbytes, value = int(dst), int(nbytes), int(value) & 0xFF
        device = self._current_device()
        if device is None:
            return (R.CUDA_ERROR_INVALID_CONTEXT,)
        if nbytes == 0:
            return (R.CUDA_SUCCESS,)
        with self._lock:
            if nbytes < 0 or not self._accessible(dst, nbytes, True):
                return (R.CUDA_ERROR_INVALID_VALUE,)

            def run() -> bool:
                if not self._accessible(dst, nbytes, True):
                    return False
                self._host_set(dst, value, nbytes)
                return True
            return self._issue(device, int(stream), run)

    # ---------------------------------------------------------------- pinned host buffers
    def cuMemAllocHost(self, bytesize):
        self._count("cuMemAllocHost")
        size = int(bytesize)
        with self._lock:
            if (e := self._need_init()) is not None:
                return (e, 0)
            if size <= 0:
                return (R.CUDA_ERROR_INVALID_VALUE, 0)
            if self.host_used + size > self.host_capacity:
                return (R.CUDA_ERROR_OUT_OF_MEMORY, 0)
            ptr = self._host_pinned_alloc(size)
            if ptr is None:
                return (R.CUDA_ERROR_OUT_OF_MEMORY, 0)
            self._pinned[ptr] = size
            self.host_used += size
            return (R.CUDA_SUCCESS, ptr)

    def cuMemFreeHost(self, p):
        self._count("cuMemFreeHost")
        ptr = int(p)
        with self._lock:
            size = self._pinned.pop(ptr, None)
            if size is None:
                return (R.CUDA_ERROR_INVALID_VALUE,)
            self._host_pinned_free(ptr, size)
            self.host_used -= size
            return (R.CUDA_SUCCESS,)

    def _in_pinned(self, ptr: int, nbytes: int) -> bool:
        return any(base <= ptr and ptr + nbytes <= base + size for base, size in self._pinned.items())

    def cuMemcpyDtoH(self, dstHost, srcDevice, ByteCount):
        self._count("cuMemcpyDtoH")
        return self._pinned_copy(int(dstHost), int(srcDevice), int(ByteCount), to_device=False)

    def cuMemcpyHtoD(self, dstDevice, srcHost, ByteCount):
        self._count("cuMemcpyHtoD")
        return self._pinned_copy(int(dstDevice), int(srcHost), int(ByteCount), to_device=True)

    def _pinned_copy(self, dst: int, src: int, nbytes: int, *, to_device: bool):
        """A copy between device memory and a pinned host buffer: the device end must be mapped with
        read (DtoH) or write (HtoD) access, the host end inside one pinned buffer."""
        current = self._current_device()
        if current is None:
            return (R.CUDA_ERROR_INVALID_CONTEXT,)
        # Synchronous, on the legacy stream: what was queued there runs first.
        ran = self._run_queued(lambda q: q.device == current and q.stream == 0)
        if ran[0] != R.CUDA_SUCCESS:
            return ran
        if nbytes == 0:
            return (R.CUDA_SUCCESS,)
        device, host = (dst, src) if to_device else (src, dst)
        with self._lock:
            if nbytes < 0 or not self._accessible(device, nbytes, to_device) or not self._in_pinned(host, nbytes):
                return (R.CUDA_ERROR_INVALID_VALUE,)
            self._host_copy(dst, src, nbytes)
            return (R.CUDA_SUCCESS,)

    # ---------------------------------------------------------------- host memory
    # Every host-memory side effect of the driver calls above, and nothing else.
    # They run under the lock, after the call's rules have been checked; a
    # subclass (MemorylessCuda) overrides exactly these to hold no bytes.

    def _host_create(self, size: int) -> int | None:
        """Back a new physical allocation of `size` bytes; returns its fd, or None if out of memory."""
        fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
        except OSError:
            os.close(fd)
            return None
        return fd

    def _host_pinned_alloc(self, size: int) -> int | None:
        """Page-locked host memory of `size` bytes (here: an anonymous mapping, its pages faulted in at
        once, as page-locking does); its address, or None."""
        try:
            return _os_mmap(0, size, _PROT_RW, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_POPULATE)
        except OSError:
            return None

    def _host_pinned_free(self, ptr: int, size: int) -> None:
        """Free a buffer from `_host_pinned_alloc`."""
        _os_check(_libc.munmap(ptr, size), "munmap")

    def _host_release(self, fd: int) -> None:
        """Free a physical allocation's memory (it is no longer mapped anywhere)."""
        os.close(fd)

    def _host_reserve(self, size: int, alignment: int) -> int | None:
        """Reserve `size` bytes of address space aligned to `alignment`; the base, or None if exhausted."""
        # Over-reserve by the alignment, then trim both ends: mmap only
        # promises host-page alignment.
        span = size + alignment
        try:
            raw = _os_mmap(0, span, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE)
        except OSError:
            return None
        base = (raw + alignment - 1) // alignment * alignment
        if base > raw:
            _os_check(_libc.munmap(raw, base - raw), "munmap")
        tail = raw + span - (base + size)
        if tail:
            _os_check(_libc.munmap(base + size, tail), "munmap")
        return base

    def _host_free(self, base: int, size: int) -> None:
        """Give back a reservation's address space (nothing is mapped inside it)."""
        _os_check(_libc.munmap(base, size), "munmap")

    def _host_idle(self) -> None:
        """The last reservation is gone: drop per-device host resources (the tombstone)."""
        if self._tombstone is not None:
            os.close(self._tombstone)  # no granule of it is mapped any more
            self._tombstone = None

    def _host_map(self, ptr: int, size: int, fd: int, offset: int) -> None:
        """Map `size` bytes of the allocation `fd` from `offset` at `ptr`, with no access."""
        _os_mmap(ptr, size, _PROT_NONE, _MAP_SHARED | _MAP_FIXED, fd, offset)

    def _host_unmap(self, ptr: int, size: int) -> None:
        """Unmap [ptr, ptr+size): bury it under the tombstone (see `_bury`)."""
        self._bury(ptr, size)

    def _host_protect(self, ptr: int, size: int, prot: int) -> None:
        """Set the access of mapped [ptr, ptr+size) to `prot` (PROT_NONE, PROT_READ or both)."""
        _os_check(_libc.mprotect(ptr, size, prot), "mprotect")

    def _host_copy(self, dst: int, src: int, nbytes: int) -> None:
        """Copy `nbytes` between accessible ranges (they may overlap)."""
        ctypes.memmove(dst, src, nbytes)

    def _host_set(self, dst: int, value: int, nbytes: int) -> None:
        """Set `nbytes` bytes of an accessible range to the byte `value`."""
        ctypes.memset(dst, value, nbytes)

    # ---------------------------------------------------------------- unmapped pages
    def _bury(self, ptr: int, size: int) -> None:
        """Unmap [ptr, ptr+size): map the tombstone over each granule instead of PROT_NONE.

        A real GPU turns an access to an unmapped page into an illegal-address
        error; a host would segfault, killing the process. So an unmapped
        granule of the emulated device is backed by one shared, never-written
        memfd: a stale read or write (a kernel still using a tensor's old
        address) lands there harmlessly and allocates a host page in it, which
        `touched_unmapped()` reports. The driver itself still treats the range
        as unmapped (copies, memsets and SetAccess refuse it).
        """
        g = self.granularity
        tombstone = self._tombstone_fd()
        for va in range(ptr, ptr + size, g):
            _os_mmap(va, g, _PROT_RW, _MAP_SHARED | _MAP_FIXED, tombstone, 0)

    def _tombstone_fd(self) -> int:
        if self._tombstone is None:
            fd = os.memfd_create(TOMBSTONE_NAME, os.MFD_CLOEXEC)
            os.ftruncate(fd, self.granularity)
            self._tombstone = fd
        return self._tombstone

    def stale_probe_fd(self) -> int:
        """The file whose allocated blocks are the stale accesses `touched_unmapped` reports, made now if
        needed (a fast path reads it with fstat). Valid while any reservation of this device lives."""
        with self._lock:
            return self._tombstone_fd()

    def touched_unmapped(self) -> int:
        """Bytes of unmapped device memory read or written since the last call (host pages), then reset.

        0 unless something accessed an address whose page was unmapped: on a
        GPU that access would have been an illegal-address error.
        """
        fd = self._tombstone
        try:
            if fd is None or not os.fstat(fd).st_blocks:
                return 0  # the common case, without the lock
        except OSError:
            pass  # closed meanwhile (the device is closing): decide under the lock
        with self._lock:
            fd = self._tombstone
            if fd is None:
                return 0
            touched = os.fstat(fd).st_blocks * 512
            if touched:
                _os_check(_libc.fallocate(fd, _FALLOC_PUNCH_HOLE, 0, self.granularity), "fallocate")
            return touched

    # ---------------------------------------------------------------- inspection
    def is_accessible(self, ptr: int, size: int, write: bool = True) -> bool:
        """Whether [ptr, ptr+size) is mapped with (write) access: a test aid."""
        with self._lock:
            return self._accessible(int(ptr), int(size), write)

    def host_state(self) -> dict:
        """Counts of host-located pages and pinned host buffers still held: the host side's leak check."""
        with self._lock:
            return {"host_pages": sum(1 for p in self._handles.values() if p.host),
                    "pinned_buffers": len(self._pinned), "host_used_bytes": self.host_used}

    def state(self) -> dict:
        """Counts of live handles, mappings and reservations: a leak check."""
        with self._lock:
            return {"handles": len(self._handles), "mappings": len(self._mappings),
                    "reservations": len(self._reservations), "used_bytes": self.used}

    def close(self) -> None:
        """Tear down everything still held (a process exit for this device), from any thread."""
        with self._lock:
            self._closing = True  # a process exit needs no current context
            self._queued.clear()
            for va in list(self._map_starts):
                m = self._mappings[va]
                self.cuMemUnmap(m.va, m.size)
            for handle in list(self._handles):
                self._handles[handle].released = True
                self._drop_physical(handle)
            for base in list(self._res_starts):
                self.cuMemAddressFree(base, self._reservations[base].size)
            for ptr in list(self._pinned):
                self.cuMemFreeHost(ptr)
