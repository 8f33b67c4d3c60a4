"""Sleep/wake and offload/reload (issue 15) on a real GPU, or rehearsed on the emulated device.

On the GPU these run the CUDA path the CPU tests cannot: cuMemAllocHost,
cuMemcpyDtoH/HtoD, and host-located pages (cuMemCreate with a host NUMA
location, CUDA >= 12.2) mapped at device addresses and read by real kernels.
Where the driver offers no host-located pages the offload test skips with
the driver's reason.
"""

from __future__ import annotations

import pytest
import torch

import defrag

from .conftest import sync

MiB = 1 << 20


def test_sleep_and_wake_keep_bytes_pointers_and_views(make_pool, figures):
    pool = make_pool("256MiB")
    page = pool.page_size
    ts = [pool.full((page // 4 * (i + 1),), float(i), dtype=torch.float32) for i in range(6)]
    views = [t[5:100] for t in ts]
    ptrs = [t.data_ptr() for t in ts]
    sync(pool)
    report = pool.sleep()
    assert pool.stats()["reserved_bytes.all.current"] == 0 and pool.asleep
    with pytest.raises(defrag.PoolAsleepError):
        pool.empty(10)
    wake = pool.wake()
    assert [t.data_ptr() for t in ts] == ptrs
    for i, (t, v) in enumerate(zip(ts, views)):
        assert bool((t == float(i)).all()) and bool((v == float(i)).all())
    ts[0].mul_(2)  # a kernel over woken pages
    sync(pool)
    assert bool((ts[0] == 0.0).all())
    pool.check_invariants()
    figures.add("sleep", report.seconds * 1e3, "ms", bytes=report.copied_bytes)
    figures.add("wake", wake.seconds * 1e3, "ms", bytes=wake.copied_bytes)


def test_offload_keeps_tensors_usable_by_kernels_in_place(make_pool, figures):
    pool = make_pool("256MiB")
    ok, why = pool.driver.host_pages_supported()
    if not ok:
        pytest.skip(f"no host-located VMM pages here: {why}")
    page = pool.page_size
    hot = pool.full((page // 4,), 1.0, dtype=torch.float32)
    cold = pool.full((2 * page // 4,), 2.0, dtype=torch.float32)  # two pages of its own
    ptr = cold.data_ptr()
    used = pool.stats()["reserved_bytes.all.current"]
    report = pool.offload(cold)
    assert cold.data_ptr() == ptr and report.moved_tensors == 0
    assert pool.stats()["reserved_bytes.all.current"] == used - 2 * page
    cold.add_(1.0)  # a kernel writing host-located memory over the bus
    sync(pool)
    assert float(cold.sum()) == 3.0 * cold.numel()
    pool.reload(cold)
    assert cold.data_ptr() == ptr and bool((cold == 3.0).all()) and bool((hot == 1.0).all())
    pool.check_invariants()
    figures.add("offload", report.seconds * 1e3, "ms", bytes=report.copied_bytes)
