"""The page growth policy: when a placement maps new physical pages and when it stitches. Pure: no torch, no driver.

A request whose window has unmapped pages needs a physical page under each.
There are three sources, which cost different things:

- *cached* handles (unmapped pages the pool still holds): one cuMemMap each;
- *new* handles, up to the pool's capacity: cuMemCreate + cuMemMap each, and
  device memory the pool did not hold before;
- *donors*, empty mapped pages elsewhere, unmapped first (stitching): a
  cuMemMap each and a cuMemUnmap per run of them, and the device must be done
  with them before they are unmapped (invariant 5: a synchronize, unless the
  backing knows it already is, see `Backing.idle`).

Stitching keeps reserved bytes down; growing keeps the driver quiet (on an
H200, per 2 MiB page: create 19 us, map 7.5 us, unmap 30 us, and a stitch
stalls the whole device). So the pool grows while it is within a slack
*budget* of what is live, and stitches only beyond it:

    budget = floor(SLACK x (live bytes + the request's bytes) / page size) pages

`GrowthPolicy.supply` splits a request's new pages between the sources:
cached handles first (pages the pool already holds), new ones while mapped
pages stay within the budget, donors for the rest, and new ones again where
donors run out (the budget is a target: only the capacity fails a request).
Growth also stops at the capacity over the slack: a pool whose capacity its
live bytes nearly fill needs every page it has, and blocks spread over new
pages strand more of them than stitching does (without that stop a
snapshot's smallest capacity grew by two pages).

Giving back is lazy and batched: nothing is unmapped when blocks are freed
(the next training step or decode wave reuses the pages in place, with no
driver call); a request that stitches also gives back, in the same batch of
unmaps and under the same synchronize, up to `BATCH_PAGES` empty pages beyond
the budget (`Supply.give_back`), which wait in the store's cache for the
next request that maps pages.

`SLACK` = 1.10: what the issue's serving trace (`traces.random_serving`,
docs/benchmarks.md) allows peak reserved over peak live, below the 1.22x of
PyTorch's expandable segments there. Its driver calls fall about tenfold
against stitching whenever cached pages fall short; a smaller slack stitches
more (1.08: 20% more maps), a larger one reserves more (1.15: a third fewer
maps) for a pool that never gives pages back on its own.

*Units.* A placement that maps `UNIT_MIN` units' worth of pages or more
creates its new pages in units (`vmm.PageStore.take_unit`): one driver handle
per run of up to capacity / `UNIT_SHARE` pages (64 MiB of an 80 GiB pool of
2 MiB pages), one cuMemCreate and one cuMemMap each, where a handle per page
costs one of each per page. CUDA maps a handle from its first byte only and
one cuMemUnmap never splits a mapping, so a unit leaves only whole: a stitch,
a give-back or a trim takes a unit only when none of its pages holds a block
(`Backing.empty_masks`), and then all of it (`Backing.donors`); unmapped, it
stays held, *spare*, and is mapped again whole by the next unit of its size,
or released where single pages need its room. Sleep unmaps a unit with one
call, offload packs blocks off units first, and meshing never takes a unit's
page. The share keeps what a partly used unit strands small beside the pool
(a pool under 2,560 pages makes none); the minimum keeps units to placements
large enough to fill two.

*The units' ceiling.* A unit that blocks hold only in part strands its empty
pages: nothing else can map them. With room to spare that costs nothing; near
the capacity it would cost the pool its tightness (on the serving trace, 2.5
GiB of its smallest capacity). So units are made only while mapped pages,
the placement's included, stay within `UNIT_CEILING` of the capacity. Once a
placement passes it the pool makes no more units (`Core.units_closed`, for
the pool's life), and each placement that stitches (and so synchronizes
anyway) first *breaks* every unit that blocks hold only in part
(`Backing.break_units`, one batch): each
used page gets a single page of its own with its bytes, the unit is unmapped
whole and spare, and its empty pages are free like any other. A unit is
broken at most once, so this costs at most two synchronizes per unit the
pool ever made. A placement that is short of pages breaks units too, below
the ceiling, the fewest used pages first. Breaking copies pages, so it runs
only while no other thread that used the pool runs, and never during graph
capture; a driver fault rolls the batch back (the pages stay stranded). On
the serving trace at 80 GiB (peak reserved 0.84 of the capacity, so units
all the way): cuMemMap + cuMemUnmap 116,148 -> 21,326 and cuMemCreate 34,315
-> 6,872, for 165 synchronizes (142 before) and the same 1.10 peak reserved
over peak live; its smallest capacities stay within a few pages of a handle
per page. docs/benchmarks.md has the figures.

What it does not decide: which window a block takes (`Core._place_large`),
which empty pages are donors (`Backing.donors`), or anything about
compaction, which never grows the pool beyond its mapped pages
(`Backing.make_room`).
"""

from __future__ import annotations

from dataclasses import dataclass

SLACK = 1.10
BATCH_PAGES = 64  # the most empty pages beyond the budget given back with one stitch (128 MiB of 2 MiB pages)
UNIT_SHARE = 1280  # a unit holds at most the capacity over this (64 MiB of an 80 GiB pool); 0: no units
UNIT_MIN = 2  # a placement creates units when it maps at least this many units' worth of pages
UNIT_CEILING = 0.85  # units only while mapped pages stay within this share of the capacity (see above)


@dataclass(frozen=True, slots=True)
class Supply:
    """Where a request's new pages come from: `cached` handles, `created` ones and `stitched` empty mapped
    pages elsewhere, unmapped first; `give_back`: how many more empty pages, beyond the budget, to unmap
    in the same batch (they wait in the store's cache)."""

    cached: int
    created: int
    stitched: int
    give_back: int


@dataclass(frozen=True, slots=True)
class GrowthPolicy:
    """The pool's page growth policy (see the module docstring): a slack over what is live, the most
    empty pages beyond the budget that one stitch gives back, and when new pages come as units
    (`unit_share`: a unit holds at most the capacity over it, 0 for none; `unit_min`: how many units'
    worth a placement maps at least to make them; `unit_ceiling`: the share of the capacity mapped
    pages stay within for units to be made, above 1 for no ceiling)."""

    slack: float = SLACK
    batch_pages: int = BATCH_PAGES
    unit_share: int = UNIT_SHARE
    unit_min: int = UNIT_MIN
    unit_ceiling: float = UNIT_CEILING

    def __post_init__(self):
        if not self.slack >= 1.0:
            raise ValueError(f"slack must be at least 1.0 (mapped pages cannot be fewer than the live ones), "
                             f"got {self.slack!r}")
        if self.batch_pages < 1:
            raise ValueError(f"batch_pages must be at least 1, got {self.batch_pages!r}")
        if not self.unit_ceiling > 0:
            raise ValueError(f"unit_ceiling must be above 0 (a share of the capacity), got {self.unit_ceiling!r}")
        if self.unit_share < 0 or self.unit_min < 1:
            raise ValueError(f"unit_share must be at least 0 (0: no units) and unit_min at least 1, got "
                             f"{self.unit_share!r} and {self.unit_min!r}")

    def unit_pages_for(self, mapped_pages: int, capacity_pages: int, mapped_now: int = 0) -> int:
        """The most pages of one unit for a placement that maps `mapped_pages` pages of a pool of
        `capacity_pages` with `mapped_now` pages mapped before it: the capacity over `unit_share` when that
        is 2 or more, the placement maps `unit_min` units' worth or more and mapped pages stay within the
        ceiling; else 0 (each new page a handle of its own). Whether the pool still makes units at all
        is the core's (`Core.units_closed`)."""
        unit = capacity_pages // self.unit_share if self.unit_share else 0
        if self.beyond_unit_ceiling(mapped_now + mapped_pages, capacity_pages):
            return 0
        return unit if unit >= 2 and mapped_pages >= self.unit_min * unit else 0

    def beyond_unit_ceiling(self, mapped_pages: int, capacity_pages: int) -> bool:
        """Whether `mapped_pages` (after a placement) pass the units' ceiling: partly used units are
        then broken (`Core._break_units`), for pages stranded in them would be missed."""
        return mapped_pages > self.unit_ceiling * capacity_pages

    def budget(self, live_bytes: int, request_bytes: int, page_size: int) -> int:
        """The most pages the pool maps without stitching, once `request_bytes` are placed beside the
        `live_bytes` already live (rounded down: mapped bytes never pass the slack)."""
        return int(self.slack * (live_bytes + request_bytes) // page_size)

    def supply(self, need: int, *, mapped: int, live_bytes: int, request_bytes: int, page_size: int,
               cached: int, creatable: int, donors: int, capacity: int) -> Supply:
        """Split `need` new pages of a request between the store and donors.

        `mapped`: pages mapped now; `cached`, `creatable`: the store's
        handles; `donors`: empty mapped pages outside the request's window;
        `capacity`: the pool's, in pages. Cached handles serve first (pages
        the pool already holds, unmapped by an earlier batch or a
        compaction); new ones while mapped pages stay within the budget and
        the capacity over the slack; donors the rest; new ones again where
        donors run out (the budget is a target: the capacity alone fails a
        request). With donors, up to `batch_pages` of the empty pages beyond
        the budget go back too. The caller has checked `cached + creatable +
        donors >= need`; the split never asks a source for more than it has.
        """
        cached_used = min(need, cached)
        rest = need - cached_used
        budget = self.budget(live_bytes, request_bytes, page_size)
        # Growth stops at the budget, and at the capacity over the slack: a pool whose capacity its
        # live bytes nearly fill needs every page it maps, and blocks spread over new pages strand
        # more of them than stitching does.
        room = min(budget, int(capacity / self.slack)) - mapped - cached_used
        created = min(rest, creatable, max(0, room))
        stitched = min(rest - created, donors)
        created += rest - created - stitched
        excess = mapped + need - stitched - budget  # pages beyond the budget once the request is mapped
        give_back = max(0, min(donors - stitched, self.batch_pages, excess)) if stitched else 0
        return Supply(cached_used, created, stitched, give_back)


class StitchFirst(GrowthPolicy):
    """The growth rule before the budget, for comparisons (tests, `defrag bench --only page_calls`): empty
    mapped pages elsewhere back a request whenever cached pages fall short, and new pages only once no
    empty page is left, so mapped pages grow only when they must. Gives nothing back beyond a request."""

    def supply(self, need: int, *, cached: int, donors: int, **_) -> Supply:
        cached_used = min(need, cached)
        stitched = min(need - cached_used, donors)
        return Supply(cached_used, need - cached_used - stitched, stitched, 0)
