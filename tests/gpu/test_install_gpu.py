"""`defrag.install(pool)` on a real GPU, native route: PyTorch's CUDA allocator is defrag's entry points.

`install_cuda` hands PyTorch `CUDAPluggableAllocator(<defrag's native module>, "defrag_cuda_alloc",
"defrag_cuda_free")`; every CUDA tensor is then a block of the pool (native/cuda_allocator.cpp). The
install is process-wide and cannot be undone, so every scenario runs in a fresh child process:

- tensors PyTorch makes (factories, matmul results) lie in the pool (`pool.stats()`, `owns_address`),
  pinned, and their frees give the blocks back;
- an impossible request raises torch.OutOfMemoryError with the pool's explained OOM, and the program
  goes on (what fits is still served, what lives keeps its bytes);
- a fragmentation pattern that makes PyTorch's caching allocator raise its OOM under a memory budget
  (each 20 MiB segment kept by one live 4 MiB tensor) completes under install with a pool of that
  budget: the freed 2 MiB pages are stitched into the big request.

The same entry points are rehearsed without a GPU in tests/cpu/test_cuda_entry.py (through the native
module's test hooks); the ctypes fallback's install is tests/gpu/test_capture_gpu.py's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from .conftest import BARE, child_env, fresh_process, last_json

pytestmark = pytest.mark.needs_cuda("PyTorch's CUDA allocator replaced by defrag's (change_current_allocator)")

MiB = 1 << 20
NATIVE = {"DEFRAG_FASTPATH": None}  # the children's environment: the fast path's own default (the native route needs it)


def child(script: str, *args, timeout=300) -> subprocess.CompletedProcess:
    """`script` in a fresh process (conftest's `fresh_process`), the fast path's setting cleared: the
    native route needs it."""
    return fresh_process(script, *args, timeout=timeout, env=NATIVE)


def result(proc) -> dict:
    """The child's last JSON line; the child must also have exited cleanly (frees at exit included)."""
    out = last_json(proc)
    assert proc.returncode == 0, (f"the child died (rc {proc.returncode}): a NULL or a free after exit?\n"
                                  f"{proc.stderr[-4000:]}")
    assert "terminate called" not in proc.stderr, proc.stderr[-4000:]
    return out


ROUTES = """
    import json, torch, defrag
    from defrag import allocator_install as cap, fastpath
    pool = defrag.Pool(device="cuda:0", capacity="1GiB")
    assert pool.core.fast is not None, fastpath.status()  # the native route needs the fast path
    route = defrag.install(pool)  # must come before PyTorch's first CUDA allocation
    out = {"route": type(route).__name__, "again": defrag.install(pool) is route,
           "installed": cap.installed() is route, "library": cap.native_library()}
    x = torch.randn(1024, 1024, device="cuda")
    y = x @ x
    torch.cuda.synchronize()
    out["x"] = pool.owns_address(x.data_ptr()) and pool.owns_address(x.data_ptr() + x.nbytes - 1)
    out["y"] = pool.owns_address(y.data_ptr())
    out["close"] = bool(torch.allclose(y.cpu(), x.cpu() @ x.cpu(), rtol=1e-3, atol=1e-2))
    stats = pool.stats()
    out["live"], out["pinned"] = stats["live_blocks"], stats["pinned_blocks"]
    out["allocated"] = stats["allocated_bytes.all.current"]
    pool.check_invariants()
    del x, y
    torch.cuda.synchronize()
    pool.stats()  # applies the frees; a block the core had recorded waits for its stream's event first
    torch.cuda.synchronize()
    out["live_after"] = pool.stats()["live_blocks"]
    c = route.counters()
    out.update(allocs=c["allocs"], frees=c["frees"], failures=c["failures"], foreign=c["foreign_frees"])
    try:
        defrag.install(defrag.Pool(device="cuda:0", capacity="64MiB"))
        out["second"] = "accepted"
    except RuntimeError as exc:
        out["second"] = str(exc)
    if torch.cuda.device_count() > 1:  # a device with no pool: PyTorch's own allocator is gone there too
        try:
            torch.empty(1024, device="cuda:1")
            out["other_device"] = "served"
        except RuntimeError as exc:
            out["other_device"] = str(exc)
    z = torch.empty(0, device="cuda")  # size 0: NULL, no error
    out["empty"] = z.numel() == 0
    keep = torch.ones(1000, device="cuda")  # freed by PyTorch at exit, after Python is gone: no crash
    print(json.dumps(out), flush=True)
"""


def test_installed_pool_holds_every_cuda_tensor():
    out = result(child(ROUTES))
    assert out["route"] == "CudaInstall" and out["again"] and out["installed"], out
    assert out["library"].endswith(".so"), out
    assert out["x"] and out["y"] and out["close"], out
    # x, y and whatever matmul made (cuBLAS's workspace, kept by PyTorch): all pinned pool blocks.
    assert out["live"] >= 2 and out["pinned"] == out["live"] and out["allocated"] >= 2 * 4 * MiB, out
    assert out["live_after"] <= out["live"] - 2, out
    assert out["allocs"] >= 2 and out["frees"] >= 2 and out["failures"] == 0 and out["foreign"] == 0, out
    assert "already serves cuda:0" in out["second"], out
    if "other_device" in out:
        assert "no pool was installed" in out["other_device"], out
    assert out["empty"], out


OOM = """
    import json, torch, defrag
    pool = defrag.Pool(device="cuda:0", capacity="256MiB")
    route = defrag.install(pool)
    keep = torch.full((1 << 20,), 3.0, device="cuda")  # 4 MiB in the pool
    before = pool.stats()
    out = {}
    try:
        torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        out["oom"] = "served"
    except torch.OutOfMemoryError as exc:
        out["oom"] = str(exc)
    after = pool.stats()
    out["unchanged"] = (after["live_blocks"], after["allocated_bytes.all.current"]) == (
        before["live_blocks"], before["allocated_bytes.all.current"])
    ok = torch.ones(1000, device="cuda") * 2  # the program goes on
    out["ok"] = bool((ok == 2).all()) and pool.owns_address(ok.data_ptr())
    out["keep"] = bool((keep == 3).all())
    pool.check_invariants()
    c = route.counters()
    out.update(ooms=c["ooms"], failures=c["failures"], last=c["last_error"])
    print(json.dumps(out), flush=True)
"""


def test_an_impossible_request_raises_torch_oom_and_the_program_goes_on():
    out = result(child(OOM))
    assert "cannot allocate 1.00 GiB" in out["oom"] and "capacity 256.00 MiB" in out["oom"], out
    assert "(PyTorch's CUDA allocator)" in out["oom"], out  # the live block named for what it is
    assert out["unchanged"] and out["ok"] and out["keep"], out
    assert out["ooms"] == 1 and out["failures"] == 1 and "cannot allocate" in out["last"], out


# PyTorch's caching allocator serves 1-10 MiB requests from 20 MiB segments: 5 tensors of 4 MiB per
# segment. Keeping one of each 5 (in address order) keeps every segment, 80% free; a big request then
# needs a new segment the budget has no room for, and nothing cached can be released: its OOM. In the
# pool the 4 MiB blocks own whole 2 MiB pages: the freed pages are stitched into the big request.
BUDGET = 1024 * MiB
SIZE = 4 * MiB
COUNT = 200  # 800 MiB, 40 segments
BIG = 512 * MiB

PATTERN = """
    import json, sys, torch, defrag
    mode = sys.argv[1]
    budget, size, count, big = map(int, sys.argv[2:6])
    if mode == "defrag":
        pool = defrag.Pool(device="cuda:0", capacity=budget)
        route = defrag.install(pool)
    elif mode == "plain":  # ("unmodified": neither; `defrag run --capacity` is its budget)
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(budget / total, 0)
    ts = [torch.empty(size, dtype=torch.uint8, device="cuda") for _ in range(count)]
    ts.sort(key=lambda t: t.data_ptr())
    for i, t in enumerate(ts):
        t.fill_(i % 251)
    survivors = {i: t for i, t in enumerate(ts) if i % 5 == 0}
    del ts, t
    torch.cuda.synchronize()
    out = {"mode": mode}
    if mode == "plain":
        stats = torch.cuda.memory_stats()
        out["reserved"], out["allocated"] = stats["reserved_bytes.all.current"], stats["allocated_bytes.all.current"]
    try:
        x = torch.empty(big, dtype=torch.uint8, device="cuda")
        x.fill_(7)
        out["oom"] = False
        # Sampled: a full reduction would make PyTorch allocate a temporary as large as `x` (int64: 8x).
        out["filled"] = bool((x[:: 1 << 16] == 7).all()) and int(x[-1]) == 7
    except torch.OutOfMemoryError as exc:
        out["oom"] = True
        out["message"] = str(exc).splitlines()[0]
    torch.cuda.synchronize()
    out["intact"] = all(bool((t == i % 251).all()) for i, t in survivors.items())
    if mode == "defrag":
        out["in_pool"] = not out["oom"] and pool.owns_address(x.data_ptr())
        out["failures"] = route.counters()["failures"]
        pool.check_invariants()
    print(json.dumps(out), flush=True)
"""


def test_a_fragmentation_oom_of_pytorch_completes_under_install(figures):
    args = [str(BUDGET), str(SIZE), str(COUNT), str(BIG)]
    plain = result(child(PATTERN, "plain", *args))
    assert plain["oom"], f"PyTorch's allocator served {BIG} bytes: the pattern does not fragment it ({plain})"
    assert plain["reserved"] - plain["allocated"] >= BIG, f"the OOM must be fragmentation, not a full budget: {plain}"
    assert plain["intact"], plain
    figures.add("plain PyTorch: reserved but unallocated at the OOM", plain["reserved"] - plain["allocated"], "bytes")

    out = result(child(PATTERN, "defrag", *args))
    assert not out["oom"], f"the installed pool refused the big request: {out}"
    assert out["filled"] and out["in_pool"] and out["intact"] and out["failures"] == 0, out
    figures.add("defrag install: big request served after the pattern", BIG, "bytes")


def test_a_fragmentation_oom_of_pytorch_completes_under_defrag_run(tmp_path, figures):
    """Issue 25's GPU check: the pattern with neither an install nor a budget of its own ("unmodified") completes
    under `defrag run --capacity <budget>` (exit 0, no OOM, every survivor's bytes intact), where PyTorch's
    allocator held to that budget raises its OOM (the test above's plain run)."""
    program = tmp_path / "frag.py"
    program.write_text(textwrap.dedent(PATTERN))
    args = [str(BUDGET), str(SIZE), str(COUNT), str(BIG)]
    report = tmp_path / "report.json"
    under = subprocess.run([sys.executable, str(BARE), "-m", "defrag", "run", "--device", "cuda:0", "--capacity",
                            str(BUDGET), "--report", str(report), str(program), "unmodified", *args],
                           capture_output=True, text=True, timeout=300, env=child_env(NATIVE), cwd=str(tmp_path))
    out = result(under)
    assert not out["oom"] and out["filled"] and out["intact"], out
    assert "defrag run: exit 0" in under.stderr and "0 OOMs" in under.stderr, under.stderr[-2000:]
    summary = json.loads(report.read_text())["summary"]
    assert summary["ooms"] == 0 and summary["peak_live_bytes"] >= BIG, summary
    figures.add("defrag run: peak live of the pattern that OOMs plain PyTorch", summary["peak_live_bytes"], "bytes")
