"""Sleep, wake, offload and reload (issue 15) on the emulated device, which really unmaps and maps.

Every test checks bytes, pointers, views and the pool's invariants, not just
that the calls return; the fault tests fail every driver call each operation
makes, one position at a time, and check that nothing was lost.
"""

from __future__ import annotations

import gc
import inspect
import re

import pytest
import torch

import defrag
from defrag import residency
from defrag.driver import Driver, EmulatedCuda, MemorylessCuda
from defrag.errors import CudaError, CudaOutOfMemoryError, NotSupportedError
from defrag.vmm import ASLEEP, HOST
from cuda.bindings import driver as cu

from .conftest import KiB, MiB, check_pattern, fill_pattern

P = 64 * KiB  # the make_pool fixture's granularity = page size


def _fill(pool, sizes, seed0=0):
    ts = [pool.empty((n,), dtype=torch.uint8) for n in sizes]
    for i, t in enumerate(ts):
        fill_pattern(t, seed0 + i)
    return ts


def _intact(ts, seeds=None):
    return all(check_pattern(t, i if seeds is None else seeds[i]) for i, t in enumerate(ts))


def _host_pages(pool):
    return sum(int((r.backing == HOST).sum()) for r in pool.core.regions)


def _backing_of(pool, t):
    region = pool.core.space.region_of(t.data_ptr())
    return int(region.backing[region.page_of(t.data_ptr())])


SIZES = [3000, 70_000, 512, 20_000, 150_000, 9000, 40_000, 1024, 64 * 1024, 5000]


# ---------------------------------------------------------------------- sleep / wake
def test_neighbouring_tensors_sleep_and_wake_in_one_queued_copy_per_run(make_pool):
    """Blocks next to each other go out and back in one copy per run (a dropped block splits a run),
    all queued on the stream before one synchronize: with the device's work queued (as a GPU runs it),
    every byte is still in place after wake."""
    pool = make_pool("2MiB", auto_compact=False)
    ts = _fill(pool, [4096] * 48)
    ts.sort(key=lambda t: t.data_ptr())
    assert all(a.data_ptr() + 4096 == b.data_ptr() for a, b in zip(ts, ts[1:]))
    gaps = [8, 9, 30]  # dropped: runs 0-7, 10-29, 31-47
    kept = {i: t for i, t in enumerate(ts) if i not in gaps}
    expected = {i: t.clone() for i, t in kept.items()}
    for i in gaps:
        ts[i] = None
    calls, api = pool.driver.faults.calls, pool.driver.api
    out_before, in_before = calls.get("cuMemcpyDtoHAsync", 0), calls.get("cuMemcpyHtoDAsync", 0)
    api.async_work = True
    pool.sleep()
    pool.wake()
    api.async_work = False
    assert calls["cuMemcpyDtoHAsync"] - out_before == 3 and calls["cuMemcpyHtoDAsync"] - in_before == 3
    assert api.queued() == 0 and api.late_faults == 0
    assert all(torch.equal(t, expected[i]) for i, t in kept.items())
    pool.check_invariants()


def test_runs_merge_only_what_continues_in_memory_and_in_the_buffer():
    saved = [(100, 10, 0), (110, 5, 10), (120, 4, 15), (124, 4, 19), (128, 4, 30)]
    assert residency.runs(saved) == [(100, 15, 0), (120, 8, 15), (128, 4, 30)]
    assert residency.runs([]) == []


def test_sleep_releases_every_device_page_and_wake_restores_bytes_pointers_and_views(make_pool):
    pool = make_pool("2MiB", auto_compact=False)
    ts = _fill(pool, SIZES)
    views = [t[7:500:3] for t in ts]
    before = [v.clone() for v in views]
    ptrs = [t.data_ptr() for t in ts]
    api = pool.driver.api
    assert api.used > 0 and pool.stats()["reserved_bytes.all.current"] > 0
    report = pool.sleep()
    st = pool.stats()
    assert pool.asleep and st["asleep"] is True
    assert api.used == 0, "sleep must release every device page to the driver"
    assert st["reserved_bytes.all.current"] == 0 and st["pages.cached"] == 0 and st["pages.total"] == 0
    assert st["sleeping_bytes.all.current"] == report.pages * P > 0
    assert st["sleep.host_bytes"] == report.copied_bytes == sum(pool.core.round(n) for n in SIZES)
    assert api.host_state()["pinned_buffers"] == 1
    assert api.state()["reservations"] == 1, "the reservation is kept"
    pool.check_invariants()
    pool.wake()
    assert not pool.asleep and api.host_state() == {"host_pages": 0, "pinned_buffers": 0, "host_used_bytes": 0}
    assert [t.data_ptr() for t in ts] == ptrs
    assert _intact(ts)
    assert all(torch.equal(v, b) for v, b in zip(views, before))
    assert pool.stats()["sleeping_bytes.all.current"] == 0 and pool.stats()["num_wakes"] == 1
    pool.check_invariants()
    extra = pool.zeros(100_000, dtype=torch.uint8)  # usable after wake
    assert int(extra.sum()) == 0
    pool.check_invariants()


def test_pool_calls_while_asleep_are_a_clear_error_and_reading_calls_work(make_pool):
    pool = make_pool("1MiB")
    ts = _fill(pool, [4000, 30_000])
    pool.sleep()
    for call in (lambda: pool.empty(10), lambda: pool.adopt(torch.ones(4)), lambda: pool.compact(),
                 lambda: pool.pin(ts[0]), lambda: pool.trim(), lambda: pool.offload(ts[0]),
                 lambda: pool.reload(ts[0]), lambda: pool.sleep()):
        with pytest.raises(defrag.PoolAsleepError, match="pool.wake"):
            call()
    assert pool.asleep
    pool.stats(), pool.summary(), pool.snapshot(), pool.live_tensors()
    layout = pool.layout()
    assert {s for r in layout["regions"] for s in r["pages"]} >= {"asleep"}
    assert "ASLEEP" in pool.summary()
    pool.wake()
    with pytest.raises(defrag.ResidencyError, match="awake"):
        pool.wake()
    assert _intact(ts)
    pool.check_invariants()


def test_sleep_discard_skips_those_bytes_and_they_come_back_as_zeros(make_pool):
    pool = make_pool("2MiB")
    ts = _fill(pool, SIZES)
    kv = [ts[1], ts[4]]
    report = pool.sleep(discard=kv)
    assert report.discarded_bytes == sum(pool.core.round(t.numel()) for t in kv)
    assert report.copied_bytes == sum(pool.core.round(n) for n in SIZES) - report.discarded_bytes
    pool.wake()
    for i, t in enumerate(ts):
        if any(t is k for k in kv):
            assert int(t.count_nonzero()) == 0
        else:
            assert check_pattern(t, i)
    pool.check_invariants()


def test_a_tensor_touched_while_asleep_reads_zeros_and_is_reported_by_wake(make_pool):
    pool = make_pool("1MiB")
    t, = _fill(pool, [20_000])
    pool.sleep()
    assert int(t.count_nonzero()) == 0  # unmapped memory: the emulated device reads zeros (a GPU faults)
    with pytest.raises(defrag.StaleAccessError, match="asleep"):
        pool.wake()  # the first pool call after the access reports it, and changes nothing
    assert pool.asleep
    pool.wake()
    pool.empty(10)  # reported once
    assert check_pattern(t, 0)  # the read changed nothing
    pool.check_invariants()


def test_tensors_dying_while_asleep_are_freed_and_wake_still_works(make_pool):
    pool = make_pool("1MiB")
    ts = _fill(pool, [4000, 60_000, 9000])
    pool.sleep()
    dead = ts.pop(1)
    del dead
    gc.collect()
    assert pool.stats()["live_blocks"] == 2  # stats drains the release while asleep
    pool.check_invariants()
    pool.wake()
    assert check_pattern(ts[0], 0) and check_pattern(ts[1], 2)
    pool.check_invariants()


def test_closing_a_sleeping_pool_leaves_nothing_behind(make_pool):
    pool = make_pool("1MiB")
    ts = _fill(pool, [4000, 60_000])
    api = pool.driver.api
    pool.sleep()
    pool.close()
    del ts
    gc.collect()
    assert api.host_state() == {"host_pages": 0, "pinned_buffers": 0, "host_used_bytes": 0}
    # make_pool checks handles, mappings and reservations


def test_sleep_of_an_empty_pool_and_a_pool_with_empty_pages(make_pool):
    pool = make_pool("1MiB")
    pool.sleep()
    pool.wake()
    ts = _fill(pool, [30_000, 30_000, 30_000])
    del ts[1]
    gc.collect()
    pool.sleep()
    assert pool.driver.api.used == 0
    pool.wake()
    assert check_pattern(ts[0], 0) and check_pattern(ts[1], 2)
    pool.check_invariants()


# ---------------------------------------------------------------------- offload / reload
def _hot_and_cold(pool):
    ts = _fill(pool, SIZES)
    cold = [ts[i] for i in (1, 3, 5, 8)]
    return ts, cold


def test_offload_backs_cold_pages_with_host_memory_and_reload_brings_writes_back(make_pool):
    pool = make_pool("2MiB", auto_compact=False)
    ts, cold = _hot_and_cold(pool)
    api = pool.driver.api
    report = pool.offload(cold)
    assert report.pages >= 1 and report.tensors == len(cold)
    ptrs = [t.data_ptr() for t in ts]  # packing may have moved the cold ones: pointers hold from here on
    views = [t[11:4000:5] for t in cold]
    st = pool.stats()
    assert st["offloaded_bytes.all.current"] == report.pages * P == api.host_used
    assert st["pages.offloaded"] == report.pages == _host_pages(pool)
    assert st["reserved_bytes.all.current"] == api.used, "reserved counts device pages only"
    assert all(_backing_of(pool, t) == HOST for t in cold)
    hot = [t for t in ts if not any(t is c for c in cold)]
    assert all(_backing_of(pool, t) != HOST for t in hot), "packing keeps hot tensors on the device"
    assert _intact(ts)
    pool.check_invariants()
    # Readable and writable while offloaded, through the same pointers and views.
    for c in cold:
        c.add_(3)
    for v in views:
        v.mul_(1)
    pool.check_invariants()
    # A new allocation lands on device pages, never in host memory.
    fresh = pool.full((50_000,), 7, dtype=torch.uint8)
    assert _backing_of(pool, fresh) != HOST
    pool.check_invariants()
    # Compaction leaves offloaded tensors where they are.
    live = {lt.address: lt for lt in pool.live_tensors()}
    assert all(not live[c.data_ptr()].movable and "offloaded" in live[c.data_ptr()].reason for c in cold)
    pool.compact()
    assert [t.data_ptr() for t in cold] == [p for t, p in zip(ts, ptrs) if any(t is c for c in cold)]
    r2 = pool.reload(cold)
    assert r2.pages == report.pages and _host_pages(pool) == 0 and api.host_used == 0
    assert [t.data_ptr() for t in cold] == [p for t, p in zip(ts, ptrs) if any(t is c for c in cold)]
    for i, t in enumerate(ts):
        if any(t is c for c in cold):
            expect = torch.empty_like(t)
            fill_pattern(expect, i)
            assert torch.equal(t, expect + 3)
        else:
            assert check_pattern(t, i)
    assert bool((fresh == 7).all())
    assert pool.stats()["offloaded_bytes.all.current"] == 0 and pool.stats()["offloaded_bytes.all.peak"] > 0
    pool.check_invariants()


def test_offload_of_isolated_tensors_moves_nothing_and_keeps_every_pointer(make_pool):
    pool = make_pool("2MiB")
    big = _fill(pool, [2 * P, 3 * P, P])  # page-sized tensors own their pages
    ptrs = [t.data_ptr() for t in big]
    used = pool.driver.api.used
    report = pool.offload(big[:2])
    assert report.moved_tensors == 0 and report.pages == 5
    assert [t.data_ptr() for t in big] == ptrs
    assert pool.driver.api.used == used - 5 * P, "device pages go back to the driver"
    pool.reload()
    assert [t.data_ptr() for t in big] == ptrs and _intact(big)
    pool.check_invariants()


def test_offload_pack_false_refuses_when_pages_are_shared(make_pool):
    pool = make_pool("1MiB")
    ts = _fill(pool, [3000, 3000, 3000])
    ptrs = [t.data_ptr() for t in ts]
    with pytest.raises(defrag.ResidencyError, match="pack=False"):
        pool.offload(ts[1], pack=False)
    assert [t.data_ptr() for t in ts] == ptrs and _host_pages(pool) == 0 and _intact(ts)
    pool.check_invariants()


def test_offload_bad_input_is_a_clear_error_with_the_pool_unchanged(make_pool):
    pool = make_pool("1MiB")
    other = make_pool("1MiB")
    ts = _fill(pool, [3000, 9000])
    foreign = other.zeros(100)
    pool.pin(ts[0])
    before = pool.layout()
    with pytest.raises(ValueError, match="pinned"):
        pool.offload(ts)
    with pytest.raises(ValueError, match="pool #"):
        pool.offload([ts[1], foreign])
    with pytest.raises(ValueError, match="not in pool"):
        pool.offload(torch.ones(10))
    assert pool.layout() == before and _host_pages(pool) == 0
    assert _intact(ts)
    pool.check_invariants()
    # Reloading what is not offloaded, or offloading twice, does nothing.
    assert pool.reload(ts[1]).pages == 0
    pool.unpin(ts[0])
    assert pool.offload(ts[1]).pages == 1
    assert pool.offload(ts[1]).pages == 0
    pool.reload()
    assert _intact(ts)


def test_offload_without_host_pages_is_not_supported_and_sleep_still_works():
    api = EmulatedCuda(capacity=4 * MiB, granularity=64 * KiB, host_pages=False)
    drv = Driver.emulated(api=api)
    pool = defrag.Pool(device=drv, capacity="1MiB")
    t = pool.full((5000,), 3, dtype=torch.uint8)
    ok, why = drv.host_pages_supported()
    assert not ok and "host NUMA" in why
    with pytest.raises(defrag.NotSupportedError, match="sleep"):
        pool.offload(t)
    pool.sleep()
    pool.wake()
    assert bool((t == 3).all())
    pool.close()
    del t
    gc.collect()
    assert api.state()["handles"] == 0 and api.host_state()["pinned_buffers"] == 0


def test_dropped_offloaded_tensors_are_freed_at_reload_and_close_leaves_nothing(make_pool):
    pool = make_pool("2MiB")
    ts = _fill(pool, [2 * P, 5000, P])
    api = pool.driver.api
    pool.offload([ts[0], ts[1]])
    del ts[0]
    gc.collect()
    assert pool.stats()["pages.offloaded"] >= 2, "held until reload: a host page never empties"
    pool.check_invariants()
    pool.reload()
    gc.collect()
    pool.stats()
    assert pool.stats()["live_blocks"] == 2
    assert check_pattern(ts[0], 1) and check_pattern(ts[1], 2)
    pool.offload(ts)
    pool.close()
    assert check_pattern(ts[0], 1)  # still usable: close keeps pages under live tensors
    del ts
    gc.collect()
    assert api.host_state() == {"host_pages": 0, "pinned_buffers": 0, "host_used_bytes": 0}


def test_sleep_keeps_offloaded_pages_host_backed(make_pool):
    pool = make_pool("2MiB")
    ts = _fill(pool, [2 * P, 5000, 30_000])
    pool.offload(ts[0])
    pool.sleep()
    assert pool.driver.api.used == 0
    assert check_pattern(ts[0], 0), "an offloaded tensor stays addressable through a sleep"
    pool.wake()
    pool.reload()
    assert _intact(ts)
    pool.check_invariants()


def test_reload_without_room_is_a_clear_error(make_pool):
    pool = make_pool("512KiB", auto_compact=False)  # 8 pages
    cold = _fill(pool, [4 * P])
    pool.offload(cold)
    hot = [pool.empty((P,), dtype=torch.uint8) for _ in range(6)]
    with pytest.raises(defrag.ResidencyError, match="reload needs 4 device pages"):
        pool.reload()
    assert _host_pages(pool) == 4 and check_pattern(cold[0], 0)
    del hot
    gc.collect()
    pool.reload()
    assert check_pattern(cold[0], 0)
    pool.check_invariants()


def test_stats_summary_layout_snapshot_and_picture_show_offloaded_and_sleeping(make_pool, tmp_path):
    from defrag import viz

    pool = make_pool("2MiB")
    ts = _fill(pool, [2 * P, 5000, 30_000])
    pool.offload(ts[0])
    st = pool.stats()
    snap = pool.snapshot()
    assert sum(s["total_size"] for s in snap["segments"]) == st["reserved_bytes.all.current"]
    assert sum(s["allocated_size"] for s in snap["segments"]) == st["allocated_bytes.all.current"] - 2 * P
    layout = pool.layout()
    assert [s for r in layout["regions"] for s in r["pages"]].count("offloaded") == 2
    assert viz.layout_totals(layout)["pages_offloaded"] == 2
    assert "Offloaded to host memory" in pool.summary()
    assert viz.plot_memory_map(layout, tmp_path / "map.png")
    pool.reload()


# ---------------------------------------------------------------------- faults at every driver call
def _calls(drv, fn):
    before = dict(drv.faults.calls)
    fn()
    return {k: v - before.get(k, 0) for k, v in drv.faults.calls.items() if v - before.get(k, 0) > 0}


def _every_position(make_pool, setup, op, after):
    """Fail each driver call of `op` in turn on a fresh pool; `after(pool, ts, error)` checks the aftermath."""
    probe_pool, probe_ts = setup(make_pool)
    counts = _calls(probe_pool.driver, lambda: op(probe_pool, probe_ts))
    assert counts, "the operation made no driver call"
    positions = [(name, k) for name, n in sorted(counts.items()) for k in range(1, n + 1)]
    for name, k in positions:
        pool, ts = setup(make_pool)
        pool.driver.faults.inject(name, nth=k)
        error = None
        try:
            op(pool, ts)
        except (CudaError, NotSupportedError) as exc:  # a fault in the host-page probe's trial: "not now"
            error = exc
        pool.driver.faults.clear()
        pool.check_invariants()
        after(pool, ts, error)
    return positions


def _sleep_setup(make_pool):
    pool = make_pool("2MiB")
    ts = _fill(pool, [3000, 70_000, 512, 2 * P, 9000])
    return pool, ts


def test_a_fault_at_any_driver_call_of_sleep_loses_nothing(make_pool):
    def after(pool, ts, error):
        if error is not None:
            assert not pool.asleep, f"sleep failed ({error}) but left the pool asleep"
            assert _intact(ts)
            pool.zeros(100)  # usable
        if pool.asleep:
            pool.wake()
        assert _intact(ts)
        pool.sleep()
        pool.wake()
        assert _intact(ts)

    positions = _every_position(make_pool, _sleep_setup, lambda pool, ts: pool.sleep(), after)
    assert {"cuMemAllocHost", "cuMemcpyDtoHAsync", "cuMemUnmap", "cuMemRelease"} <= {n for n, _ in positions}


def test_a_fault_at_any_driver_call_of_wake_keeps_the_pool_asleep_with_its_bytes(make_pool):
    def setup(mp):
        pool, ts = _sleep_setup(mp)
        pool.sleep()
        return pool, ts

    def after(pool, ts, error):
        if error is not None:
            assert pool.asleep, f"wake failed ({error}) but the pool is awake"
            assert pool.driver.api.used == 0, "a failed wake holds no device page"
            pool.wake()
        assert _intact(ts)

    positions = _every_position(make_pool, setup, lambda pool, ts: pool.wake(), after)
    assert {"cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemcpyHtoDAsync", "cuMemFreeHost"} <= {n for n, _ in positions}


def test_wake_with_a_refused_unmap_in_its_undo_still_keeps_the_pool_asleep_with_its_bytes(make_pool):
    """SetAccess refused while waking, then the undo's second unmap refused too: the page the undo left
    mapped is unmapped once more, so the pool stays asleep holding no device page, and wakes intact later."""
    pool, ts = _sleep_setup(make_pool)
    pool.sleep()
    pool.driver.faults.inject("cuMemSetAccess", nth=1)
    pool.driver.faults.inject("cuMemUnmap", nth=2)
    with pytest.raises(CudaError):
        pool.wake()
    assert pool.driver.faults.pending() == 0
    pool.driver.faults.clear()
    pool.check_invariants()
    assert pool.asleep and pool.driver.api.used == 0
    pool.wake()
    assert _intact(ts)
    pool.check_invariants()


def _offload_setup(make_pool):
    pool = make_pool("2MiB", auto_compact=False)
    ts = _fill(pool, [3000, 70_000, 512, 20_000, 2 * P, 9000])
    return pool, ts


def _offload_op(pool, ts):
    pool.offload([ts[0], ts[3], ts[4]])


def test_a_fault_at_any_driver_call_of_offload_loses_nothing(make_pool):
    def after(pool, ts, error):
        assert _intact(ts)
        if error is not None:
            assert _host_pages(pool) == 0, f"offload failed ({error}) but left host pages"
            pool.zeros(100)
            _offload_op(pool, ts)
        assert _host_pages(pool) > 0
        ts[0].add_(1)
        ts[0].sub_(1)
        pool.reload()
        assert _intact(ts) and _host_pages(pool) == 0

    positions = _every_position(make_pool, _offload_setup, _offload_op, after)
    assert {"cuMemCreate", "cuMemMap", "cuMemUnmap", "cuMemcpyDtoDAsync", "cuMemRelease"} <= {n for n, _ in positions}


def test_a_fault_at_any_driver_call_of_reload_keeps_the_pages_offloaded(make_pool):
    def setup(mp):
        pool, ts = _offload_setup(mp)
        _offload_op(pool, ts)
        return pool, ts

    def after(pool, ts, error):
        assert _intact(ts)
        if error is not None:
            assert _host_pages(pool) > 0, f"reload failed ({error}) but no page is host-backed"
            pool.reload()
        assert _host_pages(pool) == 0 and _intact(ts)
        pool.zeros(100)

    positions = _every_position(make_pool, setup, lambda pool, ts: pool.reload(), after)
    assert {"cuMemCreate", "cuMemMap", "cuMemUnmap", "cuMemRelease"} <= {n for n, _ in positions}


def test_the_device_refusing_pages_at_wake_keeps_the_pool_asleep(make_pool):
    pool, ts = _sleep_setup(make_pool)
    pool.sleep()
    pool.driver.faults.inject("cuMemCreate", cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY, repeat=True)
    with pytest.raises(CudaOutOfMemoryError) as info:
        pool.wake()
    assert "stays asleep" in "".join(getattr(info.value, "__notes__", []))
    pool.driver.faults.clear()
    assert pool.asleep
    pool.wake()
    assert _intact(ts)


# ---------------------------------------------------------------------- the driver surface
def test_host_pages_are_their_own_kind_with_their_own_capacity():
    api = EmulatedCuda(capacity=4 * P, granularity=P, host_capacity=2 * P)
    drv = Driver.emulated(api=api)
    assert drv.host_pages_supported()[0]
    hosts = [drv.create(P, host=True) for _ in range(2)]
    with pytest.raises(CudaOutOfMemoryError):
        drv.create(P, host=True)
    devs = [drv.create(P) for _ in range(4)]  # device capacity untouched by host pages
    assert api.used == 4 * P and api.host_used == 2 * P and drv.mem_info()[0] == 0
    with pytest.raises(CudaOutOfMemoryError):
        drv.alloc_host(1)  # pinned buffers share the host capacity
    for h in hosts + devs:
        drv.release(h)
    buf = drv.alloc_host(P)
    va = drv.reserve(P)
    drv.map(va, P, drv_h := drv.create(P))
    drv.set_access(va, P)
    drv.memset(va, 9, P)
    drv.copy_to_host(buf, va, P)
    drv.memset(va, 0, P)
    drv.copy_from_host(va, buf, P)
    assert api.is_accessible(va, P)
    with pytest.raises(CudaError):
        drv.copy_to_host(buf + 1, va, P)  # past the pinned buffer
    with pytest.raises(CudaError):
        drv.copy_from_host(va + P, buf, P)  # unmapped device range
    drv.unmap(va, P)
    drv.release(drv_h)
    drv.free_address(va, P)
    drv.free_host(buf)
    with pytest.raises(CudaError):
        drv.free_host(buf)
    assert api.state() == {"handles": 0, "mappings": 0, "reservations": 0, "used_bytes": 0}
    assert api.host_state() == {"host_pages": 0, "pinned_buffers": 0, "host_used_bytes": 0}
    drv.close()


def test_new_driver_calls_match_the_cuda_python_signatures():
    from .test_driver import Recorder

    api = EmulatedCuda(capacity=4 * P, granularity=P)
    rec = Recorder(api)
    drv = Driver.emulated(api=rec)
    drv.host_pages_supported()
    h = drv.create(P, host=True)
    buf = drv.alloc_host(P)
    va = drv.reserve(P)
    drv.map(va, P, h)
    drv.set_access(va, P)
    drv.copy_to_host(buf, va, 16)
    drv.copy_from_host(va, buf, 16)
    drv.unmap(va, P)
    drv.release(h)
    drv.free_address(va, P)
    drv.free_host(buf)
    names = {n for n, _ in rec.log}
    assert {"cuDeviceGetAttribute", "cuMemAllocHost", "cuMemFreeHost", "cuMemcpyDtoH", "cuMemcpyHtoD"} <= names
    for name, args in rec.log:
        sig = inspect.signature(getattr(cu, name))
        sig.bind(*args)
        for param, value in zip(sig.parameters.values(), args):
            if isinstance(param.annotation, str) and re.findall(r"CU\w+", param.annotation):
                types = {getattr(cu, t) for t in re.findall(r"CU\w+", param.annotation)}
                items = value if isinstance(value, (list, tuple)) else [value]
                assert all(type(v) in types for v in items), (name, param.name, value)
    (size, prop, flags), = [a for n, a in rec.log if n == "cuMemCreate" and a[1].location.type
                            == cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA][-1:]
    assert size == P and prop.location.id == 0 and flags == 0
    drv.close()


def test_memoryless_device_keeps_the_host_books_without_bytes():
    api = MemorylessCuda(capacity=4 * P, granularity=P, host_capacity=2 * P)
    drv = Driver.memoryless(api=api)
    h = drv.create(P, host=True)
    buf = drv.alloc_host(P)
    assert api.host_used == 2 * P and api.used == 0
    drv.release(h)
    drv.free_host(buf)
    assert api.host_state() == {"host_pages": 0, "pinned_buffers": 0, "host_used_bytes": 0}
    drv.close()


def test_residency_imports_no_torch():
    import ast
    import pathlib

    tree = ast.parse(pathlib.Path(residency.__file__).read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(n.split(".")[0] == "torch" for n in names)
