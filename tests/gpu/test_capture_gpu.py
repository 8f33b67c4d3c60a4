"""`pool.capture()` and `defrag.install()` on a real GPU: PyTorch's own CUDA allocations in pool pages.

Every test here needs CUDA itself (a `torch.cuda.MemPool` over defrag's
pluggable allocator), so the GPU rehearsal skips them; tests/cpu/test_capture.py
calls the same C entry points through ctypes on the emulated device.

- routing: tensors made inside the block lie in pool segments, those made
  outside do not, and `release_cached()` gives every cached segment back;
- an impossible request inside the block is PyTorch's own OutOfMemoryError
  (the MemPool path checks for NULL), counted, and changes nothing;
- a fragmentation scenario that fails with PyTorch's OOM on its own allocator
  (in a child process, under the same memory budget) and completes inside
  `pool.capture()`, where the segment request compacts the pool's tensors;
- a training loop under `pool.capture()`, activations and gradients in pool
  segments, compacted between steps, bit-identical to a plain run;
- the autograd-thread limit (documented) and `install()` in a child process.
"""

from __future__ import annotations

import copy
import subprocess

import pytest
import torch

import defrag
from defrag import allocator_install, capture as cap

from .conftest import fresh_process, last_json, sync

pytestmark = pytest.mark.needs_cuda("PyTorch's CUDA caching allocator routed through torch.cuda.MemPool")

MiB = 1 << 20


@pytest.fixture(autouse=True, scope="module")
def _warm_cublas():
    """PyTorch keeps some buffers for the life of the process (cuBLAS workspaces, made by a stream's
    first matmul): made inside a capture block, they would hold a pool segment forever. Make them first."""
    w = torch.randn(64, 64, device="cuda", requires_grad=True)
    (w @ w).sum().backward()
    with torch.autograd.set_multithreading_enabled(False):
        (w @ w).sum().backward()
    torch.cuda.synchronize()
    yield


def in_segments(pool, t: torch.Tensor) -> bool:
    ptr = t.untyped_storage().data_ptr()
    return any(a <= ptr < a + n for a, n in pool.segments())


def release_all(pool) -> None:
    """Give every cached segment back (what a user does between steps) and check none is left."""
    sync()
    cap.release_cached(pool)
    cap.release_cached(pool)  # a MemPool retired by the first call is destroyed by the second once idle
    assert pool.segments() == [], f"segments still held by PyTorch: {pool.segments()[:4]}"


def child(script: str, *args, timeout=300, env_extra=None) -> subprocess.CompletedProcess:
    """`script` in a fresh process (conftest's `fresh_process`), with `env_extra` set."""
    return fresh_process(script, *args, timeout=timeout, env=env_extra)


# ---------------------------------------------------------------- routing

def test_capture_routes_the_blocks_allocations_into_pool_segments(make_pool):
    pool = make_pool("256MiB")
    outside = torch.randn(256, 256, device="cuda")
    with pool.capture() as allocator:
        x = torch.randn(1024, 1024, device="cuda")  # 4 MiB: a 20 MiB segment
        y = x @ x
        small = torch.ones(10, device="cuda")  # a 2 MiB small segment
        assert allocator_install.installed() is None
    after = torch.randn(256, 256, device="cuda")
    sync()
    assert isinstance(allocator, defrag.TorchAllocator) and allocator.pool is pool
    assert in_segments(pool, x) and in_segments(pool, y) and in_segments(pool, small)
    assert not in_segments(pool, outside) and not in_segments(pool, after)
    assert torch.allclose(y, (x.cpu() @ x.cpu()).to("cuda"), rtol=1e-3, atol=1e-2)
    st = pool.stats()
    assert st["segments"] == len(pool.segments()) >= 2 and st["segment_bytes"] >= 22 * MiB
    assert allocator.counters()["allocs"] >= 2 and allocator.counters()["errors"] == 0
    kinds = {b["address"]: b.get("kind") for b in pool.layout()["blocks"]}
    assert all(kinds[a] == "segment" for a, _ in pool.segments())
    # Freed tensors stay cached inside PyTorch's segments until release_cached.
    del x, y, small
    sync()
    assert pool.segments(), "PyTorch caches freed blocks in its segments"
    release_all(pool)
    assert allocator.counters()["frees"] == allocator.counters()["allocs"]
    pool.check_invariants()


def test_nested_blocks_of_one_pool_and_refused_nesting_of_two(make_pool):
    a, b = make_pool("64MiB"), make_pool("64MiB")
    with a.capture():
        with a.capture():
            t = torch.ones(100, device="cuda")
        u = torch.ones(100, device="cuda")
        with pytest.raises(RuntimeError, match="already routes its allocations to pool"):
            with b.capture():
                pass
    assert in_segments(a, t) and in_segments(a, u)
    del t, u
    release_all(a)


def test_an_impossible_request_is_pytorchs_oom_and_changes_nothing(make_pool):
    pool = make_pool("64MiB")
    keep = pool.full((MiB,), 3, dtype=torch.uint8)
    before = pool.layout()
    with pool.capture() as allocator:
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(pool.capacity * 2, dtype=torch.uint8, device="cuda")
        ok = torch.ones(1000, device="cuda")  # the pool still serves what fits
    c = allocator.counters()
    assert c["failures"] >= 1 and c["errors"] == 0 and "returned NULL" in c["last_error"]
    assert bool((keep == 3).all()) and in_segments(pool, ok)
    del ok
    release_all(pool)
    assert pool.layout()["blocks"] == before["blocks"]
    pool.check_invariants()


# ---------------------------------------------------------------- fragmentation: PyTorch OOMs, defrag completes

BUDGET = 640 * MiB  # the memory both runs may use
SMALL = 512 * 1024  # 4 per 2 MiB page / small segment
COUNT = 1024  # 512 MiB of small tensors
BIG = 256 * MiB

PLAIN = """
    import json, sys, torch
    budget, small, count, big = map(int, sys.argv[1:5])
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(budget / total, 0)
    ts = [torch.empty(small, dtype=torch.uint8, device="cuda") for _ in range(count)]
    ts.sort(key=lambda t: t.data_ptr())
    keep = ts[::4]
    del ts
    stats = torch.cuda.memory_stats()
    out = {"reserved": stats["reserved_bytes.all.current"], "allocated": stats["allocated_bytes.all.current"]}
    try:
        x = torch.empty(big, dtype=torch.uint8, device="cuda")
        out["oom"] = False
    except torch.OutOfMemoryError as exc:
        out["oom"] = True
        out["message"] = str(exc).splitlines()[0]
    print(json.dumps(out), flush=True)
"""


def test_a_fragmentation_oom_of_pytorch_completes_under_capture(make_pool, figures):
    # Without defrag: the same pattern on PyTorch's allocator under the same budget.
    proc = child(PLAIN, str(BUDGET), str(SMALL), str(COUNT), str(BIG))
    plain = last_json(proc)
    assert plain["oom"], f"PyTorch's allocator served {BIG} bytes: the scenario does not fragment it ({plain})"
    assert plain["reserved"] - plain["allocated"] >= BIG, "the OOM must be fragmentation, not a full budget"
    figures.add("plain PyTorch: reserved but unallocated at the OOM", plain["reserved"] - plain["allocated"], "bytes")

    # With defrag: the small tensors in the pool, the big one made by PyTorch inside pool.capture().
    pool = make_pool(BUDGET)
    ts = sorted((pool.empty(SMALL, dtype=torch.uint8) for _ in range(COUNT)), key=lambda t: t.data_ptr())
    for i, t in enumerate(ts):
        t.fill_(i % 251)
    survivors = {i: t for i, t in enumerate(ts) if i % 4 == 0}
    del ts, t
    addresses = {i: t.data_ptr() for i, t in survivors.items()}
    assert pool.stats()["stranded_bytes"] >= BIG
    # torch.empty reads no pool tensor, so compacting inside the callback is safe here (the default is not to).
    with pool.capture(allocator=defrag.TorchAllocator(pool, compact_in_callback=True)) as allocator:
        x = torch.empty(BIG, dtype=torch.uint8, device="cuda")
        x.fill_(7)
        # Sampled: a full int64 reduction would make PyTorch ask for a temporary 8x as large as `x`
        # (inside the capture: a 2 GiB segment the 640 MiB budget cannot hold; seen on an H200).
        filled = bool((x[:: 1 << 16] == 7).all()) and int(x[-1]) == 7
    assert filled
    assert in_segments(pool, x)
    assert any(t.data_ptr() != addresses[i] for i, t in survivors.items()), "no compaction ran"
    sync()
    assert all(bool((t == i % 251).all()) for i, t in survivors.items()), "a pool tensor lost its bytes"
    assert allocator.counters()["failures"] == 0
    figures.add("defrag: segment served after automatic compaction", BIG, "bytes")
    del x
    release_all(pool)
    pool.check_invariants()


# ---------------------------------------------------------------- training

class _Block(torch.nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(d, heads, batch_first=True)
        self.up, self.down = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
        self.n1, self.n2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)

    def forward(self, x):
        h = self.n1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.down(torch.nn.functional.gelu(self.up(self.n2(x))))


def _model(d=128, heads=4, layers=2, vocab=96):
    return torch.nn.Sequential(torch.nn.Linear(32, d), *[_Block(d, heads) for _ in range(layers)],
                               torch.nn.Linear(d, vocab))


def _step(m, o, x, y):
    o.zero_grad()
    loss = torch.nn.functional.cross_entropy(m(x).flatten(0, 1), y.flatten())
    loss.backward()
    o.step()
    return loss.detach()


def test_training_under_capture_compacted_between_steps_is_bit_identical(make_pool):
    """Weights and Adam state in the pool (movable), activations and gradients in pool segments
    (PyTorch's, inside pool.capture()), compacted between steps: a twin on PyTorch's allocator
    matches bit for bit, loss by loss and weight by weight."""
    pool = make_pool("512MiB", auto_compact=False)
    torch.manual_seed(0)
    model = _model().cuda()
    twin = copy.deepcopy(model)
    opt, topt = torch.optim.Adam(model.parameters(), lr=1e-3), torch.optim.Adam(twin.parameters(), lr=1e-3)
    gen = torch.Generator(device="cpu").manual_seed(1)
    data = [(torch.randn(8, 32, 32, generator=gen).cuda(), torch.randint(0, 96, (8, 32), generator=gen).cuda())
            for _ in range(6)]
    assert torch.equal(_step(model, opt, *data[0]), _step(twin, topt, *data[0]))  # Adam state exists now
    spacer = pool.empty(pool.page_size // 2, dtype=torch.uint8)  # holes in front of the weights
    pool.adopt(model)
    spacer2 = pool.empty(pool.page_size // 3, dtype=torch.uint8)
    pool.adopt(opt)
    params = list(model.parameters())
    assert all(pool.owns(p) for p in params)
    del spacer, spacer2
    at = [p.data_ptr() for p in params]
    moved = 0
    with torch.autograd.set_multithreading_enabled(False):  # backward on this thread: routed too
        for x, y in data[1:]:
            scratch = [pool.empty(300_000, dtype=torch.uint8) for _ in range(40)]
            del scratch[::2]
            with pool.capture() as allocator:
                loss = _step(model, opt, x, y)
            assert in_segments(pool, loss)
            assert all(in_segments(pool, p.grad) for p in params), "gradients are not in pool segments"
            assert torch.equal(loss, _step(twin, topt, x, y))
            del scratch
            sync()
            cap.release_cached(pool)
            moved += pool.compact(verify=True).moved_tensors
    assert moved > 0 and any(p.data_ptr() != a for p, a in zip(params, at)), "the compactions moved no weight"
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    assert allocator.counters()["failures"] == 0 and allocator.counters()["errors"] == 0
    opt.zero_grad(set_to_none=True)
    del loss
    release_all(pool)
    pool.check_invariants()


def test_backward_on_autograds_thread_is_not_routed(make_pool):
    """The documented limit: use_mem_pool is per thread, and CUDA backward runs on autograd's device thread."""
    pool = make_pool("256MiB")
    w = torch.randn(512, 512, device="cuda", requires_grad=True)
    with pool.capture():
        (w @ w).sum().backward()
    routed = in_segments(pool, w.grad)
    w.grad = None
    with torch.autograd.set_multithreading_enabled(False):
        with pool.capture():
            (w @ w).sum().backward()
    assert in_segments(pool, w.grad), "with multithreading off, backward's allocations are routed"
    assert not routed, ("backward on autograd's thread was routed: PyTorch changed; update the guide's limits "
                        "(set_multithreading_enabled(False) may no longer be needed)")
    del w
    release_all(pool)


# ---------------------------------------------------------------- install (process-wide, so in a child)
# The native route (a pool with the fast path): tests/gpu/test_install_gpu.py. Here the ctypes
# fallback, which a pool without the fast path gets (DEFRAG_FASTPATH=0).

INSTALL = """
    import json, torch, defrag
    from defrag import fastpath
    pool = defrag.Pool(device="cuda:0", capacity="1GiB")
    fast = pool.core.fast is not None
    allocator = defrag.install(pool)  # a pool must not have initialized torch's allocator
    assert defrag.install(pool) is allocator
    x = torch.randn(1024, 1024, device="cuda")
    y = x @ x
    torch.cuda.synchronize()
    segs = pool.segments()
    inside = lambda t: any(a <= t.data_ptr() < a + n for a, n in segs)
    out = {"x": inside(x), "y": inside(y), "allocs": allocator.counters()["allocs"], "fast": fast,
           "fast_status": fastpath.status(),
           "close": bool(torch.allclose(y.cpu(), x.cpu() @ x.cpu(), rtol=1e-3, atol=1e-2))}
    del x, y
    torch.cuda.synchronize()
    out["frees"] = allocator.counters()["frees"]
    out["errors"] = allocator.counters()["errors"]
    try:
        defrag.install(defrag.Pool(device="cuda:0", capacity="64MiB"))
        out["second"] = "accepted"
    except RuntimeError as exc:
        out["second"] = str(exc)
    print(json.dumps(out), flush=True)
"""

LATE = """
    import json, torch, defrag
    torch.ones(1, device="cuda")  # PyTorch's allocator is in use now
    try:
        defrag.install(defrag.Pool(device="cuda:0", capacity="64MiB"))
        print(json.dumps({"refused": ""}))
    except RuntimeError as exc:
        print(json.dumps({"refused": str(exc)}))
"""


def test_install_without_the_fast_path_falls_back_to_ctypes_in_a_fresh_process():
    proc = child(INSTALL, env_extra={"DEFRAG_FASTPATH": "0"})
    out = last_json(proc)
    assert out["x"] and out["y"] and out["close"], out
    assert not out["fast"] and out["fast_status"] == "off", out  # no fast path: the TorchAllocator route
    assert out["allocs"] >= 2 and out["frees"] >= 2 and out["errors"] == 0, out
    assert "already PyTorch's allocator" in out["second"], out
    assert proc.returncode == 0, (f"the process died at exit (rc {proc.returncode}): PyTorch freeing tensors "
                                  f"through the allocator after Python finalized?\n{proc.stderr[-3000:]}")


def test_install_after_the_first_cuda_allocation_is_refused():
    out = last_json(child(LATE))
    assert "must run before PyTorch's first CUDA allocation" in out["refused"], out

