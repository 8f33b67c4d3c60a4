"""alloc+free: `pool.empty` then dropping the tensor, vs `torch.empty` on the same device, same run.

Two benchmarks: ``alloc_free`` (one size at a time, below) and ``alloc_mixed``
(64 interleaved sizes, warm and in a fresh process: `bench_alloc_mixed`).

``alloc_free``: two patterns per size:

- ``round_trip``: allocate one tensor and drop it, repeated. The pool queues
  a free when torch drops the storage and applies it at the start of the next
  pool call, so each round trip pays one allocation and one queued free.
- ``batch``: allocate ``BATCH`` tensors (fewer for the largest sizes, see
  ``tensors_live``), then drop them all (reverse order); the time is per
  tensor (one alloc + one free), with many blocks live.

The pool's C++ fast path (`defrag.fastpath`) is built or loaded before timing
and serves every request of a kept size; each row says whether it was there
(`fast_path`).

Both sides are timed on the host with time.perf_counter, sampled in turn
(pool, torch, pool, torch, ...) so machine load hits both alike; median of
the samples, after warm-up. On a GPU neither call launches device work (torch's caching
allocator is warm; the pool's pages are mapped in the warm-up), so host time
is the whole cost. Sizes below a page share mapped pages; a page and more is
placed on a run of pages (stitched from any free physical pages).
"""

from __future__ import annotations

import functools
import gc

import torch

from .runner import child_command, time_host_interleaved

KiB, MiB = 1 << 10, 1 << 20
SIZES = (512, 64 * KiB, 1 * MiB, 2 * MiB, 64 * MiB)
SMOKE_SIZES = (512, 1 * MiB, 8 * MiB)
BATCH = 256
GOAL_X = 3.0


def _torch_device(device: str) -> torch.device:
    return torch.device(device) if device.startswith("cuda") else torch.device("cpu")


def bench_alloc_free(device: str, smoke: bool) -> list[dict]:
    """Microseconds per alloc+free, pool vs torch.empty; ratio = pool / torch (goal: <= 3)."""
    import defrag
    from defrag import fastpath

    fastpath.wait()  # built (or loaded) before timing: the pool attaches it at creation
    sizes = SMOKE_SIZES if smoke else SIZES
    repeat = 3 if smoke else 7
    batch = 32 if smoke else BATCH
    tdev = _torch_device(device)
    rows = []
    capacity = 64 * MiB if smoke else 1 << 30
    with defrag.Pool(device=device, capacity=capacity, auto_compact=False) as pool:
        for size in sizes:
            # More calls for small sizes so each sample lasts milliseconds.
            number = (200 if smoke else 2000) if size < 2 * MiB else (20 if smoke else 200)

            def pool_rt():
                t = pool.empty(size, dtype=torch.uint8)
                del t

            def torch_rt():
                t = torch.empty(size, dtype=torch.uint8, device=tdev)
                del t

            tp, tt = _pair(pool_rt, torch_rt, number, repeat, number // 10 + 1)
            rows.append(_row("round_trip", size, tp, tt, pool, number, live=1))
            rows[-1]["fast_path"] = fastpath.status()

            n_batch = batch if size * batch <= capacity // 2 else max(1, capacity // 2 // size)

            def pool_batch():
                ts = [pool.empty(size, dtype=torch.uint8) for _ in range(n_batch)]
                while ts:
                    ts.pop()

            def torch_batch():
                ts = [torch.empty(size, dtype=torch.uint8, device=tdev) for _ in range(n_batch)]
                while ts:
                    ts.pop()

            reps = max(1, number // n_batch)
            tp, tt = _pair(pool_batch, torch_batch, reps, repeat, 1)
            scale = 1.0 / n_batch
            rows.append(_row("batch", size, tp, tt, pool, reps * n_batch, live=n_batch, scale=scale))
            rows[-1]["fast_path"] = fastpath.status()
            gc.collect()
    return rows


def _pair(pool_fn, torch_fn, number, repeat, warmup):
    t = time_host_interleaved({"pool": pool_fn, "torch": torch_fn}, number=number, repeat=repeat, warmup=warmup)
    return t["pool"], t["torch"]


def _row(pattern, size, tp, tt, pool, calls, *, live, scale=1.0) -> dict:
    pool_us, torch_us = tp.median_us * scale, tt.median_us * scale
    ratio = pool_us / torch_us if torch_us > 0 else None
    return {
        "pattern": pattern,
        "size_bytes": size,
        "tensors_live": live,
        "device": pool.kind,
        "method": "pool.empty + del",
        "us_per_op": pool_us,
        "best_us_per_op": tp.best_us * scale,
        "baseline": "torch.empty + del",
        "baseline_us_per_op": torch_us,
        "ratio_x": ratio,
        "ops_timed": calls * tp.repeats,
        "goal": f"pool <= {GOAL_X:g}x torch.empty",
        "goal_met": ratio <= GOAL_X if ratio is not None else None,
    }


def plot_alloc_free(rows, path) -> bool:
    from .runner import _pyplot, _save

    rows = [r for r in rows if "us_per_op" in r]
    if not rows:
        return False
    plt = _pyplot()
    patterns = sorted({r["pattern"] for r in rows}, key=lambda p: (p != "round_trip", p))
    fig, axes = plt.subplots(1, len(patterns), figsize=(4.2 * len(patterns), 3.4), squeeze=False)
    for ax, pattern in zip(axes[0], patterns):
        sel = [r for r in rows if r["pattern"] == pattern]
        x = range(len(sel))
        ax.bar([i - 0.2 for i in x], [r["us_per_op"] for r in sel], 0.4, label="pool")
        ax.bar([i + 0.2 for i in x], [r["baseline_us_per_op"] for r in sel], 0.4, label="torch.empty", color="tab:gray")
        ax.set_xticks(list(x), [_size(r["size_bytes"]) for r in sel], fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("us per alloc+free")
        ax.set_title(pattern, fontsize=9)
        ax.legend(fontsize=8)
    return _save(fig, path)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


# --------------------------------------------------------------------------- mixed sizes (issue 24's baseline)

MIXED_SIZES = tuple(int(round(16 * (MiB / 16) ** (i / 63))) for i in range(64))  # 16 B .. 1 MiB, log-spaced
MIXED_LIVE = 32
MIXED_CALLS = 20_000
FRESH_CALLS = 10_000
MIXED_SEED = 24
MIXED_GOAL_X = 1.5


def mixed_sequence(calls: int, *, seed: int = MIXED_SEED, live: int = MIXED_LIVE, sizes=MIXED_SIZES) -> list:
    """`calls` pairs (slot, bytes): a fixed seeded mix of `sizes`, each call replacing one of `live` slots."""
    import random

    rng = random.Random(seed)
    return [(rng.randrange(live), rng.choice(sizes)) for _ in range(calls)]


def _replay_mixed(alloc, seq, live: int) -> None:
    """Every call allocates into its slot, dropping the slot's previous tensor; then every slot is dropped."""
    slots = [None] * live
    for j, n in seq:
        slots[j] = alloc(n)
    del slots


def _python_path_calls(pool, alloc, seq, live: int) -> int:
    """How many calls of one more (untimed) pass the C++ fast path declined: the pool placed them in Python."""
    seen, depth = [], [0]
    placed = pool._new_tensor

    def counted(*args, **kwargs):  # outermost calls only: _new_tensor may call itself once more
        if not depth[0]:
            seen.append(1)
        depth[0] += 1
        try:
            return placed(*args, **kwargs)
        finally:
            depth[0] -= 1

    pool._new_tensor = counted
    try:
        _replay_mixed(alloc, seq, live)
    finally:
        del pool._new_tensor
    return len(seen)


# The fresh-process side: a script run by `python -c`, so nothing of this process (imports, warm caches,
# the pool's kept sizes) comes with it. It reads its spec as JSON on stdin and prints one JSON line.
_FRESH_SCRIPT = r"""
import functools, json, sys, time
spec = json.loads(sys.stdin.read())
import torch
t0 = time.perf_counter()
device = spec["device"]
if spec["side"] == "pool":
    import defrag
    pool = defrag.Pool(device=device, capacity=spec["capacity"], auto_compact=False)
    alloc = functools.partial(pool.empty, dtype=torch.uint8)
else:
    pool = None
    if device.startswith("cuda"):
        torch.cuda.init()
    alloc = functools.partial(torch.empty, dtype=torch.uint8,
                              device=torch.device(device if device.startswith("cuda") else "cpu"))
if device.startswith("cuda"):
    torch.cuda.synchronize(torch.device(device))
setup = time.perf_counter() - t0
seq = spec["seq"]
slots = [None] * spec["live"]
t0 = time.perf_counter()
j, n = seq[0]
slots[j] = alloc(n)
t1 = time.perf_counter()
for j, n in seq[1:]:
    slots[j] = alloc(n)
del slots
t2 = time.perf_counter()
out = {"seconds": t2 - t0, "first_call_seconds": t1 - t0, "setup_seconds": setup}
if pool is not None:
    out["fast_path"] = pool.core.fast is not None
    pool.close()
print(json.dumps(out))
"""


def _fresh_run(side: str, device: str, seq, live: int, capacity: int) -> dict:
    """One fresh interpreter doing `seq` with pool.empty (side "pool") or torch.empty ("torch")."""
    import json
    import subprocess

    argv, env = child_command(_FRESH_SCRIPT)  # the same defrag as here
    spec = {"side": side, "device": device, "seq": seq, "live": live, "capacity": capacity}
    proc = subprocess.run(argv, input=json.dumps(spec), capture_output=True, text=True, env=env, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"fresh {side} process failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench_alloc_mixed(device: str, smoke: bool) -> list[dict]:
    """Microseconds per call of a fixed mix of 64 sizes (16 B - 1 MiB), about 32 live: pool vs torch.empty.

    Rows (each pool / torch.empty of the same sequence, ratio = pool / torch; goal <= 1.5x):

    - ``mixed, steady``: MIXED_CALLS calls in a warm process (the pool has seen every size), samples
      taken in turn (pool, torch, ...), median; ``python_path_calls``: how many calls of one more,
      untimed pass the C++ fast path declined (the Python core placed them);
    - ``mixed, first calls of a fresh process``: the first FRESH_CALLS calls of the same sequence in
      a new interpreter (`python -c`), pool and torch each in their own, in turn; pool creation
      (and on a GPU the CUDA context) is outside the timed calls (``setup_ms``);
    - ``mixed, from a C++ thread``: the same sizes in the same order from a thread Python never saw
      (`FastPath.churn`: a std::thread, no GIL), each call replacing the next of `live` slots round
      robin: the pool's native placement (`native_empty`) against `at::empty` on the same device,
      in turn, median of the passes; ``python_trips``: how many times the native side went back to
      Python for a range (pages to map) in the timed passes.
    """
    import statistics

    import defrag
    from defrag import fastpath

    fastpath.wait()
    tdev = _torch_device(device)
    live = MIXED_LIVE
    calls = 1_000 if smoke else MIXED_CALLS
    fresh_calls = 500 if smoke else FRESH_CALLS
    repeat = 3 if smoke else 9
    pairs = 1 if smoke else 5
    capacity = 128 * MiB if smoke else 1 << 30
    seq = mixed_sequence(calls)
    common = {"sizes": f"{len(MIXED_SIZES)} log-spaced, 16 B - 1 MiB", "tensors_live": live,
              "method": "pool.empty + del", "baseline": "torch.empty + del"}
    goal = f"pool <= {MIXED_GOAL_X:g}x torch.empty (mixed sizes)"
    rows = []
    with defrag.Pool(device=device, capacity=capacity, auto_compact=False) as pool:
        pool_alloc = functools.partial(pool.empty, dtype=torch.uint8)
        torch_alloc = functools.partial(torch.empty, dtype=torch.uint8, device=tdev)
        t = time_host_interleaved({"pool": lambda: _replay_mixed(pool_alloc, seq, live),
                                   "torch": lambda: _replay_mixed(torch_alloc, seq, live)},
                                  number=1, repeat=repeat, warmup=1)
        tp, tt = t["pool"], t["torch"]
        ratio = tp.median / tt.median if tt.median > 0 else None
        python_path = _python_path_calls(pool, pool_alloc, seq, live)
        rows.append({"pattern": "mixed, steady", **common, "device": pool.kind, "calls": calls,
                     "us_per_op": tp.median_us / calls, "best_us_per_op": tp.best_us / calls,
                     "baseline_us_per_op": tt.median_us / calls, "baseline_best_us_per_op": tt.best_us / calls,
                     "ratio_x": ratio, "best_ratio_x": tp.best / tt.best if tt.best > 0 else None,
                     "fast_path": fastpath.status(), "python_path_calls": python_path,
                     "timing": f"perf_counter, interleaved, median of {repeat} passes over the sequence",
                     "goal": goal, "goal_met": ratio <= MIXED_GOAL_X if ratio is not None else None})
        kind = pool.kind
    gc.collect()

    first = seq[:fresh_calls]
    runs = {"pool": [], "torch": []}
    for _ in range(pairs):  # in turn, so machine load hits both sides alike
        for side in ("pool", "torch"):
            runs[side].append(_fresh_run(side, device, first, live, capacity))
    per = {side: [r["seconds"] / len(first) * 1e6 for r in rs] for side, rs in runs.items()}
    med = {side: statistics.median(v) for side, v in per.items()}
    pair_ratios = [p / q for p, q in zip(per["pool"], per["torch"])]
    ratio = med["pool"] / med["torch"] if med["torch"] > 0 else None
    rows.append({"pattern": "mixed, first calls of a fresh process", **common, "device": kind,
                 "calls": len(first), "processes": pairs,
                 "us_per_op": med["pool"], "best_us_per_op": min(per["pool"]),
                 "baseline_us_per_op": med["torch"], "baseline_best_us_per_op": min(per["torch"]),
                 "ratio_x": ratio, "min_ratio_x": min(pair_ratios), "max_ratio_x": max(pair_ratios),
                 "first_call_us": statistics.median(r["first_call_seconds"] for r in runs["pool"]) * 1e6,
                 "baseline_first_call_us": statistics.median(r["first_call_seconds"] for r in runs["torch"]) * 1e6,
                 "setup_ms": statistics.median(r["setup_seconds"] for r in runs["pool"]) * 1e3,
                 "fast_path": "attached" if all(r.get("fast_path") for r in runs["pool"]) else "not attached",
                 "timing": f"perf_counter, one pass per fresh process, median of {pairs} processes a side",
                 "goal": goal, "goal_met": ratio <= MIXED_GOAL_X if ratio is not None else None})
    rows.append(_cpp_thread_row(device, seq, live, capacity, repeat, common, goal))
    return rows


def _cpp_thread_row(device: str, seq, live: int, capacity: int, repeat: int, common: dict, goal: str) -> dict:
    """`bench_alloc_mixed`'s C++-thread row (see there)."""
    import statistics

    import defrag

    sizes = [n for _, n in seq]
    native, baseline = [], []
    with defrag.Pool(device=device, capacity=capacity, auto_compact=False) as pool:
        fast = pool.core.fast
        fast.churn(sizes, len(sizes), live=live, native=True)  # warm: the pages the sequence needs are mapped
        fast.churn(sizes, len(sizes), live=live, native=False)
        trips = fast.native_misses
        for _ in range(repeat):
            seconds, failed, _ = fast.churn(sizes, len(sizes), live=live, native=True)
            if failed:
                raise RuntimeError(f"{failed} native allocations failed in the C++-thread benchmark")
            native.append(seconds / len(sizes) * 1e6)
            baseline.append(fast.churn(sizes, len(sizes), live=live, native=False)[0] / len(sizes) * 1e6)
        trips = fast.native_misses - trips
        kind = pool.kind
    ratio = statistics.median(native) / statistics.median(baseline)
    return {"pattern": "mixed, from a C++ thread", **common, "method": "native placement (no GIL) + drop",
            "baseline": "at::empty + drop", "device": kind, "calls": len(sizes),
            "us_per_op": statistics.median(native), "best_us_per_op": min(native),
            "baseline_us_per_op": statistics.median(baseline), "baseline_best_us_per_op": min(baseline),
            "ratio_x": ratio, "best_ratio_x": min(native) / min(baseline), "python_trips": trips,
            "timing": f"steady_clock in the C++ thread, interleaved, median of {repeat} passes",
            "goal": goal, "goal_met": ratio <= MIXED_GOAL_X}


def plot_alloc_mixed(rows, path) -> bool:
    from .runner import _pyplot, _save

    rows = [r for r in rows if "us_per_op" in r]
    if not rows:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["us_per_op"] for r in rows], 0.4, label="pool.empty")
    ax.bar([i + 0.2 for i in x], [r["baseline_us_per_op"] for r in rows], 0.4, label="torch.empty", color="tab:gray")
    ax.set_xticks(list(x), [f"{r['pattern'].removeprefix('mixed, ')}\n{r['ratio_x']:.2f}x" for r in rows], fontsize=8)
    ax.set_ylabel("us per alloc+free")
    ax.set_title("64 sizes, 16 B - 1 MiB, 32 live", fontsize=9)
    ax.legend(fontsize=8)
    return _save(fig, path)
