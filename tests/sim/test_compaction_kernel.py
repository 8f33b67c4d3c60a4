"""Compaction with the numba move kernel (simulated) over emulated device memory.

Two routes to the kernel body: numba's own launch (engine="kernel"), and the
GPU's launch path (engine="auto": `kernels.launch.MoveLauncher` packs the
parameters, stages the table in device memory and launches through the
driver; the emulated device's host twin then runs the real kernel body under
the simulator with exactly those parameters and that table).
"""

from __future__ import annotations

import gc

import pytest
import torch

import numpy as np

import defrag
from defrag import copying
from defrag.driver import Driver
from defrag.kernels import host
from defrag.kernels.launch import MoveLauncher

KiB = 1 << 10
PAGE = 64 * KiB


def _pool():
    return defrag.Pool(device=Driver.emulated(capacity=4 << 20, granularity=PAGE), capacity="512KiB",
                       auto_compact=False)


def _fragmented(pool, sizes):
    ts = [pool.empty(n, dtype=torch.uint8) for n in sizes]
    ts.sort(key=lambda t: t.data_ptr())
    g = torch.Generator().manual_seed(1)
    for t in ts:
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g))
    survivors = [t for i, t in enumerate(ts) if i % 4 == 1]
    return survivors, [t.clone() for t in survivors]


@pytest.mark.parametrize("engine", ["kernel", "memmove", "auto"])
def test_kernel_and_memmove_engines_give_the_same_bytes_and_layout(engine, monkeypatch):
    # Same pool history for every engine: the plans and so the layouts are equal.
    if engine == "auto":  # the launch path, the real kernel body, and the copy engine for moves from 2 KiB
        monkeypatch.setattr(copying, "EMULATED_TWIN", host.ENTRY_SIMULATED)
        monkeypatch.setattr(copying, "COPY_ENGINE_MIN_BYTES", 2 * KiB)
    pool = _pool()
    sizes = [512, 1536, 4096, 512, 8192, 3072] * 12  # 72 blocks over 4 pages
    survivors, expected = _fragmented(pool, sizes)
    filler = pool.empty(PAGE, dtype=torch.uint8)  # a third page, then freed: holes everywhere
    del filler
    report = pool.compact(engine=engine, verify=True)
    assert report.engine == engine and report.moved_tensors > 0
    if engine == "auto":
        assert copying.launcher_for(pool.driver).launches > 0 and pool.driver.faults.calls["cuMemcpyDtoDAsync"] > 0
    for t, e in zip(survivors, expected):
        assert torch.equal(t, e)
    layout = [(t.data_ptr() - pool.core.regions[0].base, t.numel()) for t in survivors]
    pool.check_invariants()
    del survivors, t
    gc.collect()
    pool.close()
    test_kernel_and_memmove_engines_give_the_same_bytes_and_layout.layouts[engine] = layout
    for other, seen in test_kernel_and_memmove_engines_give_the_same_bytes_and_layout.layouts.items():
        assert layout == seen, (engine, other)


test_kernel_and_memmove_engines_give_the_same_bytes_and_layout.layouts = {}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_launch_path_feeds_the_kernel_body_its_geometry_and_table(seed):
    """Random waves through `MoveLauncher` (the GPU's launch: packed parameters, a staged table, the
    geometry's chunk size from an H200's SM count and occupancy), run by the real kernel body under the
    simulator: every byte moves, nothing outside the waves changes."""
    page = PAGE
    drv = Driver.emulated(capacity=16 * page, granularity=page)
    handle = drv.create(4 * page)
    base = drv.reserve(4 * page)
    drv.map(base, 4 * page, handle)
    drv.set_access(base, 4 * page)
    mem = np.ctypeslib.as_array((__import__("ctypes").c_uint8 * (4 * page)).from_address(base))
    rng = np.random.default_rng(seed)
    mem[:] = rng.integers(0, 256, mem.size, dtype=np.uint8)
    launcher = MoveLauncher(drv, copying._host_image(host.ENTRY_SIMULATED))
    assert launcher.load()
    for _ in range(3):
        n = int(rng.integers(1, 40))
        sizes = rng.integers(1, 200, n) * 16
        slots = rng.permutation(2 * n)
        width = int(sizes.max())
        offsets = slots * (width + 16 * int(rng.integers(0, 3)))
        src, dst = offsets[:n].astype(np.int64), offsets[n:].astype(np.int64)
        assert int(offsets.max()) + width <= mem.size
        expected = mem.copy()
        for s_, d_, k in zip(src.tolist(), dst.tolist(), sizes.tolist()):
            expected[d_:d_ + k] = mem[s_:s_ + k]
        launcher.move(base, mem.size, src, dst, sizes.astype(np.int64))
        drv.synchronize()
        assert np.array_equal(mem, expected)
    launcher.close()
    drv.api.close()
    drv.close()
