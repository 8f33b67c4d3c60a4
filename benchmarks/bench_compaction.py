"""The compactor's copy: raw copy bandwidth, and whole compactions against a plain copy of the same moves.

``copy_bandwidth``: one move of N bytes between two halves of one pool
tensor, by each of the compactor's copy paths, against the device's own copy
of the same bytes in the same run:

- ``copy engine``: `Driver.copy` (cuMemcpyDtoDAsync on torch's current
  stream; on the emulated device the emulation's memmove, after its
  mapped-and-accessible check);
- ``move kernel``: on a GPU the compactor's launcher
  (`defrag.kernels.launch.MoveLauncher`: one cuLaunchKernel of the cached
  cubin); on the emulated device `defrag.kernels.batched_move` under numba's
  CPU simulator, so only tiny sizes are run and the figure says how slow the
  simulator is, nothing about a GPU;
- ``engine='auto'``: what a compaction does with one move of that size (the
  launcher, or the copy engine from `copying.COPY_ENGINE_MIN_BYTES`); GPU
  goals: >= 0.5x ``copy_`` at 1 MiB, >= 0.9x at 16, 64 and 256 MiB;
- baseline: torch ``dst.copy_(src)`` on a GPU (CUDA events), ctypes.memmove
  on the emulated device (time.perf_counter).

``gbps`` is payload bytes per second (1e9 B/s); a copy reads and writes
each byte, so memory traffic is twice that. Small sizes fit in caches (CPU
L2/L3, GPU L2) and say so in their numbers.

``compaction``: a pool filled with equal tensors of a quarter page, then 3
of every 4 freed (each page a quarter full, no page empty), then
``pool.compact()``. Moved bytes per second of the whole call (plan, map,
copy, swap, unmap), and of its copy phase alone (``report.phases['copy']``:
the copy plus a device synchronize), against the same set of
(src, dst, size) moves done by memmove (emulated) or torch ``copy_`` per move
(GPU) between the same addresses, on the same freshly written layout, timed
the same way (host clock around the copies, plus a synchronize on a GPU). On
a GPU also: the move kernel alone doing the same moves in one launch (CUDA
events, no host work inside), against one ``copy_`` of a contiguous buffer of
the same total bytes (the device's copy bandwidth): the GPU goal.

``compaction_overhead`` and ``compaction_random``: seeded random layouts, 70%
of the tensors dropped in random order, against ONE copy of the moved bytes
between two contiguous buffers (memmove between prefaulted host buffers on
the emulated device, torch ``copy_`` on a GPU), timed right after each
compaction:

- ``compaction_overhead``: 3000 filled tensors of 8-256 KiB; timed: dropping
  70% of them and ``pool.compact()``; reported: (that time - the one copy) /
  (tensors dropped + tensors moved), microseconds per tensor (goal on the
  emulated device: <= 5 us), with the drop and the compaction apart;
- ``compaction_random``: 512 tensors of 64 KiB - 1 MiB; ``pool.compact()``
  against the one copy as a ratio (goal on the emulated device: >= 0.7x).
  Also, from `_timed_rounds`, the older baseline: a memmove per move between
  the same addresses on the same fresh layout.
"""

from __future__ import annotations

import ctypes
import dataclasses
import statistics
import time

import numpy as np
import torch

from .runner import gbps, kernel_skip_reason, time_cuda, time_host, time_host_interleaved

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SIM_MAX_BYTES = 16 * KiB  # the simulator runs one Python thread per CUDA thread


# --------------------------------------------------------------------------- copy bandwidth


def bench_copy_bandwidth(device: str, smoke: bool) -> list[dict]:
    """GB/s of one N-byte move by copy engine and move kernel, vs torch copy_ (GPU) / memmove (emulated)."""
    import defrag

    gpu = device.startswith("cuda")
    if gpu:
        sizes = (1 * MiB, 64 * MiB) if smoke else (64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, 1 * GiB)
    else:
        sizes = (64 * KiB, 1 * MiB) if smoke else (64 * KiB, 1 * MiB, 16 * MiB, 128 * MiB)
    kernel_sizes = sizes if gpu else ((4 * KiB,) if smoke else (4 * KiB, SIM_MAX_BYTES))
    kskip = kernel_skip_reason(device)
    repeat = 3 if smoke else 7
    rows = []
    capacity = 2 * max(max(sizes), max(kernel_sizes)) + 4 * MiB
    with defrag.Pool(device=device, capacity=capacity, auto_compact=False) as pool:
        drv = pool.driver
        buf = a = b = None
        for size in sorted(set(sizes) | set(kernel_sizes)):
            # The previous size's buffer and views go first: the capacity holds one buffer at a time
            # (on a GPU the 2 GiB buffer did not fit beside the previous 512 MiB one).
            buf = a = b = None
            buf = pool.empty(2 * size, dtype=torch.uint8)
            if size <= 64 * MiB:  # random bytes; larger buffers get a non-zero constant (cheaper to write)
                buf.copy_(torch.randint(1, 256, (2 * size,), dtype=torch.uint8, device=buf.device))
            else:
                buf.fill_(7)
            src, dst = buf.data_ptr(), buf.data_ptr() + size
            number = max(3, min(2000, (256 * MiB if not gpu else 4 * GiB) // size))
            if smoke:
                number = min(number, 20)

            # Baseline: the device's own copy of the same bytes; the copy engine in the same run.
            if gpu:
                a, b = buf[:size], buf[size:]
                stream = torch.cuda.current_stream(buf.device).cuda_stream
                base = time_cuda(lambda: b.copy_(a), number=number, repeat=repeat)
                engine = time_cuda(lambda: drv.copy(dst, src, size, stream), number=number, repeat=repeat)
                base_name, timing = "torch copy_", "cuda events"
            else:
                both = time_host_interleaved({"base": lambda: ctypes.memmove(dst, src, size),
                                              "engine": lambda: drv.copy(dst, src, size, 0)},
                                             number=number, repeat=repeat)
                base, engine = both["base"], both["engine"]
                base_name, timing = "memmove", "perf_counter, interleaved"
            base_gbps = gbps(size, base.median)

            def row(method, t, **extra):
                r = {"size_bytes": size, "method": method, "backend": _backend(pool, method),
                     "gbps": gbps(size, t.median), "best_gbps": gbps(size, t.best),
                     "baseline": base_name, "baseline_gbps": base_gbps, "baseline_best_gbps": gbps(size, base.best),
                     "ratio_x": (gbps(size, t.median) / base_gbps) if base_gbps else None,
                     "timing": f"{timing}, median of {t.repeats} x {t.number}"}
                r.update(extra)
                return r

            if size in sizes:
                rows.append(row("copy engine (Driver.copy)", engine))
                rows.append(_auto_row(pool, buf, size, number, repeat, row, gpu))
            if size in kernel_sizes:
                if kskip:
                    rows.append({"size_bytes": size, "method": "move kernel (batched_move)", "skipped": kskip})
                else:
                    rows.append(_kernel_row(pool, buf, size, number, repeat, row, smoke))
            del buf
    return rows


def _backend(pool, method: str) -> str:
    if pool.kind == "cuda":
        return "cuda"
    return "simulator" if "kernel" in method else "emulated"


#: One move's goals on a GPU (the compaction's engine choice against torch copy_ of the same bytes).
ONE_MOVE_GOALS = {1 * MiB: 0.5, 16 * MiB: 0.9, 64 * MiB: 0.9, 256 * MiB: 0.9}


class CoreView:
    """What `defrag.copying.copy_ranges` reads of a core (its driver and device kind), for a pool's device."""

    def __init__(self, driver):
        self.driver, self.kind = driver, driver.kind


def _auto_row(pool, buf, size, number, repeat, row, gpu):
    """The compaction's own choice for one move (engine="auto": the launcher, or the copy engine from
    `copying.COPY_ENGINE_MIN_BYTES`), with the GPU goal at the sizes that have one."""
    from defrag import copying

    launcher = copying.launcher_for(pool.driver)
    if launcher is not None:
        launcher.wait()
    core = CoreView(pool.driver)
    src, dst = buf.data_ptr(), buf.data_ptr() + size
    moves = [(src, dst, size)]
    stream = torch.cuda.current_stream(buf.device).cuda_stream if gpu else 0
    if gpu:
        t = time_cuda(lambda: copying.copy_ranges(core, stream, "auto", moves), number=number, repeat=repeat)
    else:
        t = time_host(lambda: copying.copy_ranges(core, stream, "auto", moves), number=number, repeat=repeat)
    r = row("engine='auto' (the compaction's choice)", t,
            chosen="copy engine" if size >= copying.COPY_ENGINE_MIN_BYTES else "move kernel")
    goal = ONE_MOVE_GOALS.get(size)
    if goal is not None:
        r["goal"] = f"GPU: one move of {size // MiB} MiB >= {goal:g}x torch copy_"
        r["goal_met"] = (r["ratio_x"] >= goal) if gpu and r["ratio_x"] is not None else None
    return r


def _kernel_row(pool, buf, size, number, repeat, row, smoke):
    import defrag.kernels as dk

    if pool.kind == "cuda":
        from defrag import copying

        launcher = copying.launcher_for(pool.driver)
        if not launcher.wait():
            return {"size_bytes": size, "method": "move kernel (launcher)", "skipped": launcher.error}
        z = np.zeros(1, np.int64)
        stream = torch.cuda.current_stream(buf.device).cuda_stream
        a = buf.data_ptr()
        t = time_cuda(lambda: launcher.move(a, 2 * size, z, z + size, z + size, stream), number=number, repeat=repeat)
        return row("move kernel (launcher)", t, image=launcher.origin)
    arena = dk.device_arena(buf.data_ptr(), 2 * size)
    moves = np.array([[0, size, size]], dtype=np.int64)
    # Simulator: seconds per call; a couple of calls is all it can afford.
    t = time_host(lambda: dk.batched_move(arena, moves), number=1, repeat=1 if smoke else 3, warmup=1)
    return row("move kernel (batched_move)", t, timing="perf_counter, numba simulator")


def plot_copy_bandwidth(rows, path) -> bool:
    from .runner import _pyplot, _save

    rows = [r for r in rows if r.get("gbps")]
    if not rows:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for method in dict.fromkeys(r["method"] for r in rows):
        sel = sorted((r for r in rows if r["method"] == method), key=lambda r: r["size_bytes"])
        ax.loglog([r["size_bytes"] for r in sel], [r["gbps"] for r in sel], "o-", label=f"{method} [{sel[0]['backend']}]")
    base = {}
    for r in rows:
        base[r["size_bytes"]] = r["baseline_gbps"]
    xs = sorted(base)
    ax.loglog(xs, [base[x] for x in xs], "s--", color="tab:gray", label=f"baseline: {rows[0]['baseline']}")
    ax.set_xlabel("bytes per move")
    ax.set_ylabel("GB/s (payload)")
    ax.legend(fontsize=7)
    return _save(fig, path)


# --------------------------------------------------------------------------- compaction


def _fill_fragmented(pool, npages: int) -> list:
    """4 tensors of a quarter page per page, written (non-zero), then 3 of every 4 dropped."""
    quarter = pool.page_size // 4
    # Statistics first return ranges kept for reuse to the heap: every round fills
    # the same coalesced free space, so every round builds the same layout.
    pool.stats()
    tensors = [pool.empty(quarter, dtype=torch.uint8) for _ in range(4 * npages)]
    for i, t in enumerate(tensors):
        t.fill_(i % 251 + 1)
    keep = tensors[0::4]
    del tensors, t
    if pool.kind == "cuda":
        torch.cuda.synchronize(pool.device)  # the frees wait on stream events: let them complete
    pool.stats()  # a pool call: applies the queued frees before anything is timed
    return keep


class _CudaBytes:
    """A borrowed view of raw device bytes for torch.as_tensor (owns nothing)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


def _copy_moves(pool, base: int, moves, gpu: bool):
    """A function doing every (src, dst, n) move at base+offset: memmove, or torch copy_ + synchronize."""
    if not gpu:
        triples = [(base + d, base + s, n) for s, d, n in moves]

        def run():
            for d, s, n in triples:
                ctypes.memmove(d, s, n)

        return run
    pairs = [(torch.as_tensor(_CudaBytes(base + d, n), device=pool.device),
              torch.as_tensor(_CudaBytes(base + s, n), device=pool.device)) for s, d, n in moves]

    def run():
        for dst, src in pairs:
            dst.copy_(src)
        torch.cuda.synchronize(pool.device)

    return run


def _mapped(pool, base: int, moves) -> bool:
    """Whether every source and destination page of `moves` is mapped now."""
    region = pool.layout()["regions"][0]
    P = pool.page_size
    return all(region["pages"][p] != "unmapped"
               for s, d, n in moves for off in (s, d) for p in range(off // P, (off + n - 1) // P + 1))


@dataclasses.dataclass
class _Rounds:
    """What `_timed_rounds` measured: timed compactions and baselines, with the round each came from."""

    base: int  # the region's base address: moves are (src, dst, size) offsets from it
    moves: list | None  # the moves of the first timed compaction (the baselines copy these)
    moves_seen: list  # the moves of every round after the warm-up
    compactions: list  # (wall seconds, report) of the timed compactions, in order
    compaction_rounds: list  # the round of each
    baseline_s: list  # seconds of the timed baselines, in order
    baseline_rounds: list  # the round of each
    kernel_s: list  # GPU: the move kernel alone, per baseline round (when asked for)
    after_s: list = dataclasses.field(default_factory=list)  # `after(report)` right after each timed compaction

    def pairs(self) -> list[tuple[float, float]]:
        """(compaction wall, baseline) for each compaction round followed by a timed baseline round."""
        base = dict(zip(self.baseline_rounds, self.baseline_s))
        return [(w, base[r + 1]) for (w, _), r in zip(self.compactions, self.compaction_rounds) if r + 1 in base]


def _timed_rounds(pool, fill, rounds: int, gpu: bool, *, kernel: bool = False, after=None) -> _Rounds:
    """Rounds of `fill()` (returns the live tensors) then `pool.compact()`: timed compactions and baselines.

    Rounds alternate: a timed compaction, or a timed baseline copy of the moves
    the first timed compaction made (memmove, or torch copy_ + synchronize on
    a GPU), done on the freshly filled layout (sources live, destinations in
    mapped free space) and then compacted untimed. So both sides copy the same
    bytes between the same addresses, each right after the same fill. Round 0
    only warms up. `fill` must build the same layout every round
    (`same_moves_every_round` in the rows checks it). `after(report)`, if
    given, runs right after each timed compaction (a baseline that should
    meet the same machine state); its results are `after_s`.
    """
    base = pool.layout()["regions"][0]["base"]
    out = _Rounds(base, None, [], [], [], [], [], [])
    for r in range(2 * rounds + 1):
        keep = fill()
        timed_baseline = r % 2 == 0 and out.moves is not None  # rounds 2, 4, ...: baseline
        if timed_baseline and _mapped(pool, base, out.moves):
            run = _copy_moves(pool, base, out.moves, gpu)
            if gpu:
                torch.cuda.synchronize(pool.device)
            t0 = time.perf_counter()
            run()
            out.baseline_s.append(time.perf_counter() - t0)
            out.baseline_rounds.append(r)
            del run  # GPU: the borrowed views go before any page is unmapped
            if kernel:
                out.kernel_s.append(_kernel_alone(pool, base, out.moves).median)
        before = [t.data_ptr() for t in keep]
        t0 = time.perf_counter()
        report = pool.compact()
        wall = time.perf_counter() - t0
        now = [(b - base, t.data_ptr() - base, t.nbytes) for b, t in zip(before, keep) if t.data_ptr() != b]
        if r > 0:
            out.moves_seen.append(now)
            if not timed_baseline:
                out.compactions.append((wall, report))
                out.compaction_rounds.append(r)
                if after is not None:
                    out.after_s.append(after(report))
        if r == 1:
            out.moves = now
        del keep
    return out


def bench_compaction(device: str, smoke: bool) -> list[dict]:
    """Moved bytes/s of pool.compact() (whole, and copy phase) vs memmove / torch copy_ of the same moves.

    One pool, rebuilt every round into the same layout (tensors written, then
    3 of 4 per page dropped); the rounds are `_timed_rounds`'s.
    """
    gpu = device.startswith("cuda")
    npages = 8 if smoke else (1024 if gpu else 128)
    rounds = 2 if smoke else 9
    with _pool_for(device, npages) as pool:
        kskip = kernel_skip_reason(device) if gpu else None
        rr = _timed_rounds(pool, lambda: _fill_fragmented(pool, npages), rounds, gpu,
                           kernel=gpu and kskip is None)
        moves, moves_seen, compactions, baseline_s, kernel_s = (rr.moves, rr.moves_seen, rr.compactions,
                                                                rr.baseline_s, rr.kernel_s)
        if not moves:
            return [{"skipped": "the compaction moved nothing (the planner found no useful move)"}]
        if not baseline_s:
            return [{"skipped": "the moves' destinations were not mapped before compaction; no same-address baseline"}]
        same = all(m == moves for m in moves_seen)
        # The same compaction also unmapping every empty page at the end (the default before issue 14).
        lazy = []
        for _ in range(rounds):
            keep = _fill_fragmented(pool, npages)
            t0 = time.perf_counter()
            pool.compact(release=True)
            lazy.append(time.perf_counter() - t0)
            del keep
            pool.trim()
        ceiling = _ceiling(pool, sum(n for _, _, n in moves), rounds) if gpu else None

    moved = sum(n for _, _, n in moves)
    rep = compactions[0][1]
    walls = [w for w, _ in compactions]
    copies = [rp.phases.get("copy", 0.0) for _, rp in compactions]
    phases = {f"{k}_ms": statistics.median(rp.phases.get(k, 0.0) for _, rp in compactions) * 1e3
              for k in ("sync", "plan", "prepare", "copy", "swap", "release")}
    base_name = "torch copy_ per move" if gpu else "memmove per move"
    b_med, b_best = statistics.median(baseline_s), min(baseline_s)
    common = {"moved_bytes": moved, "moved_tensors": rep.moved_tensors, "pages_before": rep.pages_before,
              "pages_after": rep.pages_after, "engine": rep.engine, "same_moves_every_round": same}

    def row(method, samples, **extra):
        med, best = statistics.median(samples), min(samples)
        r = {"method": method, **common, "ms": med * 1e3, "gbps": gbps(moved, med), "best_gbps": gbps(moved, best),
             "baseline": base_name, "baseline_gbps": gbps(moved, b_med), "baseline_best_gbps": gbps(moved, b_best),
             "ratio_x": b_med / med, "best_ratio_x": b_best / best,
             "timing": f"perf_counter, median of {len(samples)} rounds"}
        r.update(extra)
        return r

    whole = row("pool.compact() whole call", walls, **phases,
                goal="emulated: whole compaction >= 0.7x memmove of the same moves")
    whole["goal_met"] = whole["ratio_x"] >= 0.7 if not gpu else None
    copy = row("copy phase (report.phases['copy'])", copies)
    kept_mapped = row("pool.compact(release=True) whole call", lazy,
                      note="also unmaps every empty page at the end (the default before issue 14; frees no "
                           "device memory: the handles stay cached)")
    rows = [whole, kept_mapped, copy,
            {"method": f"baseline: {base_name}", **common, "ms": b_med * 1e3, "gbps": gbps(moved, b_med),
             "best_gbps": gbps(moved, b_best), "timing": f"perf_counter{' incl. synchronize' if gpu else ''}, "
                                                         f"median of {len(baseline_s)} rounds"}]
    if ceiling is not None:
        c_gbps = gbps(moved, ceiling.median)
        rows.append({"method": "torch copy_ contiguous (same total bytes)", "moved_bytes": moved,
                     "ms": ceiling.median * 1e3, "gbps": c_gbps, "best_gbps": gbps(moved, ceiling.best),
                     "timing": f"cuda events, median of {ceiling.repeats} x {ceiling.number}"})
        copy.update(ceiling_gbps=c_gbps, ratio_vs_ceiling_x=copy["gbps"] / c_gbps)
        goal = "GPU: move kernel bandwidth >= 0.9x torch copy_ (contiguous, same bytes)"
        if kernel_s:
            k_med = statistics.median(kernel_s)
            ratio = gbps(moved, k_med) / c_gbps
            rows.insert(2, {"method": "move kernel alone (batched_move, same moves)", **common, "ms": k_med * 1e3,
                            "gbps": gbps(moved, k_med), "best_gbps": gbps(moved, min(kernel_s)),
                            "baseline": "torch copy_ contiguous (same total bytes)", "baseline_gbps": c_gbps,
                            "ratio_x": ratio, "timing": f"cuda events, median over {len(kernel_s)} rounds",
                            "goal": goal, "goal_met": ratio >= 0.9})
        else:
            rows.insert(2, {"method": "move kernel alone (batched_move, same moves)", "skipped": kskip})
    return rows


# --------------------------------------------------------------------------- one copy of the moved bytes


class OneCopy:
    """One copy of `nbytes` between two contiguous buffers made (and written) once: memmove between host
    buffers on the emulated device, torch ``copy_`` + synchronize on a GPU. `seconds()` times one."""

    def __init__(self, device: str, nbytes: int):
        self.gpu = device.startswith("cuda")
        self.nbytes = int(nbytes)
        if self.gpu:
            flat = torch.empty(2 * self.nbytes, dtype=torch.uint8, device=device).fill_(3)
            self._src, self._dst = flat[:self.nbytes], flat[self.nbytes:]
        else:
            self._src = np.full(self.nbytes, 3, dtype=np.uint8)
            self._dst = np.full(self.nbytes, 5, dtype=np.uint8)
        self.seconds()  # warm

    def seconds(self) -> float:
        if self.gpu:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            self._dst.copy_(self._src)
            torch.cuda.synchronize()
            return time.perf_counter() - t0
        t0 = time.perf_counter()
        ctypes.memmove(self._dst.ctypes.data, self._src.ctypes.data, self.nbytes)
        return time.perf_counter() - t0


# --------------------------------------------------------------------------- random sizes

OVERHEAD_TENSORS, OVERHEAD_SIZES = 3000, (8 * KiB, 256 * KiB)
RANDOM_TENSORS, RANDOM_SIZES = 512, (64 * KiB, 1 * MiB)
RANDOM_DROP = 0.7
RANDOM_SEED = 24
OVERHEAD_GOAL_US = 5.0
RANDOM_GOAL_X = 0.7


def _random_layout(count: int, lo: int, hi: int, seed: int = RANDOM_SEED):
    """Seeded sizes uniform in [lo, hi] bytes, and the order in which RANDOM_DROP of them are dropped."""
    import random

    rng = random.Random(seed)
    sizes = [rng.randint(lo, hi) for _ in range(count)]
    drop = rng.sample(range(count), round(RANDOM_DROP * count))  # a random subset, in random order
    return sizes, drop


def _fill_random(pool, sizes, drop) -> list:
    """Allocate `sizes` in order, write every byte (non-zero), drop the tensors `drop` names, in its order."""
    pool.stats()  # kept ranges back to the heap: every round fills the same coalesced free space
    tensors = [pool.empty(n, dtype=torch.uint8) for n in sizes]
    for i, t in enumerate(tensors):
        t.fill_(i % 251 + 1)
    del t
    for i in drop:
        tensors[i] = None
    keep = [t for t in tensors if t is not None]
    del tensors
    if pool.kind == "cuda":
        torch.cuda.synchronize(pool.device)
    pool.stats()  # a pool call: applies the queued frees before anything is timed
    return keep


def _random_rounds(device: str, count: int, lo: int, hi: int, rounds: int, after=None):
    """A pool just large enough (plus 8 pages), filled by `_fill_random`, through `_timed_rounds`."""
    import defrag

    sizes, drop = _random_layout(count, lo, hi)
    probe = defrag.Pool(device=device, capacity="64MiB", auto_compact=False)
    page = probe.page_size
    probe.close()
    pages = -(-sum(sizes) // page) + 8
    with defrag.Pool(device=device, capacity=pages * page, auto_compact=False) as pool:
        rr = _timed_rounds(pool, lambda: _fill_random(pool, sizes, drop), rounds, device.startswith("cuda"),
                           after=after)
        kind = pool.kind
    return rr, sizes, kind


def _random_common(rr, sizes, lo, hi, gpu) -> dict:
    rep = rr.compactions[0][1]
    return {"tensors": len(sizes), "sizes": f"uniform {lo // KiB}-{hi // KiB} KiB, seed {RANDOM_SEED}",
            "dropped": f"{RANDOM_DROP:.0%} in random order", "moved_tensors": len(rr.moves),
            "moved_bytes": sum(n for _, _, n in rr.moves), "pages_before": rep.pages_before,
            "pages_after": rep.pages_after, "engine": rep.engine,
            "same_moves_every_round": all(m == rr.moves for m in rr.moves_seen),
            "baseline": "torch copy_ per move" if gpu else "memmove per move"}


def _random_skip(rr) -> dict | None:
    if not rr.moves:
        return {"skipped": "the compaction moved nothing (the planner found no useful move)"}
    if not rr.baseline_s:
        return {"skipped": "the moves' destinations were not mapped before compaction; no same-address baseline"}
    return None


def _random_run(device: str, size_range: tuple[int, int], count: int, smoke: bool, after=None):
    """(rounds, device kind, the rows' common fields) of `count` tensors of random sizes in `size_range`;
    (None, None, a skip row) where the rounds could not run."""
    lo, hi = size_range
    rr, sizes, kind = _random_rounds(device, count, lo, hi, 2 if smoke else 9, after=after)
    skip = _random_skip(rr)
    if skip:
        return None, None, skip
    return rr, kind, _random_common(rr, sizes, lo, hi, device.startswith("cuda"))


def _random_medians(rr) -> tuple[list[float], float, float, dict]:
    """(compaction walls, their median, the baseline's median, the median phase times in ms) of `rr`."""
    walls = [w for w, _ in rr.compactions]
    phases = {f"{k}_ms": statistics.median(rp.phases.get(k, 0.0) for _, rp in rr.compactions) * 1e3
              for k in ("sync", "plan", "prepare", "copy", "swap", "release")}
    return walls, statistics.median(walls), statistics.median(rr.baseline_s), phases


def _fill_all(pool, sizes) -> list:
    """Allocate `sizes` in order and write every byte (non-zero); nothing dropped yet."""
    pool.stats()  # kept ranges back to the heap: every round fills the same coalesced free space
    tensors = [pool.empty(n, dtype=torch.uint8) for n in sizes]
    for i, t in enumerate(tensors):
        t.fill_(i % 251 + 1)
    if pool.kind == "cuda":
        torch.cuda.synchronize(pool.device)
    pool.stats()
    return tensors


def bench_compaction_overhead(device: str, smoke: bool) -> list[dict]:
    """Dropping 70% of OVERHEAD_TENSORS filled tensors (8-256 KiB) and compacting the rest, beyond one copy
    of the moved bytes, per tensor dropped or moved (us; emulated goal <= 5 us).

    Each round fills the same layout (seeded sizes, every byte written), then
    times the drops (in the seeded random order) and `pool.compact()`, then one
    copy of the bytes that compaction moved (`OneCopy`). Medians over rounds;
    the drop and the compaction are also given apart (the drop is the release
    path's cost, applied partly at the compaction's first step).
    """
    import defrag

    gpu = device.startswith("cuda")
    count = 64 if smoke else OVERHEAD_TENSORS
    rounds = 2 if smoke else 9
    sizes, drop = _random_layout(count, *OVERHEAD_SIZES)
    probe = defrag.Pool(device=device, capacity="64MiB", auto_compact=False)
    page = probe.page_size
    probe.close()
    pages = -(-sum(sizes) // page) + 8
    per, drops, walls, copies, ones, moved, phases = [], [], [], [], [], [], []
    one = None
    with defrag.Pool(device=device, capacity=pages * page, auto_compact=False) as pool:
        kind = pool.kind
        for r in range(rounds + 1):
            tensors = _fill_all(pool, sizes)
            t0 = time.perf_counter()
            for i in drop:
                tensors[i] = None
            t1 = time.perf_counter()
            report = pool.compact()
            t2 = time.perf_counter()
            del tensors
            if one is None:
                one = OneCopy(device, max(report.moved_bytes, 16))
                first = (report.moved_tensors, report.moved_bytes)
            elif (report.moved_tensors, report.moved_bytes) != first:
                return [{"skipped": f"rounds moved different tensors or bytes ({report.moved_tensors}, "
                                    f"{report.moved_bytes} vs {first}): the layout is not the same every round"}]
            c = one.seconds()
            if r == 0:
                continue  # warm-up
            n = len(drop) + report.moved_tensors
            per.append((t2 - t0 - c) / n * 1e6)
            drops.append(t1 - t0)
            walls.append(t2 - t1)
            ones.append(c)
            moved.append(report.moved_tensors)
            phases.append(report.phases)
    if not moved or not moved[0]:
        return [{"skipped": "the compaction moved nothing (the planner found no useful move)"}]
    med = statistics.median
    phase_ms = {f"{k}_ms": med(p.get(k, 0.0) for p in phases) * 1e3
                for k in ("sync", "plan", "prepare", "copy", "swap", "release")}
    overhead = med(per)
    return [{"method": "drop 70% + pool.compact() - one copy of the moved bytes, per tensor dropped or moved",
             "device": kind, "tensors": count, "sizes": f"uniform {OVERHEAD_SIZES[0] // KiB}-"
             f"{OVERHEAD_SIZES[1] // KiB} KiB, seed {RANDOM_SEED}", "dropped": len(drop), "moved_tensors": moved[0],
             "moved_bytes": one.nbytes, "same_moves_every_round": True,  # else the row above says why not
             "us_per_tensor": overhead, "min_us_per_tensor": min(per),
             "drop_ms": med(drops) * 1e3, "drop_us_per_dropped_tensor": med(drops) / len(drop) * 1e6,
             "compact_ms": med(walls) * 1e3, "baseline": "one torch copy_ of the moved bytes" if gpu
             else "one memmove of the moved bytes", "baseline_ms": med(ones) * 1e3, **phase_ms,
             "timing": f"perf_counter, medians of {len(per)} rounds (after one warm-up round)",
             "goal": f"emulated: (drop + compact() - one memmove) per tensor dropped or moved <= "
                     f"{OVERHEAD_GOAL_US:g} us",
             "goal_met": overhead <= OVERHEAD_GOAL_US if not gpu else None}]


def bench_compaction_random(device: str, smoke: bool) -> list[dict]:
    """pool.compact() vs one copy of the moved bytes on seeded random sizes 64 KiB - 1 MiB (70% dropped).

    Rounds as `bench_compaction` (`_timed_rounds`, equal quarter-page tensors
    there), on a random mix: `ratio_x` = median one-copy time (`OneCopy`,
    right after each timed compaction) / median compaction time (>= 1: as
    fast as one memmove); `ratio_vs_per_move_x` against a memmove per move between the
    same addresses on the same fresh layout (the older baseline). Goal
    (emulated): >= 0.7x one memmove.
    """
    gpu = device.startswith("cuda")
    copier = {}

    def one_copy(report) -> float:  # right after each timed compaction: the same machine state
        if "one" not in copier:
            copier["one"] = OneCopy(device, max(report.moved_bytes, 16))
        return copier["one"].seconds()

    rr, kind, common = _random_run(device, RANDOM_SIZES, 32 if smoke else RANDOM_TENSORS, smoke, after=one_copy)
    if rr is None:
        return [common]
    moved = common["moved_bytes"]
    walls, w_med, b_med, phases = _random_medians(rr)
    copies = [rp.phases.get("copy", 0.0) for _, rp in rr.compactions]
    ones = rr.after_s
    o_med = statistics.median(ones)
    ratio = o_med / w_med
    timing = (f"perf_counter, median of {len(walls)} compactions, {len(ones)} one-copy samples, "
              f"{len(rr.baseline_s)} per-move baselines")
    one_name = "one torch copy_ of the moved bytes" if gpu else "one memmove of the moved bytes"
    common = {**common, "baseline": one_name}
    whole = {"method": "pool.compact() whole call", "device": kind, **common,
             "ms": w_med * 1e3, "gbps": gbps(moved, w_med), "best_gbps": gbps(moved, min(walls)),
             "baseline_ms": o_med * 1e3, "baseline_gbps": gbps(moved, o_med),
             "baseline_best_gbps": gbps(moved, min(ones)),
             "ratio_x": ratio, "best_ratio_x": min(ones) / min(walls),
             "per_move_baseline_ms": b_med * 1e3, "ratio_vs_per_move_x": b_med / w_med,
             **phases, "timing": timing,
             "goal": f"emulated: whole compaction >= {RANDOM_GOAL_X:g}x one memmove of the moved bytes "
                     f"(random sizes)",
             "goal_met": ratio >= RANDOM_GOAL_X if not gpu else None}
    c_med = statistics.median(copies)
    copy = {"method": "copy phase (report.phases['copy'])", "device": kind, **common,
            "ms": c_med * 1e3, "gbps": gbps(moved, c_med), "best_gbps": gbps(moved, min(copies)),
            "baseline_ms": o_med * 1e3, "baseline_gbps": gbps(moved, o_med),
            "ratio_x": o_med / c_med if c_med > 0 else None,
            "per_move_baseline_ms": b_med * 1e3, "ratio_vs_per_move_x": b_med / c_med if c_med > 0 else None,
            "timing": timing}
    return [whole, copy]


def _kernel_alone(pool, base: int, moves):
    """GPU: one batched_move launch doing every move of the layout, timed by CUDA events (no host work inside)."""
    import defrag.kernels as dk
    from numba import cuda

    lo = min(min(s, d) for s, d, _ in moves)
    lo -= lo % 512
    hi = max(max(s, d) + n for s, d, n in moves)
    table = np.array([(s - lo, d - lo, n) for s, d, n in moves], dtype=np.int64)
    arena = dk.device_arena(base + lo, hi - lo)
    stream = cuda.external_stream(torch.cuda.current_stream(pool.device).cuda_stream)
    t = time_cuda(lambda: dk.batched_move(arena, table, stream=stream), number=1, repeat=3, warmup=1)
    torch.cuda.synchronize(pool.device)
    return t


def _pool_for(device, npages):
    import defrag

    probe = defrag.Pool(device=device, capacity="64MiB", auto_compact=False)
    page = probe.page_size
    probe.close()
    return defrag.Pool(device=device, capacity=(npages + 2) * page, auto_compact=False)


def _ceiling(pool, moved: int, rounds: int):
    """GPU: torch copy_ of one contiguous buffer of `moved` bytes (the device's copy bandwidth)."""
    flat = torch.empty(2 * moved, dtype=torch.uint8, device=pool.device).random_(1, 255)
    a, b = flat[:moved], flat[moved:]
    t = time_cuda(lambda: b.copy_(a), number=3, repeat=rounds)
    del a, b, flat
    return t


def plot_compaction(rows, path) -> bool:
    from .runner import _pyplot, _save

    rows = [r for r in rows if r.get("gbps")]
    if not rows:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.2))
    labels = [r["method"] for r in rows]
    colors = ["tab:gray" if "baseline" in m or "contiguous" in m else "tab:blue" for m in labels]
    ax.barh(labels[::-1], [r["gbps"] for r in rows][::-1], color=colors[::-1])
    ax.set_xlabel(f"GB/s of moved bytes ({rows[0]['moved_bytes'] / MiB:.0f} MiB, {rows[0].get('engine', '')} engine)")
    ax.tick_params(axis="y", labelsize=7)
    return _save(fig, path)
