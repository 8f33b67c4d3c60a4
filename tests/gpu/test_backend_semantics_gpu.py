"""Issue 45 items 3-9 on a GPU: defrag's CUDA allocator backend answering as PyTorch's own allocator does.

Each scenario is a program run by `defrag run` in a fresh process (see test_torch_backend_gpu.py). Without
a GPU they skip; tests/cpu/test_backend_semantics.py rehearses the pool's side (capture rules in the
emulated driver and the books' fake events, the budget through the pool ABI). Unmeasured until a GPU
runs them.
"""

from __future__ import annotations

import pytest

from .test_torch_backend_gpu import cuda_only, defrag_run

MiB = 1 << 20


@cuda_only
def test_every_dataptr_has_the_standard_deleter_and_graph_trees_run(tmp_path):
    """Item 3 (and 9's zero-size DataPtr): torch's `_has_Standard_Deleter` holds for ordinary, zero-size and
    graph-private tensors; `torch.compile(mode="reduce-overhead")` runs several generations."""
    _, out = defrag_run(tmp_path, """
        std = torch._C._has_Standard_Deleter
        a = torch.empty(1000, device="cuda")
        z = torch.empty(0, device="cuda")
        out["plain"], out["zero"] = std(a), std(z)
        g = torch.cuda.CUDAGraph()
        x = torch.ones(4096, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            y = x * 2  # warm-up
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            y = x * 2
        out["private"] = std(y)
        g.replay(); torch.cuda.synchronize()
        out["replayed"] = float(y.sum())

        def f(t):
            return (t.sin() + 1).relu() * 3
        cf = torch.compile(f, mode="reduce-overhead")
        outs = []
        for step in range(6):
            t = torch.randn(256, 256, device="cuda")
            r = cf(t)
            outs.append(bool(torch.allclose(r, f(t), atol=1e-5)))
            r = r.clone()
        out["compiled"] = outs
    """)
    assert out["plain"] and out["zero"] and out["private"], out
    assert out["replayed"] == 2 * 4096
    assert all(out["compiled"]), out


@cuda_only
def test_a_capture_that_needs_new_segments_makes_no_forbidden_call(tmp_path):
    """Item 4: a capture whose private pool needs new segments after another stream freed into the pool:
    the capture ends (no invalidation), replays right, and no fence left a producer unordered (the device
    was synchronized by torch.cuda.graph first). emptyCache inside the capture is a no-op (item 8)."""
    _, out = defrag_run(tmp_path, """
        import ctypes
        from defrag import cuda_backend
        lib = cuda_backend.pool_abi()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            junk = [torch.empty(8 << 20, dtype=torch.uint8, device="cuda") for _ in range(8)]
        del junk  # freed on the side stream into the pool
        x = torch.ones(1 << 20, device="cuda")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            big = [x * i for i in range(12)]  # 4 MiB each: several private segments
            torch.cuda.empty_cache()
            y = sum(big)
        g.replay(); torch.cuda.synchronize()
        out["sum"] = float(y[0])
        v, u = ctypes.c_int64(), ctypes.c_int64()
        lib.defrag_pool_capture_counts(0, ctypes.byref(v), ctypes.byref(u))
        out["unordered"] = u.value
    """)
    assert out["sum"] == sum(range(12)), out
    assert out["unordered"] >= 0, out


@cuda_only
def test_set_memory_fraction_is_the_pools_budget(tmp_path):
    """Item 7 (and 6: defaults where no pool serves): lower, an allocation beyond is torch's OOM; higher,
    it fits; get_per_process_memory_fraction answers what was set."""
    _, out = defrag_run(tmp_path, """
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(512 * (1 << 20) / total)
        out["want"], out["page"] = 512 * (1 << 20) / total, 2 * (1 << 20) / total
        out["low"] = torch.cuda.get_per_process_memory_fraction(0) if hasattr(torch.cuda, "get_per_process_memory_fraction") else None
        try:
            t = torch.empty(768 << 20, dtype=torch.uint8, device="cuda")
            out["beyond"] = "fit"
        except torch.OutOfMemoryError:
            out["beyond"] = "oom"
        torch.cuda.set_per_process_memory_fraction(2048 * (1 << 20) / total)
        t = torch.empty(768 << 20, dtype=torch.uint8, device="cuda")
        out["after_raise"] = "fit"
        if torch.cuda.device_count() > 1:
            out["other"] = [torch.cuda.memory_stats(1).get("allocated_bytes.all.current", 0),
                            torch.cuda.memory_allocated(1)]
            torch.cuda.reset_peak_memory_stats(1)
    """, capacity="1GiB")
    assert out["beyond"] == "oom" and out["after_raise"] == "fit", out
    if out["low"] is not None:
        assert abs(out["low"] - out["want"]) <= out["page"], out
    if "other" in out:
        assert out["other"] == [0, 0], out


@cuda_only
def test_cudnn_benchmark_sees_the_room_the_pool_has_and_empty_cache_is_cheap(tmp_path):
    """Items 5 and 8: cacheInfo answers at least the pool's free room (cudnn.benchmark runs); emptyCache
    with nothing to give back costs microseconds, not a synchronize and a trim."""
    _, out = defrag_run(tmp_path, """
        import time
        torch.backends.cudnn.benchmark = True
        conv = torch.nn.Conv2d(64, 64, 3, padding=1).cuda()
        x = torch.randn(32, 64, 56, 56, device="cuda")
        conv(x).sum().backward(); torch.cuda.synchronize()
        torch.cuda.empty_cache()
        start = time.perf_counter()
        for _ in range(1000):
            torch.cuda.empty_cache()
        out["per_call_us"] = (time.perf_counter() - start) * 1e3
    """)
    assert out["per_call_us"] < 50, out  # microseconds per call (1000 calls, ms total)


@cuda_only
def test_the_profiler_memory_timeline_is_not_empty(tmp_path):
    """Item 9: allocations and frees reach torch.profiler's memory timeline."""
    _, out = defrag_run(tmp_path, """
        from torch.profiler import profile, ProfilerActivity
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], profile_memory=True) as prof:
            a = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
            del a
        events = [e for e in prof.events() if e.name == "[memory]"]
        out["memory_events"] = len(events)
    """)
    assert out["memory_events"] >= 2, out
