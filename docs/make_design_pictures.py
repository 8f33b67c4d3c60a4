"""Draw docs/img/design-layers.png, the layer picture of docs/design.md, and the guide's compaction picture.

    python docs/make_design_pictures.py            # writes docs/img/design-layers.png and guide-compaction.png
    python docs/make_design_pictures.py guide      # only docs/img/guide-compaction.png

docs/img/guide-compaction.png (docs/guide.md, "Observability") is not drawn by
hand: `draw_guide_compaction` runs a small serving-like workload on a private
emulated device, compacts the pool as `pool.compact()` does by default, and
draws `defrag.viz.plot_compaction` of the layouts before and after. Run it
again whenever compaction or the picture changes, and check the guide's text
under the picture against the numbers it prints.

Boxes and arrows only (matplotlib, Agg canvas; no display needed). Keep it in
step with the "Layers" section of docs/design.md and with the import rules that
tests/cpu/test_layers.py checks: an arrow means "calls / imports"; every arrow
points down or sideways, never up.
"""

from __future__ import annotations

import pathlib
import sys

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

OUT = pathlib.Path(__file__).resolve().parent / "img" / "design-layers.png"

# Colours: grey = callers, orange = torch faces, green = torch-free face and
# core, light green = pure bookkeeping, blue = address space / driver, peach =
# what actually holds the bytes.
GREY, TORCH, CORE, PURE, LOW, METAL, BAND = "#ececec", "#f5e1c0", "#d5ead0", "#e8f3e3", "#dbe6f3", "#fbe3d6", "#f7f7f7"
EDGE, ARROW, NOTE = "#44546a", "#44546a", "#5a6a80"

W, H = 1000, 800  # drawing units = pixels at dpi 100


def _box(ax, x, y, w, h, title, body="", color=CORE, dashed=False, title_size=11.5, body_size=8.6):
    """A rounded box with a bold title and a smaller body, (x, y) = top-left corner."""
    ax.add_patch(FancyBboxPatch((x, H - y - h), w, h, boxstyle="round,pad=0,rounding_size=9",
                                linewidth=1.3, edgecolor=EDGE, facecolor=color,
                                linestyle=(0, (4, 3)) if dashed else "-"))
    cx = x + w / 2
    if body:
        ax.text(cx, H - y - h * 0.30, title, ha="center", va="center", fontsize=title_size, fontweight="bold",
                color="#111111")
        ax.text(cx, H - y - h * 0.68, body, ha="center", va="center", fontsize=body_size, color="#111111",
                linespacing=1.25)
    else:
        ax.text(cx, H - y - h / 2, title, ha="center", va="center", fontsize=title_size, fontweight="bold",
                color="#111111")
    return x, y, w, h


def _band(ax, y, h, label):
    """A pale horizontal band behind one layer, labelled on the left."""
    ax.add_patch(FancyBboxPatch((8, H - y - h), W - 16, h, boxstyle="round,pad=0,rounding_size=6",
                                linewidth=0, facecolor=BAND, zorder=-2))
    ax.text(16, H - y - 3, label, ha="left", va="top", fontsize=8, style="italic", color=NOTE)


def _arrow(ax, x0, y0, x1, y1, label="", label_dx=6):
    ax.add_patch(FancyArrowPatch((x0, H - y0), (x1, H - y1), arrowstyle="-|>", mutation_scale=11,
                                 linewidth=1.2, color=ARROW, shrinkA=0, shrinkB=0))
    if label:
        ax.text((x0 + x1) / 2 + label_dx, H - (y0 + y1) / 2, label, ha="left", va="center", fontsize=7.8,
                style="italic", color=NOTE)


def draw(path: pathlib.Path = OUT) -> pathlib.Path:
    fig = Figure(figsize=(W / 100, H / 100), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, W)
    ax.set_ylim(0, H)
    ax.axis("off")

    ax.text(W - 10, H - 8, "calls go down; up only what was passed down", ha="right", va="top", fontsize=9,
            style="italic", color=NOTE)

    # ---- callers
    _box(ax, 40, 22, 220, 58, "retry.py", "retry_on_oom: compact + retry", GREY)
    _box(ax, 280, 22, 680, 58, "user code  /  CLI: defrag demo | doctor | bench | replay",
         "Pool(...).empty / adopt / pin / compact,   defrag.compact(),   replay --dry,   PyTorch's allocator",
         GREY)

    # ---- faces
    _band(ax, 94, 138, "faces")
    _box(ax, 40, 114, 330, 112, "pool.py  Pool",
         "torch storages over blocks; parts over one\nPoolContext (ownership, residency, meshing,\n"
         "segments, observability); _TorchMover\n+ tensors.py, storage_ext.py (torch glue)",
         TORCH)
    _box(ax, 390, 114, 260, 112, "capture.py  TorchAllocator",
         "PyTorch's pluggable allocator over\nthe same pages (segments);\npool.capture(); and\nallocator_install.py: install()",
         TORCH)
    _box(ax, 670, 114, 290, 112, "dry.py  DryPool",
         "the same core, blocks named by keys;\n_KeyMover rewrites a dict entry;\n"
         "no torch: dry replays (replay --dry)",
         CORE)

    # ---- core
    _band(ax, 246, 126, "policy (no torch)")
    _box(ax, 40, 266, 450, 96, "core.py  Core",
         "blocks (Block), placement, release queue (drain, settle),\ncounters, the allocation ladder; "
         "threads.py: Gate; movability.py:\nUsers.scope, Scope.blocker; readout.py: stats, layout",
         CORE)
    _box(ax, 510, 266, 450, 96, "compactor.py  compact_core / rescue",
         "plan, prepare, copy, verify, commit, release, per wave\nin a Transaction; records through Core.waves, "
         "owners\nthrough the face's Mover; mesher.py, residency.py beside it",
         CORE)

    # ---- pure parts, address space, kernels
    _box(ax, 40, 400, 160, 78, "native/  Books", "C++: heaps (best fit),\npage counts, kept\nranges, meshes; fast path",
         PURE, body_size=8.2)
    _box(ax, 365, 400, 185, 78, "backing.py  Backing", "every map, unmap, stitch,\nmesh, sleep/wake, re-backing;\nbooks kept in step",
         PURE, body_size=8.2)
    _box(ax, 210, 400, 145, 78, "planners", "pure: layouts ->\nmoves (planner.py),\nbitmaps -> meshes",
         PURE, body_size=8.2)
    _box(ax, 575, 400, 150, 78, "vmm.py", "AddressSpace,\nPageStore, Region,\nTransaction",
         LOW, body_size=8.2)
    _box(ax, 740, 400, 220, 78, "defrag.kernels", "kernels/ (numba-cuda):\nbatched_move, fill, checksum", LOW)

    # ---- driver
    _band(ax, 496, 220, "driver: one surface, three implementations")
    _box(ax, 40, 518, 680, 68, "driver/cuda.py  Driver",
         "the one adapter: CUresult -> CudaError;  FaultInjector (driver/faults.py) in front;  open_driver(spec)",
         LOW)
    _box(ax, 740, 518, 220, 68, "GPU / numba simulator", "kernels run on the device\nor on the CPU", METAL,
         title_size=10.5)
    _box(ax, 40, 620, 210, 84, "cuda.bindings.driver", "a real GPU (only the\nCUDA kind loads libcuda)", METAL,
         title_size=10.5)
    _box(ax, 270, 620, 220, 84, "EmulatedCuda", "driver/emulated.py: memfd\npages at fixed addresses;\n"
         "tombstones when unmapped", METAL, title_size=10.5, body_size=8.2)
    _box(ax, 510, 620, 210, 84, "MemorylessCuda", "driver/memoryless.py: the\nsame rules and books,\nno bytes",
         METAL, title_size=10.5, body_size=8.2)

    notes = [
        "errors.py, units.py: used by every layer (no torch).   oom.py: OutOfMemoryError, raised by the torch faces"
        " from the core's OutOfRoom.",
        "distributed.py: a face over Pool (ranks decide together).   residency.py: sleep/wake, offload/reload;"
        " mesher.py: meshing (policy, no torch).",
        "core, compactor and residency also call the Driver itself.   stats.py and viz.py read the core's layout and"
        " counters and change nothing.",
        "pool.empty's fast path (native/module.cpp) places through the same books, under their lock, when no page"
        " must be mapped.",
        "An arrow: calls / imports.",
    ]
    for i, note in enumerate(notes):
        ax.text(W / 2, H - 724 - 17 * i, note, ha="center", va="center", fontsize=8.2, color=NOTE)

    # ---- arrows: callers -> faces
    _arrow(ax, 150, 80, 150, 114)                       # retry_on_oom -> Pool.compact
    _arrow(ax, 330, 80, 330, 114)
    _arrow(ax, 520, 80, 520, 114)
    _arrow(ax, 815, 80, 815, 114)
    _arrow(ax, 390, 170, 370, 170)                      # TorchAllocator -> Pool.alloc_segment / free_segment
    # faces -> core and compactor
    _arrow(ax, 160, 226, 160, 266)
    _arrow(ax, 300, 226, 560, 266, "Mover", label_dx=-34)
    _arrow(ax, 745, 226, 420, 266)
    _arrow(ax, 860, 226, 860, 266, "Mover")
    # compactor -> core (sideways); core, compactor -> heap, planner, vmm, kernels
    ax.annotate("", xy=(490, H - 314), xytext=(510, H - 314),
                arrowprops=dict(arrowstyle="-|>", color=ARROW, lw=1.2, mutation_scale=11))
    _arrow(ax, 120, 362, 120, 400)
    _arrow(ax, 400, 362, 420, 400)
    _arrow(ax, 560, 362, 300, 400)
    _arrow(ax, 640, 362, 500, 400)
    _arrow(ax, 830, 362, 850, 400)
    # backing -> vmm; vmm -> driver; kernels -> device
    ax.annotate("", xy=(575, H - 439), xytext=(550, H - 439),
                arrowprops=dict(arrowstyle="-|>", color=ARROW, lw=1.2, mutation_scale=11))
    _arrow(ax, 650, 478, 650, 518)
    _arrow(ax, 850, 478, 850, 518)
    # driver -> implementations
    _arrow(ax, 200, 586, 145, 620)
    _arrow(ax, 380, 586, 380, 620)
    _arrow(ax, 560, 586, 615, 620)

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, facecolor="white")
    return path


GUIDE_OUT = OUT.parent / "guide-compaction.png"


def draw_guide_compaction(path: pathlib.Path = GUIDE_OUT, seed: int = 0) -> dict:
    """The guide's picture: KV caches of 128 KiB to 1 MiB, 3 of 4 finished out of order, one pinned.

    A 64 MiB pool of 2 MiB pages on a private emulated device, filled to
    60 MiB; then `pool.compact()` with its defaults (the
    emptied pages stay mapped and free). Returns the figures the guide's text
    quotes.
    """
    import random

    import torch

    import defrag
    from defrag.driver import Driver
    from defrag.viz import layout_totals, plot_compaction

    rng = random.Random(seed)
    drv = Driver.emulated(capacity=128 << 20, granularity=2 << 20)
    with defrag.Pool(device=drv, capacity="64MiB", auto_compact=False) as pool:
        caches = []
        while pool.stats()["allocated_bytes.all.current"] < 60 << 20:  # most of the 32 pages
            caches.append(pool.empty((rng.choice((128, 256, 512, 1024)) << 10,), dtype=torch.uint8))
        rng.shuffle(caches)
        survivors = caches[: len(caches) // 4]  # 3 of every 4 requests finish, in random order
        del caches
        pinned = max(survivors, key=lambda t: t.numel())  # a large one, to be seen
        pool.pin(pinned)  # e.g. its address was handed to a CUDA graph
        before = pool.layout()
        report = pool.compact()
        after = pool.layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        plot_compaction(before, after, path, report=report)
        tb, ta = layout_totals(before), layout_totals(after)
        figures = {"path": str(path), "survivors": len(survivors), "moved": report.moved_tensors,
                   "pages_before": report.pages_before, "pages_after": report.pages_after,
                   "released": report.released_pages, "unmapped": report.unmapped_pages,
                   "mapped_before": tb["pages_mapped"], "mapped_after": ta["pages_mapped"],
                   "cached_after": ta["pages_cached"]}
        pool.unpin(pinned)
        del survivors, pinned
    return figures


if __name__ == "__main__":
    if sys.argv[1:] == ["guide"]:
        print(draw_guide_compaction())
    else:
        print(draw(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else OUT))
        if len(sys.argv) == 1:
            print(draw_guide_compaction())
