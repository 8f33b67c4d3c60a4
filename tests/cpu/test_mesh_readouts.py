"""Meshed pages as the read-outs show them (issue 26, docs/meshing.md "Statistics, pictures, snapshots"):
snapshot segments count a mesh's physical page once, the summary has a line on meshes, `live_tensors()`
says which blocks sit on meshed pages, and the memory map draws twins and joins them to their primary."""

from __future__ import annotations

import gc
import json
import re

import matplotlib.colors as mcolors
import matplotlib.image as mimage
import numpy as np
import torch
from matplotlib.collections import LineCollection
from torch.cuda import _memory_viz as memory_viz

from defrag import viz
from defrag.stats import segments_from_layout

from .conftest import KiB
from .test_mesh import P, _halves, _intact

BLOCK = 8 * KiB


def _meshed(make_pool, pages=8):
    """`pages` pages of pinned 8 KiB blocks, complementary halves kept, meshed: pages/2 meshes of two."""
    pool = make_pool("2MiB", auto_compact=False)
    kept = _halves(pool, pages, BLOCK)
    assert pool.mesh().meshed_pages == pages // 2
    return pool, kept


def _segment_totals_ok(segs, st):
    assert sum(s["total_size"] for s in segs) == st["reserved_bytes.all.current"]
    assert sum(s["allocated_size"] for s in segs) == st["allocated_bytes.all.current"]
    spans = sorted((s["address"], s["address"] + s["total_size"]) for s in segs)
    assert all(a[1] < b[0] for a, b in zip(spans, spans[1:])), "segments overlap or touch"
    for seg in segs:
        addr = seg["address"]
        for b in seg["blocks"]:
            assert b["address"] == addr, "blocks must tile the segment in address order"
            addr += b["size"]
        assert addr == seg["address"] + seg["total_size"]


# ---------------------------------------------------------------- snapshots
def _empty_a_twin(pool, kept: dict) -> int:
    """Free every tensor of the first twin page (it becomes dormant); returns that page."""
    region = pool.layout()["regions"][0]
    twin = region["pages"].index("meshed")
    for seed, t in list(kept.items()):
        if (t.data_ptr() - region["base"]) // P == twin:
            pool.unpin(t)
            del kept[seed]
    t = None
    gc.collect()
    return twin


def test_snapshot_segments_count_a_meshed_physical_page_once(make_pool):
    """8 half-used pages meshed onto 4 physical pages: 256 KiB reserved, and the segments add up to
    256 KiB (not the 512 KiB of the 8 virtual pages); every live block is in a segment, twins' included;
    PyTorch's memory_viz agrees. After the tensors of one twin die (a dormant twin) too."""
    pool, kept = _meshed(make_pool)
    st = pool.stats()
    assert st["reserved_bytes.all.current"] == 4 * P and st["pages.meshed"] == 4
    data = pool.snapshot()
    segs = data["segments"]
    _segment_totals_ok(segs, st)
    active = sorted((b["address"], b["size"]) for s in segs for b in s["blocks"] if b["state"] == "active_allocated")
    assert active == sorted((t.address, t.block_bytes) for t in pool.live_tensors()) and len(active) == 32
    text = memory_viz.segsum(data)
    assert re.search(r"total_reserved: (\S+)", text).group(1) == repr(memory_viz.Bytes(4 * P))
    # The layout as JSON (mesh ids become strings) gives the same segments.
    layout = pool.layout()
    assert segments_from_layout(json.loads(json.dumps(layout))) == segments_from_layout(layout)

    twin = _empty_a_twin(pool, kept)
    assert pool.layout()["regions"][0]["pages"][twin] == "meshed-dormant"
    _segment_totals_ok(pool.snapshot()["segments"], pool.stats())
    _intact(kept)


# ---------------------------------------------------------------- live_tensors
def test_live_tensors_say_which_blocks_sit_on_meshed_pages(make_pool):
    """Every kept block is on a mesh member (primary or twin): meshed; a tensor made after meshing lands
    on a page of its own: not meshed; after unmesh() none is."""
    pool, kept = _meshed(make_pool)
    fresh = pool.empty(P, dtype=torch.uint8)
    by_address = {t.address: t for t in pool.live_tensors()}
    assert all(by_address[t.data_ptr()].meshed for t in kept.values())
    assert not by_address[fresh.data_ptr()].meshed
    layout = pool.layout()
    roles = {(r["base"] + p * P) for r in layout["regions"] for g in r["meshes"].values() for p in g}
    assert {a - (a - layout["regions"][0]["base"]) % P for a, t in by_address.items() if t.meshed} == roles
    assert pool.unmesh() == 4
    assert not any(t.meshed for t in pool.live_tensors())
    _intact(kept)


# ---------------------------------------------------------------- summary
def _summary_row(text, name):
    (line,) = [ln for ln in text.splitlines() if ln.startswith(f"| {name}")]
    return [c.strip() for c in line.strip("|").split("|")][1:]


def test_the_summary_has_a_line_on_meshes_only_while_they_exist(make_pool):
    pool = make_pool("2MiB", auto_compact=False)
    kept = _halves(pool, 8, BLOCK)
    plain = pool.summary()
    assert "mesh" not in plain.lower()
    assert pool.mesh().meshed_pages == 4
    text = pool.summary()
    assert all(len(line) == 77 for line in text.splitlines())
    assert _summary_row(text, "Mapped pages") == ["4", "256.00 KiB"]
    assert _summary_row(text, "  meshed: pages sharing 4 physical pages") == ["8", "256.00 KiB"]
    assert _summary_row(text, "    twins (no physical page of their own)") == ["4", "-"]
    assert _summary_row(text, "    pages freed / bytes copied by meshing") == ["4", "128.00 KiB"]
    assert len(text.splitlines()) == len(plain.splitlines()) + 3
    assert pool.unmesh() == 4
    assert "mesh" not in pool.summary().lower()
    _intact(kept)


# ---------------------------------------------------------------- the memory map
def _pixel(img, ax, x, y):
    px, py = ax.transData.transform((x, y))
    return tuple(img[int(img.shape[0] - py), int(px), :3])


def _near(rgb, colour):
    want = mcolors.to_rgb(colour)
    return all(abs(a - b) <= 2 / 255 for a, b in zip(rgb, want))


def _between(rgb, a, b):
    """`rgb` is a blend of colours `a` and `b` (a hatch line's antialiased pixels)."""
    a, b = np.array(mcolors.to_rgb(a)), np.array(mcolors.to_rgb(b))
    t = (np.array(rgb, dtype=float) - a) / (b - a)
    return bool(np.ptp(t) < 0.05 and -0.02 <= t.mean() <= 1.02)


def test_memory_map_draws_twins_on_their_primaries_and_joins_them(make_pool, tmp_path):
    """8 pages meshed onto 4: the title counts 4 mapped (physical) pages and says "8 pages meshed onto 4";
    twin cells are hatched twin-coloured with their own blocks on them, a primary's bytes that its twin
    uses are twin-held (not stranded), every member is labelled with its mesh id (primary starred), a
    line joins each twin to its primary, and the legend names all of it. Totals agree with stats()."""
    pool, kept = _meshed(make_pool)
    layout = json.loads(json.dumps(pool.layout()))  # as saved: mesh ids become strings
    st = pool.stats()
    totals = viz.layout_totals(layout)
    assert totals["pages_mapped"] == st["pages.mapped"] == 4 and totals["pages_live"] == 4
    assert totals["stranded"] == st["stranded_bytes"] == 0
    assert (totals["meshes"], totals["pages_meshed"], totals["pages_twin"]) == (4, 8, 4)

    path = viz.plot_memory_map(layout, tmp_path / "map.png")
    img = mimage.imread(path)
    fig = viz.plot_memory_map(layout)
    (ax,) = fig.axes
    title = ax.get_title()
    assert "4 pages mapped (256.00 KiB)" in title and "8 pages meshed onto 4 physical pages" in title
    region = layout["regions"][0]
    groups = {int(m): g for m, g in region["meshes"].items()}
    labels = sorted(t.get_text() for t in ax.texts)
    assert labels == sorted([f"m{m}*" for m in groups] + [f"m{m}" for m in groups])
    (lines,) = [c for c in ax.collections if isinstance(c, LineCollection)]
    assert len(lines.get_segments()) == 4
    for m, (primary, twin) in groups.items():
        # A join runs from the top of the primary's cell to the top of its twin's.
        ends = {tuple(np.round(s[0], 3)) for s in lines.get_segments()} | \
            {tuple(np.round(s[-1], 3)) for s in lines.get_segments()}
        assert (round(primary + viz.CELL_WIDTH / 2, 3), 0.0) in ends and (round(twin + viz.CELL_WIDTH / 2, 3), 0.0) in ends
        # The twin's free half (where the primary's blocks are) shows the twin's hatched background;
        # the primary's bytes under the twin's blocks are twin-held.
        twin_used = {(a - region["base"]) % P // (P // 2) for a in (t.data_ptr() for t in kept.values())
                     if (a - region["base"]) // P == twin}
        (used,) = twin_used
        free = 1 - used
        x_free = twin + (free + 0.5) / 2 * viz.CELL_WIDTH
        got = [_pixel(img, ax, x_free + dx, viz.ROW_HEIGHT / 2 + dy) for dx in (0, 0.03, 0.06) for dy in (0, 0.1)]
        assert all(_between(c, viz.COLORS["twin"], viz.MESH_LINE) for c in got), got  # its hatching
        assert any(_near(c, viz.COLORS["twin"]) for c in got)
        x_held = primary + (used + 0.5) / 2 * viz.CELL_WIDTH
        assert _near(_pixel(img, ax, x_held, viz.ROW_HEIGHT / 2), viz.COLORS["twin-held"])
        x_block = twin + (used + 0.19) / 2 * viz.CELL_WIDTH  # inside the second of its four blocks
        assert _near(_pixel(img, ax, x_block, viz.ROW_HEIGHT / 2), viz.COLORS["pinned"])
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert viz.LABELS["twin"] in legend and viz.LABELS["twin-held"] in legend
    assert viz.LABELS["stranded"] not in legend and viz.LABELS["dormant"] not in legend
    assert any(t.startswith("m3*, m3:") and "line" in t for t in legend)


def test_memory_map_shows_a_dormant_twin_and_its_primary_keeps_the_free_space(make_pool):
    pool, kept = _meshed(make_pool)
    twin = _empty_a_twin(pool, kept)
    layout = pool.layout()
    assert layout["regions"][0]["pages"][twin] == "meshed-dormant"
    totals, st = viz.layout_totals(layout), pool.stats()
    assert totals["pages_mapped"] == st["pages.mapped"] == 4
    assert totals["stranded"] == st["stranded_bytes"] == P // 2
    fig = viz.plot_memory_map(layout)
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert viz.LABELS["dormant"] in legend and viz.LABELS["stranded"] in legend
    _intact(kept)


def test_memory_map_of_many_meshes_leaves_out_lines_then_labels():
    """A synthetic layout of 600 pages in 300 meshes of two: no label or line (the title says so); 70
    meshes: labels without lines; 4 meshes a row apart: labels, no line across rows."""
    def layout(npairs, apart):
        pages = ["live"] * npairs + ["meshed"] * npairs + ["unmapped"] * 8
        meshes = {m: [m, npairs + m if not apart else npairs + (m + 1) % npairs] for m in range(npairs)}
        return {"pool": 1, "kind": "emulated", "page_size": P, "capacity": len(pages) * P, "cached_pages": 0,
                "regions": [{"index": 0, "base": 1 << 40, "npages": len(pages), "pages": pages, "free_ranges": [],
                             "mesh": [], "meshes": meshes}], "blocks": []}
    fig = viz.plot_memory_map(layout(300, False), max_pages=1000)
    ax = fig.axes[0]
    assert not ax.texts and not [c for c in ax.collections if isinstance(c, LineCollection)]
    assert "300 pages mapped" in ax.get_title() and "600 pages meshed onto 300 physical pages" in ax.get_title()
    assert "too many to label or join" in ax.get_title()
    ax = viz.plot_memory_map(layout(70, False)).axes[0]
    assert len(ax.texts) == 140 and not [c for c in ax.collections if isinstance(c, LineCollection)]
    assert "joined by no line above" in ax.get_title()
    ax = viz.plot_memory_map(layout(4, True), pages_per_row=4).axes[0]
    assert len(ax.texts) == 8 and not [c for c in ax.collections if isinstance(c, LineCollection)]
