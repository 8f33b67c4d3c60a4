"""The pool, compaction and the automatic trigger on a real GPU (CUDA tensors over VMM pages)."""

from __future__ import annotations

import copy
import gc

import pytest
import torch

import defrag

MiB = 1 << 20


def _cuda_ok() -> str | None:
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False"
    if defrag.driver.cuda_driver_usable()[0] is False:
        return "no usable CUDA driver"
    return None


pytestmark = pytest.mark.skipif(_cuda_ok() is not None, reason=f"needs a CUDA GPU: {_cuda_ok()}")


@pytest.fixture
def pool():
    p = defrag.Pool(device="cuda:0", capacity="256MiB", auto_compact=False)
    yield p
    p.close()
    gc.collect()


def _fragment(pool, n=256, nbytes=512 * 1024):
    ts = [pool.empty(nbytes, dtype=torch.uint8) for _ in range(n)]
    ts.sort(key=lambda t: t.data_ptr())
    for i, t in enumerate(ts):
        t.fill_(i % 251)
    return {i: t for i, t in enumerate(ts) if i % 4 == 0}


def test_tensors_are_cuda_tensors_over_pool_pages(pool):
    t = pool.full((1024, 1024), 3.0)
    assert t.is_cuda and t.device == pool.device and pool.owns(t)
    assert float(t.sum()) == 3.0 * 1024 * 1024
    u = t @ t[:, :8]  # a real kernel reads pool memory
    assert torch.allclose(u, torch.full((1024, 8), 9.0 * 1024, device="cuda"))


@pytest.mark.parametrize("engine", ["kernel", "driver"])
def test_compaction_moves_bytes_and_views_on_the_gpu(pool, engine):
    survivors = _fragment(pool)
    views = {i: t[100:200] for i, t in survivors.items()}
    before = pool.stats()
    with pytest.raises(defrag.OutOfMemoryError):
        pool.empty(pool.capacity // 2, dtype=torch.uint8)
    report = pool.compact(engine=engine, verify=True)
    assert report.moved_tensors > 0 and report.pages_after < before["pages.mapped"]
    big = pool.empty(pool.capacity // 2, dtype=torch.uint8)
    big.fill_(7)
    torch.cuda.synchronize()
    for i, t in survivors.items():
        assert bool((t == i % 251).all()) and bool((views[i] == i % 251).all())
        assert views[i].data_ptr() == t.data_ptr() + 100
    pool.check_invariants()


def test_automatic_rescue_on_the_gpu():
    with defrag.Pool(device="cuda:0", capacity="128MiB") as pool:
        survivors = _fragment(pool, n=128)
        big = pool.empty(pool.capacity // 2, dtype=torch.uint8)
        assert pool.stats()["num_compactions.automatic"] == 1
        assert all(bool((t == i % 251).all()) for i, t in survivors.items())
        del big, survivors


def test_training_on_gpu_compacted_between_steps_is_bit_identical(pool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 10)).cuda()
    twin = copy.deepcopy(model)
    opt, topt = torch.optim.Adam(model.parameters()), torch.optim.Adam(twin.parameters())
    data = [(torch.randn(64, 256, device="cuda"), torch.randint(0, 10, (64,), device="cuda")) for _ in range(4)]

    def step(m, o, x, y):
        o.zero_grad()
        loss = torch.nn.functional.cross_entropy(m(x), y)
        loss.backward()
        o.step()
        return loss.detach()

    step(model, opt, *data[0])
    step(twin, topt, *data[0])
    pool.adopt(model)
    pool.adopt(opt)
    for x, y in data[1:]:
        scratch = [pool.empty(300_000, dtype=torch.uint8) for _ in range(40)]
        del scratch[::2]
        assert torch.equal(step(model, opt, x, y), step(twin, topt, x, y))
        del scratch
        pool.compact()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def test_stream_ordered_reuse(pool):
    side = torch.cuda.Stream()
    t = pool.full((4 * MiB,), 1, dtype=torch.uint8)
    with torch.cuda.stream(side):
        torch.cuda._sleep(10_000_000)  # keep the side stream busy
        t.add_(1)
    pool.record_stream(t, side)
    del t
    stats = pool.stats()
    assert stats["active_bytes.all.current"] >= 4 * MiB  # waiting on the side stream's event
    torch.cuda.synchronize()
    assert pool.stats()["active_bytes.all.current"] == pool.stats()["allocated_bytes.all.current"]
