"""install: a whole program under `defrag.install(pool)` (emulated device) against PyTorch's own CPU allocator.

`defrag.install(pool)` makes the pool PyTorch's CPU allocator for the whole
process (`defrag/cpu_allocator.py`, `defrag/native/cpu_allocator.cpp`): every
CPU tensor made afterwards (parameters, gradients, optimizer state,
activations, temporaries) is a block of the pool. Two kinds of rows, each
the same work with and without install, in the same run:

- ``training step`` (goal: install <= 1.1x plain): forward + backward +
  `Adam.step` of a small torch.nn model (an MLP, a transformer encoder
  layer, a small conv net), ~5-30 ms a step on one core. Two copies of the
  model from the same seed: one built, warmed and stepped only while the
  pool is installed (its parameters, gradients and Adam state live in the
  pool, as in a program that installs first thing), the other only while
  it is not. Blocks of steps alternate A B B A (install, uninstall between
  blocks); the first step after each switch is untimed; every step is
  timed alone, and the row gives the median step of each side.
- ``alloc+free``: ns per `torch.empty(n, dtype=uint8)` + drop over a
  seeded mix of 48 sizes (16 B - 16 MiB, log-spaced), one tensor at a time
  (round trip) and with 32 live (each call replaces one slot); and the same
  from a C++ thread Python never saw (`FastPath.churn(native=False)`:
  `at::empty` in a std::thread, no GIL), which under install reaches the
  pool's allocator without Python's dispatch in front of it. A few
  warm-up passes on each side first (the pool maps what the mix needs over
  its first passes); then passes alternate A B B A, the first pass after
  each switch untimed; median of the timed passes.

On a GPU (``--device cuda:N``, the GPU check's ``bench:install`` stage) the
rows compare `defrag.install(pool)` as PyTorch's CUDA allocator with
PyTorch's caching allocator: a training step of an MLP (4096-8192-4096,
batch 256, Adam) and `torch.empty` + drop over the same size mix, each
synchronized. PyTorch's CUDA allocator cannot be swapped back in a process,
so each side runs in child processes of its own, alternating A B B A
(`_bench_separate`; on the emulated device the same code is rehearsed by the
tests on CPU tensors). No goal is judged there yet: no GPU has run it.

Installing replaces PyTorch's process-wide CPU allocator, so all of it runs
in a child process (`python -c`, the same defrag as here): nothing of this
process's allocator state changes, whatever else `defrag bench` runs. The
child uses one intra-op thread (`torch.set_num_threads(1)`): with two
threads on a shared 2-core machine a step's time swings several-fold with
other processes' load, which hides a 10% effect; the allocator's path is the
same with more threads (the pool's allocator serves parallel-region workers
natively too, and sends them to the previous allocator only where pages
must be mapped).

Ratios (install / plain): ``ratio_x`` of the two medians,
``best_ratio_x`` of the two best samples, and ``median_pair_ratio_x``
(with min and max for training), the median over pairs of blocks or passes
run side by side in time. The training goal is judged on the last: on this
shared machine a burst of load from other processes lasts seconds and can
land on more of one side's blocks than the other's, which moves the pooled
medians by 10% and more (seen: conv 1.106x by medians, 0.979x by pairs,
best steps 1.006x, at a load average of 3 on 2 cores), while both halves of
a pair see about the same load.

Every install row carries the allocator's counters over its timed steps or
passes: pool blocks made, trips to the pool's Python code (`asked_python`:
pages had to be mapped), and allocations declined to PyTorch's previous
allocator (`declined`), so a row whose allocations did not reach the pool
says so; and both sides carry the process's minor page faults over the timed
part (`page_faults_per_*`: fresh pages touched for the first time, which
glibc's malloc behind PyTorch's allocator takes when it gives memory back to
the kernel and asks again, and the pool when it maps pages).
"""

from __future__ import annotations

import json
import statistics
import sys

from .runner import Skip, run_child

MiB = 1 << 20
TRAIN_GOAL_X = 1.1
ALLOC_SIZES = tuple(sorted({int(round(16 * (16 * MiB / 16) ** (i / 47))) for i in range(48)}))  # 16 B .. 16 MiB
ALLOC_SEED = 7
ALLOC_LIVE = 32
MODELS = ("mlp", "transformer", "conv")

FULL = {"blocks": 32, "steps": 5, "warmup_steps": 3, "calls": 10_000, "alloc_blocks": 24, "alloc_warmup_passes": 6}
SMOKE = {"blocks": 4, "steps": 2, "warmup_steps": 1, "calls": 500, "alloc_blocks": 4, "alloc_warmup_passes": 1}
ORDER = ("install", "plain", "plain", "install")  # A B B A: a drift in the machine's load hits both sides alike


# --------------------------------------------------------------------------- the child process


def _model(kind: str):
    """(description, model, step) for one torch.nn workload, built from seed 0 (two builds are identical)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    ce = nn.functional.cross_entropy
    if kind == "mlp":
        what = "MLP 512-1024-1024-10 (GELU), batch 128"
        model = nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 10))
        x, y = torch.randn(128, 512), torch.randint(0, 10, (128,))

        def loss():
            return ce(model(x), y)
    elif kind == "transformer":
        what = ("embedding + TransformerEncoderLayer (d 128, 4 heads, ff 512, dropout 0.1) + head, vocab 1000, "
                "8 x 64 tokens")
        vocab, d = 1000, 128
        model = nn.ModuleDict({
            "emb": nn.Embedding(vocab, d),
            "block": nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.1, batch_first=True, norm_first=True),
            "head": nn.Linear(d, vocab)})
        x, y = torch.randint(0, vocab, (8, 64)), torch.randint(0, vocab, (8, 64))

        def loss():
            return ce(model["head"](model["block"](model["emb"](x))).reshape(-1, vocab), y.reshape(-1))
    elif kind == "conv":
        what = "conv net: 2 x (Conv2d 3x3, BatchNorm, ReLU), pools, Linear; batch 16 x 3 x 32 x 32"
        model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
                              nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
                              nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
        x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))

        def loss():
            return ce(model(x), y)
    else:
        raise ValueError(f"unknown model {kind!r}")
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step():
        opt.zero_grad(set_to_none=True)
        loss().backward()
        opt.step()

    return what, model, step


class _Modes:
    """Switch between PyTorch's CPU allocator ("plain") and the pool ("install"); sum the allocator's
    counters over the timed parts of install blocks."""

    KEYS = ("blocks", "asked", "declined", "ooms")

    def __init__(self, pool):
        self.pool = pool
        self.sums = dict.fromkeys(self.KEYS, 0)
        self.faults = {"install": 0, "plain": 0}  # minor page faults (first touches of fresh pages) while timed
        self._start = None
        self._faults = None

    def enter(self, mode: str) -> None:
        import defrag

        if mode == "install":
            defrag.install(self.pool)

    def start_timing(self, mode: str) -> None:
        from defrag import cpu_allocator

        self._start = cpu_allocator.counters() if mode == "install" else None
        self._faults = (mode, _minor_faults())

    def stop_timing(self) -> None:
        from defrag import cpu_allocator

        mode, before = self._faults
        self.faults[mode] += _minor_faults() - before
        if self._start is not None:
            now = cpu_allocator.counters()  # `blocks` is only there while installed
            for k in self.KEYS:
                self.sums[k] += now[k] - self._start[k]
        self._start = None

    def leave(self, mode: str) -> None:
        import defrag

        if mode == "install":
            defrag.uninstall()

    def take(self) -> dict:
        out, self.sums = dict(self.sums, faults=self.faults), dict.fromkeys(self.KEYS, 0)
        self.faults = {"install": 0, "plain": 0}
        return out


def _minor_faults() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _training(modes: _Modes, kind: str, spec: dict) -> dict:
    import gc
    import time

    built = {}
    for mode in ("install", "plain"):  # each copy made, warmed and stepped only under its own allocator
        modes.enter(mode)
        what, model, step = _model(kind)
        for _ in range(spec["warmup_steps"]):
            step()
        modes.leave(mode)
        built[mode] = (model, step)
    modes.take()
    times = {"install": [], "plain": []}
    block_medians = {"install": [], "plain": []}
    for b in range(spec["blocks"]):
        mode = ORDER[b % len(ORDER)]
        step = built[mode][1]
        gc.collect()
        modes.enter(mode)
        step()  # untimed: the first step after a switch
        modes.start_timing(mode)
        mine = []
        for _ in range(spec["steps"]):
            t0 = time.perf_counter()
            step()
            mine.append(time.perf_counter() - t0)
        modes.stop_timing()
        modes.leave(mode)
        times[mode] += mine
        block_medians[mode].append(statistics.median(mine))
    params = sum(p.numel() for p in built["plain"][0].parameters())
    return {"model": kind, "what": what, "parameters": params, "times": times, "block_medians": block_medians,
            "counters": modes.take()}


def _alloc_sizes(calls: int) -> list[int]:
    """The alloc+free rows' request sizes: `calls` draws from ALLOC_SIZES, seeded (the same on every side)."""
    import random

    rng = random.Random(ALLOC_SEED)
    return [rng.choice(ALLOC_SIZES) for _ in range(calls)]


def _alloc(modes: _Modes, pattern: str, spec: dict) -> dict:
    import gc
    import time

    import torch

    seq = _alloc_sizes(spec["calls"])
    empty, u8 = torch.empty, torch.uint8
    fast = modes.pool.core.fast

    if pattern == "python, round trip":
        def one_pass():
            for n in seq:
                t = empty(n, dtype=u8)
                del t
    elif pattern == "python, 32 live":
        def one_pass():
            slots = [None] * ALLOC_LIVE
            for i, n in enumerate(seq):
                slots[i % ALLOC_LIVE] = empty(n, dtype=u8)
            del slots
    elif pattern.startswith("C++ thread"):
        live = 1 if pattern.endswith("round trip") else ALLOC_LIVE

        def one_pass():
            seconds, failed, _ = fast.churn(seq, len(seq), live=live, native=False)
            if failed:
                raise RuntimeError(f"{failed} at::empty calls failed in a C++ thread")
            return seconds
    else:
        raise ValueError(pattern)

    for mode in ("install", "plain"):  # the pool maps what the mix needs over its first few passes
        modes.enter(mode)
        for _ in range(spec["alloc_warmup_passes"]):
            one_pass()
        modes.leave(mode)
    modes.take()
    seconds = {"install": [], "plain": []}
    for b in range(spec["alloc_blocks"]):
        mode = ORDER[b % len(ORDER)]
        gc.collect()
        modes.enter(mode)
        one_pass()  # untimed: the first pass after a switch
        modes.start_timing(mode)
        t0 = time.perf_counter()
        inner = one_pass()
        wall = time.perf_counter() - t0
        modes.stop_timing()
        modes.leave(mode)
        seconds[mode].append(inner if inner is not None else wall)  # the C++ thread times itself (steady_clock)
    return {"pattern": pattern, "calls": len(seq), "seconds": seconds, "counters": modes.take()}


ALLOC_PATTERNS = ("python, round trip", "python, 32 live", "C++ thread, round trip", "C++ thread, 32 live")


def _child_main() -> int:
    """The child: spec (JSON) on stdin, one JSON line on stdout."""
    import torch

    import defrag
    from defrag import cpu_allocator, fastpath

    spec = json.loads(sys.stdin.read())
    torch.set_num_threads(spec["threads"])
    fastpath.wait()
    out = {"threads": torch.get_num_threads(), "fast_path": fastpath.status(), "train": [], "alloc": []}
    with defrag.Pool(device="emulated", capacity=spec["capacity"], auto_compact=False) as pool:
        if pool.core.fast is None:
            print(json.dumps({"skip": f"the pool has no native fast path (fast path: {fastpath.status()}); "
                                      "defrag.install needs it"}))
            return 0
        modes = _Modes(pool)
        for kind in spec["models"]:
            out["train"].append(_training(modes, kind, spec))
        for pattern in spec["patterns"]:
            out["alloc"].append(_alloc(modes, pattern, spec))
        out["still_installed"] = cpu_allocator.installed() is not None
    print(json.dumps(out))
    return 0


# GPU rows: PyTorch's CUDA allocator cannot be swapped back once replaced, so each side runs in children
# of its own, in the order ORDER, and the rows compare the children side by side in time.
SEPARATE_FULL = {"children": 4, "blocks": 3, "steps": 20, "warmup_steps": 5, "calls": 5_000, "alloc_warmup_passes": 2}
SEPARATE_SMOKE = {"children": 2, "blocks": 1, "steps": 3, "warmup_steps": 1, "calls": 300, "alloc_warmup_passes": 1}
GPU_MLP = (4096, 8192, 256)  # width, hidden, batch: a step of a few ms on an H100-class GPU


def _separate_child_main() -> int:
    """One side of the GPU rows in a process of its own: spec (JSON) on stdin, one JSON line on stdout.

    `mode` "install": a pool installed before this process's first CUDA allocation (every CUDA tensor
    a pool block); "plain": PyTorch's caching allocator. `device` "emulated" rehearses the same code
    on the CPU (CPU tensors, the pool as PyTorch's CPU allocator).
    """
    import time

    import torch
    from torch import nn

    import defrag

    spec = json.loads(sys.stdin.read())
    device = spec["device"]
    tdev = "cpu" if device == "emulated" else device
    torch.set_num_threads(1)
    pool = None
    if spec["mode"] == "install":
        pool = defrag.Pool(device=device, capacity=spec["capacity"], auto_compact=False)
        defrag.install(pool)
    sync = (lambda: torch.cuda.synchronize(tdev)) if tdev != "cpu" else (lambda: None)
    width, hidden, batch = spec["mlp"]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width)).to(tdev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(batch, width, device=tdev)

    def step():
        opt.zero_grad(set_to_none=True)
        (model(x) - x).square().mean().backward()
        opt.step()

    seq = _alloc_sizes(spec["calls"])

    def alloc_pass():
        for n in seq:
            t = torch.empty(n, dtype=torch.uint8, device=tdev)
            del t
        sync()

    for _ in range(spec["warmup_steps"]):
        step()
    for _ in range(spec["alloc_warmup_passes"]):
        alloc_pass()
    sync()
    allocs_before = pool.stats()["num_allocs"] if pool is not None else 0
    step_s, alloc_s = [], []
    for _ in range(spec["blocks"]):
        for _ in range(spec["steps"]):
            t0 = time.perf_counter()
            step()
            sync()
            step_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        alloc_pass()
        alloc_s.append(time.perf_counter() - t0)
    out = {"mode": spec["mode"], "step_s": step_s, "alloc_s": alloc_s, "calls": len(seq),
           "pool_allocs": (pool.stats()["num_allocs"] - allocs_before) if pool is not None else 0,
           "parameters": sum(p.numel() for p in model.parameters())}
    print(json.dumps(out))
    return 0


def _bench_separate(device: str, smoke: bool) -> list[dict]:
    """The GPU rows (module doc): a training step and alloc+free under install against PyTorch's caching
    allocator, each side in its own children, A B B A. On "emulated": a CPU rehearsal of the same code."""
    import torch

    cfg = SEPARATE_SMOKE if smoke else SEPARATE_FULL
    if device == "emulated":
        capacity, mlp = 1 << 30, (256, 512, 32)
    else:
        free, _ = torch.cuda.mem_get_info(torch.device(device)) if torch.cuda.is_available() else (0, 0)
        if free < 4 << 30:
            raise Skip(f"{device} has {free >> 20} MiB free; the GPU rows need 4 GiB")
        capacity, mlp = min(free // 2, 16 << 30), GPU_MLP
    by_mode = {"install": [], "plain": []}
    for i in range(cfg["children"]):
        mode = ORDER[i % len(ORDER)]
        res = _run_child(dict(cfg, device=device, mode=mode, capacity=capacity, mlp=mlp), "_separate_child_main")
        if mode == "install" and res["pool_allocs"] == 0:
            raise RuntimeError("the installed pool made no block: the allocations did not reach it")
        by_mode[mode].append(res)
    where = "GPU" if device != "emulated" else "emulated rehearsal"
    baseline = "PyTorch's caching allocator" if device != "emulated" else "PyTorch's CPU allocator"
    timing = (f"perf_counter, synchronized; {cfg['children']} child processes alternating A B B A "
              f"(PyTorch's CUDA allocator cannot be swapped back in one process)")
    step_i = [statistics.median(r["step_s"]) for r in by_mode["install"]]
    step_p = [statistics.median(r["step_s"]) for r in by_mode["plain"]]
    alloc_i = [statistics.median(r["alloc_s"]) for r in by_mode["install"]]
    alloc_p = [statistics.median(r["alloc_s"]) for r in by_mode["plain"]]
    calls = by_mode["install"][0]["calls"]
    return [{
        "workload": f"training step ({where}): MLP {mlp[0]}-{mlp[1]}-{mlp[0]}, batch {mlp[2]}, Adam",
        "parameters": by_mode["install"][0]["parameters"],
        "method": "defrag.install(pool)", "baseline": baseline, "device": device,
        "ms": statistics.median(step_i) * 1e3, "baseline_ms": statistics.median(step_p) * 1e3,
        "ratio_x": statistics.median(step_i) / statistics.median(step_p),
        "median_pair_ratio_x": statistics.median(i / p for i, p in zip(step_i, step_p)),
        "pool_allocs": sum(r["pool_allocs"] for r in by_mode["install"]), "timing": timing,
    }, {
        "pattern": f"alloc+free ({where}), round trip",
        "sizes": f"{len(ALLOC_SIZES)} log-spaced, 16 B - 16 MiB",
        "method": "torch.empty + drop under defrag.install(pool)", "baseline": "torch.empty + drop, " + baseline,
        "device": device, "calls": calls,
        "ns_per_op": statistics.median(alloc_i) / calls * 1e9, "baseline_ns_per_op": statistics.median(alloc_p) / calls * 1e9,
        "ratio_x": statistics.median(alloc_i) / statistics.median(alloc_p),
        "median_pair_ratio_x": statistics.median(i / p for i, p in zip(alloc_i, alloc_p)),
        "timing": timing,
    }]


def _run_child(spec: dict, entry: str = "_child_main") -> dict:
    module = __spec__.name if __spec__ is not None else __name__
    return run_child(module, entry, spec, "the install benchmark's child process")


# --------------------------------------------------------------------------- rows


def _pair_ratios(by_mode: dict) -> list:
    """install / plain of each pair of blocks side by side in time (ORDER: blocks 0 and 1, 3 and 2, ...)."""
    return [i / p for i, p in zip(by_mode["install"], by_mode["plain"])]


def bench_install(device: str, smoke: bool) -> list[dict]:
    """Training steps and alloc+free under `defrag.install(pool)` vs PyTorch's CPU allocator (module doc)."""
    if device != "emulated":
        return _bench_separate(device, smoke)
    cfg = SMOKE if smoke else FULL
    spec = dict(cfg, threads=1, capacity=1 << 30, models=list(MODELS), patterns=list(ALLOC_PATTERNS))
    res = _run_child(spec)
    if "skip" in res:
        raise Skip(res["skip"])
    if res.get("still_installed"):
        raise RuntimeError("the child left its pool installed after the benchmark (uninstall failed)")
    rows = []
    goal = f"training step under install <= {TRAIN_GOAL_X:g}x plain (CPU; median of side-by-side block pairs)"
    for t in res["train"]:
        ti, tp = t["times"]["install"], t["times"]["plain"]
        med_i, med_p = statistics.median(ti), statistics.median(tp)
        ratio = med_i / med_p
        pairs = _pair_ratios(t["block_medians"])
        pair_ratio = statistics.median(pairs)
        c = t["counters"]
        rows.append({
            "workload": f"training step: {t['model']}",
            "model": t["what"],
            "parameters": t["parameters"],
            "method": "defrag.install(pool)",
            "baseline": "PyTorch's CPU allocator",
            "intra_op_threads": res["threads"],
            "steps": len(ti),
            "ms": med_i * 1e3,
            "best_ms": min(ti) * 1e3,
            "baseline_ms": med_p * 1e3,
            "baseline_best_ms": min(tp) * 1e3,
            "ratio_x": ratio,
            "best_ratio_x": min(ti) / min(tp),
            "median_pair_ratio_x": pair_ratio,
            "min_pair_ratio_x": min(pairs),
            "max_pair_ratio_x": max(pairs),
            "pool_blocks_per_step": c["blocks"] / len(ti),
            "page_faults_per_step": c["faults"]["install"] / len(ti),
            "baseline_page_faults_per_step": c["faults"]["plain"] / len(tp),
            "asked_python": c["asked"],
            "declined": c["declined"],
            "timing": f"perf_counter per step, blocks of {spec['steps']} alternating A B B A, "
                      f"median of {len(ti)} steps a side",
            "goal": goal,
            "goal_met": pair_ratio <= TRAIN_GOAL_X,
        })
    for a in res["alloc"]:
        si, sp = a["seconds"]["install"], a["seconds"]["plain"]
        n = a["calls"]
        med_i, med_p = statistics.median(si) / n * 1e9, statistics.median(sp) / n * 1e9
        c = a["counters"]
        live = ALLOC_LIVE if a["pattern"].endswith("32 live") else 1
        cpp = a["pattern"].startswith("C++")
        rows.append({
            "pattern": f"alloc+free, {a['pattern']}",
            "sizes": f"{len(ALLOC_SIZES)} log-spaced, 16 B - 16 MiB",
            "tensors_live": live,
            "method": ("at::empty" if cpp else "torch.empty") + " + drop under defrag.install(pool)",
            "baseline": ("at::empty" if cpp else "torch.empty") + " + drop, PyTorch's CPU allocator",
            "calls": n,
            "ns_per_op": med_i,
            "best_ns_per_op": min(si) / n * 1e9,
            "baseline_ns_per_op": med_p,
            "baseline_best_ns_per_op": min(sp) / n * 1e9,
            "ratio_x": med_i / med_p,
            "best_ratio_x": min(si) / min(sp),
            "median_pair_ratio_x": statistics.median(_pair_ratios(a["seconds"])),
            "diff_ns_per_op": med_i - med_p,
            "pool_blocks": c["blocks"],
            "page_faults_per_pass": c["faults"]["install"] / len(si),
            "baseline_page_faults_per_pass": c["faults"]["plain"] / len(sp),
            "asked_python": c["asked"],
            "declined": c["declined"],
            "timing": ("steady_clock in the C++ thread" if cpp else "perf_counter")
                      + f", passes alternating A B B A, median of {len(si)} passes a side",
        })
    return rows


def plot_install(rows, path) -> bool:
    from .runner import _pyplot, _save

    rows = [r for r in rows if "ratio_x" in r]
    if not rows:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    labels = [(r.get("workload") or r["pattern"]).replace("training step: ", "step: ").replace("alloc+free, ", "")
              for r in rows]
    colors = ["tab:blue" if "workload" in r else "tab:orange" for r in rows]
    ax.bar(range(len(rows)), [r["ratio_x"] for r in rows], color=colors)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(TRAIN_GOAL_X, color="tab:red", ls="--", lw=1, label=f"training goal {TRAIN_GOAL_X:g}x")
    ax.set_xticks(list(range(len(rows))), labels, rotation=25, ha="right", fontsize=7)
    ax.set_ylabel("install / plain")
    ax.set_title("under defrag.install vs PyTorch's CPU allocator (same run)", fontsize=9)
    ax.legend(fontsize=8)
    return _save(fig, path)


if __name__ == "__main__":  # python -m defrag.benchmarks.bench_install [--smoke]: rows as JSON lines
    for row in bench_install("emulated", "--smoke" in sys.argv[1:]):
        print(json.dumps(row))
