"""torch < 2.12 has no UntypedStorage._swap_data_ptr_ (the GPU machines' torch 2.11 among them).

There a small C++ extension swaps storages instead (`defrag.storage_ext`,
swap_mode() "extension"), so every view follows as on newer torch. Without it
(no compiler, or DEFRAG_NO_STORAGE_EXT=1: swap_mode() "rebind") the pool moves
a storage only when it can prove it knows every tensor over it (the
StorageImpl's use count), and rebinds those with `set_`; anything else is
treated as pinned. These tests force both paths on a newer torch.
"""

from __future__ import annotations


import pytest
import torch

from defrag import storage_ext
from defrag import tensors as tz

from .conftest import KiB, check_pattern, fill_pattern

PAGE = 64 * KiB

@pytest.fixture
def no_swap(monkeypatch):
    """The "rebind" path: no native swap and no extension."""
    monkeypatch.setenv("DEFRAG_FORCE_NO_SWAP_DATA_PTR", "1")
    monkeypatch.setenv("DEFRAG_NO_STORAGE_EXT", "1")
    assert tz.swap_mode() == "rebind"
    yield
    monkeypatch.undo()


def _torch_without_native_swap(monkeypatch) -> list:
    """Torch as if it lacked `_swap_data_ptr_`, the storage-swap extension in its place; returns the
    list that counts the extension's swaps."""
    if (missing := storage_ext._missing_tools()) is not None:
        pytest.skip(f"cannot build the storage-swap extension here: {missing}")
    monkeypatch.setenv("DEFRAG_FORCE_NO_SWAP_DATA_PTR", "1")
    monkeypatch.delenv("DEFRAG_NO_STORAGE_EXT", raising=False)
    assert tz.swap_mode() == "extension", storage_ext.failure()
    calls = []
    real = storage_ext.swap
    monkeypatch.setattr(storage_ext, "swap", lambda a, b: (calls.append(1), real(a, b)))
    return calls


@pytest.fixture
def old_torch_with_extension(monkeypatch):
    """The "extension" path: no native swap; counts the extension's swaps. The fast path is off: the
    owners of memory it makes are rebased in C++ without any swap (`test_old_torch_rebases_...`)."""
    monkeypatch.setenv("DEFRAG_FASTPATH", "0")
    return _torch_without_native_swap(monkeypatch)


def _quarter_filled(pool) -> dict:
    """64 quarter-page tensors, each with its own pattern; every fourth survives (seed -> tensor)."""
    ts = [pool.empty(PAGE // 4, dtype=torch.uint8) for _ in range(64)]
    ts.sort(key=lambda t: t.data_ptr())
    for i, t in enumerate(ts):
        fill_pattern(t, i + 1)
    return {i + 1: t for i, t in enumerate(ts) if i % 4 == 0}


def _intact_and_usable(pool, survivors, versions) -> None:
    """Every survivor kept its bytes and autograd version, and the freed half of the pool serves one request."""
    for s, t in survivors.items():
        assert check_pattern(t, s) and t._version == versions[s]
    big = pool.empty(pool.capacity // 2 - PAGE, dtype=torch.uint8)
    fill_pattern(big, 0)
    assert all(check_pattern(t, s) for s, t in survivors.items())
    pool.check_invariants()


def test_tensors_without_views_move_and_tensors_with_views_stay(make_pool, no_swap):
    pool = make_pool("1MiB", auto_compact=False)
    survivors = _quarter_filled(pool)
    viewed = survivors[61]  # on the last page, which an evacuation would empty
    view = viewed[10:20]
    viewed_at = viewed.data_ptr()
    reasons = {lt.address: lt.reason for lt in pool.live_tensors()}
    assert "views or other references" in reasons[viewed_at]
    versions = {s: t._version for s, t in survivors.items()}
    report = pool.compact()
    assert report.moved_tensors == 12 and report.pages_after == 4  # the viewed one stays, its page is kept
    assert viewed.data_ptr() == viewed_at and view.data_ptr() == viewed_at + 10
    _intact_and_usable(pool, survivors, versions)


def test_autograd_keeps_working_across_a_rebind(make_pool, no_swap):
    pool = make_pool("1MiB", auto_compact=False)
    filler = pool.empty(PAGE - 1024, dtype=torch.uint8)
    w = pool.full((256,), 0.5, requires_grad=True)  # the last KiB of page 0
    keep = pool.full((1024,), 1.0)  # page 1: denser than w's page once the filler goes
    before = w.data_ptr()
    loss = (w * w).sum()  # saves w for backward
    del filler
    report = pool.compact()
    assert report.moved_tensors == 1 and w.data_ptr() != before
    loss.backward()  # the version counter was restored: no "modified by an inplace operation"
    assert torch.equal(w.grad, torch.full((256,), 1.0)) and torch.equal(keep, torch.ones(1024))


def test_adopt_fallback_needs_a_sole_tensor(make_pool, no_swap):
    pool = make_pool("1MiB")
    lone = torch.arange(100.0)
    pool.adopt(lone)
    assert pool.owns(lone) and torch.equal(lone, torch.arange(100.0))
    shared = torch.arange(50.0)
    view = shared[5:]
    with pytest.raises(ValueError, match="views share"):
        pool.adopt(shared)
    assert not pool.owns(shared) and view.data_ptr() == shared.data_ptr() + 20
    model = torch.nn.Linear(8, 4)
    weight = model.weight
    pool.adopt(model)
    assert model.weight is weight and pool.owns(model.weight) and pool.owns(model.bias)


def test_old_torch_moves_a_storage_that_has_views(make_pool, old_torch_with_extension):
    pool = make_pool("1MiB", auto_compact=False)
    survivors = _quarter_filled(pool)
    viewed = survivors[61]  # on the last page, which an evacuation must empty
    view = viewed[10:20]
    also = viewed.view(-1, 16).t()
    viewed_at = viewed.data_ptr()
    assert all(lt.movable for lt in pool.live_tensors())
    versions = {s: t._version for s, t in survivors.items()}
    report = pool.compact()
    assert report.moved_tensors >= 12 and report.pages_after == 4 and old_torch_with_extension
    assert viewed.data_ptr() != viewed_at
    assert view.data_ptr() == viewed.data_ptr() + 10 and also.data_ptr() == viewed.data_ptr()
    assert torch.equal(view, viewed[10:20].clone()) and torch.equal(also, viewed.view(-1, 16).t().clone())
    _intact_and_usable(pool, survivors, versions)


def test_old_torch_moves_autograd_saved_tensors_and_their_views(make_pool, old_torch_with_extension):
    pool = make_pool("1MiB", auto_compact=False)
    filler = pool.empty(PAGE - 1024, dtype=torch.uint8)
    w = pool.full((256,), 0.5, requires_grad=True)  # the last KiB of page 0
    keep = pool.full((1024,), 1.0)  # page 1: denser than w's page once the filler goes
    before = w.data_ptr()
    head = w[:16]  # a differentiable view: the rebind fallback could not move w
    loss = (w * w).sum() + (head * 4).sum()  # saves w and head for backward
    del filler
    report = pool.compact()
    assert report.moved_tensors == 1 and w.data_ptr() != before and head.data_ptr() == w.data_ptr()
    loss.backward()
    grad = torch.full((256,), 1.0)
    grad[:16] += 4
    assert torch.equal(w.grad, grad) and torch.equal(keep, torch.ones(1024))


def test_old_torch_adopts_a_tensor_with_views(make_pool, old_torch_with_extension):
    pool = make_pool("1MiB")
    shared = torch.arange(50.0)
    view = shared[5:]
    pool.adopt(shared)
    assert pool.owns(shared) and view.data_ptr() == shared.data_ptr() + 20
    assert torch.equal(view, torch.arange(5.0, 50.0)) and old_torch_with_extension


def test_old_torch_rebases_the_fast_paths_storages_without_a_swap(make_pool, monkeypatch):
    """Without `_swap_data_ptr_` (torch < 2.12), the owners of memory the fast path made still move,
    views and all, without the extension's swap: their DataPtr is replaced in C++ (`FastPath.rebase`)."""
    swaps = _torch_without_native_swap(monkeypatch)
    pool = make_pool("1MiB", auto_compact=False)
    if pool.core.fast is None:
        pytest.skip("the fast path is off here")
    survivors = _quarter_filled(pool)
    viewed = survivors[61]
    view = viewed[10:20]
    viewed_at = viewed.data_ptr()
    versions = {s: t._version for s, t in survivors.items()}
    report = pool.compact()
    assert report.moved_tensors >= 12 and viewed.data_ptr() != viewed_at and swaps == []
    assert view.data_ptr() == viewed.data_ptr() + 10
    _intact_and_usable(pool, survivors, versions)
