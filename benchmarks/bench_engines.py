"""The compaction's copy engines at the device's copy bandwidth: one move, a mixed wave, whole compactions.

Every row compares with a baseline measured in the same run. On a GPU
(``cuda:N``) copies are timed with CUDA events (`runner.time_cuda`) and
compactions with the host clock around the call and a synchronize; on the
emulated device everything is host time, the move kernel is its host twin
(the GPU's launch path run against the emulated driver) and the goals are
not judged (they are the GPU's).

- ``engine_crossover``: one move of N bytes (256 KiB - 1 GiB on a GPU) by the
  move kernel through the compactor's launcher and by the copy engine
  (`Driver.copy`), same buffers; then the smallest size from which the copy
  engine is at least as fast, beside `copying.COPY_ENGINE_MIN_BYTES` (the
  constant engine="auto" uses: set it to what this measures).
- ``mixed_wave``: 3,000 moves of log-uniform sizes 64 KiB - 4 MiB inside one
  pool tensor (sources and destinations interleaved at random, a valid wave)
  through the compaction's engine choice (`copying.copy_ranges`,
  engine="auto"), against one ``copy_`` of the same total bytes (GPU goal:
  >= 0.8x). Emulated: 300 moves of 64 KiB - 1 MiB against one memmove.
- ``compaction_gpu``: the layout of the GPU report that opened this work:
  8,710 tensors of log-uniform 64 KiB - 4 MiB, every byte written, half of
  them dropped at random, then ``pool.compact()`` (about 2 GB moved; GPU
  goal: under 20 ms), against one ``copy_`` of the moved bytes; the same
  first compaction in a fresh process (the kernel loads in the background
  from pool creation; GPU goal: under 50 ms); and the automatic trigger
  serving a request that only a compaction makes room for. Emulated: 600
  tensors of 64 KiB - 1 MiB.
"""

from __future__ import annotations

import ctypes
import json
import statistics
import subprocess
import time

import numpy as np
import torch

from .bench_compaction import CoreView, OneCopy
from .runner import Skip, child_command, device_sync, gbps, time_cuda, time_host

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

MIXED_GOAL_X = 0.8
COMPACTION_GOAL_MS = 20.0
FIRST_COMPACTION_GOAL_MS = 50.0
REPORT_LAYOUT = dict(count=8710, lo=64 * KiB, hi=4 * MiB, seed=34)


def _launcher(pool):
    from defrag import copying

    launcher = copying.launcher_for(pool.driver)
    if launcher is None or not launcher.wait():
        raise Skip(f"the move kernel cannot be loaded here: {getattr(launcher, 'error', 'no launcher')}")
    return launcher


def _pool(device: str, capacity: int):
    from .runner import device_pool

    return device_pool(device, capacity)


def _timer(device: str):
    """(time a copy function: seconds per call, its name)."""
    if device.startswith("cuda"):
        return (lambda fn, number, repeat: time_cuda(fn, number=number, repeat=repeat)), "cuda events"
    return (lambda fn, number, repeat: time_host(fn, number=number, repeat=repeat)), "perf_counter"


def _stream(pool) -> int:
    return torch.cuda.current_stream(pool.device).cuda_stream if pool.kind == "cuda" else 0


# --------------------------------------------------------------------------- one move: kernel vs copy engine


def bench_engine_crossover(device: str, smoke: bool) -> list[dict]:
    """One move of N bytes by the move kernel (launcher) and by the copy engine; the measured crossover."""
    from defrag import copying

    gpu = device.startswith("cuda")
    if gpu:
        sizes = (1 * MiB, 64 * MiB) if smoke else (256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, GiB)
    else:
        sizes = (64 * KiB, 1 * MiB) if smoke else (64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB)
    timer, timing = _timer(device)
    repeat = 3 if smoke else 7
    rows = []
    with _pool(device, 2 * max(sizes) + 8 * MiB) as pool:
        launcher = _launcher(pool)
        drv, stream = pool.driver, _stream(pool)
        for size in sizes:
            buf = pool.empty(2 * size, dtype=torch.uint8)
            buf[:size].fill_(7)
            a = buf.data_ptr()
            z = np.zeros(1, np.int64)
            number = max(3, min(200, (4 * GiB if gpu else 256 * MiB) // size))
            if smoke:
                number = min(number, 10)
            kernel = timer(lambda: launcher.move(a, 2 * size, z, z + size, z + size, stream), number, repeat)
            engine = timer(lambda: drv.copy(a + size, a, size, stream), number, repeat)
            device_sync(device)
            ok = bool(torch.equal(buf[:size], buf[size:]))
            rows.append({"size_bytes": size, "method": "move kernel (launcher) vs copy engine (Driver.copy)",
                         "backend": pool.kind, "kernel_gbps": gbps(size, kernel.median),
                         "copy_engine_gbps": gbps(size, engine.median), "kernel_ms": kernel.median * 1e3,
                         "copy_engine_ms": engine.median * 1e3, "copy_engine_faster": engine.median <= kernel.median,
                         "bytes_ok": ok, "timing": f"{timing}, median of {repeat} x {number}"})
            del buf
    faster = [r["size_bytes"] for r in rows if r["copy_engine_faster"]]
    crossover = next((s for s in sorted(faster) if all(r["copy_engine_faster"] for r in rows if r["size_bytes"] >= s)),
                     None)
    rows.append({"method": "measured crossover (smallest size from which the copy engine is at least as fast)",
                 "backend": rows[0]["backend"], "crossover_bytes": crossover,
                 "constant_bytes": copying.COPY_ENGINE_MIN_BYTES,
                 "note": "copying.COPY_ENGINE_MIN_BYTES decides engine='auto'; set it to the measured crossover"
                         if gpu else "emulated: both engines are host copies; not a GPU figure"})
    return rows


# --------------------------------------------------------------------------- a mixed wave


def _log_uniform(rng, count: int, lo: int, hi: int) -> np.ndarray:
    return (np.exp(rng.uniform(np.log(lo), np.log(hi), count)).astype(np.int64) // 512) * 512


def _interleaved_wave(rng, sizes: np.ndarray):
    """Offsets of a valid wave: a source and a destination per size, all disjoint, in random order."""
    order = rng.permutation(2 * len(sizes))
    widths = np.concatenate([sizes, sizes])[order]
    starts = np.concatenate([[0], np.cumsum(widths)[:-1]])
    offsets = np.empty(2 * len(sizes), dtype=np.int64)
    offsets[order] = starts
    return offsets[:len(sizes)], offsets[len(sizes):], int(widths.sum())


def bench_mixed_wave(device: str, smoke: bool) -> list[dict]:
    """A wave of mixed 64 KiB - 4 MiB moves through engine="auto" vs one contiguous copy of the same bytes."""
    from defrag import copying

    gpu = device.startswith("cuda")
    count, hi = (200, 4 * MiB) if smoke and gpu else (3000, 4 * MiB) if gpu else (30, MiB) if smoke else (300, MiB)
    rng = np.random.default_rng(34)
    sizes = _log_uniform(rng, count, 64 * KiB, hi)
    src, dst, span = _interleaved_wave(rng, sizes)
    total = int(sizes.sum())
    timer, timing = _timer(device)
    repeat = 3 if smoke else 7
    with _pool(device, span + 2 * total + 16 * MiB) as pool:
        _launcher(pool)
        buf = pool.empty(span, dtype=torch.uint8)
        buf.copy_(torch.randint(0, 256, (span,), dtype=torch.uint8, device=buf.device))
        flat = pool.empty(2 * total, dtype=torch.uint8)
        a, stream, core = buf.data_ptr(), _stream(pool), CoreView(pool.driver)
        triples = [(a + s, a + d, n) for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist())]
        expected = buf.clone()
        for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist()):
            expected[d:d + n] = buf[s:s + n]
        wave = timer(lambda: copying.copy_ranges(core, stream, "auto", triples), 1, repeat)
        device_sync(device)
        ok = bool(torch.equal(buf, expected))
        x, y = flat[:total], flat[total:]
        if gpu:
            one = timer(lambda: y.copy_(x), 1, repeat)
            base_name = "one torch copy_ of the same total bytes"
        else:
            one = timer(lambda: ctypes.memmove(y.data_ptr(), x.data_ptr(), total), 1, repeat)
            base_name = "one memmove of the same total bytes"
    ratio = one.median / wave.median
    return [{"method": "a wave through engine='auto' (copying.copy_ranges)", "backend": pool.kind, "moves": count,
             "sizes": f"log-uniform 64 KiB - {hi // MiB} MiB", "moved_bytes": total, "ms": wave.median * 1e3,
             "gbps": gbps(total, wave.median), "baseline": base_name, "baseline_ms": one.median * 1e3,
             "baseline_gbps": gbps(total, one.median), "ratio_x": ratio, "bytes_ok": ok,
             "timing": f"{timing}, median of {repeat}",
             "goal": f"GPU: a mixed wave >= {MIXED_GOAL_X:g}x one contiguous copy_ of the same bytes",
             "goal_met": (ratio >= MIXED_GOAL_X and ok) if gpu else None}]


# --------------------------------------------------------------------------- whole compactions

_FRESH = r"""
import json, sys, time
import numpy as np, torch, defrag
from defrag import copying
count, lo, hi, seed, device = {count}, {lo}, {hi}, {seed}, {device!r}
rng = np.random.default_rng(seed)
sizes = (np.exp(rng.uniform(np.log(lo), np.log(hi), count)).astype(np.int64) // 512) * 512
drop = rng.permutation(count)[: count // 2].tolist()
probe = defrag.Pool(device=device, capacity="64MiB", auto_compact=False)
page = probe.page_size
probe.close()
capacity = (-(-int(sizes.sum()) // page) + 16) * page
pool = defrag.Pool(device=device, capacity=capacity, auto_compact=False)
ts = [pool.empty(int(n), dtype=torch.uint8) for n in sizes]
for i, t in enumerate(ts):
    t.fill_(i % 251 + 1)
for i in drop:
    ts[i] = None
if pool.kind == "cuda":
    torch.cuda.synchronize()
pool.stats()
launcher = copying.launcher_for(pool.driver)
ready = bool(launcher and launcher.ready)
t0 = time.perf_counter()
report = pool.compact()
if pool.kind == "cuda":
    torch.cuda.synchronize()
seconds = time.perf_counter() - t0
ok = all(bool((t == (i % 251 + 1)).all()) for i, t in enumerate(ts) if t is not None)
print(json.dumps({{"seconds": seconds, "moved_tensors": report.moved_tensors, "moved_bytes": report.moved_bytes,
                  "phases": report.phases, "kernel_ready": ready, "origin": getattr(launcher, "origin", ""),
                  "engine": report.engine, "bytes_ok": ok}}))
"""


def _layout(count: int, lo: int, hi: int, seed: int):
    rng = np.random.default_rng(seed)
    sizes = _log_uniform(rng, count, lo, hi)
    drop = rng.permutation(count)[: count // 2].tolist()
    return sizes, drop


def _fill(pool, sizes, drop):
    ts = [pool.empty(int(n), dtype=torch.uint8) for n in sizes]
    for i, t in enumerate(ts):
        t.fill_(i % 251 + 1)
    for i in drop:
        ts[i] = None
    device_sync("cuda" if pool.kind == "cuda" else "emulated")
    pool.stats()
    return ts


def _intact(ts) -> bool:
    return all(bool((t == (i % 251 + 1)).all()) for i, t in enumerate(ts) if t is not None)


def bench_compaction_gpu(device: str, smoke: bool) -> list[dict]:
    """The H200 report's compaction (about 2 GB moved on a GPU), its first run in a fresh process, and the
    automatic trigger serving a request; against one copy of the moved bytes."""
    import defrag

    gpu = device.startswith("cuda")
    if gpu:
        layout = dict(REPORT_LAYOUT, count=600 if smoke else REPORT_LAYOUT["count"])
    else:
        layout = dict(count=60 if smoke else 600, lo=64 * KiB, hi=MiB, seed=34)
    sizes, drop = _layout(**layout)
    rounds = 1 if smoke else 5
    probe = defrag.Pool(device=device, capacity="64MiB", auto_compact=False)
    page = probe.page_size
    probe.close()
    capacity = (-(-int(sizes.sum()) // page) + 16) * page
    walls, reports, ok = [], [], True
    with defrag.Pool(device=device, capacity=capacity, auto_compact=False) as pool:
        if gpu:
            _launcher(pool)  # loaded (compiled once per machine) before the timed rounds
        for _ in range(rounds):
            ts = _fill(pool, sizes, drop)
            device_sync(device)
            t0 = time.perf_counter()
            report = pool.compact()
            device_sync(device)
            walls.append(time.perf_counter() - t0)
            reports.append(report)
            ok = ok and _intact(ts)
            del ts
        moved = reports[0].moved_bytes
        one = OneCopy(device, max(moved, 16))
        ones = [one.seconds() for _ in range(rounds)]
        auto = _automatic_trigger(pool, sizes, drop)
    med = statistics.median
    rep = reports[len(reports) // 2]
    phases = {f"{k}_ms": med(r.phases.get(k, 0.0) for r in reports) * 1e3
              for k in ("sync", "plan", "prepare", "copy", "swap", "release")}
    common = {"tensors": len(sizes), "sizes": f"log-uniform {layout['lo'] // KiB} KiB - {layout['hi'] // MiB} MiB",
              "dropped": len(drop), "backend": pool.kind}
    base_name = "one torch copy_ of the moved bytes" if gpu else "one memmove of the moved bytes"
    ms = med(walls) * 1e3
    rows = [{"method": "pool.compact()", **common, "moved_tensors": rep.moved_tensors, "moved_bytes": moved,
             "waves": rep.waves, "engine": rep.engine, "ms": ms, "best_ms": min(walls) * 1e3,
             "gbps": gbps(moved, med(walls)), "baseline": base_name, "baseline_ms": med(ones) * 1e3,
             "ratio_x": med(ones) / med(walls), **phases, "bytes_ok": ok,
             "timing": f"perf_counter around the call and a synchronize, median of {rounds}",
             "goal": f"GPU: a compaction of about 2 GB moved in under {COMPACTION_GOAL_MS:g} ms",
             "goal_met": (ms < COMPACTION_GOAL_MS and ok) if gpu and not smoke else None}]
    if smoke and not gpu:  # a fresh interpreter costs seconds of the CPU smoke run; full runs have the row
        rows.append({"method": "first compaction in a fresh process", **common,
                     "skipped": "smoke run on the emulated device (the full run and the GPU check measure it)"})
    else:
        rows.append(_first_compaction(device, layout, common))
    rows.append(auto)
    return rows


def _first_compaction(device: str, layout: dict, common: dict) -> dict:
    """The same compaction as the first one of a fresh process (pool made, filled, half dropped, compacted)."""
    gpu = device.startswith("cuda")
    argv, env = child_command(_FRESH.format(device="cuda:0" if gpu else "emulated", **layout))
    try:
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return {"method": "first compaction in a fresh process", **common, "skipped": "the child timed out"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        return {"method": "first compaction in a fresh process", **common,
                "skipped": f"the child failed (rc {proc.returncode}): {proc.stderr[-500:]}"}
    got = json.loads(lines[-1])
    ms = got["seconds"] * 1e3
    return {"method": "first compaction in a fresh process", **common, "moved_tensors": got["moved_tensors"],
            "moved_bytes": got["moved_bytes"], "ms": ms, "engine": got["engine"],
            "kernel_ready": got["kernel_ready"], "kernel_image": got["origin"], "bytes_ok": got["bytes_ok"],
            **{f"{k}_ms": v * 1e3 for k, v in got["phases"].items()},
            "timing": "perf_counter around the call and a synchronize, one process",
            "goal": f"GPU: the first compaction of a fresh process in under {FIRST_COMPACTION_GOAL_MS:g} ms",
            "goal_met": (ms < FIRST_COMPACTION_GOAL_MS and got["bytes_ok"]) if gpu else None}


def _automatic_trigger(pool, sizes, drop) -> dict:
    """Fill, drop, then ask for more than the free pages hold (halfway to what packing would free), so
    only the automatic trigger's compaction makes room for it."""
    import defrag

    ts = _fill(pool, sizes, drop)
    page = pool.page_size
    live = sum(t.untyped_storage().nbytes() for t in ts if t is not None)
    before = pool.stats()
    free_now = before["largest_free_bytes"]
    packed = (pool.capacity_pages - -(-live // page)) * page
    request = (free_now + (packed - free_now) // 2) // page * page
    if request <= free_now:
        return {"method": "automatic trigger serving a request", "backend": pool.kind,
                "skipped": f"packing would free no more than the {free_now} bytes free now"}
    pool.auto_compact = True
    device_sync("cuda" if pool.kind == "cuda" else "emulated")
    t0 = time.perf_counter()
    try:
        big = pool.empty(request, dtype=torch.uint8)
        big[-1] = 1
        device_sync("cuda" if pool.kind == "cuda" else "emulated")
        served, error = True, ""
    except defrag.OutOfMemoryError as exc:
        served, error = False, str(exc).splitlines()[0]
    ms = (time.perf_counter() - t0) * 1e3
    pool.auto_compact = False
    after = pool.stats()
    ok = _intact(ts)
    return {"method": "automatic trigger serving a request", "backend": pool.kind, "request_bytes": request,
            "free_before_bytes": free_now, "served": served, "error": error, "ms": ms,
            "automatic_compactions": after["num_compactions.automatic"] - before["num_compactions.automatic"],
            "moved_tensors": after["compaction.moved_tensors"] - before["compaction.moved_tensors"],
            "bytes_ok": ok, "goal": "the request is served by an automatic compaction, every byte kept",
            "goal_met": served and ok and after["num_compactions.automatic"] > before["num_compactions.automatic"]}
