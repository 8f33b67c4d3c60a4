"""Meshing (issue 26) on the emulated device: pages whose live bytes are disjoint share one physical page.

Every test checks bytes through every tensor's own address, the books' invariants (invariant 9 among
them: `check_invariants`), and, through `make_pool`, that nothing leaks at close.
"""

from __future__ import annotations

import gc

import pytest
import torch
from cuda.bindings.driver import CUresult

import defrag
from defrag.backing import TWIN

from .conftest import KiB, check_pattern, fill_pattern

MiB = 1 << 20
P = 64 * KiB  # page size of the small pools below


def _pinned(pool, nbytes, seed):
    t = pool.empty(nbytes, dtype=torch.uint8)
    fill_pattern(t, seed)
    pool.pin(t)
    return t


def _halves(pool, pages, block, keep=lambda page, part: (page % 2 == 0) == (part < 2)):
    """Fill `pages` pages with pinned blocks of `block` bytes, then keep those where `keep(page, quarter
    of the page)`; by default the first half of even pages and the second half of odd ones:
    complementary half-used pages. Returns {seed: tensor} kept."""
    per = P // block
    made = [_pinned(pool, block, i) for i in range(pages * per)]
    kept = {}
    for i, t in enumerate(made):
        page, slot = divmod(i, per)
        if keep(page, slot * 4 // per):
            kept[i] = t
        else:
            pool.unpin(t)
    del made, t
    gc.collect()
    return kept


def _alternate_quarters(page, part):
    """Quarters 0 and 2 of even pages, 1 and 3 of odd ones: no free range reaches a page's size."""
    return part % 2 == page % 2


def _intact(kept):
    for seed, t in kept.items():
        assert check_pattern(t, seed), f"tensor {seed} lost its bytes"


def _layout_meshes(pool):
    return [m for r in pool.layout()["regions"] for m in r["meshes"].items()]


# ---------------------------------------------------------------- the example
def test_complementary_half_pages_of_pinned_tensors_share_physical_pages(make_pool):
    """The issue's example: 64 MiB of pinned 256 KiB tensors, half of each 2 MiB page freed (even pages
    their second half, odd pages their first). Compaction cannot move pinned tensors; meshing halves
    the device pages held, with the same pointers and bytes, and writes stay separate."""
    pool = make_pool("64MiB", granularity=2 * MiB, auto_compact=False)
    per = (2 * MiB) // (256 * KiB)
    made = [_pinned(pool, 256 * KiB, i) for i in range(256)]
    kept = {}
    for i, t in enumerate(made):
        page, slot = divmod(i, per)
        if (page % 2 == 0) == (slot < per // 2):
            kept[i] = t
        else:
            pool.unpin(t)
    del made, t
    gc.collect()
    ptrs = {s: t.data_ptr() for s, t in kept.items()}
    assert pool.stats()["reserved_bytes.all.current"] == 64 * MiB
    report = pool.compact()
    assert report.moved_tensors == 0
    assert report.meshed_pages == 16 and report.mesh_freed_pages == 16
    assert report.mesh_copied_bytes == 16 * MiB
    st = pool.stats()
    assert st["reserved_bytes.all.current"] == 32 * MiB  # each physical page counted once
    assert st["pages.meshed"] == 16 and st["meshes"] == 16 and st["pages.mapped"] == 16
    assert st["allocated_bytes.all.current"] == 32 * MiB
    pool.check_invariants()
    assert {s: t.data_ptr() for s, t in kept.items()} == ptrs
    _intact(kept)
    # Writes through one tensor are not seen by a tensor of another member of its mesh.
    for seed, t in kept.items():
        fill_pattern(t, seed + 1000)
    _intact({s + 1000: t for s, t in kept.items()})
    # The freed physical pages serve new requests; nothing lands on bytes a twin still uses.
    fresh = {5000 + i: _pinned(pool, 256 * KiB, 5000 + i) for i in range(64)}
    _intact(fresh)
    _intact({s + 1000: t for s, t in kept.items()})
    pool.check_invariants()


# ---------------------------------------------------------------- books of a mesh
def test_a_free_on_a_twin_frees_nothing_in_the_other_members(make_pool):
    pool = make_pool("1MiB", auto_compact=False)
    kept = _halves(pool, 2, 8 * KiB)
    assert pool.mesh().meshed_pages == 1
    (mesh_id, (primary, twin)), = _layout_meshes(pool)
    base = pool.layout()["regions"][0]["base"]
    on_twin = {s: t for s, t in kept.items() if (t.data_ptr() - base) // P == twin}
    assert on_twin and len(on_twin) < len(kept)
    for s, t in list(on_twin.items()):
        pool.unpin(t)
        del kept[s]
    del on_twin, t
    gc.collect()
    pool.check_invariants()
    # The twin's offsets are free at the primary's address only; new blocks land there, and the
    # primary's tensors keep their bytes. (A size not freed on the twin: a freed range of the same
    # size may be reused in place, still allocated in the twin's heap.)
    fresh = {9000 + i: _pinned(pool, 16 * KiB, 9000 + i) for i in range(2)}
    for t in fresh.values():
        assert (t.data_ptr() - base) // P == primary, "a new block on a twin page"
    _intact(kept)
    _intact(fresh)
    pool.check_invariants()


def test_new_allocations_never_land_on_bytes_a_twin_uses(make_pool):
    pool = make_pool("1MiB", auto_compact=False)
    kept = _halves(pool, 8, 8 * KiB)
    report = pool.mesh()
    assert report.meshed_pages == 4
    fresh = {}
    for i in range(40):  # more than the meshed pages' free space: the rest goes to new pages
        fresh[7000 + i] = _pinned(pool, 8 * KiB, 7000 + i)
        _intact(kept)
    _intact(fresh)
    roles = pool.core.backing.roles[0]
    base = pool.layout()["regions"][0]["base"]
    assert not any(roles[(t.data_ptr() - base) // P] == TWIN for t in fresh.values())
    pool.check_invariants()


def test_a_block_straddling_into_a_twin_frees_through_the_primary(make_pool):
    """Y crosses from a full page into page 1, which becomes a twin of page 2. Freeing Y returns its
    twin piece to the primary's heap (the redirect); the heaps stay consistent and every byte intact."""
    pool = make_pool("1MiB", auto_compact=False)
    a = _pinned(pool, 48 * KiB, 1)
    y = _pinned(pool, 32 * KiB, 2)
    w = _pinned(pool, 8 * KiB, 3)
    f1 = _pinned(pool, 40 * KiB, 4)
    f2 = _pinned(pool, 32 * KiB, 5)
    z = _pinned(pool, 32 * KiB, 6)
    base = pool.layout()["regions"][0]["base"]
    assert [(t.data_ptr() - base) // KiB for t in (a, y, w, f1, f2, z)] == [0, 48, 80, 88, 128, 160]
    pool.unpin(f1)
    pool.unpin(f2)
    del f1, f2
    gc.collect()
    assert pool.mesh().meshed_pages == 1
    (_, (primary, twin)), = _layout_meshes(pool)
    assert (primary, twin) == (2, 1)
    pool.check_invariants()
    pool.unpin(y)
    del y
    gc.collect()
    pool.check_invariants()
    _intact({1: a, 3: w, 6: z})
    # The straddling block's twin piece [0, 16K) of page 1 is now free at page 2's offsets [0, 16K).
    fresh = _pinned(pool, 16 * KiB, 7)
    assert fresh.data_ptr() - base in (2 * P, 48 * KiB)  # the primary's head, or the freed head of Y
    _intact({1: a, 3: w, 6: z, 7: fresh})
    pool.check_invariants()


def test_a_large_request_goes_elsewhere_than_meshed_pages(make_pool):
    """Meshed pages (dormant twins included) never join a run of pages for a large request."""
    pool = make_pool("1MiB", auto_compact=False)
    kept = _halves(pool, 4, 8 * KiB)
    assert pool.mesh().meshed_pages == 2
    base = pool.layout()["regions"][0]["base"]
    roles = pool.core.backing.roles[0]
    twins = [p for p in range(len(roles)) if roles[p] == TWIN]
    for s, t in list(kept.items()):  # the twins go dormant: no block, still mapped
        if (t.data_ptr() - base) // P in twins:
            pool.unpin(t)
            del kept[s]
    t = None
    gc.collect()
    big = pool.empty(3 * P, dtype=torch.uint8)
    fill_pattern(big, 77)
    first, end = (big.data_ptr() - base) // P, (big.data_ptr() - base + 3 * P - 1) // P + 1
    assert not (pool.core.backing.mesh_ids[0][first:end] >= 0).any()
    _intact(kept)
    assert check_pattern(big, 77)
    pool.check_invariants()
    # trim drops the dormant twins (their meshes dissolve; it may mesh what is left anew).
    dormant = lambda: [p for p in range(len(roles)) if roles[p] == TWIN and pool.core.backing.live_count[0][p] == 0]
    assert dormant()
    pool.trim()
    assert not dormant()
    _intact(kept)
    pool.check_invariants()


def test_a_window_for_a_large_block_never_takes_a_meshed_pages_free_bytes():
    """A block of pages may be placed over free bytes and unmapped pages side by side; never over a
    meshed page's. On the serving trace at 60.98 GiB (`defrag replay`'s mesh search) such a window
    began in a mesh primary's free tail: stitching for it promoted the twin, which held the mesh's last
    live piece, and unmapped the primary under the window, so the placement raised HeapError."""
    from types import SimpleNamespace

    import numpy as np

    from defrag.core import _cheapest_window

    base = 1 << 30
    region = SimpleNamespace(base=base, handles=np.array([1, 1, 1, 0, 0, 0, 0, 0], dtype=np.int64))
    free = [(base + P + P // 8, 2 * P - P // 8)]  # the tail of page 1, then all of page 2; 3-7 unmapped
    meshed = np.zeros(8, dtype=bool)
    # Unmeshed: the block starts in page 1's tail, which saves one page of mapping.
    key, address = _cheapest_window(region, free, P, 4 * P, meshed)
    assert address == base + P + P // 8 and key[0] == 3
    for page in (1, 2):  # page 1 or page 2 meshed: the block starts after it, never on it
        meshed[:] = False
        meshed[page] = True
        key, address = _cheapest_window(region, free, P, 4 * P, meshed)
        assert address == base + (page + 1) * P, (page, (address - base) / P)
        assert key[0] == 4 - (2 - page)  # page 2 (free, unmeshed) still saves a page when page 1 is meshed
    meshed[:] = True
    meshed[3:] = False
    assert _cheapest_window(region, free, P, 4 * P, meshed)[1] == base + 3 * P


def test_splitting_meshes_restores_separate_pages(make_pool):
    pool = make_pool("1MiB", auto_compact=False)
    kept = _halves(pool, 6, 8 * KiB)
    ptrs = {s: t.data_ptr() for s, t in kept.items()}
    before = pool.stats()["reserved_bytes.all.current"]
    assert pool.mesh().meshed_pages == 3
    assert pool.stats()["reserved_bytes.all.current"] == before - 3 * P
    assert pool.unmesh() == 3
    st = pool.stats()
    assert st["reserved_bytes.all.current"] == before and st["pages.meshed"] == 0 and st["meshes"] == 0
    assert {s: t.data_ptr() for s, t in kept.items()} == ptrs
    _intact(kept)
    for s, t in kept.items():  # separate pages again: every write stays in its own tensor
        fill_pattern(t, s + 300)
    _intact({s + 300: t for s, t in kept.items()})
    pool.check_invariants()


# ---------------------------------------------------------------- faults
MESH_FAULTS = [("cuCtxSynchronize", 1), ("cuCtxSynchronize", 2), ("cuMemcpyDtoDAsync", 1), ("cuMemcpyDtoDAsync", 3),
               ("cuMemUnmap", 1), ("cuMemUnmap", 3), ("cuMemMap", 1), ("cuMemMap", 3), ("cuMemSetAccess", 1)]


def _quarters(pool, block=8 * KiB):
    """Four pages of pinned blocks, page k keeping only its k-th quarter: one mesh of four pages."""
    return _halves(pool, 4, block, keep=lambda page, part: part == page)


def _reserved_and_layout(pool):
    lay = pool.layout()
    return pool.stats()["reserved_bytes.all.current"], [(r["pages"], r["free_ranges"], r["mesh"]) for r in lay["regions"]]


@pytest.mark.parametrize("call, nth", MESH_FAULTS)
def test_a_fault_at_any_step_of_meshing_changes_nothing(make_pool, call, nth):
    pool = make_pool("1MiB", auto_compact=False)
    kept = _quarters(pool)
    before = _reserved_and_layout(pool)
    pool.driver.faults.inject(call, CUresult.CUDA_ERROR_LAUNCH_FAILED, nth=nth)
    with pytest.raises(defrag.CudaError) as info:
        pool.mesh(engine="driver")
    assert info.value.call == call and pool.driver.faults.pending() == 0
    pool.driver.faults.clear()
    assert _reserved_and_layout(pool) == before
    _intact(kept)
    pool.check_invariants()
    for s, t in kept.items():  # still separate pages
        fill_pattern(t, s + 100)
    _intact({s + 100: t for s, t in kept.items()})
    assert pool.mesh(engine="driver").meshed_pages == 3
    _intact({s + 100: t for s, t in kept.items()})
    pool.check_invariants()


SPLIT_FAULTS = [("cuCtxSynchronize", 1), ("cuCtxSynchronize", 2), ("cuMemAddressReserve", 1), ("cuMemcpyDtoDAsync", 1),
                ("cuMemUnmap", 1), ("cuMemUnmap", 2), ("cuMemMap", 1), ("cuMemMap", 2), ("cuMemSetAccess", 1),
                ("cuMemSetAccess", 2), ("cuMemAddressFree", 1)]


@pytest.mark.parametrize("call, nth", SPLIT_FAULTS)
def test_a_fault_at_any_step_of_splitting_changes_nothing(make_pool, call, nth):
    pool = make_pool("1MiB", auto_compact=False)
    kept = _halves(pool, 2, 8 * KiB)
    assert pool.mesh().meshed_pages == 1
    before = _reserved_and_layout(pool)
    pool.driver.faults.inject(call, CUresult.CUDA_ERROR_LAUNCH_FAILED, nth=nth)
    with pytest.raises(defrag.CudaError) as info:
        pool.unmesh()
    assert info.value.call == call and pool.driver.faults.pending() == 0
    pool.driver.faults.clear()
    assert _reserved_and_layout(pool) == before
    _intact(kept)
    pool.check_invariants()
    assert pool.unmesh() == 1
    _intact(kept)
    pool.check_invariants()


# ---------------------------------------------------------------- fuzz
from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule  # noqa: E402

from defrag.driver import Driver  # noqa: E402


class MeshMachine(RuleBasedStateMachine):
    """alloc/free/pin/write/compact/mesh/unmesh/trim with most blocks pinned; every byte of every
    tensor and every invariant checked after each step."""

    def __init__(self):
        super().__init__()
        self.driver = Driver.emulated(capacity=8 * MiB, granularity=P)
        self.pool = defrag.Pool(device=self.driver, capacity="1MiB", auto_compact=True)
        self.tensors: dict[int, torch.Tensor] = {}
        self.next_seed = 1

    @rule(nbytes=st.one_of(st.integers(1, 16 * KiB), st.integers(16 * KiB, 3 * P)), pinned=st.integers(0, 9))
    def alloc(self, nbytes, pinned):
        try:
            t = self.pool.empty(nbytes, dtype=torch.uint8)
        except defrag.OutOfMemoryError:
            return
        seed, self.next_seed = self.next_seed, self.next_seed + 1
        fill_pattern(t, seed)
        if pinned < 8:
            self.pool.pin(t)
        self.tensors[seed] = t

    @precondition(lambda self: self.tensors)
    @rule(data=st.data())
    def free(self, data):
        del self.tensors[data.draw(st.sampled_from(sorted(self.tensors)))]

    @rule(n=st.integers(4, 24), nbytes=st.integers(1, 8 * KiB))
    def alloc_many(self, n, nbytes):
        for _ in range(n):
            self.alloc(nbytes, 0)

    @precondition(lambda self: len(self.tensors) > 1)
    @rule(parity=st.integers(0, 1), parts=st.sampled_from([2, 4]))
    def free_complementary(self, parity, parts):
        """Free the tensors starting in one part of even pages and another of odd pages: pages with
        complementary live ranges, what meshing feeds on."""
        for seed, t in list(self.tensors.items()):
            # Pages counted from the region's start: an absolute address would make the choice depend on
            # where the reservation landed, and hypothesis needs the same steps to do the same thing.
            region = self.pool.core.space.region_of(t.data_ptr())
            page, offset = divmod(t.data_ptr() - region.base, P)
            if (page + offset * parts // P) % 2 == parity:
                del self.tensors[seed]

    @precondition(lambda self: self.tensors)
    @rule(data=st.data())
    def write(self, data):
        seed = data.draw(st.sampled_from(sorted(self.tensors)))
        t = self.tensors.pop(seed)
        new, self.next_seed = self.next_seed, self.next_seed + 1
        fill_pattern(t, new)
        self.tensors[new] = t

    @precondition(lambda self: self.tensors)
    @rule(data=st.data())
    def unpin(self, data):
        t = self.tensors[data.draw(st.sampled_from(sorted(self.tensors)))]
        if t.data_ptr() and self.pool.core.block_at(t.data_ptr()) and self.pool.core.block_at(t.data_ptr()).pins:
            self.pool.unpin(t)

    @rule()
    def compact(self):
        self.pool.compact()

    @rule()
    def mesh(self):
        self.pool.mesh()

    @rule()
    def unmesh(self):
        try:
            self.pool.unmesh()
        except ValueError:
            pass  # no physical page left for the next split: the rest stay meshed

    @rule()
    def trim(self):
        self.pool.trim()

    @invariant()
    def every_byte_and_invariant(self):
        self.pool.check_invariants()
        for seed, t in self.tensors.items():
            assert check_pattern(t, seed), f"tensor {seed} lost its bytes"

    def teardown(self):
        self.tensors.clear()
        self.pool.close()
        clean = {"handles": 0, "mappings": 0, "reservations": 0, "used_bytes": 0}
        if self.driver.api.state() != clean:
            gc.collect()  # ~0.1 s a collection: only when something is still held
        assert self.driver.api.state() == clean


TestMeshMachine = MeshMachine.TestCase
TestMeshMachine.settings = settings(max_examples=40, stateful_step_count=40, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------- under defrag.install
INSTALLED = r"""
import gc, torch, defrag
pool = defrag.Pool("emulated", capacity="64MiB")
defrag.install(pool)
P = pool.stats()["page_size"]
ts = [torch.full((65536,), float(i)) for i in range(128)]  # 256 KiB each, PyTorch-owned blocks
assert all(pool.owns_address(t.data_ptr()) for t in ts)
keep = {i: t for i, t in enumerate(ts) if ((t.data_ptr() // P) % 2 == 0) == (t.data_ptr() % P < P // 2)}
ptrs = {i: t.data_ptr() for i, t in keep.items()}
ts = t = None
gc.collect()
before = pool.stats()["reserved_bytes.all.current"]
with defrag.no_moves():  # PyTorch's blocks would move at this safe point: kept in place, they mesh
    report = pool.compact()
after = pool.stats()["reserved_bytes.all.current"]
assert report.moved_tensors == 0 and report.meshed_pages >= 6, report
assert after == before - report.mesh_freed_pages * P, (before, after, report)
assert {i: t.data_ptr() for i, t in keep.items()} == ptrs
for i, t in keep.items():
    assert bool((t == float(i)).all()), i
    t.add_(1000)
for i, t in keep.items():
    assert bool((t == float(i) + 1000).all()), i
pool.check_invariants()
# Native churn with no Python in the way: same sizes reuse freed ranges in place (on twins too),
# other sizes go to free space, which on a meshed page is only what is free in every member.
for _ in range(3):
    extra = [torch.full((65536,), -1.0) for _ in range(8)]
    small = [torch.full((1000,), -2.0) for _ in range(50)]
    for i, t in keep.items():
        assert bool((t == float(i) + 1000).all()), i
    assert all(bool((x == -1.0).all()) for x in extra) and all(bool((x == -2.0).all()) for x in small)
    del extra, small
pool.check_invariants()
for i in list(keep)[::2]:  # native frees, twins' blocks among them
    del keep[i]
gc.collect()
more = [torch.full((65536,), -3.0) for _ in range(16)]
for i, t in keep.items():
    assert bool((t == float(i) + 1000).all()), i
assert all(bool((x == -3.0).all()) for x in more)
pool.check_invariants()
print("ok", report.meshed_pages)
"""


def test_pytorch_owned_blocks_mesh_under_install():
    from .test_cpu_allocator import run
    from defrag import fastpath
    if fastpath.setting() == "off":
        pytest.skip("DEFRAG_FASTPATH=0: no native allocator")
    assert "ok" in run(INSTALLED).stdout


def test_the_memoryless_driver_keeps_the_same_books(make_pool):
    """A dry pool (memory-less driver) meshes the same pages as an emulated one for the same sequence."""
    from defrag.dry import DryPool
    block, pages = 8 * KiB, 8
    dry = DryPool("1MiB", page_size=P, auto_compact=False)
    per = P // block
    for i in range(pages * per):
        assert dry.alloc(i, block)
    pool = make_pool("1MiB", auto_compact=False)
    kept = _halves(pool, pages, block)
    for i in range(pages * per):
        if i not in kept:
            dry.free(i)
    before = dry.reserved_bytes()
    assert before == pool.stats()["reserved_bytes.all.current"]
    from defrag.mesher import mesh_core
    with dry.core.gate:  # its blocks are not pinned: a compaction would move them, so mesh directly
        dry_report = mesh_core(dry.core)
    real_report = pool.mesh()
    assert dry_report.meshed_pages == real_report.meshed_pages == pages // 2
    assert dry_report.copied_bytes == real_report.copied_bytes
    assert dry.reserved_bytes() == pool.stats()["reserved_bytes.all.current"] == before - pages // 2 * P
    assert dry.stats()["pages.meshed"] == pages // 2
    with dry.core.gate:
        dry.core.check_invariants()
    pool.check_invariants()
    _intact(kept)


# ---------------------------------------------------------------- when meshing runs
def test_the_ladder_meshes_before_it_reports_an_oom(make_pool):
    pool = make_pool("1MiB", auto_compact=True)  # 16 pages of 64 KiB
    kept = _halves(pool, 16, 8 * KiB, _alternate_quarters)
    assert pool.stats()["pages.mapped"] == 16 and pool.stats()["pages.cached"] == 0
    big = pool.empty(P, dtype=torch.uint8)  # every page is held: compaction cannot help, meshing can
    fill_pattern(big, 500)
    st = pool.stats()
    assert st["num_meshes.automatic"] == 1 and st["pages.meshed"] == 1 and st["num_ooms"] == 0
    bigger = pool.empty(4 * P, dtype=torch.uint8)  # meshes as many more as it needs
    fill_pattern(bigger, 501)
    assert pool.stats()["pages.meshed"] == 5
    _intact(kept)
    _intact({500: big, 501: bigger})
    pool.check_invariants()
    with pytest.raises(defrag.OutOfMemoryError) as info:
        pool.empty(8 * P, dtype=torch.uint8)  # 3 more pages at most: meshing says so
    assert any("meshing" in step for step in info.value.tried)
    _intact(kept)
    pool.check_invariants()


def test_auto_compact_false_never_meshes_on_its_own(make_pool):
    pool = make_pool("1MiB", auto_compact=False)
    kept = _halves(pool, 16, 8 * KiB, _alternate_quarters)
    with pytest.raises(defrag.OutOfMemoryError):
        pool.empty(P, dtype=torch.uint8)
    assert pool.stats()["num_meshes"] == 0
    _intact(kept)


CALLBACK = r"""
import gc, torch, defrag
pool = defrag.Pool("emulated", capacity="32MiB")
defrag.install(pool)
P = pool.stats()["page_size"]
ts = [torch.full((65536,), float(i)) for i in range(128)]  # fills all 16 pages
# Alternate quarters of a page: no free range reaches a page's size.
keep = {i: t for i, t in enumerate(ts) if (t.data_ptr() % P * 4 // P) % 2 == (t.data_ptr() // P) % 2}
ts = t = None
gc.collect()
try:  # PyTorch's own allocation: the callback's ladder never meshes (nor compacts), it raises
    torch.empty(P, dtype=torch.uint8)
    raise SystemExit("allocated without a free page")
except torch.OutOfMemoryError:
    pass
assert pool.stats()["num_meshes"] == 0
with defrag.no_moves():  # an explicit call from the thread that runs the model: meshing may run
    report = pool.compact()
assert report.meshed_pages >= 1 and report.moved_tensors == 0, report
x = torch.full((P,), 3, dtype=torch.uint8)
assert bool((x == 3).all())
for i, t in keep.items():
    assert bool((t == float(i)).all()), i
pool.check_invariants()
print("ok")
"""


def test_never_meshes_inside_pytorchs_allocator_callback():
    from .test_cpu_allocator import run
    from defrag import fastpath
    if fastpath.setting() == "off":
        pytest.skip("DEFRAG_FASTPATH=0: no native allocator")
    assert "ok" in run(CALLBACK).stdout


def test_trim_meshes_then_releases(make_pool):
    pool = make_pool("1MiB", auto_compact=False)
    kept = _halves(pool, 8, 8 * KiB)
    total = pool.stats()["pages.total"]
    released = pool.trim()
    st = pool.stats()
    assert released == 4 * P and st["pages.meshed"] == 4 and st["pages.total"] == total - 4
    assert st["reserved_bytes.all.current"] == 4 * P
    _intact(kept)
    pool.check_invariants()


def test_sleep_and_offload_refuse_meshed_pages(make_pool):
    pool = make_pool("1MiB", auto_compact=False)
    kept = _halves(pool, 2, 8 * KiB)
    assert pool.mesh().meshed_pages == 1
    with pytest.raises(defrag.ResidencyError, match="unmesh"):
        pool.sleep()
    _intact(kept)
    pool.check_invariants()
    pool.unmesh()
    pool.sleep()
    pool.wake()
    _intact(kept)
    pool.check_invariants()


INSTALLED_FUZZ = r"""
import gc, random, sys, torch, defrag
from defrag.driver import Driver
pool = defrag.Pool(device=Driver.emulated(capacity=64 << 20, granularity=256 << 10), capacity="16MiB")
defrag.install(pool)
P = pool.stats()["page_size"]
rng = random.Random(int(sys.argv[1]))
live = {}  # key -> (tensor, value)
key = 0
def check():
    for k, (t, v) in live.items():
        assert bool((t == v).all()), (k, v)
meshed = 0
for step in range(400):
    op = rng.random()
    if op < 0.45:
        n = rng.choice([rng.randint(1, 4096), rng.randint(4096, 64 << 10), rng.randint(64 << 10, 600 << 10)])
        try:
            t = torch.full((n,), key % 251, dtype=torch.uint8)
        except torch.OutOfMemoryError:
            continue
        live[key] = (t, key % 251)
        key += 1
    elif op < 0.75 and live:
        for k in rng.sample(sorted(live), max(1, len(live) // 4)):
            t, v = live[k]
            if (t.data_ptr() // P + t.data_ptr() % P * 2 // P) % 2 == step % 2:
                del live[k]
    elif op < 0.85 and live:
        k = rng.choice(sorted(live))
        t, _ = live[k]
        t.fill_(200 + step % 50)
        live[k] = (t, 200 + step % 50)
    elif op < 0.95:
        meshed += pool.compact().meshed_pages
    else:
        pool.trim()
    if step % 20 == 0:
        gc.collect()
        check()
        pool.check_invariants()
gc.collect()
check()
pool.check_invariants()
print("ok", meshed)
"""


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_fuzz_under_install_keeps_every_byte(seed):
    from .test_cpu_allocator import run
    from defrag import fastpath
    if fastpath.setting() == "off":
        pytest.skip("DEFRAG_FASTPATH=0: no native allocator")
    out = run(INSTALLED_FUZZ, str(seed)).stdout
    assert "ok" in out, out
