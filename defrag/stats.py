"""Observability: allocation history, PyTorch-format snapshots, the summary table.

- `HistoryRecorder` records what the pool does (alloc, free, map, unmap, OOM,
  compaction) as PyTorch `device_traces` entries in a ring buffer
  (`Pool.record_history()`).
- `snapshot(pool)` describes the pool in the format of
  `torch.cuda.memory._snapshot()`, so PyTorch's own tools read it:
  `python -m torch.cuda._memory_viz stats|trace|segments|memory snapshot.pickle`
  and the interactive viewer at https://pytorch.org/memory_viz (drag the file in).
  `save_snapshot()` writes one such pickle.
- `summary(stats, pool)` is the table behind `Pool.summary()`, in the spirit of
  `torch.cuda.memory_summary()`.

Mapping of pool concepts onto PyTorch's snapshot format:

- a *segment* is one run of consecutive mapped pages of one region (what a
  PyTorch expandable segment is: `is_expandable` is True, and the trace's
  `segment_map`/`segment_unmap` entries grow and shrink these runs);
- a live block is an `active_allocated` block (`size` rounded to 512 bytes,
  `requested_size` the storage's bytes); free space inside mapped pages is an
  `inactive` block; an old location whose data a compaction has moved but whose
  owner has not been released yet is `active_pending_free`;
- `stream` is 0 everywhere; `frames` hold the Python stack of each
  allocation and OOM while `record_history(stacks=True)` records (the
  default), and are empty otherwise.

Nothing here changes the pool, except that `snapshot()` appends one `snapshot`
entry to the history while recording (as PyTorch does).
"""

from __future__ import annotations

import collections
import os
import pickle
import sys
import time
import weakref

from .units import format_bytes
from .page_runs import page_runs

# Actions of PyTorch's TraceEntry that the pool produces.
ACTIONS = ("alloc", "free_requested", "free_completed", "segment_map", "segment_unmap", "oom", "snapshot")

# Pickle protocol readable by PyTorch's MemoryViz.js unpickler (it accepts 2..4).
PICKLE_PROTOCOL = 4


def _now_us() -> int:
    return time.time_ns() // 1000


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
MAX_FRAMES = 32


def python_frames(limit: int = MAX_FRAMES) -> list[dict]:
    """The calling Python stack, innermost first, without defrag's own frames, as PyTorch
    records frames (`filename`, `line`, `name`)."""
    frames = []
    f = sys._getframe(1)
    while f is not None and len(frames) < limit:
        filename = f.f_code.co_filename
        if not filename.startswith(_PACKAGE_DIR):
            frames.append({"filename": filename, "line": f.f_lineno, "name": f.f_code.co_name})
        f = f.f_back
    return frames


class HistoryRecorder:
    """Records pool events as PyTorch `device_traces` entries in a ring buffer.

    The pool calls the hooks below with its lock held; each appends entries
    shaped like PyTorch's (`action`, `addr`, `size`, `stream` 0, `time_us`,
    `frames`; an `oom` entry carries `device_free` instead of `addr`, as in
    PyTorch). Sizes of block entries are the requested bytes (the storage's
    size), as PyTorch records them. Only the newest `max_entries` entries are
    kept; older ones are dropped, which PyTorch's tools handle since they
    replay a trace backwards from the snapshot's state.

    Guarantees: a free is recorded only for a block whose allocation was
    recorded or that was live when recording began (so the destination of an
    abandoned compaction wave, or an old location released after its data
    moved, never appears as a spurious free); map/unmap entries name only
    pages whose state really changed. Frees, and the allocations native code
    made, are logged by the pool's books as they happen (any thread) and
    taken in order before anything the pool's Python code records
    (`catch_up`), so a range is always freed in the trace before it is used
    again.

    Frames: with `stacks=True`, `alloc` and `oom` entries carry the caller's
    Python frames (innermost first, defrag's own frames left out), kept for
    each live block so that snapshots show them too.

    Not recorded: physical pages created or
    released (they have no virtual address), and the unmaps done by
    `Pool.close()`.
    """

    def __init__(self, core, max_entries: int = 100_000, stacks: bool = True):
        if int(max_entries) < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = int(max_entries)
        self.stacks = bool(stacks)
        self.frames: dict[int, list[dict]] = {}  # live block address -> frames of its allocation
        self.page_size = core.page_size
        self.device = int(getattr(core.driver, "ordinal", 0))
        self._core = weakref.ref(core)  # no cycle: the core holds the recorder
        self._entries: collections.deque[dict] = collections.deque(maxlen=self.max_entries)
        self.compactions: collections.deque[dict] = collections.deque(maxlen=self.max_entries)
        self.recorded = 0  # entries recorded since the start, dropped ones included
        self.lost = 0  # the allocator entries' events the native log could not keep (see `absorb`)
        # Blocks whose free may be recorded: address -> requested bytes.
        self._tracked: dict[int, int] = {
            b["address"]: b["nbytes"] for b in core.layout()["blocks"] if b["state"] == "live"}

    # ------------------------------------------------------------------ reading
    @property
    def entries(self) -> list[dict]:
        """The recorded entries, oldest first (copies: callers may keep or edit them).

        In the order things happened: the books' log (`absorb`) is taken before any event the pool's
        Python code records, so a range is always freed in the trace before it is used again (their
        `time_us` may tie within a microsecond: order by position, not by time)."""
        return [dict(e) for e in self._entries]

    def __len__(self) -> int:
        return len(self._entries)

    def _add(self, action: str, addr: int | None, size: int, *, time_us: int | None = None, **extra) -> None:
        entry = {"action": action}
        if addr is not None:
            entry["addr"] = int(addr)
        entry.update(size=int(size), stream=0, time_us=_now_us() if time_us is None else int(time_us),
                     frames=extra.pop("frames", []), **extra)
        self._entries.append(entry)
        self.recorded += 1

    def catch_up(self) -> None:
        """Take what the pool's books logged since the last call (`absorb`): before anything else is
        recorded, so the trace keeps the order things happened in."""
        core = self._core()
        if core is not None:
            self.absorb(*core.books.take_events())

    def absorb(self, events, lost: int = 0) -> None:
        """Blocks the books placed natively and every free, as they logged them (`Books.take_events`):
        (1 alloc / 2 free, address, requested bytes, time_us) each, oldest first, with the time they
        happened; no frames (native code made them). A free of a block never seen allocated is ignored
        (see the class doc). `lost`: events the native log could not keep (no host memory), ever."""
        tracked = self._tracked
        for kind, address, nbytes, time_us in events:
            if kind == 1:
                tracked[address] = nbytes
                self._add("alloc", address, nbytes, time_us=time_us)
            else:
                self._untrack(address, time_us)
        self.lost = int(lost)

    # ------------------------------------------------------------------ hooks (pool lock held)
    def block_allocated(self, alloc) -> None:
        """A block now owned by a user storage (`empty`, `adopt`, ...): one `alloc` entry."""
        self.catch_up()
        self._tracked[alloc.address] = alloc.nbytes
        frames = python_frames() if self.stacks else []
        if frames:
            self.frames[alloc.address] = frames
        self._add("alloc", alloc.address, alloc.nbytes, frames=frames)

    def _untrack(self, address: int, time_us: int | None = None) -> None:
        """The tracked block at `address` is freed (`_free`, with its recorded size); nothing for an address
        the trace never saw allocated."""
        nbytes = self._tracked.pop(address, None)
        self.frames.pop(address, None)
        if nbytes is not None:
            self._free(address, nbytes, time_us)

    def _free(self, address: int, nbytes: int, time_us: int | None = None) -> None:
        # PyTorch's viewers fold the pair into one "free" event; a lone
        # free_completed would show the block as waiting on a stream.
        self._add("free_requested", address, nbytes, time_us=time_us)
        self._add("free_completed", address, nbytes, time_us=time_us)

    def block_moved(self, old_address: int, new_address: int, nbytes: int) -> None:
        """A compaction moved a block's `nbytes` of data from `old_address` to `new_address`.

        PyTorch's format has no move: it is recorded as a free of the old
        address (`free_requested`, `free_completed`) followed by an `alloc` at
        the new one, so a viewer shows the tensor disappearing at the old
        address and appearing at the new one at the same instant. The old range
        itself, released later when the compaction drops its temporary owner
        (if it has one), is not recorded again.
        """
        self.catch_up()
        self._free(old_address, self._tracked.pop(old_address, nbytes))
        self._tracked[new_address] = nbytes
        frames = self.frames.pop(old_address, [])
        if frames:
            self.frames[new_address] = frames
        self._add("alloc", new_address, nbytes, frames=frames)

    def pages_mapped(self, region, pages) -> None:
        """Pages of `region` were mapped: one `segment_map` per run of consecutive pages."""
        self.catch_up()
        done = [p for p in pages if region.handles[p]]
        for first, count in page_runs(done):
            self._add("segment_map", region.address(first), count * self.page_size)

    def pages_unmapped(self, region, pages) -> None:
        """Pages of `region` were unmapped: one `segment_unmap` per run of consecutive pages."""
        self.catch_up()
        done = [p for p in pages if not region.handles[p]]
        for first, count in page_runs(done):
            self._add("segment_unmap", region.address(first), count * self.page_size)

    def oom(self, nbytes: int) -> None:
        """An allocation of `nbytes` failed for good: one `oom` entry.

        `device_free` (PyTorch: what the driver reports free, outside what
        the allocator reserved) is what the pool could still map: its
        capacity minus its mapped pages, or only its cached pages when the
        device refused more. So reserved + free is the pool's capacity, as
        reserved + free is the GPU's for PyTorch; the free space stranded
        inside mapped pages is not in it.
        """
        self.catch_up()
        core = self._core()
        free = 0
        if core is not None:
            store = core.space.store
            free = (store.unmapped + (0 if store.device_full else store.creatable)) * core.page_size
        self._add("oom", None, nbytes, device_free=int(free), frames=python_frames() if self.stacks else [])

    def compacted(self, report) -> None:
        """A compaction finished. Its moves and unmaps are already in the trace;
        the report is kept beside it (`compactions`, with the time and the
        trace position `entry` it followed), as PyTorch's format has no action
        for it."""
        info = dict(report.as_dict())
        info["phases"] = dict(info.get("phases", {}))
        info.update(time_us=_now_us(), entry=self.recorded)
        self.compactions.append(info)

    def snapshot_taken(self, allocated: int) -> None:
        """A snapshot was taken: one `snapshot` entry (addr 0, size = allocated bytes), as PyTorch does."""
        self.catch_up()
        self._add("snapshot", 0, allocated)


# ---------------------------------------------------------------------- snapshot
_NOT_DEVICE = ("offloaded", "asleep")  # page states without a device page behind them (defrag.residency)


def mesh_groups(region: dict) -> dict[int, list[int]]:
    """A layout region's meshes, {mesh id: [primary page, twin pages...]} (ints, also after a JSON round
    trip; {} for layouts from before meshing)."""
    return {int(k): [int(p) for p in v] for k, v in (region.get("meshes") or {}).items()}


def _device_ranges(region: dict, blocks: list[dict], P: int) -> list[tuple[int, int]]:
    """The address ranges of `region` whose bytes are the device memory it holds, each physical byte once,
    as sorted, merged [start, end) runs. A page of no mesh counts whole. A mesh is one physical page
    seen at several addresses, so its bytes are split among its members: a twin counts only the pieces
    of its own blocks, and the primary the rest of the page (its blocks and the mesh's free space)."""
    base = int(region["base"])
    twin_of = {t: g[0] for g in mesh_groups(region).values() for t in g[1:]}
    pieces: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)  # twin page -> block pieces
    for b in blocks:
        start = int(b["address"]) - base
        end = start + int(b["size"])
        for page in range(start // P, (end - 1) // P + 1):
            if page in twin_of:
                pieces[page].append((max(start, page * P) - page * P, min(end, (page + 1) * P) - page * P))
    held: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)  # primary -> its twins' pieces
    for twin, primary in twin_of.items():
        held[primary].extend(pieces.get(twin, ()))
    ranges: list[tuple[int, int]] = []
    for page, state in enumerate(region["pages"]):
        if state in ("unmapped", *_NOT_DEVICE):
            continue
        at = base + page * P
        if page in twin_of:
            ranges.extend((at + lo, at + hi) for lo, hi in pieces.get(page, ()))
            continue
        cursor = 0
        for lo, hi in sorted(held.get(page, ())):
            if lo > cursor:
                ranges.append((at + cursor, at + lo))
            cursor = max(cursor, hi)
        if cursor < P:
            ranges.append((at + cursor, at + P))
    runs: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if runs and lo <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], hi)
        else:
            runs.append([lo, hi])
    return [(lo, hi) for lo, hi in runs]


def segments_from_layout(layout: dict, device: int = 0) -> list[dict]:
    """PyTorch snapshot segments for a `Pool.layout()` dict: one per run of device memory.

    A run is consecutive mapped pages, except on meshed pages (one physical page at several
    addresses, `defrag.mesher`): there a twin page contributes only its own blocks, as segments of
    their own, and its primary the rest of the page, so each physical byte is in one segment and the
    `total_size`s add up to the reserved bytes. Each segment's blocks tile it in address order (live
    blocks and the free space between them), so that per segment
    `allocated_size + active_pending_free + inactive sizes == total_size`.
    Raises ValueError if the layout's blocks overlap or leave a mapped page.
    """
    P = int(layout["page_size"])
    by_region: dict[int, list[dict]] = collections.defaultdict(list)
    away = {int(r["index"]): (int(r["base"]), r["pages"]) for r in layout["regions"]}
    for b in layout["blocks"]:
        # Blocks on pages offloaded to host memory or asleep are in no device segment.
        base, pages = away[int(b["region"])]
        if pages[(int(b["address"]) - base) // P] in _NOT_DEVICE:
            continue
        by_region[int(b["region"])].append(b)
    out = []
    for region in layout["regions"]:
        blocks = sorted(by_region.get(int(region["index"]), []), key=lambda b: int(b["address"]))
        bi = 0
        for start, end in _device_ranges(region, blocks, P):
            tiles, cursor = [], start
            while bi < len(blocks) and int(blocks[bi]["address"]) < end:
                b = blocks[bi]
                addr, size = int(b["address"]), int(b["size"])
                if addr < cursor or addr + size > end:
                    raise ValueError(f"layout block at {addr:#x} ({size} bytes) overlaps another block "
                                     f"or an unmapped page")
                if addr > cursor:
                    tiles.append(_block(cursor, addr - cursor, 0, "inactive"))
                state = "active_allocated" if b.get("state", "live") == "live" else "active_pending_free"
                tiles.append(_block(addr, size, int(b["nbytes"]), state))
                cursor = addr + size
                bi += 1
            if cursor < end:
                tiles.append(_block(cursor, end - cursor, 0, "inactive"))
            allocated = sum(t["size"] for t in tiles if t["state"] == "active_allocated")
            out.append({
                "device": int(device),
                "address": start,
                "total_size": end - start,
                "allocated_size": allocated,
                "active_size": sum(t["size"] for t in tiles if t["state"] != "inactive"),
                "requested_size": sum(t["requested_size"] for t in tiles if t["state"] == "active_allocated"),
                "stream": 0,
                "segment_type": "large",
                "segment_pool_id": (0, 0),
                "is_expandable": True,
                "frames": [],
                "blocks": tiles,
            })
        if bi < len(blocks):
            b = blocks[bi]
            raise ValueError(f"layout block at {int(b['address']):#x} lies outside the mapped pages of region "
                             f"{region['index']}")
    return out


def _with_frames(segments: list[dict], history) -> list[dict]:
    """Give each live block the Python frames recorded at its allocation (when recording stacks)."""
    if history is not None and history.frames:
        for seg in segments:
            for block in seg["blocks"]:
                if block["state"] == "active_allocated":
                    block["frames"] = list(history.frames.get(block["address"], []))
    return segments


def _block(address: int, size: int, requested: int, state: str) -> dict:
    return {"address": address, "size": size, "requested_size": requested, "state": state, "frames": []}


def snapshot(pool) -> dict:
    """`pool` in the format of `torch.cuda.memory._snapshot()`.

    Keys: `segments` (see `segments_from_layout`), `device_traces` (one list
    per device index up to the pool's; the pool's device holds the recorded
    history, [] when not recording) and `defrag` (ignored by PyTorch's tools):
    the pool's id, kind, page size, capacity, `stats()` and the reports of the
    compactions recorded in the history. Totals agree with `pool.stats()`:
    the segments' `total_size` add up to `reserved_bytes.all.current` and
    their `allocated_size` to `allocated_bytes.all.current`.

    Takes the pool's lock; while recording, appends a `snapshot` entry to the
    history first (as PyTorch does).
    """
    core = pool.core
    with core.gate:
        core.drain()
        layout = core.layout()
        stats = core.stats_locked()
        history = core.history
        device = int(getattr(core.driver, "ordinal", 0))
        traces: list[list[dict]] = [[] for _ in range(device + 1)]
        compactions: list[dict] = []
        if history is not None:
            history.snapshot_taken(stats["allocated_bytes.all.current"])
            traces[device] = history.entries
            compactions = [dict(c) for c in history.compactions]
    return {
        "segments": _with_frames(segments_from_layout(layout, device), history),
        "device_traces": traces,
        "defrag": {"pools": [{
            "pool": pool.id, "kind": pool.kind, "device": str(pool.device), "device_index": device,
            "page_size": pool.page_size, "capacity": pool.capacity, "cached_pages": layout["cached_pages"],
            "recording": history is not None, "stats": stats, "compactions": compactions,
        }]},
    }


def merge_snapshots(snapshots: list[dict]) -> dict:
    """One snapshot holding every given one: segments concatenated, each device's
    trace entries merged by `time_us`, `defrag.pools` concatenated."""
    ndev = max((len(s["device_traces"]) for s in snapshots), default=1)
    traces: list[list[dict]] = [[] for _ in range(ndev)]
    for s in snapshots:
        for i, entries in enumerate(s["device_traces"]):
            traces[i].extend(entries)
    for entries in traces:
        entries.sort(key=lambda e: e.get("time_us", 0))  # stable: one pool's order is kept
    return {
        "segments": [seg for s in snapshots for seg in s["segments"]],
        "device_traces": traces,
        "defrag": {"pools": [p for s in snapshots for p in s.get("defrag", {}).get("pools", [])]},
    }


def write_snapshot(path, data: dict) -> str:
    """Pickle a snapshot dict to `path` (protocol 4, plain types: what the browser viewer reads)."""
    path = os.fspath(path)
    with open(path, "wb") as f:
        pickle.dump(data, f, protocol=PICKLE_PROTOCOL)
    return path


# ---------------------------------------------------------------------- counts in words
def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`n` and `noun`, plural unless `n` is 1: "1 OOM", "2 OOMs", "0 allocations", "1 allocation";
    `plural` for a noun that does not take an s ("1 entry", "2 entries")."""
    return f"{n} {noun if n == 1 else (plural or noun + 's')}"


# ---------------------------------------------------------------------- summary
_WIDTH = 77  # characters per line, as torch.cuda.memory_summary()


def _line(char: str = "-") -> str:
    return "|" + char * (_WIDTH - 2) + "|"


def _text(s: str) -> str:
    return "| " + s.ljust(_WIDTH - 4) + " |"


def _center(s: str) -> str:
    return "|" + s.center(_WIDTH - 2) + "|"


def _row(name: str, current: str, peak: str) -> str:
    """`| name | current | peak |`, 77 characters."""
    return f"| {name:<44}| {current:>12} | {peak:>12} |"


def _mesh_rows(s: dict) -> list[str]:
    """The summary's rows on meshes (`defrag.mesher`), only while some exist: the virtual pages in meshes,
    the physical pages they share (mapped pages, each counted once), the twins among them, and what
    meshing has freed and copied so far (all time)."""
    meshes, twins = s.get("meshes", 0), s.get("pages.meshed", 0)
    if not meshes and not twins:
        return []
    P, fb = s["page_size"], format_bytes
    return [
        _row(f"  meshed: pages sharing {meshes} physical pages", str(meshes + twins), fb(meshes * P)),
        _row("    twins (no physical page of their own)", str(twins), "-"),
        _row("    pages freed / bytes copied by meshing", str(s.get("mesh.freed_pages", 0)),
             fb(s.get("mesh.copied_bytes", 0))),
    ]


def summary(stats: dict, pool=None) -> str:
    """A boxed text table of `stats` (a `Pool.stats()` dict), like `torch.cuda.memory_summary()`.

    Every number in the table comes from `stats` (byte counts through
    `defrag.format_bytes`); `pool` only names the pool in the header. Rows:
    allocated/active/reserved/requested memory (current and peak), allocation
    and free counts, retries, OOMs, pages mapped/empty/cached/total/capacity,
    and, while meshes exist, the pages meshed, the physical pages they share and
    what meshing freed and copied so far; stranded bytes, the largest request
    possible now, fragmentation,
    compactions (explicit/automatic), bytes and tensors moved, pages released,
    live and pinned blocks.
    """
    s, fb = stats, format_bytes
    if pool is not None:
        title = f"defrag pool #{pool.id} memory summary ({pool.kind}, {pool.device})"
    else:
        title = "defrag pool memory summary"
    lines = [
        _line("="),
        _center(title),
        _line(),
        _text(f"capacity {fb(s['capacity_bytes'])} in pages of {fb(s['page_size'])}"),
        _text(f"OOMs: {s['num_ooms']}    allocation retries: {s['num_alloc_retries']}"),
        _line("="),
        _row("Metric", "Cur Usage", "Peak Usage"),
        _line(),
        _row("Allocated memory", fb(s["allocated_bytes.all.current"]), fb(s["allocated_bytes.all.peak"])),
        _row("Active memory", fb(s["active_bytes.all.current"]), fb(s["active_bytes.all.peak"])),
        _row("Reserved (mapped) memory", fb(s["reserved_bytes.all.current"]), fb(s["reserved_bytes.all.peak"])),
        _row("Offloaded to host memory", fb(s["offloaded_bytes.all.current"]), fb(s["offloaded_bytes.all.peak"])),
        _row("Asleep (device pages released)" + (" - ASLEEP" if s["asleep"] else ""),
             fb(s["sleeping_bytes.all.current"]), fb(s["sleeping_bytes.all.peak"])),
        _row("Requested memory", fb(s["requested_bytes.all.current"]), "-"),
        _line(),
        _row("Events", "Count", ""),
        _line(),
        _row("Allocations", str(s["num_allocs"]), ""),
        _row("Frees", str(s["num_frees"]), ""),
        _row("Allocation retries", str(s["num_alloc_retries"]), ""),
        _row("OOMs", str(s["num_ooms"]), ""),
        _line(),
        _row("Pages", "Count", "Bytes"),
        _line(),
        _row("Mapped pages", str(s["pages.mapped"]), fb(s["pages.mapped"] * s["page_size"])),
        _row("  empty (mapped, no block)", str(s["pages.empty"]), fb(s["pages.empty"] * s["page_size"])),
        *_mesh_rows(s),
        _row("Cached physical pages (unmapped)", str(s["pages.cached"]), fb(s["pages.cached"] * s["page_size"])),
        _row("Physical pages held", str(s["pages.total"]), fb(s["pages.total"] * s["page_size"])),
        _row("Capacity", str(s["pages.capacity"]), fb(s["capacity_bytes"])),
        _line(),
        _row("Fragmentation", "Value", ""),
        _line(),
        _row("Stranded (free in pages with live data)", fb(s["stranded_bytes"]), ""),
        _row("Largest request possible now", fb(s["largest_free_bytes"]), ""),
        _row("Fragmentation (stranded / reserved)", f"{s['fragmentation']:.1%}", ""),
        _line(),
        _row("Compaction", "Count", ""),
        _line(),
        _row("Compactions (explicit / automatic)",
             f"{s['num_compactions.explicit']} / {s['num_compactions.automatic']}", ""),
        _row("Tensors moved", str(s["compaction.moved_tensors"]), ""),
        _row("Bytes moved", fb(s["compaction.moved_bytes"]), ""),
        _row("PyTorch's own tensors moved (bytes)", f"{s.get('compaction.torch_moved_tensors', 0)} "
             f"({fb(s.get('compaction.torch_moved_bytes', 0))})", ""),
        _row("Pages released", str(s["compaction.released_pages"]), ""),
        _row("Live blocks", str(s["live_blocks"]), ""),
        _row("Pinned blocks", str(s["pinned_blocks"]), ""),
        _line(),
        _row("Residency", "Count", ""),
        _line(),
        _row("Sleeps / wakes", f"{s['num_sleeps']} / {s['num_wakes']}", ""),
        _row("Offloads / reloads", f"{s['num_offloads']} / {s['num_reloads']}", ""),
        _row("Pages offloaded / asleep", f"{s['pages.offloaded']} / {s['pages.asleep']}", ""),
        _row("Host buffer of the sleep", fb(s["sleep.host_bytes"]), ""),
        _line("="),
    ]
    return "\n".join(lines)
