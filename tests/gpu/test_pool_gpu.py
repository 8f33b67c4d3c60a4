"""The pool, compaction and the automatic trigger on a real GPU (CUDA tensors over VMM pages).

In a rehearsal (tests/gpu/conftest.py) the same tests run on the emulated
device with 2 MiB pages and the same capacities: every size here is derived
from ``pool.page_size`` and ``pool.capacity``, so what holds there holds on
the GPU's geometry. Compaction tests run on two torch paths: ``as-is`` (what
this machine does: torch >= 2.12's ``_swap_data_ptr_``, or on older torch
such as the GPU machines' 2.11 the storage-swap extension where it builds),
and ``rebind`` (forced: no swap at all, the pool moves only storages whose
every tensor it knows; a storage with a view it did not make stays in place).
Which blocks may move is what the pool says (`Pool.live_tensors()`), so the
tests hold on every path.
"""

from __future__ import annotations

import copy
import math
import time

import pytest
import torch

import defrag
from defrag.units import ALIGNMENT

from .conftest import MODE, REHEARSAL, sync

MiB = 1 << 20


@pytest.fixture(params=["as-is", "rebind"])
def torch_path(request, monkeypatch):
    if request.param == "rebind":  # as on torch < 2.12 without the storage-swap extension
        monkeypatch.setenv("DEFRAG_FORCE_NO_SWAP_DATA_PTR", "1")
        monkeypatch.setenv("DEFRAG_NO_STORAGE_EXT", "1")
    return request.param


def _engine_skip(engine: str) -> None:
    if engine == "kernel" and MODE != "cuda":
        import defrag.kernels as dk

        if not dk.is_simulator():
            pytest.skip("the kernel engine over emulated (host) memory needs numba's simulator")


def _verify(engine: str) -> bool:
    """Checksum every move (verify=True), except with the kernel engine in a rehearsal: numba's simulator
    needs ~10 s for the checksums there; the tests compare every byte themselves anyway."""
    return MODE == "cuda" or engine != "kernel"


def pattern(n: int, seed: int, device) -> torch.Tensor:
    """n bytes that depend on the seed and on each byte's position."""
    return ((torch.arange(n, dtype=torch.int64, device=device) * 131 + seed * 7919) % 251).to(torch.uint8)


def _fragment(pool) -> dict[int, torch.Tensor]:
    """Map every page of `pool` with one small survivor (512 B to 24 KiB) and a filler; free the fillers.

    Afterwards every page holds exactly one live block, so no physical page is
    free and any request of a page or more fails until something moves (the
    capacity, not a fixed count, sets how many pages that is). Returns
    {seed: survivor}, the survivors filled with `pattern(seed)`.
    """
    page = pool.page_size
    survivors, fillers = [], []
    for i in range(pool.capacity_pages):
        size = 512 * (1 + (i * 37) % 48)
        survivors.append(pool.empty(size, dtype=torch.uint8))
        fillers.append(pool.empty(page - size, dtype=torch.uint8))
    stats = pool.stats()
    assert stats["pages.mapped"] == pool.capacity_pages
    assert stats["allocated_bytes.all.current"] == pool.capacity, "the pool is not full: _fragment's layout is off"
    del fillers
    out = {}
    for seed, t in enumerate(sorted(survivors, key=lambda t: t.data_ptr()), start=1):
        t.copy_(pattern(t.numel(), seed, t.device))
        out[seed] = t
    return out


def _intact(survivors: dict) -> bool:
    sync()
    return all(torch.equal(t, pattern(t.numel(), s, t.device)) for s, t in survivors.items())


def test_tensors_are_device_tensors_over_pool_pages(make_pool):
    pool = make_pool("256MiB")
    t = pool.full((1024, 1024), 3.0)
    assert t.device == pool.device and pool.owns(t)
    assert t.is_cuda == (MODE == "cuda")
    page = pool.page_size
    assert pool.page_size == 2 * MiB or MODE == "cuda"
    assert float(t.sum()) == 3.0 * 1024 * 1024
    u = t @ t[:, :8]  # a real kernel (cuBLAS on the GPU) reads pool memory
    assert torch.equal(u, torch.full((1024, 8), 9.0 * 1024, device=pool.device))
    big = pool.empty(3 * page // 4, dtype=torch.uint8)  # sub-page blocks share mapped pages
    big.fill_(5)
    assert pool.stats()["pages.mapped"] * page <= pool.capacity
    assert int(big.sum()) == 5 * big.numel()
    pool.check_invariants()


@pytest.mark.parametrize("engine", ["kernel", "driver"])
def test_compaction_moves_bytes_and_views(make_pool, engine, torch_path):
    _engine_skip(engine)
    pool = make_pool("256MiB", auto_compact=False)
    survivors = _fragment(pool)
    viewed = dict(list(survivors.items())[::8])  # one survivor in eight has a view the pool did not make
    views = {s: t[8:40] for s, t in viewed.items()}
    at = {s: t.data_ptr() for s, t in survivors.items()}
    movable = {lt.address: lt.movable for lt in pool.live_tensors()}
    before = pool.stats()
    with pytest.raises(defrag.OutOfMemoryError):
        pool.empty(pool.capacity // 2, dtype=torch.uint8)
    report = pool.compact(engine=engine, verify=_verify(engine))
    assert report.moved_tensors > 0 and report.pages_after < before["pages.mapped"]
    moved = {s for s, t in survivors.items() if t.data_ptr() != at[s]}
    assert not {s for s in moved if not movable[at[s]]}, "a block the pool called immovable moved"
    if torch_path == "rebind":
        assert not any(movable[at[s]] for s in viewed), "without a storage swap a viewed storage cannot move"
    if any(movable[at[s]] for s in viewed):
        assert moved & set(viewed), "no viewed tensor moved, though the pool could move them"
    big = pool.empty(pool.capacity // 2, dtype=torch.uint8)
    big.fill_(7)
    sync()
    assert _intact(survivors)
    for s, v in views.items():
        assert v.data_ptr() == survivors[s].data_ptr() + 8
        assert torch.equal(v, pattern(40, s, v.device)[8:40])
    assert int(big.sum()) == 7 * big.numel()
    pool.check_invariants()


@pytest.mark.parametrize("engine", ["kernel", "driver"])
def test_compaction_keeps_autograd_working(make_pool, engine, torch_path):
    """Leaves, their .grad and tensors saved for backward move; backward and an optimizer step still agree."""
    _engine_skip(engine)
    pool = make_pool("64MiB", auto_compact=False)
    page = pool.page_size
    n = pool.capacity_pages
    ws, xs, fillers = [], [], []
    for i in range(n):  # every page: a weight (every third with a .grad), an input, a filler freed below
        w = pool.full((256 + 64 * (i % 5),), 0.5 + 0.01 * i, requires_grad=True)
        if i % 3 == 0:
            w.grad = pool.zeros(w.shape)
        ws.append(w)
        xs.append(pool.full((256 + 64 * (i % 5),), 1.0 - 0.003 * i))
        used = sum(-(-t.untyped_storage().nbytes() // ALIGNMENT) * ALIGNMENT
                   for t in (w, xs[-1], w.grad) if t is not None)
        fillers.append(pool.empty(page - used, dtype=torch.uint8))
    assert pool.stats()["pages.mapped"] == n and pool.stats()["allocated_bytes.all.current"] == pool.capacity
    ref_w = [w.detach().clone().requires_grad_(True) for w in ws]
    for w, r in zip(ws, ref_w):
        if w.grad is not None:
            r.grad = w.grad.clone()
    ref_x = [x.detach().clone() for x in xs]

    def loss_of(w_list, x_list):
        return sum(((w * x).sin() * w).sum() for w, x in zip(w_list, x_list))

    loss = loss_of(ws, xs)  # saves w and x (pool tensors) for backward
    ref = loss_of(ref_w, ref_x)
    del fillers
    at = [w.data_ptr() for w in ws]
    report = pool.compact(engine=engine, verify=_verify(engine))
    assert report.moved_tensors > 0
    assert any(w.data_ptr() != a for w, a in zip(ws, at)), "no weight moved"
    loss.backward()  # reads the saved tensors at their new addresses
    ref.backward()
    opt, ref_opt = torch.optim.SGD(ws, lr=0.1), torch.optim.SGD(ref_w, lr=0.1)
    opt.step()
    ref_opt.step()
    sync()
    assert torch.equal(loss.detach(), ref.detach())
    for w, r in zip(ws, ref_w):
        assert torch.equal(w.grad, r.grad) and torch.equal(w.detach(), r.detach())
    pool.check_invariants()


def test_stitching_1gib_from_512_scattered_pages(make_pool, figures):
    """Every other page of a full 2 GiB pool freed: 512 free physical pages, no two adjacent. A 1 GiB request
    succeeds at once, without compaction, by mapping them into one fresh virtual run."""
    pool = make_pool("2GiB", auto_compact=False)
    page, n = pool.page_size, pool.capacity_pages
    words = page // 8
    pages = sorted((pool.empty(page, dtype=torch.uint8) for _ in range(n)), key=lambda t: t.data_ptr())
    assert pool.stats()["pages.mapped"] == n
    keep = pages[1::2]
    for i, t in enumerate(keep):  # a marker at both ends of each kept page
        t.view(torch.int64)[:64].fill_(i)
        t.view(torch.int64)[-64:].fill_(~i)
    del pages
    sync()
    pool.stats()  # applies the queued frees (untimed)
    t0 = time.perf_counter()
    big = pool.empty((n // 2) * page, dtype=torch.uint8)
    sync()
    seconds = time.perf_counter() - t0
    stats = pool.stats()
    assert stats["num_compactions.automatic"] == 0 and stats["pages.mapped"] <= n
    assert big.data_ptr() % page == 0
    flat = big.view(torch.int64)
    torch.arange(flat.numel(), out=flat)  # every byte of the 1 GiB written through the stitched range
    per_page = flat.view(n // 2, words)
    first = torch.arange(n // 2, device=pool.device) * words
    sync()
    assert torch.equal(per_page[:, 0], first) and torch.equal(per_page[:, -1], first + words - 1), (
        "two virtual pages of the stitched range share a physical page")
    for i, t in enumerate(keep):
        assert int(t.view(torch.int64)[:64].min()) == i == int(t.view(torch.int64)[:64].max())
        assert int(t.view(torch.int64)[-64:].max()) == ~i
    pool.check_invariants()
    figures.add(f"stitched request of {n // 2} scattered pages ({(n // 2) * page >> 20} MiB)", seconds * 1e3, "ms",
                us_per_page=seconds / (n // 2) * 1e6)


def test_automatic_rescue(make_pool):
    pool = make_pool("128MiB")
    survivors = _fragment(pool)
    big = pool.empty(pool.capacity // 2, dtype=torch.uint8)
    assert pool.stats()["num_compactions.automatic"] == 1
    big.fill_(3)
    assert _intact(survivors)
    del big, survivors


class _Block(torch.nn.Module):
    """A pre-norm transformer block: RMSNorm, causal self-attention written out, GELU MLP.

    Plain matmuls and elementwise ops only, so that two runs on one device
    are bit-identical by construction (no fused attention, no atomics).
    """

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.g1, self.g2 = torch.nn.Parameter(torch.ones(d)), torch.nn.Parameter(torch.ones(d))
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.up, self.down = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    @staticmethod
    def _norm(x, g):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * g

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self._norm(x, self.g1)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.down(torch.nn.functional.gelu(self.up(self._norm(x, self.g2))))


def _model(d=128, heads=4, layers=2, vocab=96):
    return torch.nn.Sequential(torch.nn.Linear(32, d), *[_Block(d, heads) for _ in range(layers)],
                               torch.nn.Linear(d, vocab))


def test_training_compacted_between_steps_is_bit_identical(make_pool, torch_path):
    """A small transformer trained with Adam, its weights and state in the pool, compacted between
    steps, matches a twin outside the pool bit for bit, loss by loss and weight by weight."""
    pool = make_pool("256MiB", auto_compact=False)
    dev = pool.device
    torch.manual_seed(0)
    model = _model().to(dev)
    twin = copy.deepcopy(model)
    opt, topt = torch.optim.Adam(model.parameters(), lr=1e-3), torch.optim.Adam(twin.parameters(), lr=1e-3)
    gen = torch.Generator(device="cpu").manual_seed(1)
    data = [(torch.randn(8, 32, 32, generator=gen).to(dev), torch.randint(0, 96, (8, 32), generator=gen).to(dev))
            for _ in range(5)]

    def step(m, o, x, y):
        o.zero_grad()
        loss = torch.nn.functional.cross_entropy(m(x).flatten(0, 1), y.flatten())
        loss.backward()
        o.step()
        return loss.detach()

    assert torch.equal(step(model, opt, *data[0]), step(twin, topt, *data[0]))  # Adam state exists now
    spacer = pool.empty(pool.page_size // 2, dtype=torch.uint8)  # holes in front of the weights
    pool.adopt(model)
    spacer2 = pool.empty(pool.page_size // 3, dtype=torch.uint8)
    pool.adopt(opt)
    params = list(model.parameters())
    assert all(pool.owns(p) for p in params)
    del spacer, spacer2
    at = [p.data_ptr() for p in params]
    moved = 0
    for x, y in data[1:]:
        scratch = [pool.empty(300_000, dtype=torch.uint8) for _ in range(40)]
        del scratch[::2]
        assert torch.equal(step(model, opt, x, y), step(twin, topt, x, y))
        del scratch
        moved += pool.compact(verify=True).moved_tensors
    assert moved > 0 and any(p.data_ptr() != a for p, a in zip(params, at)), "the compactions moved no weight"
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    pool.check_invariants()


@pytest.mark.needs_cuda("CUDA streams and events (record_stream)")
def test_stream_ordered_reuse(make_pool):
    pool = make_pool("256MiB", auto_compact=False)
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


@pytest.mark.needs_cuda("the allocation fast path on CUDA tensors and streams")
def test_fast_path_on_cuda(make_pool):
    """pool.empty of a kept size from the C++ fast path: a CUDA tensor at the kept address; a side
    stream takes the Python path; fast-path tensors move in a compaction with their bytes."""
    from defrag import fastpath

    if fastpath.wait() is None:
        pytest.skip(f"the fast path is unavailable here: {fastpath.status()}")
    pool = make_pool("256MiB", auto_compact=False)
    assert pool.core.fast is not None and pool.core.fast.enabled
    t = pool.full((MiB,), 3, dtype=torch.uint8)
    ptr = t.data_ptr()
    del t
    hits = pool.core.fast.hits
    t = pool.empty(MiB, dtype=torch.uint8)
    assert pool.core.fast.hits == hits + 1 and t.data_ptr() == ptr and t.device == pool.device
    t.fill_(5)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        u = pool.empty(MiB, dtype=torch.uint8)  # another stream: declined, made by the Python path
    assert pool.core.fast.hits == hits + 1
    del u
    ts = [pool.empty(64 * 1024, dtype=torch.uint8) for _ in range(64)]
    del ts[::2]
    ts += [pool.empty(64 * 1024, dtype=torch.uint8) for _ in range(16)]
    for i, x in enumerate(ts):
        x.copy_(pattern(x.numel(), i, x.device))
    report = pool.compact()
    sync()
    assert report.moved_tensors > 0
    assert all(torch.equal(x, pattern(x.numel(), i, x.device)) for i, x in enumerate(ts))
    assert bool((t == 5).all())
    pool.check_invariants()


def test_rehearsal_geometry(make_pool):
    """The rehearsal really has the GPU's geometry (and the GPU the one the rehearsal assumes)."""
    pool = make_pool("256MiB")
    assert pool.page_size == 2 * MiB and pool.capacity_pages == 128, (
        f"page {pool.page_size}: tests/gpu assume 2 MiB pages (H100/H200); another GPU needs its own rehearsal")
    assert (pool.kind == "emulated") == REHEARSAL
