"""Meshed pages as the read-outs show them (issue 26, docs/meshing.md "Statistics, pictures, snapshots"):
snapshot segments count a mesh's physical page once, the summary has a line on meshes, `live_tensors()`
says which blocks sit on meshed pages, and the memory map draws twins and joins them to their primary."""

from __future__ import annotations

import gc
import json
import re

import torch
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

    region = layout["regions"][0]
    twin = region["pages"].index("meshed")
    for seed, t in list(kept.items()):
        if (t.data_ptr() - region["base"]) // P == twin:
            pool.unpin(t)
            del kept[seed]
    del t
    gc.collect()
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
