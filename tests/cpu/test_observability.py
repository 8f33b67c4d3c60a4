"""Snapshots in PyTorch's format, the allocation history, the summary table and the memory map."""

from __future__ import annotations

import json
import pickle
import pickletools
import re

import matplotlib.colors as mcolors
import matplotlib.image as mimage
import pytest
import torch
from torch.cuda import _memory_viz as memory_viz

import defrag
from defrag import viz
from defrag import save_snapshot
from defrag.stats import summary

from .conftest import KiB, MiB

PAGE = 2 * MiB

# Opcodes the unpickler of PyTorch's MemoryViz.js (pytorch.org/memory_viz) understands.
MEMORY_VIZ_OPCODES = {
    "PROTO", "FRAME", "STOP", "MARK", "MEMOIZE", "BINPUT", "LONG_BINPUT", "BINGET", "LONG_BINGET",
    "EMPTY_DICT", "EMPTY_LIST", "EMPTY_TUPLE", "DICT", "LIST", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3",
    "SETITEM", "SETITEMS", "APPEND", "APPENDS", "NONE", "NEWTRUE", "NEWFALSE", "BININT", "BININT1",
    "BININT2", "LONG1", "BINFLOAT", "SHORT_BINUNICODE", "BINUNICODE",
}


@pytest.fixture
def pool2m(make_pool):
    """A 32 MiB pool of 2 MiB pages on a 64 MiB emulated device."""
    def make(**kwargs):
        return make_pool("32MiB", granularity=PAGE, device_capacity=64 * MiB, **kwargs)
    return make


def _fragmented(pool):
    """Live, freed, pinned and empty-page state that a compaction improves; returns the live tensors."""
    a = pool.full((MiB,), 1, dtype=torch.uint8)
    b = pool.full((MiB,), 2, dtype=torch.uint8)
    c = pool.full((3 * MiB,), 3, dtype=torch.uint8)      # 1.5 pages: stitched, from a page boundary
    p = pool.full((256 * KiB,), 4, dtype=torch.uint8)    # pinned
    pool.pin(p)
    d = pool.full((MiB,), 5, dtype=torch.uint8)
    x = pool.full((MiB,), 6, dtype=torch.uint8)
    e = pool.empty(PAGE, dtype=torch.uint8)              # a whole page; freed, it stays mapped and empty
    s = pool.empty(1000, dtype=torch.float32)
    del a, d, e
    pool.stats()  # a safe point: the releases are applied
    return {"b": b, "c": c, "p": p, "x": x, "s": s}


def _tiles_ok(seg):
    addr = seg["address"]
    for b in seg["blocks"]:
        assert b["address"] == addr, "blocks must tile the segment in address order"
        addr += b["size"]
    assert addr == seg["address"] + seg["total_size"]


# ---------------------------------------------------------------------- snapshot
def test_snapshot_matches_stats_and_is_read_by_torch_memory_viz(pool2m, tmp_path):
    pool = pool2m()
    pool.record_history(True)
    kept = _fragmented(pool)
    st = pool.stats()
    assert st["pages.empty"] >= 1 and st["stranded_bytes"] > 0 and st["pinned_blocks"] == 1

    path = save_snapshot(tmp_path / "snap.pickle", pool)
    raw = (tmp_path / "snap.pickle").read_bytes()
    used = {op.name for op, _, _ in pickletools.genops(raw)}
    assert used <= MEMORY_VIZ_OPCODES, f"the browser viewer cannot unpickle {used - MEMORY_VIZ_OPCODES}"
    with open(path, "rb") as f:
        data = pickle.load(f)

    # Totals equal stats(); every segment is a run of mapped pages tiled by its blocks.
    segs = data["segments"]
    assert sum(s["total_size"] for s in segs) == st["reserved_bytes.all.current"]
    assert sum(s["allocated_size"] for s in segs) == st["allocated_bytes.all.current"]
    for seg in segs:
        _tiles_ok(seg)
        assert seg["total_size"] % PAGE == 0 and seg["address"] % PAGE == 0
        assert seg["device"] == 0 and seg["stream"] == 0 and seg["is_expandable"]
        assert seg["allocated_size"] + sum(b["size"] for b in seg["blocks"] if b["state"] == "inactive") \
            == seg["total_size"]
    # Live blocks are exactly the pool's live tensors; the empty page is one inactive block.
    active = sorted((b["address"], b["size"], b["requested_size"]) for s in segs for b in s["blocks"]
                    if b["state"] == "active_allocated")
    live = sorted((t.address, t.block_bytes, t.nbytes) for t in pool.live_tensors())
    assert active == live and len(live) == 5
    region = pool.layout()["regions"][0]
    empty = region["base"] + region["pages"].index("empty") * PAGE
    assert any(b["state"] == "inactive" and b["address"] <= empty and empty + PAGE <= b["address"] + b["size"]
               for s in segs for b in s["blocks"])
    # Runs of mapped pages are maximal: no two segments touch.
    ends = {s["address"] + s["total_size"] for s in segs}
    assert not ends & {s["address"] for s in segs}

    # PyTorch's own tools accept it and agree.
    text = memory_viz.segsum(data)  # raises on inconsistent accounting
    reserved = re.search(r"total_reserved: (\S+)", text).group(1)
    allocated = re.search(r"total_allocated: (\S+)", text).group(1)
    assert reserved == repr(memory_viz.Bytes(st["reserved_bytes.all.current"]))
    assert allocated == repr(memory_viz.Bytes(st["requested_bytes.all.current"]))
    assert f"segments: {len(segs)}" in text
    lines = memory_viz.memory(data, format_flamegraph=lambda s: s).splitlines()
    by_state = {}
    for line in lines:
        stack, n = line.rsplit(" ", 1)
        by_state[stack.split(";")[1]] = by_state.get(stack.split(";")[1], 0) + int(n)
    assert by_state["active_allocated"] == st["allocated_bytes.all.current"]
    assert by_state["active_allocated"] + by_state["inactive"] == st["reserved_bytes.all.current"]
    per_segment = {}
    for line in memory_viz.segments(data, format_flamegraph=lambda s: s).splitlines():
        stack, n = line.rsplit(" ", 1)
        key = int(stack.split(";")[1].removeprefix("seg_"))
        per_segment[key] = per_segment.get(key, 0) + int(n)
    assert per_segment == {s["address"]: s["total_size"] for s in segs}
    assert "Device 0" in memory_viz.trace(data)
    assert "snapshot.pickle" in memory_viz.trace_plot(data) and "snapshot.pickle" in memory_viz.segment_plot(data)
    # The defrag section carries the same stats.
    (info,) = data["defrag"]["pools"]
    assert info["pool"] == pool.id and info["stats"]["allocated_bytes.all.current"] == st["allocated_bytes.all.current"]
    del kept


def test_snapshot_without_recording_has_empty_trace_and_save_merges_open_pools(pool2m, tmp_path):
    p1, p2 = pool2m(), pool2m()
    x = p1.empty(3 * MiB, dtype=torch.uint8)
    y = p2.empty(100, dtype=torch.uint8)
    snap = p1.snapshot()
    assert snap["device_traces"] == [[]]
    with open(save_snapshot(tmp_path / "all.pickle"), "rb") as f:  # pool=None: every open pool
        data = pickle.load(f)
    ids = {info["pool"] for info in data["defrag"]["pools"]}
    assert {p1.id, p2.id} <= ids and ids == {p.id for p in defrag.open_pools()}
    mine = [s for s in data["segments"] if p1.owns_address(s["address"]) or p2.owns_address(s["address"])]
    assert sum(s["total_size"] for s in mine) == (p1.stats()["reserved_bytes.all.current"]
                                                  + p2.stats()["reserved_bytes.all.current"])
    memory_viz.segsum(data)
    del x, y


# ---------------------------------------------------------------------- history
def _replay(entries, page=PAGE):
    """Apply a trace forward from an empty pool, checking each step; returns (mapped ranges, live blocks).

    What PyTorch's viewers assume: a block lives inside mapped memory from its
    alloc to its free, each free is a free_requested then free_completed of a
    live block, a map covers unmapped memory and an unmap covers mapped memory
    without live blocks.
    """
    mapped, live = set(), {}
    for i, e in enumerate(entries):
        act = e["action"]
        assert e["stream"] == 0 and isinstance(e["time_us"], int)
        # Allocations and OOMs carry the caller's Python frames; nothing else has any.
        if act in ("alloc", "oom"):
            assert e["frames"] and all(set(f) == {"filename", "line", "name"} for f in e["frames"])
            assert not any("/defrag/" in f["filename"] and "/tests/" not in f["filename"] for f in e["frames"])
        else:
            assert e["frames"] == []
        if act == "segment_map":
            pages = set(range(e["addr"], e["addr"] + e["size"], page))
            assert not pages & mapped, f"entry {i} maps mapped memory"
            mapped |= pages
        elif act == "segment_unmap":
            pages = set(range(e["addr"], e["addr"] + e["size"], page))
            assert pages <= mapped, f"entry {i} unmaps unmapped memory"
            assert not any(a < e["addr"] + e["size"] and e["addr"] < a + n for a, n in live.items()), \
                f"entry {i} unmaps memory under a live block"
            mapped -= pages
        elif act == "alloc":
            a, n = e["addr"], e["size"]
            assert all(p in mapped for p in range(a - a % page, a + n, page)), f"entry {i} allocates unmapped memory"
            assert not any(b < a + n and a < b + m for b, m in live.items()), f"entry {i} overlaps a live block"
            live[a] = n
        elif act == "free_requested":
            assert live.get(e["addr"]) == e["size"], f"entry {i} frees a block that is not live"
            nxt = entries[i + 1]
            assert nxt["action"] == "free_completed" and nxt["addr"] == e["addr"] and nxt["size"] == e["size"]
        elif act == "free_completed":
            assert entries[i - 1]["action"] == "free_requested"
            del live[e["addr"]]
        else:
            assert act in ("oom", "snapshot"), act
    return mapped, live


def test_history_records_allocs_frees_maps_moves_and_oom_in_order(pool2m):
    pool = pool2m(auto_compact=False)
    pool.record_history(True)
    a, b, c, d = (pool.full((MiB,), i, dtype=torch.uint8) for i in range(4))
    p = pool.empty(1000, dtype=torch.float32)
    pool.pin(p)
    ptr = {k: t.data_ptr() for k, t in dict(a=a, b=b, c=c, d=d, p=p).items()}
    del a, c
    survivors = dict(b=b, d=d, p=p)
    pool.stats()  # a safe point: queued releases are applied (and recorded) here
    n_before_compact = len(pool.core.history)
    report = pool.compact(release=True)  # unmaps recorded too
    assert report.moved_tensors >= 1 and report.released_pages >= 1
    with pytest.raises(defrag.OutOfMemoryError):
        pool.empty(40 * MiB, dtype=torch.uint8)
    snap = pool.snapshot()
    entries = snap["device_traces"][0]

    # Replaying the trace from the empty pool ends exactly in the snapshot's state.
    mapped, live = _replay(entries)
    seg_pages = {s["address"] + k for s in snap["segments"] for k in range(0, s["total_size"], PAGE)}
    assert mapped == seg_pages
    assert live == {b["address"]: b["requested_size"] for s in snap["segments"] for b in s["blocks"]
                    if b["state"] == "active_allocated"}

    # Before the compaction: each allocation in program order, each map before the first block in it.
    allocs = [e["addr"] for e in entries[:n_before_compact] if e["action"] == "alloc"]
    assert allocs == [ptr[k] for k in "abcdp"]
    frees = [e["addr"] for e in entries[:n_before_compact] if e["action"] == "free_completed"]
    assert frees == [ptr["a"], ptr["c"]]
    assert entries[0]["action"] == "segment_map" and entries[0]["addr"] == ptr["a"] - ptr["a"] % PAGE

    # The compaction: every moved tensor is a free of its old address then an alloc at the new one.
    during = entries[n_before_compact:]
    moved = {k: t for k, t in survivors.items() if t.data_ptr() != ptr[k]}
    assert len(moved) == report.moved_tensors and "p" not in moved
    for k, t in moved.items():
        i = next(i for i, e in enumerate(during) if e["action"] == "free_requested" and e["addr"] == ptr[k])
        assert [(e["action"], e["addr"], e["size"]) for e in during[i:i + 3]] == [
            ("free_requested", ptr[k], MiB), ("free_completed", ptr[k], MiB), ("alloc", t.data_ptr(), MiB)]
    unmapped = sum(e["size"] for e in during if e["action"] == "segment_unmap")
    assert unmapped == report.unmapped_pages * PAGE and report.unmapped_pages >= report.released_pages
    # The old locations, released after the move, are not freed a second time.
    assert sum(e["action"] == "free_completed" for e in during) == report.moved_tensors

    # Then the OOM (PyTorch's shape: device_free, no addr), then the snapshot marker.
    oom, marker = entries[-2], entries[-1]
    assert oom["action"] == "oom" and oom["size"] == 40 * MiB and "addr" not in oom
    # What the pool could still map (its capacity less its mapped pages), as cudaMemGetInfo's free is outside
    # what PyTorch reserved: reserved + free is the pool's capacity; the space stranded in its pages is not free.
    assert oom["device_free"] == pool.capacity - pool.stats()["reserved_bytes.all.current"]
    assert marker["action"] == "snapshot" and marker["size"] == pool.stats()["allocated_bytes.all.current"]
    times = [e["time_us"] for e in entries]
    assert times == sorted(times)
    (info,) = snap["defrag"]["pools"]
    assert [c["moved_tensors"] for c in info["compactions"]] == [report.moved_tensors]


def test_history_is_a_ring_buffer_and_tracks_blocks_from_before_recording(pool2m):
    pool = pool2m()
    old = pool.empty(100, dtype=torch.uint8)  # allocated before recording started
    pool.record_history(True, max_entries=3)
    ts = [pool.empty(100, dtype=torch.uint8) for _ in range(4)]
    entries = pool.snapshot()["device_traces"][0]
    assert [(e["action"], e["addr"]) for e in entries] == [
        ("alloc", ts[2].data_ptr()), ("alloc", ts[3].data_ptr()), ("snapshot", 0)]
    assert pool.core.history.recorded == 5
    old_ptr = old.data_ptr()
    del old
    pool.stats()  # safe point
    last = pool.core.history.entries[-2:]
    assert [(e["action"], e["addr"]) for e in last] == [("free_requested", old_ptr), ("free_completed", old_ptr)]
    pool.record_history(False)
    assert pool.snapshot()["device_traces"] == [[]]
    del ts


# ---------------------------------------------------------------------- summary
def _summary_cells(text):
    cells = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.strip("|").split("|")]
        if len(parts) == 3:
            cells[parts[0]] = parts[1:]
    return cells


def test_summary_numbers_are_the_stats(pool2m):
    pool = pool2m(auto_compact=False)
    kept = _fragmented(pool)
    pool.compact()
    with pytest.raises(defrag.OutOfMemoryError):
        pool.empty(64 * MiB, dtype=torch.uint8)
    st = pool.stats()
    text = summary(st, pool)
    assert pool.summary() == text  # nothing changed in between
    assert len({len(line) for line in text.splitlines()}) == 1, "the box has ragged edges"
    cells = _summary_cells(text)
    fb = defrag.format_bytes
    assert cells["Allocated memory"] == [fb(st["allocated_bytes.all.current"]), fb(st["allocated_bytes.all.peak"])]
    assert cells["Active memory"] == [fb(st["active_bytes.all.current"]), fb(st["active_bytes.all.peak"])]
    assert cells["Reserved (mapped) memory"] == [fb(st["reserved_bytes.all.current"]), fb(st["reserved_bytes.all.peak"])]
    assert cells["Allocations"][0] == str(st["num_allocs"]) and cells["Frees"][0] == str(st["num_frees"])
    assert cells["OOMs"][0] == str(st["num_ooms"]) == "1"
    assert cells["Allocation retries"][0] == str(st["num_alloc_retries"])
    assert cells["Mapped pages"][0] == str(st["pages.mapped"])
    assert cells["Cached physical pages (unmapped)"][0] == str(st["pages.cached"])
    assert cells["Stranded (free in pages with live data)"][0] == fb(st["stranded_bytes"])
    assert cells["Largest request possible now"][0] == fb(st["largest_free_bytes"])
    assert cells["Fragmentation (stranded / reserved)"][0] == f"{st['fragmentation']:.1%}"
    assert cells["Compactions (explicit / automatic)"][0] == "1 / 0"
    assert cells["Tensors moved"][0] == str(st["compaction.moved_tensors"]) != "0"
    assert cells["Bytes moved"][0] == fb(st["compaction.moved_bytes"])
    assert cells["Pinned blocks"][0] == str(st["pinned_blocks"]) == "1"
    # The numbers come from the dict given, not from the pool.
    doctored = dict(st, **{"allocated_bytes.all.current": 123 * MiB, "num_ooms": 77})
    cells = _summary_cells(summary(doctored, pool))
    assert cells["Allocated memory"][0] == "123.00 MiB" and cells["OOMs"][0] == "77"
    del kept


# ---------------------------------------------------------------------- pictures
def _pixel(img, fig, x, y):
    """RGB of the PNG pixel under data point (x, y) of the figure's memory-map axes."""
    ax = fig.axes[0]
    px, py = ax.transData.transform((x, y))
    return tuple(img[int(img.shape[0] - py), int(px), :3])


def _is(rgb, name):
    want = mcolors.to_rgb(viz.COLORS[name])
    return all(abs(a - b) <= 2 / 255 for a, b in zip(rgb, want))


def test_memory_map_png_shows_blocks_in_documented_colours(pool2m, tmp_path):
    pool = pool2m()
    kept = _fragmented(pool)
    # A plain-dict layout survives JSON: pictures can be made from saved layouts.
    layout = json.loads(json.dumps(pool.layout()))
    region = layout["regions"][0]
    base = region["base"]
    path = viz.plot_memory_map(layout, tmp_path / "map.png")
    img = mimage.imread(path)
    fig = viz.plot_memory_map(layout)  # the same drawing, for its coordinates
    assert img.shape[:2] == (round(fig.get_figheight() * fig.dpi), round(fig.get_figwidth() * fig.dpi))
    ppr = 8

    def at(offset):  # data point inside the cell of pool offset `offset`
        page, within = divmod(offset, PAGE)
        return page % ppr + within / PAGE * viz.CELL_WIDTH, page // ppr + viz.ROW_HEIGHT / 2

    def middle(address, size):
        return at(address - base + size // 2)

    live_b = kept["b"].data_ptr()
    assert _is(_pixel(img, fig, *middle(live_b, MiB)), "live")
    assert _is(_pixel(img, fig, *middle(kept["c"].data_ptr(), 3 * MiB)), "live")
    assert _is(_pixel(img, fig, *middle(kept["p"].data_ptr(), 256 * KiB)), "pinned")
    # Stranded: the freed 1 MiB next to b, in a page holding live data.
    stranded = [(a, n) for a, n in region["free_ranges"] if region["pages"][(a - base) // PAGE] == "live"
                and n >= 256 * KiB]
    assert stranded
    assert _is(_pixel(img, fig, *middle(*stranded[0])), "stranded")
    empty = region["pages"].index("empty")
    assert _is(_pixel(img, fig, *at(empty * PAGE + PAGE // 2)), "empty")
    unmapped = region["pages"].index("unmapped")
    assert _is(_pixel(img, fig, *at(unmapped * PAGE + PAGE // 2)), "unmapped")
    assert _is(_pixel(img, fig, *at(unmapped * PAGE + PAGE // 5)), "unmapped")
    title = fig.axes[0].get_title()
    assert f"{layout['cached_pages']} cached" in title
    del kept


def test_memory_map_of_a_huge_region_draws_only_its_used_part(tmp_path):
    P = PAGE
    pages = ["unmapped"] * 5000
    pages[0:3] = ["live", "live", "empty"]
    layout = {"pool": 7, "kind": "emulated", "page_size": P, "capacity": 5000 * P, "cached_pages": 2,
              "regions": [{"index": 0, "base": 1 << 40, "npages": 5000, "pages": pages, "free_ranges": []}],
              "blocks": [{"address": (1 << 40) + 0, "size": P + P // 2, "nbytes": P + P // 2, "region": 0,
                          "pinned": False, "dtype": "uint8", "shape": [P + P // 2], "state": "live"}]}
    fig = viz.plot_memory_map(layout)
    title = fig.axes[0].get_title()
    assert "showing 16 of 5000 virtual pages" in title and "2 cached" in title
    assert fig.get_figheight() < 4
    pages[4321] = "empty"  # a far page: capped at max_pages
    fig = viz.plot_memory_map(layout, max_pages=64)
    assert "showing 64 of 5000" in fig.axes[0].get_title() and fig.get_figheight() < 6


def test_plot_compaction_writes_a_before_after_png(pool2m, tmp_path):
    pool = pool2m(auto_compact=False)
    kept = _fragmented(pool)
    before = pool.layout()
    report = pool.compact()
    after = pool.layout()
    path = viz.plot_compaction(before, after, tmp_path / "compaction.png", report)
    img = mimage.imread(path)
    assert img.shape[1] > img.shape[0] > 100
    fig = viz.plot_compaction(before, after, report=report.as_dict())
    assert [ax.get_title().splitlines()[0] for ax in fig.axes] == ["before compaction", "after compaction"]
    caption = " ".join(t.get_text() for t in fig.texts)
    assert f"moved {report.moved_tensors} tensors" in caption
    assert f"pages holding live data {report.pages_before} -> {report.pages_after}" in caption
    assert f"{report.fragmentation_before:.1%} -> {report.fragmentation_after:.1%}" in caption
    del kept


def test_history_frames_name_the_callers_line_and_follow_moves(make_pool):
    pool = make_pool("1MiB", granularity=64 * KiB)
    pool.record_history()
    ts = [pool.empty(16 * KiB, dtype=torch.uint8) for _ in range(8)]  # the line to find
    del ts[::2]
    pool.compact()
    snap = pool.snapshot()
    live = [b for seg in snap["segments"] for b in seg["blocks"] if b["state"] == "active_allocated"]
    assert len(live) == 4
    for b in live:
        top = b["frames"][0]
        assert top["filename"] == __file__ and top["name"] in ("<listcomp>", "test_history_frames_name_the_callers_line_and_follow_moves")
    pool.record_history(stacks=False)
    pool.empty(10)
    assert pool.snapshot()["device_traces"][0][0]["frames"] == []
