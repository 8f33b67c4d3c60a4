"""Choosing meshes: which partial pages may share one physical page.

Pure: numpy and the standard library, no torch, no driver. The mesher hands
in one bitmap per candidate page (a bit per granule that holds live bytes,
:func:`page_bitmaps`) and the live bytes of each page, and gets back groups
of pages whose bitmaps are pairwise disjoint (:func:`plan_meshes`). Each
group keeps one physical page (its *primary*'s); the other members, the
*twins*, have their live bytes copied into it at the same offsets and are
remapped onto it, so every virtual address stays the same (Mesh, Powers et
al., PLDI 2019). Nothing here maps, copies or checks that the pages may
mesh; the caller does (docs/meshing.md, "Which pages may mesh").

The method is the bounded greedy measured in docs/meshing.md: pages densest
first, each joins the first open mesh it does not overlap among at most
``max_probes`` probed ones (the newest half, the rest drawn at random, since
identical bitmaps sort next to each other and never mesh), or opens one. The
probes of one page are one numpy AND over a ``(probes, words)`` array, so the
work is O(pages x max_probes x words) by construction.

Measured on this machine (2 shared cores, numpy 2): 100,000 pages drawn from the
partial pages of the real snapshots (``benchmarks/mesh_potential.py``) plan in
1.3-1.7 s (the benchmark's former Python-int greedy: 2.6 s on the same pages,
within 0.2 % of the pages freed, better or worse by the draw); the worst case,
100,000 identical pages where every page ANDs all 128 probes, 2.3 s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

# Bytes a twin may cost on average: a group is accepted only if copying its twins' live bytes costs at
# most this per physical page it frees (docs/meshing.md measured 0.3-0.7 MiB per freed page on real
# snapshots). It bounds the copy work of a plan to MAX_COPY_PER_PAGE x freed pages.
MAX_COPY_PER_PAGE = 1 << 20
MAX_PROBES = 128  # open meshes tried per page: bounds plan_meshes at O(pages x MAX_PROBES x words)
GRANULE = 512  # the pool's alignment (defrag.units.ALIGNMENT): one bitmap bit per granule

_ONES = np.uint64(0xFFFF_FFFF_FFFF_FFFF)


@dataclass(frozen=True)
class MeshGroup:
    """Candidate pages (indices into the bitmaps) that share one physical page: the primary's.

    The members' bitmaps are pairwise disjoint. ``primary`` has the most live bytes of the group
    (ties: the lowest index) and keeps its page; ``twins`` (ascending) are copied into it and give
    theirs back, so the group frees ``len(twins)`` pages. ``copied_bytes`` is the twins' live bytes.
    """

    primary: int
    twins: tuple[int, ...]
    copied_bytes: int

    @property
    def members(self) -> tuple[int, ...]:
        return (self.primary, *self.twins)


@dataclass(frozen=True)
class MeshPlan:
    """What :func:`plan_meshes` chose: groups cheapest first (bytes copied per page freed, then primary).

    ``freed_pages`` is the sum of the groups' twins, ``copied_bytes`` the sum of their copies,
    ``seconds`` the planning time.
    """

    groups: tuple[MeshGroup, ...]
    freed_pages: int
    copied_bytes: int
    seconds: float


def page_bitmaps(pieces, page_size: int, granule: int = GRANULE, *, pages: int | None = None) -> np.ndarray:
    """One occupancy bitmap per candidate page from the live pieces on it.

    `pieces`: (page_index, offset, length) triples, or an int array of shape (m, 3): a piece of a
    live block on candidate page ``page_index`` (0..n-1), ``offset`` bytes into it. A block crossing
    a page boundary is one piece per page. Each piece sets the bit of every granule it touches
    (offset rounded down, end rounded up to `granule`). Returns ``uint64 (n, page_size // granule // 64)``,
    bit ``u % 64`` of word ``u // 64`` standing for granule ``u``; ``n = pages``, or the largest
    page index + 1 when `pages` is None. Pieces may overlap (bits are OR-ed).

    ValueError: `page_size` not a positive multiple of ``granule * 64``; a piece with a negative
    page index or offset, no bytes, an end past `page_size`, or a page index ``>= pages``.
    """
    if granule <= 0 or page_size <= 0 or page_size % (granule * 64):
        raise ValueError(f"page_size {page_size} must be a positive multiple of granule x 64 ({granule} x 64)")
    words = page_size // granule // 64
    arr = pieces if isinstance(pieces, np.ndarray) else np.array(list(pieces), dtype=np.int64)
    arr = np.asarray(arr, dtype=np.int64).reshape(-1, 3) if arr.size else np.zeros((0, 3), np.int64)
    page, off, length = arr[:, 0], arr[:, 1], arr[:, 2]
    n = (int(page.max()) + 1 if len(arr) else 0) if pages is None else int(pages)
    if n < 0:
        raise ValueError(f"pages must be >= 0, not {pages}")
    bad = (page < 0) | (page >= n) | (off < 0) | (length < 1) | (off + length > page_size)
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        raise ValueError(f"piece {k} (page {page[k]}, offset {off[k]}, length {length[k]}) lies outside "
                         f"its page: pages are 0..{n - 1}, each {page_size} bytes, a piece at least 1 byte")
    out = np.zeros((n, words), dtype=np.uint64)
    if not len(arr):
        return out
    u0 = off // granule
    u1 = (off + length + granule - 1) // granule  # exclusive
    w0, w1 = u0 // 64, (u1 - 1) // 64
    per = w1 - w0 + 1  # words each piece touches
    rep = np.repeat(np.arange(len(arr)), per)
    starts = np.cumsum(per) - per
    word = w0[rep] + (np.arange(len(rep)) - starts[rep])
    lo = np.maximum(u0[rep], word * 64) - word * 64
    width = np.minimum(u1[rep], word * 64 + 64) - word * 64 - lo  # 1..64
    mask = (_ONES >> (64 - width).astype(np.uint64)) << lo.astype(np.uint64)
    np.bitwise_or.at(out, (page[rep], word), mask)
    return out


def _popcount(bitmaps: np.ndarray) -> np.ndarray:
    """Set bits per row of a uint64 (n, words) array, as int64."""
    if hasattr(np, "bitwise_count"):  # numpy >= 2.0
        return np.bitwise_count(bitmaps).sum(axis=1, dtype=np.int64)
    return np.unpackbits(bitmaps.view(np.uint8), axis=1).sum(axis=1, dtype=np.int64)


def _greedy(bitmaps: np.ndarray, pops: np.ndarray, order: np.ndarray, max_probes: int, seed: int):
    """The bounded first fit over `order` (densest first): each page's mesh id, and the probes made.

    A page joins the first open mesh it fits (enough free granules, no overlap) among the
    ``ceil(max_probes / 2)`` newest open meshes, then ``max_probes // 2`` drawn at random (with
    replacement) from the older ones; else it opens a mesh. A mesh stays open while some candidate
    could still fit by count (``free granules >= the sparsest candidate``). A mesh that closes near
    the newest end leaves the list at once (a short shift), so the newest probes stay useful (that
    recovered 0.03 % of the pages at 100k, matching the Python-int greedy); one deeper down is
    dropped lazily, the list compacted once those are the majority. Returns
    ``(mesh_of, probes)``: ``mesh_of[i]`` for every page of `order` (-1 elsewhere), and the number
    of open meshes whose bitmaps were ANDed with a page (never more than ``len(order) x max_probes``).
    """
    n, words = bitmaps.shape
    units = words * 64
    m = len(order)
    mesh_of = np.full(n, -1, dtype=np.int64)
    if not m:
        return mesh_of, 0
    least = int(pops[order].min())
    unions = np.empty((m, words), dtype=np.uint64)
    upops = np.empty(m, dtype=np.int64)
    opened = np.empty(m, dtype=np.int64)  # mesh ids, oldest first; closed ones are dropped lazily
    n_opened = n_closed = n_mesh = probes = 0
    newest = (max_probes + 1) // 2
    drawn = max_probes - newest
    rng = np.random.default_rng(seed)
    draws = np.empty(0)
    at = 0
    for i, pb in zip(order.tolist(), pops[order].tolist()):
        b = bitmaps[i]
        if n_opened <= max_probes:
            slots = np.arange(n_opened - 1, -1, -1)
        else:
            older = n_opened - newest
            if at + drawn > len(draws):  # draws for many pages at once: one rng call per 4096 pages
                draws, at = rng.random(drawn * 4096), 0
            picks = (draws[at:at + drawn] * older).astype(np.int64)
            at += drawn
            slots = np.concatenate((np.arange(n_opened - 1, older - 1, -1), picks))
        placed = -1
        if len(slots):
            cand = opened[slots]
            room = upops[cand] <= units - pb  # room by count first: closed meshes fail here
            if room.any():
                slots, cand = slots[room], cand[room]
                probes += len(cand)
                fits = ~(unions[cand] & b).any(axis=1)
                k = int(fits.argmax())
                if fits[k]:
                    placed, slot = int(cand[k]), int(slots[k])
        if placed >= 0:
            unions[placed] |= b
            upops[placed] += pb
            mesh_of[i] = placed
            if units - upops[placed] < least:  # closed: nothing left could fit by count
                if slot >= n_opened - 2 * max_probes:  # near the newest end: leave the window now (cheap)
                    opened[slot:n_opened - 1] = opened[slot + 1:n_opened]
                    n_opened -= 1
                else:  # deep in the list: left for the next compaction, which runs once they are the majority
                    n_closed += 1
                    if n_closed > max_probes and 2 * n_closed > n_opened:
                        keep = opened[:n_opened][units - upops[opened[:n_opened]] >= least]
                        n_opened = len(keep)
                        opened[:n_opened] = keep
                        n_closed = 0
        else:
            unions[n_mesh] = b
            upops[n_mesh] = pb
            mesh_of[i] = n_mesh
            if units - pb >= least:
                opened[n_opened] = n_mesh
                n_opened += 1
            n_mesh += 1
    return mesh_of, probes


def _validate(bitmaps, live_bytes) -> tuple[np.ndarray, np.ndarray]:
    if not isinstance(bitmaps, np.ndarray) or bitmaps.dtype != np.uint64 or bitmaps.ndim != 2:
        raise ValueError(f"bitmaps must be a uint64 numpy array of shape (pages, words), not "
                         f"{type(bitmaps).__name__} {getattr(bitmaps, 'dtype', '')} {getattr(bitmaps, 'shape', '')}")
    live = np.asarray(live_bytes)
    if live.shape != (bitmaps.shape[0],):
        raise ValueError(f"live_bytes must hold one count per page: shape {live.shape}, "
                         f"bitmaps has {bitmaps.shape[0]} pages")
    if live.size and (live.dtype.kind not in "iu" or int(live.min()) < 0):
        raise ValueError(f"live_bytes must be non-negative integers, not {live.dtype} (min {live.min()})")
    return np.ascontiguousarray(bitmaps), live.astype(np.int64)


def plan_meshes(bitmaps: np.ndarray, live_bytes: np.ndarray, *, max_probes: int = MAX_PROBES, seed: int = 0,
                max_copy_per_page: int = MAX_COPY_PER_PAGE, free_at_least: int | None = None) -> MeshPlan:
    """Groups of candidate pages with pairwise disjoint bitmaps, each group sharing one physical page.

    `bitmaps`: ``uint64 (n, words)`` (:func:`page_bitmaps`); `live_bytes`: int ``(n,)``, the live
    bytes on each page (what a twin costs to copy). Guarantees:

    - members of a group have pairwise disjoint bitmaps, and every page is in at most one group;
    - the primary has the most live bytes of its group (ties: the lowest index) and the group frees
      ``len(twins)`` pages at a copy of the twins' live bytes, at most ``max_copy_per_page`` per
      freed page: a group over that keeps only its cheapest twins (none: dropped);
    - full pages (every bit set) and empty ones (no bit set: nothing to mesh; unmap them instead)
      are in no group;
    - groups come cheapest first (bytes copied per freed page, then primary index); with
      `free_at_least` = k, only the shortest such prefix that frees k pages (all groups if they free
      fewer; none for k = 0);
    - the result is a function of the input and `seed`: candidates are taken densest first, equal
      counts in the order of their bitmaps' words, then most live bytes, then index, so permuting
      the input permutes the pages of the same groups (up to interchanging identical pages and the
      primary among equally full members);
    - work is O(n x max_probes x words): at most `max_probes` open meshes are ANDed per page.

    Does not: guarantee the fewest pages (that is NP-hard; the measured greedy is within a page of
    trying every open mesh on real snapshots), check that the bitmaps match `live_bytes`, or
    decide whether a page may mesh at all.
    """
    t0 = time.perf_counter()
    if int(max_probes) < 1:
        raise ValueError(f"max_probes must be >= 1, not {max_probes}")
    if int(max_copy_per_page) < 0:
        raise ValueError(f"max_copy_per_page must be >= 0, not {max_copy_per_page}")
    if free_at_least is not None and int(free_at_least) < 0:
        raise ValueError(f"free_at_least must be >= 0 or None, not {free_at_least}")
    bitmaps, live = _validate(bitmaps, live_bytes)
    n, words = bitmaps.shape
    pops = _popcount(bitmaps)
    cand = np.flatnonzero((pops > 0) & (pops < words * 64))
    # Densest first; equal counts by content so the order (and the plan) does not depend on input order.
    sub = bitmaps[cand]
    keys = [cand, -live[cand]] + [sub[:, w] for w in range(words - 1, -1, -1)] + [-pops[cand]]
    order = cand[np.lexsort(keys)] if len(cand) else cand
    mesh_of, _ = _greedy(bitmaps, pops, order, int(max_probes), int(seed))

    groups = []
    limit = int(max_copy_per_page)
    meshed = order[np.argsort(mesh_of[order], kind="stable")]
    ids = mesh_of[meshed]
    cuts = np.flatnonzero(np.diff(ids)) + 1
    for members in np.split(meshed, cuts):
        if len(members) < 2:
            continue
        # Most live bytes first, ties by lowest index: the head is the primary, the tail the cheapest twins.
        ranked = sorted(members.tolist(), key=lambda p: (-int(live[p]), p))
        primary, twins = ranked[0], ranked[1:]
        copied = sum(int(live[p]) for p in twins)
        while twins and copied > limit * len(twins):  # the cost rule: drop the dearest twin until it holds
            copied -= int(live[twins.pop(0)])
        if twins:
            groups.append(MeshGroup(primary, tuple(sorted(twins)), copied))
    groups.sort(key=lambda g: (g.copied_bytes / len(g.twins), g.primary))
    if free_at_least is not None:
        taken, freed = [], 0
        for g in groups:
            if freed >= int(free_at_least):
                break
            taken.append(g)
            freed += len(g.twins)
        groups = taken
    return MeshPlan(groups=tuple(groups), freed_pages=sum(len(g.twins) for g in groups),
                    copied_bytes=sum(g.copied_bytes for g in groups), seconds=time.perf_counter() - t0)
