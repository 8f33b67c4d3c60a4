"""What a first GPU run and a new user's first hour would have hit, each modelled on the emulated device.

The emulated driver models what these need: a current context per thread
(and a synchronize that waits only for the current context's device), work
queued on the device until a synchronize (`async_work`), and a write still in
flight on a side stream (`defer_write`).
"""

from __future__ import annotations

import ctypes
import threading

import pytest
import torch
from cuda.bindings import driver as cu

import defrag
from defrag import fastpath
from defrag.driver import Driver, EmulatedCuda
from defrag.driver import cuda as cuda_driver
from defrag.errors import CudaError, StaleAccessError

from ..forked import run_python
from .conftest import check_pattern, fill_pattern

KiB, MiB = 1 << 10, 1 << 20
G = 64 * KiB
R = cu.CUresult


# ---------------------------------------------------------------------- torch's CUDA allocator stays untouched

def test_making_a_cuda_pool_never_initializes_torchs_cuda_allocator(monkeypatch):
    """`defrag.install` must still be able to replace torch's CUDA allocator after a pool exists:
    torch refuses once `_lazy_init` ran, and its stream queries run it."""
    calls = []
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda *a, **k: calls.append("_lazy_init"))
    fastpath.wait()
    drv = Driver(EmulatedCuda(capacity=64 * MiB, granularity=G), 0, kind="cuda")
    pool = defrag.Pool(device=drv, capacity="4MiB")
    try:
        assert pool._context.current_stream() == 0
        pool.stats(), pool.summary()
        assert calls == []
        if fastpath.status() == "ready":
            assert pool.core.fast is not None, "the fast path must attach without asking torch for a stream"
    finally:
        pool.close()
    assert calls == []


# ---------------------------------------------------------------------- contexts

def _thread(fn):
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # reported to the test below
            box["error"] = exc
    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box.get("value")


def test_a_thread_without_a_current_context_can_map_unmap_and_query_capture():
    drv = Driver.emulated(capacity=16 * MiB, granularity=G)
    va = drv.reserve(2 * G)
    h = drv.create(G)

    def work():
        assert not drv.is_capturing(0)
        drv.map(va, G, h)
        drv.set_access(va, G)
        drv.unmap(va, G)
        drv.synchronize()
    _thread(work)
    drv.release(h)
    drv.free_address(va, 2 * G)
    assert drv.api.state() == {"handles": 0, "mappings": 0, "reservations": 0, "used_bytes": 0}


def test_the_emulated_driver_refuses_a_thread_without_a_context_as_cuda_does():
    api = EmulatedCuda(capacity=16 * MiB, granularity=G)
    Driver(api, 0, kind="emulated")
    assert _thread(lambda: api.cuStreamIsCapturing(cu.CUstream(0))[0]) == R.CUDA_ERROR_INVALID_CONTEXT
    assert _thread(lambda: api.cuCtxSynchronize()[0]) == R.CUDA_ERROR_INVALID_CONTEXT
    assert _thread(lambda: api.cuMemUnmap(0, G)[0]) == R.CUDA_ERROR_INVALID_CONTEXT


def test_an_automatic_compaction_from_a_fresh_thread_succeeds(make_pool):
    pool = make_pool("1MiB", granularity=G)

    def fragment():  # on a thread that then ends, so that its tensors may move (the thread contract)
        ts = [pool.empty((16 * KiB,), dtype=torch.uint8) for _ in range(64)]
        for i, t in enumerate(ts):
            fill_pattern(t, i)
        return {i: ts[i] for i in range(0, 64, 2)}
    keep = _thread(fragment)
    # Half of every page is free: 512 KiB free in all, no free page. A new thread (no current
    # context) asks for 256 KiB: the rescue compacts (maps, unmaps) from that thread.
    big = _thread(lambda: pool.empty((256 * KiB,), dtype=torch.uint8))
    assert big.numel() == 256 * KiB
    assert pool.stats()["num_compactions.automatic"] >= 1
    assert all(check_pattern(t, i) for i, t in keep.items())


def test_synchronize_waits_for_its_own_device_after_another_device_was_made_current():
    """torch.cuda.set_device(1) makes device 1's context current behind the pool's back; a
    synchronize before an unmap must still wait for device 0's work."""
    api = EmulatedCuda(capacity=16 * MiB, granularity=G, device_count=2)
    d0, d1 = Driver(api, 0, kind="emulated"), Driver(api, 1, kind="emulated")
    va = d0.reserve(G)
    h = d0.create(G)
    d0.map(va, G, h)
    d0.set_access(va, G)
    d0.synchronize()
    api.defer_write(va, b"\x5a" * 64, device=0)  # a kernel on device 0 still writing
    d1.make_current()  # what torch.cuda.set_device(1) does
    d0.synchronize()
    assert api.queued() == 0, "the synchronize waited for device 1, not for the device it was asked for"
    assert ctypes.string_at(va, 64) == b"\x5a" * 64
    d0.unmap(va, G)
    d0.release(h)
    d0.free_address(va, G)


# ---------------------------------------------------------------------- offload / reload synchronize

def _offload_pool(make_pool):
    pool = make_pool("2MiB", auto_compact=False)
    ts = [pool.empty((n,), dtype=torch.uint8) for n in (40_000, 3 * G, 9000)]
    for i, t in enumerate(ts):
        fill_pattern(t, i)
    return pool, ts


def test_offload_keeps_a_write_still_in_flight_on_a_side_stream(make_pool):
    pool, ts = _offload_pool(make_pool)
    late = bytes(range(200))
    pool.driver.api.defer_write(ts[1].data_ptr() + 1000, late)
    pool.offload([ts[1]])
    got = bytes(ts[1][1000:1200].tolist())
    assert got == late, "the side stream's write landed in the device page after offload copied it, and was lost"
    pool.reload()
    assert bytes(ts[1][1000:1200].tolist()) == late
    assert check_pattern(ts[0], 0) and check_pattern(ts[2], 2)


def test_reload_keeps_a_write_still_in_flight_on_a_side_stream(make_pool):
    pool, ts = _offload_pool(make_pool)
    pool.offload([ts[1]])
    late = bytes(range(100, 250))
    pool.driver.api.defer_write(ts[1].data_ptr() + 4096, late)
    pool.reload()
    assert bytes(ts[1][4096:4096 + len(late)].tolist()) == late


def test_an_offload_that_fails_mid_copy_waits_for_its_copies_before_unmapping_the_scratch(make_pool):
    pool, ts = _offload_pool(make_pool)
    api = pool.driver.api
    api.async_work = True  # copies run at the next synchronize, as on a GPU
    pool.driver.faults.inject("cuMemcpyDtoDAsync", nth=2)  # the first page's copy is queued, the second fails
    with pytest.raises(CudaError):
        pool.offload([ts[1]])
    pool.driver.synchronize()  # a copy left running into the unmapped scratch range: an illegal address
    assert api.late_faults == 0
    api.async_work = False
    assert all(check_pattern(t, i) for i, t in enumerate(ts))
    pool.offload([ts[1]])
    pool.reload()
    assert all(check_pattern(t, i) for i, t in enumerate(ts))


# ---------------------------------------------------------------------- host-located pages probe

def test_host_pages_work_where_the_driver_does_not_know_the_host_numa_attributes():
    drv = Driver(EmulatedCuda(capacity=16 * MiB, granularity=G, host_numa_attributes=False), 0, kind="emulated")
    supported, reason = drv.host_pages_supported()
    assert supported, reason
    h = drv.create(G, host=True)
    drv.release(h)


def test_host_pages_work_with_a_binding_that_lacks_the_host_numa_attributes(monkeypatch):
    monkeypatch.setattr(cuda_driver, "HOST_NUMA_VMM_ATTRIBUTE", None)
    monkeypatch.setattr(cuda_driver, "HOST_NUMA_ID_ATTRIBUTE", None)
    drv = Driver.emulated(capacity=16 * MiB, granularity=G)
    assert drv.host_pages_supported() == (True, f"host NUMA node 0, granularity {G} bytes")
    assert "cuDeviceGetAttribute" not in drv.faults.calls


def test_a_transient_trial_failure_answers_no_for_now_and_is_asked_again():
    drv = Driver.emulated(capacity=16 * MiB, granularity=G)
    drv.faults.inject("cuMemCreate", R.CUDA_ERROR_UNKNOWN)
    supported, reason = drv.host_pages_supported()
    assert not supported and "CUDA_ERROR_UNKNOWN" in reason
    assert drv.host_pages_supported()[0], "a transient failure must not be cached as 'unsupported'"


def test_a_refused_trial_is_a_cached_no():
    drv = Driver.emulated(capacity=16 * MiB, granularity=G)
    drv.faults.inject("cuMemCreate", R.CUDA_ERROR_NOT_SUPPORTED)
    assert not drv.host_pages_supported()[0]
    assert not drv.host_pages_supported()[0]


# ---------------------------------------------------------------------- a new user's first hour

def _defrag(*argv, **env):
    """`python -m defrag argv...` with `env` set, forked from the test zygote (tests/forked.py). The variables
    are set before defrag's command line starts: defrag reads DEFRAG_* when it uses them (settings.py), not
    at import."""
    code = (f"import os, runpy\nos.environ.update({env!r})\n"
            "runpy.run_module('defrag', run_name='__main__', alter_sys=True)\n")
    return run_python(code, *argv, timeout=300)


@pytest.mark.parametrize("name,value,accepts", [
    ("DEFRAG_EMULATED_CAPACITY", "lots", "is not a size"),
    ("DEFRAG_EMULATED_CAPACITY", "-1GiB", "is not a size"),
    ("DEFRAG_EMULATED_GRANULARITY", "3MiB", "power of two"),
    ("DEFRAG_EMULATED_GRANULARITY", "1KiB", "power of two"),
])
def test_a_bad_environment_variable_is_one_line_and_exit_2(name, value, accepts):
    proc = _defrag("doctor", **{name: value})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert name in lines[0] and repr(value) in lines[0] and accepts in lines[0]


def test_a_negative_capacity_after_a_space_names_the_value():
    proc = _defrag("demo", "--capacity", "-1GiB", "--device", "emulated")
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "'-1GiB'" in proc.stderr and "expected one argument" not in proc.stderr


def test_a_pool_larger_than_the_device_can_address_names_the_capacity():
    drv = Driver.emulated(capacity=16 * MiB, granularity=G)
    with pytest.raises(ValueError, match=r"capacity 100\.00 TiB .*virtual address space.*16\.00 MiB"):
        defrag.Pool(device=drv, capacity="100TiB")
    assert drv.api.state()["reservations"] == 0


@pytest.mark.parametrize("kwargs", [{"release": "yes"}, {"verify": 1}, {"progress": "no"}])
def test_compact_refuses_options_that_are_not_booleans(make_pool, kwargs):
    pool = make_pool("1MiB")
    ts = [pool.empty((8 * KiB,), dtype=torch.uint8) for _ in range(8)]
    for i, t in enumerate(ts):
        fill_pattern(t, i)
    keep = ts[::2]
    del ts
    before = [t.data_ptr() for t in keep]
    with pytest.raises(TypeError, match=next(iter(kwargs))):
        pool.compact(**kwargs)
    assert [t.data_ptr() for t in keep] == before
    assert pool.stats()["num_compactions.explicit"] == 0


def test_touching_a_sleeping_pools_tensor_is_reported_at_wake_naming_the_sleep(make_pool):
    pool = make_pool("1MiB")
    t = pool.empty((4096,), dtype=torch.uint8)
    fill_pattern(t, 7)
    pool.sleep()
    assert int(t.sum()) == 0  # the read sees unmapped memory (zeros): nothing can stop a CPU read
    with pytest.raises(StaleAccessError, match="while the pool was asleep"):
        pool.wake()
    assert pool.asleep, "the failed wake changed nothing"
    pool.wake()
    assert check_pattern(t, 7)
    pool.empty((100,))  # reported once: the next calls are quiet


def test_touching_a_sleeping_pools_tensor_is_reported_by_the_next_call_that_is_not_wake(make_pool):
    pool = make_pool("1MiB")
    t = pool.empty((4096,), dtype=torch.uint8)
    pool.sleep()
    t.fill_(1)
    with pytest.raises(StaleAccessError, match="while the pool was asleep"):
        pool.empty((100,))
    pool.wake()
