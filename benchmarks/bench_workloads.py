"""Workloads: replay each trace generator against the pool with compaction on and off.

For every generator of `defrag.traces.GENERATORS` (LLM serving, training
recorded from a real PyTorch model, model/adapter swapping, the adversarial
checkerboard) one trace is built with a fixed seed and replayed with
`defrag.replay.replay` at one capacity: the trace's peak live bytes times
``HEADROOM``, rounded up to whole 2 MiB pages, plus one page. Allocators:

- ``defrag``: a real pool on the device that compacts at every phase marker
  and when an allocation fails;
- ``defrag-no-compaction``: the same pool, never compacting;
- on a GPU only, ``torch`` and ``torch-expandable``: PyTorch's caching
  allocator (plain, and with ``expandable_segments:True``) in subprocesses,
  capped with ``set_per_process_memory_fraction`` (`defrag.replay.torch_baselines`).

Per row: peak live bytes (the pool's ``allocated_bytes.all.peak``: blocks
rounded to 512 B), peak reserved bytes (the most pages ever mapped at once,
compaction transients included; PyTorch's ``reserved_bytes.all.peak``),
their ratio, allocations that failed (OOMs; each is skipped), compactions
and bytes moved, and (full runs) the smallest capacity in whole pages at
which the trace completes, by bisection over dry replays (the pool's
placement and compaction decisions without memory). Goal, for ``defrag``:
peak reserved <= 1.02 x peak live + one page at that smallest capacity (a
dry replay there; at ``HEADROOM`` the growth policy keeps up to 1.10 x the
live bytes mapped by design, `defrag.page_growth`); not judged in smoke runs,
which search no smallest capacity.
"""

from __future__ import annotations

MiB = 1 << 20
PAGE = 2 * MiB
HEADROOM = 1.25


def _traces(smoke: bool) -> dict:
    from defrag.traces import GENERATORS

    if not smoke:
        return {name: (lambda g=gen: g(seed=0)) for name, gen in GENERATORS.items()}
    small = {
        "llm_serving": dict(steps=120, weights_bytes=8 * MiB, max_batch=8),
        "training_from_model": dict(steps=2, d_model=64, nhead=4, dim_feedforward=128, num_layers=2, batch=2,
                                    min_len=8, max_len=32),
        "model_swap": dict(swaps=2, requests_per_model=4, models={"a": (256, 2, 4000), "b": (320, 2, 4000)}),
        "checkerboard": dict(total_bytes=16 * MiB, rounds=1),
    }
    return {name: (lambda g=gen, kw=small.get(name, {}): g(seed=0, **kw)) for name, gen in GENERATORS.items()}


def bench_workloads(device: str, smoke: bool) -> list[dict]:
    """Peak live, peak reserved, ratio and OOMs per workload and allocator (see the module docstring)."""
    from .runner import Skip

    try:
        from defrag.replay import min_capacity, replay, torch_baselines
    except ImportError as exc:
        raise Skip(f"defrag.replay / defrag.traces are not available ({exc})") from None

    gpu = device.startswith("cuda")
    rows = []
    for name, make in _traces(smoke).items():
        trace = make()
        st = trace.stats()
        capacity = (-(-int(st.peak_live_bytes * HEADROOM) // PAGE) + 1) * PAGE
        results = [replay(trace, capacity, device=device, compaction=c, progress=False) for c in (True, False)]
        skipped = []
        if gpu:
            extra, skipped = torch_baselines(trace, capacity)
            results += extra
        if not smoke:
            for r in results[:2]:
                r.min_capacity = min_capacity(trace, compaction=r.allocator == "defrag", page_size=PAGE,
                                              known_good=r.capacity if r.completed else None,
                                              known_bad=None if r.completed else r.capacity)
        off = results[1]
        for r in results:
            row = {
                "workload": name,
                "allocator": r.allocator,
                "events": r.events,
                "capacity_bytes": r.capacity,
                "peak_live_bytes": r.peak_live_bytes,
                "peak_reserved_bytes": r.peak_reserved_bytes,
                "reserved_over_live_x": r.reserved_over_live,
                "ooms": r.ooms,
                "failed_bytes": r.failed_bytes,
                "compactions": r.compactions if r.allocator.startswith("defrag") else None,
                "moved_bytes": r.moved_bytes if r.allocator.startswith("defrag") else None,
                "min_capacity_bytes": r.min_capacity.bytes if r.min_capacity is not None else None,
                "seconds": r.seconds,
                "device": r.device,
            }
            if r.allocator == "defrag":
                row["baseline"] = off.allocator
                row["baseline_peak_reserved_bytes"] = off.peak_reserved_bytes
                row["reserved_vs_baseline_x"] = (r.peak_reserved_bytes / off.peak_reserved_bytes
                                                 if off.peak_reserved_bytes else None)
                # Judged where the issue set it, at the smallest capacity that completes: at this roomier
                # one the growth policy keeps up to 1.10x the live bytes mapped (defrag.page_growth).
                row["goal"] = "peak reserved <= 1.02x peak live + one page, at the smallest capacity that completes"
                row["goal_met"] = None
                if r.min_capacity is not None and r.min_capacity.bytes is not None:
                    tight = replay(trace, r.min_capacity.bytes, dry=True, compaction=True, page_size=PAGE,
                                   progress=False)
                    row["reserved_over_live_at_min_capacity_x"] = tight.reserved_over_live
                    row["goal_met"] = tight.meets_goal()
            if r.error:
                row["error"] = r.error
            if r.notes:
                row["notes"] = "; ".join(r.notes)
            rows.append(row)
        for s in skipped:
            rows.append({"workload": name, "allocator": s["allocator"], "skipped": s["reason"]})
    return rows


def plot_workloads(rows, path) -> bool:
    from .runner import _pyplot, _save

    rows = [r for r in rows if r.get("peak_live_bytes")]
    if not rows:
        return False
    plt = _pyplot()
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    allocators = list(dict.fromkeys(r["allocator"] for r in rows))
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / (len(allocators) + 1)
    for j, alloc in enumerate(["peak live"] + allocators):
        xs, ys = [], []
        for i, w in enumerate(workloads):
            r = next((r for r in rows if r["workload"] == w and (alloc == "peak live" or r["allocator"] == alloc)), None)
            if r is None:
                continue
            xs.append(i + (j - len(allocators) / 2) * width)
            ys.append((r["peak_live_bytes"] if alloc == "peak live" else r["peak_reserved_bytes"]) / MiB)
        ax.bar(xs, ys, width, label=alloc if alloc == "peak live" else f"reserved: {alloc}",
               color="tab:gray" if alloc == "peak live" else None)
    ax.set_xticks(range(len(workloads)), workloads, fontsize=8)
    ax.set_ylabel("MiB")
    ax.set_title("peak reserved vs peak live", fontsize=9)
    ax.legend(fontsize=7)
    return _save(fig, path)
