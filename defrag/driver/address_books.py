"""`AddressBooks`: what the emulated device's virtual address space holds, as books alone.

The reservations (`cuMemAddressReserve`), the mappings inside them (`cuMemMap`:
an address range backed by a handle) and the access each mapped granule was
given (`cuMemSetAccess` may cover part of a mapping), kept sorted by address
so that the ranges a call names are found by bisection. It answers the
questions the device's rules ask (which reservation holds a range, which
mappings meet it, whether mappings tile it, whether it may be read or
written) and records what a call that passed them changed.

It checks no rule and touches no memory: `EmulatedCuda` decides what is
allowed and asks its `HostMemory` to do it, then records it here. Not
thread-safe: the device calls it under its lock.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from .host_memory import PROT_READ, PROT_RW

# For each needed protection, a bytes.translate table that maps a granule's
# protection to 0 when it grants that access and to 1 when it does not.
_LACKS = {need: bytes(0 if p & need == need else 1 for p in range(256)) for need in (PROT_READ, PROT_RW)}


@dataclass(slots=True)
class Mapping:
    """One `cuMemMap`: [va, va+size) backed by `handle` from `offset` (a snapshot the books build on request)."""
    va: int
    size: int
    handle: int
    offset: int
    prots: bytearray = None  # protection per granule of this mapping (SetAccess may cover part of it)


@dataclass
class Reservation:
    """One `cuMemAddressReserve`: [base, base+size)."""
    base: int
    size: int


class _Run:
    """Mappings of `size` bytes each, end to end from `start`: the i-th is `handles[i]` at start + i*size
    (offset 0); `prots`: the protection of each granule of the whole run."""

    __slots__ = ("start", "size", "handles", "prots")

    def __init__(self, start: int, size: int, handles: list[int], prots: bytearray):
        self.start, self.size, self.handles, self.prots = start, size, handles, prots

    @property
    def end(self) -> int:
        return self.start + self.size * len(self.handles)


class AddressBooks:
    """The reservations and mappings of one emulated device (see the module docstring).

    Mappings are recorded by runs (`_Run`): the mappings one batch of
    `cuMemMap` made end to end, each still its own mapping (an unmap may take
    any whole ones of a run, which splits it), so a run of pages is added,
    found and removed in a few steps however long it is. A `Mapping` object
    exists only where a caller asks for one (`mappings_in`, `in_address_order`).
    A *cover* (`covering`) names mappings as (run, first, stop) index ranges.
    """

    def __init__(self, granularity: int):
        self.granularity = granularity
        self.reservations: dict[int, Reservation] = {}  # base -> reservation
        self._res_starts: list[int] = []  # the bases, sorted
        self._runs: dict[int, _Run] = {}  # start -> run of mappings
        self._starts: list[int] = []  # the runs' starts, sorted
        self._count = 0  # mappings

    def __len__(self) -> int:
        """How many mappings there are."""
        return self._count

    # ---------------------------------------------------------------- reading
    def reservation_of(self, va: int, size: int) -> Reservation | None:
        """The one reservation that holds all of [va, va+size), else None."""
        i = bisect.bisect_right(self._res_starts, va) - 1
        if i < 0:
            return None
        res = self.reservations[self._res_starts[i]]
        if va >= res.base and va + size <= res.base + res.size:
            return res
        return None

    def _bounds(self, va: int, size: int) -> tuple[int, int]:
        """[i, j): the indices in `_starts` of the runs that meet [va, va+size)."""
        starts = self._starts
        i = max(bisect.bisect_right(starts, va) - 1, 0)
        j = bisect.bisect_left(starts, va + size, i)  # the runs from `i` on that start before the end
        if i < j and self._runs[starts[i]].end <= va:  # the one starting before `va` ends before it
            i += 1
        return i, j

    def any_in(self, va: int, size: int) -> bool:
        """Whether any mapping meets [va, va+size)."""
        i, j = self._bounds(va, size)
        return i < j

    def _cover(self, va: int, size: int) -> list[tuple[_Run, int, int]]:
        """(run, first, stop) for each run meeting [va, va+size): its mappings [first, stop) meet it."""
        i, j = self._bounds(va, size)
        end = va + size
        out = []
        for start in self._starts[i:j]:
            run = self._runs[start]
            m = run.size
            first = max(va - start, 0) // m
            stop = min(-(-(end - start) // m), len(run.handles))
            if first < stop:  # an empty range at a boundary between two of its mappings meets none
                out.append((run, first, stop))
        return out

    def mappings_in(self, va: int, size: int) -> list[Mapping]:
        """Mappings meeting [va, va+size), in address order."""
        return [self._mapping(run, k) for run, first, stop in self._cover(va, size) for k in range(first, stop)]

    def _mapping(self, run: _Run, k: int) -> Mapping:
        per = run.size // self.granularity
        return Mapping(run.start + k * run.size, run.size, run.handles[k], 0, run.prots[k * per:(k + 1) * per])

    def covering(self, va: int, size: int) -> list[tuple[_Run, int, int]] | None:
        """The mappings that tile [va, va+size) without gaps, as a cover (see the class docstring), else
        None. They may reach beyond the range at either end (`cover_span` says how far)."""
        cover = self._cover(va, size)
        if not cover:
            return None
        run, first, _ = cover[0]
        if run.start + first * run.size > va:
            return None
        for (a, _, _), (b, _, _) in zip(cover, cover[1:]):
            if a.end != b.start:
                return None
        run, _, stop = cover[-1]
        if run.start + stop * run.size < va + size:
            return None
        return cover

    @staticmethod
    def cover_span(cover: list[tuple[_Run, int, int]]) -> tuple[int, int]:
        """[start, end) of the mappings a cover names."""
        run, first, _ = cover[0]
        last, _, stop = cover[-1]
        return run.start + first * run.size, last.start + stop * last.size

    def accessible(self, ptr: int, size: int, write: bool) -> bool:
        """Whether every byte of [ptr, ptr+size) is mapped with read (and, if `write`, write) access."""
        cover = self.covering(ptr, size)
        if cover is None:
            return False
        lacks = _LACKS[PROT_RW if write else PROT_READ]
        g, end = self.granularity, ptr + size
        for run, _, _ in cover:
            first = (max(ptr, run.start) - run.start) // g
            last = (min(end, run.end) - 1 - run.start) // g
            if 1 in run.prots[first:last + 1].translate(lacks):
                return False
        return True

    def in_address_order(self) -> tuple[list[Mapping], list[Reservation]]:
        """Every mapping and every reservation, each list in address order (a snapshot)."""
        maps = []
        for start in self._starts:
            run = self._runs[start]
            maps.extend(self._mapping(run, k) for k in range(len(run.handles)))
        return maps, [self.reservations[base] for base in self._res_starts]

    # ---------------------------------------------------------------- recording
    def add_reservation(self, base: int, size: int) -> None:
        """Record the reservation [base, base+size) (it overlaps none)."""
        self.reservations[base] = Reservation(base, size)
        bisect.insort(self._res_starts, base)

    def remove_reservation(self, base: int) -> None:
        """Forget the reservation at `base` (nothing is mapped inside it)."""
        del self.reservations[base]
        del self._res_starts[bisect.bisect_left(self._res_starts, base)]

    def add_mappings(self, vas: list[int], size: int, handles: list[int]) -> None:
        """Record `size` bytes of `handles[i]` mapped at `vas[i]` from offset 0, with no access yet, for
        addresses `size` apart in ascending order that no mapping meets: one run, joined to the run
        that ends where it starts when that one's mappings are of the same size."""
        if not vas:
            return
        per = size // self.granularity
        i = bisect.bisect_left(self._starts, vas[0])
        if i:
            before = self._runs[self._starts[i - 1]]
            if before.end == vas[0] and before.size == size:
                before.handles.extend(handles)
                before.prots.extend(bytes(per * len(vas)))
                self._count += len(vas)
                return
        self._runs[vas[0]] = _Run(vas[0], size, list(handles), bytearray(per * len(vas)))
        self._starts.insert(i, vas[0])
        self._count += len(vas)

    def remove_mappings(self, cover: list[tuple[_Run, int, int]]) -> list[int]:
        """Forget the mappings a cover from `covering` names; returns their handles, in address order. A run
        they leave pieces of on either side goes on as those pieces."""
        out: list[int] = []
        runs, starts = self._runs, self._starts
        for run, first, stop in cover:
            n = len(run.handles)
            out.extend(run.handles[first:stop])
            per = run.size // self.granularity
            i = bisect.bisect_left(starts, run.start)
            if first and stop < n:  # mappings on both sides: those after the cover become a run of their own
                rest = _Run(run.start + stop * run.size, run.size, run.handles[stop:], run.prots[stop * per:])
                runs[rest.start] = rest
                starts.insert(i + 1, rest.start)
                del run.handles[first:], run.prots[first * per:]
            elif first:  # the mappings before it stay
                del run.handles[first:], run.prots[first * per:]
            elif stop < n:  # the mappings after it stay, the run now starting at the first of them
                del runs[run.start], run.handles[:stop], run.prots[:stop * per]
                run.start += stop * run.size
                runs[run.start] = run
                starts[i] = run.start
            else:
                del runs[run.start], starts[i]
        self._count -= len(out)
        return out

    def set_access(self, ptr: int, size: int, prot: int, cover: list[tuple[_Run, int, int]]) -> None:
        """Record that [ptr, ptr+size), which the cover tiles (`covering`), now has protection `prot`,
        granule by granule: the range may cover only part of its first and last mapping."""
        g, end = self.granularity, ptr + size
        for run, _, _ in cover:
            first = (max(ptr, run.start) - run.start) // g
            last = (min(end, run.end) - run.start) // g
            run.prots[first:last] = bytes([prot]) * (last - first)
