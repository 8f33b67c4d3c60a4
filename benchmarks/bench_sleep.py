"""sleep: `pool.sleep()` / `pool.wake()` and `offload` / `reload` against a plain host copy of the same bytes.

A pool is filled to about 90% with 4 MiB tensors (uint8, a pattern written
once). Measured, host wall-clock (time.perf_counter), best of `repeat`
rounds, each on the same tensors:

- ``sleep``: copy every live tensor to one pinned host buffer, unmap and
  release every device page (`pool.sleep()`), in seconds per GiB of live
  bytes;
- ``wake``: map device pages at the same addresses and copy the bytes back
  (`pool.wake()`);
- ``offload`` / ``reload``: half the tensors (each owns its pages, so no
  packing move) swapped to host-located pages at the same addresses and back.

Baseline, in the same run, per row: the same bytes copied by torch between
the pool's tensors and preallocated host tensors (device to host for sleep
and offload, host to device for wake and reload): on a GPU ``copy_`` to and
from pinned host memory (``pin_memory=True``, synchronized); on the emulated
device a CPU ``copy_`` (a memmove), since its "device" is host memory too.
``ratio_x`` = seconds / baseline seconds: the cost of the page work (unmap,
release, create, map, SetAccess) on top of moving the bytes. Every round
checks the bytes after wake and reload (``bytes_intact``).

On the emulated device the page work is Linux mmap/munmap on memfds (a written
page costs ~0.1-0.2 ms to unmap there, far more than on a GPU), so compare
emulated rows only with each other.
"""

from __future__ import annotations

import time

from .runner import device_pool, device_sync

MiB, GiB = 1 << 20, 1 << 30
TENSOR = 4 * MiB


def _timed(device: str, fn) -> float:
    device_sync(device)
    t0 = time.perf_counter()
    fn()
    device_sync(device)
    return time.perf_counter() - t0


def bench_sleep(device: str, smoke: bool) -> list[dict]:
    import torch

    capacity = (64 if smoke else 1024) * MiB
    repeat = 2 if smoke else 3
    pool = device_pool(device, capacity)
    gpu = device.startswith("cuda")
    try:
        n = int(capacity * 0.9) // TENSOR
        ts = [pool.empty((TENSOR,), dtype=torch.uint8) for _ in range(n)]
        for i, t in enumerate(ts):
            t.copy_((torch.arange(TENSOR, dtype=torch.int64, device=t.device) * 7 + i).remainder(251).to(torch.uint8))
        sums = [int(t[:: 4096].to(torch.int64).sum()) for t in ts]
        host = [torch.empty(TENSOR, dtype=torch.uint8, pin_memory=gpu) for _ in ts]
        half = ts[: n // 2]
        live = n * TENSOR

        def d2h(tensors):
            for h, t in zip(host, tensors):
                h.copy_(t, non_blocking=gpu)

        def h2d(tensors):
            for h, t in zip(host, tensors):
                t.copy_(h, non_blocking=gpu)

        def intact() -> bool:
            return all(int(t[:: 4096].to(torch.int64).sum()) == s for t, s in zip(ts, sums))

        times = {k: [] for k in ("sleep", "wake", "offload", "reload", "d2h", "h2d", "d2h_half", "h2d_half")}
        ok = True
        supported, why = pool.driver.host_pages_supported()
        for _ in range(repeat):
            times["d2h"].append(_timed(device, lambda: d2h(ts)))
            times["sleep"].append(_timed(device, lambda: pool.sleep(progress=False)))
            times["wake"].append(_timed(device, lambda: pool.wake(progress=False)))
            times["h2d"].append(_timed(device, lambda: h2d(ts)))
            ok = ok and intact()
            if supported:
                times["d2h_half"].append(_timed(device, lambda: d2h(half)))
                times["offload"].append(_timed(device, lambda: pool.offload(half, progress=False)))
                times["reload"].append(_timed(device, lambda: pool.reload(half, progress=False)))
                times["h2d_half"].append(_timed(device, lambda: h2d(half)))
                ok = ok and intact()
        baseline = ("torch copy_ to/from pinned host tensors, synchronized" if gpu
                    else "torch CPU copy_ to/from preallocated host tensors (memmove)")
        rows = []
        for op, base, nbytes in (("sleep", "d2h", live), ("wake", "h2d", live),
                                 ("offload", "d2h_half", len(half) * TENSOR),
                                 ("reload", "h2d_half", len(half) * TENSOR)):
            if not times[op]:
                rows.append({"operation": op, "skipped": f"no host-located pages here: {why}"})
                continue
            s, b = min(times[op]), min(times[base])
            rows.append({
                "operation": op, "device": "cuda" if gpu else "emulated", "bytes": nbytes, "tensors": nbytes // TENSOR,
                "seconds": s, "s_per_gib": s * GiB / nbytes, "gbps": nbytes / s / 1e9,
                "baseline": baseline, "baseline_seconds": b, "baseline_s_per_gib": b * GiB / nbytes,
                "ratio_x": s / b if b else None, "bytes_intact": ok,
                "timing": f"perf_counter, best of {repeat}" + (", synchronized" if gpu else ""),
            })
        return rows
    finally:
        pool.close()


def plot_sleep(rows, path) -> bool:
    rows = [r for r in rows if "s_per_gib" in r]
    if not rows:
        return False
    from .runner import _pyplot, _save

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["s_per_gib"] for r in rows], width=0.4, label="defrag", color="tab:blue")
    ax.bar([i + 0.2 for i in x], [r["baseline_s_per_gib"] for r in rows], width=0.4, label="host copy",
           color="tab:gray")
    ax.set_xticks(list(x), [r["operation"] for r in rows])
    ax.set_ylabel("seconds per GiB")
    ax.set_title(f"sleep/wake/offload/reload vs a host copy ({rows[0]['device']})", fontsize=9)
    ax.legend(fontsize=8)
    return _save(fig, path)
