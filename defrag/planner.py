"""Compaction planner: one region's live layout in, waves of block moves out.

Pure: integers and numpy, no torch, no driver; best fit runs in defrag's
native module (:func:`_best_fit`; the module that keeps the pool's books,
which torch's ``cpp_extension`` builds, so loading it loads torch's
libraries, though no code here imports torch). The pool calls the
planner once per contiguous virtual region and the compactor executes what it
returns. A layout is parallel arrays (``offsets``, ``sizes``, ``movable``;
a block's key is its index) and a plan is an :class:`ArrayPlan`: int64
arrays ``index``, ``src``, ``dst``, ``size`` and ``wave``, one entry per
move, sorted by wave then destination, so each wave is one contiguous slice
(:meth:`ArrayPlan.wave_slices`). No Python object per block or per move.
What the compactor runs:

- :func:`plan_arrays`: a compaction; the algorithm below.
- :func:`plan_conveyor`: the blocks :func:`plan_arrays` never moves (a page
  or more), packed end to end into a zone of free pages, one wave, when
  that frees pages. The compactor runs it before :func:`plan_arrays`.
- :func:`plan_hole_arrays`: the automatic rescue of a sub-page request, one
  move that merges two free ranges into a hole.
- :func:`plan_window_arrays`: the automatic rescue of a request of a page
  or more, the evacuation of a window.
- :func:`validate_arrays`: checks that a plan is safe and honest.

Model
-----
The region spans ``[0, span)``; ``span`` is a multiple of ``page_size``. Live
blocks are ``alignment``-aligned (offset and size), do not overlap, and a page
is *touched* (needs physical backing) iff some live block intersects it. A
block is *fixed* if it is pinned (``movable=False``) or at least a page long.
Fixed blocks never move: pinned ones by contract, large ones because the pool
places a block of a page or more where it touches the fewest pages it can (on
a page boundary, or starting in a free page tail), so moving one rarely lowers
the page count and always costs bytes. The pages touched by fixed blocks are the *forced* pages ``F``.

Lower bound: any final layout touches ``F`` and at least ``ceil(live/page)``
pages, so ``pages_after >= max(|F|, ceil(live / page_size))`` (a plan's
``pages_lower_bound``).

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
   into them, go back to the left-overs; steps 3-4 repeat (``_MAX_DROP_STEPS``
   + 1 times at most).
5. Rounds after wave 1 (``_MAX_ROUNDS_AFTER_WAVE_1`` at most): left-over
   blocks go, best fit, into kept-page space free by then (remnants; what
   earlier movers vacated) or else into zone pages, each of which costs a
   page: unmapped pages (longest runs first), then evacuated pages that
   earlier rounds emptied. A block that fits nowhere stays where it is.
6. Waves: each move runs one wave after the latest move whose old place its
   destination covers, wave 1 if none (acyclic: a destination only covers
   space vacated in an earlier round). A move into an unmapped page or a
   hole that was free all along therefore runs in wave 1.
7. Retries while the result misses ``T``: "swap" keeps the pages of blocks
   that had to go to zone pages and stops keeping as many of the emptiest
   kept pages; "drop" stops keeping enough of the emptiest kept pages to
   cover the excess. Up to ``_MAX_ATTEMPTS`` attempts, the best by (pages,
   bytes moved, waves) wins. Retries stop once the attempts have handled
   ``_RETRY_MAX_MOVERS`` movers, so a large region gets one attempt. A plan
   that frees no page becomes empty.

Complexity: sorting and interval arithmetic are numpy, ``O(n log n)`` for
``n`` blocks; per-page bookkeeping uses tables indexed by page number
(``O(span / page_size)`` memory) when the region is not much sparser than
its blocks, binary search otherwise. Best fit is a C++ loop
(``defrag/native/planner.h``), one block at a time: holes are bucketed by
length (in units of ``alignment``, one bucket for holes of a page or more)
and a 64-ary bitset tree over the non-empty buckets finds the best one
(two words to look at for 2 MiB pages and 512-byte units). It was a Python loop
(:func:`_best_fit_python`, kept as its model: the same array for every
input), whose per-block iterations were most of a small compaction's
planning time: for 900 blocks (548 moves) :func:`plan_arrays` takes
~0.7 ms instead of ~1.4 ms, best fit ~0.02 ms instead of ~0.6. Measured on
the synthetic layout of ``benchmarks/bench_planner.py`` (every page about
half full, 2 MiB pages, one shared 2-core machine): :func:`plan_arrays`
~0.04 s for 10^5 blocks and ~0.7 s for 10^6 (7 * 10^5 moves), numpy
steps now most of it.

The page bookkeeping, the attempts and the waves (steps 3-6; :class:`_Planner`)
run in C++ too (``PlanRegion`` of ``defrag/native/plan_attempt.h``): in numpy
they were dozens of calls per drop step and round, whose fixed per-call cost
was nearly all of a small compaction's planning time. The numpy code stays as
the model (:meth:`_Planner._init_python`, :meth:`_Planner.attempt_python`,
:meth:`_Planner.waves_python`; ``_plan_arrays(..., native_attempts=False)``),
and ``tests/cpu/test_native_attempt.py`` asserts identical plans. On the
compaction benchmark's layout (900 blocks, 548 moves) :func:`plan_arrays`
takes ~0.26 ms instead of ~0.70 ms.

Guarantees of every plan
------------------------
- Each block moves at most once, only if movable, from its current offset,
  to an ``alignment``-aligned destination inside ``[0, span)``; in a
  :func:`plan_arrays` plan only blocks shorter than a page move.
- Waves run in order. Within a wave no destination overlaps any source or any
  other destination of that wave, so a wave may be executed as "read every
  source, then write every destination" (one kernel launch) or as in-order
  memmoves, with the same result.
- A destination is free when its wave runs: every block that was there has
  moved away in an earlier wave.
- The final layout does not overlap; ``pages_after <= pages_before``; and
  ``pages_before``, ``pages_after`` and ``moved_bytes`` are exact.
- Deterministic: the same layout gives the same plan, in any input order.
  (:func:`validate_arrays` checks all but the last.)

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
  its extra page), and uses at most ``_MAX_ROUNDS_AFTER_WAVE_1 + 1`` waves.
- Peak memory: destinations in unmapped pages need those pages mapped while
  the plan runs, before the evacuated ones are released;
  ``max_new_pages=0`` forbids them (then the plan may free fewer pages).
"""
from __future__ import annotations

import collections
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from operator import neg
from typing import NamedTuple

import numpy as np

from . import native
from .page_runs import page_run_arrays

__all__ = [
    "ArrayPlan",
    "PlanError",
    "plan_arrays",
    "plan_conveyor",
    "plan_hole_arrays",
    "plan_window_arrays",
    "validate_arrays",
]

# --------------------------------------------------------------------------
# Bounds and tuning
# --------------------------------------------------------------------------

#: Default block alignment: the pool's (``heap.ALIGNMENT``, PyTorch's 512-byte rounding).
ALIGNMENT = 512

#: Placement rounds per attempt after wave 1, so at most this many waves plus one. Each may
#: add a wave (one more launch and synchronisation) and has fewer blocks left to place.
_MAX_ROUNDS_AFTER_WAVE_1 = 6
#: Drop steps (step 4) per attempt: each places every pending block again, so each costs
#: about as much planning time as wave 1.
_MAX_DROP_STEPS = 3
#: Attempts with different kept sets (step 7), the first included: each retry costs as much
#: planning time as the first attempt.
_MAX_ATTEMPTS = 6
#: Retries stop once the attempts together have handled this many movers, so that a large
#: region gets one attempt and planning time stays about linear in its block count.
_RETRY_MAX_MOVERS = 60_000
#: Per-page tables (one int64 per page of the region) are used while the region has at most
#: this many pages per touched page, plus _PAGE_TABLE_PAGES_ALWAYS: filling a sparser table
#: costs more than the binary searches it saves.
_PAGE_TABLE_PAGES_PER_TOUCHED = 8
#: Pages for which a page table is always used: 2^16 entries are 512 KiB, filled in well
#: under a millisecond.
_PAGE_TABLE_PAGES_ALWAYS = 1 << 16
#: _best_fit_python buckets at most this many holes in a Python loop: below that, numpy's fixed
#: per-call cost exceeds the loop's.
_PYTHON_BUCKETING_MAX_HOLES = 64
#: _best_fit_python places items into a hole of a page or more with one prefix sum over at least
#: this many items at a time (else twice as many as the last prefix sum placed): fewer do
#: not pay for the numpy calls.
_PREFIX_RUN_MIN_ITEMS = 64
#: _best_fit_python places items into a hole of a page or more one at a time when fewer than this
#: many of the current item fit before the hole stops being a page or more: a prefix sum
#: would place too few to pay for itself.
_PREFIX_RUN_MIN_FIT = 32
#: Sort keys below this fit uint16, and a stable argsort of 16-bit keys is a radix sort.
_UINT16_KEYS = 1 << 16
#: Sort keys below this fit uint8 (wave numbers: at most _MAX_ROUNDS_AFTER_WAVE_1 + 1).
_UINT8_KEYS = 1 << 8
#: plan_hole_arrays' destination search skips at most the two free ranges that are the
#: moving block's neighbours (free ranges have distinct offsets).
_HOLE_NEIGHBOURS = 2
#: A conveyor moves at most this many pages' worth of bytes per page it gains (pages freed
#: less zone pages used). With 4, llm_serving's smallest capacity is 1.046x its peak live
#: bytes instead of 1.024x; the extra bytes are milliseconds of copying on a GPU.
CONVEYOR_MAX_PAGES_MOVED_PER_PAGE_GAINED = 16
#: plan_window_arrays packs at most this many candidate windows (cheapest by its bounds
#: first) before giving up: each costs a Python loop over the window's blocks, and the
#: rescue that asks runs while an allocation waits.
MAX_WINDOW_TRIES = 64


class PlanError(ValueError):
    """Bad planner input (overlap, misalignment, out of span) or an unsafe plan."""


_MOVE_ARRAYS = ("index", "src", "dst", "size", "wave")
_INT64 = np.dtype(np.int64)


@dataclass(frozen=True, eq=False)
class ArrayPlan:
    """A plan: parallel int64 arrays, one entry per move.

    Move ``j`` copies ``size[j]`` bytes of input block ``index[j]`` (its
    position in the layout arrays given to the planner) from ``src[j]`` to
    ``dst[j]`` (region offsets) in wave ``wave[j]``. Waves are numbered from 1
    and run in order; each is one kernel launch.

    Guaranteed for plans the planner makes (and checked by
    :func:`validate_arrays`, except the order of destinations):

    - sorted by wave, then by destination; waves ``1 .. waves`` are all
      non-empty, so wave ``w`` is the slice ``wave_slices()[w - 1]``;
    - within a wave no destination overlaps any source or any other
      destination of that wave (read every source then write, or in-order
      memmoves: same result), and each destination is free when its wave
      runs (whatever was there left in an earlier wave);
    - each block moves at most once; ``index`` has no repeats;
    - ``pages_before``, ``pages_after`` and ``moved_bytes`` (``size.sum()``)
      are exact.

    The arrays are read-only views. ``==`` compares every field.
    """

    index: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    size: np.ndarray
    wave: np.ndarray
    page_size: int
    pages_before: int
    pages_after: int
    moved_bytes: int
    #: ``max(forced pages, ceil(live / page))``; ``None`` when not computed.
    pages_lower_bound: int | None = None
    #: ``(offset, length)`` of the free range a :func:`plan_window_arrays` plan leaves for a request
    #: (its unmapped pages still to be mapped); ``None`` for every other plan.
    hole: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        n = None
        for name in _MOVE_ARRAYS:
            a = getattr(self, name)
            # The planner's own arrays are 1-d int64 already: only the read-only view to make.
            if not (type(a) is np.ndarray and a.dtype == _INT64 and a.ndim == 1):
                a = np.asarray(a)
                if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
                    raise PlanError(f"ArrayPlan.{name} must be a 1-d integer array")
                a = a.astype(np.int64, copy=False)
            a = a.view()  # read-only without touching the caller's array
            a.flags.writeable = False
            if n is not None and a.size != n:
                raise PlanError("ArrayPlan arrays must have equal lengths")
            n = a.size
            object.__setattr__(self, name, a)

    def __len__(self) -> int:
        """Number of moves."""
        return int(self.index.size)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ArrayPlan):
            return NotImplemented
        return all(np.array_equal(getattr(self, f), getattr(other, f)) for f in _MOVE_ARRAYS) and (
            self.page_size, self.pages_before, self.pages_after, self.moved_bytes, self.pages_lower_bound, self.hole
        ) == (other.page_size, other.pages_before, other.pages_after, other.moved_bytes, other.pages_lower_bound,
              other.hole)

    __hash__ = None  # type: ignore[assignment]

    @property
    def waves(self) -> int:
        """Number of waves (0 for an empty plan)."""
        return int(self.wave.max()) if self.wave.size else 0

    @property
    def empty(self) -> bool:
        """True when the plan moves nothing."""
        return not self.index.size

    @property
    def pages_freed(self) -> int:
        """Pages the region stops touching once the plan has run."""
        return self.pages_before - self.pages_after

    def wave_slices(self) -> list[tuple[int, int]]:
        """``(start, stop)`` into the arrays for waves ``1 .. waves``, in order (needs the wave order)."""
        if not self.wave.size:
            return []
        # The last entry is the number of waves (sorted by wave); method calls, not numpy's
        # Python-level wrappers: this runs once per compaction, cold.
        b = self.wave.searchsorted(np.arange(1, int(self.wave[-1]) + 2)).tolist()
        return list(zip(b[:-1], b[1:]))


def _empty_arrays(page_size: int, pages: int, lower_bound: int | None) -> ArrayPlan:
    e = np.empty(0, np.int64)
    return ArrayPlan(e, e, e, e, e, page_size, pages, pages, 0, lower_bound)


# --------------------------------------------------------------------------
# Helpers on (offset, size) layouts
# --------------------------------------------------------------------------


def _page_union_count(first: np.ndarray, last: np.ndarray) -> int:
    """Number of distinct pages in the union of inclusive ranges [first, last]."""
    if first.size == 0:
        return 0
    if first.size > 1 and (first[1:] < first[:-1]).any():
        order = np.argsort(first, kind="stable")
        first, last = first[order], last[order]
    l_ = np.maximum.accumulate(last)
    # A range starts a new run unless it begins at or before the previous max end.
    prev = np.concatenate(([first[0] - 2], l_[:-1]))
    covered_before = np.maximum(prev, first - 1)
    # Count pages each range adds beyond what earlier ranges covered.
    added = np.maximum(0, l_ - covered_before)
    return int(added.sum())


# --------------------------------------------------------------------------
# Input checking
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Layout:
    """Blocks as arrays sorted by offset (validated); ``order[i]``: input index of sorted block ``i``."""

    order: np.ndarray | None  # None: the input was sorted already
    off: np.ndarray
    size: np.ndarray
    movable: np.ndarray

    def inputs(self, idx: np.ndarray) -> np.ndarray:
        """Input indices of sorted positions ``idx``."""
        return idx if self.order is None else self.order[idx]


def _check_geometry(page_size: int, span: int, alignment: int) -> None:
    if alignment <= 0:
        raise PlanError(f"alignment must be positive, got {alignment}")
    if page_size <= 0 or page_size % alignment:
        raise PlanError(f"page_size {page_size} must be a positive multiple of alignment {alignment}")
    if span < 0 or span % page_size:
        raise PlanError(f"span {span} must be a non-negative multiple of page_size {page_size}")


def _int_array(a, what: str) -> np.ndarray:
    a = np.asarray(a)
    if a.ndim != 1:
        raise PlanError(f"{what} must be a 1-d array, got shape {a.shape}")
    if a.size and a.dtype.kind not in "iu":
        raise PlanError(f"{what} must hold integers, got {a.dtype}")
    return a.astype(np.int64, copy=False)


def _layout_arrays(offsets, sizes, movable) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    off, size = _int_array(offsets, "offsets"), _int_array(sizes, "sizes")
    mov = np.asarray(movable)
    if mov.ndim != 1 or (mov.size and mov.dtype.kind not in "biu"):
        raise PlanError("movable must be a 1-d array of booleans")
    mov = mov.astype(bool, copy=False)
    if not off.size == size.size == mov.size:
        raise PlanError(f"offsets, sizes and movable differ in length ({off.size}, {size.size}, {mov.size})")
    return off, size, mov


def _free_arrays(free_offsets, free_sizes) -> tuple[np.ndarray, np.ndarray]:
    fo, fs = _int_array(free_offsets, "free_offsets"), _int_array(free_sizes, "free_sizes")
    if fo.size != fs.size:
        raise PlanError(f"free_offsets and free_sizes differ in length ({fo.size}, {fs.size})")
    return fo, fs


def _layout(off: np.ndarray, size: np.ndarray, movable: np.ndarray, *, span: int, alignment: int) -> _Layout:
    """Check a layout (input order) and sort it by offset; errors name blocks by input index."""
    n = off.size
    if alignment & (alignment - 1):
        bad = (size <= 0) | (off < 0) | (off % alignment != 0) | (size % alignment != 0) | (off > span - size)
    else:  # a power of two: both aligned iff no low bit of either is set (fewer numpy calls)
        bad = (size <= 0) | (off < 0) | ((off | size) & (alignment - 1) != 0) | (off > span - size)
    # count_nonzero, not .any(): a C call instead of numpy's Python-level reduction wrapper.
    if np.count_nonzero(bad):
        i = int(bad.nonzero()[0][0])
        raise PlanError(
            f"block {i} [{off[i]}, +{size[i]}) must have positive size, be "
            f"{alignment}-aligned and lie inside [0, {span})"
        )
    order = None
    if n > 1 and np.count_nonzero(off[1:] < off[:-1]):
        order = off.argsort(kind="stable")
        off, size, movable = off[order], size[order], movable[order]
    if n > 1:
        clash = (off[1:] < off[:-1] + size[:-1]).nonzero()[0]
        if clash.size:
            i = int(clash[0])
            a, b = (i, i + 1) if order is None else (int(order[i]), int(order[i + 1]))
            raise PlanError(
                f"blocks {a} [{off[i]}, +{size[i]}) and {b} [{off[i + 1]}, +{size[i + 1]}) overlap"
            )
    return _Layout(order, off, size, movable)


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
    """Intersection of two lists of sorted disjoint intervals (sorted, non-empty pieces)."""
    if a_s.size == 0 or b_s.size == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    # The a-intervals overlapping b-interval k are a[lo[k]:hi[k]].
    lo = a_e.searchsorted(b_s, side="right")
    hi = a_s.searchsorted(b_e, side="left")
    cnt = hi - lo
    if not np.count_nonzero(cnt != 1):
        return np.maximum(b_s, a_s[lo]), np.minimum(b_e, a_e[lo])
    if not np.count_nonzero(cnt > 1):
        # Each b-interval meets at most one a-interval (e.g. gaps between blocks and
        # runs of kept pages): the general case below with fewer numpy calls.
        k = cnt.nonzero()[0]
        j = lo[k]
        return np.maximum(b_s[k], a_s[j]), np.minimum(b_e[k], a_e[j])
    owner = np.arange(b_s.size).repeat(cnt)
    j = np.arange(owner.size) + (lo - (cnt.cumsum() - cnt)).repeat(cnt)
    return np.maximum(b_s[owner], a_s[j]), np.minimum(b_e[owner], a_e[j])


def _page_runs(pages: np.ndarray, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Byte intervals [start, end) covered by a sorted array of distinct page ids (`page_run_arrays`)."""
    first, count = page_run_arrays(pages)
    return first * page_size, (first + count) * page_size


def _expand_pages(first: np.ndarray, last: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every (page, owner index) pair for inclusive page ranges [first[i], last[i]]."""
    cnt = last - first + 1
    owner = np.arange(first.size).repeat(cnt)
    pages = np.arange(owner.size) + (first - (cnt.cumsum() - cnt)).repeat(cnt)
    return pages, owner


def _filled(n: int, value, dtype) -> np.ndarray:
    """``np.full(n, value, dtype)`` without numpy's Python-level wrapper (planning runs cold, once per
    compaction: each distinct numpy wrapper it enters costs more than the arithmetic)."""
    a = np.empty(n, dtype)
    a.fill(value)
    return a


def _expand_runs(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + n) for s, n in zip(starts, lens)])``."""
    return np.arange(int(lens.sum())) + (starts - (lens.cumsum() - lens)).repeat(lens)


def _minus(s: np.ndarray, e: np.ndarray, cut_s: np.ndarray, cut_e: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray]:
    """Sorted disjoint intervals minus disjoint intervals (any order) each inside one of them.

    Within an interval ``[a, b)`` holding cuts ``[s1, e1) .. [sk, ek)`` the
    pieces start at ``a, e1 .. ek`` and end at ``s1 .. sk, b``: the sorted
    starts and ends pair up. Empty pieces are dropped.
    """
    if not cut_s.size:
        return s, e
    ps = np.sort(np.concatenate((s, np.sort(cut_e))), kind="stable")
    pe = np.sort(np.concatenate((np.sort(cut_s), e)), kind="stable")
    keep = pe > ps
    return ps[keep], pe[keep]


def _merge_intervals(a_s: np.ndarray, a_e: np.ndarray, b_s: np.ndarray, b_e: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Sorted union of disjoint intervals ``a`` (sorted) and ``b`` (any order), all disjoint.

    Disjoint non-empty intervals' starts and ends sort into the same order, so
    each sorts on its own; the stable sort (timsort) merges the two runs.
    """
    if not b_s.size:
        return a_s, a_e
    s = np.sort(np.concatenate((a_s, np.sort(b_s))), kind="stable")
    e = np.sort(np.concatenate((a_e, np.sort(b_e))), kind="stable")
    return s, e


# --------------------------------------------------------------------------
# Best-fit placement
# --------------------------------------------------------------------------


def _bucket_holes(hole_s: np.ndarray, hole_e: np.ndarray, unit: int, cap: int
                  ) -> tuple[collections.defaultdict[int, list[int]], list[int], int, list[list[int]]]:
    """The holes in units of ``unit``, as :func:`_best_fit_python` keeps them: ``(buckets, words, top, big)``.

    Holes shorter than ``cap`` units: ``buckets[length]`` lists their starts
    in the order given; bit ``length`` of the 64-bit ``words`` (bit
    ``length & 63`` of ``words[length >> 6]``) is set iff that bucket is not
    empty, and bit ``w`` of ``top`` iff ``words[w]`` is not zero. Holes of
    ``cap`` units or more: ``big`` lists ``[start, length]``, last given
    first (items are carved from the end of the list: first given, first
    used). Empty holes are dropped.
    """
    buckets: collections.defaultdict[int, list[int]] = collections.defaultdict(list)  # only lengths seen
    words = [0] * ((cap + 63) >> 6)
    top = 0
    if hole_s.size <= _PYTHON_BUCKETING_MAX_HOLES:
        # Few holes: bucket them in Python (same lists, same order); numpy's
        # per-call cost dominates here.
        big = []
        for s, e in zip(hole_s.tolist(), hole_e.tolist()):
            ln = (e - s) // unit
            s //= unit
            if ln >= cap:
                big.append([s, ln])
            elif ln > 0:
                lst = buckets[ln]
                if not lst:
                    words[ln >> 6] |= 1 << (ln & 63)
                    top |= 1 << (ln >> 6)
                lst.append(s)
        big.reverse()
        return buckets, words, top, big
    hs = hole_s // unit
    hl = (hole_e - hole_s) // unit
    is_big = hl >= cap
    big = [[s, ln] for s, ln in zip(hs[is_big].tolist(), hl[is_big].tolist())]
    big.reverse()
    small = ~is_big & (hl > 0)
    if small.any():
        lens = hl[small]
        # Stable: each bucket lists its holes in the order given. (A stable
        # sort of 16-bit keys is a radix sort.)
        o = (lens.astype(np.uint16) if cap <= _UINT16_KEYS else lens).argsort(kind="stable")
        lens, starts = lens[o], hs[small][o].tolist()
        first = np.concatenate(([0], (lens[1:] != lens[:-1]).nonzero()[0] + 1))  # where each length starts
        bounds = first.tolist() + [lens.size]
        for j, ln in enumerate(lens[first].tolist()):
            buckets[ln] = starts[bounds[j]:bounds[j + 1]]
            words[ln >> 6] |= 1 << (ln & 63)
            top |= 1 << (ln >> 6)
    return buckets, words, top, big


def _longest_small_hole(words: list[int], top: int) -> int:
    """Length of the longest hole in the buckets (``top`` not zero)."""
    w = top.bit_length() - 1
    return (w << 6) + words[w].bit_length() - 1


def _best_fit(
    hole_s: np.ndarray, hole_e: np.ndarray, sizes: np.ndarray, unit: int, cap: int
) -> np.ndarray:
    """Place ``sizes`` (non-increasing) into holes, best fit; -1 = no room.

    Works in units of ``unit`` bytes. Holes of ``cap`` units or more share one
    bucket: any of them fits any item shorter than ``cap``, and items are
    carved from the front of the first such hole (in the order given) until
    it shrinks below ``cap``, so long holes fill contiguously. Items of
    ``cap`` units or more are never placed. Returns byte offsets (int64).

    Runs in C++ (``best_fit`` of defrag's native module,
    ``defrag/native/planner.h``): in Python the placement loop, one
    iteration per item or run, was the largest part of :func:`plan_arrays`'
    time (about 0.6 ms of 1.4 for a compaction of 900 blocks; 0.02 ms in
    C++). The result is the same
    array as :func:`_best_fit_python`'s, the model, for every input
    (``tests/cpu/test_native_planner.py`` runs both); the native module is
    the pool's books, already loaded by any pool (built on first use:
    :func:`defrag.native.load_module`).
    """
    return native.load_module().best_fit(hole_s, hole_e, sizes, unit, cap)


def _best_fit_python(
    hole_s: np.ndarray, hole_e: np.ndarray, sizes: np.ndarray, unit: int, cap: int
) -> np.ndarray:
    """:func:`_best_fit` in Python: the model of the native ``best_fit``, same arguments, same result.

    Works in units of ``unit`` bytes. Holes of ``cap`` units or more share one
    bucket: any of them fits any item shorter than ``cap``, and items are
    carved from the front of the first such hole (in the order given) until
    it shrinks below ``cap``, so long holes fill contiguously. Items of
    ``cap`` units or more are never placed. Returns byte offsets.

    The placement is the same as placing items one at a time, each into the
    last hole of the shortest non-empty bucket that fits (remnants pushed
    onto their length's bucket), else the first hole of ``cap`` or more,
    else nowhere: the runs below and the bisect skips are shortcuts of that
    loop, which is what the native ``best_fit`` runs.

    Shorter holes are bucketed by length (:func:`_bucket_holes`), so the best
    bucket (the shortest that fits) is found with a few operations on small
    integers. The loop below is the hot path: one item placed into a hole
    shorter than ``cap``; runs of equal items (:func:`_carve_equal_run`) and
    items going into a hole of ``cap`` or more (:func:`_fill_big_hole`) are
    placed a run at a time.
    """
    n = sizes.size
    buckets, words, top, big = _bucket_holes(hole_s, hole_e, unit, cap)
    units_arr = np.ascontiguousarray(sizes // unit, dtype=np.int64)
    # Item sizes as Python ints without converting them all up front: most
    # calls look at few items (they run out of holes), or place most of them
    # with the vectorised run below. Non-increasing: bisect on key=neg.
    units = memoryview(units_arr)
    window = _PREFIX_RUN_MIN_ITEMS  # items looked at per prefix sum into a big hole (adapts)
    out = _filled(n, -1, np.int64)
    at_i: list[int] = []  # placements one at a time: item, start
    at_s: list[int] = []
    add_i, add_s = at_i.append, at_s.append
    i = bisect_left(units, -(cap - 1), 0, key=neg)  # items of cap units or more never fit
    while i < n:
        # The best bucket b: the shortest non-empty one of g units or more; cap: a big hole.
        g = units[i]
        w = g >> 6
        x = words[w] >> (g & 63)
        if x:
            b = g + (x & -x).bit_length() - 1
        else:
            t = top >> (w + 1)
            if t:
                w += (t & -t).bit_length()
                x = words[w]
                b = (w << 6) + (x & -x).bit_length() - 1
            elif big:
                b = cap
            else:
                # Nothing fits; neither does any item longer than the longest hole.
                if not top:
                    break
                i = max(i + 1, bisect_left(units, -_longest_small_hole(words, top), i, key=neg))
                continue
        if b >= cap:
            i, top, window = _fill_big_hole(units, units_arr, i, cap, big, buckets, words, top, window, out,
                                            add_i, add_s)
            continue
        lst = buckets[b]
        start = lst.pop()
        if not lst:
            w = b >> 6
            x = words[w] ^ (1 << (b & 63))
            words[w] = x
            if not x:
                top ^= 1 << w
        r = b - g
        if r:
            if r >= g and i + 1 < n and units[i + 1] == g:
                i, top = _carve_equal_run(units, i, b, start, lst, buckets, words, top, at_i, at_s)
                continue
            lst = buckets[r]
            if not lst:
                words[r >> 6] |= 1 << (r & 63)
                top |= 1 << (r >> 6)
            lst.append(start + g)
        add_i(i)
        add_s(start)
        i += 1
    if at_i:
        out[at_i] = at_s
    return np.where(out >= 0, out * unit, -1)


def _carve_equal_run(units, i: int, b: int, start: int, lst: list[int], buckets, words: list[int], top: int,
                     at_i: list[int], at_s: list[int]) -> tuple[int, int]:
    """:func:`_best_fit_python` for a run of equal items from item ``i``, the first going into the hole of ``b``
    units at ``start`` just popped from bucket ``lst``; returns the next item and ``top``.

    Each next item of the run would take the remnant just made (the shortest
    hole that fits, popped first), so as many as fit go into this hole at
    once. When that fills the hole and the run goes on for a hole or more,
    its next items take the next holes of this bucket (still the shortest
    that fit: the remnants are shorter than an item), ``q`` per hole.
    Placements are appended to ``at_i``/``at_s``.
    """
    n = len(units)
    g = units[i]
    q = b // g
    j = bisect_right(units, -g, i + 1, min(n, i + q), key=neg)  # end of the run in the hole
    at_i.extend(range(i, j))
    at_s.extend(range(start, start + (j - i) * g, g))
    r = b - (j - i) * g
    if r:
        rl = buckets[r]
        if not rl:
            words[r >> 6] |= 1 << (r & 63)
            top |= 1 << (r >> 6)
        rl.append(start + (j - i) * g)
    i = j
    if r < g and lst and i + q <= n and units[i + q - 1] == g:
        m = (bisect_right(units, -g, i + q, min(n, i + q * len(lst)), key=neg) - i) // q
        if m:
            taken = lst[-m:]
            del lst[-m:]
            taken.reverse()  # popped last first
            at_i.extend(range(i, i + m * q))
            for st in taken:
                at_s.extend(range(st, st + q * g, g))
            if r:
                rl.extend([st + q * g for st in taken])
            if not lst:
                w = b >> 6
                x = words[w] ^ (1 << (b & 63))
                words[w] = x
                if not x:
                    top ^= 1 << w
            i += m * q
    return i, top


def _fill_big_hole(units, units_arr: np.ndarray, i: int, cap: int, big: list[list[int]], buckets,
                   words: list[int], top: int, window: int, out: np.ndarray, add_i, add_s
                   ) -> tuple[int, int, int]:
    """:func:`_best_fit_python` for item ``i`` and the items after it into the front of the first hole of ``cap``
    units or more; returns the next item, ``top`` and the next ``window``.

    When few items fit before the hole shrinks below ``cap``, item ``i``
    alone (appended to ``add_i``/``add_s``). Else so go the items after it
    that fit no small hole either (longer than the longest) while the hole
    stays big before each, at most ``window``: the buckets do not change
    until then, so one prefix sum places them (written to ``out``). A hole
    that shrinks below ``cap`` goes to its bucket.
    """
    g = units[i]
    h = big[-1]
    if h[1] - cap < _PREFIX_RUN_MIN_FIT * g:
        cnt = 1
        add_i(i)
        add_s(h[0])
        used = g
    else:
        n = len(units)
        stop = bisect_left(units, -_longest_small_hole(words, top), i, key=neg) if top else n  # fits a small hole
        hi = min(stop, i + window)
        ends = units_arr[i:hi].cumsum()  # hole used after each item
        cnt = min(int(ends.searchsorted(h[1] - cap, side="right")) + 1, hi - i)
        used = int(ends[cnt - 1])
        out[i:i + cnt] = ends[:cnt] - units_arr[i:i + cnt] + h[0]
        window = max(_PREFIX_RUN_MIN_ITEMS, 2 * cnt)
    h[0] += used
    h[1] -= used
    if h[1] < cap:
        big.pop()
        r = h[1]
        if r:
            lst = buckets[r]
            if not lst:
                words[r >> 6] |= 1 << (r & 63)
                top |= 1 << (r >> 6)
            lst.append(h[0])
    return i + cnt, top, window


def _runs_first(pages: np.ndarray) -> np.ndarray:
    """Sorted distinct page ids reordered: longest contiguous runs first (ties: lower first)."""
    if pages.size == 0:
        return pages
    brk = (pages[1:] - pages[:-1] != 1).nonzero()[0] + 1
    starts = np.concatenate(([0], brk))
    bounds = np.concatenate((starts, [pages.size]))
    lens = bounds[1:] - bounds[:-1]
    order = np.lexsort((starts, -lens))
    return pages[_expand_runs(starts[order], lens[order])]


# --------------------------------------------------------------------------
# Planning
# --------------------------------------------------------------------------


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
    """Per-region state shared by the attempts of one plan."""

    def __init__(self, lay: _Layout, page_size: int, span: int, alignment: int, max_new_pages: int | None,
                 mapped: np.ndarray | None = None, native_attempts: bool = True):
        self.lay, self.P, self.span, self.A = lay, page_size, span, alignment
        self.npages = span // page_size
        n = lay.off.size
        limit = n if max_new_pages is None else min(n, max_new_pages)  # one fresh page per block at most
        # The page bookkeeping, steps 3-6 in C++ (defrag/native/plan_attempt.h): the same arrays and
        # results as _init_python, attempt_python and waves_python, the model. None: the model runs.
        self.native = None
        if native_attempts:
            region = native.load_module().PlanRegion(lay.off, lay.size, lay.movable, page_size, span, alignment,
                                                     limit, mapped, _MAX_ROUNDS_AFTER_WAVE_1, _MAX_DROP_STEPS)
            self.native = region
            self.touched, self.forced, self.tpos = region.touched, region.forced, region.tpos
            self.first_pos, self.last_pos, self.by_density = region.first_pos, region.last_pos, region.by_density
            self.n_forced, self.lower_bound = region.n_forced, region.lower_bound
            self.pages_before = int(self.touched.size)
        else:
            self._init_python(limit, mapped)

    def _init_python(self, limit: int, mapped: np.ndarray | None) -> None:
        """The model of the native ``PlanRegion``'s page bookkeeping: touched, forced and fresh pages."""
        lay, P, span = self.lay, self.P, self.span
        off, size = lay.off, lay.size
        self.end = off + size
        self.src_gaps = _gaps(off, self.end, span)
        first = off // P
        last = (self.end - 1) // P
        self.fixed = ~lay.movable | (size >= P)
        # Touched pages, live bytes on each, and which are forced. The blocks
        # are sorted and disjoint, so the expanded page ids do not decrease.
        one = not np.count_nonzero(first != last)  # every block on one page: no expansion
        if one:
            pages = first
        else:
            pages, owner = _expand_pages(first, last)
        new = np.empty(pages.size, bool)
        new[0] = True
        np.not_equal(pages[1:], pages[:-1], out=new[1:])
        inv = new.cumsum() - 1
        self.touched = pages[new]
        T = self.touched.size
        self.forced = np.zeros(T, bool)
        if one:
            live_per_page = np.bincount(inv, weights=size, minlength=T)
            self.forced[inv[self.fixed]] = True
            self.first_pos = self.last_pos = inv  # each block's page as an index into `touched`
        else:
            lo = np.maximum(off[owner], pages * P)
            hi = np.minimum(self.end[owner], (pages + 1) * P)
            live_per_page = np.bincount(inv, weights=hi - lo, minlength=T)
            self.forced[inv[self.fixed[owner]]] = True
            # Each block's first/last page as an index into `touched`.
            ends = (last - first + 1).cumsum()
            self.first_pos = inv[ends - (last - first + 1)]
            self.last_pos = inv[ends - 1]
        self.n_forced = int(np.count_nonzero(self.forced))
        self.pages_before = int(T)
        self.lower_bound = max(self.n_forced, -(-int(size.sum()) // P))
        # Page table: page id -> index into `touched` (-1: untouched).
        self.tpos = None
        if self.npages <= _PAGE_TABLE_PAGES_PER_TOUCHED * T + _PAGE_TABLE_PAGES_ALWAYS:
            self.tpos = _filled(self.npages, -1, np.int64)
            self.tpos[self.touched] = np.arange(T)
        # Non-forced touched pages, densest first (ties: lower address first).
        cand = (~self.forced).nonzero()[0]
        self.by_density = cand[(-live_per_page[cand]).argsort(kind="stable")]
        # Pages nothing touches (unmapped, free now), longest runs first.
        self.fresh = self._fresh_pages(limit, mapped)

    def _fresh_pages(self, limit: int, mapped: np.ndarray | None) -> np.ndarray:
        """Up to ``limit`` pages no block touches, in the order zones open them: longest runs first
        (with ``mapped``, mapped ones first: a destination there costs no mapping)."""
        if not limit:
            # No page may be opened (an explicit compaction without empty mapped pages): none to list.
            return np.empty(0, np.int64)
        P = self.P
        t_s, t_e = _page_runs(self.touched, P)
        free_s, free_e = _gaps(t_s, t_e, self.span)
        run_s, run_n = free_s // P, (free_e - free_s) // P
        if mapped is not None:
            # Each kind in runs, longest first.
            pages = _expand_runs(run_s, run_n)
            on = mapped[pages]
            return np.concatenate((_runs_first(pages[on]), _runs_first(pages[~on])))[:limit]
        o = (-run_n).argsort(kind="stable")
        run_s, run_n = run_s[o], run_n[o]
        before = run_n.cumsum() - run_n
        use = np.clip(limit - before, 0, run_n)
        return _expand_runs(run_s, use)

    # -- page bookkeeping ---------------------------------------------------

    def _tix(self, pages: np.ndarray) -> np.ndarray:
        """Index into ``touched`` of pages that are touched."""
        if self.tpos is not None:
            return self.tpos[pages]
        return self.touched.searchsorted(pages)

    def _member(self, x: np.ndarray, pages: np.ndarray) -> np.ndarray:
        """``np.isin(x, pages)`` for page ids inside the region."""
        if self.tpos is None:
            return np.isin(x, pages)
        m = np.zeros(self.npages, bool)
        m[pages] = True
        return m[x]

    def _expand(self, pos: np.ndarray, idx: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Pages touched by blocks ``idx`` (None: all) placed at ``pos[idx]`` (with repeats), and bytes on each."""
        P = self.P
        o, sz = (pos, self.lay.size) if idx is None else (pos[idx], self.lay.size[idx])
        first, last = o // P, (o + sz - 1) // P
        one = first == last  # most blocks: all their bytes on one page
        if np.count_nonzero(one) == one.size:
            return first, sz
        many = (~one).nonzero()[0]
        pages, owner = _expand_pages(first[many], last[many])
        s = o[many][owner]
        e = s + sz[many][owner]
        part = np.minimum(e, (pages + 1) * P) - np.maximum(s, pages * P)
        return np.concatenate((first[one], pages)), np.concatenate((sz[one], part))

    def _touched_bytes(self, pos: np.ndarray, idx: np.ndarray) -> np.ndarray:
        """Live bytes per touched page of blocks ``idx`` at ``pos[idx]``, all on touched pages."""
        pages, b = self._expand(pos, idx)
        return np.bincount(self._tix(pages), weights=b, minlength=self.touched.size)

    def _final_pages(self, pos: np.ndarray) -> tuple[int, np.ndarray]:
        """Pages touched by every block at ``pos``, and live bytes per touched page (of now)."""
        pages, b = self._expand(pos, None)
        if self.tpos is not None:
            per_page = np.bincount(pages, weights=b, minlength=self.npages)
            return int(np.count_nonzero(per_page)), per_page[self.touched]
        uniq, inv = np.unique(pages, return_inverse=True)
        used = np.bincount(inv, weights=b, minlength=uniq.size)
        out = np.zeros(self.touched.size)
        at = np.minimum(self.touched.searchsorted(uniq), self.touched.size - 1)
        hit = self.touched[at] == uniq
        out[at[hit]] = used[hit]
        return int(uniq.size), out

    def _largest_first(self, idx: np.ndarray) -> np.ndarray:
        """Distinct mover indices ``idx`` by size, largest first (ties: lower index first)."""
        size, n = self.lay.size, self.lay.off.size
        cap = self.P // self.A  # movers are shorter than a page: size // A < cap
        if cap > _UINT16_KEYS:
            return idx[np.lexsort((idx, -size[idx]))]
        if idx.size > 1 and np.count_nonzero(idx[1:] < idx[:-1]):
            m = np.zeros(n, bool)
            m[idx] = True
            idx = m.nonzero()[0]
        # A stable sort of 16-bit keys is a radix sort.
        return idx[(cap - 1 - size[idx] // self.A).astype(np.uint16).argsort(kind="stable")]

    # -- kept sets ------------------------------------------------------------

    def keep_densest(self, k: int) -> np.ndarray:
        kept = self.forced.copy()
        kept[self.by_density[:k]] = True
        return kept

    def drop(self, r: _Result, target: int) -> np.ndarray | None:
        """Retry: also stop keeping the kept pages that ended up emptiest."""
        droppable = (r.kept & ~self.forced & (r.waste > 0)).nonzero()[0]
        if not droppable.size:
            return None
        droppable = droppable[(-r.waste[droppable]).argsort(kind="stable")]
        excess = (r.pages_after - target) * self.P
        n_drop = int(r.waste[droppable].cumsum().searchsorted(excess)) + 1
        kept = r.kept.copy()
        kept[droppable[:n_drop]] = False
        return kept

    def swap(self, r: _Result, target: int) -> np.ndarray | None:
        """Retry: keep the pages of blocks that had to go to zone pages (no
        kept hole fit them) and stop keeping as many of the emptiest kept pages."""
        P, size = self.P, self.lay.size
        kept_pages = self.touched[r.kept]
        d, d_end = r.dst, r.dst + size[r.mover_idx]
        in_kept = self._member(d // P, kept_pages) & self._member((d_end - 1) // P, kept_pages)
        zoned = r.mover_idx[~in_kept]
        if not zoned.size:
            return None
        add = np.zeros(self.touched.size, bool)
        add[self.first_pos[zoned]] = True
        add[self.last_pos[zoned]] = True
        add &= ~r.kept
        removable = (r.kept & ~self.forced & ~add).nonzero()[0]
        removable = removable[(-r.waste[removable]).argsort(kind="stable")]
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

    # -- one attempt ----------------------------------------------------------

    def attempt(self, kept: np.ndarray) -> _Result:
        """Evacuate the pages not in ``kept`` (steps 3-5 of the module docstring): the native
        ``PlanRegion.attempt`` unless the model was asked for (the same result)."""
        if self.native is None:
            return self.attempt_python(kept)
        k, moved, dst, rounds, pages_after, moved_bytes, waste, movers = self.native.attempt(kept)
        return _Result(k, moved, dst, rounds, pages_after, moved_bytes, waste, movers)

    def attempt_python(self, kept: np.ndarray) -> _Result:
        """:meth:`attempt` in numpy: the model of ``defrag/native/plan_attempt.h``, same result."""
        P, span = self.P, self.span
        off, size, end = self.lay.off, self.lay.size, self.end
        n = off.size
        kept = kept.copy()
        mover = self._movers(kept)
        dst = _filled(n, -1, np.int64)
        waiting = _filled(n, True, bool)  # still at its source
        pending = self._largest_first(mover.nonzero()[0])
        movers = pending.size

        # Steps 3-4, up to _MAX_DROP_STEPS + 1 times: best-fit pending blocks into
        # kept-page holes that are free now (wave 1), then drop the kept pages
        # whose holes stayed emptiest: their contents, packed into contiguous
        # zone pages instead, waste (almost) nothing. Dropping a page turns the
        # blocks placed into it and those straddling into it into pending
        # blocks, which is why this repeats.
        gaps = self.src_gaps
        for _ in range(_MAX_DROP_STEPS + 1):
            # Free space of kept pages: gaps between sources on kept pages (kept
            # only shrinks, so the last ones do), less where the placed blocks
            # go (all on kept pages: _drop undoes the others).
            gaps = _intersect(*_page_runs(self.touched[kept], P), *gaps)
            at = (~waiting).nonzero()[0]
            holes = _minus(*gaps, dst[at], dst[at] + size[at]) if at.size else gaps
            pending = self._place(pending, holes, dst, waiting)
            if not pending.size:
                break
            before = np.count_nonzero(kept)
            pending = self._drop(kept, mover, dst, waiting, pending)
            if np.count_nonzero(kept) == before:
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
        for r in range(2, _MAX_ROUNDS_AFTER_WAVE_1 + 2):
            if not pending.size:
                break
            at = (~waiting).nonzero()[0]
            free = _gaps(*_merge_intervals(off[waiting], end[waiting], dst[at], dst[at] + size[at]), span)
            vacated = self.touched[~kept & ~self._busy(waiting.nonzero()[0])]
            candidates = np.concatenate((fresh, _runs_first(vacated[~self._member(vacated, zone)])))
            new = candidates[: -(-int(size[pending].sum()) // P)]
            fresh = fresh[~self._member(fresh, new)]
            zone = np.concatenate((zone, new))
            h_s, h_e = _intersect(*_page_runs(np.union1d(self.touched[kept], zone), P), *free)
            # Space in pages already counted first, newly opened pages last.
            is_new = self._member(h_s // P, new) & self._member((h_e - 1) // P, new)
            o = np.concatenate(((~is_new).nonzero()[0], is_new.nonzero()[0]))
            before = pending.size
            pending = self._place(pending, (h_s[o], h_e[o]), dst, waiting)
            if pending.size < before:
                rounds = r
            elif not new.size:
                break  # no progress and nothing new to open: give up
        # Step 6 (waves) is done for the chosen attempt only; what is still
        # pending stays where it is.
        moved = (mover & (dst >= 0)).nonzero()[0]
        fin = off.copy()
        fin[moved] = dst[moved]
        pages_after, used = self._final_pages(fin)
        waste = np.where(used > 0, P - used, 0.0)
        waste[~kept] = 0
        return _Result(kept, moved, dst[moved], rounds, pages_after, int(size[moved].sum()), waste, movers)

    def _drop(self, kept, mover, dst, waiting, pending) -> np.ndarray:
        """Step 4; updates ``kept``, ``dst`` and ``waiting`` in place, returns the new pending."""
        P, off, size = self.P, self.lay.off, self.lay.size
        used = self._touched_bytes(np.where(waiting, off, dst), (~waiting | ~mover).nonzero()[0])
        waste = np.where(used > 0, P - used, 0.0)
        cand = (kept & ~self.forced & (waste > 0)).nonzero()[0]
        cand = cand[(-waste[cand]).argsort(kind="stable")]
        left = int(size[pending].sum()) - np.concatenate(([0], waste[cand].cumsum()))
        extra = -(-left // P)  # pages needed beyond the kept ones (may be < 0)
        # Never plan more zone pages than can be free soon: unmapped pages, and
        # evacuated pages that no pending block touches (empty after wave 1).
        # Dropping the first d candidates sends the blocks placed into them
        # back to pending, so their source pages stop counting: a page counts
        # for d drops iff it is evacuated, idle, and no block from it went to
        # one of the first d candidates.
        rank = np.full(self.touched.size, cand.size, np.int64)
        rank[cand] = np.arange(cand.size)
        placed = (mover & ~waiting).nonzero()[0]
        dp = dst[placed]
        dp_first = self._tix(dp // P)  # placed blocks lie on kept (touched) pages
        dp_last = self._tix((dp + size[placed] - 1) // P)
        r_f = np.minimum(rank[dp_first], rank[dp_last])
        first_drop = np.full(self.touched.size, cand.size, np.int64)
        np.minimum.at(first_drop, self.first_pos[placed], r_f)
        np.minimum.at(first_drop, self.last_pos[placed], r_f)
        idle = ~kept & ~self._busy(pending)
        lost = np.bincount(first_drop[idle], minlength=cand.size + 1)  # pages lost at each d
        supply = self.fresh.size + int(idle.sum()) - np.concatenate(([0], lost.cumsum()[:-1]))
        feasible = extra + np.arange(left.size) <= supply
        n_ok = max(1, int(np.argmin(feasible)) if not feasible.all() else feasible.size)
        d = int(np.argmin(extra[:n_ok]))  # fewest drops that reach the fewest pages
        if not d:
            return pending
        kept[cand[:d]] = False
        # Blocks placed into dropped pages go back to pending; blocks that
        # straddled into a dropped page become movers.
        gone = np.zeros(self.touched.size, bool)
        gone[cand[:d]] = True
        undo = placed[gone[dp_first] | gone[dp_last]]
        dst[undo] = -1
        waiting[undo] = True
        return self._largest_first(np.concatenate((pending, undo, (self._movers(kept) & ~mover).nonzero()[0])))

    def _place(self, pending: np.ndarray, holes, dst: np.ndarray, waiting: np.ndarray) -> np.ndarray:
        """Best-fit ``pending`` (largest first) into ``holes``; returns what did not fit."""
        size = self.lay.size
        if not holes[0].size:
            return pending
        placed = _best_fit(*holes, size[pending], self.A, self.P // self.A)
        ok = placed >= 0
        dst[pending[ok]] = placed[ok]
        waiting[pending[ok]] = False
        return pending[~ok]

    def waves(self, r: _Result) -> tuple[np.ndarray, np.ndarray]:
        """Step 6 (:meth:`waves_python`): the native ``PlanRegion.waves`` unless the model was asked for."""
        if self.native is None:
            return self.waves_python(r)
        return self.native.waves(r.mover_idx, r.dst)

    def waves_python(self, r: _Result) -> tuple[np.ndarray, np.ndarray]:
        """Step 6: smallest consistent wave per move, one after every block whose source it covers.

        Returns the order of the moves (into ``r.mover_idx`` and ``r.dst``)
        by wave, then destination (all destinations are distinct), and their
        waves in that order. Terminates: a destination only covers sources
        vacated in an earlier round, so the dependencies are acyclic and at
        most ``rounds`` deep.
        """
        off, size = self.lay.off, self.lay.size
        by_dst = r.dst.argsort()  # sorted queries also search faster
        moved, d = r.mover_idx[by_dst], r.dst[by_dst]
        lo = self.end.searchsorted(d, side="right")  # first source ending after d
        hi = off.searchsorted(d + size[moved], side="left")  # sources starting before the end
        idx = (hi > lo).nonzero()[0]
        wave = _filled(moved.size, 1, np.int64)
        if idx.size:
            bounds = np.empty(2 * idx.size, np.int64)
            bounds[0::2] = lo[idx]
            bounds[1::2] = hi[idx]
            wave_of = np.zeros(off.size + 1, np.int64)  # +1: reduceat bounds may equal off.size
            while True:
                wave_of[moved] = wave
                new = wave.copy()
                new[idx] = np.maximum.reduceat(wave_of, bounds)[0::2] + 1
                if not np.count_nonzero(new != wave):
                    break
                wave = new
        # A stable sort of 8-bit keys is a radix sort.
        by_wave = (wave.astype(np.uint8) if wave.max() < _UINT8_KEYS else wave).argsort(kind="stable")
        return by_dst[by_wave], wave[by_wave]


def plan_arrays(
    offsets: np.ndarray,
    sizes: np.ndarray,
    movable: np.ndarray,
    *,
    page_size: int,
    span: int,
    alignment: int = ALIGNMENT,
    max_new_pages: int | None = None,
    mapped: np.ndarray | None = None,
) -> ArrayPlan:
    """Plan moves that leave the live blocks on as few pages as possible.

    Block ``i`` is ``[offsets[i], offsets[i] + sizes[i])``, movable iff
    ``movable[i]``; the arrays are parallel (integers and booleans, any
    order) and ``i`` is the block's key in the plan's ``index``.
    ``max_new_pages`` caps how many pages that no live block touches now
    (likely unmapped) the plan may use as destinations; ``None``: no cap;
    ``0``: only pages touched now, for when no physical page is free to map
    (the plan then never needs more pages than the region holds now).
    ``mapped`` (optional, one bool per page of ``span``) says which pages are
    mapped: untouched mapped pages are then used before unmapped ones, so a
    destination costs no mapping while an empty mapped page is left. Never
    more pages remain than without the hint (when the hinted plan misses the
    lower bound, the plain one is computed too and the better one kept).

    Raises :class:`PlanError` on bad input (blocks named by index). The input
    arrays are not modified. The plan passes :func:`validate_arrays`, is
    sorted by wave then destination (each wave a contiguous slice), has
    ``pages_after <= pages_before``, and is empty when no page can be freed;
    within a wave no destination overlaps any source or other destination
    (see :class:`ArrayPlan` for all it guarantees). The same blocks in any
    order give the same plan. See the module docstring for the algorithm and
    for what it does not guarantee (optimality).
    """
    return _plan_arrays(offsets, sizes, movable, page_size=page_size, span=span, alignment=alignment,
                        max_new_pages=max_new_pages, mapped=mapped, native_attempts=True)


def _plan_arrays(offsets, sizes, movable, *, page_size: int, span: int, alignment: int, max_new_pages: int | None,
                 mapped: np.ndarray | None, native_attempts: bool) -> ArrayPlan:
    """:func:`plan_arrays`; ``native_attempts=False`` runs the Python model of the page bookkeeping,
    attempts and waves (:meth:`_Planner._init_python`, :meth:`_Planner.attempt_python`,
    :meth:`_Planner.waves_python`) instead of the native ``PlanRegion``: the same plan, which
    tests/cpu/test_native_attempt.py checks."""
    off, size, mov = _layout_arrays(offsets, sizes, movable)
    _check_geometry(page_size, span, alignment)
    if max_new_pages is not None and max_new_pages < 0:
        raise PlanError(f"max_new_pages must be >= 0 or None, got {max_new_pages}")
    if mapped is not None:
        mapped = np.asarray(mapped, dtype=bool)
        if mapped.shape != (span // page_size,):
            raise PlanError(f"mapped needs one entry per page of the span ({span // page_size}), got shape "
                            f"{mapped.shape}")
        if max_new_pages == 0:
            mapped = None  # no page may be opened: the hint changes nothing, nor needs a second plan
    lay = _layout(off, size, mov, span=span, alignment=alignment)
    plan = _plan(lay, page_size, span, alignment, max_new_pages, mapped, native_attempts)
    if mapped is not None and plan.pages_lower_bound is not None and plan.pages_after > plan.pages_lower_bound:
        # Scattered mapped pages can cost the packing of blocks that would have
        # straddled two adjacent unmapped pages: keep the hint only if it loses nothing.
        plain = _plan(lay, page_size, span, alignment, max_new_pages, None, native_attempts)
        if plain.pages_after < plan.pages_after:
            plan = plain
    return plan


def _plan(lay: _Layout, page_size: int, span: int, alignment: int, max_new_pages: int | None,
          mapped: np.ndarray | None = None, native_attempts: bool = True) -> ArrayPlan:
    if lay.off.size == 0:
        return _empty_arrays(page_size, 0, 0)
    pl = _Planner(lay, page_size, span, alignment, max_new_pages, mapped, native_attempts)
    target = pl.lower_bound
    if pl.pages_before <= target:
        return _empty_arrays(page_size, pl.pages_before, target)

    # Step 2 and the retries (step 7).
    best = pl.attempt(pl.keep_densest(target - pl.n_forced))
    work, attempts = best.movers, 1
    tried = {best.kept.tobytes()}
    base, gens = best, [pl.swap, pl.drop]
    while best.pages_after > target and gens and attempts < _MAX_ATTEMPTS and work <= _RETRY_MAX_MOVERS:
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
        return _empty_arrays(page_size, pl.pages_before, target)

    order, wave = pl.waves(best)  # by wave, then destination
    idx = best.mover_idx[order]
    return ArrayPlan(
        lay.inputs(idx), lay.off[idx], best.dst[order], lay.size[idx], wave,
        page_size, pl.pages_before, best.pages_after, best.moved_bytes, target,
    )


# --------------------------------------------------------------------------
# The conveyor: blocks of a page or more, packed end to end
# --------------------------------------------------------------------------

def plan_conveyor(
    offsets: np.ndarray,
    sizes: np.ndarray,
    movable: np.ndarray,
    *,
    page_size: int,
    span: int,
    zone_ok: np.ndarray,
    max_pages: int,
    alignment: int = ALIGNMENT,
) -> ArrayPlan:
    """One wave that packs blocks of a page or more end to end into a free zone, when that frees pages.

    A block of a page or more strands the free tail of its last page unless
    something small fills it; :func:`plan_arrays` never moves such blocks.
    This plan takes the longest run of pages that ``zone_ok`` allows (one
    bool per page: no live block touches it, and it may be backed), at most
    ``max_pages`` long, and packs movable blocks of a page or more into it
    back to back from its start (so each shares a page with the next), the
    ones stranding the most bytes per byte moved first, while they fit.
    Pages that only moved blocks touched become free.

    Returns an empty plan unless the pages freed exceed the zone pages used
    by at least one, and at most ``CONVEYOR_MAX_PAGES_MOVED_PER_PAGE_GAINED``
    pages' worth of bytes move per page gained. Destinations lie only in the zone, so the
    wave overlaps no source. Does not: move blocks shorter than a page (that
    is :func:`plan_arrays`' job), or chain zones (call it again after the
    wave: the pages it freed may form the next zone).
    """
    off, size, mov = _layout_arrays(offsets, sizes, movable)
    _check_geometry(page_size, span, alignment)
    P = page_size
    zone_ok = np.asarray(zone_ok, dtype=bool)
    if zone_ok.shape != (span // P,):
        raise PlanError(f"zone_ok needs one entry per page of the span ({span // P}), got shape {zone_ok.shape}")
    lay = _layout(off, size, mov, span=span, alignment=alignment)
    off, size, mov = lay.off, lay.size, lay.movable
    n = off.size
    if n == 0 or max_pages < 1:
        return _empty_arrays(P, 0, None)
    first, last = off // P, (off + size - 1) // P
    # Sorted, disjoint blocks share a page only where one ends and the next begins.
    shared_next = np.zeros(n, bool)
    shared_next[:-1] = last[:-1] == first[1:]
    shared_prev = np.zeros(n, bool)
    shared_prev[1:] = shared_next[:-1]
    pages_before = int((last - first + 1).sum() - shared_next.sum())
    big = np.flatnonzero(mov & (size >= P))
    # The zone: the longest run of allowed pages no block touches (a difference
    # array over the pages: no per-page expansion of large blocks).
    depth = np.zeros(zone_ok.size + 1, np.int64)
    np.add.at(depth, first, 1)
    np.add.at(depth, last + 1, -1)
    ok = zone_ok & (np.cumsum(depth[:-1]) == 0)
    runs_s, runs_e = _page_runs(np.flatnonzero(ok), P)
    if not big.size or not runs_s.size:
        return _empty_arrays(P, pages_before, None)
    longest = int(np.argmax(runs_e - runs_s))
    z0 = int(runs_s[longest])
    zlen = min(int(runs_e[longest] - runs_s[longest]) // P, max_pages) * P
    # Pages each candidate alone touches become free when it moves: all of its
    # pages but a first or last one it shares with a neighbour.
    alone = (last - first + 1) - shared_prev - shared_next
    alone = np.maximum(alone, 0)
    waste = alone[big] * P - size[big]  # bytes it strands (negative: it shares its pages)
    keep = waste >= alignment
    big, waste = big[keep], waste[keep]
    order = np.lexsort((off[big], -waste / size[big]))
    chosen, dst, cursor = [], [], 0
    for i in big[order].tolist():
        if cursor + int(size[i]) <= zlen:
            chosen.append(i)
            dst.append(z0 + cursor)
            cursor += int(size[i])
    if not chosen:
        return _empty_arrays(P, pages_before, None)
    idx = np.array(chosen, np.int64)
    used = -(-cursor // P)
    freed = int(alone[idx].sum())
    moved = int(size[idx].sum())
    if freed - used < 1 or moved > CONVEYOR_MAX_PAGES_MOVED_PER_PAGE_GAINED * (freed - used) * P:
        return _empty_arrays(P, pages_before, None)
    dst = np.array(dst, np.int64)
    o = np.argsort(dst, kind="stable")
    idx, dst = idx[o], dst[o]
    return ArrayPlan(lay.inputs(idx), off[idx], dst, size[idx], np.ones(idx.size, np.int64), P,
                     pages_before, pages_before - freed + used, moved, None)


# --------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------


def validate_arrays(
    offsets: np.ndarray, sizes: np.ndarray, movable: np.ndarray, plan: ArrayPlan, *, span: int,
    alignment: int = ALIGNMENT,
) -> None:
    """Raise :class:`PlanError` unless ``plan`` is safe to run on the layout.

    Checks: the input is valid; every move names a live block by index with
    its current offset and size, each block moves at most once and only if
    movable; destinations are aligned (page-aligned for blocks of a page or
    more) and inside ``[0, span)``; waves are numbered ``1 .. waves`` with
    none empty and the moves are in wave order (what
    :meth:`ArrayPlan.wave_slices` needs); within a wave no destination
    overlaps a source or another destination; a destination is free when its
    wave runs (nothing that has not left in an earlier wave is there); the
    final layout does not overlap; and the plan's ``pages_before``,
    ``pages_after`` and ``moved_bytes`` are right. Does not check that the
    plan is good, only that it is safe and honest.
    """
    off, size, mov = _layout_arrays(offsets, sizes, movable)
    _check_geometry(plan.page_size, span, alignment)
    _validate(_layout(off, size, mov, span=span, alignment=alignment), plan, span=span, alignment=alignment)


def _validate(lay: _Layout, plan: ArrayPlan, *, span: int, alignment: int, large_on_pages: bool = True) -> None:
    """The checks of :func:`validate_arrays`, in its order. ``large_on_pages=False`` lets a block of a page
    or more land off a page boundary (:func:`plan_window_arrays` puts such blocks into free page tails, as
    the pool's own placement does)."""
    n = lay.off.size
    _check_waves_and_keys(plan, n)
    # Sorted-layout positions of the moved blocks.
    if lay.order is None:
        mv = plan.index
    else:
        rank = np.empty(n, np.int64)
        rank[lay.order] = np.arange(n)
        mv = rank[plan.index]
    _check_moves(lay, plan, mv, span=span, alignment=alignment, large_on_pages=large_on_pages)
    leave = np.zeros(n, np.int64)  # wave in which the block moves; 0 = stays
    leave[mv] = plan.wave
    if mv.size:
        _check_destinations_free(lay, plan, leave)
    final = lay.off.copy()
    final[mv] = plan.dst
    _check_final_layout(lay, plan, final)


def _check_waves_and_keys(plan: ArrayPlan, n: int) -> None:
    """Moves in wave order, waves ``1 .. waves`` none empty, every index naming one of the ``n`` blocks."""
    wv = plan.wave
    if wv.size:
        if wv[0] < 1 or (np.diff(wv) < 0).any():
            raise PlanError("moves must be in wave order, waves numbered from 1")
        gap = np.flatnonzero(np.diff(wv) > 1)
        if wv[0] > 1 or gap.size:
            raise PlanError(f"wave {1 if wv[0] > 1 else int(wv[gap[0]]) + 1} is empty")
    bad = np.flatnonzero((plan.index < 0) | (plan.index >= n))
    if bad.size:
        raise PlanError(f"move of unknown block {int(plan.index[bad[0]])}")


def _check_moves(lay: _Layout, plan: ArrayPlan, mv: np.ndarray, *, span: int, alignment: int,
                 large_on_pages: bool) -> None:
    """Each move on its own: its block (sorted position ``mv``) moves once, from where it is, with its
    size, only if movable, to an aligned destination inside the span (on a page boundary if
    ``large_on_pages`` and the block is a page or more)."""
    off, size, movable = lay.off, lay.size, lay.movable
    P, wv, d, sz = plan.page_size, plan.wave, plan.dst, plan.size
    if mv.size:
        o = np.argsort(mv, kind="stable")
        twice = np.flatnonzero(mv[o][1:] == mv[o][:-1])
        if twice.size:
            j1, j2 = int(o[twice[0]]), int(o[twice[0] + 1])
            raise PlanError(f"block {int(plan.index[j1])} moves twice (waves {wv[j1]} and {wv[j2]})")
    for j in np.flatnonzero((plan.src != off[mv]) | (sz != size[mv]))[:1].tolist():
        i = int(mv[j])
        raise PlanError(f"move of {int(plan.index[j])} says [{plan.src[j]}, +{sz[j]}) "
                        f"but the block is [{off[i]}, +{size[i]})")
    for j in np.flatnonzero(~movable[mv])[:1].tolist():
        raise PlanError(f"block {int(plan.index[j])} is pinned but moves")
    for j in np.flatnonzero((d < 0) | (d > span - sz) | (d % alignment != 0))[:1].tolist():
        raise PlanError(f"move of {int(plan.index[j])} to {d[j]} is misaligned or outside [0, {span})")
    for j in np.flatnonzero((sz >= P) & (d % P != 0) & large_on_pages)[:1].tolist():
        raise PlanError(f"block {int(plan.index[j])} of {sz[j]} bytes must land on a page boundary, "
                        f"not {d[j]}")


def _check_destinations_free(lay: _Layout, plan: ArrayPlan, leave: np.ndarray) -> None:
    """Per wave: destinations overlap neither each other nor any source of the wave, and are free: no block
    is still there when the wave runs (one that never moves, ``leave`` 0, or moves in that wave or later)."""
    off, end = lay.off, lay.off + lay.size
    wv, d = plan.wave, plan.dst
    de = d + plan.size
    o = np.lexsort((d, wv))
    same = wv[o][1:] == wv[o][:-1]
    clash = np.flatnonzero(same & (d[o][1:] < de[o][:-1]))
    if clash.size:
        raise PlanError(f"wave {wv[o][clash[0]]}: destinations overlap")
    # Sources overlapping each destination form the index range [lo, hi).
    lo = np.searchsorted(end, d, side="right")
    hi = np.searchsorted(off, de, side="left")
    # A block still there when wave w runs: it never moves (leave = inf)
    # or moves in wave >= w. Check the latest leaver per range at once.
    still = np.append(np.where(leave == 0, np.iinfo(np.int64).max, leave), 0)
    idx = np.flatnonzero(hi > lo)
    if not idx.size:
        return
    bounds = np.empty(2 * idx.size, np.int64)
    bounds[0::2] = lo[idx]
    bounds[1::2] = hi[idx]
    latest = np.maximum.reduceat(still, bounds)[0::2]
    bad = np.flatnonzero(latest >= wv[idx])
    if bad.size:
        j = int(idx[bad[0]])
        blockers = still[lo[j]:hi[j]]
        b = int(lo[j]) + int(np.flatnonzero(blockers >= wv[j])[0])
        who = int(lay.inputs(np.array([b]))[0])
        raise PlanError(
            f"wave {wv[j]}: {int(plan.index[j])} lands on [{d[j]}, {de[j]}) where "
            f"{who} still is (it {'never moves' if not leave[b] else f'moves in wave {leave[b]}'})"
        )


def _check_final_layout(lay: _Layout, plan: ArrayPlan, final: np.ndarray) -> None:
    """The blocks at ``final`` (sorted positions' offsets after the plan) do not overlap, and the plan's
    ``pages_before``, ``pages_after`` and ``moved_bytes`` are exact."""
    P, n, size = plan.page_size, lay.off.size, lay.size
    o = np.argsort(final, kind="stable")
    fs, fe = final[o], final[o] + size[o]
    if n > 1 and (fs[1:] < fe[:-1]).any():
        i = int(np.flatnonzero(fs[1:] < fe[:-1])[0])
        a, b = lay.inputs(o[i:i + 2])
        raise PlanError(f"final layout: {int(a)} and {int(b)} overlap")
    before = _page_union_count(lay.off // P, (lay.off + size - 1) // P) if n else 0
    after = _page_union_count(fs // P, (fe - 1) // P) if n else 0
    moved = int(plan.size.sum())
    if (plan.pages_before, plan.pages_after, plan.moved_bytes) != (before, after, moved):
        raise PlanError(
            f"plan claims pages {plan.pages_before}->{plan.pages_after}, {plan.moved_bytes} bytes moved; "
            f"actual {before}->{after}, {moved} bytes"
        )


# --------------------------------------------------------------------------
# One move that merges two free ranges
# --------------------------------------------------------------------------


def plan_hole_arrays(
    offsets: np.ndarray, sizes: np.ndarray, movable: np.ndarray,
    free_offsets: np.ndarray, free_sizes: np.ndarray, size: int, *,
    page_size: int, span: int, alignment: int = ALIGNMENT,
) -> ArrayPlan | None:
    """The cheapest single move that turns two free ranges into one hole of ``size`` bytes.

    The blocks are as for :func:`plan_arrays`; ``free_offsets`` and
    ``free_sizes`` are the free ranges in address order, relative to the
    region like the blocks' offsets. For a sub-page request when no page can
    be emptied (the live bytes need every page) but the free bytes are split:
    a movable block lying exactly between two consecutive free ranges, whose
    sum with it reaches ``size``, moves (best fit: the shortest free range
    that holds it, then the lowest address; one starting on a page boundary
    for a block of a page or more) to the start of a third free range. Of
    all such blocks the shortest moves (ties: the first pair). One wave, one
    move; no page the blocks do not already touch is needed unless the
    chosen free range lies on one. Returns None when no such block exists.
    Does not consider moving two blocks, or blocks next to unmapped space.
    The plan passes :func:`validate_arrays`; ``pages_lower_bound`` is None.
    """
    off, bsize, mov = _layout_arrays(offsets, sizes, movable)
    _check_geometry(page_size, span, alignment)
    lay = _layout(off, bsize, mov, span=span, alignment=alignment)
    fo, fs = _free_arrays(free_offsets, free_sizes)
    n = lay.off.size
    if fo.size < 2 or not n:
        return None
    a_off, a_sz, b_off, b_sz = fo[:-1], fs[:-1], fo[1:], fs[1:]
    a_end = a_off + a_sz
    # The block starting where free range a ends (sorted position j).
    j = np.minimum(np.searchsorted(lay.off, a_end), n - 1)
    bsz = lay.size[j]
    ok = (lay.off[j] == a_end) & lay.movable[j] & (a_end + bsz == b_off) & (a_sz + bsz + b_sz >= size)
    pair = np.flatnonzero(ok)
    if not pair.size:
        return None
    # Destination: the first free range in (size, offset) order that holds
    # the block and is neither neighbour (and starts a page, for a block of a
    # page or more).
    by_size = np.lexsort((fo, fs))
    s_sz, s_off = fs[by_size], fo[by_size]
    m = fo.size
    need = bsz[pair]
    pos = np.searchsorted(s_sz, need, side="left")
    nb_a, nb_b = a_off[pair], b_off[pair]
    slow = need >= page_size
    for _ in range(_HOLE_NEIGHBOURS + 1):  # distinct offsets: at most the neighbours to skip, then a check
        p = np.minimum(pos, m - 1)
        skip = (pos < m) & ((s_off[p] == nb_a) | (s_off[p] == nb_b))
        if not skip.any():
            break
        pos = pos + skip
    else:  # free ranges sharing offsets: skip one at a time
        slow |= skip
    for k in np.flatnonzero(slow & (pos < m)).tolist():
        large = need[k] >= page_size
        while pos[k] < m and (s_off[pos[k]] in (nb_a[k], nb_b[k]) or (large and s_off[pos[k]] % page_size)):
            pos[k] += 1
    has = pos < m
    if not has.any():
        return None
    k = int(np.argmin(np.where(has, need, np.iinfo(np.int64).max)))  # shortest; ties: lowest address
    jj, dst = int(j[pair[k]]), int(s_off[pos[k]])
    moved_size = int(bsz[pair[k]])
    src = int(lay.off[jj])
    P = page_size
    first, last = lay.off // P, (lay.off + lay.size - 1) // P
    before = _page_union_count(first, last)
    first[jj], last[jj] = dst // P, (dst + moved_size - 1) // P
    after = _page_union_count(first, last)
    one = np.ones(1, np.int64)
    plan = ArrayPlan(lay.inputs(np.array([jj])), src * one, dst * one, moved_size * one, one,
                     page_size, before, after, moved_size, None)
    _validate(lay, plan, span=span, alignment=alignment)
    return plan


# --------------------------------------------------------------------------
# A window evacuated for a request of a page or more
# --------------------------------------------------------------------------

def plan_window_arrays(
    offsets: np.ndarray, sizes: np.ndarray, movable: np.ndarray,
    free_offsets: np.ndarray, free_sizes: np.ndarray, size: int, *,
    page_size: int, span: int, mapped: np.ndarray, spare_pages: int, alignment: int = ALIGNMENT,
) -> ArrayPlan | None:
    """The cheapest evacuation (in bytes moved) of a window of ``size`` bytes, for a request of a page or more.

    For a request that no placement serves after the automatic compaction:
    every page but a few is needed, the free bytes lie in tails between
    large blocks, and a contiguous free range needs the request to share a
    page with a block that stays. Blocks, ``free_offsets``/``free_sizes``
    (the heap's free ranges, in mapped pages) and offsets are as for
    :func:`plan_hole_arrays`; ``mapped`` has one bool per page of the span;
    ``spare_pages`` counts the physical pages to be had besides this
    region's empty mapped pages (cached or creatable ones, empty pages of
    other regions).

    A window ``[w, w + size)`` qualifies when every byte of it is free,
    unmapped or in a movable block, and its blocks fit, one by one (largest
    first), into free ranges outside it: each where it touches the fewest
    pages no block touches (starting at a free range's start, so it fills
    the tail of a page; ending at its end; or on a page boundary), then in
    the shortest range, then at the lowest address. After the moves its
    unmapped pages must be backable: no more than ``spare_pages`` plus the
    mapped pages outside it that no block touches then. Windows start where
    a block or free range ends or at a page boundary, or end where a block
    or free range starts or at a page boundary; the cheapest (bytes moved,
    then unmapped pages, then address) of the first ``MAX_WINDOW_TRIES`` that
    pass cheap bounds wins.

    Returns an :class:`ArrayPlan` of one wave (destinations only in free
    ranges: they overlap no source; blocks of a page or more may land off a
    page boundary, in a free tail) whose ``hole`` is ``(w, size)``: after
    the wave, the caller maps the window's unmapped pages (unmapping empty
    pages outside it first) and the request fits there. The plan may move
    nothing (the window is free but needs mapping). None when no window
    qualifies. Does not chain waves, move blocks into unmapped pages, or
    use space the moved blocks vacate.
    """
    off, bsize, mov = _layout_arrays(offsets, sizes, movable)
    _check_geometry(page_size, span, alignment)
    lay = _layout(off, bsize, mov, span=span, alignment=alignment)
    fo, fs = _free_arrays(free_offsets, free_sizes)
    npages = span // page_size
    mapped = np.asarray(mapped, dtype=bool)
    if mapped.shape != (npages,):
        raise PlanError(f"mapped needs one entry per page of the span ({npages}), got shape {mapped.shape}")
    size = int(size)
    if size <= 0 or size % alignment:
        raise PlanError(f"size {size} must be a positive multiple of alignment {alignment}")
    if size > span:
        return None
    keep = fs > 0
    fo, fs = fo[keep], fs[keep]
    # Blocks touching each page (a difference array: no per-page expansion of large blocks).
    depth = np.zeros(npages + 1, np.int64)
    np.add.at(depth, lay.off // page_size, 1)
    np.add.at(depth, (lay.off + lay.size - 1) // page_size + 1, -1)
    count = np.cumsum(depth[:-1])
    windows = _window_candidates(lay, fo, fs, mapped, count, size, page_size, spare_pages, alignment)
    if windows is None:
        return None
    return _first_packable_window(lay, fo, fo + fs, mapped, count, windows, size, spare_pages, page_size, alignment)


class _Windows(NamedTuple):
    """Windows ``[start, start + size)`` that pass :func:`_window_candidates`' bounds, in the order to try."""

    start: np.ndarray
    lo: np.ndarray  # sorted blocks lo .. hi - 1 intersect the window
    hi: np.ndarray
    first_page: np.ndarray
    last_page: np.ndarray
    unmapped_pages: np.ndarray  # unmapped pages of the window
    order: list[int]  # cheapest first (bytes moved, unmapped pages, address); at most MAX_WINDOW_TRIES


def _window_candidates(lay: _Layout, fo: np.ndarray, fs: np.ndarray, mapped: np.ndarray, count: np.ndarray,
                       size: int, P: int, spare_pages: int, alignment: int) -> _Windows | None:
    """The windows worth packing for :func:`plan_window_arrays`, or None.

    A candidate starts where a block, free range or unmapped run ends or at a
    page boundary, or ends where one starts or at a page boundary. It passes
    when it lies inside one run of free, unmapped or block space, holds no
    block that cannot move, its unmapped pages can be backed by the spare
    pages, the empty mapped pages outside it and the pages outside it its
    straddling blocks leave, and the free bytes outside it can hold its
    blocks' bytes. Necessary, not sufficient: :func:`_pack_window` decides.
    """
    span = mapped.size * P
    fe = fo + fs
    o, z, m = lay.off, lay.size, lay.movable
    e = o + z
    bfirst, blast = o // P, (e - 1) // P
    empty = mapped & (count == 0)
    un_s, un_e = _page_runs(np.flatnonzero(~mapped), P)
    run_s, run_e = _union_runs(np.concatenate((fo, un_s, o)), np.concatenate((fe, un_e, e)))
    if not run_s.size:
        return None

    bounds = np.arange(mapped.size + 1, dtype=np.int64) * P
    cand = np.concatenate((e, fo, un_s, bounds, o - size, fe - size, un_e - size, bounds - size))
    cand = np.unique(cand[(cand >= 0) & (cand <= span - size) & (cand % alignment == 0)])
    ce = cand + size
    r = np.searchsorted(run_s, cand, side="right") - 1
    ok = (r >= 0) & (run_e[np.maximum(r, 0)] >= ce)
    lo = np.searchsorted(e, cand, side="right")  # first block ending after the window's start
    hi = np.searchsorted(o, ce, side="left")     # blocks before hi start before the window's end
    cz = np.concatenate(([0], np.cumsum(z)))
    cost = cz[hi] - cz[lo]
    cfix = np.concatenate(([0], np.cumsum(~m)))
    ok &= cfix[hi] == cfix[lo]
    first, last = cand // P, (ce - 1) // P
    cun = np.concatenate(([0], np.cumsum(~mapped)))
    unmapped_in = cun[last + 1] - cun[first]
    cem = np.concatenate(([0], np.cumsum(empty)))
    empty_out = int(empty.sum()) - (cem[last + 1] - cem[first])
    # Bounds: pages outside the window that its straddling blocks leave, and free bytes outside it.
    has = hi > lo
    left = np.where(has, np.maximum(first - bfirst[np.minimum(lo, max(o.size - 1, 0))], 0), 0) if o.size else 0
    right = np.where(has, np.maximum(blast[np.maximum(hi - 1, 0)] - last, 0), 0) if o.size else 0
    ok &= unmapped_in <= spare_pages + empty_out + left + right
    cf = np.concatenate(([0], np.cumsum(fs)))
    flo = np.searchsorted(fe, cand, side="right")
    fhi = np.searchsorted(fo, ce, side="left")
    inside = cf[fhi] - cf[flo]
    fl = np.minimum(flo, max(fo.size - 1, 0))
    fh = np.maximum(fhi - 1, 0)
    if fo.size:
        some = fhi > flo
        inside = (inside - np.where(some, np.maximum(cand - fo[fl], 0), 0)
                  - np.where(some, np.maximum(fe[fh] - ce, 0), 0))
    ok &= cost <= int(fs.sum()) - inside
    good = np.flatnonzero(ok)
    if not good.size:
        return None
    good = good[np.lexsort((cand[good], unmapped_in[good], cost[good]))][:MAX_WINDOW_TRIES]
    return _Windows(cand, lo, hi, first, last, unmapped_in, good.tolist())


def _union_runs(s: np.ndarray, e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Maximal runs covered by intervals ``[s, e)`` (any order; overlapping or touching ones merge)."""
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    if not s.size:
        return s, e
    reach = np.maximum.accumulate(e)
    starts = np.flatnonzero(np.concatenate(([True], s[1:] > reach[:-1])))
    return s[starts], reach[np.concatenate((starts[1:] - 1, [s.size - 1]))]


def _first_packable_window(lay: _Layout, fo: np.ndarray, fe: np.ndarray, mapped: np.ndarray, count: np.ndarray,
                           windows: _Windows, size: int, spare_pages: int, P: int, alignment: int
                           ) -> ArrayPlan | None:
    """The plan of the first of ``windows`` whose blocks :func:`_pack_window` places outside it and whose
    unmapped pages can then be backed (by the spare pages and the mapped pages outside it that no block
    touches after the moves); None if none."""
    o, z = lay.off, lay.size
    bfirst, blast = o // P, (o + z - 1) // P
    for c in windows.order:
        w, a, b = int(windows.start[c]), int(windows.lo[c]), int(windows.hi[c])
        dst = _pack_window(o, z, fo, fe, count, mapped, w, w + size, a, b, P)
        if dst is None:
            continue
        after = count.copy()
        for i, d in zip(range(a, b), dst):
            after[bfirst[i]:blast[i] + 1] -= 1
            after[d // P:(d + int(z[i]) - 1) // P + 1] += 1
        donors = mapped & (after == 0)
        donors[windows.first_page[c]:windows.last_page[c] + 1] = False
        if windows.unmapped_pages[c] > spare_pages + int(donors.sum()):
            continue
        return _window_plan(lay, np.arange(a, b, dtype=np.int64), np.array(dst, np.int64), (w, size), P,
                            mapped.size * P, alignment)
    return None


def _pack_window(o, z, fo, fe, count, mapped, w0, w1, a, b, P) -> list[int] | None:
    """Destinations (in block order a..b-1) for the blocks of window [w0, w1) in free ranges outside it, or None.

    Largest first; each where it touches the fewest pages no block touches
    (from a range's start, to its end, or from a page boundary), then the
    shortest range, then the lowest address.
    """
    if a == b:
        return []
    ps = np.concatenate((fo, np.maximum(fo, w1)))
    pe = np.concatenate((np.minimum(fe, w0), fe))
    keep = pe > ps
    ps, pe = ps[keep], pe[keep]
    untouched = (count == 0).astype(np.int64)
    dst = [0] * (b - a)
    for i in sorted(range(a, b), key=lambda i: (-int(z[i]), int(o[i]))):
        n = int(z[i])
        fit = np.flatnonzero(pe - ps >= n)
        if not fit.size:
            return None
        s, t = ps[fit], pe[fit]
        aligned = -(-s // P) * P
        opts = np.concatenate((s, t - n, aligned))
        where = np.concatenate((fit, fit, fit))
        valid = opts + n <= np.concatenate((t, t, t))
        opts, where = opts[valid], where[valid]
        cu = np.concatenate(([0], np.cumsum(untouched)))
        new = cu[(opts + n - 1) // P + 1] - cu[opts // P]
        k = int(np.lexsort((opts, pe[where] - ps[where], new))[0])
        d, j = int(opts[k]), int(where[k])
        dst[i - a] = d
        untouched[d // P:(d + n - 1) // P + 1] = 0
        # The range splits around the destination.
        rest = [(x, y) for x, y in ((int(ps[j]), d), (d + n, int(pe[j]))) if y > x]
        ps = np.concatenate((np.delete(ps, j), np.array([x for x, _ in rest], np.int64)))
        pe = np.concatenate((np.delete(pe, j), np.array([y for _, y in rest], np.int64)))
    return dst


def _window_plan(lay: _Layout, idx: np.ndarray, dst: np.ndarray, hole: tuple[int, int], P: int, span: int,
                 alignment: int) -> ArrayPlan:
    """One wave moving sorted blocks ``idx`` to ``dst``, checked, with ``hole`` recorded."""
    first, last = lay.off // P, (lay.off + lay.size - 1) // P
    before = _page_union_count(first, last) if lay.off.size else 0
    o = np.argsort(dst, kind="stable")
    idx, dst = idx[o], dst[o]
    first[idx], last[idx] = dst // P, (dst + lay.size[idx] - 1) // P
    after = _page_union_count(first, last) if lay.off.size else 0  # it sorts what the moves unsorted
    size = lay.size[idx]
    plan = ArrayPlan(lay.inputs(idx), lay.off[idx], dst, size, np.ones(idx.size, np.int64), P, before, after,
                     int(size.sum()), None, hole)
    _validate(lay, plan, span=span, alignment=alignment, large_on_pages=False)
    # The window holds no block once the wave has run.
    w, n = hole
    final = lay.off.copy()
    final[idx] = dst
    if ((final < w + n) & (final + lay.size > w)).any():
        raise PlanError("plan_window_arrays: a block stays in the window")  # a bug, never a layout's fault
    return plan
