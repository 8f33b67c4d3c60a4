"""The memory-less driver: the emulated driver's rules, errors and accounting, without bytes.

Rule tests run on both devices (`kind` parameter) and must give the same
answers; a seeded differential run drives both with the same random calls and
compares every result and every state count. Memory-less-only tests show that
nothing is held behind the addresses: no memfd, no host mapping, no RSS
growth for terabytes mapped, and copies over addresses that do not exist on
the host succeed without touching them.
"""
from __future__ import annotations

import mmap
import random
import time

import pytest
from cuda.bindings import driver as cu

import defrag.driver as driver_mod
from defrag.driver import Driver, EmulatedCuda, MemorylessCuda, open_driver
from defrag.driver.memoryless import VA_LIMIT, VA_START
from defrag.errors import CudaError, CudaOutOfMemoryError

from .test_driver import CAP, G, _exercise, expect_error, memfd_count, memfd_map_count

R = cu.CUresult
KINDS = ("emulated", "memoryless")
TiB = 1 << 40


def make(kind: str, capacity: int = CAP, granularity: int = G) -> Driver:
    return getattr(Driver, kind)(capacity=capacity, granularity=granularity)


@pytest.fixture(params=KINDS)
def drv(request):
    d = make(request.param)
    yield d
    d.api.close()
    d.close()


@pytest.fixture
def mless():
    d = make("memoryless")
    yield d
    d.api.close()
    d.close()


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


def host_maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


# ---------------------------------------------------------------- construction

def test_memoryless_driver_reports_its_device(mless):
    assert mless.kind == "memoryless" and mless.ordinal == 0
    assert isinstance(mless.api, MemorylessCuda) and isinstance(mless.api, EmulatedCuda)
    assert mless.granularity == G
    assert mless.total_memory == CAP
    assert mless.mem_info() == (CAP, CAP)
    assert mless.name == "defrag memoryless device"
    assert repr(mless) == "Driver(kind='memoryless', ordinal=0, name='defrag memoryless device', granularity=65536)"
    assert mless.touched_unmapped() == 0
    mless.synchronize()
    assert mless.is_capturing() is False


def test_memoryless_defaults_and_validation():
    d = Driver.memoryless()
    assert d.granularity == 2 << 20 and d.total_memory == 16 << 30
    d.close()
    with pytest.raises(ValueError, match="granularity"):
        MemorylessCuda(capacity=CAP, granularity=G + 1)
    with pytest.raises(ValueError, match="capacity"):
        MemorylessCuda(capacity=-1, granularity=G)
    api = MemorylessCuda(capacity=CAP, granularity=G)
    assert Driver(api, 0, kind="memoryless").kind == "memoryless"
    assert Driver.memoryless(api=api).api is api
    with pytest.raises(ValueError, match="kind must be one of 'cuda', 'emulated', 'memoryless'"):
        Driver(api, 0, kind="dry")


def test_open_memoryless_is_one_device_per_process(monkeypatch):
    monkeypatch.setitem(driver_mod._shared, "memoryless", None)
    monkeypatch.setenv("DEFRAG_MEMORYLESS_CAPACITY", "80GiB")
    monkeypatch.setenv("DEFRAG_MEMORYLESS_GRANULARITY", "4MiB")
    d = open_driver("memoryless")
    try:
        assert d.kind == "memoryless" and d is open_driver("memoryless")
        assert d.total_memory == 80 << 30 and d.granularity == 4 << 20
        assert open_driver("emulated") is not d and open_driver(d) is d
    finally:
        d.api.close()
        d.close()


def test_memoryless_calls_match_the_cuda_python_signatures():
    # test_driver's call-construction tests, on the memory-less device: the same calls succeed.
    d = make("memoryless")
    _exercise(d)
    assert d.api.state() == {"handles": 0, "mappings": 0, "reservations": 0, "used_bytes": 0}
    d.close()


# ---------------------------------------------------------------- the same rules on both devices

# test_driver's own rule tests, collected here again: this module's `drv` runs them on both devices.
from .test_driver import test_create_rejects_bad_sizes, test_reserve_rejects_bad_size_or_alignment  # noqa: E402,F401


def test_reservations_are_aligned_and_disjoint(drv):
    got = []
    for size, align in [(G, 0), (3 * G, 8 * G), (G, 0), (5 * G, 4 * G), (2 * G, 16 * G)]:
        va = drv.reserve(size, align)
        assert va % (align or G) == 0
        got.append((va, va + size))
    got.sort()
    assert all(a_end <= b for (_, a_end), (b, _) in zip(got, got[1:]))


def test_map_rejects_misaligned_outside_and_over_mapped(drv):
    h, h2 = drv.create(2 * G), drv.create(2 * G)
    va = drv.reserve(4 * G)
    for args in [(va + 4096, G, h), (va, G + 4096, h), (va, G, h, 4096), (va, 0, h),      # alignment
                 (va, G, h, G), (va, 2 * G, h, 2 * G),                                   # offset not zero
                 (va, 3 * G, h), (va, 4 * G, h),                                         # beyond the handle
                 (va + 3 * G, 2 * G, h), (va + 4 * G, G, h), (va - G, G, h),             # outside the reservation
                 (va, G, 0xDEAD)]:                                                       # unknown handle
        expect_error(drv, drv.map, *args, call="cuMemMap")
    drv.map(va + G, 2 * G, h)
    for args in [(va + G, 2 * G, h2), (va, 2 * G, h2), (va + 2 * G, 2 * G, h2), (va + 2 * G, G, h2)]:
        expect_error(drv, drv.map, *args, call="cuMemMap")
    h3, h4 = drv.create(G), drv.create(G)
    drv.map(va, G, h3)
    drv.map(va + 3 * G, G, h4)
    assert drv.api.state()["mappings"] == 3


def test_unmap_never_splits_a_mapping(drv):
    h1, h2, h3, h4 = drv.create(2 * G), drv.create(G), drv.create(G), drv.create(G)
    va = drv.reserve(8 * G)
    drv.map(va, 2 * G, h1)
    drv.map(va + 3 * G, G, h2)                 # gap at va+2G
    for args in [(va + 4096, G), (va, 2 * G - 4096), (va, G), (va + G, G), (va, 4 * G),
                 (va + 2 * G, G), (va + 5 * G, G), (va, 0)]:
        expect_error(drv, drv.unmap, *args, call="cuMemUnmap")
    drv.unmap(va, 2 * G)
    expect_error(drv, drv.unmap, va, 2 * G, call="cuMemUnmap")
    drv.map(va, G, h3)
    drv.map(va + G, G, h4)
    drv.map(va + 2 * G, G, h2)                 # h2 again, beside its mapping at va+3G
    drv.unmap(va, 4 * G)                       # several whole mappings in one call
    assert drv.api.state()["mappings"] == 0


def test_access_rules_for_set_access_copy_and_memset(drv):
    h, h2, h3 = drv.create(2 * G), drv.create(G), drv.create(G)
    va = drv.reserve(4 * G)
    drv.map(va, 2 * G, h)
    drv.map(va + 2 * G, G, h2)
    for args in [(va + 4096, G), (va, G + 4096), (va, 4 * G), (va + 3 * G, G), (va, 0)]:
        expect_error(drv, drv.set_access, *args, call="cuMemSetAccess")
    expect_error(drv, drv.memset, va, 0, 8, call="cuMemsetD8Async")        # mapped, no access yet
    drv.set_access(va + G, 2 * G)                                           # part of one mapping + another
    assert drv.api.is_accessible(va + G, 2 * G) and not drv.api.is_accessible(va, G, write=False)
    drv.copy(va + 2 * G, va + G + 1, G - 1)
    drv.memset(va + G, 7, 2 * G)
    expect_error(drv, drv.copy, va, va + G, 8, call="cuMemcpyDtoDAsync")    # dst has no access
    expect_error(drv, drv.copy, va + G, va + 3 * G - 4, 8, call="cuMemcpyDtoDAsync")  # runs off the end
    expect_error(drv, drv.memset, 0x1000, 1, 2, call="cuMemsetD8Async")    # not device memory
    with pytest.raises(OverflowError):  # a negative size_t: refused by the binding, as on a GPU
        drv.copy(va + G, va + G, -1)
    drv.copy(va, 0x1000, 0)                                                 # zero bytes: nothing, no error
    read_only = cu.CUmemAccessDesc()
    read_only.location = drv._location()
    read_only.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ
    assert drv.api.cuMemSetAccess(va + G, G, [read_only], 1) == (R.CUDA_SUCCESS,)
    drv.copy(va + 2 * G, va + G, G)                                         # reads are allowed
    expect_error(drv, drv.memset, va + G, 0, 8, call="cuMemsetD8Async")    # writes are not
    assert drv.api.cuMemSetAccess(va + G, G, [read_only], 2) == (R.CUDA_ERROR_INVALID_VALUE,)
    drv.unmap(va + 2 * G, G)
    assert not drv.api.is_accessible(va + 2 * G, G, write=False)            # access goes with the mapping
    drv.map(va + 2 * G, G, h3)
    assert not drv.api.is_accessible(va + 2 * G, G, write=False)            # a remap starts with none


def test_release_and_free_address_rules(drv):
    expect_error(drv, drv.release, 0xDEAD, call="cuMemRelease")
    h = drv.create(G)
    drv.release(h)
    expect_error(drv, drv.release, h, call="cuMemRelease")
    va = drv.reserve(4 * G)
    expect_error(drv, drv.map, va, G, h, call="cuMemMap")                  # released handle
    h = drv.create(G)
    drv.map(va + 2 * G, G, h)
    expect_error(drv, drv.free_address, va, 4 * G, call="cuMemAddressFree")    # mapping inside
    drv.unmap(va + 2 * G, G)
    for args in [(va, 2 * G), (va, 8 * G), (va + G, 3 * G)]:
        expect_error(drv, drv.free_address, *args, call="cuMemAddressFree")
    drv.free_address(va, 4 * G)
    expect_error(drv, drv.free_address, va, 4 * G, call="cuMemAddressFree")
    expect_error(drv, drv.map, va, G, h, call="cuMemMap")                  # a freed reservation
    assert drv.api.state() == {"handles": 1, "mappings": 0, "reservations": 0, "used_bytes": G}


@pytest.mark.parametrize("kind", KINDS)
def test_capacity_out_of_memory_until_a_release(kind):
    d = make(kind, capacity=4 * G)
    try:
        handles = [d.create(G) for _ in range(3)]
        expect_error(d, d.create, 2 * G, call="cuMemCreate", name="CUDA_ERROR_OUT_OF_MEMORY",
                     cls=CudaOutOfMemoryError)
        handles.append(d.create(G))
        assert d.mem_info() == (0, 4 * G)
        va = d.reserve(64 * G)                            # address space costs no capacity
        d.map(va, G, handles[0])
        d.release(handles.pop())
        assert d.mem_info() == (G, 4 * G)
        handles.append(d.create(G))
        with pytest.raises(CudaOutOfMemoryError):
            d.create(G)
    finally:
        d.api.close()
        d.close()


@pytest.mark.parametrize("kind", KINDS)
def test_release_while_mapped_frees_capacity_at_last_unmap(kind):
    d = make(kind, capacity=2 * G)
    try:
        h = d.create(2 * G)
        va1, va2 = d.reserve(2 * G), d.reserve(2 * G)
        d.map(va1, 2 * G, h)
        d.map(va2, 2 * G, h)                              # aliasing
        d.release(h)
        assert d.mem_info() == (0, 2 * G) and d.api.state()["handles"] == 1
        with pytest.raises(CudaOutOfMemoryError):
            d.create(G)
        d.unmap(va1, 2 * G)
        assert d.mem_info() == (0, 2 * G)
        d.unmap(va2, 2 * G)                               # the last unmap frees it
        assert d.mem_info() == (2 * G, 2 * G)
        assert d.api.state() == {"handles": 0, "mappings": 0, "reservations": 2, "used_bytes": 0}
        d.create(2 * G)
    finally:
        d.api.close()
        d.close()


def test_fault_injection_works_the_same(drv):
    hs = [drv.create(G) for _ in range(3)]
    va = drv.reserve(4 * G)
    drv.faults.inject("cuMemMap", R.CUDA_ERROR_ILLEGAL_STATE, nth=2)
    drv.map(va, G, hs[0])
    before = drv.api.calls["cuMemMap"]
    expect_error(drv, drv.map, va + G, G, hs[1], call="cuMemMap", name="CUDA_ERROR_ILLEGAL_STATE")
    assert drv.api.calls["cuMemMap"] == before           # the device was never called
    drv.map(va + G, G, hs[1])                            # nothing was mapped: the range is free
    drv.faults.inject("cuMemCreate", R.CUDA_ERROR_OUT_OF_MEMORY, repeat=True)
    for _ in range(2):
        expect_error(drv, drv.create, G, call="cuMemCreate", name="CUDA_ERROR_OUT_OF_MEMORY",
                     cls=CudaOutOfMemoryError)
    drv.faults.clear()
    drv.faults.inject("cuCtxSynchronize", R.CUDA_ERROR_LAUNCH_FAILED)
    expect_error(drv, drv.synchronize, call="cuCtxSynchronize", name="CUDA_ERROR_LAUNCH_FAILED")
    drv.synchronize()
    drv.create(G)
    assert drv.faults.injected == [("cuMemMap", "CUDA_ERROR_ILLEGAL_STATE"),
                                   ("cuMemCreate", "CUDA_ERROR_OUT_OF_MEMORY"),
                                   ("cuMemCreate", "CUDA_ERROR_OUT_OF_MEMORY"),
                                   ("cuCtxSynchronize", "CUDA_ERROR_LAUNCH_FAILED")]
    assert drv.mem_info() == (CAP - 4 * G, CAP)


@pytest.mark.parametrize("kind", KINDS)
def test_leak_counts_after_teardown_and_close(kind):
    d = make(kind)
    h1 = d.create(2 * G)
    va1 = d.reserve(2 * G)
    d.map(va1, 2 * G, h1)
    d.set_access(va1, 2 * G)
    va2 = d.reserve(4 * G)
    d.map(va2, 2 * G, h1)
    d.release(h1)                                          # released but mapped twice
    d.create(3 * G)                                        # never mapped
    assert d.api.state() == {"handles": 2, "mappings": 2, "reservations": 2, "used_bytes": 5 * G}
    d.unmap(va1, 2 * G)
    assert d.api.state() == {"handles": 2, "mappings": 1, "reservations": 2, "used_bytes": 5 * G}
    d.api.close()                                          # tears down what is still held
    assert d.api.state() == {"handles": 0, "mappings": 0, "reservations": 0, "used_bytes": 0}
    assert d.mem_info() == (CAP, CAP)
    d.api.close()                                          # idempotent
    d.close()


# ---------------------------------------------------------------- differential: same calls, same answers

def _outcome(fn, *args):
    try:
        out = fn(*args)
    except CudaError as err:
        return err.name, None
    return "ok", out


@pytest.mark.parametrize("seed", range(4))
def test_random_calls_give_the_same_results_on_both_devices(seed):
    """Drive both devices with one seeded sequence of valid and invalid calls: every
    outcome, every handle number, every state count and every access bit must agree
    (addresses are compared relative to their reservations)."""
    rng = random.Random(seed)
    emu, dry = make("emulated", capacity=12 * G), make("memoryless", capacity=12 * G)
    # (emulated base, memory-less base, size) of live reservations. Freed ones are dropped: the
    # host may hand a freed range to the next emulated reservation, the counter never does.
    res = []
    handles = {}   # live handle -> size
    released = []
    mapped = []    # (reservation index, offset, size) of the mappings made, to aim unmaps and copies at
    read_only = cu.CUmemAccessDesc()
    read_only.location = emu._location()
    read_only.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ

    def addr(i, off):
        """The same place in both devices: reservation i (or a bogus address) plus off."""
        if i is None:
            return 0x1000 + off, 0x1000 + off
        return res[i][0] + off, res[i][1] + off

    def pick_range(aim=True, inside=True):
        """A range in a live reservation (or at a bogus address). Where reservations lie relative
        to each other differs (the host packs emulated ones back to back, the counter leaves a
        gap), so unless `inside` is false a range never leaves its reservation."""
        if aim and mapped and rng.random() < 0.5:
            i, off, n = rng.choice(mapped)
            if rng.random() < 0.3:
                n += rng.choice([G, -G, 4096])        # run into the neighbour or stop short
        else:
            i = rng.randrange(len(res)) if res and rng.random() < 0.95 else None
            size = res[i][2] if i is not None else 4 * G
            off = rng.randrange(0, size // G) * G + (4096 if rng.random() < 0.05 else 0)
            n = rng.choice([0, G, G, 2 * G, 3 * G]) + (4096 if rng.random() < 0.05 else 0)
        if inside and i is not None:
            n = min(n, res[i][2] - off)
        return i, off, n

    counts = {}
    try:
        for _ in range(600):
            op = rng.choice(["create", "create", "release", "reserve", "free", "map", "map", "map",
                             "unmap", "unmap", "access", "access_ro", "copy", "memset"])
            if op == "create":
                size = rng.choice([G, 2 * G, 3 * G, 0, G + 4096])
                a, b = _outcome(emu.create, size), _outcome(dry.create, size)
                if a[0] == "ok":
                    handles[a[1]] = size
            elif op == "release":
                h = rng.choice(list(handles)) if handles and rng.random() < 0.8 else rng.choice(released + [0xDEAD])
                a, b = _outcome(emu.release, h), _outcome(dry.release, h)
                if a[0] == "ok":
                    released.append(h)
                    del handles[h]
            elif op == "reserve":
                size, align = rng.choice([G, 2 * G, 4 * G, 8 * G, G + 4096]), rng.choice([0, 0, G, 4 * G, 3 * G])
                a, b = _outcome(emu.reserve, size, align), _outcome(dry.reserve, size, align)
                if a[0] == "ok":
                    res.append((a[1], b[1], size))
                    assert a[1] % (align or G) == 0 and b[1] % (align or G) == 0
                    a, b = ("ok", None), ("ok", None)
            elif op == "free":
                if not res or rng.random() < 0.5:   # keep a few reservations alive
                    continue
                i = rng.randrange(len(res))
                off, size = rng.choice([(0, res[i][2])] * 4 + [(0, res[i][2] + G), (G, res[i][2] - G)])
                (ea, da) = addr(i, off)
                a, b = _outcome(emu.free_address, ea, size), _outcome(dry.free_address, da, size)
                if a[0] == "ok":
                    res.pop(i)
                    mapped[:] = [(k - (k > i), o, n) for k, o, n in mapped]   # none was inside it
            elif op == "map":
                i, off, n = pick_range(aim=rng.random() < 0.2, inside=False)   # off the end: error on both
                h = rng.choice(list(handles)) if handles and rng.random() < 0.9 else rng.choice(released + [0xDEAD])
                hsize = handles.get(h, G)
                # CUDA maps only from offset 0; a few non-zero offsets check that both refuse them.
                hoff = 0 if rng.random() < 0.8 else rng.randrange(1, hsize // G + 1) * G
                if rng.random() < 0.7:
                    n = min(n, hsize - hoff) if n > 0 else hsize - hoff     # mostly within the handle
                (ea, da) = addr(i, off)
                a, b = _outcome(emu.map, ea, n, h, hoff), _outcome(dry.map, da, n, h, hoff)
                if a[0] == "ok":
                    mapped.append((i, off, n))
            elif op == "unmap":
                i, off, n = pick_range()
                (ea, da) = addr(i, off)
                a, b = _outcome(emu.unmap, ea, n), _outcome(dry.unmap, da, n)
                if a[0] == "ok":
                    mapped[:] = [m for m in mapped if not (m[0] == i and off <= m[1] < off + n)]
            elif op in ("access", "access_ro"):
                i, off, n = pick_range()
                (ea, da) = addr(i, off)
                if op == "access":
                    a, b = _outcome(emu.set_access, ea, n), _outcome(dry.set_access, da, n)
                else:
                    a = (emu.api.cuMemSetAccess(ea, n, [read_only], 1)[0].name, None)
                    b = (dry.api.cuMemSetAccess(da, n, [read_only], 1)[0].name, None)
            else:
                i, off, n = pick_range()
                j, off2, _ = pick_range()
                n = rng.choice([0, 1, 100, G, G + 7, 2 * G])
                (ea, da), (eb, db) = addr(i, off), addr(j, off2)
                if op == "copy":
                    a, b = _outcome(emu.copy, ea, eb, n), _outcome(dry.copy, da, db, n)
                else:
                    a, b = _outcome(emu.memset, ea, 0x5A, n), _outcome(dry.memset, da, 0x5A, n)
            assert a == b, (op, a, b)
            counts[(op, a[0])] = counts.get((op, a[0]), 0) + 1
            assert emu.api.state() == dry.api.state()
            assert emu.mem_info() == dry.mem_info()
        for ea, da, size in res:
            for off in range(0, size, G):
                for write in (False, True):
                    assert emu.api.is_accessible(ea + off, G, write) == dry.api.is_accessible(da + off, G, write)
        # The run exercised both outcomes of the calls that matter.
        for op in ("create", "map", "unmap", "access", "copy"):
            assert counts.get((op, "ok")) and any(k[0] == op and k[1] != "ok" for k in counts), (op, counts)
        assert counts.get(("create", "CUDA_ERROR_OUT_OF_MEMORY"))
        emu.api.close()
        dry.api.close()
        assert emu.api.state() == dry.api.state() == {"handles": 0, "mappings": 0, "reservations": 0,
                                                      "used_bytes": 0}
    finally:
        emu.api.close()
        dry.api.close()
        emu.close()
        dry.close()


# ---------------------------------------------------------------- memory-less only: no bytes

def test_memoryless_opens_no_memfd_and_maps_nothing_on_the_host(mless):
    fds, maps, lines = memfd_count(), memfd_map_count(), host_maps()
    h = mless.create(4 * G)
    va = mless.reserve(8 * G)
    mless.map(va, 4 * G, h)
    mless.set_access(va, 4 * G)
    mless.memset(va, 1, 4 * G)
    mless.unmap(va, 4 * G)
    assert memfd_count() == fds and memfd_map_count() == maps
    assert host_maps() <= lines + 2      # allowance for the interpreter's own allocations
    assert mless.touched_unmapped() == 0


def test_memoryless_addresses_come_from_a_counter_never_reused(mless):
    a = mless.reserve(4 * G)
    b = mless.reserve(G, 16 * G)
    assert VA_START <= a < a + 4 * G <= b and b % (16 * G) == 0
    mless.free_address(a, 4 * G)
    c = mless.reserve(4 * G)
    assert c > b                          # never reused: a stale address can never be valid again
    assert mless.reserve(64 * TiB) > c    # 64 TiB of address space, instantly
    assert mless.api.state()["reservations"] == 3


def test_memoryless_address_space_exhaustion_is_out_of_memory():
    d = make("memoryless", capacity=G, granularity=G)
    try:
        top = d.reserve(G, 1 << 62)
        assert top == 1 << 62 and top + G < VA_LIMIT
        expect_error(d, d.reserve, G, 1 << 62, call="cuMemAddressReserve", name="CUDA_ERROR_OUT_OF_MEMORY",
                     cls=CudaOutOfMemoryError)
        assert d.reserve(G) < VA_LIMIT    # smaller requests still fit below the limit
    finally:
        d.api.close()
        d.close()


def test_memoryless_copies_touch_no_host_memory(mless):
    # The addresses are above every host mapping: a host access there would kill the process.
    h = mless.create(2 * G)
    va = mless.reserve(2 * G)
    assert va >= VA_START
    mless.map(va, 2 * G, h)
    mless.set_access(va, 2 * G)
    mless.copy(va + 1, va, 2 * G - 1)
    mless.memset(va, 0xFF, 2 * G)
    mless.synchronize()
    assert mless.api.calls["cuMemcpyDtoDAsync"] == 1 and mless.api.calls["cuMemsetD8Async"] == 1
    assert mless.touched_unmapped() == 0


def test_memoryless_maps_terabytes_without_host_memory():
    """64 TiB reserved, 1 TiB mapped in 2 GiB handles and 8 GiB in 2 MiB pages: RSS stays flat."""
    page = 2 << 20
    d = make("memoryless", capacity=2 * TiB, granularity=page)
    fds = memfd_count()
    try:
        before = rss()
        va = d.reserve(64 * TiB)
        big = [d.create(2 << 30) for _ in range(512)]
        for i, h in enumerate(big):
            d.map(va + i * (2 << 30), 2 << 30, h)
        d.set_access(va, TiB)                      # one call over 512 mappings
        small_va = va + TiB
        small = [d.create(page) for _ in range(4096)]
        for i, h in enumerate(small):
            d.map(small_va + i * page, page, h)
        d.set_access(small_va, 4096 * page)
        d.copy(small_va, va, 8 << 30)              # an 8 GiB copy: validated, nothing moved
        assert d.mem_info() == (2 * TiB - TiB - (8 << 30), 2 * TiB)
        assert d.api.state()["mappings"] == 512 + 4096
        grown = rss() - before
        assert grown < 64 << 20, f"RSS grew by {grown >> 20} MiB for 1 TiB + 8 GiB mapped"
        assert memfd_count() == fds
        for i in range(4096):
            d.unmap(small_va + i * page, page)
            d.release(small[i])
        d.unmap(va, TiB)                           # 512 whole mappings in one call
        for h in big:
            d.release(h)
        d.free_address(va, 64 * TiB)
        assert d.api.state() == {"handles": 0, "mappings": 0, "reservations": 0, "used_bytes": 0}
    finally:
        d.api.close()
        d.close()


def test_memoryless_map_unmap_cost_is_reported_not_asserted(record_property):
    """10k pages mapped, granted access and unmapped; the time is reported (with -s, and as JUnit
    properties), never asserted, and never printed into a captured run's output."""
    n = 10_000
    d = make("memoryless", capacity=n * G)
    try:
        hs = [d.create(G) for _ in range(n)]
        va = d.reserve(n * G)
        t0 = time.perf_counter()
        for i, h in enumerate(hs):
            d.map(va + i * G, G, h)
        t1 = time.perf_counter()
        d.set_access(va, n * G)
        for i in range(n):
            d.unmap(va + i * G, G)
        t2 = time.perf_counter()
        assert d.api.state()["mappings"] == 0
        record_property("memoryless_map_us_per_call", round(1e6 * (t1 - t0) / n, 2))
        record_property("memoryless_unmap_us_per_call", round(1e6 * (t2 - t1) / n, 2))
        print(f"\nmemoryless: {n} maps {1e6 * (t1 - t0) / n:.1f} us/call, "
              f"{n} unmaps {1e6 * (t2 - t1) / n:.1f} us/call")  # captured: shown with -s
    finally:
        d.api.close()
        d.close()


def test_the_cost_report_stays_out_of_quiet_output(tmp_path):
    """`pytest -q` shows dots, not the map/unmap costs above (those are for -s and the JUnit properties)."""
    from pathlib import Path

    from ..forked import run_module

    node = f"{Path(__file__).resolve()}::test_memoryless_map_unmap_cost_is_reported_not_asserted"
    # `python -m pytest -q ...` in a process of its own, forked from the test zygote (torch imported once)
    proc = run_module("pytest", "-q", "-p", "no:cacheprovider", node, cwd=str(Path(__file__).resolve().parents[2]),
                      timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout
    assert "memoryless:" not in proc.stdout + proc.stderr, proc.stdout
