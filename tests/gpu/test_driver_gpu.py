"""The driver-level checks of tests/cpu/test_driver.py, on a real GPU through `Driver.cuda(0)`.

Bytes move through the driver (memset, DtoD copy) and are checked on the host
with cuMemcpyHtoD / cuMemcpyDtoH. In a rehearsal (DEFRAG_GPU_REHEARSAL=1, no
GPU) the same checks run on an emulated device with the GPU's 2 MiB pages,
host copies through ctypes after checking the range is mapped with access;
without either, tests/gpu/conftest.py skips every test here with the reason.
Nothing at import time touches the driver, so collection never fails.

Deliberately not done on a GPU: copies into unmapped or no-access memory (an
illegal address there is a sticky error that poisons the context for every later
test) and double releases (undefined in the driver documentation).

Where the CUDA documentation does not pin the error code of a misuse, the test
accepts the codes the driver documents for that call; the emulation answers
CUDA_ERROR_INVALID_VALUE in all of these cases.
"""
from __future__ import annotations

import ctypes
import os
import threading

import pytest
from cuda.bindings import driver as cu

from defrag.driver import Driver
from defrag.errors import CudaError, CudaOutOfMemoryError

from .conftest import MODE

R = cu.CUresult
INVALID = {"CUDA_ERROR_INVALID_VALUE"}
# Misuse whose exact code the documentation leaves open (emulation: INVALID_VALUE).
# A non-zero cuMemMap offset: INVALID_VALUE on CUDA 12 drivers, NOT_SUPPORTED on the 580 driver (CUDA 13.0)
# seen on an H200 here (2026-12-04).
OFFSET = {"CUDA_ERROR_INVALID_VALUE", "CUDA_ERROR_NOT_SUPPORTED"}
# The 580 driver (CUDA 13.0, H200, 2026-12-04) answers NOT_SUPPORTED where CUDA 12 drivers answered
# INVALID_VALUE: a misaligned map address, a map larger than its handle.
MISUSE = {"CUDA_ERROR_NOT_SUPPORTED", "CUDA_ERROR_INVALID_VALUE", "CUDA_ERROR_ILLEGAL_STATE", "CUDA_ERROR_ALREADY_MAPPED",
          "CUDA_ERROR_NOT_MAPPED", "CUDA_ERROR_NOT_PERMITTED", "CUDA_ERROR_INVALID_ADDRESS_SPACE"}


# ---------------------------------------------------------------- fixtures and helpers

@pytest.fixture(scope="module")
def gpu(gpu_driver):
    return gpu_driver


class Held:
    """What a test created on the GPU, torn down in reverse order even when the test fails."""

    def __init__(self, d: Driver):
        self.d = d
        self.maps: list[tuple[int, int]] = []
        self.handles: list[int] = []
        self.reservations: list[tuple[int, int]] = []

    @property
    def G(self) -> int:
        return self.d.granularity

    def create(self, size: int) -> int:
        h = self.d.create(size)
        self.handles.append(h)
        return h

    def release(self, h: int) -> None:
        self.d.release(h)
        self.handles.remove(h)

    def reserve(self, size: int) -> int:
        va = self.d.reserve(size)
        self.reservations.append((va, size))
        return va

    def map(self, va: int, size: int, h: int) -> None:
        self.d.map(va, size, h)            # cuMemMap's offset must be 0
        self.maps.append((va, size))

    def unmap(self, va: int, size: int) -> None:
        self.d.unmap(va, size)
        self.maps.remove((va, size))

    def mapped_rw(self, size: int) -> tuple[int, int]:
        h = self.create(size)
        va = self.reserve(size)
        self.map(va, size, h)
        self.d.set_access(va, size)
        return h, va

    def close(self) -> None:
        self.d.faults.clear()
        self.d.synchronize()  # unmap does not wait for the device
        for va, size in reversed(self.maps):
            self.d.unmap(va, size)
        for h in reversed(self.handles):
            self.d.release(h)
        for va, size in reversed(self.reservations):
            self.d.free_address(va, size)


@pytest.fixture
def held(gpu):
    gpu.make_current()
    h = Held(gpu)
    yield h
    h.close()


def _ok(result) -> None:
    assert result[0] == R.CUDA_SUCCESS, result


def to_device(d: Driver, va: int, data: bytes) -> None:
    buf = ctypes.create_string_buffer(data, len(data))
    if d.kind == "emulated":  # device memory is host memory: check it is mapped with access first
        assert d.api.is_accessible(va, len(data), write=True), f"{len(data)} bytes at {va:#x} are not writable"
        ctypes.memmove(va, buf, len(data))
        return
    _ok(cu.cuMemcpyHtoD(cu.CUdeviceptr(va), ctypes.addressof(buf), len(data)))


def to_host(d: Driver, va: int, n: int) -> bytes:
    d.synchronize()  # driver.copy/memset run on the (async) legacy stream
    if d.kind == "emulated":
        assert d.api.is_accessible(va, n, write=False), f"{n} bytes at {va:#x} are not readable"
        return ctypes.string_at(va, n)
    buf = ctypes.create_string_buffer(n)
    _ok(cu.cuMemcpyDtoH(ctypes.addressof(buf), cu.CUdeviceptr(va), n))
    return buf.raw


def expect_error(fn, *args, call: str, names=INVALID, cls=CudaError) -> CudaError:
    with pytest.raises(cls) as info:
        fn(*args)
    err = info.value
    assert err.call == call
    assert err.name in names, f"{call} answered {err.name}; the emulation answers CUDA_ERROR_INVALID_VALUE"
    assert err.code == int(getattr(R, err.name))
    assert call in str(err) and err.name in str(err)
    return err


# ---------------------------------------------------------------- device

def test_gpu_driver_reports_its_device(gpu):
    assert gpu.kind == ("cuda" if MODE == "cuda" else "emulated") and gpu.ordinal == 0
    g = gpu.granularity
    assert g >= 64 << 10 and g & (g - 1) == 0
    assert g == 2 << 20 or MODE == "cuda"  # a rehearsal has the H100/H200 granularity
    assert gpu.name and gpu.total_memory > 0
    free, total = gpu.mem_info()
    assert 0 < free <= total and total == gpu.total_memory
    assert gpu.is_capturing() is False


# ---------------------------------------------------------------- bytes

def test_gpu_bytes_survive_remap_to_another_reservation(held, gpu):
    G = held.G
    data = os.urandom(2 * G)
    h = held.create(2 * G)
    va1 = held.reserve(2 * G)
    held.map(va1, 2 * G, h)
    gpu.set_access(va1, 2 * G)
    to_device(gpu, va1, data)
    gpu.synchronize()
    held.unmap(va1, 2 * G)
    va2 = held.reserve(4 * G)
    held.map(va2 + G, 2 * G, h)
    gpu.set_access(va2 + G, 2 * G)
    assert to_host(gpu, va2 + G, 2 * G) == data
    # And bytes written by the device through the new address read back too.
    gpu.memset(va2 + G + 3, 0xA5, G)
    expected = bytearray(data)
    expected[3:3 + G] = b"\xa5" * G
    assert to_host(gpu, va2 + G, 2 * G) == bytes(expected)


def test_gpu_remap_of_pages_in_another_order_reads_those_pages(held, gpu):
    """One handle per page (cuMemMap's offset must be 0): remapped in another order, each page keeps its bytes."""
    G = held.G
    data = os.urandom(3 * G)
    hs = [held.create(G) for _ in range(3)]
    va = held.reserve(3 * G)
    for i, h in enumerate(hs):
        held.map(va + i * G, G, h)
    gpu.set_access(va, 3 * G)
    to_device(gpu, va, data)
    gpu.synchronize()
    for i in range(3):
        held.unmap(va + i * G, G)
    held.map(va, G, hs[2])
    held.map(va + G, G, hs[0])
    gpu.set_access(va, 2 * G)              # one call over two mappings
    assert to_host(gpu, va, 2 * G) == data[2 * G:] + data[:G]


def test_gpu_aliasing_one_handle_two_addresses(held, gpu):
    G = held.G
    h = held.create(G)
    va1, va2 = held.reserve(G), held.reserve(G)
    held.map(va1, G, h)
    held.map(va2, G, h)
    gpu.set_access(va1, G)
    gpu.set_access(va2, G)
    data = os.urandom(G)
    to_device(gpu, va1, data)
    assert to_host(gpu, va2, G) == data
    gpu.memset(va2 + 100, 0x3C, 50)
    assert to_host(gpu, va1 + 90, 70) == data[90:100] + b"\x3c" * 50 + data[150:160]


def test_gpu_copy_and_memset_across_mapping_boundaries(held, gpu):
    G = held.G
    va = held.reserve(4 * G)
    for i in range(4):
        held.map(va + i * G, G, held.create(G))
    gpu.set_access(va, 4 * G)              # one SetAccess for four mappings
    gpu.memset(va, 0x11, 4 * G)
    data = os.urandom(G)
    _, src = held.mapped_rw(G)
    to_device(gpu, src, data)
    gpu.copy(va + G // 2, src, G)          # straddles the first boundary
    expected = bytearray(b"\x11" * (4 * G))
    expected[G // 2:G // 2 + G] = data
    assert to_host(gpu, va, 4 * G) == bytes(expected)
    held.unmap(va + 3 * G, G)
    held.unmap(va + 2 * G, G)
    assert to_host(gpu, va, 2 * G) == bytes(expected[:2 * G])


def test_gpu_release_while_mapped_keeps_bytes_until_last_unmap(held, gpu):
    G = held.G
    size = 32 * G
    free0, _ = gpu.mem_info()
    h, va = held.mapped_rw(size)
    free1, _ = gpu.mem_info()
    assert free1 <= free0 - size
    data = os.urandom(G)
    to_device(gpu, va + 5 * G, data)
    held.release(h)                        # deferred: still mapped
    assert to_host(gpu, va + 5 * G, G) == data
    gpu.memset(va, 0x77, G)
    assert to_host(gpu, va, 8) == b"\x77" * 8
    gpu.synchronize()
    held.unmap(va, size)                   # the last unmap frees the memory
    free2, _ = gpu.mem_info()
    assert free2 >= free1 + size


# ---------------------------------------------------------------- rule violations

def test_gpu_misaligned_sizes_addresses_and_offsets(held, gpu):
    G = held.G
    expect_error(gpu.create, G + 4096, call="cuMemCreate")
    if gpu.kind == "emulated":
        expect_error(gpu.reserve, G + 4096, call="cuMemAddressReserve")
    else:
        # The driver may accept a reservation that is only a multiple of the host page: either
        # outcome is fine, but a successful one must be freed (and freeable at that size).
        try:
            odd = gpu.reserve(G + 4096)
        except CudaError as err:
            assert err.call == "cuMemAddressReserve" and err.name in INVALID, err
        else:
            gpu.free_address(odd, G + 4096)
    h = held.create(2 * G)
    va = held.reserve(4 * G)
    expect_error(gpu.map, va + 4096, G, h, call="cuMemMap", names=MISUSE)
    expect_error(gpu.map, va, G + 4096, h, call="cuMemMap", names=MISUSE)
    expect_error(gpu.map, va, G, h, 4096, call="cuMemMap", names=OFFSET)   # (any non-zero offset is refused)
    held.map(va, 2 * G, h)
    expect_error(gpu.unmap, va + 4096, G, call="cuMemUnmap", names=MISUSE)
    expect_error(gpu.set_access, va + 4096, G, call="cuMemSetAccess", names=MISUSE)


def test_gpu_map_offset_must_be_zero(held, gpu):
    """cuMemMap: "offset ... Currently must be zero"; the rehearsal's emulated device refuses it the same way."""
    G = held.G
    h = held.create(2 * G)
    va = held.reserve(2 * G)
    expect_error(gpu.map, va, G, h, G, call="cuMemMap", names=OFFSET)  # aligned, inside the handle: still refused
    held.map(va, 2 * G, h)                 # the failed call mapped nothing
    gpu.set_access(va, 2 * G)


def test_gpu_map_outside_reservation_beyond_handle_or_over_a_mapping(held, gpu):
    G = held.G
    h = held.create(2 * G)
    va = held.reserve(4 * G)
    try:  # past the reservation's end: the emulation refuses it
        gpu.map(va + 3 * G, 2 * G, h)
    except CudaError as err:
        assert err.call == "cuMemMap" and err.name in MISUSE, err
    else:  # the 580 driver (CUDA 13.0, H200, 2026-12-04) accepted it: undone, the emulation stays the stricter
        gpu.unmap(va + 3 * G, 2 * G)
    expect_error(gpu.map, va, 3 * G, h, call="cuMemMap", names=MISUSE)          # size > handle
    held.map(va, 2 * G, h)
    h2 = held.create(2 * G)
    expect_error(gpu.map, va + G, 2 * G, h2, call="cuMemMap", names=MISUSE)     # over a mapping
    held.map(va + 2 * G, 2 * G, h2)        # the failed calls left the free pages free
    gpu.set_access(va, 4 * G)


def test_gpu_unmap_and_set_access_need_whole_mapped_ranges(held, gpu):
    G = held.G
    h = held.create(2 * G)
    va = held.reserve(4 * G)
    held.map(va, 2 * G, h)
    gpu.set_access(va, 2 * G)
    to_device(gpu, va, b"intact" * 10)
    expect_error(gpu.unmap, va, G, call="cuMemUnmap", names=MISUSE)             # splits a mapping
    try:  # nothing mapped there: the emulation refuses; the 580 driver (CUDA 13.0) returned success
        gpu.unmap(va + 2 * G, G)
    except CudaError as err:
        assert err.call == "cuMemUnmap" and err.name in MISUSE, err
    expect_error(gpu.set_access, va + 2 * G, G, call="cuMemSetAccess", names=MISUSE)  # unmapped
    expect_error(gpu.set_access, va, 3 * G, call="cuMemSetAccess", names=MISUSE)      # runs off it
    assert to_host(gpu, va, 60) == b"intact" * 10   # the mapping survived every failed call


def test_gpu_free_address_with_the_wrong_size_fails(held, gpu):
    G = held.G
    va = held.reserve(4 * G)
    expect_error(gpu.free_address, va, 2 * G, call="cuMemAddressFree", names=MISUSE)


# ---------------------------------------------------------------- fault injection

def test_gpu_fault_fires_on_the_nth_map_without_side_effect(held, gpu):
    G = held.G
    h1, h2 = held.create(G), held.create(G)
    va = held.reserve(2 * G)
    gpu.faults.inject("cuMemMap", R.CUDA_ERROR_ILLEGAL_STATE, nth=2)
    held.map(va, G, h1)
    expect_error(gpu.map, va + G, G, h2, call="cuMemMap", names={"CUDA_ERROR_ILLEGAL_STATE"})
    assert gpu.faults.pending() == 0
    held.map(va + G, G, h2)                # nothing was mapped by the failed call
    gpu.set_access(va, 2 * G)
    gpu.memset(va, 1, 2 * G)
    assert to_host(gpu, va + 2 * G - 4, 4) == b"\x01" * 4


def test_gpu_fault_repeat_and_clear(held, gpu):
    G = held.G
    gpu.faults.inject("cuMemCreate", R.CUDA_ERROR_OUT_OF_MEMORY, repeat=True)
    for _ in range(2):
        expect_error(gpu.create, G, call="cuMemCreate", names={"CUDA_ERROR_OUT_OF_MEMORY"},
                     cls=CudaOutOfMemoryError)
    assert gpu.faults.pending() == 1
    gpu.faults.clear()
    assert gpu.faults.pending() == 0
    held.create(G)
    with pytest.raises(ValueError):
        gpu.faults.inject("cuMemFrobnicate")


def test_gpu_one_unmap_covers_several_whole_mappings(held, gpu):
    """The emulation lets one cuMemUnmap cover adjacent whole mappings; the GPU must agree."""
    G = held.G
    va = held.reserve(2 * G)
    held.map(va, G, held.create(G))
    held.map(va + G, G, held.create(G))
    gpu.set_access(va, 2 * G)
    gpu.synchronize()
    gpu.unmap(va, 2 * G)
    held.maps.clear()
    held.map(va, G, held.handles[1])       # both pages are free again
    held.map(va + G, G, held.handles[0])


# ---------------------------------------------------------------- costs (reported, never asserted on)

def test_gpu_vmm_call_costs_per_page(held, gpu, figures):
    """What each VMM call costs per page on this device, the bytes checked after each way of granting access.

    Per page: cuMemCreate, cuMemMap, cuMemSetAccess, cuMemUnmap, cuMemRelease;
    and ONE cuMemSetAccess over the whole run of mapped pages, which is what
    `defrag.vmm` does after a stitch. Host wall clock per call (these calls
    are synchronous on the host), median over the pages.
    """
    import statistics
    import time

    G, n = held.G, 64

    def timed(fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        return out, time.perf_counter() - t0

    create = [timed(held.create, G) for _ in range(n)]
    handles = [h for h, _ in create]
    va = held.reserve(n * G)
    costs = {"create": [t for _, t in create], "map": [], "set_access": [], "unmap": [], "release": []}
    for i, h in enumerate(handles):
        costs["map"].append(timed(held.map, va + i * G, G, h)[1])
    for i in range(n):
        costs["set_access"].append(timed(gpu.set_access, va + i * G, G)[1])
    gpu.memset(va, 0x5A, n * G)
    assert to_host(gpu, va + (n - 1) * G + G - 16, 16) == b"\x5a" * 16
    gpu.synchronize()  # cuMemUnmap does not wait for the device
    for i in range(n):
        costs["unmap"].append(timed(held.unmap, va + i * G, G)[1])
    for i, h in enumerate(handles):
        held.map(va + i * G, G, h)
    _, one_call = timed(gpu.set_access, va, n * G)  # one SetAccess over the whole run
    gpu.memset(va + G // 2, 0x3C, (n - 1) * G)
    assert to_host(gpu, va, 8) == b"\x5a" * 8 and to_host(gpu, va + (n - 1) * G + G // 2 - 8, 16) == b"\x3c" * 8 + b"\x5a" * 8
    gpu.synchronize()
    for i in range(n):
        held.unmap(va + i * G, G)
    for h in list(handles):
        costs["release"].append(timed(held.release, h)[1])
    page = f"{G >> 20} MiB page" if G >= 1 << 20 else f"{G >> 10} KiB page"
    for op, samples in costs.items():
        figures.add(f"{op} per {page}", statistics.median(samples) * 1e6, "us", pages=n, max_us=max(samples) * 1e6)
    figures.add(f"one set_access over {n} pages", one_call * 1e6, "us",
                per_page_us=one_call / n * 1e6, vs_per_page_x=statistics.median(costs["set_access"]) * n / one_call)


def test_gpu_a_thread_with_no_current_context_maps_unmaps_and_synchronizes(held, gpu):
    """A new thread has no current context (an automatic rescue may run on one): every driver call that
    needs the context makes it current itself, and the bytes written there are read back here."""
    G = held.G
    h = held.create(G)
    va = held.reserve(G)
    data = os.urandom(4096)
    seen = {}

    def work():
        try:
            seen["capturing"] = gpu.is_capturing(0)
            held.map(va, G, h)
            gpu.set_access(va, G)
            gpu.memset(va, 0, G)
            gpu.synchronize()
            to_device(gpu, va, data)
            seen["bytes"] = to_host(gpu, va, len(data))
            held.unmap(va, G)
        except BaseException as exc:  # reported below, on the test's thread
            seen["error"] = exc

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert "error" not in seen, seen.get("error")
    assert seen["capturing"] is False and seen["bytes"] == data
