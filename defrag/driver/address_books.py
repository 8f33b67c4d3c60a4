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
    """One `cuMemMap`: [va, va+size) backed by `handle` from `offset`."""
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


class AddressBooks:
    """The reservations and mappings of one emulated device (see the module docstring)."""

    def __init__(self, granularity: int):
        self.granularity = granularity
        self.reservations: dict[int, Reservation] = {}  # base -> reservation
        self._res_starts: list[int] = []  # the bases, sorted
        self.mappings: dict[int, Mapping] = {}  # va -> mapping
        self._map_starts: list[int] = []  # the mappings' starts, sorted

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

    def mappings_in(self, va: int, size: int) -> list[Mapping]:
        """Mappings intersecting [va, va+size), in address order."""
        starts, mappings = self._map_starts, self.mappings
        first = max(bisect.bisect_right(starts, va) - 1, 0)
        last = bisect.bisect_left(starts, va + size)  # the mappings from `first` on that start before the end
        out = [mappings[start] for start in starts[first:last]]
        if out and out[0].va + out[0].size <= va:  # the one starting before `va` ends before it
            del out[0]
        return out

    def covering(self, va: int, size: int) -> list[Mapping] | None:
        """The mappings that exactly tile [va, va+size) without gaps, else None."""
        maps = self.mappings_in(va, size)
        if not maps or maps[0].va > va or maps[-1].va + maps[-1].size < va + size:
            return None
        # Mappings never overlap: they tile their span when their sizes add up to it.
        if sum(m.size for m in maps) != maps[-1].va + maps[-1].size - maps[0].va:
            return None
        return maps

    def accessible(self, ptr: int, size: int, write: bool) -> bool:
        """Whether every byte of [ptr, ptr+size) is mapped with read (and, if `write`, write) access."""
        maps = self.covering(ptr, size)
        if maps is None:
            return False
        need = PROT_RW if write else PROT_READ
        g = self.granularity
        end = ptr + size
        for m in maps:
            first = (max(ptr, m.va) - m.va) // g
            last = (min(end, m.va + m.size) - 1 - m.va) // g
            if 1 in m.prots[first:last + 1].translate(_LACKS[need]):
                return False
        return True

    def in_address_order(self) -> tuple[list[Mapping], list[Reservation]]:
        """Every mapping and every reservation, each list in address order (a snapshot)."""
        return ([self.mappings[va] for va in self._map_starts],
                [self.reservations[base] for base in self._res_starts])

    # ---------------------------------------------------------------- recording
    def add_reservation(self, base: int, size: int) -> None:
        """Record the reservation [base, base+size) (it overlaps none)."""
        self.reservations[base] = Reservation(base, size)
        bisect.insort(self._res_starts, base)

    def remove_reservation(self, base: int) -> None:
        """Forget the reservation at `base` (nothing is mapped inside it)."""
        del self.reservations[base]
        del self._res_starts[bisect.bisect_left(self._res_starts, base)]

    def add_mapping(self, va: int, size: int, handle: int, offset: int) -> None:
        """Record that `handle` is mapped at [va, va+size) from `offset`, with no access yet."""
        self.mappings[va] = Mapping(va, size, handle, offset, bytearray(size // self.granularity))
        bisect.insort(self._map_starts, va)

    def add_mappings(self, vas: list[int], size: int, handles: list[int]) -> None:
        """`add_mapping` of `size` bytes of `handles[i]` at `vas[i]`, offset 0, for a run of addresses
        `size` apart in ascending order that no mapping meets: one insertion into the sorted starts."""
        if not vas:
            return
        granules = size // self.granularity
        for va, handle in zip(vas, handles):
            self.mappings[va] = Mapping(va, size, handle, 0, bytearray(granules))
        i = bisect.bisect_left(self._map_starts, vas[0])
        self._map_starts[i:i] = vas

    def remove_mappings(self, maps: list[Mapping]) -> None:
        """Forget `maps`, which `covering` returned: they tile one range, so their starts are adjacent."""
        first = bisect.bisect_left(self._map_starts, maps[0].va)
        del self._map_starts[first:first + len(maps)]
        for m in maps:
            del self.mappings[m.va]

    def set_access(self, ptr: int, size: int, prot: int, maps: list[Mapping]) -> None:
        """Record that [ptr, ptr+size), which `maps` tile (`covering`), now has protection `prot`, granule by
        granule: the range may cover only part of its first and last mapping."""
        g, end, fill = self.granularity, ptr + size, bytes([prot])
        for m in maps:
            if len(m.prots) == 1 and ptr <= m.va:  # one granule, inside the range (a mapping meets it)
                m.prots[0] = prot
                continue
            first = (max(ptr, m.va) - m.va) // g
            last = (min(end, m.va + m.size) - m.va) // g
            m.prots[first:last] = fill * (last - first)
