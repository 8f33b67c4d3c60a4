"""Compaction on the emulated device: bytes, views, identity, rollback on every fault."""

from __future__ import annotations

import copy
import gc

import numpy as np
import pytest
import torch
from cuda.bindings.driver import CUresult
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import rule

import defrag
from defrag.vmm import Transaction
from defrag import compactor

from .conftest import KiB, check_pattern, fill_pattern
from .test_pool import PoolMachine

PAGE = 64 * KiB


def fragment(pool, n=64, keep_every=4, nbytes=PAGE // 4):
    """Fill the pool with equal tensors; free 3 of every 4 by address so every page keeps one."""
    ts = [pool.empty(nbytes, dtype=torch.uint8) for _ in range(n)]
    ts.sort(key=lambda t: t.data_ptr())
    for i, t in enumerate(ts):
        fill_pattern(t, i + 1)
    survivors = {i + 1: t for i, t in enumerate(ts) if i % keep_every == 0}
    del ts, t
    return survivors


def test_the_fragmentation_scenario(make_pool):
    pool = make_pool("1MiB", auto_compact=False)  # 16 pages of 64 KiB
    survivors = fragment(pool)
    views = {seed: t[100:200] for seed, t in survivors.items()}
    ids = {seed: id(t) for seed, t in survivors.items()}
    st_ = pool.stats()
    assert st_["pages.mapped"] == 16 and st_["stranded_bytes"] == 16 * 3 * PAGE // 4
    with pytest.raises(defrag.OutOfMemoryError):
        pool.empty(pool.capacity // 2, dtype=torch.uint8)
    report = pool.compact()
    assert report.moved_tensors == 12 and report.moved_bytes == 12 * PAGE // 4
    assert report.released_pages == 12 and report.pages_before == 16 and report.pages_after == 4
    assert report.fragmentation_before == pytest.approx(0.75) and report.fragmentation_after == 0.0
    assert set(report.phases) >= {"plan", "copy", "swap", "release"}
    assert "moved 12 tensors" in str(report)
    big = pool.empty(pool.capacity // 2, dtype=torch.uint8)
    fill_pattern(big, 999)
    for seed, t in survivors.items():
        assert id(t) == ids[seed] and check_pattern(t, seed)
        full = torch.empty(PAGE // 4, dtype=torch.uint8)
        fill_pattern(full, seed)
        assert torch.equal(views[seed], full[100:200])
        assert views[seed].data_ptr() == t.data_ptr() + 100
    assert check_pattern(big, 999)
    st_ = pool.stats()
    assert st_["num_compactions"] == 1 and st_["num_compactions.explicit"] == 1
    assert st_["compaction.moved_tensors"] == 12
    pool.check_invariants()


@pytest.mark.parametrize("release", [False, True])
def test_the_reports_fragmentation_figures_are_the_stats(make_pool, release):
    """The report's stranded bytes and fragmentation, before and after, are what stats() says then."""
    pool = make_pool("1MiB", auto_compact=False)
    survivors = fragment(pool, n=40)
    pinned = next(iter(survivors.values()))
    pool.pin(pinned)  # its page stays, so fragmentation stays above zero after
    small = [pool.empty(1000, dtype=torch.uint8) for _ in range(5)]  # a few sub-page remnants
    del small[1::2]
    before = pool.stats()
    report = pool.compact(release=release)
    after = pool.stats()
    assert report.moved_tensors > 0
    assert (report.stranded_before, report.fragmentation_before) == (before["stranded_bytes"],
                                                                      before["fragmentation"])
    assert (report.stranded_after, report.fragmentation_after) == (after["stranded_bytes"], after["fragmentation"])
    pool.unpin(pinned)
    pool.check_invariants()


def test_compaction_preserves_metadata_and_grads(make_pool):
    pool = make_pool("1MiB")
    keep = []
    for i in range(40):
        t = pool.full((1000,), float(i), dtype=torch.float32, requires_grad=(i % 2 == 0))
        keep.append(t)
    x = keep[20]
    (x * 3).sum().backward()
    for i in range(0, 40, 3):
        keep[i] = None
    alive = [(t, t.shape, t.stride(), t.dtype, t.requires_grad, id(t), t.clone()) for t in keep if t is not None]
    transposed = alive[0][0].view(25, 40).t()
    report = pool.compact(verify=True)
    assert report.moved_tensors > 0 and report.verified
    for t, shape, stride, dtype, rg, ident, data in alive:
        assert (t.shape, t.stride(), t.dtype, t.requires_grad, id(t)) == (shape, stride, dtype, rg, ident)
        assert torch.equal(t.detach(), data)
    assert torch.equal(x.grad, torch.full((1000,), 3.0))
    assert torch.equal(transposed, alive[0][6].view(25, 40).t())
    pool.check_invariants()


def test_pinned_blocks_never_move(make_pool):
    pool = make_pool("1MiB", auto_compact=False)
    survivors = fragment(pool)
    pinned = [survivors[1], survivors[33]]
    addresses = [t.data_ptr() for t in pinned]
    for t in pinned:
        pool.pin(t)
    report = pool.compact()
    assert [t.data_ptr() for t in pinned] == addresses
    assert report.pages_after <= 4 + 2
    for seed, t in survivors.items():
        assert check_pattern(t, seed)
    pool.check_invariants()


def test_compaction_of_a_packed_pool_moves_nothing(make_pool):
    pool = make_pool("1MiB")
    ts = [pool.full((PAGE // 4,), float(i)) for i in range(8)]
    report = pool.compact()
    assert report.moved_tensors == 0 and report.released_pages == 0
    assert all(torch.equal(t, torch.full((PAGE // 4,), float(i))) for i, t in enumerate(ts))


def test_other_pools_are_untouched(make_pool):
    a, b = make_pool("1MiB"), make_pool("1MiB")
    sa, sb = fragment(a), fragment(b)
    b_addresses = {seed: t.data_ptr() for seed, t in sb.items()}
    a.compact()
    assert {seed: t.data_ptr() for seed, t in sb.items()} == b_addresses
    reports = defrag.compact()
    assert len(reports) >= 2
    assert all(check_pattern(t, s) for s, t in sa.items()) and all(check_pattern(t, s) for s, t in sb.items())


def test_refused_during_graph_capture(make_pool):
    pool = make_pool("1MiB")
    survivors = fragment(pool)
    addresses = {s: t.data_ptr() for s, t in survivors.items()}
    pool.driver.api.capturing = True
    with pytest.raises(defrag.CompactionError, match="CUDA graph"):
        pool.compact()
    pool.driver.api.capturing = False
    assert {s: t.data_ptr() for s, t in survivors.items()} == addresses


@pytest.mark.parametrize("engine", ["memmove", "driver"])
def test_engines_give_the_same_bytes(make_pool, engine):
    pool = make_pool("1MiB")
    survivors = fragment(pool)
    report = pool.compact(engine=engine, verify=True)
    assert report.engine == engine and report.moved_tensors == 12
    assert all(check_pattern(t, s) for s, t in survivors.items())


def test_bad_engine(make_pool):
    pool = make_pool()
    with pytest.raises(ValueError, match="unknown copy engine"):
        pool.compact(engine="dma")


def test_on_compact_callbacks_and_progress_bar(make_pool, capsys):
    pool = make_pool("1MiB")
    fragment(pool)
    seen = []
    pool.on_compact.append(seen.append)
    report = pool.compact(progress=True)
    assert seen == [report]
    assert "defrag compact" in capsys.readouterr().err


# ---------------------------------------------------------------- faults at every step
FAULTS = [
    ("cuCtxSynchronize", 1), ("cuCtxSynchronize", 2), ("cuMemMap", 1), ("cuMemSetAccess", 1), ("cuMemCreate", 1),
    ("cuMemcpyDtoDAsync", 1), ("cuMemcpyDtoDAsync", 7), ("cuMemUnmap", 1), ("cuMemUnmap", 3),
]


@pytest.mark.parametrize("call, nth", FAULTS)
def test_a_driver_fault_at_any_step_loses_nothing(make_pool, call, nth):
    pool = make_pool("1MiB", auto_compact=False)
    survivors = fragment(pool)
    # Destinations on unmapped pages force map/SetAccess/create calls inside the compaction.
    pool.trim()
    pool.driver.faults.inject(call, CUresult.CUDA_ERROR_LAUNCH_FAILED, nth=nth)
    try:
        pool.compact(engine="driver")
    except defrag.CudaError as exc:
        assert exc.call == call
    pool.driver.faults.clear()
    pool.check_invariants()
    for seed, t in survivors.items():
        assert check_pattern(t, seed), f"tensor {seed} lost its bytes after a fault in {call}"
    # And the pool still compacts and serves a large request afterwards.
    pool.compact()
    big = pool.empty(pool.capacity // 2, dtype=torch.uint8)
    fill_pattern(big, 5)
    assert check_pattern(big, 5) and all(check_pattern(t, s) for s, t in survivors.items())
    pool.check_invariants()


@pytest.mark.parametrize("undo_nth", [1, 2, 3])
def test_a_fault_in_the_undo_of_a_failed_mapping_still_loses_nothing(make_pool, undo_nth):
    """SetAccess refused for a request's new pages, then one unmap of the undo refused too: that page stays
    mapped (access granted again) as an empty page of the pool, the books match the device, nothing is
    lost, the pool serves the request once the fault is gone, and a trim unmaps the extra page."""
    pool = make_pool("2MiB", auto_compact=False)
    keep = pool.empty(PAGE // 4, dtype=torch.uint8)
    fill_pattern(keep, 3)
    mapped = pool.stats()["pages.mapped"]
    pool.driver.faults.inject("cuMemSetAccess", CUresult.CUDA_ERROR_LAUNCH_FAILED, nth=1)
    pool.driver.faults.inject("cuMemUnmap", CUresult.CUDA_ERROR_LAUNCH_FAILED, nth=undo_nth)
    with pytest.raises(defrag.CudaError) as info:
        pool.empty(3 * PAGE, dtype=torch.uint8)
    assert info.value.call == "cuMemSetAccess" and pool.driver.faults.pending() == 0
    pool.driver.faults.clear()
    pool.check_invariants()
    stats = pool.stats()
    assert stats["pages.mapped"] == mapped + 1 and stats["pages.empty"] == 1 and stats["live_blocks"] == 1
    assert pool.driver.api.state()["mappings"] == mapped + 1  # the books match the device
    assert check_pattern(keep, 3)
    big = pool.empty(3 * PAGE, dtype=torch.uint8)  # the page left mapped is as good as any
    fill_pattern(big, 4)
    assert check_pattern(big, 4) and check_pattern(keep, 3)
    del big
    pool.trim()
    assert pool.stats()["pages.mapped"] == mapped
    pool.check_invariants()


def test_a_placement_retried_from_donor_pages_keeps_a_page_its_first_undo_left_mapped(make_pool):
    """The device refuses a placement's second page (out of memory) and then the undo's unmap of the
    first: that first page stays mapped, an empty page of the heap, and the retry from donor pages maps
    only the page still missing (it used to ask to map the first page again: ValueError)."""
    pool = make_pool("2MiB", auto_compact=False)
    backing, region = pool.core.backing, pool.core.regions[0]
    with Transaction() as txn:
        backing.map(region, [10, 11], txn)  # empty mapped pages: the donors
    faults = pool.driver.faults
    faults.inject("cuMemMap", CUresult.CUDA_ERROR_OUT_OF_MEMORY, nth=2)
    faults.inject("cuMemUnmap", CUresult.CUDA_ERROR_LAUNCH_FAILED, nth=1)
    with pool.core.gate, Transaction() as txn:
        backing.map_for_placement(region, [0, 1], txn)
    assert faults.pending() == 0
    faults.clear()
    assert region.handles[0] and region.handles[1]
    # 0, 1 and both donors: page 1 is mapped from the handle its failed map gave back to the store, so
    # no donor had to go (the retry counts only the pages still unmapped).
    assert pool.stats()["pages.mapped"] == 4
    pool.check_invariants()
    t = pool.empty(2 * PAGE, dtype=torch.uint8)
    fill_pattern(t, 9)
    assert check_pattern(t, 9)
    pool.check_invariants()


class Boom(RuntimeError):
    pass


@pytest.mark.parametrize("where", ["copy", "verify", "storage", "rebase"])
def test_an_exception_mid_compaction_rolls_back(make_pool, monkeypatch, where):
    """A failure anywhere before the commit (the copy, its verification, making the temporaries'
    storages, the in-place rebase) leaves every tensor where and as it was, and the books as before."""
    from defrag.pool_context import _TorchMover

    pool = make_pool("1MiB", auto_compact=False)
    survivors = fragment(pool)
    addresses = {s: t.data_ptr() for s, t in survivors.items()}
    before = pool.stats()
    real_copy = compactor._copy

    def corrupt_then_fail(core, mover, engine, moves):
        real_copy(core, mover, engine, moves)
        for _, dst, n in moves:  # scribble over the destinations, then fail
            torch.frombuffer((torch.uint8.__class__ and __import__("ctypes").c_uint8 * n).from_address(dst),
                             dtype=torch.uint8).fill_(0xEE)
        raise Boom("copy failed")

    if where == "copy":
        monkeypatch.setattr(compactor, "_copy", corrupt_then_fail)
        expected = Boom
    elif where == "verify":
        def bad_copy(core, mover, engine, moves):
            real_copy(core, mover, engine, moves[:-1])  # one move silently not done
        monkeypatch.setattr(compactor, "_copy", bad_copy)
        expected = defrag.CompactionError
    elif where == "rebase":
        def failing_rebase(self, users, addresses, olds):
            raise Boom("rebase failed")  # as the C++ call would on running out of memory, before any change
        monkeypatch.setattr(_TorchMover, "rebase_all", failing_rebase)
        expected = Boom
    else:
        monkeypatch.setattr(_TorchMover, "_rebases", lambda self: False)  # through temporaries
        real = pool._context.mover.destinations

        def failing_storages(blocks):
            made = real(blocks[:4])  # some destinations exist (and die with the wave) when the next fails
            assert len(made) == 4
            raise Boom("storage creation failed")
        monkeypatch.setattr(pool._context.mover, "destinations", failing_storages)
        expected = Boom
    with pytest.raises(expected):
        pool.compact(verify=True)
    monkeypatch.undo()
    gc.collect()
    pool.check_invariants()
    assert {s: t.data_ptr() for s, t in survivors.items()} == addresses
    assert all(check_pattern(t, s) for s, t in survivors.items())
    after = pool.stats()
    assert after["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]
    assert after["live_blocks"] == before["live_blocks"]


@pytest.mark.parametrize("commit", ["rebase", "rebase_then_swap_storages", "swap_storages", "move_by_move"])
def test_a_storage_changed_during_the_copy_stops_the_wave(make_pool, monkeypatch, commit):
    """The commit checks every owner before rewriting any (owners rebased in one C++ call, swapped with
    temporaries in one C++ call, or move by move): an owner whose memory changed meanwhile makes the
    wave roll back, every tensor where and as it was."""
    from defrag import fastpath
    from defrag.pool_context import _TorchMover

    if commit.endswith("swap_storages") and getattr(fastpath.module, "swap_storages", None) is None:
        pytest.skip("no batched storage swap here (needs the fast path built against torch >= 2.13)")
    if not commit.startswith("rebase"):
        monkeypatch.setattr(_TorchMover, "_rebases", lambda self: False)
    if commit == "move_by_move":
        monkeypatch.setattr(_TorchMover, "commit_all", lambda self, dests: None)
    pool = make_pool("1MiB", auto_compact=False)
    survivors = fragment(pool)
    addresses = {s: t.data_ptr() for s, t in survivors.items()}
    before = pool.stats()
    real_copy = compactor._copy
    victim = {}

    def copy_then_meddle(core, mover, engine, moves):
        real_copy(core, mover, engine, moves)
        # The last moved tensor's storage takes other memory (as a stray thread might): its check fails.
        # For the rebase, that memory is another pool tensor's of the same size, so that only the
        # address tells (memory not made by the fast path sends the wave to the temporaries).
        seed = next(s for s, t in survivors.items() if t.data_ptr() == moves[-1][0])
        storage = survivors[seed].untyped_storage()
        if commit == "rebase":
            stray = next(t.untyped_storage() for s, t in survivors.items()
                         if s != seed and t.untyped_storage().nbytes() == storage.nbytes())
        else:
            stray = torch.UntypedStorage(storage.nbytes())
        storage._swap_data_ptr_(stray)
        victim.update(seed=seed, storage=storage, stray=stray)

    monkeypatch.setattr(compactor, "_copy", copy_then_meddle)
    rebased = []
    real_rebase = _TorchMover.rebase_all
    monkeypatch.setattr(_TorchMover, "rebase_all", lambda self, *a: rebased.append(real_rebase(self, *a)) or rebased[-1])
    with pytest.raises(defrag.CompactionError, match="changed during compaction; nothing was moved"):
        pool.compact()
    monkeypatch.undo()
    if commit == "rebase":
        assert len(rebased) == 1 and rebased[0] >= 0  # the rebase itself found the changed owner
    elif commit == "rebase_then_swap_storages":
        assert rebased == [-2]  # memory the fast path did not make: the temporaries' swap found it
    else:
        assert rebased == []
    victim["storage"]._swap_data_ptr_(victim["stray"])  # give the tensor its pool memory back
    gc.collect()
    pool.check_invariants()
    assert {s: t.data_ptr() for s, t in survivors.items()} == addresses
    assert all(check_pattern(t, s) for s, t in survivors.items())
    after = pool.stats()
    assert after["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]
    assert after["live_blocks"] == before["live_blocks"]
    assert pool.compact().moved_tensors > 0  # and the next compaction moves them


# ---------------------------------------------------------------- training
def _step(model, opt, x, y):
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach().clone()


def test_training_compacted_between_steps_is_bit_identical(make_pool):
    pool = make_pool("4MiB")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 10))
    twin = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    data = [(torch.randn(32, 64), torch.randint(0, 10, (32,))) for _ in range(6)]
    _step(model, opt, *data[0])
    _step(twin, twin_opt, *data[0])
    # Scratch tensors between adoptions scatter parameters and state over many pages.
    scratch = []
    for p in model.parameters():
        pool.adopt(p)
        scratch.append(pool.empty(48 * KiB, dtype=torch.uint8))
    pool.adopt(model)  # the grads
    for state in opt.state.values():
        for v in state.values():
            pool.adopt(v)
            scratch.append(pool.empty(40 * KiB, dtype=torch.uint8))
    assert all(pool.owns(v) for s in opt.state.values() for v in s.values())
    del scratch
    moved = 0
    for x, y in data[1:]:
        # Scratch tensors between steps fragment the pool; then compact.
        scratch = [pool.empty(int(torch.randint(1000, 200_000, ()).item()), dtype=torch.uint8) for _ in range(30)]
        del scratch[::2]
        a = _step(model, opt, x, y)
        b = _step(twin, twin_opt, x, y)
        assert torch.equal(a, b)
        del scratch
        moved += pool.compact().moved_tensors
    assert moved > 0
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q) and torch.equal(p.grad, q.grad)
    pool.check_invariants()


# ---------------------------------------------------------------- property-based
class CompactMachine(PoolMachine):
    """The pool machine's random alloc/free/view/adopt/pin/trim sequences, with compact() interleaved."""

    @rule(verify=st.booleans(), release=st.booleans())
    def compact(self, verify, release):
        pinned = {a.address for a in self.pool.live_tensors() if a.pinned}
        before = self.pool.stats()
        pages_before = self.pool.core.backing.live_pages()
        report = self.pool.compact(verify=verify, release=release)
        after = self.pool.stats()
        assert pinned == {a.address for a in self.pool.live_tensors() if a.pinned}
        assert (report.pages_before, report.pages_after) == (pages_before, self.pool.core.backing.live_pages())
        assert report.pages_after <= report.pages_before
        # An explicit compaction never maps more pages than were mapped before it, not even transiently.
        assert after["reserved_bytes.all.peak"] == before["reserved_bytes.all.peak"]
        assert after["pages.mapped"] <= before["pages.mapped"]


CompactMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=25, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])
test_compaction_random_sequences = CompactMachine.TestCase


def _driver_calls(pool, *names):
    calls = pool.driver.faults.calls
    return {n: calls.get(n, 0) for n in names}


def test_compaction_leaves_emptied_pages_mapped_and_a_large_request_reuses_them(make_pool):
    """By default a compaction makes no mapping call; the pages it empties stay mapped and free, and
    a request of several pages is stitched from them (unmapped there, mapped in its window) instead of
    new physical pages, though the pool could still create 16 more: reserved bytes never grow."""
    pool = make_pool("2MiB", auto_compact=False)  # 32 pages of 64 KiB; the fill maps 16
    survivors = fragment(pool)
    created = pool.core.space.store.created
    before = _driver_calls(pool, "cuMemMap", "cuMemUnmap", "cuMemCreate")
    report = pool.compact()
    assert report.released_pages == 12 and report.unmapped_pages == 0
    assert _driver_calls(pool, "cuMemMap", "cuMemUnmap", "cuMemCreate") == before
    st_ = pool.stats()
    assert st_["pages.mapped"] == 16 and st_["reserved_bytes.all.current"] == 16 * PAGE
    big = pool.empty(8 * PAGE, dtype=torch.uint8)
    fill_pattern(big, 77)
    st_ = pool.stats()
    assert st_["pages.mapped"] == 16 and st_["reserved_bytes.all.peak"] == 16 * PAGE
    assert pool.core.space.store.created == created  # no new physical page
    assert check_pattern(big, 77) and all(check_pattern(t, s) for s, t in survivors.items())
    pool.check_invariants()
    # release=True still unmaps every empty page at the end (handles cached, not freed).
    del big
    report = pool.compact(release=True)
    assert report.unmapped_pages == 12 and pool.stats()["pages.mapped"] == 4
    assert pool.trim() == 12 * PAGE
    assert all(check_pattern(t, s) for s, t in survivors.items())
    pool.check_invariants()


def test_compaction_packs_blocks_of_a_page_or_more_end_to_end(make_pool):
    """Four 1.5-page tensors on page boundaries strand half a page each (their small neighbours died).
    With six empty mapped pages to use, the compaction's conveyor packs them back to back: pages
    holding live data drop, mapped pages do not grow, and every byte, view and tensor id survives."""
    pool = make_pool("2MiB", auto_compact=False)  # 32 pages of 64 KiB
    xs, smalls = [], []
    for i in range(4):
        xs.append(pool.empty(PAGE + PAGE // 2, dtype=torch.uint8))
        smalls.append(pool.empty(PAGE // 2, dtype=torch.uint8))  # fills the tail, so the next starts a page
    spare = pool.empty(6 * PAGE, dtype=torch.uint8)
    for i, x in enumerate(xs):
        fill_pattern(x, i + 1)
    assert all(x.data_ptr() % PAGE == 0 for x in xs)
    views = [x[1000:2000] for x in xs]
    ids = [id(x) for x in xs]
    del smalls, spare
    st_ = pool.stats()
    mapped = st_["pages.mapped"]
    assert st_["pages.empty"] == 6 and st_["stranded_bytes"] == 4 * PAGE // 2
    before = _driver_calls(pool, "cuMemCreate")
    report = pool.compact()
    assert report.moved_tensors >= 2 and report.pages_after < report.pages_before == 8
    assert pool.stats()["pages.mapped"] == mapped and _driver_calls(pool, "cuMemCreate") == before
    for i, (x, v) in enumerate(zip(xs, views)):
        assert id(x) == ids[i] and check_pattern(x, i + 1)
        assert v.data_ptr() == x.data_ptr() + 1000
    pool.check_invariants()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1 << 24), st.integers(1, 1 << 23)), max_size=40),
       st.sampled_from([4096, 65536, 2 << 20]))
def test_the_pages_under_a_wave_are_every_page_its_ranges_touch(ranges, page):
    offsets = np.array([o for o, _ in ranges], dtype=np.int64)
    sizes = np.array([n for _, n in ranges], dtype=np.int64)
    expect = sorted({p for o, n in ranges for p in range(o // page, (o + n - 1) // page + 1)})
    assert compactor._pages_under(offsets, sizes, page).tolist() == expect


def test_a_compaction_leaves_the_collector_as_it_found_it(make_pool):
    pool = make_pool("8MiB")
    keep = [pool.empty(40 * KiB, dtype=torch.uint8) for _ in range(20)][::2]
    assert gc.isenabled()
    pool.compact()
    assert gc.isenabled()
    gc.disable()
    try:
        pool.compact()
        assert not gc.isenabled()
    finally:
        gc.enable()
    del keep


def test_rebased_owners_release_their_new_blocks_and_nothing_else(make_pool):
    """A wave committed by rebasing (no temporaries): nothing is queued for the old ranges, and each
    moved tensor's death frees exactly its new block."""
    from defrag.pool_context import _TorchMover

    pool = make_pool("1MiB", auto_compact=False)
    survivors = fragment(pool)
    calls = []
    real_rebase = _TorchMover.rebase_all
    _TorchMover.rebase_all = lambda self, *a: calls.append(real_rebase(self, *a)) or calls[-1]
    try:
        report = pool.compact()
    finally:
        _TorchMover.rebase_all = real_rebase
    assert report.moved_tensors > 0 and calls and all(c == -1 for c in calls)
    assert not pool.core.has_backlog()
    pool.check_invariants()
    assert all(check_pattern(t, s) for s, t in survivors.items())
    live = pool.stats()["live_blocks"]
    for seed in list(survivors)[: len(survivors) // 2]:
        del survivors[seed]
        gc.collect()
        live -= 1
        assert pool.stats()["live_blocks"] == live
    pool.check_invariants()
    survivors.clear()
    assert pool.stats()["allocated_bytes.all.current"] == 0
