"""The compaction protocol over the core: plan, prepare, copy, commit, release. No torch.

The one step that depends on what a block is to its user, rewriting the
block's owner so it uses the new location, is the face's: a `Mover` (see
below) that `defrag.pool.Pool` implements with torch storages and
`defrag.dry.DryPool` with plain keys.

The protocol, wave by wave (a wave is a set of moves whose destinations are
free and overlap no source, see `defrag.planner`):

1. **prepare**: map the destination pages that are not mapped yet and carve
   the destination ranges in the heap (giving the old ranges back at once
   where the face lets go of them at the commit).
2. **copy**: every move of the wave in one batch, queued on the face's
   stream (on a GPU the move kernel in one launch and the copy engine for
   the largest moves, `defrag.copying`; memmove, the simulated kernel or the
   driver's copy on the emulated device). Nothing waits for it: stream order
   runs the next wave's copies after it, and the compaction synchronizes
   once, after its last wave (and before any page is unmapped: `vmm` waits
   for the device first). With `verify=True`, the device is synchronized and
   checksums of sources and destinations are compared.
3. **commit**: every owner is checked, then rewritten to use its new range.
   In place where the face can (`Mover.move_in_place`: for torch, each
   storage takes a data pointer over its new range in one C++ call and every
   tensor and view follows; the core re-addresses the same block), else
   through destination blocks and what the face makes for them
   (`Mover.destinations`: for torch, a temporary storage over each, swapped
   with the user's). Everything the commit needs was checked before, so
   this step cannot fail half-way.
4. **release**: the old locations go back to the heap (at once when given
   back in step 1; for torch's temporaries, when they die).

A failure in steps 1-2 of a wave (driver error, copy failure, checksum
mismatch, any exception) drops that wave's destinations and unmaps the pages
it mapped: every tensor keeps its old location and bytes. Earlier waves stay
done (their tensors are valid at their new places). The closing synchronize
is the one step after the commits: when it fails, the device reported an
error from work it ran (on a GPU a sticky one: the context is lost); the
books and every owner stay as committed, and the error is raised. After the last wave the
emptied pages stay mapped and free (`release=False`, the default): unmapping
them would free no device memory (their handles stay in the pool) and costs
a driver call per mapping, here and again when they are reused. A request
that needs their physical page elsewhere unmaps them then (stitching), and
`trim()` returns them to the device. With `release=True` every mapped page
that holds no block is unmapped at the end (after a synchronize) and its
physical page cached.

Destinations go, in order of preference, into holes of pages that stay
(wave 1), into empty mapped pages, and only then into unmapped pages (which
an explicit compaction backs by unmapping empty pages elsewhere, so it never
raises the number of mapped pages).

Blocks of a page or more are moved only by the conveyor (`_convey`, before
the plan: `planner.plan_conveyor` packs them end to end into a zone of free
pages when that frees pages; the main plan treats them as fixed).

Never moved: pinned blocks; blocks
another thread may be using (`Core.scope`: the contract is in
`defrag.pool`); blocks whose owner the face cannot rewrite (a storage being
released, segments handed to PyTorch's allocator, or in rebind mode a
storage whose users it cannot all prove known); and anything at all while a
CUDA graph is being captured on the current stream (refused with an error).
A graph captured *earlier* still holds the old addresses: pin the tensors a
graph uses. Other pools are untouched.

Concurrency: the caller holds the core's gate for the whole compaction, so
no pool call of another thread runs meanwhile; threads waiting at the gate
run none of their own code, which is why their blocks may move.

What it asks of the core, and nothing else: its figures (`page_size`, `kind`,
`capacity`, `capacity_pages`, `allocated_bytes`, `round`) and the rescue's
settings (`auto_compact`, `auto_mesh`, `min_compact_interval`,
`last_auto_compact`); safe points (`settle`, `drain`, `flush_reuse`); reads
of the layout (`regions`, `blocks`, `free_ranges`, `unmanaged_ranges`,
`stranded`, `scope`); `place` (a rescue's retry) and `record_compaction`;
and three interfaces: `Core.waves` (`defrag.core.WaveBooks`, the only
operations that change blocks' records: `begin_moves`, `record_moves`,
`swap_in`, `move_to`, `forget`), `Core.backing` (pages: `map`, `make_room`,
`unmap_empty` and its reads) and `Core.driver` (`synchronize`,
`is_capturing`).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import time
import traceback
from dataclasses import dataclass, field

from typing import Protocol

import numpy as np

from .copying import ENGINES, WaveMoves, copy_ranges, default_engine, kernel_stream, relative
from .core import Core, NoSpace, Scope
from .errors import CompactionError, CudaError
from .mesher import mesh_core
from .page_runs import run_pages
from .planner import ArrayPlan, plan_arrays, plan_conveyor, plan_hole_arrays, plan_window_arrays
from .readout import packing_floor
from .units import format_bytes
from .vmm import Transaction

_log = logging.getLogger("defrag")

PROGRESS_BYTES = 256 << 20  # show a progress bar when a compaction moves more than this
PROGRESS_MOVES = 20_000


@dataclass
class CompactionReport:
    """What one compaction did. `phases` holds seconds per step."""

    moved_tensors: int = 0
    moved_bytes: int = 0
    released_pages: int = 0  # pages that held live data before and hold none after
    unmapped_pages: int = 0  # pages unmapped at the end (release=True); their physical pages are cached
    seconds: float = 0.0
    fragmentation_before: float = 0.0
    fragmentation_after: float = 0.0
    stranded_before: int = 0
    stranded_after: int = 0
    pages_before: int = 0
    pages_after: int = 0
    waves: int = 0
    engine: str = ""
    automatic: bool = False
    verified: bool = False
    page_size: int = 0
    meshed_pages: int = 0  # pages that could not be emptied, now sharing a physical page (defrag.mesher)
    mesh_freed_pages: int = 0  # physical pages meshing freed
    mesh_copied_bytes: int = 0
    phases: dict = field(default_factory=dict)

    def __str__(self) -> str:
        kind = "automatic" if self.automatic else "explicit"
        phases = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.phases.items())
        if self.moved_tensors:
            moved = (f"moved {self.moved_tensors} tensors ({format_bytes(self.moved_bytes)}) in {self.waves} "
                     f"wave{'s' if self.waves != 1 else ''}")
        else:
            moved = "moved nothing"
        freed = (f"pages holding live data {self.pages_before} -> {self.pages_after}"
                 + (f" ({self.released_pages} freed, {format_bytes(self.released_pages * self.page_size)})"
                    if self.released_pages else ""))
        unmapped = (f"; {self.unmapped_pages} empty pages unmapped (their physical memory is kept for the next "
                    f"request; trim() returns it)" if self.unmapped_pages else "")
        meshed = (f"; meshed {self.meshed_pages} pages onto others' physical pages ({self.mesh_freed_pages} "
                  f"freed, {format_bytes(self.mesh_copied_bytes)} copied)" if self.meshed_pages else "")
        return (
            f"Compaction ({kind}, engine={self.engine}{', verified' if self.verified else ''}): {moved}; "
            f"{freed}{meshed}{unmapped}; fragmentation {self.fragmentation_before:.1%} -> {self.fragmentation_after:.1%} "
            f"(stranded {format_bytes(self.stranded_before)} -> {format_bytes(self.stranded_after)}); "
            f"{self.seconds * 1e3:.1f} ms [{phases}]"
        )

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class Mover(Protocol):
    """What a face tells the compaction about its blocks' owners (all called with the gate held).

    - `stream()`: the CUDA stream copies run on (0: the default stream);
    - `can_rewrite(block)`: "" when the face can rewrite the block's owner,
      else why not (the block is then unmovable);
    - `grip(block)`: a strong reference that keeps the owner alive and
      unchanged through the compaction (the block's *grip*), or None when it
      cannot move now (`can_rewrite(block)` is not "" included: the
      compaction asks `grip` alone for every block `movability.Scope.blocker`
      lets move);
    - `grip_all(blocks)`: `[grip(b) for b in blocks]`, in one call (a
      region's blocks before each plan, or a wave's);
    - `grippable(blocks)`: for a face whose grips only keep owners alive
      (`lets_go()`), whether `grip` would give each block a grip, without
      taking it (cheap: the compaction plans with it and grips only the
      blocks it moves);
    - `destinations(blocks)`: for each freshly carved destination of a wave,
      in order, whatever the commit will need (in one call: one C++ call for
      torch); if the wave is abandoned, dropping one must lead the face to
      release its block (or the face does nothing when `free` is used);
    - `check(old, held, dest)`: whether the owner is still exactly as held
      (nothing may be moved otherwise);
    - `commit(old, new, held, dest)`: the owner now uses `new`'s memory; the
      face releases `old` later (when nothing can use it any more). Must not
      fail.
    - `lets_go()`: whether, once the compaction drops the grips and the
      destinations of a committed wave, nothing can use the old ranges any
      more (the compaction then frees them at once, in one batch, instead of
      waiting for their releases one by one);
    - `move_in_place(olds, addresses, grips)` (only when `lets_go()`): every
      owner of `olds` checked as `check` would, then, only if all pass, each
      given the memory at the same index of `addresses` (the copy is done)
      while its block keeps its identity (`WaveBooks.move_to` re-addresses it):
      -1, or the index of the first owner that failed (nothing changed); None
      when the face cannot for this wave (nothing changed: the wave then goes
      through destination blocks, `destinations` and `commit_all`);
    - `commit_all(dests)`: None when the face commits move by move (`check`
      for every move, then `commit` each); else it checks every move of
      `dests` ((old, new, held, dest) tuples) as `check` would and, only if
      all pass, commits all of them as `commit` would (then it must not
      fail): -1, or the index of the first move that failed its check
      (nothing committed). It may replace the destinations in `dests` (a
      list) with ones it made itself.
    """

    def stream(self) -> int: ...
    def can_rewrite(self, block) -> str: ...
    def grip(self, block): ...
    def grip_all(self, blocks) -> list: ...
    def grippable(self, blocks) -> list: ...
    def destinations(self, blocks) -> list: ...
    def check(self, old, held, dest) -> bool: ...
    def commit(self, old, new, held, dest) -> None: ...
    def lets_go(self) -> bool: ...
    def move_in_place(self, olds, addresses, grips) -> int | None: ...
    def commit_all(self, dests) -> int | None: ...


class _NoBar:
    """A progress bar that shows nothing (`update` and `close` do nothing)."""

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


_NO_BAR = _NoBar()


def progress_bar(total_bytes: int, progress: bool | None, desc: str, *, large: bool):
    """A tqdm bar over `total_bytes`: shown when `progress` is True, or when it is None and the work is
    `large`; otherwise a bar whose `update` and `close` do nothing. Asked for explicitly, the finished
    bar stays on screen; automatic ones vanish."""
    show = bool(progress) or (progress is None and large)
    if not show:
        return _NO_BAR  # what a disabled tqdm does, without building one (about 0.1 ms)
    from tqdm.auto import tqdm

    return tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, leave=bool(progress),
                disable=False)


class PhaseTimer:
    """`with PhaseTimer(report.phases, "copy"):` adds the block's wall time to `phases["copy"]`."""

    def __init__(self, phases: dict, name: str):
        self.phases, self.name = phases, name

    def __enter__(self):
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        self.phases[self.name] = self.phases.get(self.name, 0.0) + time.perf_counter() - self.t0


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic collector off inside (left as it was found); also a decorator. A compaction
    makes a few objects per moved block, enough to set off collections whose pauses (a full one
    walks every object of the program: ~10 ms with ten thousand tensors alive) would land inside
    it; what it makes is acyclic and freed by reference counting. A dry replay likewise (a probe
    of the 80 GB serving trace: 7-11% of its time in collections that find a few hundred cycles)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@collector_paused()
def compact_core(core: Core, mover: Mover, *, verify: bool = False, progress: bool | None = None,
                 engine: str | None = None, automatic: bool = False, release: bool = False,
                 hole_for: int | None = None, scope: Scope | None = None, callbacks=(),
                 mesh: bool = False) -> CompactionReport:
    """Compact every region of `core` (its gate held by the caller). See the module docstring.

    `release=True` also unmaps every empty page at the end (after a
    synchronize), so `reserved_bytes` drops; with `release=False` (default)
    they stay mapped and empty, free for any later request (which unmaps
    only what it must), saving the unmap/remap round trip.
    `hole_for=n` plans instead the single cheapest move that merges two free
    ranges into one hole of at least n bytes, or for n of a page or more the
    cheapest evacuation of a window of n bytes whose unmapped pages are then
    mapped (see `_hole_plan`). `scope`
    (from `Core.scope`) says which threads' blocks may move: by default,
    what a compaction from the calling thread may move. `callbacks` are
    called with the report at the end (one that raises is logged, ignored).
    `mesh=True`: after the moves, the pages of blocks that could not move
    share physical pages where their live bytes are disjoint
    (`defrag.mesher`; a driver fault there rolls that mesh back and is
    logged); nothing is meshed when every block could move.
    """
    if scope is None:
        scope = core.scope(None)
    for name, value in (("verify", verify), ("release", release), ("mesh", mesh)):
        if not isinstance(value, bool):
            raise TypeError(f"compact({name}=...) takes True or False, got {value!r}; nothing was moved")
    if progress is not None and not isinstance(progress, bool):
        raise TypeError(f"compact(progress=...) takes True, False or None, got {progress!r}; nothing was moved")
    engine = engine or default_engine(core.kind)
    if engine not in ENGINES:
        raise ValueError(f"unknown copy engine {engine!r}; expected one of {ENGINES}")
    if engine == "memmove" and core.kind != "emulated":
        raise ValueError("the memmove engine works only on the emulated device")
    if engine == "kernel" and core.kind == "memoryless":
        raise ValueError("the kernel engine needs device memory; the memory-less device copies nothing")
    if core.driver.is_capturing(mover.stream()):
        raise CompactionError("cannot compact while a CUDA graph is being captured: "
                              "captured kernels hold raw pointers that a move would invalidate")
    t_start = time.perf_counter()
    report = CompactionReport(engine=engine, automatic=automatic, verified=verify, page_size=core.page_size)
    phases = report.phases
    core.settle()  # the plan and the destinations read the heap's free space
    with PhaseTimer(phases, "sync"):
        core.driver.synchronize()  # queued kernels may still use blocks we are about to move
    report.stranded_before, report.fragmentation_before = core.stranded()
    report.pages_before = core.backing.live_pages()

    if hole_for is None:
        try:
            _convey(core, mover, scope, engine, verify, report, automatic)
        except BaseException:
            _finish(core, report, t_start, automatic, release, failing=True)
            raise

    with PhaseTimer(phases, "plan"):
        plans, stuck = _plan_regions(core, mover, scope, hole_for, automatic, mesh and hole_for is None)

    total_bytes = sum(p.moved_bytes for _, p, _ in plans)
    total_moves = sum(len(p) for _, p, _ in plans)
    bar = progress_bar(total_bytes, progress, "defrag compact",
                       large=total_bytes > PROGRESS_BYTES or total_moves > PROGRESS_MOVES)
    done = False
    try:
        for region, plan, layout in plans:
            for a, b in plan.wave_slices():
                _run_wave(core, mover, region, plan, a, b, layout, engine, verify, report)
                report.waves += 1
                bar.update(int(plan.size[a:b].sum()))
            layout.held.clear()
            if plan.hole is not None:
                with PhaseTimer(phases, "prepare"):
                    _map_hole(core, region, plan.hole)
        if stuck:
            with PhaseTimer(phases, "mesh"):
                _mesh(core, mover, scope, engine, automatic, report, pages=stuck)
        done = True
    finally:
        for _, _, layout in plans:
            layout.held.clear()  # strong references to the owners end here, error or not
        bar.close()
        _finish(core, report, t_start, automatic, release, failing=not done)
    for callback in list(callbacks):
        try:
            callback(report)
        except Exception:  # a logging hook must not turn a finished compaction (or an allocation) into an error
            # Formatted now: a stored exc_info would keep every frame (and tensor) of the caller alive.
            _log.error("defrag: an on_compact callback raised; ignored\n%s", traceback.format_exc())
    return report


def _plan_regions(core: Core, mover: Mover, scope: Scope, hole_for: int | None, automatic: bool,
                  mesh: bool):
    """Each region's plan, as (region, plan, layout) for the regions with moves; and, per region index,
    the pages that blocks which cannot move touch (what a compaction's meshing step may share: the
    moves pack the rest), only with `mesh` (else empty: nothing will mesh)."""
    plans, stuck = [], {}
    for region in core.regions:
        layout = _collect(core, mover, region, scope)
        fixed = ~layout.movable
        if mesh and fixed.any():
            stuck[region.index] = _pages_under(layout.offsets[fixed], layout.sizes[fixed], core.page_size)
        if not layout.held and (hole_for is None or hole_for < core.page_size):
            continue  # nothing can move (a window plan may move nothing: it maps the window's pages)
        if hole_for is not None:
            plan = _hole_plan(core, region, layout, hole_for)
            if plan is not None:
                plans.append((region, plan, layout))
                break  # one hole is all the request needs
        else:
            budget = _page_budget(core, automatic)
            # The mapped-pages hint orders the pages a plan may open; with none to open it changes nothing.
            plan = plan_arrays(layout.offsets, layout.sizes, layout.movable, page_size=core.page_size,
                               span=region.size, max_new_pages=budget,
                               mapped=region.handles != 0 if budget else None)
            if not plan.empty:
                plans.append((region, plan, layout))
    return plans, stuck


def _mesh(core: Core, mover: Mover, scope: Scope, engine: str, automatic: bool, report: CompactionReport,
          free_at_least: int | None = None, pages: dict | None = None) -> None:
    """Mesh what the moves left (`defrag.mesher.mesh_core`; `pages`: only those, per region index) into
    `report`; a fault is logged, not raised."""
    meshed = mesh_core(core, engine=engine, scope=scope, stream=mover.stream(), automatic=automatic,
                       free_at_least=free_at_least, raise_errors=False, pages=pages)
    report.meshed_pages += meshed.meshed_pages
    report.mesh_freed_pages += meshed.freed_pages
    report.mesh_copied_bytes += meshed.copied_bytes
    if meshed.error:
        _log.warning("defrag: meshing stopped after a driver fault (that mesh was rolled back): %s", meshed.error)


def _finish(core: Core, report: CompactionReport, t_start: float, automatic: bool, release: bool,
            failing: bool = False) -> None:
    """The end of every compaction, failed or not: the one synchronize after the waves' copies, release,
    the report's after-figures, the counters. A failed synchronize is raised after the rest is done
    (only logged when the compaction is `failing` already: its own error goes up)."""
    phases = report.phases
    sync_error = _wait_for_copies(core, report, failing)
    # Release the pages the moves emptied, even after a failed wave: earlier
    # waves' work is committed and their pages are free.
    core.drain()
    if release:
        with PhaseTimer(phases, "release"):
            mapped_before_release = core.backing.space.mapped
            try:
                core.backing.unmap_empty(core.backing.empty_mapped())
            except CudaError:
                pass  # pages that could not be unmapped stay mapped and usable; state stays consistent
            report.unmapped_pages = mapped_before_release - core.backing.space.mapped
    report.stranded_after, report.fragmentation_after = core.stranded()
    report.pages_after = core.backing.live_pages()
    report.released_pages = max(report.pages_before - report.pages_after, 0)
    report.seconds = time.perf_counter() - t_start
    core.record_compaction(report)
    if sync_error is not None:
        raise sync_error


def _wait_for_copies(core: Core, report: CompactionReport, failing: bool) -> CudaError | None:
    """The compaction's one synchronize after its waves: their copies were queued without waiting
    (stream order runs each wave's after the one before), and a caller may use the moved tensors on
    any stream once the compaction returns. Counted in the copy phase. Returns the driver's error,
    if any (logged and dropped when the compaction is `failing` already)."""
    if not report.waves and not failing:
        return None  # nothing was queued (a failed wave may have queued part of its copies)
    with PhaseTimer(report.phases, "copy"):
        try:
            core.driver.synchronize()
        except CudaError as exc:
            if failing:
                _log.error("defrag: the synchronize after a failed compaction's copies failed too: %s", exc)
                return None
            exc.add_note("the compaction's copies were queued on the device, which reported this error while "
                         "running them; the pool's books and every tensor's address are as committed (on a "
                         "GPU this error is sticky: the CUDA context is lost)")
            return exc
    return None


def _page_budget(core: Core, automatic: bool) -> int:
    """How many pages no live block touches a compaction may put destinations on.

    They are backed by the pool's empty mapped pages (in place, or unmapped
    and remapped), so an explicit compaction never raises the number of
    mapped pages. A rescue may also use cached or creatable pages: the
    request it serves is about to need every free page anyway.
    """
    return core.backing.empty + (core.backing.space.store.available if automatic else 0)


def _convey(core: Core, mover: Mover, scope: Scope, engine: str, verify: bool, report: CompactionReport,
            automatic: bool, rounds: int = 4) -> None:
    """Pack blocks of a page or more end to end (`planner.plan_conveyor`), a wave per round, while it frees pages.

    The zone is bounded like the other destinations: empty mapped pages (and,
    for a rescue, cached or creatable ones), so mapped pages never grow. Each
    round's freed pages may form the next round's zone.
    """
    for _ in range(rounds):
        progressed = False
        for region in core.regions:
            budget = _page_budget(core, automatic)
            if budget < 1:
                return
            P = core.page_size
            if not any(b.size >= P for b in core.blocks(region)):
                continue  # nothing to convey: skip gripping every block of the region
            layout = _collect(core, mover, region, scope, large_only=True)
            try:
                if not layout.held:
                    continue
                plan = plan_conveyor(layout.offsets, layout.sizes, layout.movable, page_size=core.page_size,
                                     span=region.size, zone_ok=core.backing.untouched(region), max_pages=budget)
                if plan.empty:
                    continue
                _run_wave(core, mover, region, plan, 0, len(plan), layout, engine, verify, report)
                report.waves += 1
                progressed = True
            finally:
                layout.held.clear()
        if not progressed:
            return


def _hole_plan(core: Core, region, layout: "_Collected", size: int) -> ArrayPlan | None:
    """`defrag.planner.plan_hole_arrays` over this region's free ranges; for `size` of a page or more,
    `plan_window_arrays` (its window's unmapped pages are backed by cached or creatable pages and
    by the empty mapped pages of the other regions and of this one)."""
    free = core.free_ranges(region)
    free_off = np.fromiter((off - region.base for off, _ in free), dtype=np.int64, count=len(free))
    free_size = np.fromiter((sz for _, sz in free), dtype=np.int64, count=len(free))
    if size >= core.page_size:
        mapped = region.handles != 0
        here = int((mapped & core.backing.untouched(region)).sum())
        spare = core.backing.free_physical() - here
        return plan_window_arrays(layout.offsets, layout.sizes, layout.movable, free_off, free_size, size,
                                  page_size=core.page_size, span=region.size, mapped=mapped, spare_pages=spare)
    return plan_hole_arrays(layout.offsets, layout.sizes, layout.movable, free_off, free_size, size,
                            page_size=core.page_size, span=region.size)


def _map_hole(core: Core, region, hole: tuple[int, int]) -> None:
    """Map the unmapped pages of the window `hole` (region offset, length) that a window plan emptied,
    unmapping empty pages outside it first (so mapped pages never exceed the capacity); CompactionError
    (nothing mapped) when too few physical pages are free."""
    P = core.page_size
    pages = range(hole[0] // P, (hole[0] + hole[1] - 1) // P + 1)
    to_map = [p for p in pages if not region.handles[p]]
    if not to_map:
        return
    _make_physical_room(core, region, set(pages), len(to_map))
    with Transaction() as txn:
        core.backing.map(region, to_map, txn)


@dataclass
class _Collected:
    """One region's blocks as the planner takes them (arrays, in `blocks` order), and the face's grips."""

    blocks: list
    offsets: np.ndarray
    sizes: np.ndarray
    movable: np.ndarray
    held: dict  # block address -> the face's grip (movable blocks only; None until the wave when `lazy`)
    lazy: bool = False  # grips taken per wave, for the blocks it moves (`Mover.grippable`)


def _collect(core: Core, mover: Mover, region, scope: Scope, *, large_only: bool = False) -> _Collected:
    """The region's blocks for the planner, and the face's grip on each movable one.

    A block the face cannot grip now is passed to the planner as unmovable;
    with `large_only`, so is every block shorter than a page (not held).
    Where the face's grips only keep owners alive (`Mover.lets_go()`), its
    cheap verdict (`Mover.grippable`) decides instead and each wave grips the
    blocks it moves (`lazy`): most blocks of a region are never moved.
    """
    base, small, blocker = region.base, core.page_size if large_only else 0, scope.blocker
    # Plain lists and one call to the face: this runs for every block of the region before each plan.
    blocks = core.blocks(region)
    candidates = [i for i, block in enumerate(blocks) if block.size >= small and not blocker(block)]
    lazy = mover.lets_go()
    picked = [blocks[i] for i in candidates]
    grips = [None if ok else False for ok in mover.grippable(picked)] if lazy else mover.grip_all(picked)
    held, ok = {}, []
    for i, grip in zip(candidates, grips):
        if grip is not None and grip is not False:
            held[blocks[i].address] = grip
            ok.append(i)
        elif lazy and grip is None:  # grippable: held by the wave that moves it
            held[blocks[i].address] = None
            ok.append(i)
    movable = np.zeros(len(blocks), dtype=bool)
    movable[ok] = True
    offsets = np.fromiter((block.address for block in blocks), dtype=np.int64, count=len(blocks)) - base
    sizes = np.fromiter((block.size for block in blocks), dtype=np.int64, count=len(blocks))
    if core.backing.meshes():
        offsets, sizes, movable = _fix_meshed(core, region, blocks, offsets, sizes, movable, held)
    return _Collected(blocks, offsets, sizes, movable, held, lazy)


def _fix_meshed(core: Core, region, blocks: list, offsets: np.ndarray, sizes: np.ndarray, movable: np.ndarray,
                held: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Meshed pages in a layout: their blocks never move (a move's heap frees do not redirect twin pieces),
    and the bytes their own heap does not manage (a twin's page minus its pieces; on a primary, its
    twins' pieces) join as fixed entries with no block (None in `blocks`), since the planner takes
    unoccupied bytes as free. Returns the layout's (offsets, sizes, movable), `blocks` and `held`
    changed in place."""
    meshed = core.backing.mesh_ids[region.index] >= 0
    if not meshed.any():
        return offsets, sizes, movable
    P = core.page_size
    for i in np.flatnonzero(movable).tolist():
        first, last = int(offsets[i]) // P, (int(offsets[i]) + int(sizes[i]) - 1) // P
        if meshed[first:last + 1].any():
            movable[i] = False
            held.pop(blocks[i].address, None)
    extra = core.unmanaged_ranges(region)
    if not extra:
        return offsets, sizes, movable
    blocks.extend([None] * len(extra))
    return (np.concatenate((offsets, np.array([address - region.base for address, _ in extra], dtype=np.int64))),
            np.concatenate((sizes, np.array([size for _, size in extra], dtype=np.int64))),
            np.concatenate((movable, np.zeros(len(extra), dtype=bool))))


def _run_wave(core: Core, mover: Mover, region, plan: ArrayPlan, a: int, b: int, layout: _Collected, engine, verify,
              report) -> None:
    """Moves [a, b) of `plan` (one wave): prepare, copy, (verify), commit, release. All-or-nothing before the commit."""
    phases = report.phases
    core.flush_reuse()  # destinations may lie in ranges kept for reuse
    blocks, held = layout.blocks, layout.held
    # Plain ints from here on: one tolist per array instead of numpy arithmetic per step.
    olds = [blocks[i] for i in plan.index[a:b].tolist()]
    dsts = [region.base + d for d in plan.dst[a:b].tolist()]
    grips = list(map(held.pop, [old.address for old in olds]))
    if layout.lazy:  # the owners, held from here to the commit
        grips = mover.grip_all(olds)
        if None in grips:
            raise CompactionError(f"block at {olds[grips.index(None)].address:#x} changed during compaction "
                                  f"(its owner died); nothing was moved")
    dests = []  # where the owners do not move in place: (old Block, new Block, grip, the face's destination)
    with Transaction() as txn:
        # 1. prepare: map the destination pages. The copy needs no more: on a GPU it is queued on the
        # stream now and runs while the host does the rest; elsewhere it runs after it, on caches the
        # rest left warm. (Whole blocks, 512-byte multiples: 16-byte aligned for the kernel, and the
        # rounding stays inside each block.)
        with PhaseTimer(phases, "prepare"):
            dest_pages = _pages_under(plan.dst[a:b], plan.size[a:b], core.page_size)
            to_map = dest_pages[region.handles[dest_pages] == 0].tolist()
            _make_physical_room(core, region, dest_pages, len(to_map))
            core.backing.map(region, to_map, txn)
        moves = WaveMoves([(old.address, dst, old.size) for old, dst in zip(olds, dsts)],
                          (region.base, region.size, plan.src[a:b], plan.dst[a:b], plan.size[a:b]))
        overlap = core.kind == "cuda"
        if overlap:
            with PhaseTimer(phases, "copy"):
                _copy(core, mover, engine, moves)
            # Undo steps run newest first: the books' undo steps below run before this one, the
            # pages' after it, so nothing is unmapped under a running copy.
            txn.on_rollback(core.driver.synchronize)
        # 2. the books in one batch: the destinations taken; the old ranges given back at once when
        # the face lets go of them at the commit.
        with PhaseTimer(phases, "prepare"):
            lets_go = mover.lets_go()
            core.waves.begin_moves(region, olds, dsts, txn, vacate=lets_go)
        # 3. copy (queued: the compaction synchronizes once, after its last wave); verify.
        if not overlap:
            with PhaseTimer(phases, "copy"):
                _copy(core, mover, engine, moves)
        if verify:
            with PhaseTimer(phases, "verify"):
                _verify(core, mover, engine, moves)
        # 4. every owner checked before the first is rewritten: in place (the blocks keep their
        # identity), or through destination blocks.
        with PhaseTimer(phases, "swap"):
            failed = mover.move_in_place(olds, dsts, grips) if lets_go else None
            in_place, one_by_one = failed is not None, False
            if not in_place:
                failed, one_by_one = _prepare_commit(core, mover, region, olds, dsts, grips, dests, txn)
        if failed >= 0:
            raise CompactionError(f"block at {olds[failed].address:#x} changed during compaction; nothing was moved")
        txn.commit()

    # 5. commit: cannot fail (the face only exchanges fields).
    with PhaseTimer(phases, "swap"):
        if in_place:
            core.waves.move_to(olds, dsts)
        else:
            _commit_destinations(core, mover if one_by_one else None, dests)
        report.moved_tensors += len(olds)
        report.moved_bytes += sum(old.nbytes for old in olds)
        del grips
    # 6. release: the face lets go of the old ranges (for torch: the temporaries die); freed now.
    with PhaseTimer(phases, "release"):
        dests.clear()
        if lets_go and not in_place:
            core.waves.forget(olds)  # vacated before the copy; their queued releases find nothing to do
        core.drain()
        core.flush_reuse()  # later waves' destinations lie in what this one vacated


def _prepare_commit(core: Core, mover: Mover, region, olds, dsts, grips, dests: list,
                    txn: Transaction) -> tuple[int, bool]:
    """A wave whose owners cannot move in place: destination blocks recorded, the face's destinations
    made, every owner checked (by the face's batch, which then commits them all, or move by move).
    Fills `dests`. Returns (-1 when the commit may go ahead, else the index of a changed owner;
    whether the owners are still to be committed one by one)."""
    carved = core.waves.record_moves(region, olds, dsts, txn)
    txn.on_rollback(dests.clear)  # if the wave is abandoned the face's destinations go, and their blocks
    dests.extend(zip(olds, carved, grips, mover.destinations(carved)))
    failed = mover.commit_all(dests)
    if failed is not None:
        return failed, False
    check = mover.check
    for i, (old, new, grip, dest) in enumerate(dests):
        if not check(old, grip, dest):
            return i, True
    return -1, True


def _commit_destinations(core: Core, mover: Mover | None, dests: list) -> None:
    """The commit of `_prepare_commit`'s wave: each destination block takes its old block's place,
    and `mover` (None when its batch already did) commits each owner."""
    swap_in, commit = core.waves.swap_in, (mover.commit if mover is not None else None)
    for old, new, grip, dest in dests:
        swap_in(old, new)
        if commit is not None:
            commit(old, new, grip, dest)


def _pages_under(offsets: np.ndarray, sizes: np.ndarray, page_size: int) -> np.ndarray:
    """Every page index that a range [offsets[i], offsets[i] + sizes[i]) touches, sorted, once each."""
    first, last = offsets // page_size, (offsets + sizes - 1) // page_size
    if not first.size:
        return first
    span = last - first + 1
    if span.max() <= 2:
        pages = (first, last)  # the common case: a block touches one or two pages
    else:
        pages = (run_pages(first, span),)
    # A mask over the pages, not np.unique: no sort, and the wave's pages are few and close together.
    touched = np.zeros(int(last.max()) + 1, dtype=bool)
    for p in pages:
        touched[p] = True
    return np.flatnonzero(touched)


def _make_physical_room(core: Core, region, dest_pages, needed: int) -> None:
    """`Backing.make_room` for a wave's or a window's `needed` new pages; CompactionError (nothing
    unmapped, nothing moved) when the pool's free physical pages cannot back them."""
    try:
        core.backing.make_room(region, dest_pages, needed)
    except NoSpace as exc:
        raise CompactionError(f"the plan {exc}; nothing was moved") from None


def _copy(core: Core, mover: Mover, engine: str, moves: list[tuple[int, int, int]]) -> None:
    """Copy (src, dst, nbytes) triples; destinations never overlap sources within a wave."""
    copy_ranges(core, mover.stream(), engine, moves)


def _verify(core: Core, mover: Mover, engine: str, moves: list[tuple[int, int, int]]) -> None:
    """Compare checksums of every source and destination; CompactionError on mismatch.

    The checksum kernel runs where the copy kernel ran (GPU, or the simulator
    for engine="kernel" on the emulated device); host memory is summed with
    the identical numpy function otherwise. The memory-less device has no
    bytes to compare.
    """
    if core.kind == "memoryless":
        return
    core.driver.synchronize()  # the wave's copies were only queued
    if core.kind == "emulated" and engine != "kernel":
        from .kernels import host_checksum
        for src, dst, n in moves:
            a = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(src))
            b = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(dst))
            if host_checksum(a) != host_checksum(b):
                raise CompactionError(f"verification failed: {n} bytes copied from {src:#x} to {dst:#x} differ")
        return
    from .kernels import checksum, device_arena
    base, span, table = relative(moves)
    arena = device_arena(base, span)
    sums_src = checksum(arena, table[:, [0, 2]], stream=kernel_stream(core, mover.stream()))
    sums_dst = checksum(arena, table[:, [1, 2]], stream=kernel_stream(core, mover.stream()))
    bad = np.flatnonzero(sums_src != sums_dst)
    if bad.size:
        src, dst, n = moves[int(bad[0])]
        raise CompactionError(f"verification failed for {bad.size} move(s), first {n} bytes {src:#x} -> {dst:#x}")


def rescue(core: Core, mover: Mover, nbytes: int, tried: list[str], callbacks=(), ran: dict | None = None):
    """The ladder's rescue step (see `Core.allocate`): compact and retry when packing could cover the
    request, then mesh and retry (`_rescue_by_meshing`) before the ladder reports an OOM.

    Returns the placed Block, or None (with `tried` extended) when
    compaction is off, would not help, is rate-limited, or did not help.
    ``ran`` (a dict, or None): counts under "rescues" each call and under
    "meshing" each call that went on to meshing (moving did not place the
    block). A pool without compaction fails at the first rescue; one without
    meshing at the first that goes on to meshing: what a dry replay's
    probes use to answer for those pools too.
    """
    if ran is not None:
        ran["rescues"] = ran.get("rescues", 0) + 1
    block = _rescue_by_moving(core, mover, nbytes, tried, callbacks)
    if block is None and core.auto_compact:
        if core.auto_mesh:
            if ran is not None:
                ran["meshing"] = ran.get("meshing", 0) + 1
            block = _rescue_by_meshing(core, mover, nbytes, tried)
        else:
            tried.append("automatic meshing is off (auto_mesh=False)")
    return block


def _rescue_by_meshing(core: Core, mover: Mover, nbytes: int, tried: list[str]):
    """Share physical pages between pages whose live bytes are disjoint, as many as the request's pages
    need (at least one), and place again. Only from the ladder of an ordinary allocation, never from
    inside PyTorch's allocator callback (that ladder has no rescue): it copies and synchronizes."""
    need = -(-core.round(nbytes) // core.page_size)
    want = max(1, need - core.backing.free_physical())
    if core.driver.is_capturing(mover.stream()):
        tried.append("meshing skipped: a CUDA graph is being captured")
        return None
    core.break_stranded_units()  # a unit's pages never mesh: those its blocks hold in part become single pages
    report = CompactionReport(engine=default_engine(core.kind), automatic=True, page_size=core.page_size)
    _mesh(core, mover, core.scope(None), report.engine, True, report, free_at_least=want)
    if not report.mesh_freed_pages:
        tried.append("meshing found no pages whose live bytes are disjoint")
        return None
    tried.append(f"meshing (freed {report.mesh_freed_pages} physical pages)")
    return _place_again(core, nbytes, tried, "meshing")


def _place_again(core: Core, nbytes: int, tried: list[str], after: str):
    """The ladder's placement after a rescue step: the Block, or None with the reason added to `tried`."""
    try:
        return core.place(nbytes)
    except NoSpace as exc:
        tried.append(f"placement after {after} ({exc})")
        return None


def _rescue_by_moving(core: Core, mover: Mover, nbytes: int, tried: list[str], callbacks=()):
    """`rescue`'s compaction steps."""
    if not core.auto_compact:
        tried.append("automatic compaction is off (auto_compact=False)")
        return None
    size = core.round(nbytes)
    scope = core.scope(None)  # the allocating thread's blocks, parked threads', or all when it is the only one
    if size < core.page_size:
        # A sub-page request needs a hole, not a page. Movable blocks can also fill
        # holes in pages that blocks which cannot move keep (other threads' blocks
        # are spread over every page), so only the live bytes bound what packing frees.
        slack = core.capacity - core.allocated_bytes
        if size > slack:
            tried.append(f"compaction cannot help: even packed, only {format_bytes(max(slack, 0))} would be free")
            return None
    else:
        pinned_pages, movable = packing_floor(core, scope, mover.can_rewrite)
        need = -(-size // core.page_size)
        could_free = core.capacity_pages - pinned_pages - -(-movable // core.page_size)
        if need > could_free:
            tried.append(f"compaction cannot help: even packed, only {max(could_free, 0)} of the {need} "
                         f"pages needed would be free")
            return None
    now = time.monotonic()
    since = now - core.last_auto_compact
    if since < core.min_compact_interval:
        tried.append(f"automatic compaction skipped: the last one was {since:.3f} s ago "
                     f"(min_compact_interval={core.min_compact_interval} s)")
        return None
    core.last_auto_compact = now
    try:
        report = compact_core(core, mover, automatic=True, release=False, scope=scope, callbacks=callbacks)
    except Exception as exc:  # noqa: BLE001 - rolled back like a CompactionError: the OOM names it
        if not isinstance(exc, (CompactionError, CudaError)):
            _log.error("defrag: automatic compaction failed (a defrag bug: please report it)\n%s",
                       traceback.format_exc())  # text, not exc_info: a kept log record holds no frames
            exc = f"{type(exc).__name__}: {exc}; a defrag bug"
        tried.append(f"automatic compaction did not run or was rolled back ({exc})")
        return None
    tried.append(f"automatic compaction (moved {report.moved_tensors} tensors, released {report.released_pages} pages)")
    block = _place_again(core, nbytes, tried, "compaction")
    if block is not None:
        return block
    # Every page is needed, but the free bytes are split: merge two holes (a sub-page request), or
    # evacuate a window that shares a page with a block that stays (a request of a page or more).
    large = size >= core.page_size
    what = ("window-evacuating", "evacuating a window") if large else ("hole-merging", "merging holes")
    core.flush_reuse()
    if all(_hole_plan(core, region, _collect(core, mover, region, scope), size) is None
           for region in core.regions):
        tried.append("no window can be evacuated into free space with its pages backed" if large
                     else "no single move merges free ranges into a large enough hole")
        return None
    try:
        compact_core(core, mover, automatic=True, release=False, hole_for=size, scope=scope, callbacks=callbacks)
    except Exception as exc:  # noqa: BLE001 - as above
        if not isinstance(exc, (CompactionError, CudaError)):
            _log.error("defrag: automatic compaction failed (a defrag bug: please report it)\n%s",
                       traceback.format_exc())  # text, not exc_info: a kept log record holds no frames
            exc = f"{type(exc).__name__}: {exc}; a defrag bug"
        tried.append(f"{what[0]} compaction did not run or was rolled back ({exc})")
        return None
    return _place_again(core, nbytes, tried, what[1])


# ---------------------------------------------------------------------- moves the caller places
@collector_paused()
def move_blocks(core: Core, mover: Mover, moves, *, engine: str | None = None, verify: bool = False,
                scope: Scope | None = None) -> CompactionReport:
    """Move each `(block, destination address)` of `moves` in one wave: the compaction protocol
    (prepare, copy, verify, commit, release) for a placement the caller chose, not the planner.

    `defrag.residency` packs the tensors it offloads into pages of their own
    with it. Every block must lie in one region, and every destination in
    that region's pages that no block touches, not overlapping another
    destination (the caller's plan; unmapped pages there are mapped, stitched
    from empty pages when the store is short). Every block must be movable
    for `scope` (default: a compaction from the calling thread), or
    CompactionError is raised before anything changes. All or nothing, like
    one wave of `compact_core`; the caller holds the core's gate. Counts in no
    compaction counter: the caller reports what it moved.
    """
    moves = list(moves)
    engine = engine or default_engine(core.kind)
    report = CompactionReport(engine=engine, verified=verify, page_size=core.page_size)
    if not moves:
        return report
    if scope is None:
        scope = core.scope(None)
    if core.driver.is_capturing(mover.stream()):
        raise CompactionError("cannot move blocks while a CUDA graph is being captured: "
                              "captured kernels hold raw pointers that a move would invalidate")
    region = moves[0][0].region
    held = {}
    for block, _ in moves:
        if block.region is not region:
            raise ValueError("move_blocks: every block must lie in one region")
        why = scope.blocker(block, mover.can_rewrite)
        grip = mover.grip(block) if not why else None
        if grip is None:
            raise CompactionError(f"block at {block.address:#x} ({format_bytes(block.nbytes)}) cannot move: "
                                  f"{why or 'its owner cannot be held now'}; nothing was moved")
        held[block.address] = grip
    t0 = time.perf_counter()
    core.settle()
    core.driver.synchronize()  # queued kernels may still use the blocks about to move
    blocks = [b for b, _ in moves]
    src = np.fromiter((b.address - region.base for b in blocks), dtype=np.int64, count=len(blocks))
    dst = np.fromiter((d - region.base for _, d in moves), dtype=np.int64, count=len(blocks))
    size = np.fromiter((b.size for b in blocks), dtype=np.int64, count=len(blocks))
    order = np.argsort(dst, kind="stable")
    plan = ArrayPlan(index=order, src=src[order], dst=dst[order], size=size[order],
                     wave=np.ones(len(blocks), dtype=np.int64), page_size=core.page_size,
                     pages_before=0, pages_after=0, moved_bytes=int(size.sum()))
    layout = _Collected(blocks, src, size, np.ones(len(blocks), dtype=bool), held)
    done = False
    try:
        _run_wave(core, mover, region, plan, 0, len(blocks), layout, engine, verify, report)
        report.waves = 1
        done = True
    finally:
        held.clear()  # strong references to the owners end here, error or not
        sync_error = _wait_for_copies(core, report, failing=not done)
        core.drain()
        report.seconds = time.perf_counter() - t0
    if sync_error is not None:
        raise sync_error
    return report
