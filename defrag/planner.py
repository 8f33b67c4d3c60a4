"""Compaction planner: one region's live layout in, waves of block moves out.

Pure: integers and numpy only, no torch, no driver. The compactor executes a
:class:`Plan`; the pool calls :func:`plan_compaction` once per contiguous
virtual region.

Model
-----
The region spans ``[0, span)``; ``span`` is a multiple of ``page_size``. Live
blocks are ``alignment``-aligned (offset and size), do not overlap, and a page
is *touched* (needs physical backing) iff some live block intersects it. A
block is *fixed* if it is pinned (``movable=False``) or at least a page long.
Fixed blocks never move: pinned ones by contract, large ones because a block
of a page or more that starts on a page boundary (the pool places them so)
already touches the fewest pages it can, and large blocks can never share a
page with each other, so moving one never lowers the page count, only costs
bytes. The pages touched by fixed blocks are the *forced* pages ``F``.

Lower bound: any final layout touches ``F`` and at least ``ceil(live/page)``
pages, so ``pages_after >= max(|F|, ceil(live / page_size))``
(:func:`lower_bound_pages`).

Algorithm (evacuation, as in Mesh and G1)
-----------------------------------------
1. Target ``T``: the lower bound. If the layout already touches ``T`` pages,
   the plan is empty.
2. Keep ``F`` and the ``T - |F|`` densest other touched pages (live bytes;
   ties by address). Blocks whose pages are all kept stay; every other
   movable block is a *mover* (blocks straddling a kept and an evacuated page
   included).
3. Wave 1: movers, largest first, best fit into kept-page holes that are free
   now. A hole may span adjacent kept pages, so small blocks may straddle.
4. Drop: if movers are left over, stop keeping the kept pages whose holes
   stayed emptiest. Their contents, packed into contiguous *zone* pages
   instead, waste (almost) nothing, so dropping the ``d`` emptiest leaves
   about ``kept - d + ceil((left over + their live bytes) / page)`` pages;
   ``d`` is the fewest drops that minimise this, capped so that the zone
   pages needed can be free soon. Blocks of dropped pages, and blocks placed
   into them, go back to the left-overs; steps 3-4 repeat (4 times at most).
5. Rounds after wave 1 (6 at most): left-over blocks go, best fit, into
   kept-page space free by then (remnants; what earlier movers vacated) or
   else into zone pages, each of which costs a page: unmapped pages (longest
   runs first), then evacuated pages that earlier rounds emptied. A block
   that fits nowhere stays where it is.
6. Waves: each move runs one wave after the latest move whose old place its
   destination covers, wave 1 if none (acyclic: a destination only covers
   space vacated in an earlier round). A move into an unmapped page or a
   hole that was free all along therefore runs in wave 1.
7. Retries while the result misses ``T``: "swap" keeps the pages of blocks
   that had to go to zone pages and stops keeping as many of the emptiest
   kept pages; "drop" stops keeping enough of the emptiest kept pages to
   cover the excess. Up to 6 attempts, the best by (pages, bytes moved,
   waves) wins. Retries stop once the attempts have handled 60k movers, so a
   large region gets one attempt. A plan that frees no page becomes empty.

Complexity: sorting and interval arithmetic are numpy, ``O(n log n)`` for
``n`` blocks. Best fit is a Python loop, ``O(1)`` per placed block: holes are
bucketed by length (in units of ``alignment``, one bucket for holes of a page
or more) and the non-empty buckets form a bitmask, so the best bucket is a
shift and a lowest-set-bit; blocks longer than every hole are skipped with a
bisect. Measured on the synthetic layout of ``benchmarks/bench_planner.py``
(every page about half full, 2 MiB pages, one shared 2-core machine): ~0.25 s
for 10^5 blocks, ~3 s for 10^6.

What it does not guarantee
--------------------------
- Optimality. Placing blocks into holes is bin packing; best fit decreasing
  and the retries are heuristics. The lower bound is reached when the holes
  of kept pages can be filled to within ``T * page - live`` bytes: always in
  the tests' families (equal blocks of a size dividing the page, with whole
  large pages; the "k equal blocks per page, most freed" pattern), often not
  with coarse mixed sizes (blocks of a quarter page or more), where it may end
  one or a few pages above. With pinned blocks the bound may be unreachable.
- Fewest bytes moved among page-optimal plans: keeping the densest pages is a
  greedy proxy.
- It never moves a block only to merge holes inside kept pages, never moves
  fixed blocks (a large block that does not start on a page boundary keeps
  its extra page), and uses at most 7 waves.
- Peak memory: destinations in unmapped pages need those pages mapped while
  the plan runs, before the evacuated ones are released;
  ``max_new_pages=0`` forbids them (then the plan may free fewer pages).
"""
from __future__ import annotations

import gc
from bisect import bisect_left
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Hashable, Iterable, Sequence

import numpy as np

__all__ = [
    "LiveBlock",
    "Move",
    "Plan",
    "PlanError",
    "lower_bound_pages",
    "plan_compaction",
    "plan_hole",
    "touched_pages",
    "validate_plan",
]


class PlanError(ValueError):
    """Bad planner input (overlap, misalignment, out of span, duplicate key) or an unsafe plan."""


@dataclass(frozen=True)
class LiveBlock:
    """One live block of the region: ``[offset, offset + size)``."""

    key: Hashable
    offset: int
    size: int
    movable: bool  # False: pinned, or not provably rewritable; never moves


@dataclass(frozen=True)
class Move:
    """Copy ``size`` bytes of block ``key`` from ``src`` to ``dst`` (region offsets)."""

    key: Hashable
    src: int
    dst: int
    size: int


@dataclass(frozen=True)
class Plan:
    """Waves of moves; each wave is one kernel launch, waves run in order.

    Within a wave no destination overlaps any source or other destination, so
    a wave may be executed as "read all sources, then write" or as in-order
    memmoves with the same result.
    """

    waves: tuple[tuple[Move, ...], ...]
    page_size: int
    pages_before: int
    pages_after: int
    moved_bytes: int
    #: ``max(forced pages, ceil(live / page))`` as computed by the planner;
    #: ``None`` for a plan built by hand.
    pages_lower_bound: int | None = None

    @property
    def moves(self) -> tuple[Move, ...]:
        """All moves, in wave order."""
        return tuple(m for wave in self.waves for m in wave)

    @property
    def empty(self) -> bool:
        """True when the plan moves nothing."""
        return not any(self.waves)

    @property
    def pages_freed(self) -> int:
        """Pages the region stops touching once the plan has run."""
        return self.pages_before - self.pages_after


# --------------------------------------------------------------------------
# Helpers on (offset, size) layouts
# --------------------------------------------------------------------------


def _page_union_count(first: np.ndarray, last: np.ndarray) -> int:
    """Number of distinct pages in the union of inclusive ranges [first, last]."""
    if first.size == 0:
        return 0
    order = np.argsort(first, kind="stable")
    f = first[order]
    l_ = np.maximum.accumulate(last[order])
    # A range starts a new run unless it begins at or before the previous max end.
    prev = np.concatenate(([f[0] - 2], l_[:-1]))
    covered_before = np.maximum(prev, f - 1)
    # Count pages each range adds beyond what earlier ranges covered.
    added = np.maximum(0, l_ - covered_before)
    return int(added.sum())


def touched_pages(layout: Iterable[tuple[int, int]], page_size: int) -> int:
    """Number of distinct pages touched by ``(offset, size)`` intervals.

    Zero-size intervals touch nothing. Intervals may overlap.
    """
    if page_size <= 0:
        raise PlanError(f"page_size must be positive, got {page_size}")
    pairs = [(int(o), int(s)) for o, s in layout if int(s) > 0]
    if not pairs:
        return 0
    arr = np.array(pairs, dtype=np.int64)
    first = arr[:, 0] // page_size
    last = (arr[:, 0] + arr[:, 1] - 1) // page_size
    return _page_union_count(first, last)


# --------------------------------------------------------------------------
# Input checking
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Layout:
    """Blocks as arrays sorted by offset (validated)."""

    keys: list
    off: np.ndarray
    size: np.ndarray
    movable: np.ndarray


def _check_geometry(page_size: int, span: int, alignment: int) -> None:
    if alignment <= 0:
        raise PlanError(f"alignment must be positive, got {alignment}")
    if page_size <= 0 or page_size % alignment:
        raise PlanError(f"page_size {page_size} must be a positive multiple of alignment {alignment}")
    if span < 0 or span % page_size:
        raise PlanError(f"span {span} must be a non-negative multiple of page_size {page_size}")


def _layout(blocks: Sequence[LiveBlock], *, span: int, alignment: int) -> _Layout:
    blocks = list(blocks)
    n = len(blocks)
    keys = [b.key for b in blocks]
    if len(set(keys)) != n:
        seen: set = set()
        dup = next(k for k in keys if k in seen or seen.add(k))
        raise PlanError(f"duplicate block key {dup!r}")
    off = np.fromiter((b.offset for b in blocks), dtype=np.int64, count=n)
    size = np.fromiter((b.size for b in blocks), dtype=np.int64, count=n)
    movable = np.fromiter((bool(b.movable) for b in blocks), dtype=bool, count=n)
    bad = (size <= 0) | (off < 0) | (off % alignment != 0) | (size % alignment != 0) | (off + size > span)
    if bad.any():
        b = blocks[int(np.flatnonzero(bad)[0])]
        raise PlanError(
            f"block {b.key!r} [{b.offset}, +{b.size}) must have positive size, be "
            f"{alignment}-aligned and lie inside [0, {span})"
        )
    order = np.argsort(off, kind="stable")
    off, size, movable = off[order], size[order], movable[order]
    if n > 1:
        clash = np.flatnonzero(off[1:] < off[:-1] + size[:-1])
        if clash.size:
            i = int(clash[0])
            a, b = blocks[int(order[i])], blocks[int(order[i + 1])]
            raise PlanError(
                f"blocks {a.key!r} [{a.offset}, +{a.size}) and {b.key!r} [{b.offset}, +{b.size}) overlap"
            )
    return _Layout([keys[i] for i in order.tolist()], off, size, movable)


def lower_bound_pages(blocks: Sequence[LiveBlock], *, page_size: int) -> int:
    """``max(|F|, ceil(live / page_size))``: no plan can touch fewer pages.

    ``F`` is the set of pages touched by fixed blocks (pinned, or a page or
    longer). Not always reachable: holes can be too fragmented to pack.
    """
    if page_size <= 0:
        raise PlanError(f"page_size must be positive, got {page_size}")
    live = sum(int(b.size) for b in blocks)
    fixed = [(b.offset, b.size) for b in blocks if not b.movable or b.size >= page_size]
    return max(touched_pages(fixed, page_size), -(-live // page_size))


# --------------------------------------------------------------------------
# Interval arithmetic (sorted, disjoint, half-open intervals as start/end arrays)
# --------------------------------------------------------------------------


def _gaps(starts: np.ndarray, ends: np.ndarray, span: int) -> tuple[np.ndarray, np.ndarray]:
    """Complement of sorted disjoint intervals within [0, span)."""
    gs = np.concatenate(([0], ends))
    ge = np.concatenate((starts, [span]))
    keep = ge > gs
    return gs[keep], ge[keep]


def _intersect(
    a_s: np.ndarray, a_e: np.ndarray, b_s: np.ndarray, b_e: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Intersection of two lists of sorted disjoint intervals."""
    if a_s.size == 0 or b_s.size == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    pos = np.concatenate((a_s, b_s, a_e, b_e))
    delta = np.concatenate(
        (np.ones(a_s.size + b_s.size, np.int8), -np.ones(a_e.size + b_e.size, np.int8))
    )
    order = np.lexsort((delta, pos))  # at equal positions, ends before starts
    pos, delta = pos[order], delta[order]
    depth = np.cumsum(delta, dtype=np.int64)
    i = np.flatnonzero(depth[:-1] == 2)
    s, e = pos[i], pos[i + 1]
    keep = e > s
    return s[keep], e[keep]


def _page_runs(pages: np.ndarray, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Byte intervals covered by a sorted array of distinct page ids."""
    if pages.size == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    brk = np.flatnonzero(np.diff(pages) != 1)
    first = np.concatenate(([0], brk + 1))
    last = np.concatenate((brk, [pages.size - 1]))
    return pages[first] * page_size, (pages[last] + 1) * page_size


def _expand_pages(first: np.ndarray, last: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every (page, owner index) pair for inclusive page ranges [first[i], last[i]]."""
    cnt = last - first + 1
    owner = np.repeat(np.arange(first.size), cnt)
    base = np.repeat(np.cumsum(cnt) - cnt, cnt)
    pages = first[owner] + (np.arange(owner.size) - base)
    return pages, owner


# --------------------------------------------------------------------------
# Best-fit placement
# --------------------------------------------------------------------------


def _best_fit(
    hole_s: np.ndarray, hole_e: np.ndarray, sizes: np.ndarray, unit: int, cap: int
) -> list[int]:
    """Place ``sizes`` (non-increasing) into holes, best fit; -1 = no room.

    Works in units of ``unit`` bytes. Holes of ``cap`` units or more share one
    bucket: any of them fits any item shorter than ``cap``, and items are
    carved from the front of the first such hole (in the order given) until
    it shrinks below ``cap``, so long holes fill contiguously. Items of
    ``cap`` units or more are never placed.
    """
    hs = hole_s // unit
    hl = (hole_e - hole_s) // unit
    is_big = hl >= cap
    big = [[s, ln] for s, ln in zip(hs[is_big].tolist(), hl[is_big].tolist())]
    big.reverse()  # carve from the end of the list: first given, first used
    buckets: list[list[int]] = [[] for _ in range(cap)]
    mask = 1 << cap if big else 0
    small = ~is_big & (hl > 0)
    if small.any():
        o = np.argsort(hl[small], kind="stable")
        lens, starts = hl[small][o], hs[small][o]
        uniq, first = np.unique(lens, return_index=True)
        bounds = first.tolist() + [lens.size]
        for j, ln in enumerate(uniq.tolist()):
            buckets[ln] = starts[bounds[j]:bounds[j + 1]].tolist()
            mask |= 1 << ln
    units_arr = sizes // unit
    units = units_arr.tolist()
    neg = (-units_arr).tolist()  # ascending, for bisect
    out = [-1] * len(units)
    i, n = 0, len(units)
    while i < n:
        g = units[i]
        m = mask >> g
        if not m or g >= cap:
            # Nothing fits; neither does any item longer than the longest hole.
            if not mask:
                break
            longest = mask.bit_length() - 1
            i = max(i + 1, bisect_left(neg, -longest, i))
            continue
        b = g + (m & -m).bit_length() - 1
        if b < cap:
            lst = buckets[b]
            start = lst.pop()
            if not lst:
                mask ^= 1 << b
            r = b - g
            if r:
                buckets[r].append(start + g)
                mask |= 1 << r
        else:
            h = big[-1]
            start = h[0]
            h[0] += g
            h[1] -= g
            if h[1] < cap:
                big.pop()
                if not big:
                    mask ^= 1 << cap
                if h[1]:
                    buckets[h[1]].append(h[0])
                    mask |= 1 << h[1]
        out[i] = start * unit
        i += 1
    return out


def _runs_first(pages: np.ndarray) -> np.ndarray:
    """Sorted distinct page ids reordered: longest contiguous runs first."""
    if pages.size == 0:
        return pages
    brk = np.flatnonzero(np.diff(pages) != 1) + 1
    starts = np.concatenate(([0], brk))
    lens = np.diff(np.concatenate((starts, [pages.size])))
    order = np.lexsort((starts, -lens))
    return np.concatenate([pages[starts[i]:starts[i] + lens[i]] for i in order.tolist()])


# --------------------------------------------------------------------------
# Planning
# --------------------------------------------------------------------------

#: Placement rounds per attempt after wave 1 (each may add a wave).
_MAX_ROUNDS = 6
#: Attempts with different kept sets; retries only while the movers placed
#: by all attempts together stay under _RETRY_MOVERS, so that large regions
#: get one attempt and planning time stays linear-ish in the block count.
_MAX_ATTEMPTS = 6
_RETRY_MOVERS = 60_000
#: Drop steps per attempt.
_MAX_DROPS = 3


@dataclass
class _Result:
    kept: np.ndarray  # kept mask over the touched pages
    mover_idx: np.ndarray  # sorted-layout indices of blocks that move
    dst: np.ndarray  # their destinations
    rounds: int  # placement rounds used (an upper bound on the waves)
    pages_after: int
    moved_bytes: int
    waste: np.ndarray  # per touched page: free bytes if kept and touched after, else 0
    movers: int  # blocks considered for moving (work done)

    @property
    def score(self) -> tuple[int, int, int]:
        return (self.pages_after, self.moved_bytes, self.rounds)


class _Planner:
    """Per-region state shared by the attempts of one plan_compaction call."""

    def __init__(self, lay: _Layout, page_size: int, span: int, alignment: int, max_new_pages: int | None):
        self.lay, self.P, self.span, self.A = lay, page_size, span, alignment
        P = page_size
        off, size = lay.off, lay.size
        self.first = off // P
        self.last = (off + size - 1) // P
        self.fixed = ~lay.movable | (size >= P)
        # Touched pages, live bytes on each, and which are forced.
        pages, owner = _expand_pages(self.first, self.last)
        lo = np.maximum(off[owner], pages * P)
        hi = np.minimum(off[owner] + size[owner], (pages + 1) * P)
        self.touched, inv = np.unique(pages, return_inverse=True)
        live_per_page = np.bincount(inv, weights=hi - lo, minlength=self.touched.size)
        self.forced = np.zeros(self.touched.size, bool)
        self.forced[inv[self.fixed[owner]]] = True
        # Each block's first/last page as an index into `touched`.
        self.first_pos = np.searchsorted(self.touched, self.first)
        self.last_pos = np.searchsorted(self.touched, self.last)
        self.n_forced = int(self.forced.sum())
        self.pages_before = int(self.touched.size)
        self.lower_bound = max(self.n_forced, -(-int(size.sum()) // P))
        # Non-forced touched pages, densest first (ties: lower address first).
        cand = np.flatnonzero(~self.forced)
        self.by_density = cand[np.lexsort((cand, -live_per_page[cand]))]
        # Pages nothing touches (unmapped, free now), longest runs first; one
        # per block is the most that can be of use.
        t_s, t_e = _page_runs(self.touched, P)
        free_s, free_e = _gaps(t_s, t_e, span)
        limit = off.size if max_new_pages is None else min(off.size, max_new_pages)
        fresh: list[int] = []
        for a, b in sorted(zip((free_s // P).tolist(), (free_e // P).tolist()), key=lambda r: r[0] - r[1]):
            if len(fresh) >= limit:
                break
            fresh.extend(range(a, min(b, a + limit - len(fresh))))
        self.fresh = np.array(fresh, np.int64)

    def keep_densest(self, k: int) -> np.ndarray:
        kept = self.forced.copy()
        kept[self.by_density[:k]] = True
        return kept

    def drop(self, r: _Result, target: int) -> np.ndarray | None:
        """Retry: also stop keeping the kept pages that ended up emptiest."""
        droppable = np.flatnonzero(r.kept & ~self.forced & (r.waste > 0))
        if not droppable.size:
            return None
        droppable = droppable[np.argsort(-r.waste[droppable], kind="stable")]
        excess = (r.pages_after - target) * self.P
        n_drop = int(np.searchsorted(np.cumsum(r.waste[droppable]), excess)) + 1
        kept = r.kept.copy()
        kept[droppable[:n_drop]] = False
        return kept

    def swap(self, r: _Result, target: int) -> np.ndarray | None:
        """Retry: keep the pages of blocks that had to go to zone pages (no
        kept hole fit them) and stop keeping as many of the emptiest kept pages."""
        P, size = self.P, self.lay.size
        kept_pages = self.touched[r.kept]
        d, d_end = r.dst, r.dst + size[r.mover_idx]
        in_kept = np.isin(d // P, kept_pages) & np.isin((d_end - 1) // P, kept_pages)
        zoned = r.mover_idx[~in_kept]
        if not zoned.size:
            return None
        add = np.zeros(self.touched.size, bool)
        add[self.first_pos[zoned]] = True
        add[self.last_pos[zoned]] = True
        add &= ~r.kept
        removable = np.flatnonzero(r.kept & ~self.forced & ~add)
        removable = removable[np.argsort(-r.waste[removable], kind="stable")]
        kept = r.kept | add
        kept[removable[: int(add.sum())]] = False
        return kept

    def _movers(self, kept: np.ndarray) -> np.ndarray:
        return ~self.fixed & ~(kept[self.first_pos] & kept[self.last_pos])

    def _busy(self, idx: np.ndarray) -> np.ndarray:
        """Mask over touched pages: touched by the blocks ``idx`` at their source."""
        busy = np.zeros(self.touched.size, bool)
        busy[self.first_pos[idx]] = True
        busy[self.last_pos[idx]] = True
        return busy

    def attempt(self, kept: np.ndarray) -> _Result:
        """Evacuate the pages not in ``kept`` (steps 3-6 of the module docstring)."""
        P, span = self.P, self.span
        off, size = self.lay.off, self.lay.size
        n = off.size
        kept = kept.copy()
        mover = self._movers(kept)
        dst = np.full(n, -1, np.int64)
        waiting = np.ones(n, bool)  # still at its source
        pending = np.flatnonzero(mover)
        pending = pending[np.lexsort((pending, -size[pending]))]  # largest first
        movers = pending.size

        # Steps 3-4, up to _MAX_DROPS + 1 times: best-fit pending blocks into
        # kept-page holes that are free now (wave 1), then drop the kept pages
        # whose holes stayed emptiest: their contents, packed into contiguous
        # zone pages instead, waste (almost) nothing. Dropping a page turns the
        # blocks placed into it and those straddling into it into pending
        # blocks, which is why this repeats.
        for _ in range(_MAX_DROPS + 1):
            occupied = self._occupancy(np.ones(n, bool), dst, also=np.flatnonzero(~waiting))
            holes = _intersect(*_page_runs(self.touched[kept], P), *_gaps(*occupied, span))
            pending = self._place(pending, holes, dst, waiting)
            if not pending.size:
                break
            before = kept.sum()
            pending = self._drop(kept, mover, dst, waiting, pending)
            if kept.sum() == before:
                break
            mover = self._movers(kept)
            movers += pending.size

        # Step 5: rounds after wave 1. Each places what is pending into
        # kept-page space free by then (remnants, and what wave-1 movers left)
        # and, failing that, into zone pages: unmapped pages first, then
        # evacuated pages that earlier rounds emptied. Step 6 later gives each
        # move the earliest wave its destination allows, so a move into an
        # unmapped page still runs in wave 1.
        zone = np.empty(0, np.int64)
        fresh = self.fresh
        rounds = 1
        for r in range(2, _MAX_ROUNDS + 2):
            if not pending.size:
                break
            free = _gaps(*self._occupancy(waiting, dst), span)
            vacated = self.touched[~kept & ~self._busy(np.flatnonzero(waiting))]
            candidates = np.concatenate((fresh, _runs_first(vacated[~np.isin(vacated, zone)])))
            new = candidates[: -(-int(size[pending].sum()) // P)]
            fresh = fresh[~np.isin(fresh, new)]
            zone = np.concatenate((zone, new))
            h_s, h_e = _intersect(*_page_runs(np.union1d(self.touched[kept], zone), P), *free)
            # Space in pages already counted first, newly opened pages last.
            is_new = np.isin(h_s // P, new) & np.isin((h_e - 1) // P, new)
            o = np.lexsort((h_s, is_new))
            before = pending.size
            pending = self._place(pending, (h_s[o], h_e[o]), dst, waiting)
            if pending.size < before:
                rounds = r
            elif not new.size:
                break  # no progress and nothing new to open: give up
        # Step 6 (waves) is done for the chosen attempt only; what is still
        # pending stays where it is.
        moved = np.flatnonzero(mover & (dst >= 0))
        fin = off.copy()
        fin[moved] = dst[moved]
        pages, used = self._page_bytes(fin, np.arange(n))
        waste = np.zeros(self.touched.size)
        at = np.minimum(np.searchsorted(self.touched, pages), self.touched.size - 1)
        hit = self.touched[at] == pages
        waste[at[hit]] = P - used[hit]
        waste[~kept] = 0
        return _Result(kept, moved, dst[moved], rounds, int(pages.size), int(size[moved].sum()), waste, movers)

    def _drop(self, kept, mover, dst, waiting, pending) -> np.ndarray:
        """Step 4; updates ``kept``, ``dst`` and ``waiting`` in place, returns the new pending."""
        P, off, size = self.P, self.lay.off, self.lay.size
        pages, used = self._page_bytes(np.where(waiting, off, dst), np.flatnonzero(~waiting | ~mover))
        waste = np.zeros(self.touched.size)
        waste[np.searchsorted(self.touched, pages)] = P - used
        cand = np.flatnonzero(kept & ~self.forced & (waste > 0))
        cand = cand[np.lexsort((cand, -waste[cand]))]
        left = int(size[pending].sum()) - np.concatenate(([0], np.cumsum(waste[cand])))
        extra = -(-left // P)  # pages needed beyond the kept ones (may be < 0)
        # Never plan more zone pages than can be free soon: unmapped pages, and
        # evacuated pages that no pending block touches (empty after wave 1).
        # Dropping the first d candidates sends the blocks placed into them
        # back to pending, so their source pages stop counting: a page counts
        # for d drops iff it is evacuated, idle, and no block from it went to
        # one of the first d candidates.
        rank = np.full(self.touched.size, cand.size, np.int64)
        rank[cand] = np.arange(cand.size)
        placed = np.flatnonzero(mover & ~waiting)
        dp = dst[placed]
        r_f = np.minimum(
            rank[np.searchsorted(self.touched, dp // P)],
            rank[np.searchsorted(self.touched, (dp + size[placed] - 1) // P)],
        )
        first_drop = np.full(self.touched.size, cand.size, np.int64)
        np.minimum.at(first_drop, self.first_pos[placed], r_f)
        np.minimum.at(first_drop, self.last_pos[placed], r_f)
        idle = ~kept & ~self._busy(pending)
        lost = np.bincount(first_drop[idle], minlength=cand.size + 1)  # pages lost at each d
        supply = self.fresh.size + int(idle.sum()) - np.concatenate(([0], np.cumsum(lost)[:-1]))
        feasible = extra + np.arange(left.size) <= supply
        n_ok = max(1, int(np.argmin(feasible)) if not feasible.all() else feasible.size)
        d = int(np.argmin(extra[:n_ok]))  # fewest drops that reach the fewest pages
        if not d:
            return pending
        dropped = self.touched[cand[:d]]
        kept[cand[:d]] = False
        # Blocks placed into dropped pages go back to pending; blocks that
        # straddled into a dropped page become movers.
        placed = np.flatnonzero(mover & ~waiting)
        dp = dst[placed]
        undo = placed[np.isin(dp // P, dropped) | np.isin((dp + size[placed] - 1) // P, dropped)]
        dst[undo] = -1
        waiting[undo] = True
        pending = np.concatenate((pending, undo, np.flatnonzero(self._movers(kept) & ~mover)))
        return pending[np.lexsort((pending, -size[pending]))]

    def _page_bytes(self, pos: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Distinct pages touched by blocks ``idx`` placed at ``pos[idx]``, and live bytes on each."""
        P, size = self.P, self.lay.size
        o, sz = pos[idx], size[idx]
        pages, owner = _expand_pages(o // P, (o + sz - 1) // P)
        lo = np.maximum(o[owner], pages * P)
        hi = np.minimum(o[owner] + sz[owner], (pages + 1) * P)
        uniq, inv = np.unique(pages, return_inverse=True)
        return uniq, np.bincount(inv, weights=hi - lo, minlength=uniq.size)

    def _place(self, pending: np.ndarray, holes, dst: np.ndarray, waiting: np.ndarray) -> np.ndarray:
        """Best-fit ``pending`` (largest first) into ``holes``; returns what did not fit."""
        size = self.lay.size
        if not holes[0].size:
            return pending
        placed = np.array(_best_fit(*holes, size[pending], self.A, self.P // self.A), np.int64)
        ok = placed >= 0
        dst[pending[ok]] = placed[ok]
        waiting[pending[ok]] = False
        return pending[~ok]

    def _occupancy(
        self, waiting: np.ndarray, dst: np.ndarray, also: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Sorted intervals occupied by blocks at their source (``waiting``) or at their dst.

        ``also``: the blocks whose dst counts (default: those not waiting).
        """
        off, size = self.lay.off, self.lay.size
        at_dst = np.flatnonzero(~waiting) if also is None else also
        s = np.concatenate((off[waiting], dst[at_dst]))
        e = s + np.concatenate((size[waiting], size[at_dst]))
        o = np.argsort(s, kind="stable")
        return s[o], e[o]

    def waves(self, r: _Result) -> np.ndarray:
        """Step 6: smallest consistent wave per move, one after every block whose source it covers.

        Terminates: a destination only covers sources vacated in an earlier
        round, so the dependencies are acyclic and at most ``rounds`` deep.
        """
        off, size = self.lay.off, self.lay.size
        moved, d = r.mover_idx, r.dst
        lo = np.searchsorted(off + size, d, side="right")  # first source ending after d
        hi = np.searchsorted(off, d + size[moved], side="left")  # sources starting before the end
        idx = np.flatnonzero(hi > lo)
        wave = np.ones(moved.size, np.int64)
        if not idx.size:
            return wave
        bounds = np.empty(2 * idx.size, np.int64)
        bounds[0::2] = lo[idx]
        bounds[1::2] = hi[idx]
        wave_of = np.zeros(off.size + 1, np.int64)  # +1: reduceat bounds may equal off.size
        while True:
            wave_of[moved] = wave
            new = wave.copy()
            new[idx] = np.maximum.reduceat(wave_of, bounds)[0::2] + 1
            if np.array_equal(new, wave):
                return wave
            wave = new


@contextmanager
def _gc_paused():
    """Pause the cyclic GC: building ~10^5 small objects otherwise triggers full
    collections that scan the caller's whole heap and can double planning time."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _empty_plan(page_size: int, pages: int, lower_bound: int) -> Plan:
    return Plan((), page_size, pages, pages, 0, lower_bound)


def plan_compaction(
    blocks: Sequence[LiveBlock],
    *,
    page_size: int,
    span: int,
    alignment: int = 512,
    max_new_pages: int | None = None,
) -> Plan:
    """Plan moves that leave the live blocks on as few pages as possible.

    ``max_new_pages`` caps how many pages that no live block touches now
    (likely unmapped) the plan may use as destinations; ``None``: no cap;
    ``0``: only pages touched now, for when no physical page is free to map
    (the plan then never needs more pages than the region holds now).

    Raises :class:`PlanError` on bad input. The plan passes
    :func:`validate_plan`, has ``pages_after <= pages_before``, and is empty
    when no page can be freed. See the module docstring for the algorithm and
    for what it does not guarantee (optimality).
    """
    _check_geometry(page_size, span, alignment)
    if max_new_pages is not None and max_new_pages < 0:
        raise PlanError(f"max_new_pages must be >= 0 or None, got {max_new_pages}")
    with _gc_paused():
        return _plan(blocks, page_size, span, alignment, max_new_pages)


def _plan(blocks, page_size: int, span: int, alignment: int, max_new_pages: int | None) -> Plan:
    lay = _layout(blocks, span=span, alignment=alignment)
    if lay.off.size == 0:
        return _empty_plan(page_size, 0, 0)
    pl = _Planner(lay, page_size, span, alignment, max_new_pages)
    target = pl.lower_bound
    if pl.pages_before <= target:
        return _empty_plan(page_size, pl.pages_before, target)

    # Step 2 and the retries (step 7).
    best = pl.attempt(pl.keep_densest(target - pl.n_forced))
    work, attempts = best.movers, 1
    tried = {best.kept.tobytes()}
    base, gens = best, [pl.swap, pl.drop]
    while best.pages_after > target and gens and attempts < _MAX_ATTEMPTS and work <= _RETRY_MOVERS:
        kept = gens.pop(0)(base, target)
        if kept is None or kept.tobytes() in tried:
            continue
        tried.add(kept.tobytes())
        r = pl.attempt(kept)
        work, attempts = work + r.movers, attempts + 1
        if r.score < best.score:
            best = base = r
            gens = [pl.swap, pl.drop]
    if best.pages_after >= pl.pages_before:
        return _empty_plan(page_size, pl.pages_before, target)

    wave = pl.waves(best)
    keys, off, size = lay.keys, lay.off, lay.size
    order = np.lexsort((best.dst, wave))
    idx = best.mover_idx[order]
    waves: list[list[Move]] = [[] for _ in range(int(wave.max()))]
    new = object.__new__
    for i, src, d, sz, w in zip(
        idx.tolist(), off[idx].tolist(), best.dst[order].tolist(), size[idx].tolist(), wave[order].tolist()
    ):
        # Same object as Move(keys[i], src, d, sz), built ~2.5x faster: a
        # frozen dataclass __init__ goes through object.__setattr__ per field.
        m = new(Move)
        fields = m.__dict__
        fields["key"] = keys[i]
        fields["src"] = src
        fields["dst"] = d
        fields["size"] = sz
        waves[w - 1].append(m)
    return Plan(
        tuple(tuple(w) for w in waves if w),
        page_size,
        pl.pages_before,
        best.pages_after,
        best.moved_bytes,
        target,
    )


# --------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------


def validate_plan(
    blocks: Sequence[LiveBlock], plan: Plan, *, span: int, alignment: int = 512
) -> None:
    """Raise :class:`PlanError` unless ``plan`` is safe to run on ``blocks``.

    Checks: the input is valid; every move names a live block by key with its
    current offset and size, each block moves at most once and only if
    movable; destinations are aligned (page-aligned for blocks of a page or
    more) and inside ``[0, span)``; no wave is empty; within a wave no
    destination overlaps a source or another destination; a destination is
    free when its wave runs (nothing that has not left in an earlier wave is
    there); the final layout does not overlap; and the plan's
    ``pages_before``, ``pages_after`` and ``moved_bytes`` are right.
    Does not check that the plan is good, only that it is safe and honest.
    """
    P = plan.page_size
    _check_geometry(P, span, alignment)
    lay = _layout(blocks, span=span, alignment=alignment)
    pos = {k: i for i, k in enumerate(lay.keys)}
    off, size, movable = lay.off, lay.size, lay.movable
    end = off + size
    n = off.size
    leave = np.zeros(n, np.int64)  # wave in which the block moves; 0 = stays
    dst = off.copy()
    for w, wave in enumerate(plan.waves, start=1):
        if not wave:
            raise PlanError(f"wave {w} is empty")
        for m in wave:
            i = pos.get(m.key)
            if i is None:
                raise PlanError(f"move of unknown block {m.key!r}")
            if leave[i]:
                raise PlanError(f"block {m.key!r} moves twice (waves {leave[i]} and {w})")
            if m.src != off[i] or m.size != size[i]:
                raise PlanError(
                    f"move of {m.key!r} says [{m.src}, +{m.size}) but the block is [{off[i]}, +{size[i]})"
                )
            if not movable[i]:
                raise PlanError(f"block {m.key!r} is pinned but moves")
            if m.dst < 0 or m.dst + m.size > span or m.dst % alignment:
                raise PlanError(f"move of {m.key!r} to {m.dst} is misaligned or outside [0, {span})")
            if m.size >= P and m.dst % P:
                raise PlanError(f"block {m.key!r} of {m.size} bytes must land on a page boundary, not {m.dst}")
            leave[i] = w
            dst[i] = m.dst

    # Per wave: destinations must not overlap each other nor any source of the
    # wave, and must be free: no block that is still there when the wave runs
    # (it never moves, or it moves in this wave or later).
    mv = np.flatnonzero(leave > 0)
    if mv.size:
        d, de, wv = dst[mv], dst[mv] + size[mv], leave[mv]
        for w in range(1, len(plan.waves) + 1):
            sel = wv == w
            ds, dend = d[sel], de[sel]
            o = np.argsort(ds)
            if (ds[o][1:] < dend[o][:-1]).any():
                raise PlanError(f"wave {w}: destinations overlap")
        # Sources overlapping each destination form the index range [lo, hi).
        lo = np.searchsorted(end, d, side="right")
        hi = np.searchsorted(off, de, side="left")
        # A block still there when wave w runs: it never moves (leave = inf)
        # or moves in wave >= w. Check the latest leaver per range at once.
        still = np.append(np.where(leave == 0, np.iinfo(np.int64).max, leave), 0)
        idx = np.flatnonzero(hi > lo)
        if idx.size:
            bounds = np.empty(2 * idx.size, np.int64)
            bounds[0::2] = lo[idx]
            bounds[1::2] = hi[idx]
            latest = np.maximum.reduceat(still, bounds)[0::2]
            bad = np.flatnonzero(latest >= wv[idx])
            if bad.size:
                j = int(idx[bad[0]])
                blockers = still[lo[j]:hi[j]]
                b = int(lo[j]) + int(np.flatnonzero(blockers >= wv[j])[0])
                raise PlanError(
                    f"wave {wv[j]}: {lay.keys[mv[j]]!r} lands on [{d[j]}, {de[j]}) where "
                    f"{lay.keys[b]!r} still is (it {'never moves' if not leave[b] else f'moves in wave {leave[b]}'})"
                )

    # Final layout.
    o = np.argsort(dst, kind="stable")
    fs, fe = dst[o], dst[o] + size[o]
    if n > 1 and (fs[1:] < fe[:-1]).any():
        i = int(np.flatnonzero(fs[1:] < fe[:-1])[0])
        raise PlanError(f"final layout: {lay.keys[o[i]]!r} and {lay.keys[o[i + 1]]!r} overlap")

    before = _page_union_count(off // P, (end - 1) // P) if n else 0
    after = _page_union_count(dst // P, (dst + size - 1) // P) if n else 0
    moved = int(size[mv].sum())
    if (plan.pages_before, plan.pages_after, plan.moved_bytes) != (before, after, moved):
        raise PlanError(
            f"plan claims pages {plan.pages_before}->{plan.pages_after}, {plan.moved_bytes} bytes moved; "
            f"actual {before}->{after}, {moved} bytes"
        )


def plan_hole(blocks: Sequence[LiveBlock], free: Sequence[tuple[int, int]], size: int, *,
              page_size: int, span: int) -> Plan | None:
    """The cheapest single move that turns two free ranges into one hole of ``size`` bytes.

    For a sub-page request when no page can be emptied (the live bytes need
    every page) but the free bytes are split: a movable block lying exactly
    between two free ranges, whose sum with it reaches ``size``, moves (best
    fit) into a third free range. ``free`` are the free ranges (offset, size)
    in address order, relative to the region like the blocks' offsets. One
    wave; no page the blocks do not already touch is needed unless the chosen
    free range lies on one. Returns None when no such block exists. Does not
    consider moving two blocks, or blocks next to unmapped space.
    """
    by_offset = {b.offset: b for b in blocks}
    by_size = sorted((sz, off) for off, sz in free)
    best = None  # (bytes moved, block, destination)
    for (a_off, a_sz), (b_off, b_sz) in zip(free, free[1:]):
        block = by_offset.get(a_off + a_sz)
        if block is None or not block.movable or a_off + a_sz + block.size != b_off:
            continue
        if a_sz + block.size + b_sz < size or (best is not None and block.size >= best[0]):
            continue
        i = bisect_left(by_size, (block.size, -1))
        while i < len(by_size) and by_size[i][1] in (a_off, b_off):
            i += 1
        if i < len(by_size):
            best = (block.size, block, by_size[i][1])
    if best is None:
        return None
    _, block, dst = best
    move = Move(block.key, block.offset, dst, block.size)
    before = [(b.offset, b.size) for b in blocks]
    after = [(dst, b.size) if b.key == block.key else (b.offset, b.size) for b in blocks]
    plan = Plan(waves=((move,),), page_size=page_size, pages_before=touched_pages(before, page_size),
                pages_after=touched_pages(after, page_size), moved_bytes=block.size)
    validate_plan(blocks, plan, span=span)
    return plan
