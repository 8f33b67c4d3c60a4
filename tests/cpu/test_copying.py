"""The copy engines and the move kernel's launch path, on the emulated device (no GPU, no simulator needed).

The GPU's launch path (`kernels.launch.MoveLauncher`: module, occupancy,
geometry, staged tables, cuLaunchKernel) runs here against the emulated driver,
whose kernels are host twins fed the same packed parameters; so wrong
parameters, tables or reuse show as wrong bytes. Also: the launch geometry,
the on-disk image cache, the engine choice by size, one synchronize per
compaction, and faults at every new step.
"""

from __future__ import annotations

import ctypes
import os
import random
import shutil

import numpy as np
import pytest
import torch
from cuda.bindings.driver import CUresult
from hypothesis import given, settings
from hypothesis import strategies as st

import defrag
from defrag import copying
from defrag.driver import Driver
from defrag.kernels import KernelUnavailableError, abi, host, image
from defrag.kernels.geometry import launch_geometry
from defrag.kernels.launch import FIRST_SEGMENTS, SLOTS, MoveLauncher

from .conftest import KiB, check_pattern, fill_pattern

PAGE = 64 * KiB


# ---------------------------------------------------------------- geometry
@pytest.mark.parametrize("words, sms, per_sm, expected", [
    (65_536, 132, 4, (256, 256, 32)),  # 1 MiB on an H200: 32-word chunks, every SM busy
    (1 << 20, 132, 4, (256, 256, 512)),  # 16 MiB: full 8 KiB chunks already give 2048 of them
    (1 << 24, 132, 4, (528, 256, 512)),  # 256 MiB: one resident wave of blocks (132 x 4)
    (1 << 24, 132, 8, (1056, 256, 512)),  # a kernel with half the registers: twice the blocks
    (4096, 132, 4, (16, 256, 32)),  # 64 KiB cannot reach every SM
    (0, 132, 4, (1, 256, 32)),
    (65_536, 16, 2, (16, 256, 512)),  # a small GPU: 8 KiB chunks already reach every SM
    (1 << 20, 16, 2, (32, 256, 512)),  # the resident limit (16 x 2)
])
def test_launch_geometry_for_given_occupancy_and_sm_count(words, sms, per_sm, expected):
    assert launch_geometry(words, sm_count=sms, blocks_per_sm=per_sm) == expected


@settings(max_examples=300, deadline=None)
@given(words=st.integers(0, 1 << 34), sms=st.integers(1, 256), per_sm=st.integers(1, 32),
       threads=st.sampled_from([64, 128, 256, 512, 1024]))
def test_launch_geometry_uses_every_sm_from_a_mib_and_never_more_than_fits(words, sms, per_sm, threads):
    blocks, t, chunk = launch_geometry(words, sm_count=sms, blocks_per_sm=per_sm, threads=threads)
    assert t == threads and 32 <= chunk <= 512 and chunk % 32 == 0
    assert 1 <= blocks <= sms * per_sm
    teams = blocks * threads // 32
    assert teams * chunk >= min(words, teams * chunk)  # the grid-stride loop covers every word
    if words >= sms * threads:  # at 256 threads and up to 256 SMs: every wave of 1 MiB or more
        assert blocks >= sms


def test_launch_geometry_refuses_an_impossible_kernel():
    with pytest.raises(ValueError, match="occupancy of 0"):
        launch_geometry(1000, sm_count=132, blocks_per_sm=0)
    with pytest.raises(ValueError, match="multiple of 32"):
        launch_geometry(1000, sm_count=132, blocks_per_sm=4, threads=48)


# ---------------------------------------------------------------- the kernel's parameters
def test_packed_parameters_read_back_as_the_launch_they_describe():
    p = abi.MoveParams()
    p.set(base=0x7F0000000000, arena_bytes=1 << 30, table=0x1000, segments=37, total_words=12345, chunk_words=64)
    pointers = (ctypes.c_void_p * abi.PARAMS).from_address(p.address)
    values = [ctypes.c_uint64.from_address(q).value for q in pointers]
    launch = abi.unpack(values)
    assert launch == abi.Launch(base=0x7F0000000000, arena_bytes=1 << 30, table=0x1000, segments=37,
                                table_strides=(38 * 8, 8), total_words=12345, chunk_words=64)
    # numba's array layout: meminfo and parent unused, then nitems, itemsize, data, shape, strides.
    assert values[:7] == [0, 0, (1 << 30) // 8, 8, 0x7F0000000000, (1 << 30) // 8, 8]
    assert values[7:16] == [0, 0, 3 * 38, 8, 0x1000, 3, 38, 38 * 8, 8]
    with pytest.raises(ValueError):
        abi.unpack(values[:-1])
    values[12] = 4  # a table of 4 rows is not the move kernel's
    with pytest.raises(ValueError):
        abi.unpack(values)


# ---------------------------------------------------------------- the image cache
def _fake_builder(calls):
    def build(cc):
        calls.append(cc)
        return image.KernelImage(b"CUBIN" + bytes(cc), "_Z4movePv", abi.PARAMS, "built")
    return build


def test_the_image_is_built_once_then_loaded_from_the_cache(tmp_path):
    calls = []
    dirs = [tmp_path / "cache"]
    first = image.move_image((9, 0), build=_fake_builder(calls), dirs=dirs)
    second = image.move_image((9, 0), build=_fake_builder(calls), dirs=dirs)
    assert calls == [(9, 0)] and first.origin == "built" and second.origin == "cache"
    assert (second.data, second.entry, second.params) == (first.data, first.entry, first.params)
    image.move_image((8, 0), build=_fake_builder(calls), dirs=dirs)  # another GPU: its own entry
    assert calls == [(9, 0), (8, 0)]
    assert len(list(dirs[0].glob("*.cubin"))) == 2 and not list(dirs[0].glob("*.cubin.*"))  # no temporaries left


def test_an_unwritable_cache_falls_back_to_the_next_folder_and_then_to_memory(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    calls = []
    dirs = [blocker / "cache", tmp_path / "fallback"]
    image.move_image((9, 0), build=_fake_builder(calls), dirs=dirs)
    assert image.move_image((9, 0), build=_fake_builder(calls), dirs=dirs).origin == "cache"
    assert calls == [(9, 0)] and list((tmp_path / "fallback").glob("*.cubin"))
    nowhere = [blocker / "x", blocker / "y"]
    assert image.move_image((9, 0), build=_fake_builder(calls), dirs=nowhere).origin == "built"
    assert image.move_image((9, 0), build=_fake_builder(calls), dirs=nowhere).origin == "built"  # compiled again


def test_a_damaged_cache_entry_is_compiled_again_and_replaced(tmp_path):
    calls = []
    dirs = [tmp_path]
    image.move_image((9, 0), build=_fake_builder(calls), dirs=dirs)
    cubin, = tmp_path.glob("*.cubin")
    cubin.write_bytes(cubin.read_bytes()[:-1] + b"!")  # same length, other bytes
    assert image.move_image((9, 0), build=_fake_builder(calls), dirs=dirs).origin == "built"
    assert image.move_image((9, 0), build=_fake_builder(calls), dirs=dirs).origin == "cache"
    assert len(calls) == 2


def test_the_cache_key_follows_every_kernel_source_and_the_gpu(tmp_path):
    shutil.copytree(image.HERE, tmp_path / "k", ignore=shutil.ignore_patterns("__pycache__"))
    key = image.cache_key((9, 0), folder=tmp_path / "k")
    assert key == image.cache_key((9, 0)) and key != image.cache_key((10, 0))
    for name in image.SOURCES:
        path = tmp_path / "k" / name
        original = path.read_bytes()
        path.write_bytes(original + b"\n# changed\n")
        assert image.cache_key((9, 0), folder=tmp_path / "k") != key, name
        path.write_bytes(original)


def test_the_cache_folder_is_the_environments_or_the_users(monkeypatch, tmp_path):
    monkeypatch.setenv(image.CACHE_ENV, str(tmp_path / "mine"))
    assert image.cache_dirs() == [tmp_path / "mine"]
    monkeypatch.delenv(image.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert image.cache_dirs()[0] == tmp_path / "xdg" / "defrag" / "kernels"


def test_entry_params_reads_a_ptx_entry():
    ptx = ".visible .entry _Z3fooPv(\n\t.param .u64 _p0,\n\t.param .u64 _p1\n)\n{\n}"
    assert image.entry_params(ptx, "_Z3fooPv") == ["u64", "u64"]
    assert image.entry_params(ptx, "bar") is None


# ---------------------------------------------------------------- the launcher against the emulated driver
class Region:
    """`pages` mapped 64 KiB pages of a fresh emulated device, filled with random bytes."""

    def __init__(self, pages: int, *, seed: int = 0, async_work: bool = False):
        self.drv = Driver.emulated(capacity=4 * pages * PAGE, granularity=PAGE)
        self.size = pages * PAGE
        self.handle = self.drv.create(self.size)
        self.base = self.drv.reserve(self.size)
        self.drv.map(self.base, self.size, self.handle)
        self.drv.set_access(self.base, self.size)
        self.host = np.ctypeslib.as_array((ctypes.c_uint8 * self.size).from_address(self.base))
        self.host[:] = np.random.default_rng(seed).integers(0, 256, self.size, dtype=np.uint8)
        self.drv.api.async_work = async_work

    def close(self):
        self.drv.api.close()
        self.drv.close()


def random_wave(rng, sizes, span):
    """Sources and destinations as disjoint blocks in random order (a valid wave), byte offsets."""
    blocks = [(k, kind) for k in range(len(sizes)) for kind in (0, 1)]
    rng.shuffle(blocks)
    offsets = np.zeros((len(sizes), 2), dtype=np.int64)
    cursor = 0
    for k, kind in blocks:
        cursor += 16 * int(rng.integers(0, 4))
        offsets[k, kind] = cursor
        cursor += sizes[k]
    assert cursor <= span
    return offsets[:, 0], offsets[:, 1], np.asarray(sizes, dtype=np.int64)


def _apply(expected, src, dst, size):
    before = expected.copy()
    for s, d, n in zip(src.tolist(), dst.tolist(), size.tolist()):
        expected[d:d + n] = before[s:s + n]


def _launcher(drv, entry=host.ENTRY):
    return MoveLauncher(drv, copying._host_image(entry))


def test_the_launcher_moves_every_byte_and_reuses_its_tables():
    region = Region(16)
    drv, rng = region.drv, np.random.default_rng(1)
    launcher = _launcher(drv)
    assert launcher.load() and launcher.sm_count == 132 and launcher.blocks_per_sm == 4
    expected = region.host.copy()
    allocs = []
    for wave in range(3 * SLOTS):
        sizes = rng.integers(1, 64, int(rng.integers(1, 300))) * 16
        src, dst, size = random_wave(rng, sizes, region.size)
        _apply(expected, src, dst, size)
        launcher.move(region.base, region.size, src, dst, size)
        allocs.append(drv.faults.calls.get("cuMemAlloc", 0))
    drv.synchronize()
    assert np.array_equal(region.host, expected)
    assert launcher.launches == 3 * SLOTS
    assert allocs[SLOTS - 1] == SLOTS and allocs[-1] == SLOTS  # a table per slot, then none per wave
    # A wave with more segments than a slot holds grows that slot once (to the next power of two).
    sizes = np.full(FIRST_SEGMENTS + 1, 32, dtype=np.int64)
    src, dst, size = random_wave(rng, sizes, region.size)
    _apply(expected, src, dst, size)
    launcher.move(region.base, region.size, src, dst, size)
    drv.synchronize()
    assert np.array_equal(region.host, expected) and drv.faults.calls["cuMemAlloc"] == SLOTS + 1
    launcher.close()
    assert drv.api.kernel_state() == {"linear_buffers": 0, "linear_bytes": 0, "modules": 0, "events": 0}
    region.close()


def test_queued_waves_never_overwrite_a_table_still_in_use():
    """With the device's work queued (as a GPU runs it), more waves than slots are launched before any
    synchronize: a slot is reused only after its event, so each queued copy reads its own table."""
    region = Region(8, seed=2, async_work=True)
    rng = np.random.default_rng(2)
    launcher = _launcher(region.drv)
    launcher.load()
    expected = region.host.copy()
    for wave in range(2 * SLOTS + 1):
        src, dst, size = random_wave(rng, rng.integers(1, 40, 50) * 16, region.size)
        _apply(expected, src, dst, size)
        launcher.move(region.base, region.size, src, dst, size, stream=3)
    assert region.drv.api.queued() > 0  # the last waves are still queued
    region.drv.synchronize()
    assert np.array_equal(region.host, expected) and region.drv.api.late_faults == 0
    launcher.close()
    region.close()


def test_a_launcher_whose_image_cannot_load_says_why_and_launches_nothing():
    region = Region(2)

    def broken():
        raise KernelUnavailableError("no libNVVM here")
    launcher = MoveLauncher(region.drv, broken)
    assert launcher.load() is False and "no libNVVM" in launcher.error
    with pytest.raises(RuntimeError, match="not loaded"):
        launcher.move(region.base, region.size, np.zeros(1, np.int64), np.full(1, 16), np.full(1, 16))
    assert region.drv.api.kernel_state()["modules"] == 0
    region.close()


# ---------------------------------------------------------------- engines in a compaction
def _fragmented(pool, seed=7, count=160):
    """Tensors of random sizes (512 B - 40 KiB), 70% dropped: several waves, big and small moves."""
    rng = random.Random(seed)
    ts = [pool.empty(rng.randint(1, 80) * 512, dtype=torch.uint8) for _ in range(count)]
    for i, t in enumerate(ts):
        fill_pattern(t, i)
    keep = {i: t for i, t in enumerate(ts) if rng.random() < 0.3}
    del ts, t
    return keep


def _intact(keep) -> bool:
    return all(check_pattern(t, s) for s, t in keep.items())


def test_a_wave_mixing_the_kernel_and_the_copy_engine_moves_every_byte(make_pool, monkeypatch):
    monkeypatch.setattr(copying, "COPY_ENGINE_MIN_BYTES", 16 * KiB)
    pool = make_pool("4MiB", auto_compact=False)
    keep = _fragmented(pool)
    views = {s: t[3:50] for s, t in keep.items()}
    report = pool.compact(engine="auto", verify=True)
    launcher = copying.launcher_for(pool.driver)
    big = pool.driver.faults.calls.get("cuMemcpyDtoDAsync", 0)
    assert report.engine == "auto" and report.moved_tensors > 0
    assert launcher.launches >= 1 and big >= 1, (launcher.launches, big)
    assert _intact(keep) and all(torch.equal(v, keep[s][3:50]) for s, v in views.items())
    pool.check_invariants()


def test_without_a_loaded_kernel_auto_copies_with_the_copy_engine(make_pool, monkeypatch):
    def unavailable(entry):
        def source():
            raise RuntimeError("cannot load the kernel here")
        return source
    monkeypatch.setattr(copying, "_host_image", unavailable)
    pool = make_pool("4MiB", auto_compact=False)
    keep = _fragmented(pool)
    report = pool.compact(engine="auto", verify=True)
    assert copying.launcher_for(pool.driver).error and pool.driver.faults.calls.get("cuLaunchKernel", 0) == 0
    assert pool.driver.faults.calls["cuMemcpyDtoDAsync"] == report.moved_tensors
    assert _intact(keep)
    pool.check_invariants()


@pytest.mark.parametrize("engine", ["memmove", "driver", "auto"])
def test_one_synchronize_before_and_one_after_the_waves(make_pool, engine):
    pool = make_pool("4MiB", auto_compact=False)
    keep = _fragmented(pool)
    calls = pool.driver.faults.calls
    before = calls.get("cuCtxSynchronize", 0)
    report = pool.compact(engine=engine)
    assert report.waves >= 2, "the layout should need several waves"
    assert calls["cuCtxSynchronize"] - before == 2  # not one per wave
    assert _intact(keep)


@pytest.mark.parametrize("engine", ["driver", "auto"])
@pytest.mark.parametrize("release", [False, True])
def test_queued_copies_finish_before_the_compaction_returns_and_before_any_unmap(make_pool, monkeypatch, engine,
                                                                                release):
    """With the device's work queued until a synchronize (as a GPU runs it), every wave's copy lands
    in order, none finds its pages unmapped (invariant 5), and every byte is in place on return."""
    monkeypatch.setattr(copying, "COPY_ENGINE_MIN_BYTES", 16 * KiB)
    pool = make_pool("4MiB", auto_compact=False)
    keep = _fragmented(pool)
    api = pool.driver.api
    api.async_work = True
    report = pool.compact(engine=engine, release=release)
    assert report.waves >= 2 and api.queued() == 0 and api.late_faults == 0
    assert not release or report.unmapped_pages > 0
    api.async_work = False
    assert _intact(keep)
    pool.check_invariants()


# The tables' buffers (cuMemAlloc, cuMemAllocHost) are made when the kernel loads, not in a wave: a fault
# there is a failed load (tests/cpu/test_first_gpu_run.py).
FAULTS = [("cuLaunchKernel", 1), ("cuLaunchKernel", 2), ("cuMemcpyHtoDAsync", 1), ("cuEventRecord", 2),
          ("cuMemcpyDtoDAsync", 1), ("cuMemcpyDtoDAsync", 3), ("cuCtxSynchronize", 2)]


@pytest.mark.parametrize("call, nth", FAULTS)
def test_a_fault_at_any_copy_step_loses_nothing(make_pool, monkeypatch, call, nth):
    """A fault in the kernel's launch, its table's copy or buffers, the copy engine, or the one
    synchronize after the waves: every tensor keeps its bytes (at its old place, or at its new one for
    waves committed before), the books hold, and the pool compacts afterwards."""
    monkeypatch.setattr(copying, "COPY_ENGINE_MIN_BYTES", 16 * KiB)
    pool = make_pool("4MiB", auto_compact=False)
    keep = _fragmented(pool)
    pool.driver.faults.inject(call, CUresult.CUDA_ERROR_LAUNCH_FAILED, nth=nth)
    with pytest.raises(defrag.CudaError) as info:
        pool.compact(engine="auto")
    assert info.value.call == call and pool.driver.faults.pending() == 0
    pool.check_invariants()
    assert _intact(keep)
    pool.compact(engine="auto", verify=True)
    assert _intact(keep)
    pool.check_invariants()


# ---------------------------------------------------------------- meshing copies through the same engines
def test_meshing_copies_a_groups_pieces_in_one_launch(make_pool):
    from .test_mesh import _intact as mesh_intact
    from .test_mesh import _quarters

    pool = make_pool("1MiB", auto_compact=False)
    kept = _quarters(pool)
    report = pool.mesh(engine="auto")
    assert report.meshed_pages == 3 and copying.launcher_for(pool.driver).launches == report.groups == 1
    mesh_intact(kept)
    pool.check_invariants()


@pytest.mark.parametrize("call", ["cuLaunchKernel", "cuMemcpyHtoDAsync"])
def test_a_launch_fault_while_meshing_changes_nothing(make_pool, call):
    from .test_mesh import _intact as mesh_intact
    from .test_mesh import _quarters

    pool = make_pool("1MiB", auto_compact=False)
    kept = _quarters(pool)
    reserved = pool.stats()["reserved_bytes.all.current"]
    pool.driver.faults.inject(call, CUresult.CUDA_ERROR_LAUNCH_FAILED)
    with pytest.raises(defrag.CudaError):
        pool.mesh(engine="auto")
    assert pool.stats()["reserved_bytes.all.current"] == reserved
    mesh_intact(kept)
    pool.check_invariants()
    assert pool.mesh(engine="auto").meshed_pages == 3
    mesh_intact(kept)


def test_a_background_load_is_not_ready_until_done_and_loads_once():
    """A pool starts the load in a background thread: until it finishes, `ready` is False (engine 'auto'
    then copies with the copy engine on a GPU); a caller's `wait` joins that load instead of loading twice."""
    import threading

    region = Region(2)
    gate, calls = threading.Event(), []
    source = copying._host_image(host.ENTRY)

    def slow():
        calls.append(1)
        gate.wait(30)
        return source()
    launcher = MoveLauncher(region.drv, slow)
    launcher.start()
    launcher.start()
    assert not launcher.ready and not launcher.loaded
    waiter = threading.Thread(target=launcher.wait)
    waiter.start()
    gate.set()
    waiter.join(30)
    assert launcher.wait() and launcher.ready and calls == [1]
    assert region.drv.api.kernel_state()["modules"] == 1
    launcher.close()
    region.close()
