"""alloc+free: `pool.empty` then dropping the tensor, vs `torch.empty` on the same device, same run.

Two patterns per size:

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

import gc

import torch

from .runner import time_host_interleaved

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
