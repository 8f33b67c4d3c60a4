"""Reading a core: statistics in PyTorch's key grammar, the layout picture, the invariant check and
the explained out-of-memory error. No torch; nothing here changes a block or a page.

Every function takes a `defrag.core.Core` whose gate the caller holds, and reads it through its
public views (`Core.blocks`, `Core.counters`, `Core.peaks`, `Core.backing`). Ranges kept for reuse
go back to the heaps first (`Core.flush_reuse`), so free-space figures are exact.
"""

from __future__ import annotations

import numpy as np

from .backing import PRIMARY, TWIN
from .units import ALIGNMENT, format_bytes
from .vmm import ASLEEP, DEVICE, HOST


class OutOfRoom(MemoryError):
    """The ladder is exhausted: `message` explains; faces raise their own error from it.

    `figures` (a dict): `requested`, `capacity`, `live`, `stranded`,
    `pinned`, `tried`, and for faces that word their own advice
    (`defrag.oom.refused_inside_allocator`): `movable` (live bytes a
    compaction could move), `reserved`, `page_size`, `device_total`,
    `device_full` (the device refused a page below the capacity),
    `capacity_needed` (the smallest capacity whose pages would have served
    this request now, layout unchanged) and `facts` (the message's lines
    before its suggestion).
    """

    def __init__(self, message: str, **figures):
        super().__init__(message)
        self.message = message
        self.figures = figures


def packing_floor(core, scope, can_rewrite=None) -> tuple[int, int]:
    """(pages touched by blocks that cannot move, bytes of blocks that can) for a compaction of `scope`:
    a perfect compaction leaves the first plus the second in whole pages. A mesh is one physical page:
    its pages count once."""
    pinned_pages = set()
    movable = 0
    backing = core.backing
    ids = backing.mesh_ids
    for b in core.blocks():
        if scope.blocker(b, can_rewrite):
            first, end = backing.pages_of(b)
            mesh = ids[b.region.index]
            pinned_pages.update((b.region.index, p) if mesh[p] < 0 else ("mesh", int(mesh[p]))
                                for p in range(first, end))
        else:
            movable += b.size
    return len(pinned_pages), movable


def out_of_room(core, nbytes: int, tried: list[str], describe=None, can_rewrite=None) -> OutOfRoom:
    """The explained out-of-memory error for `nbytes` (see `OutOfRoom`); `can_rewrite`: the face's verdict
    of which blocks could move now (`Mover.can_rewrite`), for what a compaction could free."""
    st = stats(core)
    pinned = sum(b.size for b in core.blocks() if b.pins)
    largest = sorted((b for b in core.blocks() if not b.retired), key=lambda b: (-b.nbytes, -b.pins))[:5]
    lines = [
        f"defrag {core.label} ({core.kind}) cannot allocate {format_bytes(nbytes)} ({nbytes} bytes):",
        f"  capacity {format_bytes(core.capacity)}, live {format_bytes(st['allocated_bytes.all.current'])}, "
        f"stranded in half-used pages {format_bytes(st['stranded_bytes'])}, pinned {format_bytes(pinned)}, "
        f"largest request possible now {format_bytes(st['largest_free_bytes'])}.",
        "  tried: " + "; ".join(tried or ["placement"]),
    ]
    if largest:
        lines.append("  largest live tensors: " + ", ".join(
            (f"{format_bytes(b.nbytes)} {describe(b) if describe else ''}".strip()
             + (" (pinned)" if b.pins else "")) for b in largest))
    facts = tuple(lines)
    floor = packing_floor(core, core.scope(None), can_rewrite)
    lines.append("  suggestion: " + _suggestion(core, nbytes, st["allocated_bytes.all.current"], pinned, floor))
    P = core.page_size
    store = core.space.store
    free_pages = store.unmapped + (0 if store.device_full else store.creatable) + core.backing.empty
    return OutOfRoom("\n".join(lines), requested=nbytes, capacity=core.capacity,
                     live=st["allocated_bytes.all.current"], stranded=st["stranded_bytes"],
                     pinned=pinned, tried=tuple(tried), movable=floor[1],
                     reserved=st["reserved_bytes.all.current"], page_size=P,
                     device_total=core.driver.total_memory, device_full=bool(store.device_full),
                     capacity_needed=(core.capacity_pages - free_pages + -(-nbytes // P)) * P, facts=facts)


def _suggestion(core, nbytes: int, live: int, pinned: int, floor: tuple[int, int]) -> str:
    """What would really make room for `nbytes`: only advice that is true of this pool and device."""
    device_total = core.driver.total_memory
    if nbytes > core.capacity:
        advice = f"the request is larger than the pool's capacity ({format_bytes(core.capacity)})"
        if nbytes > device_total:
            return advice + f" and than the whole device ({format_bytes(device_total)}): split the tensor."
        return advice + f": create the pool with capacity >= {format_bytes(nbytes)}."
    if core.space.store.device_full:
        return (f"the device is the limit, not the pool: it has {format_bytes(device_total)} in all and gave "
                f"no more pages (other pools, PyTorch's caching allocator or other processes hold the rest), "
                f"so a larger capacity would not help; free memory held outside this pool "
                f"(torch.cuda.empty_cache(), other pools' trim()) or ask for less.")
    pinned_pages, movable = floor
    free_after_compaction = core.capacity - (pinned_pages + -(-movable // core.page_size)) * core.page_size
    if nbytes <= free_after_compaction and not core.auto_compact:
        return "pool.compact() (or auto_compact=True) would make room for this request."
    steps = []
    if pinned:
        steps.append("unpin tensors you no longer need to keep in place")
    if live:
        steps.append("free tensors you no longer need")
    if core.capacity < device_total:
        steps.append(f"create the pool with a larger capacity (the device has {format_bytes(device_total)})")
    elif not steps:
        steps.append("ask for less: the pool already spans the whole device")
    return ", ".join(steps[:-1]) + (" or " if len(steps) > 1 else "") + steps[-1] + "."


def stats(core) -> dict:
    """Counters and gauges in PyTorch's key grammar (the gate is held; see `Pool.stats`)."""
    backing = core.backing
    stranded, fragmentation = core.stranded()
    P = core.page_size
    counted = core.books.counters()  # the block counters are the books'
    allocated = counted["allocated_bytes"]
    pending = counted["pending_bytes"]
    mapped = core.space.mapped
    empty = backing.empty
    heap_free = stranded + empty * P
    store = core.space.store
    free_pages = store.unmapped + (0 if store.device_full else store.creatable) + empty
    if free_pages >= 1:
        largest = free_pages * P
    else:
        largest = max((h.largest_free() for h in backing.heaps), default=0)
        largest = min(largest, P - ALIGNMENT)
    # The largest block servable without mapping a page (PyTorch's cacheInfo; `stranded()` above
    # returned the kept ranges to the heaps).
    largest_mapped = max((h.largest_free() for h in backing.heaps), default=0)
    reserved = mapped * P
    core.peaks["reserved_bytes"] = max(core.peaks["reserved_bytes"], reserved)
    active = allocated + pending
    c = core.counters
    return {
        "allocated_bytes.all.current": allocated,
        "allocated_bytes.all.peak": counted["allocated_bytes.peak"],
        "active_bytes.all.current": active,
        "active_bytes.all.peak": counted["active_bytes.peak"],
        "reserved_bytes.all.current": reserved,
        "reserved_bytes.all.peak": core.peaks["reserved_bytes"],
        "requested_bytes.all.current": sum(b.nbytes for b in core.blocks()),
        "num_alloc_retries": c["num_alloc_retries"],
        "num_ooms": c["num_ooms"],
        "num_allocs": counted["num_allocs"],
        "num_frees": counted["num_frees"],
        "num_device_alloc": store.created,
        "num_device_free": store.created - store.total,
        "pages.mapped": mapped,
        "pages.meshed": core.space.aliases,
        "meshes": len(backing.meshes()),
        "num_meshes": c["num_meshes"],
        "num_meshes.automatic": c["num_meshes.automatic"],
        "mesh.freed_pages": c["mesh.freed_pages"],
        "mesh.copied_bytes": c["mesh.copied_bytes"],
        "units.broken": c["units.broken"],
        "units.freed_pages": c["units.freed_pages"],
        "pages.cached": store.unmapped,
        "pages.total": store.total,
        "pages.empty": empty,
        "pages.capacity": core.capacity_pages,
        "page_size": P,
        "capacity_bytes": core.capacity,
        "free_inside_mapped_bytes": heap_free,
        "stranded_bytes": stranded,
        "largest_free_bytes": largest,
        "largest_mapped_free_bytes": largest_mapped,
        "fragmentation": fragmentation,
        "num_compactions": c["num_compactions"],
        "num_compactions.explicit": c["num_compactions.explicit"],
        "num_compactions.automatic": c["num_compactions.automatic"],
        "compaction.moved_bytes": c["compaction.moved_bytes"],
        "compaction.moved_tensors": c["compaction.moved_tensors"],
        "compaction.released_pages": c["compaction.released_pages"],
        "live_blocks": sum(1 for b in core.blocks() if not b.retired),
        "pinned_blocks": sum(1 for b in core.blocks() if b.pins),
        "regions": len(core.space.regions),
        # Residency (defrag.residency): reserved_bytes above counts device pages only.
        "offloaded_bytes.all.current": core.space.host_mapped * P,
        "offloaded_bytes.all.peak": core.peaks["offloaded_bytes"],
        "sleeping_bytes.all.current": core.space.asleep * P,
        "sleeping_bytes.all.peak": core.peaks["sleeping_bytes"],
        "pages.offloaded": core.space.host_mapped,
        "pages.asleep": core.space.asleep,
        "asleep": core.space.sleeping,
        "sleep.host_bytes": c["sleep.host_bytes"],
        "num_sleeps": c["num_sleeps"],
        "num_wakes": c["num_wakes"],
        "num_offloads": c["num_offloads"],
        "num_reloads": c["num_reloads"],
        "offload.moved_bytes": c["offload.moved_bytes"],
    }


def layout(core) -> dict:
    """A plain-dict picture of the core (for `defrag.viz` and snapshots); see `Pool.layout`."""
    backing = core.backing
    core.flush_reuse()
    regions = []
    for region in core.space.regions:
        live = backing.live_count[region.index] > 0
        mapped = region.handles != 0
        states = np.where(live, "live", np.where(mapped, "empty", "unmapped"))
        # Pages behind host memory (offloaded) or released by a sleep.
        states = np.where(region.backing == HOST, "offloaded", np.where(region.backing == ASLEEP, "asleep", states))
        twin = backing.roles[region.index] == TWIN  # sharing a primary's physical page (a mesh)
        states = np.where(twin, np.where(live, "meshed", "meshed-dormant"), states)
        regions.append({"index": region.index, "base": region.base, "npages": region.npages,
                        "pages": states.tolist(), "free_ranges": backing.heaps[region.index].free_ranges(),
                        "mesh": backing.mesh_ids[region.index].tolist(),
                        "meshes": {m[0]: [m[2], *m[3]] for m in backing.meshes() if m[1] == region.index}})
    blocks = []
    for _, b in ((b.address, b) for b in sorted(core.blocks(), key=lambda b: b.address)):
        dtype, shape = getattr(b.info, "dtype", None), getattr(b.info, "shape", None)
        blocks.append({"address": b.address, "size": b.size, "nbytes": b.nbytes, "region": b.region.index,
                       "kind": getattr(b.info, "kind", None) or "block",
                       "pinned": b.pins > 0, "offloaded": b.offloaded,
                       "dtype": str(dtype).replace("torch.", "") if dtype else None,
                       "shape": list(shape) if shape is not None else None,
                       "state": "retired" if b.retired else ("live" if b.counted else "pending-free")})
    return {"kind": core.kind, "page_size": core.page_size, "capacity": core.capacity,
            "cached_pages": core.space.store.unmapped, "regions": regions, "blocks": blocks}


def check_invariants(core) -> None:
    """Raise AssertionError if any of DESIGN.md's invariants is broken (a test aid).

    Checks: blocks do not overlap; every byte of every block is mapped;
    allocated + free-inside-mapped == mapped bytes; page live counts match
    the blocks; heaps are internally consistent.
    """
    backing = core.backing
    core.flush_reuse()
    prev_end = None
    counts = [np.zeros_like(c) for c in backing.live_count]
    for address, b in ((b.address, b) for b in sorted(core.blocks(), key=lambda b: b.address)):
        assert address == b.address
        assert prev_end is None or address >= prev_end, f"blocks overlap at {address:#x}"
        prev_end = address + b.size
        first, end = backing.pages_of(b)
        assert b.region.handles[first:end].all(), f"block at {address:#x} touches an unmapped page"
        counts[b.region.index][first:end] += 1
    for region, heap, expect, got in zip(core.space.regions, backing.heaps, counts, backing.live_count):
        heap.check_invariants()
        assert np.array_equal(expect, got), f"page live counts of region {region.index} disagree"
        for off, size in heap.free_ranges():
            first, end = backing.pages_of(off, size)
            assert region.handles[first:end].all(), "free space recorded inside an unmapped page"
    allocated = sum(b.size for b in core.blocks())
    counted = sum(b.size for b in core.blocks() if b.counted)
    assert counted == core.allocated_bytes, "allocated counter disagrees with blocks"
    heap_free = sum(h.free_bytes() for h in backing.heaps)
    assert allocated + heap_free == core.space.book_pages * core.page_size, (
        f"allocated {allocated} + free {heap_free} != mapped {core.space.book_pages * core.page_size}")
    assert core.space.store.total <= core.capacity_pages, "more physical pages than capacity"
    assert core.space.mapped + core.space.store.unmapped == core.space.store.total
    # A mesh is one physical page: counted once, empty when none of its pages holds a block.
    meshes = backing.meshes()
    plain = [(r.handles != 0) & (m < 0) for r, m in zip(core.space.regions, backing.mesh_ids)]
    empty = sum(int((p & (c == 0)).sum()) for p, c in zip(plain, backing.live_count))
    empty += sum(1 for *_, live in meshes if live == 0)
    assert empty == backing.empty, f"empty page count {backing.empty} != {empty}"
    live = sum(int((p & (c > 0)).sum()) for p, c in zip(plain, backing.live_count))
    live += sum(1 for *_, n in meshes if n > 0)
    assert live == backing.live_pages(), f"live page count {backing.live_pages()} != {live}"
    _check_meshes(core, meshes)


def _check_meshes(core, meshes) -> None:
    """Invariant 9 and the books of meshes (docs/meshing.md, "Invariants"): every member maps its mesh's
    one handle; each byte offset is managed by exactly one member's heap; twins hold no free space; a
    mesh's live count is its members'; `mapped` counts distinct device handles."""
    backing, space, P = core.backing, core.space, core.page_size
    refs: dict[int, int] = {}
    for region in space.regions:
        for h in region.handles[(region.handles != 0) & (region.backing == DEVICE)].tolist():
            refs[h] = refs.get(h, 0) + 1
    assert refs == space.refs, "per-handle mapping counts disagree with the pages"
    assert space.mapped == len(refs), f"mapped {space.mapped} != distinct device handles {len(refs)}"
    assert space.aliases == sum(refs.values()) - len(refs), "alias count disagrees with the pages"
    members = set()
    for mesh_id, index, primary, twins, live in meshes:
        region, heap = space.regions[index], backing.heaps[index]
        ids, roles, counts = backing.mesh_ids[index], backing.roles[index], backing.live_count[index]
        group = [primary, *twins]
        assert twins, f"mesh {mesh_id} has no twin"
        assert len({int(region.handles[p]) for p in group}) == 1 and region.handles[primary], (
            f"mesh {mesh_id}'s pages map different physical pages")
        assert all(ids[p] == mesh_id for p in group)
        assert roles[primary] == PRIMARY and all(roles[t] == TWIN for t in twins)
        assert live == sum(int(counts[p]) for p in group), f"mesh {mesh_id}'s live count disagrees"
        covered = np.zeros(P // ALIGNMENT, dtype=np.int64)
        for p in group:
            base = region.address(p)
            for lo, n in heap.managed_in(base, base + P):
                covered[(lo - base) // ALIGNMENT:(lo - base + n) // ALIGNMENT] += 1
            if p != primary:
                assert heap.free_bytes_in(base, base + P) == 0, f"free space on twin page {p} of mesh {mesh_id}"
        assert (covered == 1).all(), f"mesh {mesh_id}: an offset managed by {covered.max()} or no member"
        members.update((index, p) for p in group)
    for index, ids in enumerate(backing.mesh_ids):
        stray = {(index, int(p)) for p in np.flatnonzero(ids >= 0)} - members
        assert not stray, f"pages {sorted(stray)[:4]} carry a mesh id but are in no mesh"
