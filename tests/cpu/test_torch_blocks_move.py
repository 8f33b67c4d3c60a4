"""PyTorch's own blocks move at safe points (`defrag.owners`, `defrag run --rescue`, `--compact-at step`).

Under `defrag.install` on the emulated device every CPU tensor is a block PyTorch's allocator placed in
the pool. At a safe point the owner match finds each block's one storage, and the compaction rewrites it:
every tensor, view, gradient and optimizer state follows. What never moves stays: memory exported to
numpy or DLPack, storages shared with another, blocks no storage reachable from Python owns, everything
while another allocating thread runs or inside `defrag.no_moves()`, and pinned tensors. Each test would
fail on a stale pointer: it checks bytes and addresses, not only that a call returned.

Each run is a subprocess (PyTorch's allocator is process-wide, and a crash must fail the test).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from defrag import fastpath

from ..forked import run_clean

pytestmark = pytest.mark.skipif(fastpath.setting() == "off", reason="DEFRAG_FASTPATH=0: no native allocator")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The issue's program: 256 tensors of 1 MiB, every fourth kept (each 2 MiB page half used), then 200 MiB.
FRAGMENT = """
        import torch
        ts = [torch.full((256 * 1024,), float(i)) for i in range(256)]
        keep = ts[::4]
        del ts
"""


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    return run_clean(textwrap.dedent(script), *args)


def installed(capacity: str, imports: str = "torch, defrag") -> str:
    """A script's first lines: a pool of `capacity` installed as PyTorch's CPU allocator (as defrag run does)."""
    return f"""
        import {imports}
        pool = defrag.Pool("emulated", capacity="{capacity}")
        defrag.install(pool)
"""


def test_an_explicit_compaction_moves_pytorchs_tensors_and_a_large_request_then_fits():
    proc = run(installed("300MiB", "gc, torch, defrag") + FRAGMENT + """
        before = [t.data_ptr() for t in keep]
        views = [t[10:20] for t in keep]  # views follow their storage
        try:
            torch.empty(200 << 20, dtype=torch.uint8)
            raise SystemExit("served without a compaction: the test lost its point")
        except torch.OutOfMemoryError:
            pass
        (report,) = defrag.compact()
        assert report.moved_tensors > 0 and report.released_pages > 0, report
        moved = sum(a != t.data_ptr() for a, t in zip(before, keep))
        assert moved == report.moved_tensors, (moved, report)
        big = torch.empty(200 << 20, dtype=torch.uint8)  # fits now
        big.fill_(7)
        for i, (t, v) in enumerate(zip(keep, views)):
            assert bool((t == 4 * i).all()), i
            assert v.data_ptr() == t.data_ptr() + 40 and bool((v == 4 * i).all()), i
            t.add_(1)
            assert bool((v == 4 * i + 1).all()), i  # a write through the tensor is seen by its view
        stats = pool.stats()
        assert stats["compaction.torch_moved_tensors"] == report.moved_tensors, stats
        assert stats["compaction.torch_moved_bytes"] == report.moved_bytes, stats
        pool.check_invariants()
        print("ok")
    """)
    assert "ok" in proc.stdout


def test_exports_and_shared_storages_never_move_and_say_why():
    proc = run(installed("64MiB", "numpy as np, torch, defrag") + """
        from torch.utils.dlpack import to_dlpack  # after install, as under defrag run
        """ + FRAGMENT.replace("256 * 1024", "64 * 1024") + """
        exported = {0: keep[0].numpy(), 1: np.asarray(keep[1]), 2: to_dlpack(keep[2]), 3: np.from_dlpack(keep[3])}
        shared = torch.from_numpy(keep[4].numpy())  # a second storage over the same bytes
        import ctypes
        raw = np.ctypeslib.as_array((ctypes.c_float * 100).from_address(keep[5].data_ptr() + 400))
        inside = torch.from_numpy(raw)  # a storage over part of the block, seen by no export hook
        addresses = [t.data_ptr() for t in keep]
        reasons = {t.address: t.reason for t in pool.live_tensors()}
        assert "numpy" in reasons[addresses[0]] and "numpy" in reasons[addresses[1]], reasons[addresses[0]]
        assert "DLPack" in reasons[addresses[2]] and "DLPack" in reasons[addresses[3]], reasons[addresses[2]]
        assert "numpy" in reasons[addresses[4]], reasons[addresses[4]]  # exported, then imported back
        assert "another storage covers its bytes" in reasons[addresses[5]], reasons[addresses[5]]
        report = pool.compact()
        assert report.moved_tensors > 0, report
        for i in range(6):
            assert keep[i].data_ptr() == addresses[i], i  # never moved
        assert any(t.data_ptr() != a for t, a in zip(keep[6:], addresses[6:]))  # the others did
        # The numpy arrays still see the tensors' bytes, both ways.
        exported[0][3] = -5.0
        assert float(keep[0][3]) == -5.0
        keep[1][4] = -6.0
        assert exported[1][4] == -6.0 and shared[0] == 16.0
        shared[1] = -7.0
        assert float(keep[4][1]) == -7.0
        inside[0] = -8.0
        assert float(keep[5][100]) == -8.0
        pool.check_invariants()
        print("ok")
    """)
    assert "ok" in proc.stdout


def test_pins_no_moves_and_a_running_allocating_thread_keep_every_block_in_place():
    proc = run(installed("64MiB", "threading, torch, defrag") + FRAGMENT.replace("256 * 1024", "64 * 1024") + """
        addresses = lambda: [t.data_ptr() for t in keep]
        start = addresses()
        pool.pin(keep[0])
        with defrag.no_moves():
            reasons = {t.address: t.reason for t in pool.live_tensors()}
            assert reasons[start[1]] == "a defrag.no_moves() block is running", reasons[start[1]]
            assert pool.compact().moved_tensors == 0 and addresses() == start
        # Another Python thread that allocates from the pool runs: it may be inside an operation.
        go, done = threading.Event(), threading.Event()
        def worker():
            x = torch.ones(1000)
            go.set()
            done.wait()
        t = threading.Thread(target=worker, name="loader")
        t.start()
        go.wait()
        reasons = {t.address: t.reason for t in pool.live_tensors()}
        assert "thread 'loader'" in reasons[start[1]] and "middle of an operation" in reasons[start[1]], reasons
        assert pool.compact().moved_tensors == 0 and addresses() == start
        done.set()
        t.join()
        report = pool.compact()  # the thread ended: PyTorch's blocks move, the pinned one stays
        assert report.moved_tensors > 0 and addresses()[0] == start[0], report
        assert {t.address: t.reason for t in pool.live_tensors()}[start[0]] == "pinned"
        for i, t in enumerate(keep):
            assert bool((t == 4 * i).all()), i
        print("ok")
    """)
    assert "ok" in proc.stdout


def test_a_compaction_between_forward_and_backward_gives_the_same_gradients():
    proc = run("""
        import torch, defrag
        def grads(between=None):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.LayerNorm(256),
                                        torch.nn.Linear(256, 10))
            x = torch.randn(32, 64)
            junk = [torch.randn(16384) for _ in range(128)]  # holes between the model's blocks
            del junk[::2]
            loss = model(x).logsumexp(-1).mean()
            moved = between() if between else 0
            loss.backward()
            return [p.grad.clone() for p in model.parameters()], float(loss), moved, model
        plain, plain_loss, _, _ = grads()
        pool = defrag.Pool("emulated", capacity="64MiB")
        defrag.install(pool)
        got, loss, moved, model = grads(lambda: pool.compact().moved_bytes)
        assert moved > 0, "nothing moved: the test lost its point"
        assert loss == plain_loss
        for a, b in zip(plain, got):
            assert torch.equal(a, b)
        reasons = [t.reason for t in pool.live_tensors() if not t.movable]
        print("ok", moved)
    """)
    assert "ok" in proc.stdout


def test_a_compiled_model_gives_the_same_outputs_across_compactions():
    proc = run("""
        import torch, defrag
        torch.manual_seed(0)
        pool = defrag.Pool("emulated", capacity="64MiB")
        defrag.install(pool)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
        x = torch.randn(16, 32)
        compiled = torch.compile(model, backend="aot_eager")
        expected = compiled(x).detach().clone()  # compiled code may round differently from eager: its own
        moved = 0
        for step in range(3):
            junk = [torch.randn(65536) for _ in range(64)]
            del junk[::2]
            out = compiled(x)
            assert torch.equal(out, expected), f"step {step}"
            moved += pool.compact().moved_bytes
        assert moved > 0, "nothing moved: the test lost its point"
        assert torch.equal(compiled(x), expected)
        print("ok")
    """)
    assert "ok" in proc.stdout


def test_the_rescue_retries_a_failed_operation_once_and_never_an_in_place_one():
    proc = run(installed("300MiB") + """
        from defrag import rescue
        rescue.enable()
        """ + FRAGMENT + """
        big = torch.zeros(200 << 20, dtype=torch.uint8)  # fails, is rescued, runs again
        assert rescue.counters()["rescued"] == 1, rescue.counters()
        assert "a compaction moved" in rescue.last_note, rescue.last_note
        for i, t in enumerate(keep):
            assert bool((t == 4 * i).all()), i
        del big
        # An operation that writes an argument (out=) and runs out of memory is never run again.
        a, out = torch.ones(1 << 18), torch.empty(0)
        try:
            torch.cat([a] * 400, out=out)  # 400 MiB: more than the pool holds
            raise SystemExit("no OOM")
        except torch.OutOfMemoryError:
            pass
        assert rescue.counters()["mutating"] == 1 and rescue.counters()["rescued"] == 1, rescue.counters()
        # What no compaction can serve fails again; the message says what the rescue moved and could not.
        try:
            torch.zeros(280 << 20, dtype=torch.uint8)
            raise SystemExit("no OOM")
        except torch.OutOfMemoryError as e:
            message = str(e)
        assert "  rescue: at the failed operation, a compaction moved" in message, message
        assert "defrag run --rescue" not in message, message  # it ran: not advised again
        assert rescue.counters()["failed"] == 1, rescue.counters()
        assert rescue.disable() is True and rescue.disable() is False
        print("ok")
    """)
    assert "ok" in proc.stdout


def _defrag_run(tmp_path, *args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "defrag", "run", "--device", "emulated", *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=240, env=env)


def test_defrag_run_rescue_serves_the_issues_program_with_no_defrag_call(tmp_path):
    (tmp_path / "prog.py").write_text(textwrap.dedent(FRAGMENT) + textwrap.dedent("""
        big = torch.empty(200 << 20, dtype=torch.uint8)
        assert all(bool((t == 4 * i).all()) for i, t in enumerate(keep))
        print("served")
    """))
    plain = _defrag_run(tmp_path, "--capacity", "300MiB", "prog.py")
    assert plain.returncode == 1 and "--rescue" in plain.stderr, plain.stderr  # the advice names it
    proc = _defrag_run(tmp_path, "--capacity", "300MiB", "--rescue", "--report", "r.json", "prog.py")
    assert proc.returncode == 0 and proc.stdout.split() == ["served"], proc.stderr
    summary = json.loads((tmp_path / "r.json").read_text())["summary"]
    assert summary["rescued_operations"] == 1 and summary["torch_moved_bytes"] > 0, summary
    assert "of PyTorch's tensors (" in proc.stderr and "· 1 operation rescued" in proc.stderr, proc.stderr


def test_compact_at_step_trains_bit_identically_with_pytorchs_tensors_moving(tmp_path):
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        import torch
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64), torch.nn.GELU(),
                                    torch.nn.Linear(64, 64))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)
        cache = []  # what a program keeps across steps (every other entry dropped): holes between blocks
        for step in range(8):
            cache += [torch.full((65536,), float(step)) for _ in range(8)]
            del cache[-8::2]
            n = int(torch.randint(4, 48, (1,), generator=g))  # varying sequence lengths
            ids = torch.randint(0, 64, (8, n), generator=g)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
            loss.backward()
            opt.step()
            print(f"{loss.item():.12f}")
        assert all(bool((t == t[0]).all()) for t in cache)
    """))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    plain = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=240,
                           env=env)
    assert plain.returncode == 0, plain.stderr
    proc = _defrag_run(tmp_path, "--compact-at", "step", "--compact-min", "1", "--report", "r.json", "train.py")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == plain.stdout  # bit-identical losses
    summary = json.loads((tmp_path / "r.json").read_text())["summary"]
    assert summary["compactions"] == 8 and summary["torch_moved_bytes"] > 0, summary


def test_bad_compact_options_get_one_line_and_exit_2(tmp_path):
    (tmp_path / "p.py").write_text("print(1)\n")
    for args, says in ((["--compact-at", "epoch", "p.py"], "the one safe point it knows is 'step'"),
                       (["--compact-min", "1MiB", "p.py"], "--compact-min needs --compact-at step"),
                       (["--compact-at", "step", "--compact-min", "lots", "p.py"], "--compact-min")):
        proc = _defrag_run(tmp_path, *args)
        assert proc.returncode == 2 and says in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
