"""Moving a storage with all its views on torch without `_swap_data_ptr_` (torch < 2.12).

`defrag.tensors.swap_data` exchanges two storages' memory; on old torch it
does so through a small C++ extension (`defrag.storage_ext`). These tests hide
the native method (DEFRAG_FORCE_NO_SWAP_DATA_PTR=1) and check, on storages
over owned host memory like the pool's: every view and autograd-saved tensor
follows, version counters stay, each memory's owner (its deleter) travels
with it, and a missing compiler degrades to "rebind" with one warning.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import sys
import threading

import pytest
import torch

from defrag import storage_ext
from defrag import tensors as tz

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def built():
    """Build (or load the cached) extension once for this module; skip if this machine has no compiler."""
    missing = storage_ext._missing_tools()
    if missing:
        pytest.skip(f"cannot build the storage-swap extension here: {missing}")
    module = storage_ext.load()
    assert module is not None, f"the extension failed to build: {storage_ext.failure()}"
    print(f"\nstorage-swap extension ready in {storage_ext.build_seconds():.2f} s (build or cache check + import)")
    return module


@pytest.fixture
def old_torch(monkeypatch, built):
    """torch as if < 2.12: no native swap, the extension available."""
    monkeypatch.setenv("DEFRAG_FORCE_NO_SWAP_DATA_PTR", "1")
    monkeypatch.delenv("DEFRAG_NO_STORAGE_EXT", raising=False)
    assert tz.swap_mode() == "extension" and tz.can_swap_storages()
    calls = []
    real = storage_ext.swap
    monkeypatch.setattr(storage_ext, "swap", lambda a, b: (calls.append(1), real(a, b)))
    yield calls
    tz._forget_swap_mode()


class Block:
    """Host memory with an owner that records its release, like a pool block."""

    def __init__(self, nbytes: int, fill: int):
        self.buf = (ctypes.c_uint8 * nbytes)()
        ctypes.memset(self.buf, fill, nbytes)
        self.address = ctypes.addressof(self.buf)
        self.nbytes = nbytes
        self.released = 0

    def storage(self) -> torch.UntypedStorage:
        def release(_key):
            self.released += 1
        storage, hook = tz.storage_over("emulated", CPU, self.address, self.nbytes, release)
        self.hooks = getattr(self, "hooks", []) + [hook]  # kept alive, as the pool keeps it on the block
        return storage

    def scribble(self, value: int) -> None:
        ctypes.memset(self.buf, value, self.nbytes)


def _move(user: torch.UntypedStorage, dest: torch.UntypedStorage) -> None:
    """What the compactor does: copy, then swap."""
    dest.copy_(user)
    tz.swap_data(user, dest)


def test_a_storage_with_views_and_saved_tensors_moves_on_old_torch(old_torch):
    old, new = Block(64 * 4, 0), Block(64 * 4, 0x55)
    x = tz.tensor_over(old.storage(), torch.float32, (64,), CPU)
    with torch.no_grad():
        x.copy_(torch.arange(64.0))
    x.requires_grad_(True)
    expected = torch.arange(64.0)
    loss = (x * x).sum()                       # saves x for backward
    square = x.view(8, 8)                      # differentiable views
    diff_view = square[2]
    loss2 = (diff_view * 3).sum()
    plain = x.detach()[5:21]                   # non-differentiable views
    strided = x.detach().view(8, 8).t()[1]
    views = [square, diff_view, plain, strided]
    offsets = [v.data_ptr() - old.address for v in views]
    versions = [t._version for t in [x, *views]]

    dest = new.storage()
    _move(x.untyped_storage(), dest)
    assert old_torch, "the extension did the swap"

    assert x.data_ptr() == new.address
    assert [v.data_ptr() - new.address for v in views] == offsets
    assert [t._version for t in [x, *views]] == versions
    assert torch.equal(x.detach(), expected)
    # The temporary holds the old memory and its owner; it is released when the temporary dies.
    assert dest.data_ptr() == old.address and old.released == 0
    del dest
    assert old.released == 1 and new.released == 0
    old.scribble(0xFF)                         # nothing may still read the old memory
    assert torch.equal(x.detach(), expected) and torch.equal(plain, expected[5:21])
    assert torch.equal(strided, expected.view(8, 8).t()[1])

    cell = ctypes.c_float.from_address(new.address + 9 * 4)
    cell.value = -1.0                          # every view reads the new memory
    assert [t.item() for t in (x[9], square[1, 1], plain[4], strided[1])] == [-1.0] * 4
    cell.value = 9.0

    loss.backward()                            # x was saved: no "modified by an inplace operation"
    loss2.backward()
    grad = 2 * expected
    grad[16:24] += 3
    assert torch.equal(x.grad, grad)

    del x, loss, loss2, square, diff_view, plain, strided, views
    assert new.released == 1, "the new memory's owner travelled with it and is released with the last user"


def test_the_exchange_goes_both_ways_and_matches_the_native_method(old_torch, monkeypatch):
    def run():
        a, b = Block(256, 1), Block(256, 2)
        user = torch.arange(32, dtype=torch.int64)          # ordinary CPU-allocator memory
        view = user[4:]
        pool_storage = b.storage()
        pool_storage.copy_(user.untyped_storage())
        before = user.untyped_storage().data_ptr()
        flags = (user.untyped_storage().resizable(), pool_storage.resizable())
        tz.swap_data(user.untyped_storage(), pool_storage)
        state = dict(
            user_on_block=user.data_ptr() == b.address,
            view_follows=view.data_ptr() == b.address + 32,
            temp_has_old=pool_storage.data_ptr() == before,
            values=torch.equal(user, torch.arange(32)),
            flags_swapped=(user.untyped_storage().resizable(), pool_storage.resizable()) == flags[::-1],
        )
        del pool_storage
        state["user_block_kept"] = b.released == 0
        del user, view
        state["user_block_released"] = b.released == 1
        return state, a

    extension, _ = run()
    assert old_torch
    assert all(extension.values()), extension
    if tz.NATIVE_SWAP_DATA_PTR:
        monkeypatch.delenv("DEFRAG_FORCE_NO_SWAP_DATA_PTR")
        assert tz.swap_mode() == "native"
        native, _ = run()
        assert native == extension


def test_mismatched_storages_are_refused_before_any_change(old_torch):
    a = torch.arange(8.0)
    b = torch.zeros(9)
    with pytest.raises(ValueError, match="32 and 36 bytes"):
        tz.swap_data(a.untyped_storage(), b.untyped_storage())
    meta = torch.empty(8, device="meta")
    with pytest.raises(ValueError, match="cpu and meta"):
        tz.swap_data(a.untyped_storage(), meta.untyped_storage())
    assert not old_torch and torch.equal(a, torch.arange(8.0))
    s = a.untyped_storage()
    tz.swap_data(s, s)                                      # a storage with itself: nothing happens
    assert torch.equal(a, torch.arange(8.0))


@pytest.fixture
def fresh_mode(monkeypatch):
    """Recompute the mode (and its log line) in this test; restore the extension afterwards."""
    monkeypatch.setenv("DEFRAG_FORCE_NO_SWAP_DATA_PTR", "1")
    tz._forget_swap_mode()
    yield
    monkeypatch.undo()
    storage_ext._reset_for_tests()
    tz._forget_swap_mode()


def test_forbidding_the_extension_means_rebind_with_one_warning(fresh_mode, monkeypatch, caplog):
    monkeypatch.setenv("DEFRAG_NO_STORAGE_EXT", "1")
    with caplog.at_level(logging.INFO, logger="defrag"):
        assert tz.swap_mode() == "rebind" and not tz.can_swap_storages()
        assert tz.swap_mode() == "rebind"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "falls back to rebinding" in warnings[0].getMessage()
    assert "DEFRAG_NO_STORAGE_EXT" in warnings[0].getMessage()
    with pytest.raises(RuntimeError, match="rebind"):
        tz.swap_data(torch.zeros(4).untyped_storage(), torch.zeros(4).untyped_storage())


def test_a_missing_compiler_means_rebind_with_a_warning_saying_how_to_fix_it(fresh_mode, monkeypatch, caplog):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    storage_ext._reset_for_tests()
    with caplog.at_level(logging.INFO, logger="defrag"):
        assert tz.swap_mode() == "rebind"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "no C++ compiler" in warnings[0] and "g++, ninja" in warnings[0] and "rebinding" in warnings[0]
    assert storage_ext.load() is None  # the failure is remembered: no second attempt


def test_concurrent_first_calls_load_once(built):
    storage_ext._reset_for_tests()
    got = []
    threads = [threading.Thread(target=lambda: got.append(storage_ext.load())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and all(m is got[0] for m in got) and got[0] is not None


def test_importing_defrag_builds_nothing(tmp_path):
    code = ("import defrag, defrag.tensors, defrag.storage_ext as e, os; "
            "assert e._EXTENSION._module is None and e.failure() is None; "
            "assert not os.listdir(os.environ['DEFRAG_EXT_DIR'])")
    env = dict(os.environ, DEFRAG_FORCE_NO_SWAP_DATA_PTR="1", DEFRAG_EXT_DIR=str(tmp_path))
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
