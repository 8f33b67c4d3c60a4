"""The one adapter between defrag and a CUDA driver API.

`Driver` builds every call with cuda-python's own types and sends it to an API
object: the real `cuda.bindings.driver` module on a GPU, an `EmulatedCuda` on a
machine without one, or a `MemorylessCuda` (the emulated rules without bytes,
for dry replays). All three return `(CUresult, *outputs)` tuples, and every
result goes through `_check`, which raises `defrag.CudaError` (or its subclass
`CudaOutOfMemoryError`) naming the call and the CUDA error. Nothing above this
module touches the driver API directly.

The adapter does not pool, cache or retry anything: one method, one driver
call (SetAccess is one call per contiguous range, however many pages it spans).
"""

from __future__ import annotations

from cuda.bindings import driver as cu

from ..errors import CudaError, CudaOutOfMemoryError, NotSupportedError
from .emulated import DEFAULT_CAPACITY, DEFAULT_GRANULARITY, EmulatedCuda
from .faults import FaultInjector
from .memoryless import MemorylessCuda

R = cu.CUresult
KINDS = ("cuda", "emulated", "memoryless")
HOST_NUMA_MIN_DRIVER = 12020  # cuMemCreate with CU_MEM_LOCATION_TYPE_HOST_NUMA: CUDA 12.2 drivers and later
# Names that older cuda-bindings lack (the host NUMA VMM attribute came with 12.9; the location type and
# the NUMA id with 12.2): looked up, not assumed, so an older binding answers "unknown", not AttributeError.
HOST_NUMA_VMM_ATTRIBUTE = getattr(cu.CUdevice_attribute,
                                  "CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED", None)
HOST_NUMA_ID_ATTRIBUTE = getattr(cu.CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID", None)
HOST_NUMA_LOCATION = getattr(cu.CUmemLocationType, "CU_MEM_LOCATION_TYPE_HOST_NUMA", None)
_REFUSALS = (int(R.CUDA_ERROR_INVALID_VALUE), int(R.CUDA_ERROR_NOT_SUPPORTED))  # "no", as the driver states it


def _check(call: str, result):
    """Unpack a `(CUresult, *outputs)` tuple: return the outputs, raise on failure."""
    err = result[0]
    if err != R.CUDA_SUCCESS:
        code = int(err)
        try:
            name = R(code).name
        except ValueError:
            name = f"CUDA_ERROR_{code}"
        cls = CudaOutOfMemoryError if code == int(R.CUDA_ERROR_OUT_OF_MEMORY) else CudaError
        raise cls(call, name, code)
    if len(result) == 1:
        return None
    if len(result) == 2:
        return result[1]
    return result[1:]


def _raise_mapped(call: str, result, mapped: int):
    """`_check`'s error for a failed call of a batch, carrying `mapped`: how many of the batch's calls
    succeeded before it."""
    try:
        _check(call, result)
    except CudaError as exc:
        exc.mapped = mapped
        raise


def cuda_driver_usable() -> tuple[bool, str]:
    """Probe whether a real CUDA driver with at least one GPU can be used.

    Returns (usable, reason). Only a missing/failed driver counts as "no": the
    probe catches the RuntimeError cuda-python raises when libcuda is absent and
    error results from cuInit/cuDeviceGetCount, nothing broader.
    """
    try:
        err, = cu.cuInit(0)
    except RuntimeError as exc:  # cuda-python raises a RuntimeError subclass when libcuda is missing
        return False, f"no CUDA driver library ({exc.__class__.__name__}: {exc})".strip()
    if err != R.CUDA_SUCCESS:
        return False, f"cuInit failed: {R(int(err)).name}"
    err, count = cu.cuDeviceGetCount()
    if err != R.CUDA_SUCCESS:
        return False, f"cuDeviceGetCount failed: {R(int(err)).name}"
    if count < 1:
        return False, "the CUDA driver reports no devices"
    return True, f"{count} CUDA device(s)"


class Driver:
    """One device seen through one driver API (real CUDA, emulated or memory-less).

    `kind` says which: "cuda", "emulated" (host memory behind every address) or
    "memoryless" (the emulated rules and accounting, no bytes: nothing may be
    read or written through its addresses).

    Guarantees: every method makes exactly the driver calls its name says, with
    cuda-python's argument types, and raises `CudaError` on any failure without
    retrying. It does not track what it created: ownership and rollback belong
    to `defrag.vmm`.
    """

    def __init__(self, api, ordinal: int = 0, *, kind: str):
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(map(repr, KINDS))}, got {kind!r}")
        self.kind = kind
        self.ordinal = int(ordinal)
        self.faults = FaultInjector(api)
        self._api = self.faults  # every call passes the fault plan first
        self._closed = False
        _check("cuInit", self._api.cuInit(0))
        count = _check("cuDeviceGetCount", self._api.cuDeviceGetCount())
        if not 0 <= self.ordinal < count:
            raise ValueError(f"device ordinal {self.ordinal} out of range: {count} device(s) present")
        self.device = _check("cuDeviceGet", self._api.cuDeviceGet(self.ordinal))
        # The primary context is the one PyTorch uses, so pointers we map are
        # valid in torch's kernels and ours alike.
        self.context = _check("cuDevicePrimaryCtxRetain", self._api.cuDevicePrimaryCtxRetain(self.device))
        self._context_id = int(self.context)
        self.make_current()
        self._prop = self._allocation_prop()
        self.granularity = int(_check(
            "cuMemGetAllocationGranularity",
            self._api.cuMemGetAllocationGranularity(
                self._prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)))
        self._access_rw = self._access_desc(cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        raw_name = _check("cuDeviceGetName", self._api.cuDeviceGetName(256, self.device))
        self.name = bytes(raw_name).split(b"\0", 1)[0].decode(errors="replace")
        self.total_memory = int(_check("cuDeviceTotalMem", self._api.cuDeviceTotalMem(self.device)))
        self._host_support: tuple[bool, str] | None = None  # host_pages_supported(), once known
        self._host_prop = None
        self._trial_handle = 0  # the probe's trial page, if releasing it failed (released at the next probe)

    @property
    def on_libcuda(self) -> bool:
        """Whether this driver's calls go to the real CUDA driver library (not an emulation of one, even
        one rehearsing the "cuda" kind): what native code may then call itself (stream events)."""
        return self.api is cu

    @property
    def context_handle(self) -> int:
        """The device's primary context (CUcontext) as an integer, for native code that must make it current."""
        return self._context_id

    # ------------------------------------------------------------ constructors
    @classmethod
    def cuda(cls, ordinal: int = 0) -> "Driver":
        """The real driver (`cuda.bindings.driver`) for GPU `ordinal`."""
        return cls(cu, ordinal, kind="cuda")

    @classmethod
    def emulated(cls, *, capacity: int = DEFAULT_CAPACITY, granularity: int = DEFAULT_GRANULARITY,
                 api: EmulatedCuda | None = None) -> "Driver":
        """A fresh emulated device on host memory (never loads libcuda)."""
        return cls(api or EmulatedCuda(capacity=capacity, granularity=granularity), 0, kind="emulated")

    @classmethod
    def memoryless(cls, *, capacity: int = DEFAULT_CAPACITY, granularity: int = DEFAULT_GRANULARITY,
                   api: MemorylessCuda | None = None) -> "Driver":
        """A fresh memory-less device: handles, reservations and mappings without bytes.

        The emulated device's rules, errors and capacity accounting, but nothing
        behind the addresses, so `capacity` may far exceed host RAM (dry replays).
        """
        return cls(api or MemorylessCuda(capacity=capacity, granularity=granularity), 0, kind="memoryless")

    @property
    def api(self):
        """The underlying driver API object (module, EmulatedCuda or MemorylessCuda), without fault injection."""
        return self.faults._api

    # ------------------------------------------------------------ structs
    def _location(self):
        loc = cu.CUmemLocation()
        loc.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        loc.id = self.ordinal
        return loc

    def _allocation_prop(self):
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location = self._location()
        return prop

    def _access_desc(self, flags):
        desc = cu.CUmemAccessDesc()
        desc.location = self._location()
        desc.flags = flags
        return desc

    # ------------------------------------------------------------ context
    def make_current(self) -> None:
        """Make this device's primary context current on the calling thread, unless it already is.

        Asks the driver every time (cuCtxGetCurrent): the current context is
        per thread and anyone may change it between two calls of ours
        (`torch.cuda.set_device`, another library, another device's pool), so
        a cached "done" would send a synchronize or an unmap to the wrong
        device. Every method below that needs a context calls this first.
        """
        current = _check("cuCtxGetCurrent", self._api.cuCtxGetCurrent())
        if current is not self.context and int(current) != self._context_id:  # `is`: the emulator's shortcut
            _check("cuCtxSetCurrent", self._api.cuCtxSetCurrent(self.context))

    def synchronize(self) -> None:
        """Wait until the device has finished all queued work (cuCtxSynchronize)."""
        self.make_current()
        _check("cuCtxSynchronize", self._api.cuCtxSynchronize())

    def touched_unmapped(self) -> int:
        """Bytes of unmapped memory accessed since the last call: the emulated device records
        stale accesses (see `EmulatedCuda.touched_unmapped`); a real GPU reports them itself,
        as an illegal-address error, so this is 0 there."""
        probe = getattr(self.api, "touched_unmapped", None)
        return probe() if probe is not None else 0

    def stale_probe_fd(self) -> int:
        """A file whose allocated blocks mean `touched_unmapped()` has something to report (fstat's
        st_blocks), for a fast path that must not call Python; -1 where there is none (a real GPU)."""
        probe = getattr(self.api, "stale_probe_fd", None)
        return probe() if probe is not None else -1

    def is_capturing(self, stream: int = 0) -> bool:
        """Whether `stream` is capturing a CUDA graph (mapping or moving then is unsafe)."""
        self.make_current()
        status = _check("cuStreamIsCapturing", self._api.cuStreamIsCapturing(cu.CUstream(int(stream))))
        return status != cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE

    def mem_info(self) -> tuple[int, int]:
        """(free, total) device memory in bytes, as cuMemGetInfo reports it."""
        self.make_current()
        free, total = _check("cuMemGetInfo", self._api.cuMemGetInfo())
        return int(free), int(total)

    # ------------------------------------------------------------ physical memory
    def create(self, size: int, *, host: bool = False) -> int:
        """Create one physical allocation of `size` bytes; returns its handle.

        `host=True`: a host-located page (host NUMA memory the device maps and
        reads over the bus); only where `host_pages_supported()` says so, else
        RuntimeError naming why.
        """
        prop = self._prop
        if host:
            supported, reason = self.host_pages_supported()
            if not supported:
                raise NotSupportedError(f"host-located pages are not supported here: {reason}")
            prop = self._host_prop
        self.make_current()
        handle = _check("cuMemCreate", self._api.cuMemCreate(int(size), prop, 0))
        return int(handle)

    def release(self, handle: int) -> None:
        """Release a physical handle (its memory is freed at its last unmap)."""
        self.make_current()
        _check("cuMemRelease", self._api.cuMemRelease(int(handle)))

    # ------------------------------------------------------------ host memory (sleep, offload)
    def host_pages_supported(self) -> tuple[bool, str]:
        """Whether `create(..., host=True)` works here: (supported, reason); cached once the driver has said.

        Host-located VMM pages (`cuMemCreate` with a `CU_MEM_LOCATION_TYPE_HOST_NUMA`
        location) need a CUDA 12.2 driver or later. The device's own answer
        (`CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`) is
        taken when it gives one; a binding that lacks the attribute, or a driver
        that refuses the query (older 12.x drivers do), says nothing either way.
        The location's id is `CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID` where known,
        else node 0 (a machine without NUMA has just that one). Then one granule
        is created and released as a trial, and that trial decides: any driver
        error there is a "no" with its reason, never an exception. A "no" the
        driver states (CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_SUPPORTED) is
        cached; any other (out of memory, a transient fault) is asked again at
        the next call. Errors outside the probe's own questions (the context,
        releasing the trial page) propagate.
        """
        if self._host_support is not None:
            return self._host_support
        self.make_current()
        if self._trial_handle:
            _check("cuMemRelease", self._api.cuMemRelease(self._trial_handle))
            self._trial_handle = 0
        if HOST_NUMA_LOCATION is None:
            self._host_support = (False, "this cuda-bindings has no CU_MEM_LOCATION_TYPE_HOST_NUMA "
                                         "(install cuda-bindings 12.2 or later)")
            return self._host_support
        if self.kind == "cuda":
            version = int(_check("cuDriverGetVersion", self._api.cuDriverGetVersion()))
            if version < HOST_NUMA_MIN_DRIVER:
                self._host_support = (False, f"the CUDA driver is {version // 1000}.{version % 1000 // 10}; "
                                             f"host-located VMM pages need 12.2 or later")
                return self._host_support
        if self._device_attribute(HOST_NUMA_VMM_ATTRIBUTE) == 0:
            self._host_support = (False, "the device reports no host NUMA virtual memory management support "
                                         "(CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0)")
            return self._host_support
        numa = self._device_attribute(HOST_NUMA_ID_ATTRIBUTE)
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        loc = cu.CUmemLocation()
        loc.type = HOST_NUMA_LOCATION
        loc.id = max(int(numa), 0) if numa is not None else 0  # -1: not a NUMA machine; its one node is 0
        prop.location = loc
        try:
            granularity = int(_check("cuMemGetAllocationGranularity", self._api.cuMemGetAllocationGranularity(
                prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)))
            handle = _check("cuMemCreate", self._api.cuMemCreate(granularity, prop, 0))
        except CudaError as exc:
            answer = (False, f"the driver refused a host-located page ({exc.call}: {exc.name})")
            if exc.code in _REFUSALS:
                self._host_support = answer
            return answer
        self._trial_handle = int(handle)
        _check("cuMemRelease", self._api.cuMemRelease(handle))
        self._trial_handle = 0
        self._host_prop = prop
        self.host_granularity = granularity
        self._host_support = (True, f"host NUMA node {loc.id}, granularity {granularity} bytes")
        return self._host_support

    def _device_attribute(self, attribute) -> int | None:
        """The device's value of `attribute`; None where the binding lacks it (None) or the driver
        refuses the query (an attribute older drivers do not know)."""
        if attribute is None:
            return None
        try:
            return int(_check("cuDeviceGetAttribute", self._api.cuDeviceGetAttribute(attribute, self.device)))
        except CudaError as exc:
            if exc.code in _REFUSALS:
                return None
            raise

    def alloc_host(self, nbytes: int) -> int:
        """Page-locked host memory of `nbytes` (cuMemAllocHost); returns its address."""
        self.make_current()
        return int(_check("cuMemAllocHost", self._api.cuMemAllocHost(int(nbytes))))

    def free_host(self, ptr: int) -> None:
        """Free memory from `alloc_host` (cuMemFreeHost)."""
        self.make_current()
        _check("cuMemFreeHost", self._api.cuMemFreeHost(int(ptr)))

    def copy_to_host(self, dst: int, src: int, nbytes: int) -> None:
        """Copy `nbytes` of device memory at `src` to host memory at `dst` (cuMemcpyDtoH: synchronous)."""
        self.make_current()
        _check("cuMemcpyDtoH", self._api.cuMemcpyDtoH(int(dst), int(src), int(nbytes)))

    def copy_from_host(self, dst: int, src: int, nbytes: int) -> None:
        """Copy `nbytes` of host memory at `src` to device memory at `dst` (cuMemcpyHtoD: synchronous)."""
        self.make_current()
        _check("cuMemcpyHtoD", self._api.cuMemcpyHtoD(int(dst), int(src), int(nbytes)))

    # ------------------------------------------------------------ virtual memory
    def reserve(self, size: int, alignment: int = 0) -> int:
        """Reserve `size` bytes of virtual address space; returns the base address."""
        self.make_current()
        va = _check("cuMemAddressReserve", self._api.cuMemAddressReserve(int(size), int(alignment), 0, 0))
        return int(va)

    def free_address(self, va: int, size: int) -> None:
        """Return a whole reservation (nothing may be mapped inside it)."""
        self.make_current()
        _check("cuMemAddressFree", self._api.cuMemAddressFree(int(va), int(size)))

    def map(self, va: int, size: int, handle: int, offset: int = 0) -> None:
        """Map `size` bytes of `handle` at `va`; no access yet. `offset` is passed through for the
        driver to judge: cuMemMap's offset "currently must be zero" (a part of an allocation is
        mapped by giving it a handle of its own), and every caller in defrag passes 0."""
        self.make_current()
        _check("cuMemMap", self._api.cuMemMap(int(va), int(size), int(offset), int(handle), 0))

    def map_each(self, vas: list[int], size: int, handles: list[int]) -> None:
        """`map(vas[i], size, handles[i])` for each i, in order: one cuMemMap each, as the driver
        counts them. On the first failure the CudaError (or whatever else interrupts the batch)
        carries `mapped`, how many were mapped before it (those stay mapped: the caller undoes them).
        An emulated device takes the batch under one hold of its lock (`EmulatedCuda.map_each`;
        see `_batch`); the real driver, or a proxy over any device, gets one call each without
        re-checking the context between them."""
        n = len(vas)
        if not n:
            return
        self.make_current()
        size = int(size)

        def one(i: int):
            return self._api.cuMemMap(int(vas[i]), size, 0, int(handles[i]), 0)

        def batch(start: int, count: int):
            return self.api.map_each(vas[start:start + count], size, handles[start:start + count])

        self._batch("cuMemMap", n, one, batch)

    def create_each(self, size: int, n: int) -> list[int]:
        """`create(size)` `n` times: one cuMemCreate each, as the driver counts them; returns the handles.
        On the first failure the CudaError carries `created`, the handles made before it (the caller
        owns them) and `mapped`, their count. An emulated device takes the batch under one hold of its
        lock (`EmulatedCuda.create_each`; see `_batch`); the real driver gets one call each, without
        re-checking the context between them (one cuCtxGetCurrent a batch)."""
        if n <= 0:
            return []
        self.make_current()
        size, prop, out = int(size), self._prop, []

        def one(i: int):
            result = self._api.cuMemCreate(size, prop, 0)
            if result[0] == R.CUDA_SUCCESS:
                out.append(int(result[1]))
            return result

        def batch(start: int, count: int):
            try:
                error, made = self.api.create_each(size, prop, count)
            except BaseException as exc:
                out.extend(getattr(exc, "created", ()))
                raise
            out.extend(made)
            return error, len(made)

        try:
            self._batch("cuMemCreate", n, one, batch)
        except BaseException as exc:
            exc.created = out
            raise
        return out

    def _batch(self, name: str, n: int, one, batch) -> None:
        """`n` calls of `name`, in order, stopping at the first that fails (its CudaError, or whatever else
        interrupts them, carries `mapped`: how many succeeded before it).

        `one(i)` makes call i alone through the API (and the fault plan); the real driver, or a
        proxy over any device, gets each call that way. On an emulated device, the fault plan first
        says how many of the next calls pass and `batch(start, count)` makes those under one hold of
        the device's lock, returning (the failing call's CUresult or CUDA_SUCCESS, how many
        succeeded); the plan's lock is held until they are counted, so another thread's call cannot
        come between. The call a planned fault stops is then made alone, through the plan. To everyone
        who can look (the device's and the plan's counts, when a fault fires, what is left) this is
        the calls one by one.
        """
        ok = R.CUDA_SUCCESS
        if not isinstance(self.api, EmulatedCuda):  # the real driver, or any proxy over a device: one call each
            for i in range(n):
                try:
                    result = one(i)
                except BaseException as exc:
                    exc.mapped = i
                    raise
                if result[0] != ok:
                    _raise_mapped(name, result, i)
            return
        start = 0
        while start < n:
            with self.faults.held():
                passing = self.faults.passing(name, n - start)
                made = 0
                try:
                    error, done = batch(start, passing)
                    made = done + (error != ok)
                except BaseException as exc:
                    made = getattr(exc, "mapped", 0) + 1
                    exc.mapped = start + getattr(exc, "mapped", 0)
                    raise
                finally:
                    self.faults.count(name, made)
            if error != ok:
                _raise_mapped(name, (error,), start + done)
            start += passing
            if start < n:  # the call a planned fault stops: made alone, through the plan
                result = one(start)
                if result[0] != ok:
                    _raise_mapped(name, result, start)
                start += 1

    def unmap(self, va: int, size: int) -> None:
        """Unmap whole mappings covering exactly [va, va+size). Does not synchronize."""
        self.make_current()
        _check("cuMemUnmap", self._api.cuMemUnmap(int(va), int(size)))

    def unmap_each(self, ranges: list[tuple[int, int]]) -> None:
        """`unmap(va, size)` for each (va, size), in order: one cuMemUnmap each, as the driver counts them.
        On the first failure the CudaError (or whatever else interrupts the batch) carries `mapped`, how
        many ranges were unmapped before it (those stay unmapped). An emulated device takes the batch
        under one hold of its lock (`EmulatedCuda.unmap_each`; see `_batch`); the real driver, or a
        proxy over any device, gets one call each, without re-checking the context between them (one
        cuCtxGetCurrent a batch). Does not synchronize."""
        n = len(ranges)
        if not n:
            return
        self.make_current()

        def one(i: int):
            return self._api.cuMemUnmap(int(ranges[i][0]), int(ranges[i][1]))

        def batch(start: int, count: int):
            return self.api.unmap_each(ranges[start:start + count])

        self._batch("cuMemUnmap", n, one, batch)

    def set_access(self, va: int, size: int) -> None:
        """Grant this device read/write access to [va, va+size): one call for the whole range."""
        self.make_current()
        _check("cuMemSetAccess", self._api.cuMemSetAccess(int(va), int(size), [self._access_rw], 1))

    # ------------------------------------------------------------ data
    def copy(self, dst: int, src: int, nbytes: int, stream: int = 0) -> None:
        """Device-to-device copy of `nbytes`, ordered on `stream` (0: the legacy default stream)."""
        self.make_current()
        _check("cuMemcpyDtoDAsync",
               self._api.cuMemcpyDtoDAsync(int(dst), int(src), int(nbytes), cu.CUstream(int(stream))))

    def memset(self, ptr: int, value: int, nbytes: int, stream: int = 0) -> None:
        """Set `nbytes` bytes at `ptr` to `value` (a byte), ordered on `stream`."""
        self.make_current()
        _check("cuMemsetD8Async",
               self._api.cuMemsetD8Async(int(ptr), int(value) & 0xFF, int(nbytes), cu.CUstream(int(stream))))

    def copy_from_host_async(self, dst: int, src: int, nbytes: int, stream: int = 0) -> None:
        """Copy `nbytes` from page-locked host memory at `src` (`alloc_host`) to device memory at `dst`,
        ordered on `stream` (cuMemcpyHtoDAsync). The source is read when the copy runs: keep it
        unchanged until then (an event recorded after it says when)."""
        self.make_current()
        _check("cuMemcpyHtoDAsync",
               self._api.cuMemcpyHtoDAsync(int(dst), int(src), int(nbytes), cu.CUstream(int(stream))))

    def copy_to_host_async(self, dst: int, src: int, nbytes: int, stream: int = 0) -> None:
        """Copy `nbytes` of device memory at `src` to page-locked host memory at `dst` (`alloc_host`),
        ordered on `stream` (cuMemcpyDtoHAsync); the bytes are there once the stream has run it."""
        self.make_current()
        _check("cuMemcpyDtoHAsync",
               self._api.cuMemcpyDtoHAsync(int(dst), int(src), int(nbytes), cu.CUstream(int(stream))))

    def synchronize_stream(self, stream: int = 0) -> None:
        """Wait until `stream` has finished its queued work (cuStreamSynchronize)."""
        self.make_current()
        _check("cuStreamSynchronize", self._api.cuStreamSynchronize(cu.CUstream(int(stream))))

    # ------------------------------------------------------------ device memory for kernels' tables
    def alloc(self, nbytes: int) -> int:
        """`nbytes` of device memory outside the pool's VMM pages (cuMemAlloc); returns its address."""
        self.make_current()
        return int(_check("cuMemAlloc", self._api.cuMemAlloc(int(nbytes))))

    def free(self, ptr: int) -> None:
        """Free memory from `alloc` (cuMemFree). Work that may still use it must be finished first."""
        self.make_current()
        _check("cuMemFree", self._api.cuMemFree(int(ptr)))

    # ------------------------------------------------------------ events
    def create_event(self):
        """A new event without timing (cuEventCreate, CU_EVENT_DISABLE_TIMING); an opaque handle."""
        self.make_current()
        return _check("cuEventCreate", self._api.cuEventCreate(int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)))

    def record_event(self, event, stream: int = 0) -> None:
        """Mark the point of `stream`'s queue the event completes at (cuEventRecord)."""
        self.make_current()
        _check("cuEventRecord", self._api.cuEventRecord(event, cu.CUstream(int(stream))))

    def wait_event(self, event) -> None:
        """Wait until the event has completed (cuEventSynchronize)."""
        self.make_current()
        _check("cuEventSynchronize", self._api.cuEventSynchronize(event))

    def destroy_event(self, event) -> None:
        self.make_current()
        _check("cuEventDestroy", self._api.cuEventDestroy(event))

    # ------------------------------------------------------------ modules and kernel launches
    def attribute(self, attribute) -> int:
        """The device's value of a `CUdevice_attribute` (cuDeviceGetAttribute)."""
        return int(_check("cuDeviceGetAttribute", self._api.cuDeviceGetAttribute(attribute, self.device)))

    def driver_version(self) -> int:
        """The CUDA driver's version as cuDriverGetVersion reports it (12080 for 12.8; 0 on the emulated
        device, which is no CUDA driver)."""
        return int(_check("cuDriverGetVersion", self._api.cuDriverGetVersion()))

    def multiprocessors(self) -> int:
        """How many SMs the device has."""
        return self.attribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)

    def compute_capability(self) -> tuple[int, int]:
        """The device's (major, minor) compute capability."""
        a = cu.CUdevice_attribute
        return (self.attribute(a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                self.attribute(a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR))

    def load_module(self, image: bytes):
        """Load a module image (a cubin; on the emulated device, host twins) into this device's primary
        context (cuModuleLoadData); an opaque module handle."""
        self.make_current()
        return _check("cuModuleLoadData", self._api.cuModuleLoadData(image))

    def unload_module(self, module) -> None:
        self.make_current()
        _check("cuModuleUnload", self._api.cuModuleUnload(module))

    def get_function(self, module, name: str):
        """The kernel `name` (its entry symbol) of a loaded module (cuModuleGetFunction); an opaque handle."""
        self.make_current()
        return _check("cuModuleGetFunction", self._api.cuModuleGetFunction(module, name.encode()))

    def function_registers(self, function) -> int:
        """Registers per thread the kernel's code uses (CU_FUNC_ATTRIBUTE_NUM_REGS)."""
        self.make_current()
        return int(_check("cuFuncGetAttribute", self._api.cuFuncGetAttribute(
            cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS, function)))

    def occupancy(self, function, block: int, dynamic_shared: int = 0) -> int:
        """How many blocks of `block` threads of the kernel fit one SM at once
        (cuOccupancyMaxActiveBlocksPerMultiprocessor)."""
        self.make_current()
        return int(_check("cuOccupancyMaxActiveBlocksPerMultiprocessor",
                          self._api.cuOccupancyMaxActiveBlocksPerMultiprocessor(function, int(block),
                                                                                int(dynamic_shared))))

    def launch(self, function, grid: int, block: int, params: int, stream: int = 0) -> None:
        """Launch a 1-D grid of the kernel on `stream` (cuLaunchKernel). `params` is the address of an
        array of pointers to the kernel's parameters, read by the driver during this call."""
        self.make_current()
        # `extra` is a void_ptr in cuda-bindings: 0 (NULL), never None (TypeError "an integer is required").
        _check("cuLaunchKernel", self._api.cuLaunchKernel(function, int(grid), 1, 1, int(block), 1, 1, 0,
                                                          cu.CUstream(int(stream)), int(params), 0))

    # ------------------------------------------------------------ teardown
    def close(self) -> None:
        """Release the primary context reference taken at construction (idempotent)."""
        if self._closed:
            return
        self._closed = True
        _check("cuDevicePrimaryCtxRelease", self._api.cuDevicePrimaryCtxRelease(self.device))

    def __repr__(self) -> str:
        return f"Driver(kind={self.kind!r}, ordinal={self.ordinal}, name={self.name!r}, granularity={self.granularity})"
