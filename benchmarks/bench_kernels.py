"""Microbenchmarks of defrag.kernels: copy bandwidth, and one batched launch vs one copy per tensor.

Plain functions returning lists of dicts (one row per measurement); the
runner writes them out. Every row carries ``backend``:

- ``"cuda"``: a real GPU. Times come from torch.cuda.Event pairs around
  ``iters`` back-to-back calls on torch's current stream, after warm-up and a
  synchronize, divided by ``iters``. They include everything a caller pays
  per call that delays the GPU (for ``batched_move``: building the segment
  table, copying it to the device, the launch). ``gbps`` is payload bytes
  moved per second (1e9 B/s); ``bus_gbps`` counts the read and the write
  (2x), which is what a bandwidth roofline compares against.
- ``"simulator"``: numba's CPU simulator over host memory, tiny sizes only,
  wall-clock via time.perf_counter. These numbers say how slow the simulator
  is, nothing about a GPU.
- ``"cpu"``: torch's CPU ``copy_`` over the same host memory, as a reference
  for the simulator rows.

A row with ``skipped`` (and a reason) replaces measurements that cannot be
taken on this machine.
"""

from __future__ import annotations

import time

import numpy as np

import defrag.kernels as dk

SIM_MAX_BYTES = 16 * 1024  # the simulator runs a Python thread per CUDA thread
SIM_MAX_MOVES = 64


def _backend(device) -> tuple[str, str | None]:
    """Return (backend, skip_reason) for a device spec ("cuda", "cuda:N", "cpu", "simulator", ...)."""
    name = str(device)
    if name.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return "cuda", "torch.cuda.is_available() is False"
        if dk.is_simulator():
            return "cuda", "numba.cuda is the simulator (NUMBA_ENABLE_CUDASIM is set)"
        return "cuda", None
    try:
        sim = dk.is_simulator()
    except dk.KernelUnavailableError as e:  # pragma: no cover - is_simulator only imports
        return "simulator", str(e)
    if not sim:
        return "simulator", "set NUMBA_ENABLE_CUDASIM=1 before numba.cuda is imported to run on the CPU"
    return "simulator", None


def _round16(n: int) -> int:
    return max(16, (int(n) + 15) // 16 * 16)


# --------------------------------------------------------------------------- GPU helpers


def _cuda_setup(device):
    import torch
    from numba import cuda

    torch.cuda.set_device(torch.device(device))
    return torch, cuda.external_stream(torch.cuda.current_stream().cuda_stream)


def _cuda_time_ms(torch, fn, iters: int, warmup: int) -> float:
    """Mean milliseconds per call of fn() on torch's current stream, by CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def _row(bench, backend, method, nbytes, ms, **extra):
    row = {"bench": bench, "backend": backend, "method": method, "bytes": int(nbytes), "ms": ms}
    if ms and ms > 0:
        row["gbps"] = nbytes / (ms * 1e-3) / 1e9
        row["bus_gbps"] = 2 * nbytes / (ms * 1e-3) / 1e9
    row.update(extra)
    return row


# --------------------------------------------------------------------------- host helpers


def _host_arena(nbytes: int, seed: int = 0):
    """A 16-byte-aligned host buffer (numpy view) and its simulator arena."""
    raw = np.random.default_rng(seed).integers(0, 256, nbytes + 64, dtype=np.uint8)
    start = (-raw.ctypes.data) % 64
    host = raw[start : start + nbytes]
    return host, dk.device_arena(host.ctypes.data, nbytes)


def _wall_ms(fn, iters: int) -> float:
    fn()  # warm-up (first call compiles/jit-loads)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / iters


# --------------------------------------------------------------------------- benchmarks


def bench_move_bandwidth(device, sizes, smoke: bool = False) -> list[dict]:
    """One move of each size with batched_move vs torch ``dst.copy_(src)`` of the same bytes.

    ``sizes`` in bytes (rounded up to 16). On a GPU source and destination are
    disjoint halves of one tensor; under the simulator sizes are capped at
    SIM_MAX_BYTES and the reference is torch's CPU copy over the same memory.
    """
    backend, skip = _backend(device)
    if skip:
        return [{"bench": "move_bandwidth", "backend": backend, "skipped": skip}]
    sizes = [_round16(s) for s in sizes]
    if smoke:
        sizes = sizes[:2]
    rows = []
    if backend == "cuda":
        torch, stream = _cuda_setup(device)
        name = torch.cuda.get_device_name()
        for size in sizes:
            half = (size + 511) // 512 * 512
            buf = torch.empty(2 * half, dtype=torch.uint8, device=device)
            arena = dk.device_arena(buf.data_ptr(), buf.numel())
            moves = np.array([[0, half, size]], dtype=np.int64)
            src, dst = buf[:size], buf[half : half + size]
            iters = 3 if smoke else int(min(200, max(5, (4 << 30) // size)))
            ms_k = _cuda_time_ms(torch, lambda: dk.batched_move(arena, moves, stream=stream), iters, 3)
            ms_t = _cuda_time_ms(torch, lambda: dst.copy_(src), iters, 3)
            rows.append(_row("move_bandwidth", "cuda", "batched_move", size, ms_k, iters=iters, device=name))
            rows.append(_row("move_bandwidth", "cuda", "torch.copy_", size, ms_t, iters=iters, device=name))
            del buf, arena
        return rows

    import torch

    for size in [s for s in sizes if s <= SIM_MAX_BYTES] or [SIM_MAX_BYTES]:
        host, arena = _host_arena(2 * size)
        moves = np.array([[0, size, size]], dtype=np.int64)
        iters = 1 if smoke else 3
        ms_k = _wall_ms(lambda: dk.batched_move(arena, moves), iters)
        t = torch.from_numpy(host)
        ms_t = _wall_ms(lambda: t[size:].copy_(t[:size]), iters)
        rows.append(_row("move_bandwidth", "simulator", "batched_move", size, ms_k, iters=iters))
        rows.append(_row("move_bandwidth", "cpu", "torch.copy_", size, ms_t, iters=iters))
    skipped = [s for s in sizes if s > SIM_MAX_BYTES]
    if skipped:
        rows.append(
            {"bench": "move_bandwidth", "backend": "simulator", "skipped": f"sizes {skipped} exceed SIM_MAX_BYTES"}
        )
    return rows


def bench_batched_vs_per_tensor(device, n_moves: int = 10_000, move_bytes: int = 4096, smoke: bool = False) -> list[dict]:
    """n_moves scattered moves of move_bytes: ONE batched_move launch vs one copy call per move.

    On a GPU the batched side is the compactor's launcher (`kernels.launch`);
    under the simulator, `batched_move`. The per-tensor baseline is what a
    compactor without batching would do:
    torch ``dst.copy_(src)`` per tensor on a GPU (n launches and n Python
    calls). Destinations are a random permutation of slots in a separate
    region, so no two moves are adjacent. Rows also report ``host_ms``: wall
    time of the call(s) plus a synchronize, which shows Python/launch overhead
    the event timing can hide when the GPU is not idle.
    """
    backend, skip = _backend(device)
    if skip:
        return [{"bench": "batched_vs_per_tensor", "backend": backend, "skipped": skip}]
    move_bytes = _round16(move_bytes)
    if smoke:
        n_moves = min(n_moves, 100)
    if backend == "simulator":
        n_moves, move_bytes = min(n_moves, 8 if smoke else SIM_MAX_MOVES), min(move_bytes, 512)
    region = n_moves * move_bytes
    perm = np.random.default_rng(0).permutation(n_moves)
    moves = np.column_stack(
        [np.arange(n_moves) * move_bytes, region + perm * move_bytes, np.full(n_moves, move_bytes)]
    ).astype(np.int64)
    total = region  # payload bytes per repetition
    rows = []
    if backend == "cuda":
        from defrag import copying
        from defrag.driver import open_driver

        torch, _ = _cuda_setup(device)
        name = torch.cuda.get_device_name()
        buf = torch.randint(0, 256, (2 * region,), dtype=torch.uint8, device=device)
        pairs = [(buf[d : d + n], buf[s : s + n]) for s, d, n in moves.tolist()]
        # The compactor's own launch path: one cuLaunchKernel of the cached cubin, a staged table.
        launcher = copying.launcher_for(open_driver(device))
        if not launcher.wait():
            return [{"bench": "batched_vs_per_tensor", "backend": "cuda", "skipped": launcher.error}]
        base, span, stream = buf.data_ptr(), buf.numel(), torch.cuda.current_stream().cuda_stream
        cols = (moves[:, 0].copy(), moves[:, 1].copy(), moves[:, 2].copy())

        def batched():
            launcher.move(base, span, *cols, stream=stream)

        def per_tensor():
            for dst, src in pairs:
                dst.copy_(src)

        iters = 2 if smoke else 10
        for method, fn, launches in (("move kernel launch (MoveLauncher)", batched, 1),
                                     ("torch.copy_ per tensor", per_tensor, n_moves)):
            ms = _cuda_time_ms(torch, fn, iters, 2)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            host_ms = (time.perf_counter() - t0) * 1e3
            rows.append(
                _row("batched_vs_per_tensor", "cuda", method, total, ms, launches=launches,
                     n_moves=n_moves, move_bytes=move_bytes, host_ms=host_ms, iters=iters, device=name)
            )
        return rows

    host, arena = _host_arena(2 * region)
    iters = 1
    ms_b = _wall_ms(lambda: dk.batched_move(arena, moves), iters)
    ms_p = _wall_ms(lambda: [dk.batched_move(arena, moves[i : i + 1]) for i in range(n_moves)], iters)
    common = dict(n_moves=n_moves, move_bytes=move_bytes, iters=iters)
    rows.append(_row("batched_vs_per_tensor", "simulator", "batched_move", total, ms_b, launches=1, **common))
    rows.append(
        _row("batched_vs_per_tensor", "simulator", "batched_move per tensor", total, ms_p, launches=n_moves, **common)
    )
    return rows


if __name__ == "__main__":  # python -m defrag.benchmarks.bench_kernels [cuda|simulator] [--smoke]
    import json
    import sys

    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    dev = args[0] if args else "cuda"
    smoke = "--smoke" in sys.argv
    sizes = [4096, 1 << 16, 1 << 20, 16 << 20, 256 << 20, 1 << 30]
    for r in bench_move_bandwidth(dev, sizes, smoke=smoke) + bench_batched_vs_per_tensor(dev, smoke=smoke):
        print(json.dumps(r))
