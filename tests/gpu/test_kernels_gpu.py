"""defrag.kernels on a real CUDA GPU, over torch CUDA tensors (device_arena(t.data_ptr(), n)).

Checks at GPU sizes: every byte of the arena against a reference computed
with torch on the device, guard bytes on both sides, checksum against
host_checksum, fill, validate, and ordering on torch's current stream. And two
measurements (reported through the `figures` fixture, never asserted on):
the move kernel against torch ``copy_`` of the same bytes, and one batched
launch against 10,000 ``copy_`` calls, each timed with CUDA events after a
warm-up (median of several samples), the bytes checked after every variant.
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


pytestmark = [
    pytest.mark.needs_cuda("torch CUDA tensors and numba's real kernels at GPU sizes"),
    pytest.mark.skipif(MODE == "cuda" and _skip_reason() is not None, reason=str(_skip_reason())),
]

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


def test_ten_thousand_tiny_moves_and_a_few_huge_ones():
    rng = np.random.default_rng(0)
    sizes = [512] * 10_000 + [8 << 20, 3 << 20, (1 << 20) + 16] + list(rng.integers(1, 300, 200) * 16)
    rng.shuffle(sizes)
    buf = DeviceArena(96 << 20, seed=0)
    check_wave(buf, random_wave(rng, sizes, 96 << 20), validate=True)


def test_adjacent_and_odd_sized_moves():
    buf = DeviceArena(1 << 20, seed=1)
    moves = np.array(
        [[0, 4096, 4096], [16384, 8192, 8192], [65536, 65536 + 16, 16], [131072, 131072 + 48, 48],
         [262144, 262144 + 300000 - 300000 % 16, 300000 - 300000 % 16]]
    )
    check_wave(buf, moves, validate=True)


def test_default_stream_and_zero_moves():
    buf = DeviceArena(1 << 16, seed=2)
    before = buf.t.clone()
    dk.batched_move(buf.arena, np.zeros((0, 3), np.int64))
    torch.cuda.synchronize()
    assert torch.equal(buf.t, before)
    dk.batched_move(buf.arena, [[0, 32768, 4096]])  # stream=None: the default stream
    torch.cuda.synchronize()
    assert torch.equal(buf.t[32768 : 32768 + 4096], before[:4096])


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


def test_checksum_is_position_sensitive():
    buf = DeviceArena(1 << 16, seed=5)
    a = dk.checksum(buf.arena, [[0, 4096]])[0]
    word2 = buf.t[32:48].clone()
    buf.t[32:48] = buf.t[512:528]
    buf.t[512:528] = word2
    torch.cuda.synchronize()
    assert dk.checksum(buf.arena, [[0, 4096]])[0] != a


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
