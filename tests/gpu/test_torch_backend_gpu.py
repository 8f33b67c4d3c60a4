"""`defrag run` runs what people run: PyTorch's memory APIs answered by the pool through defrag's CUDA
allocator backend (`defrag.cuda_backend`, native/torch_cuda_backend.cpp over native/pool_abi.h).

Each scenario is an unmodified program run by `defrag run` in a fresh process (PyTorch's CUDA allocator
is replaced once per process and never back): statistics agree with `pool.stats()`; a conv net trains
with `cudnn.benchmark`; a recorded history dumps a snapshot that `_memory_viz` renders and `defrag
replay` replays with the run's own peak; CUDA graphs and `torch.compile(mode="reduce-overhead")` give
the plain outputs; a CUDA tensor sent to another process fails with defrag's one clear error; an OOM is
a torch.OutOfMemoryError saying what the pool tried, and the program goes on.

Without a GPU the scenarios skip (they need CUDA torch); the rehearsal runs the pool's side of the ABI
with the GPU's 2 MiB pages (`test_the_pool_abi_rehearsed_with_gpu_pages`), and tests/cpu/test_pool_abi.py
and tests/cpu/test_cuda_backend.py check the rest on a CPU.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap

import pytest

from .conftest import BARE, MODE, child_env, fresh_process, last_json

MiB = 1 << 20
NATIVE = {"DEFRAG_FASTPATH": None, "DEFRAG_CUDA_BACKEND": None}
cuda_only = pytest.mark.needs_cuda("PyTorch's CUDA allocator replaced by defrag's backend (`defrag run` on a GPU)")

# Every program starts with this: the pool `defrag run` made, and the route PyTorch reaches it by.
HEAD = """
import json, sys, torch, defrag
from defrag import allocator_install
pool = defrag.open_pools()[0]
route = allocator_install.installed(0)
out = {"route": getattr(route, "route", None), "note": getattr(route, "backend_note", None)}
def done():
    print(json.dumps(out, default=str), flush=True)
"""


def defrag_run(tmp_path, program: str, *args, capacity: str = "4GiB", timeout: float = 600):
    """`program` (dedented, after HEAD) run by `defrag run --device cuda:0 --capacity <capacity>`; its
    CompletedProcess and its last JSON line."""
    path = tmp_path / "program.py"
    path.write_text(HEAD + textwrap.dedent(program) + "\ndone()\n")
    report = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, str(BARE), "-m", "defrag", "run", "--device", "cuda:0", "--capacity",
                           capacity, "--report", str(report), str(path), *args], capture_output=True, text=True,
                          timeout=timeout, env=child_env(NATIVE), cwd=str(tmp_path))
    out = last_json(proc)
    assert proc.returncode == 0, f"the program failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    assert "terminate called" not in proc.stderr, proc.stderr[-4000:]
    assert out["route"] == "backend", f"defrag run did not install the backend: {out['note']}"
    return proc, out


@cuda_only
def test_memory_stats_agree_with_the_pool(tmp_path):
    _, out = defrag_run(tmp_path, """
        keep = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (100, 3 * 2**20, 700_000, 64 * 2**20)]
        gone = torch.empty(200 * 2**20, dtype=torch.uint8, device="cuda")
        del gone
        torch.cuda.synchronize()
        def both():
            st, mine = torch.cuda.memory_stats(), pool.stats()
            return {"torch": [st["allocated_bytes.all.current"], st["allocated_bytes.all.peak"],
                              st["reserved_bytes.all.current"], st["reserved_bytes.all.peak"],
                              st["active_bytes.all.current"], st["num_ooms"]],
                    "pool": [mine["allocated_bytes.all.current"], mine["allocated_bytes.all.peak"],
                             mine["reserved_bytes.all.current"], mine["reserved_bytes.all.peak"],
                             mine["active_bytes.all.current"], mine["num_ooms"]],
                    "api": [torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated(),
                            torch.cuda.memory_reserved(), torch.cuda.max_memory_reserved()],
                    "small": st["allocated_bytes.small_pool.current"], "large": st["allocated_bytes.large_pool.current"]}
        out["before"] = both()
        torch.cuda.reset_peak_memory_stats()
        out["after_reset"] = both()
        out["summary"] = torch.cuda.memory_summary()
        out["fraction"] = torch.cuda.get_per_process_memory_fraction(0) if hasattr(torch.cuda, "get_per_process_memory_fraction") else None
        out["capacity_fraction"] = pool.capacity / torch.cuda.get_device_properties(0).total_memory
        # As PyTorch's allocator: the fraction is the pool's budget, lowered or raised (issue 45 item 7).
        torch.cuda.set_per_process_memory_fraction(out["capacity_fraction"] / 4)
        out["shrunk_capacity"] = pool.capacity
        torch.cuda.set_per_process_memory_fraction(out["capacity_fraction"])
        out["restored_capacity"] = pool.capacity
        del keep
        torch.cuda.synchronize()
        out["reserved_before_empty"] = torch.cuda.memory_reserved()
        torch.cuda.empty_cache()
        out["reserved_after_empty"] = torch.cuda.memory_reserved()
        out["pool_reserved_after_empty"] = pool.stats()["reserved_bytes.all.current"]
    """)
    for phase in ("before", "after_reset"):
        figures = out[phase]
        assert figures["torch"] == figures["pool"], (phase, figures)
        assert figures["api"] == figures["pool"][:4], (phase, figures)
    before, after = out["before"], out["after_reset"]
    assert before["pool"][1] >= before["pool"][0] + 200 * MiB, before  # the freed 200 MiB is in the peak
    assert after["pool"][1] == after["pool"][0], after  # reset: peak == current
    assert before["small"] >= 512 and before["large"] >= 64 * MiB + 3 * MiB, before
    assert "Allocated memory" in out["summary"] and "Reserved memory" in out["summary"], out["summary"]
    if out["fraction"] is not None:
        assert abs(out["fraction"] - out["capacity_fraction"]) < 1e-9, out
    total = out["restored_capacity"] / out["capacity_fraction"]
    assert abs(out["shrunk_capacity"] - total * out["capacity_fraction"] / 4) <= 2 * MiB, out  # whole pages
    assert abs(out["restored_capacity"] - total * out["capacity_fraction"]) <= 2 * MiB, out
    assert out["reserved_after_empty"] < out["reserved_before_empty"], out
    assert out["reserved_after_empty"] == out["pool_reserved_after_empty"], out


@cuda_only
def test_a_conv_net_trains_with_cudnn_benchmark(tmp_path):
    _, out = defrag_run(tmp_path, """
        torch.backends.cudnn.benchmark = True
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(),
                                  torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(),
                                  torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 10)).cuda()
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        x = torch.randn(64, 3, 32, 32, device="cuda")
        y = torch.randint(0, 10, (64,), device="cuda")
        losses = []
        for step in range(30):
            loss = torch.nn.functional.cross_entropy(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss))
        out["losses"] = losses
        out["in_pool"] = pool.owns_address(next(net.parameters()).data_ptr())
    """)
    assert out["in_pool"], out
    assert out["losses"][-1] < out["losses"][0] * 0.9, out["losses"]


@cuda_only
def test_a_recorded_history_renders_and_replays_with_the_runs_own_peak(tmp_path, figures):
    snapshot = tmp_path / "snap.pickle"
    _, out = defrag_run(tmp_path, f"""
        torch.cuda.memory._record_memory_history(max_entries=100000)
        torch.manual_seed(0)
        live = []
        for step in range(200):
            live.append(torch.empty(int(torch.randint(1, 8 * 2**20, ())), dtype=torch.uint8, device="cuda"))
            if step % 3 == 2:
                del live[int(torch.randint(0, len(live), ()))]
        x = torch.randn(1024, 1024, device="cuda")
        y = (x @ x).relu_()
        torch.cuda.synchronize()
        out["peak"] = torch.cuda.max_memory_allocated()
        out["pool_peak"] = pool.stats()["allocated_bytes.all.peak"]
        torch.cuda.memory._dump_snapshot({str(snapshot)!r})
        snap = torch.cuda.memory._snapshot()
        out["segments"] = len(snap["segments"])
        out["segment_bytes"] = sum(s["total_size"] for s in snap["segments"])
        out["reserved"] = torch.cuda.memory_reserved()
        out["allocated_in_segments"] = sum(s["allocated_size"] for s in snap["segments"])
        out["allocated"] = torch.cuda.memory_allocated()
        trace = snap["device_traces"][0]
        out["actions"] = sorted({{e["action"] for e in trace}})
        out["frames"] = sum(1 for e in trace if e["action"] == "alloc" and e.get("frames"))
        out["allocs"] = sum(1 for e in trace if e["action"] == "alloc")
        torch.cuda.memory._record_memory_history(enabled=None)
    """)
    assert out["peak"] == out["pool_peak"], out
    assert out["segment_bytes"] == out["reserved"] and out["allocated_in_segments"] == out["allocated"], out
    assert {"alloc", "free_requested", "free_completed", "snapshot"} <= set(out["actions"]), out["actions"]
    assert out["frames"] >= out["allocs"] // 2 > 0, out  # Python frames from PyTorch's own recorder
    with open(snapshot, "rb") as f:
        data = pickle.load(f)
    assert data["segments"] and data["device_traces"][0], "an empty snapshot"
    html = tmp_path / "trace.html"
    viz = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "trace_plot", str(snapshot), "-o", str(html)],
                         capture_output=True, text=True, timeout=300)
    assert viz.returncode == 0 and html.stat().st_size > 1000, viz.stderr[-2000:]
    report = tmp_path / "replay.json"
    replay = subprocess.run([sys.executable, str(BARE), "-m", "defrag", "replay", str(snapshot), "--dry", "--json",
                             str(report)], capture_output=True, text=True, timeout=600, env=child_env(NATIVE),
                            cwd=str(tmp_path))
    assert replay.returncode == 0, replay.stderr[-3000:]
    replayed = json.loads(report.read_text())["trace"]["stats"]["peak_live_bytes"]
    figures.add("replayed peak / the run's max_memory_allocated", replayed / out["peak"], "ratio")
    assert abs(replayed - out["peak"]) <= 0.01 * out["peak"], (replayed, out["peak"])


@cuda_only
def test_cuda_graphs_and_reduce_overhead_give_the_plain_outputs(tmp_path):
    _, out = defrag_run(tmp_path, """
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).cuda()
        static_x = torch.randn(32, 256, device="cuda")
        with torch.no_grad():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    net(static_x)  # warm up off the default stream, as PyTorch's docs do
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_y = net(static_x)
            errors = []
            for i in range(5):
                x = torch.randn(32, 256, device="cuda")
                static_x.copy_(x)
                graph.replay()
                errors.append(float((static_y - net(x)).abs().max()))
        out["graph_errors"] = errors
        out["private"] = route.counters()["backend"]["private_pools"]
        fn = torch.compile(lambda a: torch.nn.functional.gelu(a @ a.T) * 2, mode="reduce-overhead")
        diffs = []
        for i in range(6):
            a = torch.randn(64, 64, device="cuda")
            diffs.append(float((fn(a) - torch.nn.functional.gelu(a @ a.T) * 2).abs().max()))
        out["compiled_errors"] = diffs
        del graph, static_y
        torch.cuda.synchronize()
    """, timeout=900)
    assert max(out["graph_errors"]) < 1e-4, out
    assert out["private"] >= 1, out  # the graph's allocations came from a private pool
    assert max(out["compiled_errors"]) < 1e-3, out


@cuda_only
def test_a_cuda_tensor_sent_to_another_process_fails_with_one_clear_error(tmp_path):
    _, out = defrag_run(tmp_path, """
        import torch.multiprocessing as mp
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        t = torch.arange(1000, device="cuda", dtype=torch.float32)
        try:
            parent.send(t)  # pickling shares the CUDA storage (CUDA IPC)
            out["sent"] = "sent"
        except RuntimeError as exc:
            out["sent"] = str(exc)
        u = t * 2  # the program goes on
        out["after"] = float(u.sum())
    """)
    assert "defrag" in out["sent"] and "cannot be shared with another process" in out["sent"], out["sent"]
    assert out["after"] == float(sum(range(1000)) * 2), out


@cuda_only
def test_an_oom_is_torchs_error_saying_what_the_pool_tried_and_the_program_goes_on(tmp_path):
    _, out = defrag_run(tmp_path, """
        seen = []
        torch._C._cuda_attach_out_of_memory_observer(lambda *args: seen.append(args))
        keep = torch.full((2**20,), 3.0, device="cuda")
        try:
            torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
            out["oom"] = "served"
        except torch.OutOfMemoryError as exc:
            out["oom"] = str(exc)
        out["observed"] = len(seen)
        out["num_ooms"] = torch.cuda.memory_stats()["num_ooms"]
        ok = torch.ones(1000, device="cuda") * 2
        out["goes_on"] = bool((ok == 2).all()) and bool((keep == 3).all())
    """, capacity="1GiB")
    assert "cannot allocate 2.00 GiB" in out["oom"] and "tried:" in out["oom"], out["oom"]
    assert out["observed"] == 1 and out["num_ooms"] >= 1 and out["goes_on"], out


# PyTorch's caching allocator, held to a budget, raises its OOM on this pattern with most of the budget
# reserved but unallocated (tests/gpu/test_install_gpu.py, the same program); under `defrag run` with that
# budget as the capacity it completes, now through the backend, and PyTorch's statistics say so.
FRAGMENT = """
    budget, size, count, big = map(int, sys.argv[1:5])
    ts = [torch.empty(size, dtype=torch.uint8, device="cuda") for _ in range(count)]
    ts.sort(key=lambda t: t.data_ptr())
    for i, t in enumerate(ts):
        t.fill_(i % 251)
    survivors = {i: t for i, t in enumerate(ts) if i % 5 == 0}
    del ts, t
    x = torch.empty(big, dtype=torch.uint8, device="cuda")
    x.fill_(7)
    torch.cuda.synchronize()
    out["intact"] = all(bool((t == i % 251).all()) for i, t in survivors.items())
    out["filled"] = bool((x[:: 1 << 16] == 7).all())
    out["peak"] = torch.cuda.max_memory_allocated()
    out["retries"] = torch.cuda.memory_stats()["num_alloc_retries"]
"""


@cuda_only
def test_a_fragmentation_oom_of_plain_pytorch_completes_through_the_backend(tmp_path, figures):
    budget, size, count, big = 1024 * MiB, 4 * MiB, 200, 512 * MiB
    _, out = defrag_run(tmp_path, FRAGMENT, str(budget), str(size), str(count), str(big), capacity=str(budget))
    assert out["intact"] and out["filled"] and out["peak"] >= big, out
    figures.add("defrag run (backend): peak allocated of the pattern that OOMs plain PyTorch", out["peak"], "bytes")


def test_the_pool_abi_rehearsed_with_gpu_pages():
    """The pool's side of the backend's ABI over a pool with the GPU's 2 MiB pages (on the GPU the pool
    is the GPU's): the backend's view (`defrag_pool_stats`, `largest_block`, `empty_cache`) of a
    fragmenting churn agrees with `pool.stats()` at every step."""
    device = "cuda:0" if MODE == "cuda" else "emulated"
    proc = fresh_process(f"""
        import ctypes, json, torch, defrag
        from defrag import allocator_install, cuda_backend as cb
        from defrag.driver import Driver
        MiB = 1 << 20
        if {device!r} == "emulated":
            pool = defrag.Pool(device=Driver.emulated(capacity=1 << 30, granularity=2 * MiB), capacity="512MiB",
                               page_size=2 * MiB, auto_compact=False)
        else:
            pool = defrag.Pool(device="cuda:0", capacity="512MiB", auto_compact=False)
        allocator_install.register_native(pool, device=0)
        lib = cb.pool_abi()
        def abi():
            s = cb.PoolStats(); s.struct_size = ctypes.sizeof(s)
            assert lib.defrag_pool_stats(0, ctypes.byref(s)) == 0
            return s
        live, checked = [], 0
        why = ctypes.create_string_buffer(4096)
        for step in range(200):
            n = [4096, 700_000, 3 * MiB, 5 * MiB][step % 4]
            out = ctypes.c_void_p()
            assert lib.defrag_pool_alloc(0, n, None, ctypes.byref(out), why, len(why)) == 0, why.value
            live.append(out.value)
            if step % 3 == 1:
                assert lib.defrag_pool_free(0, live.pop(step % len(live)), None) > 0
            if step % 25 == 0:
                s, mine = abi(), pool.stats()
                assert (s.allocated_bytes, s.reserved_bytes, s.live_blocks, s.largest_mapped_free) == (
                    mine["allocated_bytes.all.current"], mine["reserved_bytes.all.current"], mine["live_blocks"],
                    mine["largest_mapped_free_bytes"])
                checked += 1
        for p in live:
            lib.defrag_pool_free(0, p, None)
        released = ctypes.c_int64()
        assert lib.defrag_pool_empty_cache(0, ctypes.byref(released)) == 0
        s = abi()
        assert s.allocated_bytes == 0 and s.reserved_bytes == 0 and released.value > 0
        pool.check_invariants()
        print(json.dumps({{"checked": checked, "released": released.value}}))
    """, env=NATIVE)
    out = last_json(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out["checked"] == 8 and out["released"] >= 2 * MiB, out
