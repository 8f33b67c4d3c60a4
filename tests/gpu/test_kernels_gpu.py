"""defrag.kernels on a real CUDA GPU, over torch CUDA tensors (device_arena(t.data_ptr(), n)).

Checks at GPU sizes: every byte of the arena against a reference computed
with torch on the device, guard bytes on both sides, checksum against
host_checksum, fill, validate, and ordering on torch's current stream. And two
measurements (reported through the `figures` fixture, never asserted on):
the move kernel against torch ``copy_`` of the same bytes, and one batched
launch against 10,000 ``copy_`` calls, each timed with CUDA events after a
warm-up (median of several samples), the bytes checked after every variant.

The compactor's own launch path (`kernels.launch.MoveLauncher`: the cubin
cached on disk, cuLaunchKernel through defrag's driver) is checked the same
way, with the figures its goals are about: one move of 1-256 MiB by the launcher, the
copy engine and engine="auto" against ``copy_``; 10,000 moves of 4 KiB in one
launch; a mixed wave against one contiguous ``copy_``; the image compiled once
and loaded without numba in a later process. The last test (a compaction
with engine="auto" mixing both engines) also runs in the GPU rehearsal.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import defrag.kernels as dk

from .conftest import MODE


def _skip_reason():
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (torch.cuda.is_available() is False)"
    if dk.is_simulator():
        return "numba.cuda is the simulator (NUMBA_ENABLE_CUDASIM is set); these tests need the real GPU"
    return None


pytestmark = [pytest.mark.skipif(MODE == "cuda" and _skip_reason() is not None, reason=str(_skip_reason()))]
# Every test here but the last needs CUDA itself; the last runs in the GPU rehearsal too.
_cuda_only = pytest.mark.needs_cuda("torch CUDA tensors and numba's real kernels at GPU sizes")

GUARD = 1 << 16


def torch_stream():
    from numba import cuda

    handle = torch.cuda.current_stream().cuda_stream
    return cuda.external_stream(handle) if handle else cuda.default_stream()


def cuda_ms(fn, *, repeat: int = 10, warmup: int = 3) -> float:
    """Median milliseconds of fn() on the current stream: the benchmarks' own CUDA-event timer."""
    from defrag.benchmarks.runner import time_cuda

    return time_cuda(fn, number=1, repeat=repeat, warmup=warmup).median_us / 1e3


class DeviceArena:
    """``nbytes`` of random bytes in a CUDA tensor with GUARD random bytes on each side."""

    def __init__(self, nbytes: int, seed: int = 0):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.raw = torch.randint(0, 256, (nbytes + 2 * GUARD,), dtype=torch.uint8, device="cuda", generator=gen)
        self.t = self.raw[GUARD : GUARD + nbytes]
        assert self.t.data_ptr() % 256 == 0
        self.guards = torch.cat([self.raw[:GUARD], self.raw[GUARD + nbytes :]]).clone()
        self.arena = dk.device_arena(self.t.data_ptr(), nbytes)

    def assert_guards_intact(self):
        torch.cuda.synchronize()
        now = torch.cat([self.raw[:GUARD], self.raw[GUARD + self.t.numel() :]])
        assert torch.equal(now, self.guards), "bytes outside the arena changed"


def random_wave(rng, sizes, arena_bytes, max_gap=4096):
    """Precondition-satisfying wave: sources and destinations as disjoint blocks in random order."""
    sizes = [int(s) for s in sizes]
    blocks = [(k, kind) for k in range(len(sizes)) for kind in (0, 1)]
    order = rng.permutation(len(blocks))
    offsets = np.zeros((len(sizes), 2), dtype=np.int64)
    gaps = np.where(rng.random(len(blocks)) < 0.4, 0, rng.integers(0, max_gap // 16 + 1, len(blocks)) * 16)
    cursor = 0
    for pos, b in enumerate(order):
        k, kind = blocks[b]
        cursor += int(gaps[pos])
        offsets[k, kind] = cursor
        cursor += sizes[k]
    assert cursor <= arena_bytes
    return np.column_stack([offsets[:, 0], offsets[:, 1], np.array(sizes, dtype=np.int64)])


def check_wave(buf: DeviceArena, moves, **kw):
    before = buf.t.clone()
    expected = before.clone()
    for s, d, n in moves.tolist():
        expected[d : d + n] = before[s : s + n]
    torch.cuda.synchronize()
    dk.batched_move(buf.arena, moves, stream=torch_stream(), **kw)
    torch.cuda.current_stream().synchronize()
    bad = torch.nonzero(buf.t != expected)
    assert bad.numel() == 0, f"{bad.numel()} wrong bytes, first at {int(bad[0])}"
    buf.assert_guards_intact()


@_cuda_only
def test_ten_thousand_tiny_moves_and_a_few_huge_ones():
    rng = np.random.default_rng(0)
    sizes = [512] * 10_000 + [8 << 20, 3 << 20, (1 << 20) + 16] + list(rng.integers(1, 300, 200) * 16)
    rng.shuffle(sizes)
    buf = DeviceArena(96 << 20, seed=0)
    check_wave(buf, random_wave(rng, sizes, 96 << 20), validate=True)


@_cuda_only
def test_adjacent_and_odd_sized_moves():
    buf = DeviceArena(1 << 20, seed=1)
    moves = np.array(
        [[0, 4096, 4096], [16384, 8192, 8192], [65536, 65536 + 16, 16], [131072, 131072 + 48, 48],
         [262144, 262144 + 300000 - 300000 % 16, 300000 - 300000 % 16]]
    )
    check_wave(buf, moves, validate=True)


@_cuda_only
def test_default_stream_and_zero_moves():
    buf = DeviceArena(1 << 16, seed=2)
    before = buf.t.clone()
    dk.batched_move(buf.arena, np.zeros((0, 3), np.int64))
    torch.cuda.synchronize()
    assert torch.equal(buf.t, before)
    dk.batched_move(buf.arena, [[0, 32768, 4096]])  # stream=None: the default stream
    torch.cuda.synchronize()
    assert torch.equal(buf.t[32768 : 32768 + 4096], before[:4096])


@_cuda_only
def test_runs_in_order_on_torch_stream():
    """A move enqueued on a side stream sees a fill enqueued just before it on that stream."""
    buf = DeviceArena(256 << 20, seed=3)
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        buf.t[: 128 << 20].fill_(7)
        dk.batched_move(buf.arena, [[0, 128 << 20, 128 << 20]], stream=torch_stream())
    side.synchronize()
    assert bool((buf.t[128 << 20 :] == 7).all())


@_cuda_only
def test_checksum_matches_host_and_follows_moves():
    rng = np.random.default_rng(4)
    buf = DeviceArena(16 << 20, seed=4)
    ranges = [[0, 16 << 20], [0, 0], [16, 16], [4096, 1 << 20]]
    for _ in range(500):
        off = int(rng.integers(0, (16 << 20) // 16)) * 16
        ranges.append([off, int(rng.integers(0, min(1 << 16, (16 << 20) - off) // 16 + 1)) * 16])
    got = dk.checksum(buf.arena, ranges, stream=torch_stream())
    host = buf.t.cpu().numpy()
    assert got.tolist() == [dk.host_checksum(host[o : o + n]) for o, n in ranges]

    moves = random_wave(rng, [512] * 1000 + [1 << 20], 16 << 20)
    before = dk.checksum(buf.arena, moves[:, [0, 2]])
    dk.batched_move(buf.arena, moves, validate=True)
    after = dk.checksum(buf.arena, moves[:, [1, 2]])  # default stream: ordered after the move
    assert before.tolist() == after.tolist()


@_cuda_only
def test_checksum_is_position_sensitive():
    buf = DeviceArena(1 << 16, seed=5)
    a = dk.checksum(buf.arena, [[0, 4096]])[0]
    word2 = buf.t[32:48].clone()
    buf.t[32:48] = buf.t[512:528]
    buf.t[512:528] = word2
    torch.cuda.synchronize()
    assert dk.checksum(buf.arena, [[0, 4096]])[0] != a


@_cuda_only
def test_fill():
    buf = DeviceArena(8 << 20, seed=6)
    ranges = np.array([[0, 512], [4096, 16], [1 << 20, 3 << 20], [(2 << 20), 1 << 20]])
    expected = buf.t.clone()
    for o, n in ranges:
        expected[o : o + n] = 0x5A
    dk.fill(buf.arena, ranges, 0x5A, stream=torch_stream())
    torch.cuda.current_stream().synchronize()
    assert torch.equal(buf.t, expected)
    buf.assert_guards_intact()


@_cuda_only
def test_validate_and_bounds():
    buf = DeviceArena(1 << 16, seed=7)
    before = buf.t.clone()
    with pytest.raises(ValueError, match="moves 0 and 1 overlap"):
        dk.batched_move(buf.arena, [[0, 4096, 1024], [2048, 4608, 1024]], validate=True)
    with pytest.raises(ValueError, match="past the end"):
        dk.batched_move(buf.arena, [[0, (1 << 16) - 16, 32]])
    misaligned = dk.device_arena(buf.t.data_ptr() + 8, 4096)
    with pytest.raises(ValueError, match="aligned"):
        dk.batched_move(misaligned, [[0, 1024, 16]])
    torch.cuda.synchronize()
    assert torch.equal(buf.t, before)


@_cuda_only
def test_move_kernel_against_copy_of_the_same_bytes(figures):
    """One move of N bytes by batched_move and by torch copy_, same buffers; bytes checked after each."""
    stream = torch_stream()
    for size in (16 << 20, 256 << 20):  # 256 MiB: far beyond the 60 MB L2
        buf = DeviceArena(2 * size, seed=8)
        src, dst = buf.t[:size], buf.t[size:]
        moves = np.array([[0, size, size]], dtype=np.int64)
        dst.zero_()  # poisoned: the copy must write every byte
        kernel = cuda_ms(lambda: dk.batched_move(buf.arena, moves, stream=stream))
        assert torch.equal(dst, src)
        dst.zero_()
        copy = cuda_ms(lambda: dst.copy_(src))
        assert torch.equal(dst, src)
        buf.assert_guards_intact()
        mib = size >> 20
        figures.add(f"batched_move {mib} MiB", size / kernel / 1e6, "GB/s", ms=kernel, bus_gbps=2 * size / kernel / 1e6)
        figures.add(f"torch copy_ {mib} MiB", size / copy / 1e6, "GB/s", ms=copy, bus_gbps=2 * size / copy / 1e6)
        figures.add(f"batched_move / copy_ bandwidth, {mib} MiB", copy / kernel, "x")


@_cuda_only
def test_one_batched_launch_against_ten_thousand_copies(figures):
    """10,000 scattered 4 KiB moves: ONE batched_move launch vs one copy_ per tensor; both give the same bytes."""
    n, nbytes = 10_000, 4096
    region = n * nbytes
    buf = DeviceArena(3 * region, seed=9)
    perm = np.random.default_rng(9).permutation(n)
    moves = np.column_stack([np.arange(n) * nbytes, region + perm * nbytes, np.full(n, nbytes)]).astype(np.int64)
    pairs = [(buf.t[2 * region + int(p) * nbytes: 2 * region + (int(p) + 1) * nbytes], buf.t[i * nbytes: (i + 1) * nbytes])
             for i, p in enumerate(perm)]
    stream = torch_stream()

    def batched():
        dk.batched_move(buf.arena, moves, stream=stream)

    def per_tensor():
        for dst, src in pairs:
            dst.copy_(src)

    buf.t[region:].zero_()
    batched_ms = cuda_ms(batched, repeat=10, warmup=2)
    per_ms = cuda_ms(per_tensor, repeat=3, warmup=1)
    torch.cuda.synchronize()
    assert torch.equal(buf.t[region: 2 * region], buf.t[2 * region:])  # the same bytes by both routes
    assert not bool((buf.t[region: 2 * region] == 0).all())
    host = {}
    for name, fn in (("batched", batched), ("per_tensor", per_tensor)):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        host[name] = (time.perf_counter() - t0) * 1e3
    buf.assert_guards_intact()
    figures.add("one batched_move launch, 10k x 4 KiB", batched_ms, "ms", host_ms=host["batched"])
    figures.add("10k torch copy_ calls, 10k x 4 KiB", per_ms, "ms", host_ms=host["per_tensor"])
    figures.add("batched launch speedup over 10k copy_", per_ms / batched_ms, "x")


# ---------------------------------------------------------------- the compactor's launch path (kernels.launch)
# The launcher (one cubin per machine, a persistent table, cuLaunchKernel through defrag's driver) is what
# compactions, meshing and packing copy with. In a rehearsal the tests marked needs_cuda skip; the ones
# below them run the same code against the emulated device's host twin at the GPU's sizes.

def _launcher():
    from defrag import copying
    from defrag.driver import open_driver

    launcher = copying.launcher_for(open_driver("cuda:0"))
    assert launcher.wait(), f"the move kernel did not load: {launcher.error}"
    return launcher


def _tensor_moves(launcher, buf: DeviceArena, moves) -> None:
    moves = np.asarray(moves, dtype=np.int64)
    launcher.move(buf.t.data_ptr(), buf.t.numel(), moves[:, 0], moves[:, 1], moves[:, 2],
                  stream=torch.cuda.current_stream().cuda_stream)


@_cuda_only
def test_the_launcher_moves_every_byte_at_gpu_sizes(figures):
    """10,000 tiny moves and a few huge ones in ONE launch through the launcher; every byte, the guards."""
    launcher = _launcher()
    rng = np.random.default_rng(10)
    sizes = [512] * 10_000 + [8 << 20, 3 << 20, (1 << 20) + 16] + list(rng.integers(1, 300, 200) * 16)
    rng.shuffle(sizes)
    buf = DeviceArena(96 << 20, seed=10)
    moves = random_wave(rng, sizes, 96 << 20)
    before = buf.t.clone()
    expected = before.clone()
    for s, d, n in moves.tolist():
        expected[d: d + n] = before[s: s + n]
    torch.cuda.synchronize()
    _tensor_moves(launcher, buf, moves)
    torch.cuda.current_stream().synchronize()
    bad = torch.nonzero(buf.t != expected)
    assert bad.numel() == 0, f"{bad.numel()} wrong bytes, first at {int(bad[0])}"
    buf.assert_guards_intact()
    figures.add("move kernel image", launcher.origin, "", registers=launcher.registers,
                blocks_per_sm=launcher.blocks_per_sm, sm_count=launcher.sm_count)


@_cuda_only
def test_the_launch_geometry_reaches_every_sm_from_a_mib():
    launcher = _launcher()
    blocks, threads, chunk = launcher.geometry((1 << 20) // 16)
    assert launcher.blocks_per_sm >= 1 and blocks >= launcher.sm_count, (blocks, launcher.sm_count)
    assert launcher.geometry((256 << 20) // 16)[0] == launcher.sm_count * launcher.blocks_per_sm


@_cuda_only
def test_the_launcher_runs_in_order_on_the_stream_it_is_given():
    launcher = _launcher()
    buf = DeviceArena(64 << 20, seed=11)
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        buf.t[: 32 << 20].fill_(9)
        _tensor_moves(launcher, buf, [[0, 32 << 20, 32 << 20]])
    side.synchronize()
    assert bool((buf.t[32 << 20:] == 9).all())


@_cuda_only
def test_the_kernel_image_is_compiled_once_per_machine_and_loads_without_numba(tmp_path, figures):
    """A fresh process with an empty cache compiles the cubin; the next one loads it from disk, never
    imports numba, and has the kernel ready well before a first compaction needs it."""
    from .conftest import fresh_process, last_json

    script = """
        import json, sys, time
        t0 = time.perf_counter()
        import defrag
        from defrag import copying
        pool = defrag.Pool(device="cuda:0", capacity="64MiB")  # starts loading the kernel in the background
        launcher = copying.launcher_for(pool.driver)
        ready = launcher.wait()
        print(json.dumps({"ready": ready, "origin": launcher.origin, "error": launcher.error,
                          "seconds": time.perf_counter() - t0, "numba": "numba" in sys.modules}))
    """
    env = {"DEFRAG_KERNEL_CACHE": str(tmp_path)}
    first = last_json(fresh_process(script, env=env))
    second = last_json(fresh_process(script, env=env))
    assert first["ready"] and first["origin"] == "built", first
    assert second["ready"] and second["origin"] == "cache", second
    assert not second["numba"], "a cached image should load without importing numba"
    figures.add("first process on a machine: import + pool + kernel compiled", first["seconds"] * 1e3, "ms")
    figures.add("later process: import + pool + kernel loaded from disk", second["seconds"] * 1e3, "ms")


@_cuda_only
def test_launcher_and_copy_engine_against_copy_of_one_move(figures):
    """One move of 1, 16, 64 and 256 MiB: the launcher, the copy engine and the compaction's own choice
    (engine="auto") against torch copy_ of the same bytes (CUDA events); bytes checked after each."""
    from defrag import copying
    from defrag.driver import open_driver

    launcher = _launcher()
    drv = open_driver("cuda:0")
    stream = torch.cuda.current_stream().cuda_stream
    for size in (1 << 20, 16 << 20, 64 << 20, 256 << 20):
        buf = DeviceArena(2 * size, seed=12)
        src, dst = buf.t[:size], buf.t[size:]
        a = buf.t.data_ptr()
        z = np.zeros(1, np.int64)
        one = (z, z + size, z + size)
        results = {}
        for name, fn in (("launcher", lambda: launcher.move(a, 2 * size, *one, stream=stream)),
                         ("copy engine", lambda: drv.copy(a + size, a, size, stream)),
                         ("auto", lambda: copying._copy_auto(_Core(drv), stream, [(a, a + size, size)])),
                         ("copy_", lambda: dst.copy_(src))):
            dst.zero_()
            results[name] = cuda_ms(fn)
            assert torch.equal(dst, src), name
        mib = size >> 20
        for name in ("launcher", "copy engine", "auto"):
            figures.add(f"{name} / copy_, one move of {mib} MiB", results["copy_"] / results[name], "x",
                        ms=results[name], copy_ms=results["copy_"],
                        goal=">= 0.5x" if size == 1 << 20 else ">= 0.9x")
        figures.add(f"copy engine faster than the launcher at {mib} MiB", results["copy engine"] < results["launcher"],
                    "", crossover_constant_mib=copying.COPY_ENGINE_MIN_BYTES >> 20)
        buf.assert_guards_intact()


class _Core:
    """What copy_ranges reads of a core: its driver and kind."""

    def __init__(self, driver):
        self.driver, self.kind = driver, driver.kind


@_cuda_only
def test_one_launch_of_ten_thousand_moves_against_ten_thousand_copies(figures):
    n, nbytes = 10_000, 4096
    region = n * nbytes
    buf = DeviceArena(3 * region, seed=13)
    perm = np.random.default_rng(13).permutation(n)
    moves = np.column_stack([np.arange(n) * nbytes, region + perm * nbytes, np.full(n, nbytes)]).astype(np.int64)
    pairs = [(buf.t[2 * region + int(p) * nbytes: 2 * region + (int(p) + 1) * nbytes], buf.t[i * nbytes: (i + 1) * nbytes])
             for i, p in enumerate(perm)]
    launcher = _launcher()
    buf.t[region:].zero_()
    launch_ms = cuda_ms(lambda: _tensor_moves(launcher, buf, moves))
    per_ms = cuda_ms(lambda: [d.copy_(s) for d, s in pairs], repeat=3, warmup=1)
    torch.cuda.synchronize()
    assert torch.equal(buf.t[region: 2 * region], buf.t[2 * region:])
    t0 = time.perf_counter()
    _tensor_moves(launcher, buf, moves)
    host_us = (time.perf_counter() - t0) * 1e6
    torch.cuda.synchronize()
    figures.add("launcher: one launch of 10k x 4 KiB", launch_ms, "ms", host_us=host_us)
    figures.add("launcher speedup over 10k copy_", per_ms / launch_ms, "x", goal=">= 10x")


@_cuda_only
def test_a_mixed_wave_against_one_contiguous_copy(figures):
    """3,000 moves of log-uniform 64 KiB - 4 MiB (a compaction's wave) through the compaction's engine
    choice, against one copy_ of the same total bytes."""
    from defrag import copying
    from defrag.driver import open_driver

    rng = np.random.default_rng(14)
    sizes = (np.exp(rng.uniform(np.log(64 << 10), np.log(4 << 20), 3000)).astype(np.int64) // 512) * 512
    total = int(sizes.sum())
    buf = DeviceArena(2 * total + (64 << 20), seed=14)
    moves = random_wave(rng, sizes, buf.t.numel(), max_gap=0)
    a = buf.t.data_ptr()
    drv = open_driver("cuda:0")
    _launcher()
    stream = torch.cuda.current_stream().cuda_stream
    triples = [(a + s, a + d, n) for s, d, n in moves.tolist()]
    expected = buf.t.clone()
    for s, d, n in moves.tolist():
        expected[d: d + n] = buf.t[s: s + n]
    wave_ms = cuda_ms(lambda: copying._copy_auto(_Core(drv), stream, triples), repeat=5, warmup=1)
    torch.cuda.synchronize()
    assert torch.equal(buf.t, expected)
    flat = torch.empty(2 * total, dtype=torch.uint8, device="cuda")
    x, y = flat[:total], flat[total:]
    contiguous_ms = cuda_ms(lambda: y.copy_(x))
    figures.add("mixed wave (3,000 moves, 64 KiB-4 MiB) / one contiguous copy_", contiguous_ms / wave_ms, "x",
                wave_ms=wave_ms, copy_ms=contiguous_ms, moved_bytes=total, goal=">= 0.8x")


# ---------------------------------------------------------------- rehearsed too: compactions through engine="auto"

def test_auto_engine_compaction_mixes_engines_and_keeps_every_byte(make_pool, monkeypatch):
    """On the GPU the cubin; in a rehearsal the host twin: a compaction whose wave mixes the kernel
    (small moves) and the copy engine (moves from 256 KiB here) moves every byte, and synchronizes once
    after its waves."""
    from defrag import copying

    monkeypatch.setattr(copying, "COPY_ENGINE_MIN_BYTES", 256 << 10)
    pool = make_pool("256MiB", auto_compact=False)
    rng = np.random.default_rng(15)
    ts = [pool.empty(int(n), dtype=torch.uint8) for n in rng.integers(1, 2000, 300) * 512]
    for i, t in enumerate(ts):
        t.fill_(i % 251 + 1)
    keep = {i: t for i, t in enumerate(ts) if rng.random() < 0.3}
    del ts, t
    expected = {i: t.clone() for i, t in keep.items()}
    calls = pool.driver.faults.calls
    syncs = calls.get("cuCtxSynchronize", 0)
    copying.launcher_for(pool.driver).wait()
    report = pool.compact(engine="auto", verify=True)
    assert report.moved_tensors > 0 and calls.get("cuLaunchKernel", 0) > 0 and calls.get("cuMemcpyDtoDAsync", 0) > 0
    assert calls["cuCtxSynchronize"] - syncs == 2 + report.waves  # before, after the waves, and verify's per wave
    assert all(torch.equal(t, expected[i]) for i, t in keep.items())
    pool.check_invariants()
