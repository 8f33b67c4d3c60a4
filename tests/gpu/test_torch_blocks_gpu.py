"""PyTorch's own CUDA blocks under `defrag.install` at safe points: what must never move does not.

On a GPU the owner match (`defrag.owners`) does not recognize PyTorch's CUDA DataPtrs (the
pluggable route's are PyTorch's own, the backend's carry the backend's deleters), so every
PyTorch-made block stays pinned there: a CUDA graph's inputs and private pool, and cuBLAS/cuDNN
workspaces (blocks no Python storage owns). These tests hold that line on a real GPU: a safe point's
compaction (`defrag.compact()`, which matches owners) moves none of them, a graph replayed after it
computes the same result, and a matmul after it still runs on its workspace. Each scenario runs in a
fresh process (the install is process-wide). Unmeasured until a GPU runs them.
"""

from __future__ import annotations

import pytest

from .conftest import fresh_process, last_json

pytestmark = pytest.mark.needs_cuda("PyTorch's CUDA allocator replaced by defrag's (change_current_allocator)")

GRAPH_AND_WORKSPACES = """
    import json, torch, defrag
    pool = defrag.Pool(device="cuda:0", capacity="2GiB")
    defrag.install(pool)
    out = {}
    static_in = torch.randn(1024, 1024, device="cuda")
    w = torch.randn(1024, 1024, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up: cuBLAS's workspace is made here
            static_out = static_in @ w
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = static_in @ w
    junk = [torch.empty(1 << 18, device="cuda") for _ in range(256)]  # 1 MiB each
    del junk[::2]  # holes: a compaction would have something to gain
    before = {t.address: t.reason for t in pool.live_tensors()}
    addresses = {"input": static_in.data_ptr(), "weight": w.data_ptr(), "output": static_out.data_ptr()}
    reports = defrag.compact()
    torch.cuda.synchronize()
    out["moved_torch"] = pool.stats()["compaction.torch_moved_tensors"]
    out["same_addresses"] = {k: v == {"input": static_in, "weight": w, "output": static_out}[k].data_ptr()
                             for k, v in addresses.items()}
    static_in.copy_(torch.randn(1024, 1024, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    out["replay_right"] = bool(torch.allclose(static_out, static_in @ w, rtol=1e-3, atol=1e-2))
    x = torch.randn(2048, 2048, device="cuda")
    out["matmul_right"] = bool(torch.allclose((x @ x).cpu(), x.cpu() @ x.cpu(), rtol=1e-3, atol=1e-1))
    out["unmovable"] = sum(1 for r in before.values() if r)
    out["blocks"] = len(before)
    pool.check_invariants()
    print(json.dumps(out), flush=True)
"""


def test_graph_inputs_graph_pools_and_workspaces_never_move_at_a_safe_point():
    proc = fresh_process(GRAPH_AND_WORKSPACES, env={"DEFRAG_FASTPATH": None})
    out = last_json(proc)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert out["moved_torch"] == 0, out
    assert all(out["same_addresses"].values()), out
    assert out["replay_right"] and out["matmul_right"], out
    assert out["unmovable"] == out["blocks"] > 0, out  # every PyTorch-made CUDA block says why it stays
