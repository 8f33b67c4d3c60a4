"""Whole programs under `defrag.install(pool)` on the emulated device (native/cpu_allocator.cpp).

A third-party model (transformers' GPT-2) trains bit-identically with every parameter, gradient,
optimizer state and activation in the pool; a DataLoader's forked workers leave the parent's pool
intact; a driver fault in the allocator's slow path (pages must be mapped) is a clean
torch.OutOfMemoryError after which the pool is whole and serves again.

Each run is a subprocess, so that a crash fails the test instead of killing pytest (and PyTorch's
allocator, process-wide, is never left replaced in pytest's own process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from defrag import fastpath

from ..forked import check_clean, run_python

pytestmark = pytest.mark.skipif(fastpath.setting() == "off", reason="DEFRAG_FASTPATH=0: no native allocator")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(script: str, *args: str, root_first: bool = True, cwd: str = ROOT, ok: bool = True,
        timeout: float = 240) -> subprocess.CompletedProcess:
    """`python -c script args...`; with `ok`, fails unless it exited 0 without a C++ or ignored exception.

    `root_first` False: the checkout is not put on PYTHONPATH (the script puts it on sys.path itself,
    after what must not be shadowed by the checkout's top-level folders).
    """
    if root_first:  # a process of its own, forked from the suite's zygote, which imported torch (tests/forked.py)
        proc = run_python(script, *args, cwd=cwd, timeout=timeout)
    else:  # the import order is the point: a fresh interpreter
        env = dict(os.environ)
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                 if p and os.path.realpath(p) != os.path.realpath(ROOT)]
        env["PYTHONPATH"] = os.pathsep.join(paths)
        env["HF_HUB_OFFLINE"] = "1"  # transformers: never a download
        proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                              timeout=timeout, env=env, cwd=cwd)
    return check_clean(proc) if ok else proc


# ---------------------------------------------------------------- a third-party model
GPT2 = r"""
import gc, sys
# transformers (>= 5) imports the `kernels` distribution; the checkout's top-level kernels/ folder
# (shipped as defrag.kernels) would shadow it, so the model's modules are imported before the
# checkout goes on sys.path.
from transformers import GPT2Config, GPT2LMHeadModel
import torch
sys.path.insert(0, sys.argv[1])
import defrag
from defrag import cpu_allocator, fastpath
assert defrag.__file__.startswith(sys.argv[1]), defrag.__file__

def tensors_in(o):
    if torch.is_tensor(o):
        yield o
    elif isinstance(o, (tuple, list)):
        for x in o:
            yield from tensors_in(x)
    elif isinstance(o, dict):  # transformers' ModelOutput is a dict
        for x in o.values():
            yield from tensors_in(x)

def train(check=None):
    torch.manual_seed(0)  # weights and dropout
    config = GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=128, n_positions=32,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    outputs = []
    for m in model.modules():
        m.register_forward_hook(lambda m, i, o: outputs.append(o))
    losses = []
    for step in range(3):
        ids = torch.randint(0, 128, (4, 32), generator=g)
        opt.zero_grad()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        losses.append(out.loss.detach().clone())
        if check is not None:
            check(model, opt, outputs + [out])
        outputs.clear()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses

pool = defrag.Pool("emulated", capacity="256MiB")
made = fastpath.module.cpu_allocator_made
plain_state, plain_losses = train()  # before install: PyTorch's own allocator
assert not any(made(t) for t in list(plain_state.values()) + plain_losses)
defrag.install(pool)
seen = {"parameters": 0, "gradients": 0, "optimizer state": 0, "activations": 0}

def check(model, opt, outputs):
    for p in model.parameters():
        assert made(p) and pool.owns_address(p.data_ptr()), ("parameter", tuple(p.shape))
        assert p.grad is not None and made(p.grad) and pool.owns_address(p.grad.data_ptr()), ("gradient", p.shape)
        seen["parameters"] += 1
        seen["gradients"] += 1
    for state in opt.state.values():
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}, set(state)
        for name, v in state.items():
            assert made(v) and pool.owns_address(v.data_ptr()), ("optimizer state", name, tuple(v.shape))
            seen["optimizer state"] += 1
    for t in tensors_in(outputs):  # every module's output, the logits and the loss
        if t.numel():
            assert made(t) and pool.owns_address(t.data_ptr()), ("activation", tuple(t.shape), t.dtype)
            seen["activations"] += 1
    pool.check_invariants()

before = cpu_allocator.counters()
state, losses = train(check)
after = cpu_allocator.counters()
assert seen["parameters"] == seen["gradients"] > 0 and seen["optimizer state"] == 3 * seen["parameters"], seen
assert seen["activations"] > 3 * 20, seen
# Temporaries too: far more blocks than the tensors the hooks saw, none served elsewhere.
assert after["blocks"] - before["blocks"] > 1000 and after["declined"] == before["declined"], (before, after)
assert after["ooms"] == before["ooms"], after
assert pool.stats()["allocated_bytes.all.peak"] > sum(t.nbytes for t in state.values()) * 4, pool.stats()
assert [float(x) for x in losses] == [float(x) for x in plain_losses], (losses, plain_losses)
assert state.keys() == plain_state.keys()
for name, t in state.items():
    assert made(t) and t.dtype == plain_state[name].dtype, name
    assert torch.equal(t, plain_state[name]), f"{name} is not bit-identical to the plain run's"
defrag.uninstall()
del state, losses, t
gc.collect()
pool.check_invariants()
assert pool.stats()["live_blocks"] == 0, pool.stats()  # nothing the model made outlives it
pool.close()
print("ok", seen)
"""


def test_a_transformers_gpt2_trains_bit_identically_with_everything_in_the_pool(tmp_path):
    pytest.importorskip("transformers", reason="transformers is a test extra: pip install -e '.[test]'")
    proc = run(GPT2, ROOT, root_first=False, cwd=str(tmp_path))
    assert "ok" in proc.stdout


# ---------------------------------------------------------------- DataLoader workers (fork)
LOADER = r"""
import gc, torch, defrag
from defrag import cpu_allocator, fastpath

class Rows(torch.utils.data.Dataset):
    def __init__(self, table):
        self.table = table  # the parent's tensor, inherited by each forked worker
    def __len__(self):
        return 40
    def __getitem__(self, i):
        noise = torch.randn(8)  # the worker's RNG, seeded from the parent's loader generator
        child = [fastpath.module.cpu_allocator_made(noise), cpu_allocator.counters()["forked_child"]]
        row = self.table[i % len(self.table)]
        return {"x": row * 2 + noise, "i": i, "big": torch.full((5000,), float(i)), "child": torch.tensor(child)}

def epochs(table):
    g = torch.Generator().manual_seed(3)
    # fork, Linux's default start method before Python 3.14 (whose default is forkserver), named so that
    # the workers are forked children of the installed parent on any Python.
    loader = torch.utils.data.DataLoader(Rows(table), batch_size=8, shuffle=True, num_workers=2, generator=g,
                                         multiprocessing_context="fork")
    return [batch for _ in range(2) for batch in loader]  # workers started and shut down twice

pool = defrag.Pool("emulated", capacity="64MiB")
made = fastpath.module.cpu_allocator_made
table = torch.arange(16 * 8, dtype=torch.float32).reshape(16, 8)
plain = epochs(table)
assert not any(bool(b["child"].any()) for b in plain)  # nothing installed: no fork handler ran

defrag.install(pool)
table = torch.arange(16 * 8, dtype=torch.float32).reshape(16, 8)
keep = [torch.full((n,), float(i)) for i, n in enumerate((10, 1000, 100_000, 300_000, 1 << 20))]
assert made(table) and all(made(t) for t in keep)
before = pool.stats()
got = epochs(table)
assert len(got) == len(plain) == 10
for a, b in zip(plain, got):
    assert torch.equal(a["i"], b["i"]) and torch.equal(a["x"], b["x"]) and torch.equal(a["big"], b["big"])
    # In each worker: PyTorch's previous allocator, the fork handler having run.
    assert b["child"].tolist() == [[False, True]] * len(b["i"]), b["child"]
# The parent: its pool whole, its tensors' bytes as they were, the allocator still its own.
del got, b
gc.collect()
pool.check_invariants()
after = pool.stats()
for key in ("allocated_bytes.all.current", "live_blocks", "pinned_blocks", "pages.mapped"):
    assert after[key] == before[key], (key, before[key], after[key])
assert torch.equal(table, torch.arange(16 * 8, dtype=torch.float32).reshape(16, 8))
for i, t in enumerate(keep):
    assert bool((t == float(i)).all()), i
counters = cpu_allocator.counters()
assert counters["installed"] and counters["current"] and not counters["forked_child"], counters
assert counters["declined"] == 0 and counters["ooms"] == 0, counters
fresh = torch.randn(100_000)
assert made(fresh) and pool.owns_address(fresh.data_ptr())
pool.check_invariants()
print("ok")
"""


def test_dataloader_workers_match_a_plain_run_and_leave_the_parents_pool_intact():
    proc = run(LOADER)
    assert "ok" in proc.stdout


class WorkerWroteIntoTheParent(Exception):
    pass


WORKER_WRITES = r"""
import torch, defrag

class Centered(torch.utils.data.Dataset):
    def __init__(self, table):
        self.table = table
    def __len__(self):
        return len(self.table)
    def __getitem__(self, i):
        row = self.table[i]
        row -= row.mean()  # in place on the inherited tensor: the worker's own copy under fork
        return row.clone()

def iterate(table):
    loader = torch.utils.data.DataLoader(Centered(table), batch_size=4, num_workers=2, multiprocessing_context="fork")
    return torch.cat(list(loader))

expect = torch.arange(8 * 8, dtype=torch.float32).reshape(8, 8)
table = expect.clone()
plain = iterate(table)
print("plain:", "unchanged" if torch.equal(table, expect) else "changed")
defrag.install(defrag.Pool("emulated", capacity="64MiB"))
table = expect.clone()
got = iterate(table)
assert torch.equal(got, plain)
print("installed:", "unchanged" if torch.equal(table, expect) else "changed")
"""


def test_a_workers_write_into_an_inherited_tensor_stays_in_the_worker():
    """The pool's pages are memfds mapped MAP_SHARED; a forked child maps them again copy-on-write
    (EmulatedCuda._privatize_in_child), as fork treats PyTorch's own allocator's memory."""
    proc = run(WORKER_WRITES)
    assert "plain: unchanged" in proc.stdout, proc.stdout  # fork's copy-on-write, the baseline
    if "installed: unchanged" not in proc.stdout:
        raise WorkerWroteIntoTheParent(proc.stdout)


# ---------------------------------------------------------------- driver faults in the slow path
FAULT = r"""
import json, sys, torch, defrag
from cuda.bindings.driver import CUresult
from defrag import cpu_allocator, fastpath
plan = json.loads(sys.argv[1])
# No automatic compaction: it would retry around a fault (a refused cuMemCreate then succeeds).
pool = defrag.Pool("emulated", capacity="64MiB", auto_compact=False)
defrag.install(pool)
made = fastpath.module.cpu_allocator_made
keep = [torch.full((n,), float(i)) for i, n in enumerate((10, 1000, 100_000, 300_000))]  # most of page one
drv, page = pool.driver, pool.page_size
request = 3 * page + 1000  # more than the mapped page's room: new pages must be created and mapped
before, mappings = pool.stats(), drv.api.state()["mappings"]
assert before["pages.mapped"] == 1 and before["pages.cached"] == 0, before
errors = {"cuMemCreate": CUresult.CUDA_ERROR_OUT_OF_MEMORY}
for call, nth in plan:
    drv.faults.inject(call, errors.get(call, CUresult.CUDA_ERROR_UNKNOWN), nth=nth)
ooms = cpu_allocator.counters()["ooms"]
try:
    torch.empty(request, dtype=torch.uint8)
    raise SystemExit("no error")
except torch.OutOfMemoryError as e:
    message = str(e)
assert drv.faults.pending() == 0 and [c for c, _ in drv.faults.injected] == [c for c, _ in plan], drv.faults.injected
call = plan[0][0]
if call == "cuMemCreate":  # the device is out of pages: the pool's explained OOM
    assert f"cannot allocate 6.00 MiB ({request} bytes)" in message, message
    assert "the device has no free memory" in message and "CUDA_ERROR_OUT_OF_MEMORY" in message, message
else:  # any other driver error: named in the message (its traceback logged)
    assert message == (f"defrag: making room for {request} bytes failed: "
                       f"CudaError('{call} failed: CUDA_ERROR_UNKNOWN (999)')"), message
assert cpu_allocator.counters()["ooms"] == ooms + 1
drv.faults.clear()
try:
    pool.check_invariants()
except AssertionError as e:
    print("books broken:", e)
    raise SystemExit(5)
after, state = pool.stats(), drv.api.state()
# A page the undo could not unmap (an injected cuMemUnmap fault) stays mapped, as an empty page of the pool.
left = sum(1 for c, _ in plan if c == "cuMemUnmap")
for key in ("allocated_bytes.all.current", "live_blocks"):
    assert after[key] == before[key], (key, before[key], after[key])
assert after["pages.mapped"] == before["pages.mapped"] + left and after["pages.empty"] == before["pages.empty"] + left
assert state["mappings"] == mappings + left, state  # every other page mapped meanwhile was unmapped
assert state["handles"] == after["pages.total"], (state, after)  # pages created meanwhile: the pool's, cached
for i, t in enumerate(keep):
    assert bool((t == float(i)).all()), i
# The next allocation, the fault gone: in the pool.
t = torch.empty(request, dtype=torch.uint8).fill_(7)
assert made(t) and pool.owns_address(t.data_ptr()) and pool.owns_address(t.data_ptr() + request - 1)
assert bool((t == 7).all())
pool.check_invariants()
del t
pool.trim()
assert drv.api.state()["handles"] == pool.stats()["pages.total"] == 1, (drv.api.state(), pool.stats())
print("ok")
"""


class BooksBroken(Exception):
    pass


@pytest.mark.parametrize("plan", [
    [("cuMemCreate", 1)], [("cuMemCreate", 3)],  # the first page, or after two were created
    [("cuMemMap", 1)], [("cuMemMap", 3)],  # none mapped, or after two were mapped (unmapped again)
    [("cuMemSetAccess", 1)],  # every page mapped, access refused
    # ... and the undo's second unmap refused too: that page stays mapped (access granted again), an empty
    # page of the pool that the next trim unmaps (vmm.Space._undo_map, Backing.map's left_mapped).
    [("cuMemSetAccess", 1), ("cuMemUnmap", 2)],
], ids=lambda plan: "+".join(f"{c}#{n}" for c, n in plan))
def test_a_driver_fault_in_the_slow_path_is_a_clean_oom_and_the_pool_serves_again(plan):
    proc = run(FAULT, json.dumps(plan), ok=False)
    if proc.returncode == 5:
        raise BooksBroken(proc.stdout)
    run_ok = proc.returncode == 0 and "terminate called" not in proc.stderr and "Exception ignored" not in proc.stderr
    assert run_ok, f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "ok" in proc.stdout
    if plan[0][0] != "cuMemCreate":  # the original traceback is kept in the log
        assert "placing a block for native code failed" in proc.stderr, proc.stderr
        assert f"CudaError: {plan[0][0]} failed: CUDA_ERROR_UNKNOWN" in proc.stderr, proc.stderr
