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
- kernels: a module image names *host twins* (`host_kernels`: Python
  functions registered under a kernel's name) instead of GPU code;
  cuLaunchKernel reads the launch's 8-byte parameters and calls the twin
  with them (queued like a copy under `async_work`); occupancy follows an
  sm_90 SM's register file; `cuMemAlloc` buffers (kernels' tables) are
  anonymous host mappings, counted in `kernel_state()`, not in `capacity`;
  events complete when their stream reaches them;
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

It is cut in three parts. `EmulatedCuda` holds the driver calls: each one's
rules and error codes, the contexts, the physical handles and the capacity
accounting, the queued work of streams, the pinned buffers. What its virtual
address space holds (reservations, mappings, each granule's access) is kept
in its `AddressBooks` (`address_books.py`), which checks no rule. Every
host-memory side effect (create/release a page's memfd, reserve/free address
space, map/unmap/protect, copy/set bytes, pinned buffers, the tombstone) is
done by its `host_memory`, a `HostMemory` (`host_memory.py`), once the call's
rules have passed. `defrag.driver.memoryless.MemorylessCuda` swaps only that
part (`host_memory_class`), so the memory-less device follows exactly these
rules with no bytes behind them.

Host memory the device can use (sleep, wake, offload) is a kind of
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

import ctypes
import functools
import itertools
import logging
import mmap
import os
import threading
import weakref
from dataclasses import dataclass

from cuda.bindings import driver as cu

from . import host_kernels
from .address_books import AddressBooks
from .signatures import SIGNATURES, conform
from .host_memory import MEMFD_NAME, TOMBSTONE_NAME  # noqa: F401  (still named from here: the memfds' names)
from .host_memory import PROT_NONE, PROT_READ, PROT_RW, HostMemory

R = cu.CUresult
GiB = 1 << 30
MiB = 1 << 20

DEFAULT_GRANULARITY = 2 * MiB  # what H100/H200 report for CU_MEM_ALLOC_GRANULARITY_MINIMUM
DEFAULT_CAPACITY = 16 * GiB
DEFAULT_HOST_CAPACITY = 64 * GiB  # host-located pages and pinned buffers (memfd/mmap pages cost nothing until written)
HOST_NUMA_NODE = 0  # the one host NUMA node the emulated device offers
DEFAULT_SM_COUNT = 132  # an H200's, the GPU the rehearsals stand in for
COMPUTE_CAPABILITY = (9, 0)


@dataclass
class _Physical:
    fd: int
    size: int
    released: bool = False
    map_count: int = 0
    host: bool = False  # a host-located page (CU_MEM_LOCATION_TYPE_HOST_NUMA): counted in host_used


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

    #: What does each call's host side (`host_memory`): real memfd pages and mmap here, an address
    #: counter with no bytes for `MemorylessCuda`. Built with (granularity, the device's lock).
    host_memory_class: type[HostMemory] = HostMemory

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _take_arguments_as_the_binding_does(cls)  # entry points a subclass defines are checked too

    def __init__(self, *, capacity: int = DEFAULT_CAPACITY, granularity: int = DEFAULT_GRANULARITY,
                 device_count: int = 1, name: str = "defrag emulated device",
                 host_capacity: int = DEFAULT_HOST_CAPACITY, host_pages: bool = True,
                 host_numa_attributes: bool = True, sm_count: int = DEFAULT_SM_COUNT):
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
        self.sm_count = int(sm_count)  # CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
        self._linear: dict[int, int] = {}  # cuMemAlloc base -> size (kernels' tables; outside `capacity`)
        self._modules: dict[int, dict] = {}  # module id -> {name: HostKernel} (see host_kernels)
        self._functions: dict[int, tuple[int, object]] = {}  # function id -> (module id, HostKernel)
        self._events: dict[int, list] = {}  # event id -> [done, stream recorded on, capture recorded in]
        self._next_id = itertools.count(0x100)
        self.capturing = False  # tests flip this to emulate CUDA graph capture (every stream captures)
        # Stream capture, as CUDA's rules have it (global mode, PyTorch's default): the streams that
        # begin_capture (cuStreamBeginCapture) began (stream -> capture id), the captures a forbidden
        # call invalidated, and each forbidden call tried (name, why): a test fails on any.
        self._captures: dict[int, int] = {}
        self._invalidated: set[int] = set()
        self.capture_violations: list[tuple[str, str]] = []
        self._lock = threading.RLock()
        self._initialized = False
        self._handles: dict[int, _Physical] = {}
        self._released_mapped = 0  # handles released while still mapped (freed at their last unmap)
        self._next_handle = itertools.count(0x1000)
        self._addresses = AddressBooks(self.granularity)  # reservations, mappings, each granule's access
        self._contexts: dict[int, int] = {}  # context id -> retain count
        self._thread = threading.local()  # .ctx: the calling thread's current context (0: none)
        self._ctx_handles: dict[int, object] = {}  # context id -> its CUcontext
        self.async_work = False  # tests: queue DtoD copies and memsets until a synchronize, as a GPU runs them
        self._queued: list[_Queued] = []
        self.late_faults = 0  # queued work that found its target unmapped (an illegal address on a GPU)
        self._closing = False
        self.calls: dict[str, int] = {}
        self.host_memory = self.host_memory_class(self.granularity, self._lock)  # every host side effect
        _devices.add(self)  # a forked child keeps its writes to this device's pages to itself

    # ---------------------------------------------------------------- fork
    def _privatize_in_child(self) -> None:
        """In a child just forked: every mapping again, copy-on-write (`HostMemory.privatize`).

        The pages are memfds mapped MAP_SHARED, so without this a child's
        write into memory it inherited (a DataLoader worker normalizing a
        row in place) would land in the parent's tensor. Afterwards the
        child sees the bytes as they were at the fork, plus its own writes;
        the parent's later writes reach a child's page only until the child
        first writes that page. Runs for forks through Python (`os.fork`,
        multiprocessing, DataLoader workers); a fork from C code skips it.
        """
        locked = self._lock.acquire(blocking=False)  # a thread that held it at the fork is gone
        try:
            for m in self._addresses.in_address_order()[0]:
                phys = self._handles.get(m.handle)
                if phys is not None:  # released handles stay alive while mapped
                    self.host_memory.privatize(m.va, m.size, phys.fd, m.offset, m.prots)
        finally:
            if locked:
                self._lock.release()

    # ---------------------------------------------------------------- helpers
    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def _batch_refused(self, name: str, n: int) -> tuple | None:
        """What a batch of `n` calls of `name` returns before its first call's own rules: (CUDA_SUCCESS, 0)
        for no calls; without a current context, (CUDA_ERROR_INVALID_CONTEXT, 0), the first call counted;
        else None (go on)."""
        if not n:
            return (R.CUDA_SUCCESS, 0)
        if self._current_device() is None:
            self._count(name)
            return (R.CUDA_ERROR_INVALID_CONTEXT, 0)
        return None

    def _aligned(self, *values: int) -> bool:
        return all(int(v) % self.granularity == 0 for v in values)

    def _drop_physical(self, handle: int) -> None:
        phys = self._handles.pop(handle)
        self.host_memory.release_page(phys.fd)
        if phys.host:
            self.host_used -= phys.size
        else:
            self.used -= phys.size

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
        """Only the attributes defrag asks about (SM count, compute capability, host NUMA VMM support);
        others: CUDA_ERROR_INVALID_VALUE."""
        self._count("cuDeviceGetAttribute")
        if (e := self._need_init()) is not None:
            return (e, 0)
        if not 0 <= int(dev) < self.device_count:
            return (R.CUDA_ERROR_INVALID_DEVICE, 0)
        a = cu.CUdevice_attribute
        if attrib == a.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT:
            return (R.CUDA_SUCCESS, self.sm_count)
        if attrib == a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR:
            return (R.CUDA_SUCCESS, COMPUTE_CAPABILITY[0])
        if attrib == a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR:
            return (R.CUDA_SUCCESS, COMPUTE_CAPABILITY[1])
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
        if self._captures:  # (the `capturing` flag keeps its old meaning: tests that flip it only ask)
            return self._forbidden("cuCtxSynchronize", "synchronized the device during a capture")
        return self._run_queued(lambda q: q.device == device)

    def cuStreamSynchronize(self, stream):
        self._count("cuStreamSynchronize")
        device = self._current_device()
        if device is None:
            return (R.CUDA_ERROR_INVALID_CONTEXT,)
        stream = int(stream)
        if self._captures:
            return self._forbidden("cuStreamSynchronize", "synchronized a stream during a capture")
        return self._run_queued(lambda q: q.device == device and q.stream == stream)

    # ---------------------------------------------------------------- stream capture
    def _stream_capture(self, stream: int) -> int | None:
        """The capture `stream` records into: its capture id, -1 for `capturing` (every stream), None."""
        if self.capturing:
            return -1
        return self._captures.get(int(stream))

    def _capture_underway(self) -> bool:
        return bool(self.capturing or self._captures)

    def _forbidden(self, name: str, why: str, code=None):
        """A call CUDA refuses during a capture: counted, every capture underway invalidated (as CUDA
        invalidates the capture the call meets), refused with CUDA's error."""
        with self._lock:
            self.capture_violations.append((name, why))
            self._invalidated.update(self._captures.values())
        return ((code if code is not None else R.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED),)

    # cuStreamBeginCapture / cuStreamEndCapture / cuStreamWaitEvent as test aids (named apart from the
    # driver entry points, whose table is driver/signatures.py): the pool itself never calls them.
    def begin_capture(self, hStream, mode=0):
        """cuStreamBeginCapture: `hStream`'s work is recorded, not run, until `end_capture`."""
        self._count("cuStreamBeginCapture")
        if self._current_device() is None:
            return (R.CUDA_ERROR_INVALID_CONTEXT,)
        stream = int(hStream)
        with self._lock:
            if stream == 0 or stream in self._captures:
                return (R.CUDA_ERROR_ILLEGAL_STATE if hasattr(R, "CUDA_ERROR_ILLEGAL_STATE")
                        else R.CUDA_ERROR_INVALID_VALUE,)
            self._captures[stream] = next(self._next_id)
            return (R.CUDA_SUCCESS,)

    def end_capture(self, hStream):
        """cuStreamEndCapture: end the capture of `hStream`: (CUDA_SUCCESS, a graph placeholder), or
        CUDA_ERROR_STREAM_CAPTURE_INVALIDATED when a forbidden call invalidated it."""
        self._count("cuStreamEndCapture")
        stream = int(hStream)
        with self._lock:
            capture = self._captures.pop(stream, None)
            if capture is None:
                return (R.CUDA_ERROR_STREAM_CAPTURE_UNMATCHED, None)
            if capture in self._invalidated:
                self._invalidated.discard(capture)
                return (R.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, None)
            return (R.CUDA_SUCCESS, capture)

    def stream_wait_event(self, hStream, hEvent, Flags=0):
        """cuStreamWaitEvent: `hStream` waits for `hEvent`. A capturing stream may wait only for an event
        recorded in its own capture (or with CU_EVENT_WAIT_EXTERNAL, 1): else CUDA_ERROR_STREAM_CAPTURE_ISOLATION."""
        self._count("cuStreamWaitEvent")
        if self._current_device() is None:
            return (R.CUDA_ERROR_INVALID_CONTEXT,)
        stream, flags = int(hStream), int(Flags)
        with self._lock:
            event = self._events.get(int(hEvent))
            if event is None:
                return (R.CUDA_ERROR_INVALID_HANDLE,)
            capture = self._stream_capture(stream)
            recorded_in = event[2] if len(event) > 2 else None
        if capture is not None and not flags & 1 and (recorded_in is None or recorded_in != capture):
            return self._forbidden("cuStreamWaitEvent", "a capturing stream waited for an event recorded outside "
                                   "its capture", R.CUDA_ERROR_STREAM_CAPTURE_ISOLATION)
        return (R.CUDA_SUCCESS,)

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
            if not self._addresses.accessible(ptr, len(source), True):
                return False
            self.host_memory.copy(ptr, ctypes.addressof(source), len(source))  # a host effect, as every one is
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
        with self._lock:
            capture = self._stream_capture(int(stream))
            if capture is None:
                return (R.CUDA_SUCCESS, status.CU_STREAM_CAPTURE_STATUS_NONE)
            if capture in self._invalidated:
                return (R.CUDA_SUCCESS, status.CU_STREAM_CAPTURE_STATUS_INVALIDATED)
        return (R.CUDA_SUCCESS, status.CU_STREAM_CAPTURE_STATUS_ACTIVE)

    def cuMemGetInfo(self):
        self._count("cuMemGetInfo")
        if self._current_device() is None:
            return (R.CUDA_ERROR_INVALID_CONTEXT, 0, 0)
        with self._lock:
            return (R.CUDA_SUCCESS, self.capacity - self.used, self.capacity)

    # ---------------------------------------------------------------- physical
    def _prop_kind(self, prop) -> str | None:
        """"device" or "host" (a host NUMA location this device accepts), None for an invalid prop (None,
        the NULL the binding passes for it, included)."""
        if prop is None:
            return None
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
        if self._prop_kind(prop) is None or option not in (0, 1):  # MINIMUM, RECOMMENDED
            return (R.CUDA_ERROR_INVALID_VALUE, 0)
        return (R.CUDA_SUCCESS, self.granularity)

    def cuMemCreate(self, size, prop, flags):
        self._count("cuMemCreate")
        error, handle = self._create(int(size), prop, int(flags))
        return (error, cu.CUmemGenericAllocationHandle(handle))

    def create_each(self, size: int, prop, n: int) -> tuple:
        """`cuMemCreate(size, prop, 0)` `n` times under one hold of the lock, stopping at the first that
        fails: (its CUresult, or CUDA_SUCCESS; the handles made, as ints). Each is counted as one
        cuMemCreate. An exception from the host side (no memfd to be had) carries the handles made before
        it as `created` (and their count as `mapped`). `Driver.create_each` calls it after the fault plan,
        never FaultInjector."""
        made: list[int] = []

        def create(_: int):
            error, handle = self._create(int(size), prop, 0)
            if error == R.CUDA_SUCCESS:
                made.append(handle)
            return error

        try:
            error, _ = self._each("cuMemCreate", n, create)
        except BaseException as exc:  # the host side (a memfd): what came before is made, and the caller's
            exc.created = made
            raise
        return (error, made)

    def _each(self, name: str, n: int, call) -> tuple:
        """`call(i)` (one call of `name`'s rules and effect, returning its CUresult) for i in 0..n-1 under one
        hold of the lock, stopping at the first that fails: (its CUresult, or CUDA_SUCCESS; how many
        succeeded). Each is counted as one call of `name`; an exception (from the host side) carries how
        many succeeded before it as `mapped`."""
        done = 0
        error = R.CUDA_SUCCESS
        with self._lock:
            try:
                while done < n:
                    error = call(done)
                    if error != R.CUDA_SUCCESS:
                        break
                    done += 1
            except BaseException as exc:
                exc.mapped = done
                raise
            finally:
                self.calls[name] = self.calls.get(name, 0) + done + (done < n)
        return (error, done)

    def _create(self, size: int, prop, flags: int) -> tuple:
        """cuMemCreate's rules and effect: (CUresult, the new handle as an int, 0 on failure)."""
        with self._lock:
            if (e := self._need_init()) is not None:
                return (e, 0)
            kind = self._prop_kind(prop)
            if kind is None or size <= 0 or not self._aligned(size) or flags != 0:
                return (R.CUDA_ERROR_INVALID_VALUE, 0)
            host = kind == "host"
            if (self.host_used + size > self.host_capacity) if host else (self.used + size > self.capacity):
                return (R.CUDA_ERROR_OUT_OF_MEMORY, 0)
            fd = self.host_memory.create_page(size)
            if fd is None:
                return (R.CUDA_ERROR_OUT_OF_MEMORY, 0)
            handle = next(self._next_handle)
            self._handles[handle] = _Physical(fd=fd, size=size, host=host)
            if host:
                self.host_used += size
            else:
                self.used += size
            return (R.CUDA_SUCCESS, handle)

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
            else:
                self._released_mapped += 1  # freed at its last unmap
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
            base = self.host_memory.reserve(size, alignment)  # the hint is ignored, as the driver may
            if base is None:
                return (R.CUDA_ERROR_OUT_OF_MEMORY, cu.CUdeviceptr(0))
            self._addresses.add_reservation(base, size)
            return (R.CUDA_SUCCESS, cu.CUdeviceptr(base))

    def cuMemAddressFree(self, ptr, size):
        self._count("cuMemAddressFree")
        ptr, size = int(ptr), int(size)
        with self._lock:
            res = self._addresses.reservations.get(ptr)
            if res is None or res.size != size or self._addresses.any_in(ptr, size):
                return (R.CUDA_ERROR_INVALID_VALUE,)
            self.host_memory.free_reserved(ptr, size)
            self._addresses.remove_reservation(ptr)
            if not self._addresses.reservations:
                self.host_memory.drop_tombstone()
            return (R.CUDA_SUCCESS,)

    def cuMemMap(self, ptr, size, offset, handle, flags):
        if int(offset) != 0 or int(flags) != 0:  # CUDA: "offset currently must be zero"; no flags exist
            self._count("cuMemMap")
            return ((R.CUDA_ERROR_INVALID_CONTEXT,) if self._current_device() is None
                    else (R.CUDA_ERROR_INVALID_VALUE,))
        error, _ = self.map_each([int(ptr)], size, [handle])  # one call: the batch's rules, applied once
        return (error,)

    def map_each(self, ptrs: list[int], size: int, handles: list[int]) -> tuple:
        """`cuMemMap(ptrs[i], size, 0, handles[i], 0)` for each i in order, under one hold of the lock,
        stopping at the first that fails: returns (that call's CUresult, or CUDA_SUCCESS; how many
        mapped). Each is counted as one cuMemMap and judged by its rules, which live here (`cuMemMap`
        is a batch of one, after its offset and flags checks); a run of pages `size` apart
        is checked against the reservations and mappings once and recorded with one insertion, which
        is what makes a batch cheaper than its calls (not what it does). An exception from the host
        side (an mmap that fails) leaves the pages before it mapped and recorded, as the calls one by
        one would, and carries their count as `mapped`. `Driver.map_each` calls it after the fault
        plan, never FaultInjector."""
        n = len(ptrs)
        if (refused := self._batch_refused("cuMemMap", n)) is not None:
            return refused
        size = int(size)
        books, host_map, table = self._addresses, self.host_memory.map, self._handles
        maps_bytes = self.host_memory.maps_bytes  # a memory-less device's map does nothing: not called
        with self._lock:
            done = 0
            error = R.CUDA_SUCCESS
            raised = False
            try:
                if size <= 0 or not self._aligned(size):
                    error = R.CUDA_ERROR_INVALID_VALUE
                while done < n and error == R.CUDA_SUCCESS:
                    # The longest run from `done` of addresses `size` apart, each page free in one reservation.
                    first = ptrs[done]
                    run = 1
                    while done + run < n and ptrs[done + run] == first + run * size:
                        run += 1
                    if (not self._aligned(first) or books.reservation_of(first, run * size) is None
                            or books.any_in(first, run * size)):
                        run = 1  # judge the pages one by one: the call that breaks a rule is the one that fails
                        if (not self._aligned(first) or books.reservation_of(first, size) is None
                                or books.any_in(first, size)):
                            error = R.CUDA_ERROR_INVALID_VALUE
                            break
                    mapped = done
                    ints = list(map(int, handles[done:done + run]))
                    try:
                        for i, phys in enumerate(map(table.get, ints), done):
                            if phys is None or phys.released or size > phys.size:
                                error = R.CUDA_ERROR_INVALID_VALUE
                                break
                            if maps_bytes:
                                host_map(ptrs[i], size, phys.fd, 0)  # may raise (mmap): what came before stays
                            phys.map_count += 1
                            mapped = i + 1
                    finally:
                        books.add_mappings(ptrs[done:mapped], size, ints[:mapped - done])
                        done = mapped
            except BaseException as exc:
                # As a single cuMemMap would: the calls before it mapped and recorded, this one counted.
                raised = True
                exc.mapped = done
                raise
            finally:
                self.calls["cuMemMap"] = (self.calls.get("cuMemMap", 0) + done
                                          + (error != R.CUDA_SUCCESS or raised))
            return (error, done)

    def cuMemUnmap(self, ptr, size):
        self._count("cuMemUnmap")
        if self._current_device() is None:
            return (R.CUDA_ERROR_INVALID_CONTEXT,)
        return (self._unmap(int(ptr), int(size)),)

    def unmap_each(self, ranges: list[tuple[int, int]]) -> tuple:
        """`cuMemUnmap(ptr, size)` for each (ptr, size) in order, under one hold of the lock, stopping at the
        first that fails: (its CUresult, or CUDA_SUCCESS; how many unmapped). Each is counted as one
        cuMemUnmap. An exception from the host side (an mmap that fails) leaves the ranges before it
        unmapped and carries their count as `mapped`. `Driver.unmap_each` calls it after the fault plan,
        never FaultInjector."""
        n = len(ranges)
        if (refused := self._batch_refused("cuMemUnmap", n)) is not None:
            return refused
        return self._each("cuMemUnmap", n, lambda i: self._unmap(int(ranges[i][0]), int(ranges[i][1])))

    def _unmap(self, ptr: int, size: int):
        """cuMemUnmap's rules and effect (a current context is the caller's check): its CUresult."""
        with self._lock:
            if size <= 0 or not self._aligned(ptr, size):
                return R.CUDA_ERROR_INVALID_VALUE
            books = self._addresses
            cover = books.covering(ptr, size)
            # One unmap may cover several whole mappings but never split one.
            if cover is None or books.cover_span(cover) != (ptr, ptr + size):
                return R.CUDA_ERROR_INVALID_VALUE
            self.host_memory.unmap(ptr, size)
            table = self._handles
            handles = books.remove_mappings(cover)
            for phys in map(table.__getitem__, handles):
                phys.map_count -= 1
            if self._released_mapped:  # a handle released while mapped is freed at its last unmap
                for handle in handles:
                    phys = table.get(handle)
                    if phys is not None and phys.released and not phys.map_count:
                        self._released_mapped -= 1
                        self._drop_physical(handle)
            return R.CUDA_SUCCESS

    def cuMemSetAccess(self, ptr, size, desc, count):
        self._count("cuMemSetAccess")
        ptr, size, count = int(ptr), int(size), int(count)
        descs = list(desc or ())
        if self._current_device() is None:
            return (R.CUDA_ERROR_INVALID_CONTEXT,)
        with self._lock:
            if count != len(descs) or count < 1 or size <= 0 or not self._aligned(ptr, size):
                return (R.CUDA_ERROR_INVALID_VALUE,)
            cover = self._addresses.covering(ptr, size)
            if cover is None:
                return (R.CUDA_ERROR_INVALID_VALUE,)
            prot = None
            flags = cu.CUmemAccess_flags
            for d in descs:
                if (d.location.type != cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                        or not 0 <= d.location.id < self.device_count):
                    return (R.CUDA_ERROR_INVALID_DEVICE,)
                prot = {flags.CU_MEM_ACCESS_FLAGS_PROT_NONE: PROT_NONE,
                        flags.CU_MEM_ACCESS_FLAGS_PROT_READ: PROT_READ,
                        flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE: PROT_RW}.get(d.flags)
                if prot is None:
                    return (R.CUDA_ERROR_INVALID_VALUE,)
            self.host_memory.protect(ptr, size, prot)
            self._addresses.set_access(ptr, size, prot, cover)  # per granule: it may cover part of a mapping
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
            accessible = self._device_accessible
            if nbytes < 0 or not accessible(src, nbytes, False) or not accessible(dst, nbytes, True):
                return (R.CUDA_ERROR_INVALID_VALUE,)

            def run() -> bool:
                if not (accessible(src, nbytes, False) and accessible(dst, nbytes, True)):
                    return False
                self.host_memory.copy(dst, src, nbytes)
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
            if nbytes < 0 or not self._addresses.accessible(dst, nbytes, True):
                return (R.CUDA_ERROR_INVALID_VALUE,)

            def run() -> bool:
                if not self._addresses.accessible(dst, nbytes, True):
                    return False
                self.host_memory.fill(dst, value, nbytes)
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
            ptr = self.host_memory.alloc_pinned(size)
            if ptr is None:
                return (R.CUDA_ERROR_OUT_OF_MEMORY, 0)
            self._pinned[ptr] = size
            self.host_used += size
            return (R.CUDA_SUCCESS, ptr)

    def cuMemFreeHost(self, p):
        self._count("cuMemFreeHost")
        if not isinstance(p, int):  # a Python buffer: never one of this device's pinned buffers
            return (R.CUDA_ERROR_INVALID_VALUE,)
        ptr = p
        with self._lock:
            size = self._pinned.pop(ptr, None)
            if size is None:
                return (R.CUDA_ERROR_INVALID_VALUE,)
            self.host_memory.free_pinned(ptr, size)
            self.host_used -= size
            return (R.CUDA_SUCCESS,)

    def _in_pinned(self, ptr: int, nbytes: int) -> bool:
        return any(base <= ptr and ptr + nbytes <= base + size for base, size in self._pinned.items())

    def cuMemcpyDtoH(self, dstHost, srcDevice, ByteCount):
        self._count("cuMemcpyDtoH")
        if not isinstance(dstHost, int):  # a Python buffer: not pinned memory of this device
            return (R.CUDA_ERROR_INVALID_VALUE,)
        return self._pinned_copy(dstHost, int(srcDevice), int(ByteCount), to_device=False)

    def cuMemcpyHtoD(self, dstDevice, srcHost, ByteCount):
        self._count("cuMemcpyHtoD")
        if not isinstance(srcHost, int):
            return (R.CUDA_ERROR_INVALID_VALUE,)
        return self._pinned_copy(int(dstDevice), srcHost, int(ByteCount), to_device=True)

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
            if (nbytes < 0 or not self._device_accessible(device, nbytes, to_device)
                    or not self._in_pinned(host, nbytes)):
                return (R.CUDA_ERROR_INVALID_VALUE,)
            self.host_memory.copy(dst, src, nbytes)
            return (R.CUDA_SUCCESS,)

    def cuMemcpyHtoDAsync(self, dstDevice, srcHost, ByteCount, hStream):
        self._count("cuMemcpyHtoDAsync")
        if not isinstance(srcHost, int):  # a Python buffer: not pinned memory of this device
            return (R.CUDA_ERROR_INVALID_VALUE,)
        return self._pinned_copy_async(int(dstDevice), srcHost, int(ByteCount), int(hStream), to_device=True)

    def cuMemcpyDtoHAsync(self, dstHost, srcDevice, ByteCount, hStream):
        self._count("cuMemcpyDtoHAsync")
        if not isinstance(dstHost, int):
            return (R.CUDA_ERROR_INVALID_VALUE,)
        return self._pinned_copy_async(dstHost, int(srcDevice), int(ByteCount), int(hStream), to_device=False)

    def _pinned_copy_async(self, dst: int, src: int, nbytes: int, stream: int, *, to_device: bool):
        """A copy between device memory and a pinned host buffer ordered on `stream`: checked now, run
        now or (under `async_work`) at the stream's turn, reading its source then, as a DMA from pinned
        memory does (a host write to the buffer before the copy runs is what the copy sees)."""
        current = self._current_device()
        if current is None:
            return (R.CUDA_ERROR_INVALID_CONTEXT,)
        if nbytes == 0:
            return (R.CUDA_SUCCESS,)
        device, host = (dst, src) if to_device else (src, dst)
        with self._lock:
            if (nbytes < 0 or not self._device_accessible(device, nbytes, to_device)
                    or not self._in_pinned(host, nbytes)):
                return (R.CUDA_ERROR_INVALID_VALUE,)

            def run() -> bool:
                if not (self._device_accessible(device, nbytes, to_device) and self._in_pinned(host, nbytes)):
                    return False
                self.host_memory.copy(dst, src, nbytes)
                return True
            return self._issue(current, stream, run)

    # ---------------------------------------------------------------- linear device memory (cuMemAlloc)
    def cuMemAlloc(self, bytesize):
        """Device memory outside the VMM calls, for kernels' tables: counted apart from `capacity` (in
        `kernel_state`), freed by cuMemFree or at close."""
        self._count("cuMemAlloc")
        size = int(bytesize)
        if self._current_device() is None:
            return (R.CUDA_ERROR_INVALID_CONTEXT, cu.CUdeviceptr(0))
        with self._lock:
            if size <= 0:
                return (R.CUDA_ERROR_INVALID_VALUE, cu.CUdeviceptr(0))
            ptr = self.host_memory.alloc_linear(size)
            if ptr is None:
                return (R.CUDA_ERROR_OUT_OF_MEMORY, cu.CUdeviceptr(0))
            self._linear[ptr] = size
            return (R.CUDA_SUCCESS, cu.CUdeviceptr(ptr))

    def cuMemFree(self, dptr):
        self._count("cuMemFree")
        ptr = int(dptr)
        with self._lock:
            size = self._linear.pop(ptr, None)
            if size is None:
                return (R.CUDA_ERROR_INVALID_VALUE,)
            self.host_memory.free_linear(ptr, size)
            return (R.CUDA_SUCCESS,)

    def _device_accessible(self, ptr: int, nbytes: int, write: bool) -> bool:
        """Whether [ptr, ptr+nbytes) is device memory a copy or kernel may touch: mapped with (write)
        access, or inside one cuMemAlloc buffer (lock held)."""
        if self._addresses.accessible(ptr, nbytes, write):
            return True
        return any(base <= ptr and ptr + nbytes <= base + size for base, size in self._linear.items())

    # ---------------------------------------------------------------- events
    def cuEventCreate(self, Flags):
        self._count("cuEventCreate")
        if self._current_device() is None:
            return (R.CUDA_ERROR_INVALID_CONTEXT, cu.CUevent(0))
        with self._lock:
            eid = next(self._next_id)
            self._events[eid] = [True, 0, None]  # a fresh event counts as complete (cuEventQuery: CUDA_SUCCESS)
            return (R.CUDA_SUCCESS, cu.CUevent(eid))

    def cuEventRecord(self, hEvent, hStream):
        """The event completes when the work queued on the stream before it has run (at once unless
        `async_work`)."""
        self._count("cuEventRecord")
        device = self._current_device()
        if device is None:
            return (R.CUDA_ERROR_INVALID_CONTEXT,)
        with self._lock:
            event = self._events.get(int(hEvent))
            if event is None:
                return (R.CUDA_ERROR_INVALID_HANDLE,)
            event[1] = int(hStream)
            capture = self._captures.get(int(hStream))
            if len(event) > 2:
                event[2] = capture
            else:
                event.append(capture)
            if capture is not None:  # a node of the capture: nothing runs until the graph is launched
                event[0] = False
                return (R.CUDA_SUCCESS,)
            if not self.async_work:
                event[0] = True
                return (R.CUDA_SUCCESS,)
            event[0] = False

            def run() -> bool:
                event[0] = True
                return True
            self._queued.append(_Queued(device, int(hStream), run))
            return (R.CUDA_SUCCESS,)

    def cuEventSynchronize(self, hEvent):
        self._count("cuEventSynchronize")
        device = self._current_device()
        if device is None:
            return (R.CUDA_ERROR_INVALID_CONTEXT,)
        with self._lock:
            event = self._events.get(int(hEvent))
            if event is None:
                return (R.CUDA_ERROR_INVALID_HANDLE,)
            captured = len(event) > 2 and event[2] is not None
        if captured or self._captures:
            return self._forbidden("cuEventSynchronize", "waited for an event during a capture",
                                   R.CUDA_ERROR_CAPTURED_EVENT if captured else None)
        with self._lock:
            if event[0]:
                return (R.CUDA_SUCCESS,)
            stream = event[1]
        # Everything queued on that stream runs (the event's predecessors among it).
        return self._run_queued(lambda q: q.device == device and q.stream == stream)

    def cuEventQuery(self, hEvent):
        self._count("cuEventQuery")
        with self._lock:
            event = self._events.get(int(hEvent))
            if event is None:
                return (R.CUDA_ERROR_INVALID_HANDLE,)
            captured = len(event) > 2 and event[2] is not None
            if not captured and not self._captures:
                return (R.CUDA_SUCCESS,) if event[0] else (R.CUDA_ERROR_NOT_READY,)
        # CUDA: a captured event cannot be queried; any query during a global-mode capture is unsafe.
        return self._forbidden("cuEventQuery", "queried an event during a capture",
                               R.CUDA_ERROR_CAPTURED_EVENT if captured else None)

    def cuEventDestroy(self, hEvent):
        self._count("cuEventDestroy")
        with self._lock:
            if self._events.pop(int(hEvent), None) is None:
                return (R.CUDA_ERROR_INVALID_HANDLE,)
            return (R.CUDA_SUCCESS,)

    # ---------------------------------------------------------------- modules and launches (host twins)
    def cuModuleLoadData(self, image):
        """Load a module whose image names registered host twins (`host_kernels.module_image`); any
        other image (a cubin, PTX) is CUDA_ERROR_INVALID_IMAGE: this device has no SMs to run it."""
        self._count("cuModuleLoadData")
        if self._current_device() is None:
            return (R.CUDA_ERROR_INVALID_CONTEXT, cu.CUmodule(0))
        if not image:  # NULL
            return (R.CUDA_ERROR_INVALID_VALUE, cu.CUmodule(0))
        # An address (int) names an image in memory this device cannot read as one: not a host-twin image.
        kernels = None if isinstance(image, int) else host_kernels.load(image)
        if kernels is None:
            return (R.CUDA_ERROR_INVALID_IMAGE, cu.CUmodule(0))
        with self._lock:
            mid = next(self._next_id)
            self._modules[mid] = kernels
            return (R.CUDA_SUCCESS, cu.CUmodule(mid))

    def cuModuleUnload(self, hmod):
        self._count("cuModuleUnload")
        with self._lock:
            mid = int(hmod)
            if self._modules.pop(mid, None) is None:
                return (R.CUDA_ERROR_INVALID_HANDLE,)
            for fid in [f for f, (m, _) in self._functions.items() if m == mid]:
                del self._functions[fid]
            return (R.CUDA_SUCCESS,)

    def cuModuleGetFunction(self, hmod, name):
        self._count("cuModuleGetFunction")
        with self._lock:
            kernels = self._modules.get(int(hmod))
            if kernels is None:
                return (R.CUDA_ERROR_INVALID_HANDLE, cu.CUfunction(0))
            kernel = kernels.get(name.decode(errors="replace"))
            if kernel is None:
                return (R.CUDA_ERROR_NOT_FOUND, cu.CUfunction(0))
            fid = next(self._next_id)
            self._functions[fid] = (int(hmod), kernel)
            return (R.CUDA_SUCCESS, cu.CUfunction(fid))

    def cuFuncGetAttribute(self, attrib, hfunc):
        self._count("cuFuncGetAttribute")
        with self._lock:
            entry = self._functions.get(int(hfunc))
        if entry is None:
            return (R.CUDA_ERROR_INVALID_HANDLE, 0)
        a = cu.CUfunction_attribute
        if attrib == a.CU_FUNC_ATTRIBUTE_NUM_REGS:
            return (R.CUDA_SUCCESS, entry[1].registers)
        if attrib == a.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK:
            return (R.CUDA_SUCCESS, host_kernels.MAX_BLOCK)
        return (R.CUDA_ERROR_INVALID_VALUE, 0)

    def cuOccupancyMaxActiveBlocksPerMultiprocessor(self, func, blockSize, dynamicSMemSize):
        self._count("cuOccupancyMaxActiveBlocksPerMultiprocessor")
        with self._lock:
            entry = self._functions.get(int(func))
        if entry is None:
            return (R.CUDA_ERROR_INVALID_HANDLE, 0)
        if int(dynamicSMemSize) < 0:
            return (R.CUDA_ERROR_INVALID_VALUE, 0)
        return (R.CUDA_SUCCESS, host_kernels.occupancy(entry[1].registers, int(blockSize)))

    def cuLaunchKernel(self, f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes,
                       hStream, kernelParams, extra):
        """Run a host twin with the launch's parameters, now or (under `async_work`) at its stream's
        turn. `kernelParams` must be the address of an array of pointers to the 8-byte parameters (the
        form defrag passes), and `extra` 0 (NULL: the binding takes an integer there, never None);
        their values are read now, as the driver copies them at the launch. The binding's other forms
        (a buffer, a tuple of values and types, an `extra` array) are CUDA_ERROR_INVALID_VALUE here."""
        self._count("cuLaunchKernel")
        device = self._current_device()
        if device is None:
            return (R.CUDA_ERROR_INVALID_CONTEXT,)
        with self._lock:
            entry = self._functions.get(int(f))
        if entry is None:
            return (R.CUDA_ERROR_INVALID_HANDLE,)
        kernel = entry[1]
        grid = (int(gridDimX), int(gridDimY), int(gridDimZ))
        block = (int(blockDimX), int(blockDimY), int(blockDimZ))
        if (min(grid + block) < 1 or block[0] * block[1] * block[2] > host_kernels.MAX_BLOCK
                or int(sharedMemBytes) < 0 or extra != 0
                or not isinstance(kernelParams, int) or not kernelParams):
            return (R.CUDA_ERROR_INVALID_VALUE,)
        pointers = (ctypes.c_void_p * kernel.params).from_address(kernelParams)
        params = tuple(ctypes.c_uint64.from_address(p).value for p in pointers)
        memory = host_kernels.KernelMemory(self._device_accessible, self.host_memory.copy, self.host_memory.view)

        def run() -> bool:
            if not self.host_memory.runs_kernels:
                return True
            with self._lock:
                return bool(kernel.run(memory, params))
        with self._lock:
            return self._issue(device, int(hStream), run)

    # ---------------------------------------------------------------- stale accesses
    def stale_probe_fd(self) -> int:
        """The file whose allocated blocks are the stale accesses `touched_unmapped` reports, made now if
        needed (a fast path reads it with fstat). Valid while any reservation of this device lives."""
        return self.host_memory.stale_probe_fd()

    def touched_unmapped(self) -> int:
        """Bytes of unmapped device memory read or written since the last call, then reset: 0 unless
        something accessed an address whose page was unmapped (an illegal address on a GPU).
        `HostMemory.unmap` says how the emulated device notices."""
        return self.host_memory.touched_unmapped()

    # ---------------------------------------------------------------- inspection
    def is_accessible(self, ptr: int, size: int, write: bool = True) -> bool:
        """Whether [ptr, ptr+size) is mapped with (write) access: a test aid."""
        with self._lock:
            return self._addresses.accessible(int(ptr), int(size), write)

    def host_state(self) -> dict:
        """Counts of host-located pages and pinned host buffers still held: the host side's leak check."""
        with self._lock:
            return {"host_pages": sum(1 for p in self._handles.values() if p.host),
                    "pinned_buffers": len(self._pinned), "host_used_bytes": self.host_used}

    def state(self) -> dict:
        """Counts of live handles, mappings and reservations: a leak check."""
        with self._lock:
            return {"handles": len(self._handles), "mappings": len(self._addresses),
                    "reservations": len(self._addresses.reservations), "used_bytes": self.used}

    def kernel_state(self) -> dict:
        """Counts of what kernels use and a close releases (cuMemAlloc buffers and their bytes, loaded
        modules, events): the leak check of kernel launches."""
        with self._lock:
            return {"linear_buffers": len(self._linear), "linear_bytes": sum(self._linear.values()),
                    "modules": len(self._modules), "events": len(self._events)}

    def close(self) -> None:
        """Tear down everything still held (a process exit for this device), from any thread."""
        with self._lock:
            self._closing = True  # a process exit needs no current context
            self._queued.clear()
            for ptr in list(self._linear):
                self.cuMemFree(ptr)
            self._modules.clear()
            self._functions.clear()
            self._events.clear()
            mappings, _ = self._addresses.in_address_order()
            for m in mappings:
                self.cuMemUnmap(m.va, m.size)
            for handle in list(self._handles):
                self._handles[handle].released = True
                self._drop_physical(handle)
            self._released_mapped = 0
            _, reservations = self._addresses.in_address_order()
            for res in reservations:
                self.cuMemAddressFree(res.base, res.size)
            for ptr in list(self._pinned):
                self.cuMemFreeHost(ptr)


def _take_arguments_as_the_binding_does(cls) -> None:
    """Wrap each driver entry point `cls` itself defines so that its arguments pass `signatures.conform`
    first: a call the real cuda-bindings function refuses (a TypeError, an OverflowError) is refused here
    the same way, before any rule or effect of the call, and the body gets them as ints where the binding
    converts them to C integers or handles."""
    for name in SIGNATURES:
        method = cls.__dict__.get(name)
        if method is None or getattr(method, "__conforming__", False):
            continue

        def entry(self, *args, _name=name, _method=method, **kwargs):
            return _method(self, *conform(_name, args, kwargs))
        functools.update_wrapper(entry, method)
        entry.__conforming__ = True
        setattr(cls, name, entry)


_take_arguments_as_the_binding_does(EmulatedCuda)

_devices: "weakref.WeakSet[EmulatedCuda]" = weakref.WeakSet()  # every emulated device of this process


def _privatize_after_fork() -> None:
    """`os.register_at_fork` hook: each emulated device's mappings copy-on-write in the child. Never raises
    (a failure is logged: the child then shares those pages with its parent, as before)."""
    for device in list(_devices):
        try:
            device._privatize_in_child()
        except Exception:  # noqa: BLE001 - an at-fork hook must not raise
            logging.getLogger("defrag").exception("defrag: could not make the emulated device's pages private "
                                                  "in a forked child; its writes may reach the parent's")


os.register_at_fork(after_in_child=_privatize_after_fork)
