"""`AddressBooks` records mappings by runs (`_Run`): the mappings one batch made, end to end, split by the
unmaps that take some of them. Every answer must be the one a record per mapping would give: this test
drives both with the same random calls and compares every answer and the whole books after each call."""
from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from defrag.driver.address_books import AddressBooks
from defrag.driver.host_memory import PROT_NONE, PROT_READ, PROT_RW

G = 1 << 21
BASE = 1 << 40
GRANULES = 24


class _PerMapping:
    """The books as a dict of one record per mapping: start -> [size, handle, protection per granule]."""

    def __init__(self):
        self.maps: dict[int, list] = {}

    def meeting(self, va: int, size: int) -> list[int]:
        return sorted(s for s, (n, _, _) in self.maps.items() if s < va + size and va < s + n)

    def tiles(self, va: int, size: int) -> list[int] | None:
        starts = self.meeting(va, size)
        if not starts or starts[0] > va:
            return None
        end = starts[0]
        for s in starts:
            if s != end:
                return None
            end = s + self.maps[s][0]
        return starts if end >= va + size else None

    def accessible(self, ptr: int, size: int, write: bool) -> bool:
        starts = self.tiles(ptr, size)
        if starts is None:
            return False
        need = PROT_RW if write else PROT_READ
        for s in starts:
            n, _, prots = self.maps[s]
            for k, p in enumerate(prots):
                lo = s + k * G
                if lo < ptr + size and ptr < lo + G and p & need != need:
                    return False
        return True

    def snapshot(self) -> list[tuple]:
        return [(s, n, h, 0, bytes(p)) for s, (n, h, p) in sorted(self.maps.items())]


_ops = st.lists(st.tuples(st.sampled_from(["map", "unmap", "access", "ask"]),
                          st.integers(0, GRANULES - 1), st.integers(1, 12), st.sampled_from([1, 1, 2]),
                          st.sampled_from([PROT_NONE, PROT_READ, PROT_RW]), st.booleans()),
                max_size=60)


@settings(max_examples=150, deadline=None)
@given(_ops)
@example([("map", 0, 10, 1, PROT_NONE, False), ("access", 2, 1, 1, PROT_RW, False),
          ("access", 3, 2, 1, PROT_READ, False), ("unmap", 4, 1, 1, PROT_NONE, False),  # a run split in two
          ("unmap", 0, 2, 1, PROT_NONE, False), ("access", 6, 4, 1, PROT_RW, True),   # its head, then access
          ("ask", 2, 2, 1, PROT_NONE, False), ("ask", 5, 3, 1, PROT_NONE, True),
          ("map", 10, 3, 2, PROT_NONE, False), ("map", 4, 1, 1, PROT_NONE, False),      # runs joined or not
          ("access", 3, 10, 1, PROT_RW, False), ("unmap", 9, 3, 1, PROT_NONE, False),
          ("unmap", 5, 5, 1, PROT_NONE, False), ("ask", 0, 16, 1, PROT_NONE, True)])
def test_books_by_runs_answer_as_one_record_per_mapping(ops):
    books, model = AddressBooks(G), _PerMapping()
    books.add_reservation(BASE, GRANULES * G)
    next_handle = 0x1000
    for op, first, count, per, prot, write in ops:
        va, size = BASE + first * G, count * G
        assert books.any_in(va, size) == bool(model.meeting(va, size))
        if op == "map":  # `count` mappings of `per` granules each, end to end, where none lies yet
            msize = per * G
            vas = [va + i * msize for i in range(count) if va + (i + 1) * msize <= BASE + GRANULES * G]
            if not vas or model.meeting(vas[0], len(vas) * msize):
                continue
            handles = list(range(next_handle, next_handle + len(vas)))
            next_handle += len(vas)
            books.add_mappings(vas, msize, handles)
            for v, h in zip(vas, handles):
                model.maps[v] = [msize, h, bytearray(per)]
        elif op == "unmap":  # only whole mappings, exactly tiling the range
            cover = books.covering(va, size)
            starts = model.tiles(va, size)
            assert (cover is None) == (starts is None)
            exact = starts is not None and starts[0] == va and starts[-1] + model.maps[starts[-1]][0] == va + size
            assert (cover is not None and books.cover_span(cover) == (va, va + size)) == exact
            if exact:
                handles = books.remove_mappings(cover)
                assert handles == [model.maps[s][1] for s in starts]
                for s in starts:
                    del model.maps[s]
        elif op == "access":  # may cover part of its first and last mapping
            cover = books.covering(va, size)
            starts = model.tiles(va, size)
            assert (cover is None) == (starts is None)
            if cover is not None:
                books.set_access(va, size, prot, cover)
                for s in starts:
                    n, _, prots = model.maps[s]
                    for k in range(n // G):
                        if va <= s + k * G < va + size:
                            prots[k] = prot
        else:
            assert books.accessible(va, size, write) == model.accessible(va, size, write)
            assert books.accessible(va, 0, write) == model.accessible(va, 0, write)  # nothing: met by no mapping
            assert books.accessible(va + 4096, size - 8192 or 1, write) == model.accessible(va + 4096, size - 8192 or 1,
                                                                                           write)
        maps, _ = books.in_address_order()
        assert [(m.va, m.size, m.handle, m.offset, bytes(m.prots)) for m in maps] == model.snapshot()
        assert len(books) == len(model.maps)
        assert [(m.va, m.size, m.handle) for m in books.mappings_in(va, size)] == \
            [(s, model.maps[s][0], model.maps[s][1]) for s in model.meeting(va, size)]
