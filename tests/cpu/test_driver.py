"""Driver layer over the emulated device: bytes, rules, capacity, faults, leaks, call types.

Every test builds its own `Driver.emulated(...)` with a small granularity (64 KiB)
so pages are cheap, and tears the emulated device down afterwards. Memory is
read and written through raw host pointers (ctypes), which is what the
emulation's "device addresses" are.
"""
from __future__ import annotations

import ctypes
import inspect
import os
import re
import threading

import pytest
import torch
from cuda.bindings import driver as cu

import defrag.driver as driver_mod
from defrag.driver import DeviceUnavailableError, Driver, EmulatedCuda, open_driver
from defrag.driver.emulated import MEMFD_NAME
from defrag.errors import CudaError, CudaOutOfMemoryError

R = cu.CUresult
G = 64 << 10            # emulated granularity used by every test
CAP = 16 * G            # emulated capacity used by most tests


# ---------------------------------------------------------------- helpers

def new_driver(capacity: int = CAP, granularity: int = G, api=None) -> Driver:
    return Driver.emulated(capacity=capacity, granularity=granularity, api=api)


@pytest.fixture
def drv():
    d = new_driver()
    yield d
    d.api.close()
    d.close()


def write(va: int, data: bytes) -> None:
    ctypes.memmove(va, data, len(data))


def read(va: int, n: int) -> bytes:
    return ctypes.string_at(va, n)


def pattern(n: int, seed: int = 0) -> bytes:
    """Bytes that differ at every page and every offset (so misplaced pages show)."""
    return bytes((i * 131 + (i >> 12) * 7 + seed) & 0xFF for i in range(n))


def state(d: Driver) -> dict:
    return d.api.state()


def expect_error(d: Driver, fn, *args, call: str, name: str = "CUDA_ERROR_INVALID_VALUE",
                 cls=CudaError) -> CudaError:
    """fn(*args) raises `cls` for `call` with CUDA error `name`, and changes no driver state."""
    before = state(d)
    with pytest.raises(cls) as info:
        fn(*args)
    err = info.value
    assert isinstance(err, CudaError)
    assert err.call == call
    assert err.name == name
    assert err.code == int(getattr(R, name))
    assert call in str(err) and name in str(err)
    assert state(d) == before
    return err


def memfd_count() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the directory's own fd, already closed
            continue
        if target.startswith(f"/memfd:{MEMFD_NAME}"):
            n += 1
    return n


def memfd_map_count() -> int:
    with open("/proc/self/maps") as f:
        return sum(MEMFD_NAME in line for line in f)


def mapped_rw(d: Driver, size: int):
    """Create a handle, reserve `size`, map, grant access; returns (handle, va)."""
    h = d.create(size)
    va = d.reserve(size)
    d.map(va, size, h)
    d.set_access(va, size)
    return h, va


# ---------------------------------------------------------------- construction

def test_emulated_driver_reports_its_device(drv):
    assert drv.kind == "emulated" and drv.ordinal == 0
    assert drv.granularity == G
    assert drv.total_memory == CAP
    assert drv.mem_info() == (CAP, CAP)
    assert drv.name == "defrag emulated device"
    assert "granularity=65536" in repr(drv)


def test_emulated_rejects_bad_granularity_and_capacity():
    with pytest.raises(ValueError, match="granularity"):
        EmulatedCuda(capacity=CAP, granularity=G + 1)
    with pytest.raises(ValueError, match="granularity"):
        EmulatedCuda(capacity=CAP, granularity=0)
    with pytest.raises(ValueError, match="capacity"):
        EmulatedCuda(capacity=-1, granularity=G)


def test_driver_rejects_bad_ordinal_and_kind():
    api = EmulatedCuda(capacity=CAP, granularity=G)
    with pytest.raises(ValueError, match="ordinal 1 out of range"):
        Driver(api, 1, kind="emulated")
    with pytest.raises(ValueError, match="kind"):
        Driver(api, 0, kind="tpu")
    two = EmulatedCuda(capacity=CAP, granularity=G, device_count=2)
    assert Driver(two, 1, kind="emulated").ordinal == 1


def test_close_releases_context_once():
    d = new_driver()
    d.close()
    d.close()  # idempotent: a second cuDevicePrimaryCtxRelease would fail
    assert d.api.calls["cuDevicePrimaryCtxRelease"] == 1
    assert d.api._contexts[0xC000] == 0
    d.api.close()


def test_context_made_current_once_per_thread(drv):
    before = drv.api.calls["cuCtxSetCurrent"]
    drv.mem_info()
    drv.synchronize()
    assert drv.api.calls["cuCtxSetCurrent"] == before  # already current on this thread
    t = threading.Thread(target=lambda: (drv.mem_info(), drv.synchronize()))
    t.start()
    t.join()
    assert drv.api.calls["cuCtxSetCurrent"] == before + 1


# ---------------------------------------------------------------- bytes: remap, alias, copy

def test_bytes_survive_remap_to_another_reservation(drv):
    size = 3 * G
    data = pattern(size, seed=1)
    h = drv.create(size)
    va1 = drv.reserve(size)
    drv.map(va1, size, h)
    drv.set_access(va1, size)
    write(va1, data)
    drv.unmap(va1, size)
    assert not drv.api.is_accessible(va1, G)

    va2 = drv.reserve(2 * size)          # a different reservation, mapped past its start
    target = va2 + G
    assert not (va1 <= target < va1 + size)
    drv.map(target, size, h)
    assert not drv.api.is_accessible(target, size)  # a remap starts with no access
    with pytest.raises(CudaError):
        drv.copy(va2, target, G)
    drv.set_access(target, size)
    assert read(target, size) == data


def test_remap_of_a_slice_reads_that_slice(drv):
    """CUDA maps a handle only from its first byte (offset 0), so the slices of a range are handles of
    their own: one per page, written in order, then remapped in another order."""
    data = pattern(4 * G, seed=2)
    hs = [drv.create(G) for _ in range(4)]
    va = drv.reserve(4 * G)
    for i, h in enumerate(hs):
        drv.map(va + i * G, G, h)
    drv.set_access(va, 4 * G)
    write(va, data)
    drv.unmap(va, 4 * G)
    # Map pages 2..3 at the start of the same range, page 0 after them.
    drv.map(va, G, hs[2])
    drv.map(va + G, G, hs[3])
    drv.map(va + 2 * G, G, hs[0])
    drv.set_access(va, 3 * G)
    assert read(va, 2 * G) == data[2 * G:4 * G]
    assert read(va + 2 * G, G) == data[:G]


def aliased(drv, size):
    """One handle of `size` mapped read/write at two reserved addresses; (va1, va2)."""
    h = drv.create(size)
    va1, va2 = drv.reserve(size), drv.reserve(size)
    for va in (va1, va2):
        drv.map(va, size, h)
        drv.set_access(va, size)
    return va1, va2


def test_aliasing_one_handle_two_addresses_share_bytes(drv):
    size = 2 * G
    va1, va2 = aliased(drv, size)
    assert va1 != va2
    data = pattern(size, seed=3)
    write(va1, data)
    assert read(va2, size) == data
    write(va2 + G + 5, b"alias")
    assert read(va1 + G + 5, 5) == b"alias"
    drv.memset(va2, 0x5A, G)
    assert read(va1, G) == b"\x5a" * G
    # Unmapping one alias leaves the other intact.
    drv.unmap(va1, size)
    assert read(va2 + G + 5, 5) == b"alias"


def test_a_forked_child_writes_its_own_copy_of_the_pages(drv):
    """Pages are memfds mapped MAP_SHARED: a forked child maps them again copy-on-write, so its writes
    (a DataLoader worker's in-place op on a tensor it inherited) never reach the parent's bytes, read-only
    granules stay read-only there, and aliases of one page stay aliases in the parent."""
    size = 2 * G
    va1, va2 = aliased(drv, size)
    data = pattern(size, seed=5)
    write(va1, data)
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        ok = read(va1, size) == data and read(va2, size) == data
        write(va1 + 7, b"child")
        ok = ok and read(va1 + 7, 5) == b"child"
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert read(va1, size) == data and read(va2, size) == data
    write(va2 + 7, b"after")
    assert read(va1 + 7, 5) == b"after"  # still one page behind both addresses here


def test_copy_and_memset_move_the_right_bytes(drv):
    _, a = mapped_rw(drv, 2 * G)
    _, b = mapped_rw(drv, 2 * G)
    data = pattern(2 * G, seed=4)
    write(a, data)
    drv.memset(b, 0x11, 2 * G)
    drv.copy(b + 100, a + 7, G)
    expected = bytearray(b"\x11" * (2 * G))
    expected[100:100 + G] = data[7:7 + G]
    assert read(b, 2 * G) == bytes(expected)
    drv.memset(b + 3, 0x1FF, 2)             # only the low byte counts
    assert read(b + 2, 4) == bytes([expected[2], 0xFF, 0xFF, expected[5]])
    drv.copy(a, a + 1, 100)                 # overlapping ranges behave like memmove
    assert read(a, 100) == data[1:101]
    drv.copy(a, b, 0)                       # zero bytes: nothing, no error
    drv.memset(a, 0, 0)
    assert read(a + 100, G) == data[100:100 + G]


def test_one_set_access_spans_several_mappings_and_one_unmap_covers_them(drv):
    handles = [drv.create(G) for _ in range(4)]
    va = drv.reserve(4 * G)
    for i, h in enumerate(handles):
        drv.map(va + i * G, G, h)
    n = drv.api.calls.get("cuMemSetAccess", 0)
    drv.set_access(va, 4 * G)
    assert drv.api.calls["cuMemSetAccess"] == n + 1
    data = pattern(4 * G, seed=5)
    write(va, data)                        # crosses every mapping boundary
    assert read(va, 4 * G) == data
    drv.unmap(va, 4 * G)                   # several whole mappings at once
    assert state(drv)["mappings"] == 0
    # Each handle kept its own page: remap them in reverse order.
    for i, h in enumerate(reversed(handles)):
        drv.map(va + i * G, G, h)
    drv.set_access(va, 4 * G)
    assert read(va, 4 * G) == b"".join(data[(3 - i) * G:(4 - i) * G] for i in range(4))


# ---------------------------------------------------------------- rule violations

@pytest.mark.parametrize("size", [0, G - 4096, G + 4096, -G])
def test_create_rejects_bad_sizes(drv, size):
    if size < 0:  # a size_t: cuda-bindings refuses a negative one before any driver call, as the emulator does
        before = state(drv)
        with pytest.raises(OverflowError):
            drv.create(size)
        assert state(drv) == before
        return
    expect_error(drv, drv.create, size, call="cuMemCreate")


@pytest.mark.parametrize("size, alignment", [(G + 4096, 0), (0, 0), (G, 4096), (G, 3 * G), (G, G + 4096)])
def test_reserve_rejects_bad_size_or_alignment(drv, size, alignment):
    expect_error(drv, drv.reserve, size, alignment, call="cuMemAddressReserve")


def test_reserve_honours_a_larger_alignment(drv):
    for _ in range(3):
        assert drv.reserve(G, 8 * G) % (8 * G) == 0


def test_map_rejects_misaligned_address_size_and_offset(drv):
    h = drv.create(2 * G)
    va = drv.reserve(4 * G)
    expect_error(drv, drv.map, va + 4096, G, h, call="cuMemMap")
    expect_error(drv, drv.map, va, G + 4096, h, call="cuMemMap")
    expect_error(drv, drv.map, va, G, h, 4096, call="cuMemMap")
    expect_error(drv, drv.map, va, G, h, G, call="cuMemMap")  # aligned, but CUDA's offset "must be zero"
    expect_error(drv, drv.map, va, 0, h, call="cuMemMap")
    drv.map(va, 2 * G, h)  # the aligned, zero-offset form works


def test_map_rejects_size_beyond_handle(drv):
    h = drv.create(2 * G)
    va = drv.reserve(4 * G)
    expect_error(drv, drv.map, va, 3 * G, h, call="cuMemMap")
    expect_error(drv, drv.map, va, 4 * G, h, call="cuMemMap")
    drv.map(va, 2 * G, h)  # exactly the handle maps


def test_map_refuses_any_nonzero_offset_like_cuda(drv):
    """cuMemMap's offset "currently must be zero": the emulation answers CUDA_ERROR_INVALID_VALUE,
    through the driver layer's CudaError, and maps nothing."""
    h = drv.create(4 * G)
    va = drv.reserve(4 * G)
    expect_error(drv, drv.map, va, G, h, G, call="cuMemMap")          # aligned, inside the handle
    expect_error(drv, drv.map, va, 2 * G, h, 2 * G, call="cuMemMap")
    drv.map(va, 4 * G, h)                                             # offset 0 maps
    drv.set_access(va, 4 * G)
    write(va + 3 * G, b"zero")
    assert read(va + 3 * G, 4) == b"zero"


def test_gpu_rehearsal_devices_refuse_a_nonzero_map_offset():
    """tests/gpu's emulated devices (DEFRAG_GPU_REHEARSAL=1) catch a GPU test or a pool that maps at an offset."""
    from tests.gpu import conftest as gpu_conftest

    d = gpu_conftest.emulated_device(4 << 20)
    try:
        P = d.granularity
        h = d.create(2 * P)
        va = d.reserve(2 * P)
        expect_error(d, d.map, va, P, h, P, call="cuMemMap")
        d.map(va, 2 * P, h)
        d.unmap(va, 2 * P)
        d.release(h)
        d.free_address(va, 2 * P)
    finally:
        d.api.close()
        d.close()


class _HostPageReservations(EmulatedCuda):
    """A device whose cuMemAddressReserve takes any host-page multiple (the CUDA driver may), rounded up inside."""

    def _round(self, size) -> int:
        size, G = int(size), self.granularity
        return -(-size // G) * G if size % 4096 == 0 else size

    def cuMemAddressReserve(self, size, alignment, addr, flags):
        return super().cuMemAddressReserve(self._round(size), alignment, addr, flags)

    def cuMemAddressFree(self, ptr, size):
        return super().cuMemAddressFree(ptr, self._round(size))


def test_gpu_misaligned_reserve_check_frees_a_reservation_the_gpu_accepts():
    """tests/gpu's misalignment test on a GPU that accepts reserve(granularity + 4096): passes, leaks nothing."""
    from tests.gpu import test_driver_gpu as gpu_tests

    api = _HostPageReservations(capacity=16 * (2 << 20), granularity=2 << 20)
    d = Driver(api, 0, kind="cuda")
    held = gpu_tests.Held(d)
    try:
        gpu_tests.test_gpu_misaligned_sizes_addresses_and_offsets(held, d)
    finally:
        held.close()
    try:
        assert api.state() == {"handles": 0, "mappings": 0, "reservations": 0, "used_bytes": 0}
    finally:
        api.close()
        d.close()


def test_map_rejects_addresses_outside_a_reservation(drv):
    h = drv.create(2 * G)
    va = drv.reserve(2 * G)
    expect_error(drv, drv.map, va + G, 2 * G, h, call="cuMemMap")     # spans past the end
    expect_error(drv, drv.map, va + 2 * G, G, h, call="cuMemMap")     # just past the end
    expect_error(drv, drv.map, va - G, G, h, call="cuMemMap")         # just before it
    gone = drv.reserve(G)
    drv.free_address(gone, G)
    expect_error(drv, drv.map, gone, G, h, call="cuMemMap")           # a freed reservation


def test_map_rejects_an_already_mapped_range(drv):
    h1, h2 = drv.create(2 * G), drv.create(2 * G)
    va = drv.reserve(4 * G)
    drv.map(va + G, 2 * G, h1)
    expect_error(drv, drv.map, va + G, 2 * G, h2, call="cuMemMap")   # exactly over it
    expect_error(drv, drv.map, va, 2 * G, h2, call="cuMemMap")       # overlaps its start
    expect_error(drv, drv.map, va + 2 * G, 2 * G, h2, call="cuMemMap")  # overlaps its end
    expect_error(drv, drv.map, va + 2 * G, G, h2, call="cuMemMap")   # inside it
    h3, h4 = drv.create(G), drv.create(G)
    drv.map(va, G, h3)                                               # the free pages still map
    drv.map(va + 3 * G, G, h4)


def test_map_rejects_unknown_and_released_handles(drv):
    va = drv.reserve(G)
    expect_error(drv, drv.map, va, G, 0xDEAD, call="cuMemMap")
    h = drv.create(G)
    drv.release(h)
    expect_error(drv, drv.map, va, G, h, call="cuMemMap")


def test_unmap_rejects_misaligned_split_gap_and_unmapped(drv):
    h1, h2 = drv.create(2 * G), drv.create(G)
    va = drv.reserve(8 * G)
    drv.map(va, 2 * G, h1)
    drv.map(va + 3 * G, G, h2)                 # gap at va+2G
    expect_error(drv, drv.unmap, va + 4096, G, call="cuMemUnmap")
    expect_error(drv, drv.unmap, va, 2 * G - 4096, call="cuMemUnmap")
    expect_error(drv, drv.unmap, va, G, call="cuMemUnmap")             # first half of a mapping
    expect_error(drv, drv.unmap, va + G, G, call="cuMemUnmap")         # second half
    expect_error(drv, drv.unmap, va, 4 * G, call="cuMemUnmap")         # covers the gap
    expect_error(drv, drv.unmap, va + 2 * G, G, call="cuMemUnmap")     # only the gap
    expect_error(drv, drv.unmap, va + 5 * G, G, call="cuMemUnmap")     # nothing there
    expect_error(drv, drv.unmap, va, 0, call="cuMemUnmap")
    drv.unmap(va, 2 * G)
    expect_error(drv, drv.unmap, va, 2 * G, call="cuMemUnmap")         # twice
    drv.unmap(va + 3 * G, G)


def test_set_access_rejects_misaligned_and_unmapped_ranges(drv):
    h = drv.create(2 * G)
    va = drv.reserve(4 * G)
    drv.map(va, 2 * G, h)
    expect_error(drv, drv.set_access, va + 4096, G, call="cuMemSetAccess")
    expect_error(drv, drv.set_access, va, G + 4096, call="cuMemSetAccess")
    expect_error(drv, drv.set_access, va + 2 * G, G, call="cuMemSetAccess")   # unmapped
    expect_error(drv, drv.set_access, va, 3 * G, call="cuMemSetAccess")       # runs off the mapping
    expect_error(drv, drv.set_access, va, 0, call="cuMemSetAccess")
    assert not drv.api.is_accessible(va, 2 * G)
    drv.set_access(va, 2 * G)
    assert drv.api.is_accessible(va, 2 * G)


def test_set_access_count_must_match_descriptors(drv):
    h = drv.create(G)
    va = drv.reserve(G)
    drv.map(va, G, h)
    desc = drv._access_rw
    assert drv.api.cuMemSetAccess(va, G, [desc], 2) == (R.CUDA_ERROR_INVALID_VALUE,)
    assert drv.api.cuMemSetAccess(va, G, [], 0) == (R.CUDA_ERROR_INVALID_VALUE,)
    assert not drv.api.is_accessible(va, G)


def test_release_rejects_unknown_and_double_release(drv):
    expect_error(drv, drv.release, 0xDEAD, call="cuMemRelease")
    h = drv.create(G)
    drv.release(h)
    expect_error(drv, drv.release, h, call="cuMemRelease")
    h = drv.create(G)
    va = drv.reserve(G)
    drv.map(va, G, h)
    drv.release(h)                                                  # still mapped: deferred
    expect_error(drv, drv.release, h, call="cuMemRelease")


def test_free_address_rejects_mappings_inside_and_wrong_size(drv):
    h = drv.create(G)
    va = drv.reserve(4 * G)
    drv.map(va + 2 * G, G, h)
    expect_error(drv, drv.free_address, va, 4 * G, call="cuMemAddressFree")   # mapping inside
    drv.unmap(va + 2 * G, G)
    expect_error(drv, drv.free_address, va, 2 * G, call="cuMemAddressFree")   # too small
    expect_error(drv, drv.free_address, va, 8 * G, call="cuMemAddressFree")   # too large
    expect_error(drv, drv.free_address, va + G, 3 * G, call="cuMemAddressFree")  # not its base
    drv.free_address(va, 4 * G)
    expect_error(drv, drv.free_address, va, 4 * G, call="cuMemAddressFree")   # twice
    assert state(drv)["reservations"] == 0


def test_copy_and_memset_on_unmapped_or_inaccessible_memory_fail_cleanly(drv):
    _, good = mapped_rw(drv, 2 * G)
    write(good, pattern(2 * G, seed=6))
    h = drv.create(G)
    bare = drv.reserve(2 * G)                   # reserved, nothing mapped
    noaccess = drv.reserve(G)
    drv.map(noaccess, G, h)                     # mapped, never granted access
    snapshot = read(good, 2 * G)
    for dst, src in [(bare, good), (good, bare), (noaccess, good), (good, noaccess),
                     (good + G, good + G + 1), (good + G + 1, good + G),   # runs off the mapping
                     (0x1000, good), (good, 0x1000)]:                      # not device memory
        expect_error(drv, drv.copy, dst, src, G, call="cuMemcpyDtoDAsync")
    for ptr in (bare, noaccess, good + 2 * G - 1, 0x1000):
        expect_error(drv, drv.memset, ptr, 1, 2, call="cuMemsetD8Async")
    with pytest.raises(OverflowError):  # a negative size_t: refused by the binding, as on a GPU
        drv.copy(good, good + G, -1)
    assert read(good, 2 * G) == snapshot        # nothing was half-copied


def test_read_only_access_allows_reads_but_not_writes(drv):
    h = drv.create(G)
    ro = drv.reserve(G)
    drv.map(ro, G, h)
    drv.set_access(ro, G)
    write(ro, b"readonly")
    desc = cu.CUmemAccessDesc()
    desc.location = drv._location()
    desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ
    assert drv.api.cuMemSetAccess(ro, G, [desc], 1) == (R.CUDA_SUCCESS,)
    _, rw = mapped_rw(drv, G)
    drv.copy(rw, ro, 8)
    assert read(rw, 8) == b"readonly"
    expect_error(drv, drv.copy, ro, rw, 8, call="cuMemcpyDtoDAsync")
    expect_error(drv, drv.memset, ro, 0, 8, call="cuMemsetD8Async")


def test_set_access_on_part_of_a_mapping_never_claims_access_it_did_not_grant(drv):
    """A copy into the part of a mapping that set_access did not cover must fail, not segfault.

    Asserted through is_accessible so a regression fails here instead of killing the run.
    """
    h = drv.create(2 * G)
    va = drv.reserve(2 * G)
    drv.map(va, 2 * G, h)
    try:
        drv.set_access(va + G, G)      # a GPU may refuse this; if it is accepted...
    except CudaError as err:
        assert err.name == "CUDA_ERROR_INVALID_VALUE"
        return
    # ...the first page still has no access, so the emulation must say so.
    assert not drv.api.is_accessible(va, G), (
        "EmulatedCuda.cuMemSetAccess marks the whole mapping accessible after a partial "
        "set_access; a copy into its first page would segfault the process")


# ---------------------------------------------------------------- capacity

def test_create_beyond_capacity_raises_out_of_memory_until_a_release():
    d = new_driver(capacity=4 * G)
    try:
        handles = [d.create(G) for _ in range(3)]
        expect_error(d, d.create, 2 * G, call="cuMemCreate", name="CUDA_ERROR_OUT_OF_MEMORY",
                     cls=CudaOutOfMemoryError)
        handles.append(d.create(G))
        err = expect_error(d, d.create, G, call="cuMemCreate", name="CUDA_ERROR_OUT_OF_MEMORY",
                           cls=CudaOutOfMemoryError)
        assert err.code == 2 and isinstance(err, RuntimeError)
        assert d.mem_info() == (0, 4 * G)
        d.release(handles.pop())
        assert d.mem_info() == (G, 4 * G)
        handles.append(d.create(G))
        with pytest.raises(CudaOutOfMemoryError):
            d.create(G)
        for h in handles[:2]:
            d.release(h)
        handles = handles[2:] + [d.create(2 * G)]   # two freed pages back one 2-page handle
    finally:
        d.api.close()


def test_mem_info_counts_physical_bytes_only(drv):
    assert drv.mem_info() == (CAP, CAP)
    h1 = drv.create(3 * G)
    h2 = drv.create(G)
    assert drv.mem_info() == (CAP - 4 * G, CAP)
    va = drv.reserve(8 * G)                        # address space costs no capacity
    drv.map(va, 3 * G, h1)
    drv.map(va + 4 * G, G, h2)
    drv.set_access(va, 3 * G)
    assert drv.mem_info() == (CAP - 4 * G, CAP)
    assert state(drv)["used_bytes"] == 4 * G
    drv.unmap(va, 3 * G)
    drv.unmap(va + 4 * G, G)
    drv.release(h1)
    assert drv.mem_info() == (CAP - G, CAP)
    drv.release(h2)
    assert drv.mem_info() == (CAP, CAP)


def test_release_while_mapped_frees_capacity_at_last_unmap():
    d = new_driver(capacity=2 * G)
    try:
        h = d.create(2 * G)
        va1, va2 = d.reserve(2 * G), d.reserve(2 * G)
        d.map(va1, 2 * G, h)
        d.map(va2, 2 * G, h)
        d.set_access(va1, 2 * G)
        d.set_access(va2, 2 * G)
        data = pattern(2 * G, seed=7)
        write(va1, data)
        d.release(h)
        assert d.mem_info() == (0, 2 * G)            # still held by its mappings
        assert state(d)["handles"] == 1
        with pytest.raises(CudaOutOfMemoryError):
            d.create(G)
        assert read(va2, 2 * G) == data              # bytes live on while mapped
        write(va2, b"still writable")
        assert read(va1, 14) == b"still writable"
        d.unmap(va1, 2 * G)
        assert d.mem_info() == (0, 2 * G)            # one mapping left
        assert read(va2 + 14, 2 * G - 14) == data[14:]
        with pytest.raises(CudaOutOfMemoryError):
            d.create(G)
        d.unmap(va2, 2 * G)                          # the last unmap frees it
        assert d.mem_info() == (2 * G, 2 * G)
        assert state(d)["handles"] == 0 and state(d)["used_bytes"] == 0
        d.create(2 * G)
    finally:
        d.api.close()


# ---------------------------------------------------------------- fault injection

def test_fault_fires_exactly_on_the_nth_call_without_side_effects(drv):
    hs = [drv.create(G) for _ in range(4)]
    va = drv.reserve(4 * G)
    drv.faults.inject("cuMemMap", R.CUDA_ERROR_ILLEGAL_STATE, nth=3)
    assert drv.faults.pending() == 1
    drv.map(va, G, hs[0])
    drv.map(va + G, G, hs[1])
    assert drv.faults.pending() == 1
    api_maps = drv.api.calls["cuMemMap"]
    expect_error(drv, drv.map, va + 2 * G, G, hs[2], call="cuMemMap", name="CUDA_ERROR_ILLEGAL_STATE")
    assert drv.api.calls["cuMemMap"] == api_maps         # the emulator was never called
    assert drv.faults.pending() == 0
    assert drv.faults.injected == [("cuMemMap", "CUDA_ERROR_ILLEGAL_STATE")]
    assert not drv.api.is_accessible(va + 2 * G, G, write=False)
    drv.map(va + 2 * G, G, hs[2])                         # nothing was mapped: the range is free
    drv.map(va + 3 * G, G, hs[3])
    drv.set_access(va, 4 * G)
    assert state(drv)["mappings"] == 4


def test_fault_repeat_fails_every_call_until_cleared(drv):
    drv.faults.inject("cuMemCreate", int(R.CUDA_ERROR_UNKNOWN), nth=2, repeat=True)  # int accepted
    drv.create(G)
    for _ in range(3):
        expect_error(drv, drv.create, G, call="cuMemCreate", name="CUDA_ERROR_UNKNOWN")
    assert drv.faults.pending() == 1
    assert drv.mem_info() == (CAP - G, CAP)
    drv.faults.clear()
    assert drv.faults.pending() == 0
    drv.create(G)
    assert drv.mem_info() == (CAP - 2 * G, CAP)


def test_injected_out_of_memory_raises_the_oom_subclass_and_opens_no_memfd(drv):
    fds = memfd_count()
    drv.faults.inject("cuMemCreate", R.CUDA_ERROR_OUT_OF_MEMORY)
    expect_error(drv, drv.create, G, call="cuMemCreate", name="CUDA_ERROR_OUT_OF_MEMORY",
                 cls=CudaOutOfMemoryError)
    assert memfd_count() == fds
    assert drv.mem_info() == (CAP, CAP)


def test_faults_count_calls_per_function(drv):
    h1, h2 = drv.create(G), drv.create(G)
    va = drv.reserve(2 * G)
    drv.faults.inject("cuMemUnmap", R.CUDA_ERROR_INVALID_VALUE, nth=2)
    drv.faults.inject("cuMemSetAccess", R.CUDA_ERROR_INVALID_VALUE, nth=1)
    drv.map(va, G, h1)
    drv.map(va + G, G, h2)              # maps do not advance the unmap fault
    expect_error(drv, drv.set_access, va, 2 * G, call="cuMemSetAccess")
    assert not drv.api.is_accessible(va, 2 * G)
    drv.unmap(va, G)
    expect_error(drv, drv.unmap, va + G, G, call="cuMemUnmap")
    drv.unmap(va + G, G)
    assert drv.faults.pending() == 0 and state(drv)["mappings"] == 0


@pytest.mark.parametrize("call, run", [
    ("cuMemGetInfo", lambda d: d.mem_info()),
    ("cuMemAddressReserve", lambda d: d.reserve(G)),
    ("cuStreamIsCapturing", lambda d: d.is_capturing()),
    ("cuCtxSynchronize", lambda d: d.synchronize()),
])
def test_faults_on_calls_with_outputs_raise_cuda_error(drv, call, run):
    drv.faults.inject(call, R.CUDA_ERROR_LAUNCH_FAILED)
    expect_error(drv, run, drv, call=call, name="CUDA_ERROR_LAUNCH_FAILED")
    run(drv)  # the next call succeeds


def test_fault_injection_rejects_unknown_functions_and_bad_nth(drv):
    for name in ("cuMemFrobnicate", "memMap", "close", "state", ""):
        with pytest.raises(ValueError, match="unknown driver function"):
            drv.faults.inject(name)
    with pytest.raises(ValueError, match="nth"):
        drv.faults.inject("cuMemMap", nth=0)
    assert drv.faults.pending() == 0


def test_two_faults_planned_for_the_same_call_both_fire(drv):
    """Two plans that land on the same call: the first fires, the second must fire next
    (or be refused) -- never be silently lost while pending() keeps counting it."""
    drv.faults.inject("cuMemCreate", R.CUDA_ERROR_OUT_OF_MEMORY, nth=1)
    drv.faults.inject("cuMemCreate", R.CUDA_ERROR_INVALID_VALUE, nth=1)
    outcomes = []
    for _ in range(3):
        try:
            drv.create(G)
            outcomes.append("ok")
        except CudaError as err:
            outcomes.append(err.name)
    assert outcomes == ["CUDA_ERROR_OUT_OF_MEMORY", "CUDA_ERROR_INVALID_VALUE", "ok"]
    assert drv.faults.pending() == 0


# ---------------------------------------------------------------- leaks

def test_explicit_teardown_and_close_leave_nothing_behind():
    fds, maps = memfd_count(), memfd_map_count()
    d = new_driver()
    h1, va1 = mapped_rw(d, 2 * G)
    h2 = d.create(G)
    va2 = d.reserve(3 * G)
    d.map(va2, G, h2)
    d.map(va2 + G, 2 * G, h1)                  # alias of h1
    d.set_access(va2, 3 * G)
    write(va1, pattern(2 * G))
    assert memfd_count() == fds + 2
    assert memfd_map_count() > maps
    d.release(h1)                              # deferred: still mapped twice
    d.unmap(va1, 2 * G)
    assert memfd_count() == fds + 2
    d.unmap(va2, 3 * G)                        # two whole mappings in one call
    d.release(h2)
    d.free_address(va1, 2 * G)
    d.free_address(va2, 3 * G)
    assert memfd_count() == fds and memfd_map_count() == maps
    assert d.api.state() == {"handles": 0, "mappings": 0, "reservations": 0, "used_bytes": 0}
    d.api.close()
    d.close()
    assert memfd_count() == fds and memfd_map_count() == maps


def test_close_tears_down_everything_still_held():
    fds, maps = memfd_count(), memfd_map_count()
    d = new_driver()
    h1, va1 = mapped_rw(d, 2 * G)
    d.create(G)
    d.reserve(4 * G)
    va3 = d.reserve(G)
    d.map(va3, G, h1)                          # alias
    d.release(h1)                              # released but mapped
    d.create(3 * G)                            # never mapped
    assert memfd_count() == fds + 3
    d.api.close()
    assert d.api.state() == {"handles": 0, "mappings": 0, "reservations": 0, "used_bytes": 0}
    assert memfd_count() == fds and memfd_map_count() == maps
    assert d.mem_info() == (CAP, CAP)
    d.api.close()                              # idempotent
    d.close()


def test_failed_calls_leave_no_memfd_or_mapping():
    fds, maps = memfd_count(), memfd_map_count()
    d = new_driver(capacity=2 * G)
    h = d.create(2 * G)
    va = d.reserve(2 * G)
    for bad in (lambda: d.create(G), lambda: d.create(G + 1), lambda: d.map(va, 3 * G, h),
                lambda: d.map(va + 4096, G, h)):
        with pytest.raises(CudaError):
            bad()
    assert memfd_count() == fds + 1
    d.map(va, 2 * G, h)
    with pytest.raises(CudaError):
        d.map(va, 2 * G, h)
    assert memfd_map_count() - maps == 1
    d.api.close()
    assert memfd_count() == fds and memfd_map_count() == maps


# ---------------------------------------------------------------- call construction

class Recorder:
    """A transparent proxy over a driver API that records every cu* call and its arguments."""

    def __init__(self, api):
        self._api = api
        self.log: list[tuple[str, tuple]] = []

    def __getattr__(self, name):
        target = getattr(self._api, name)
        if not name.startswith("cu") or not callable(target):
            return target

        def call(*args):
            self.log.append((name, args))
            return target(*args)
        return call

    def args(self, name):
        return [a for n, a in self.log if n == name]


@pytest.fixture
def recorded():
    api = EmulatedCuda(capacity=CAP, granularity=G)
    rec = Recorder(api)
    d = Driver.emulated(api=rec)
    yield d, rec
    api.close()
    d.close()


def _exercise(d: Driver) -> None:
    hs = [d.create(G) for _ in range(3)]
    va = d.reserve(5 * G, 0)
    for i, h in enumerate(hs):
        d.map(va + i * G, G, h)
    big = d.create(2 * G)
    d.map(va + 3 * G, 2 * G, big)
    d.set_access(va, 5 * G)
    d.memset(va, 7, G, stream=0)
    d.copy(va + G, va, G)
    d.mem_info()
    d.is_capturing()
    d.synchronize()
    d.unmap(va, 5 * G)
    for h in hs + [big]:
        d.release(h)
    d.free_address(va, 5 * G)


def _location_is_device0(loc) -> bool:
    return (isinstance(loc, cu.CUmemLocation)
            and loc.type == cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE and loc.id == 0)


def test_every_call_matches_the_cuda_python_signature(recorded):
    d, rec = recorded
    _exercise(d)
    d.close()
    names = {n for n, _ in rec.log}
    assert {"cuInit", "cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuMemRelease",
            "cuMemAddressReserve", "cuMemAddressFree", "cuMemcpyDtoDAsync", "cuMemsetD8Async",
            "cuMemGetInfo", "cuStreamIsCapturing", "cuDevicePrimaryCtxRelease"} <= names
    for name, args in rec.log:
        real = getattr(cu, name)   # the adapter only calls functions cuda-python has
        sig = inspect.signature(real)
        sig.bind(*args)            # same arity as the real binding
        for param, value in zip(sig.parameters.values(), args):
            if not isinstance(param.annotation, str):
                continue
            # e.g. "Optional[CUmemAllocationProp]" or "Optional[tuple[CUmemAccessDesc] | list[...]]"
            types = {getattr(cu, t) for t in re.findall(r"CU\w+", param.annotation)}
            items = value if isinstance(value, (list, tuple)) else [value]
            assert items and all(type(v) in types for v in items), (name, param.name, value)


def test_create_and_granularity_use_cuda_python_structs(recorded):
    d, rec = recorded
    h = d.create(2 * G)
    (size, prop, flags), = rec.args("cuMemCreate")
    assert size == 2 * G and flags == 0
    assert type(prop) is cu.CUmemAllocationProp
    assert prop.type == cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    assert _location_is_device0(prop.location)
    (gprop, option), = rec.args("cuMemGetAllocationGranularity")
    assert type(gprop) is cu.CUmemAllocationProp
    assert type(option) is cu.CUmemAllocationGranularity_flags
    assert option == cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    d.release(h)
    (released,), = rec.args("cuMemRelease")
    assert int(released) == h


def test_map_and_reserve_pass_arguments_in_driver_order(recorded):
    d, rec = recorded
    h = d.create(4 * G)
    va = d.reserve(8 * G, 4 * G)
    # A non-zero offset tells offset from flags in the recorded call; CUDA refuses it, as the device does.
    expect_error(d, d.map, va + G, 2 * G, h, 2 * G, call="cuMemMap")
    d.map(va + G, 4 * G, h)
    (rsize, align, hint, rflags), = rec.args("cuMemAddressReserve")
    assert (rsize, align, int(hint), rflags) == (8 * G, 4 * G, 0, 0)
    refused, mapped = rec.args("cuMemMap")
    (ptr, size, offset, handle, flags) = refused
    assert (int(ptr), size, offset, int(handle), flags) == (va + G, 2 * G, 2 * G, h, 0)
    (ptr, size, offset, handle, flags) = mapped
    assert (int(ptr), size, offset, int(handle), flags) == (va + G, 4 * G, 0, h, 0)
    d.unmap(va + G, 4 * G)
    assert [tuple(map(int, a)) for a in rec.args("cuMemUnmap")] == [(va + G, 4 * G)]
    d.free_address(va, 8 * G)
    assert [tuple(map(int, a)) for a in rec.args("cuMemAddressFree")] == [(va, 8 * G)]


def test_set_access_is_one_call_per_range_with_one_readwrite_descriptor(recorded):
    d, rec = recorded
    va = d.reserve(4 * G)
    for i in range(4):
        d.map(va + i * G, G, d.create(G))
    d.set_access(va, 4 * G)
    calls = rec.args("cuMemSetAccess")
    assert len(calls) == 1
    ptr, size, descs, count = calls[0]
    assert (int(ptr), size, count) == (va, 4 * G, 1)
    assert isinstance(descs, list) and len(descs) == 1
    desc = descs[0]
    assert type(desc) is cu.CUmemAccessDesc
    assert desc.flags == cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    assert _location_is_device0(desc.location)


def test_copy_memset_and_capture_pass_cuda_streams(recorded):
    d, rec = recorded
    _, va = mapped_rw(d, 2 * G)
    d.copy(va + G, va, 16, stream=0)
    d.memset(va, 0x1AB, 16, stream=0)
    d.is_capturing(0)
    (dst, src, n, stream), = rec.args("cuMemcpyDtoDAsync")
    assert (int(dst), int(src), n) == (va + G, va, 16) and type(stream) is cu.CUstream
    (ptr, value, n, stream), = rec.args("cuMemsetD8Async")
    assert (int(ptr), value, n) == (va, 0xAB, 16) and type(stream) is cu.CUstream
    (stream,), = rec.args("cuStreamIsCapturing")
    assert type(stream) is cu.CUstream and int(stream) == 0


def test_emulator_refuses_plain_python_stand_ins_for_structs(drv):
    api = drv.api
    with pytest.raises(TypeError, match="CUmemAllocationProp"):
        api.cuMemCreate(G, object(), 0)
    with pytest.raises(TypeError, match="'option' must not be None"):  # the binding takes an int, not None
        api.cuMemGetAllocationGranularity(drv._prop, None)
    assert api.cuMemGetAllocationGranularity(drv._prop, 0) == (R.CUDA_SUCCESS, G)  # as the binding does
    with pytest.raises(TypeError, match="CUmemAccessDesc"):
        api.cuMemSetAccess(0, G, [object()], 1)
    assert state(drv)["handles"] == 0


# ---------------------------------------------------------------- device selection

def test_open_emulated_needs_no_libcuda():
    d = open_driver("emulated")
    assert d.kind == "emulated" and d is open_driver("emulated")
    assert open_driver(d) is d
    mine = new_driver()
    assert open_driver(mine) is mine
    mine.api.close()


def test_open_none_falls_back_to_emulated_without_a_driver(monkeypatch):
    monkeypatch.setattr(driver_mod, "cuda_driver_usable", lambda: (False, "no driver (test)"))
    d = open_driver(None)
    assert d.kind == "emulated" and d is open_driver("emulated")


def test_open_none_and_cuda_specs_pick_the_gpu_when_one_works(monkeypatch):
    picked = []
    sentinel = new_driver()
    monkeypatch.setattr(driver_mod, "cuda_driver_usable", lambda: (True, "1 CUDA device(s)"))
    monkeypatch.setattr(driver_mod, "_cuda_driver", lambda i: picked.append(i) or sentinel)
    assert open_driver(None) is sentinel
    assert open_driver("cuda") is sentinel
    assert open_driver("cuda:2") is sentinel
    assert open_driver(torch.device("cuda", 1)) is sentinel
    assert picked == [0, 0, 2, 1]
    assert open_driver("emulated") is not sentinel
    sentinel.api.close()


def test_cuda_without_a_driver_raises_device_unavailable(monkeypatch):
    monkeypatch.setattr(driver_mod, "cuda_driver_usable", lambda: (False, "no driver (test)"))
    monkeypatch.setattr(driver_mod, "_cuda_drivers", {})
    for spec in ("cuda", "cuda:0", "cuda:3", torch.device("cuda", 1)):
        with pytest.raises(DeviceUnavailableError) as info:
            open_driver(spec)
        msg = str(info.value)
        assert "no driver (test)" in msg and "emulated" in msg
        assert isinstance(info.value, RuntimeError)
    with pytest.raises(DeviceUnavailableError, match="'cuda:3'"):
        open_driver("cuda:3")


@pytest.mark.skipif(driver_mod.cuda_driver_usable()[0], reason="this machine has a working CUDA driver")
def test_this_machine_has_no_gpu_so_cuda_is_unavailable_and_none_is_emulated():
    usable, reason = driver_mod.cuda_driver_usable()
    assert not usable and reason
    with pytest.raises(DeviceUnavailableError, match=r"cuda:0.*device='emulated'"):
        open_driver("cuda:0")
    assert open_driver(None).kind == "emulated"


@pytest.mark.parametrize("spec", ["tpu", "cuda:x", "cuda:-1", "cuda:0:1", "cpu", "CUDA", "", 0,
                                  torch.device("cpu")])
def test_bad_device_specs_raise_value_error(spec):
    with pytest.raises(ValueError, match="device"):
        open_driver(spec)


def test_is_capturing_follows_the_emulated_flag(drv):
    assert drv.is_capturing() is False
    drv.api.capturing = True
    assert drv.is_capturing() is True
    assert drv.is_capturing(stream=7) is True
    drv.api.capturing = False
    assert drv.is_capturing() is False


# ---------------------------------------------------------------- kernels: modules, launches, tables, events
# The emulated device runs a kernel by calling its registered host twin with the launch's parameters.
from defrag.driver import host_kernels  # noqa: E402

COPY_TWIN = "test_copy_twin"  # params: (dst, src, nbytes), all 8 bytes


def _copy_twin(memory, params) -> bool:
    dst, src, n = params
    if not (memory.accessible(src, n, False) and memory.accessible(dst, n, True)):
        return False
    memory.copy(dst, src, n)
    return True


host_kernels.register(host_kernels.HostKernel(COPY_TWIN, _copy_twin, params=3, registers=56))


class Params:
    """An array of pointers to 8-byte values, as cuLaunchKernel takes it."""

    def __init__(self, *values):
        self.values = (ctypes.c_uint64 * len(values))(*values)
        base = ctypes.addressof(self.values)
        self.pointers = (ctypes.c_void_p * len(values))(*(base + 8 * i for i in range(len(values))))
        self.address = ctypes.addressof(self.pointers)


def _loaded(d: Driver):
    module = d.load_module(host_kernels.module_image(COPY_TWIN))
    return module, d.get_function(module, COPY_TWIN)


def _exercise_kernels(d: Driver) -> None:
    _, va = mapped_rw(d, 2 * G)
    module, fn = _loaded(d)
    d.function_registers(fn)
    d.occupancy(fn, 256)
    d.multiprocessors()
    d.compute_capability()
    table = d.alloc(4096)
    staging = d.alloc_host(4096)
    event = d.create_event()
    d.copy_from_host_async(table, staging, 4096, stream=0)
    d.copy_to_host_async(staging, va, 4096, stream=0)
    p = Params(va + G, va, 4096)
    d.launch(fn, 2, 256, p.address, stream=0)
    d.record_event(event, stream=0)
    d.wait_event(event)
    d.synchronize_stream(0)
    d.destroy_event(event)
    d.free(table)
    d.free_host(staging)
    d.unload_module(module)


def test_kernel_calls_match_the_cuda_python_signature(recorded):
    d, rec = recorded
    _exercise_kernels(d)
    names = {n for n, _ in rec.log}
    assert {"cuModuleLoadData", "cuModuleGetFunction", "cuFuncGetAttribute", "cuLaunchKernel",
            "cuOccupancyMaxActiveBlocksPerMultiprocessor", "cuMemAlloc", "cuMemFree", "cuMemcpyHtoDAsync",
            "cuMemcpyDtoHAsync", "cuEventCreate", "cuEventRecord", "cuEventSynchronize", "cuEventDestroy",
            "cuStreamSynchronize", "cuModuleUnload"} <= names
    for name, args in rec.log:
        sig = inspect.signature(getattr(cu, name))
        sig.bind(*args)
        for param, value in zip(sig.parameters.values(), args):
            if isinstance(param.annotation, str):
                types = {getattr(cu, t) for t in re.findall(r"CU\w+", param.annotation)}
                items = value if isinstance(value, (list, tuple)) else [value]
                assert items and all(type(v) in types for v in items), (name, param.name, value)
    (f, gx, gy, gz, bx, by, bz, shared, stream, params, extra), = rec.args("cuLaunchKernel")
    assert type(f) is cu.CUfunction and type(stream) is cu.CUstream and type(extra) is int and extra == 0
    assert (gx, gy, gz, bx, by, bz, shared) == (2, 1, 1, 256, 1, 1, 0) and isinstance(params, int)
    (attrib, _), = rec.args("cuFuncGetAttribute")
    assert attrib == cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS
    (flags,), = rec.args("cuEventCreate")
    assert flags == int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
    (_, name), = rec.args("cuModuleGetFunction")
    assert name == COPY_TWIN.encode()


def test_a_launch_runs_its_host_twin_with_the_packed_parameters(drv):
    _, va = mapped_rw(drv, 2 * G)
    data = pattern(G, seed=3)
    write(va, data)
    module, fn = _loaded(drv)
    p = Params(va + G, va, G)
    drv.launch(fn, 1, 32, p.address)
    assert read(va + G, G) == data
    assert drv.function_registers(fn) == 56 and drv.multiprocessors() == 132 and drv.compute_capability() == (9, 0)
    bad = Params(va + 2 * G, va, G)  # past the mapping: the twin refuses, as an illegal address
    expect_error(drv, drv.launch, fn, 1, 32, bad.address, call="cuLaunchKernel",
                 name="CUDA_ERROR_ILLEGAL_ADDRESS")
    drv.unload_module(module)


def test_occupancy_follows_an_sm90_register_file():
    # 55-56 registers at 256 threads: 4 blocks (the move kernel on an H200); fewer registers, more blocks.
    assert host_kernels.occupancy(56, 256) == 4
    assert host_kernels.occupancy(55, 256) == 4
    assert host_kernels.occupancy(32, 256) == 8  # the thread limit: 2048 / 256
    assert host_kernels.occupancy(16, 64) == 32  # the block limit
    assert host_kernels.occupancy(255, 1024) == 0  # more registers than an SM has
    assert host_kernels.occupancy(32, 1025) == 0 and host_kernels.occupancy(32, 0) == 0


def test_module_and_function_errors_are_the_drivers(drv):
    expect_error(drv, drv.load_module, b"\x7fELF not a host module", call="cuModuleLoadData",
                 name="CUDA_ERROR_INVALID_IMAGE")
    expect_error(drv, drv.load_module, host_kernels.module_image("no_such_twin"), call="cuModuleLoadData",
                 name="CUDA_ERROR_INVALID_IMAGE")
    module, fn = _loaded(drv)
    expect_error(drv, drv.get_function, module, "other", call="cuModuleGetFunction", name="CUDA_ERROR_NOT_FOUND")
    p = Params(0, 0, 0)
    expect_error(drv, drv.launch, fn, 0, 32, p.address, call="cuLaunchKernel")  # an empty grid
    expect_error(drv, drv.launch, fn, 1, 2048, p.address, call="cuLaunchKernel")  # too many threads
    drv.unload_module(module)
    expect_error(drv, drv.launch, fn, 1, 32, p.address, call="cuLaunchKernel", name="CUDA_ERROR_INVALID_HANDLE")
    expect_error(drv, drv.occupancy, fn, 256, call="cuOccupancyMaxActiveBlocksPerMultiprocessor",
                 name="CUDA_ERROR_INVALID_HANDLE")
    assert drv.api.kernel_state()["modules"] == 0


def test_async_work_runs_launches_and_table_copies_in_stream_order():
    """Under `async_work` a table copied from pinned staging is read when the copy runs (a DMA), and the
    launch after it on the same stream sees it; an event completes only when the stream reaches it."""
    api = EmulatedCuda(capacity=CAP, granularity=G)
    d = new_driver(api=api)
    _, va = mapped_rw(d, 2 * G)
    write(va, pattern(G, 5))
    _, fn = _loaded(d)
    staging = d.alloc_host(64)
    table = d.alloc(64)
    event = d.create_event()
    api.async_work = True
    ctypes.memmove(staging, b"A" * 64, 64)
    d.copy_from_host_async(table, staging, 64, stream=7)
    ctypes.memmove(staging, b"B" * 64, 64)  # before the copy ran: the copy reads this
    p = Params(va + G, va, G)
    d.launch(fn, 1, 32, p.address, stream=7)
    d.record_event(event, stream=7)
    assert api.cuEventQuery(event) == (R.CUDA_ERROR_NOT_READY,)
    assert read(va + G, 16) != pattern(G, 5)[:16]  # queued, not run
    d.wait_event(event)
    assert api.cuEventQuery(event) == (R.CUDA_SUCCESS,)
    assert read(table, 64) == b"B" * 64 and read(va + G, G) == pattern(G, 5)
    assert api.late_faults == 0
    api.close()
    d.close()


def test_linear_memory_events_and_modules_leak_nothing_and_close_frees_them():
    api = EmulatedCuda(capacity=CAP, granularity=G)
    d = new_driver(api=api)
    _loaded(d)
    ptr = d.alloc(3 * 4096)
    d.create_event()
    assert api.kernel_state() == {"linear_buffers": 1, "linear_bytes": 3 * 4096, "modules": 1, "events": 1}
    assert state(d)["used_bytes"] == 0  # outside the VMM capacity
    write(ptr, b"x" * 16)
    d.free(ptr)
    expect_error(d, d.free, ptr, call="cuMemFree")
    api.close()
    assert api.kernel_state() == {"linear_buffers": 0, "linear_bytes": 0, "modules": 0, "events": 0}
    d.close()


@pytest.mark.parametrize("call, run", [
    ("cuModuleLoadData", lambda d: d.load_module(host_kernels.module_image(COPY_TWIN))),
    ("cuMemAlloc", lambda d: d.alloc(4096)),
    ("cuEventCreate", lambda d: d.create_event()),
])
def test_faults_on_kernel_calls_with_outputs_raise_cuda_error(drv, call, run):
    drv.faults.inject(call, R.CUDA_ERROR_LAUNCH_FAILED)
    expect_error(drv, run, drv, call=call, name="CUDA_ERROR_LAUNCH_FAILED")
    assert drv.api.kernel_state() == {"linear_buffers": 0, "linear_bytes": 0, "modules": 0, "events": 0}
    run(drv)  # the next call succeeds


def test_the_memoryless_device_checks_launches_and_runs_nothing():
    d = Driver.memoryless(capacity=CAP, granularity=G)
    h = d.create(2 * G)
    va = d.reserve(2 * G)
    d.map(va, 2 * G, h)
    d.set_access(va, 2 * G)
    module, fn = _loaded(d)
    assert d.occupancy(fn, 256) == 4
    table = d.alloc(4096)
    staging = d.alloc_host(4096)
    d.copy_from_host_async(table, staging, 4096)
    p = Params(va + G, va, G)
    d.launch(fn, 1, 32, p.address)  # no bytes behind the addresses: checked, nothing run
    expect_error(d, d.copy_from_host_async, table, staging, 8192, call="cuMemcpyHtoDAsync")
    expect_error(d, d.load_module, b"cubin", call="cuModuleLoadData", name="CUDA_ERROR_INVALID_IMAGE")
    d.free(table)
    d.free_host(staging)
    d.unload_module(module)
    assert d.api.kernel_state() == {"linear_buffers": 0, "linear_bytes": 0, "modules": 0, "events": 0}
    d.api.close()
    d.close()
