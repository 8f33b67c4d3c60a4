"""Meshing over the core: pages that cannot move share physical pages (docs/meshing.md). No torch.

`mesh_core(core, ...)` is the policy: settle the books, drop dormant twins,
pick the candidate pages of each region, let `defrag.mesh_planner` choose
groups of pages whose live bytes are disjoint at page offsets, and run one
`Backing.mesh` transaction per group. Every group is all or nothing: a fault
in one rolls it back (every byte and mapping as before) and stops the run;
groups meshed before it stay meshed (each is a complete, consistent mesh).

Which pages: mapped device pages with live data, not full, in no mesh yet
(v1 does not grow meshes), every block touching them passing
`Scope.mesh_blocker` (compaction's thread rule without pins: no address
changes, but a write by another thread between the copy and the remap would
be lost). The caller holds the core's gate, so the books are held: native
placement declines and releases queue while a mesh is built.

Never called while asleep, during graph capture (it synchronizes), or from
inside an allocation callback (the faces see to that).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .copying import copy_ranges, default_engine
from .errors import CudaError
from .mesh_planner import page_bitmaps, plan_meshes
from .movability import Scope
from .vmm import DEVICE, Transaction


@dataclass
class MeshReport:
    """What one meshing run did."""

    meshed_pages: int = 0  # twin pages now mapped onto another page's physical page
    freed_pages: int = 0  # physical pages given back (to the store; to the driver with release=True)
    released_pages: int = 0  # of those, released to the driver
    copied_bytes: int = 0
    groups: int = 0
    dormant_unmapped: int = 0  # twins that held no block any more, unmapped
    candidates: int = 0
    seconds: float = 0.0
    error: str = ""  # the fault that stopped the run (its group rolled back), if any

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def mesh_core(core, *, engine: str | None = None, scope: Scope | None = None, stream: int = 0,
              free_at_least: int | None = None, release: bool = False, automatic: bool = False,
              raise_errors: bool = True, pages: dict | None = None) -> MeshReport:
    """Mesh what can be meshed in `core` (its gate held); see the module docstring.

    `free_at_least=k`: stop once k physical pages are freed (the ladder's
    use). `pages`: only these pages may mesh, as {region index: page
    indices} (a compaction's: the pages of blocks it could not move); None:
    every page. `release`: give the freed physical pages to the driver (trim) instead
    of caching them. A driver fault rolls back the group it hit and is raised
    (`raise_errors`), or recorded in the report's `error`.
    """
    t0 = time.perf_counter()
    report = MeshReport()
    if core.space.sleeping or core.driver.is_capturing(stream):
        return report
    scope = scope if scope is not None else core.scope(None)
    engine = engine or default_engine(core.kind)
    core.settle()
    try:
        report.dormant_unmapped = core.backing.unmap_dormant()
        for region in core.regions:
            want = None if free_at_least is None else free_at_least - report.freed_pages
            if want is not None and want <= 0:
                break
            if pages is None or region.index in pages:
                _mesh_region(core, region, scope, stream, engine, want, release, report,
                             None if pages is None else pages[region.index])
    except CudaError as exc:
        report.error = str(exc)
        if raise_errors:
            raise
    finally:
        report.seconds = time.perf_counter() - t0
        _count(core, report, automatic)
    return report


def _mesh_region(core, region, scope: Scope, stream: int, engine: str, want, release: bool,
                 report: MeshReport, only=None) -> None:
    pages, pieces, live = candidates(core, region, scope, only)
    report.candidates += len(pages)
    if len(pages) < 2:
        return
    bitmaps = page_bitmaps(pieces, core.page_size, pages=len(pages))
    plan = plan_meshes(bitmaps, live, free_at_least=want)
    backing = core.backing

    def copy(moves):
        copy_ranges(core, stream, engine, moves)

    for group in plan.groups:
        primary, twins = pages[group.primary], [pages[t] for t in group.twins]
        with Transaction() as txn:
            olds = backing.mesh(region, primary, twins, copy, txn)
        # Committed: the twins' own physical pages hold nothing any page uses.
        if release:
            report.released_pages += len(olds) - backing.release_to_driver(olds)
        else:
            core.space.store.put(olds)
        report.groups += 1
        report.meshed_pages += len(twins)
        report.freed_pages += len(olds)
        report.copied_bytes += group.copied_bytes


def candidates(core, region, scope: Scope, only=None) -> tuple[list[int], np.ndarray, np.ndarray]:
    """The pages of `region` that may mesh (see the module docstring), among `only` (page indices) if
    given: (page indices, their live pieces as (candidate index, offset, length) rows, live bytes per
    candidate). The books are settled."""
    backing, P = core.backing, core.page_size
    counts = backing.live_count[region.index]
    ok = ((region.handles != 0) & (region.backing == DEVICE) & (counts > 0)
          & (backing.mesh_ids[region.index] < 0) & (region.unit_start < 0))  # a unit's page never meshes
    if only is not None:
        allowed = np.zeros_like(ok)
        allowed[np.asarray(only, dtype=np.int64)] = True
        ok &= allowed
    if int(ok.sum()) < 2:
        return [], np.zeros((0, 3), np.int64), np.zeros(0, np.int64)
    blocker = scope.mesh_blocker
    for block in core.blocks():
        if block.region is region and blocker(block):
            first, end = backing.pages_of(block)
            ok[first:end] = False
    pages = np.flatnonzero(ok).tolist()
    rows, live = [], np.zeros(len(pages), np.int64)
    for i, page in enumerate(pages):
        for off, n in backing.live_pieces(region, page):
            rows.append((i, off, n))
            live[i] += n
    full = live >= P
    if full.any():  # nothing meshes with a full page: keep the planner's input small
        keep = np.flatnonzero(~full)
        remap = {int(old): new for new, old in enumerate(keep)}
        pages = [pages[i] for i in keep]
        rows = [(remap[i], off, n) for i, off, n in rows if i in remap]
        live = live[keep]
    return pages, np.array(rows, dtype=np.int64).reshape(-1, 3), live


def _count(core, report: MeshReport, automatic: bool) -> None:
    c = core.counters
    if report.groups:
        c["num_meshes"] += report.groups
        if automatic:
            c["num_meshes.automatic"] += report.groups
    c["mesh.freed_pages"] += report.freed_pages
    c["mesh.copied_bytes"] += report.copied_bytes


def split_all(core) -> int:
    """Give every twin page of `core` (gate held) a physical page of its own (`Backing.split`), dormant
    twins unmapped first; returns how many were split. Each split is its own transaction; ValueError
    (the rest stay meshed) when no physical page is free for the next one."""
    core.settle()
    backing = core.backing
    backing.unmap_dormant()
    split = 0
    for _, index, _, twins, _ in backing.meshes():
        region = core.space.regions[index]
        for twin in twins:
            with Transaction() as txn:
                backing.split(region, twin, txn)
            split += 1
    return split
