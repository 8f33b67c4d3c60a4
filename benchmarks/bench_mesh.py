"""mesh: what meshing gives back when nothing can move, against the lower bound, and what it costs.

A pool is filled to ~95% with pinned tensors (compaction cannot move a
pinned tensor, as it cannot move PyTorch's own blocks under `defrag.install`)
of seeded random sizes 16-256 KiB, each written with its own byte. Then a
seeded random share of them is dropped in random order, leaving 25%, 50% or
75% of the live bytes (occupancy), and the empty pages are unmapped
(`trim(mesh=False)`): what is left are pages holding live data. Then
`pool.mesh()`, timed (host wall-clock, synchronized on a GPU).

Per occupancy, one row:

- ``pages_before``: physical pages held (``reserved_bytes.all.current`` /
  page) before meshing; ``pages_after``: after;
- ``lower_bound``: live bytes rounded up to pages, what perfect packing
  would hold; ``gap_closed``: the share of ``pages_before - lower_bound``
  that meshing gave back;
- ``copied_mib`` and ``copied_kib_per_freed_page``: the bytes meshing
  copied; ``ms`` and ``ms_per_freed_page``: its time (planning, copies,
  remaps);
- ``bytes_intact``: every surviving tensor still reads its own byte, and
  ``pointers_kept``: none moved.

No baseline allocator can do this (PyTorch's caching allocator frees a
segment only when all of it is free), so the figure to read is the gap to
the lower bound. Sizes are random and placement is the pool's own (best
fit, densest first), so survivors sit at scattered offsets: partial pages
mesh when their live bytes do not overlap at page offsets.
"""

from __future__ import annotations

import random
import time

from .runner import device_pool, device_sync

KiB, MiB = 1 << 10, 1 << 20
OCCUPANCIES = (0.25, 0.5, 0.75)
SIZES = (16 * KiB, 256 * KiB)
SEED = 26
FILL = 0.95


def _fill(pool, rng: random.Random) -> list:
    """Pinned uint8 tensors of random sizes until ~FILL of the capacity is live, each holding its own byte."""
    import torch

    tensors, live = [], 0
    while live < FILL * pool.capacity:
        n = rng.randint(*SIZES)
        try:
            t = pool.empty(n, dtype=torch.uint8)
        except Exception:  # the pool is full before FILL: enough
            break
        t.fill_(len(tensors) % 251 + 1)
        pool.pin(t)
        tensors.append(t)
        live += n
    return tensors


def _row(device: str, capacity: int, occupancy: float) -> dict:
    import torch

    rng = random.Random(f"{SEED}-{occupancy}")
    pool = device_pool(device, capacity)
    try:
        page = pool.page_size
        tensors = _fill(pool, rng)
        order = list(range(len(tensors)))
        rng.shuffle(order)
        total = sum(t.numel() for t in tensors)
        live = total
        keep = {}
        for i in order:  # drop in random order until the live bytes fall to the occupancy
            if live <= occupancy * total:
                keep[i] = tensors[i]
                continue
            pool.unpin(tensors[i])
            live -= tensors[i].numel()
        del tensors
        pool.trim(mesh=False)  # the empty pages go: what remains holds data
        before = pool.stats()["reserved_bytes.all.current"] // page
        pointers = {i: t.data_ptr() for i, t in keep.items()}
        device_sync(device)
        t0 = time.perf_counter()
        report = pool.mesh()
        device_sync(device)
        seconds = time.perf_counter() - t0
        after = pool.stats()["reserved_bytes.all.current"] // page
        intact = all(bool(torch.all(t == i % 251 + 1)) for i, t in keep.items())
        kept = all(t.data_ptr() == pointers[i] for i, t in keep.items())
        bound = -(-live // page)
        freed = before - after
        return {"occupancy": occupancy, "device": pool.kind, "tensors_live": len(keep),
                "live_mib": live / MiB, "pages_before": before, "pages_after": after, "lower_bound": bound,
                "gap_closed": (freed / (before - bound)) if before > bound else None,
                "meshed_pages": report.meshed_pages, "groups": report.groups, "freed_pages": freed,
                "copied_mib": report.copied_bytes / MiB,
                "copied_kib_per_freed_page": report.copied_bytes / KiB / freed if freed else None,
                "ms": seconds * 1e3, "ms_per_freed_page": seconds * 1e3 / freed if freed else None,
                "bytes_intact": intact, "pointers_kept": kept,
                "timing": "perf_counter around pool.mesh(), synchronized; one run"}
    finally:
        pool.close()


def bench_mesh(device: str, smoke: bool) -> list[dict]:
    """One row per occupancy (25/50/75%) on a pool of pinned random-size tensors; see the module docstring."""
    capacity = (32 if smoke else 256) * MiB
    return [_row(device, capacity, occ) for occ in OCCUPANCIES]


def plot_mesh(rows: list[dict], path):
    """Pages held before and after meshing, and the lower bound, per occupancy; `path`, or None without rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "pages_before" in r]
    if not rows:
        return None
    labels = [f"{r['occupancy']:.0%}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    w = 0.27
    ax.bar([i - w for i in x], [r["pages_before"] for r in rows], w, label="before meshing", color="#d62728")
    ax.bar(list(x), [r["pages_after"] for r in rows], w, label="after meshing", color="#2ca02c")
    ax.bar([i + w for i in x], [r["lower_bound"] for r in rows], w, label="lower bound (live bytes)",
           color="#7f7f7f")
    ax.set_xticks(list(x), labels)
    ax.set_xlabel("share of the bytes left live (pinned, 16-256 KiB, dropped in random order)")
    ax.set_ylabel("physical pages held")
    ax.set_title(f"Meshing pinned pages ({rows[0]['device']})")
    ax.set_ylim(0, 1.3 * max(r["pages_before"] for r in rows))
    ax.legend(fontsize=8, loc="upper center", ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
