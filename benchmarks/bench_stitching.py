"""Stitching: how fast physical pages are mapped into one virtual range, and what SetAccess costs.

Driver level (`defrag.driver.Driver`, one page = the device granularity):

- ``create``: cuMemCreate of N pages (pages per ms);
- ``map, one SetAccess per range``: N cuMemMap (one per page, so each page
  can later be unmapped alone) then ONE cuMemSetAccess over the N pages —
  what `defrag.vmm` does;
- ``map, SetAccess per page``: N cuMemMap and N cuMemSetAccess — the
  baseline the first is compared with (ratio = range / per-page rate);
- ``unmap``: N cuMemUnmap (pages per ms).

Pool level: a pool whose pages are all mapped, with every other page's
tensor freed (N empty mapped pages scattered between live ones), then ONE
request of N pages: the pool unmaps the N donor pages and maps their physical
pages into a fresh contiguous run (``pool stitched request``, pages per ms of
that request).

On a GPU these are the CUDA driver's VMM costs. On the emulated device a
page is a memfd: cuMemMap is mmap(MAP_FIXED), SetAccess is mprotect and unmap
is an mmap(PROT_NONE) over the range, so the numbers measure Linux mmap and
mprotect costs (plus the emulation's bookkeeping), not a GPU's.
All timing is host wall-clock (time.perf_counter): these calls are
synchronous on the host.
"""

from __future__ import annotations

import statistics
import time

MiB = 1 << 20


def _driver(device: str, npages: int):
    from defrag.driver import Driver, open_driver

    if device.startswith("cuda"):
        return open_driver(device)
    # A private emulated device, so its page count and capacity are exactly ours.
    return Driver.emulated(capacity=(npages + 8) * 2 * MiB, granularity=2 * MiB)


def bench_stitching(device: str, smoke: bool) -> list[dict]:
    """Pages per ms for create, map (+SetAccess per range or per page), unmap, and a stitched pool request."""
    npages = 16 if smoke else (512 if device.startswith("cuda") else 256)
    repeat = 3 if smoke else 7
    drv = _driver(device, npages)
    P = drv.granularity
    label = "cuda" if drv.kind == "cuda" else "emulated (mmap/mprotect)"
    rows = []

    t0 = time.perf_counter()
    handles = [drv.create(P) for _ in range(npages)]
    t_create = time.perf_counter() - t0
    va = drv.reserve(npages * P, P)
    try:
        def map_all(per_page_access: bool) -> float:
            t0 = time.perf_counter()
            for i, h in enumerate(handles):
                drv.map(va + i * P, P, h)
                if per_page_access:
                    drv.set_access(va + i * P, P)
            if not per_page_access:
                drv.set_access(va, npages * P)
            return time.perf_counter() - t0

        def unmap_all() -> float:
            drv.synchronize()  # cuMemUnmap does not wait for queued work
            t0 = time.perf_counter()
            for i in range(npages):
                drv.unmap(va + i * P, P)
            return time.perf_counter() - t0

        samples = {"range": [], "page": [], "unmap": []}
        map_all(False)  # warm-up
        unmap_all()
        for _ in range(repeat):  # interleaved, so drift hits both variants alike
            for variant in ("range", "page"):
                samples[variant].append(map_all(variant == "page"))
                samples["unmap"].append(unmap_all())
    finally:
        drv.free_address(va, npages * P)
        for h in handles:
            drv.release(h)
        if drv.kind == "emulated":
            drv.close()  # a private device; the CUDA driver is shared and stays open

    def rate(seconds: float) -> float:
        return npages / (seconds * 1e3)

    per_range = statistics.median(samples["range"])
    per_page = statistics.median(samples["page"])
    common = {"backend": label, "pages": npages, "page_bytes": P}
    rows.append({"op": "create (cuMemCreate)", **common, "pages_per_ms": rate(t_create),
                 "us_per_page": t_create / npages * 1e6, "timing": "one pass (first use)"})
    rows.append({"op": "map, one SetAccess per range", **common, "pages_per_ms": rate(per_range),
                 "us_per_page": per_range / npages * 1e6,
                 "baseline": "map, SetAccess per page", "baseline_pages_per_ms": rate(per_page),
                 "ratio_x": per_page / per_range, "timing": f"median of {repeat}"})
    rows.append({"op": "map, SetAccess per page", **common, "pages_per_ms": rate(per_page),
                 "us_per_page": per_page / npages * 1e6, "timing": f"median of {repeat}"})
    unmap = statistics.median(samples["unmap"])
    rows.append({"op": "unmap (cuMemUnmap)", **common, "pages_per_ms": rate(unmap),
                 "us_per_page": unmap / npages * 1e6, "timing": f"median of {2 * repeat}"})
    rows.append(_pool_stitch(device, npages, repeat, label))
    return rows


def _pool_stitch(device: str, npages: int, repeat: int, label: str) -> dict:
    """One request of `npages` pages served by unmapping scattered empty pages and remapping them."""
    import torch

    import defrag

    drv = _driver(device, 2 * npages)
    P = drv.granularity
    samples = []
    with defrag.Pool(device=drv, capacity=2 * npages * P, auto_compact=False) as pool:
        for _ in range(repeat + 1):
            pages = [pool.empty(P, dtype=torch.uint8) for _ in range(2 * npages)]  # every page mapped
            del pages[1::2]  # every other page empty: no run of 2 free pages, N free physical pages
            if pool.kind == "cuda":
                torch.cuda.synchronize(pool.device)  # the frees wait on stream events: let them complete
            pool.stats()  # a pool call: applies the queued frees (untimed)
            t0 = time.perf_counter()
            big = pool.empty(npages * P, dtype=torch.uint8)
            samples.append(time.perf_counter() - t0)
            del big, pages
        samples = samples[1:]  # the first request also created the region's bookkeeping
    if drv.kind == "emulated":
        drv.close()
    seconds = statistics.median(samples)
    return {"op": "pool stitched request (unmap N donors + map N)", "backend": label, "pages": npages,
            "page_bytes": P, "pages_per_ms": npages / (seconds * 1e3), "us_per_page": seconds / npages * 1e6,
            "timing": f"median of {repeat}"}


def plot_stitching(rows, path) -> bool:
    from .runner import _pyplot, _save

    rows = [r for r in rows if "pages_per_ms" in r]
    if not rows:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.4))
    ax.barh([r["op"] for r in rows][::-1], [r["pages_per_ms"] for r in rows][::-1], color="tab:blue")
    ax.set_xlabel(f"pages per ms ({rows[0]['page_bytes'] // MiB} MiB pages, {rows[0]['backend']})")
    ax.tick_params(axis="y", labelsize=7)
    return _save(fig, path)
