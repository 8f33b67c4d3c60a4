"""`defrag bench`: run the registered benchmarks, write results.json, results.md and PNG plots.

Every benchmark is a plain function ``bench(device, smoke) -> list[dict]``:
one dict per measurement, with units in the column names (``us_per_op``,
``gbps``, ``pages_per_ms``, ...), a ``baseline_*`` column where there is a
baseline, and the ratio to it computed in the same run. A row with ``goal``
(text) and ``goal_met`` (True, False, or None where the goal does not apply
to this device) states one of the issue's goals. A benchmark that cannot run
here raises `Skip` with the reason; rows that cannot be measured carry
``skipped`` with the reason instead of numbers.

The runner never invents figures: on the emulated device it labels every row
``emulated`` and GPU goals are reported as not applicable, not as met.

Timing helpers shared by the benchmark modules live here too
(`time_host`, `time_cuda`); see docs/benchmarks.md for what each number means.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path


class Skip(Exception):
    """Raised by a benchmark that cannot run on this machine; the message is the reason."""


# --------------------------------------------------------------------------- registry


@dataclasses.dataclass(frozen=True)
class Benchmark:
    """One registered benchmark: `target` and `plot` are "module:function" inside defrag.benchmarks."""

    name: str
    target: str
    what: str
    plot: str | None = None


REGISTRY: dict[str, Benchmark] = {b.name: b for b in [
    Benchmark("alloc_free", "bench_pool:bench_alloc_free",
              "alloc+free round trip: pool.empty vs torch.empty on the same device, same run (goal: pool <= 3x torch)",
              "bench_pool:plot_alloc_free"),
    Benchmark("alloc_mixed", "bench_pool:bench_alloc_mixed",
              "64 interleaved sizes (16 B - 1 MiB), about 32 live, ~20k calls: pool.empty + drop vs torch.empty + "
              "drop of the same sequence, warm and in the first 10k calls of a fresh process (issue 24's baseline; "
              "goal: pool <= 1.5x torch)",
              "bench_pool:plot_alloc_mixed"),
    Benchmark("copy_bandwidth", "bench_compaction:bench_copy_bandwidth",
              "one move of N bytes in pool memory: copy engine and move kernel vs the device's own copy "
              "(torch copy_ on a GPU, memmove on the emulated device)",
              "bench_compaction:plot_copy_bandwidth"),
    Benchmark("batched_launch", "runner:bench_batched_launch",
              "many small moves: one launch of the move kernel (the compactor's launcher on a GPU) vs one copy "
              "call per tensor (GPU goal: >= 10x)",
              "runner:plot_batched_launch"),
    Benchmark("engine_crossover", "bench_engines:bench_engine_crossover",
              "one move of N bytes: the move kernel (the compactor's launcher) vs the copy engine, and the "
              "smallest size from which the copy engine is as fast (what copying.COPY_ENGINE_MIN_BYTES should be)"),
    Benchmark("mixed_wave", "bench_engines:bench_mixed_wave",
              "a wave of 3,000 moves of log-uniform 64 KiB - 4 MiB through engine='auto' vs one contiguous copy of "
              "the same bytes (GPU goal: >= 0.8x)"),
    Benchmark("compaction_gpu", "bench_engines:bench_compaction_gpu",
              "8,710 tensors of log-uniform 64 KiB - 4 MiB, half dropped, pool.compact() (about 2 GB moved; GPU "
              "goal: < 20 ms), the same as a fresh process's first compaction (GPU goal: < 50 ms), and the "
              "automatic trigger serving a request; vs one copy of the moved bytes"),
    Benchmark("stitching", "bench_stitching:bench_stitching",
              "pages mapped per ms: one cuMemSetAccess per range vs per page; unmap; a stitched pool request",
              "bench_stitching:plot_stitching"),
    Benchmark("planner", "runner:bench_planner_adapter",
              "planner time vs live block count, 1k to 1M (goals: plan_arrays < 0.3 s at 100k, < 2 s at 1M)",
              "runner:plot_planner"),
    Benchmark("compaction", "bench_compaction:bench_compaction",
              "pool.compact() of a pool with 3 of 4 tensors per page freed, vs memmove (emulated) / torch copy_ "
              "(GPU) of the same moves, same run (goals: emulated >= 0.7x memmove; GPU copy >= 0.9x copy_)",
              "bench_compaction:plot_compaction"),
    Benchmark("compaction_overhead", "bench_compaction:bench_compaction_overhead",
              "3000 filled tensors of random sizes 8-256 KiB: dropping 70% and pool.compact(), beyond one memmove "
              "of the moved bytes, per tensor dropped or moved (emulated goal: <= 5 us)"),
    Benchmark("compaction_random", "bench_compaction:bench_compaction_random",
              "pool.compact() vs one memmove of the moved bytes on 512 tensors of random sizes 64 KiB - 1 MiB, 70% "
              "dropped (emulated goal: >= 0.7x)"),
    Benchmark("rescue", "bench_rescue:bench_rescue",
              "automatic trigger on random adversarial traces: OOMs that compaction could make room for "
              "(live + request <= capacity - pinned pages), and how many it rescued"),
    Benchmark("threads", "bench_threads:bench_threads",
              "several threads allocate (empty, full, zeros), write and re-check every element of their tensors "
              "while automatic and explicit compactions run: operations, compactions and moved tensors per second "
              "(goal: no byte error, no crash)"),
    Benchmark("sleep", "bench_sleep:bench_sleep",
              "pool.sleep()/wake() and offload()/reload() in seconds per GiB vs a host copy of the same bytes in the "
              "same run (torch copy_ to pinned host memory on a GPU, a CPU copy_ on the emulated device)",
              "bench_sleep:plot_sleep"),
    Benchmark("mesh", "bench_mesh:bench_mesh",
              "pinned tensors of random sizes, 25/50/75% of their bytes dropped in random order: physical pages held "
              "before and after pool.mesh() against the lower bound (live bytes in whole pages), bytes copied and "
              "time per freed page",
              "bench_mesh:plot_mesh"),
    Benchmark("install", "bench_install:bench_install",
              "defrag.install(pool) (emulated device: the pool as PyTorch's CPU allocator) vs PyTorch's own, in a "
              "child process, same run: a torch.nn training step (MLP, transformer layer, conv net; goal: install "
              "<= 1.1x plain) and ns per torch.empty / at::empty + drop over 48 sizes (16 B - 16 MiB)",
              "bench_install:plot_install"),
    Benchmark("install_varying", "bench_varying:bench_install_varying",
              "a transformer trained on a different sequence length every step (GPU: GPT-2 small's shapes, 16k "
              "tokens a step) under defrag.install vs the caching allocator and expandable segments, each in a "
              "child process: step time (goal: <= 1.02x), peak reserved (goal: <= expandable's), trips to the "
              "pool's Python code after warm-up (goal: <= 1 per 1000 allocations), and a budget where the caching "
              "allocator OOMs (goal: install completes); on the emulated device a CPU rehearsal"),
    Benchmark("workloads", "bench_workloads:bench_workloads",
              "trace replays with compaction on/off (and PyTorch's allocator on a GPU): peak live, peak reserved, "
              "OOMs (goal: peak reserved <= 1.02x peak live + one page at the smallest capacity that completes)",
              "bench_workloads:plot_workloads"),
    Benchmark("owner_match", "bench_torch_moves:bench_owner_match",
              "the owner match at a safe point (defrag.owners: which storage owns each PyTorch-made block) with "
              "10k and 100k live tensors among 200k other objects (goal at 100k: <= 50 ms)"),
    Benchmark("op_rescue", "bench_torch_moves:bench_op_rescue",
              "defrag run --rescue's happy path per operation: 100k small ops plain, under the C++ dispatcher "
              "fallback, and under a Python TorchDispatchMode (goal: the fallback <= 1 us over plain)"),
    Benchmark("compact_at_step", "bench_torch_moves:bench_compact_at_step",
              "transformers' GPT-2 trained 20 steps (AdamW, varying lengths): python, defrag run, --compact-at step "
              "and a compaction every step: losses bit-identical, PyTorch's tensors moved, and the hook's cost on a "
              "step that needs none (goal: <= 1% of the step)"),
    Benchmark("serving", "bench_torch_moves:bench_serving",
              "a serving loop of transformers' generate keeping conversations' KV caches and dropping them out of "
              "order: the smallest capacity that completes under defrag run with --rescue and without (goal: "
              "lower with moves, tokens identical)"),
    Benchmark("page_calls", "bench_page_calls:bench_page_calls",
              "driver calls per dry replay (the serving trace at 80 GiB, the shared snapshots): maps, unmaps, "
              "SetAccess, synchronizes under the growth policy vs stitching first, same run (goals, serving "
              "trace: maps + unmaps <= 113,337, synchronizes <= 228, peak reserved <= 1.10x peak live)"),
]}


def child_command(code: str) -> tuple[list[str], dict]:
    """argv and environment for `python -c code` in a child that imports the same defrag (and
    defrag.benchmarks) as this process: this process's sys.path as PYTHONPATH and, where this process
    found the checkout through `_bare_checkout.py`'s finder (the GPU check's stages: nothing
    pip-installed, so the checkout is on no path a child would search), that finder installed first."""
    import os
    import sys

    prelude = ""
    for finder in sys.meta_path:
        if type(finder).__name__ == "CheckoutFinder":
            root = str(finder.root)
            prelude = (f"import sys\nsys.path.insert(0, {os.path.join(root, 'benchmarks')!r})\n"
                       f"import _bare_checkout\n_bare_checkout.install({root!r})\n")
            break
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return [sys.executable, "-c", prelude + code], env


def run_child(module: str, entry: str, spec: dict, what: str, timeout: float = 900) -> dict:
    """Run `module.entry()` in a child (`child_command`) with `spec` as JSON on its stdin, and return the
    JSON of its last stdout line. RuntimeError naming `what` (with the end of its stderr) if it fails."""
    import json
    import subprocess

    argv, env = child_command(f"import importlib, sys\nsys.exit(importlib.import_module({module!r}).{entry}())\n")
    proc = subprocess.run(argv, input=json.dumps(spec), capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (rc {proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _resolve(spec: str):
    module, _, attr = spec.partition(":")
    mod = importlib.import_module(f"{__package__}.{module}" if __package__ else module)
    return getattr(mod, attr)


# --------------------------------------------------------------------------- device


def resolve_device(spec: str | None) -> str:
    """'cuda:N' when asked for (or by default when a GPU works), else 'emulated'."""
    from defrag.driver import cuda_driver_usable

    if spec in (None, "", "auto"):
        ok, _ = cuda_driver_usable()
        if ok:
            import torch

            if torch.cuda.is_available():
                return "cuda:0"
        return "emulated"
    text = "cuda:0" if str(spec) == "cuda" else str(spec)
    if text == "emulated":
        return text
    if text.startswith("cuda:") and text[5:].isdigit():
        ok, reason = cuda_driver_usable()
        if not ok:
            raise ValueError(f"device {text} was asked for but no GPU is usable here ({reason}); "
                             "use --device emulated")
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"device {text} was asked for but torch.cuda.is_available() is False "
                             f"(torch {torch.__version__})")
        return text
    raise ValueError(f"unknown device {spec!r}: expected 'emulated', 'cuda' or 'cuda:N'")


def prepare_simulator() -> None:
    """Turn on numba's CUDA simulator when no CUDA driver works, before numba.cuda is imported.

    On a machine with a GPU the variable is left alone: kernels run for real,
    and kernel rows on the emulated device (host memory) are skipped.
    """
    if "NUMBA_ENABLE_CUDASIM" in os.environ or "numba.cuda" in sys.modules:
        return
    from defrag.driver import cuda_driver_usable

    if not cuda_driver_usable()[0]:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"


def kernel_skip_reason(device: str) -> str | None:
    """Why defrag.kernels cannot run over this device's memory here (None: they can)."""
    try:
        import defrag.kernels as dk

        sim = dk.is_simulator()
    except Exception as exc:  # numba missing or broken: say so in the row
        return f"defrag.kernels unusable: {exc.__class__.__name__}: {exc}"
    if device.startswith("cuda"):
        return "numba.cuda is the CPU simulator (NUMBA_ENABLE_CUDASIM is set)" if sim else None
    if not sim:
        return ("numba.cuda is a real GPU here, and the emulated device's memory is host memory: "
                "kernels over it need the simulator (run with NUMBA_ENABLE_CUDASIM=1)")
    return None


def machine_info(device: str) -> dict:
    """What ran the benchmarks: versions, device, CPU, date."""
    import numpy
    import torch

    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        "emulated": not device.startswith("cuda"),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "numba_cudasim": os.environ.get("NUMBA_ENABLE_CUDASIM", "") == "1",
        # Other processes share the CPU: the load says how much (timings on a loaded machine are noisier).
        "loadavg_1min_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    for dist in ("defrag", "numba", "numba-cuda", "cuda-python"):
        info[dist.replace("-", "_")] = _version(dist)
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        info["device_name"] = props.name
        info["device_memory_bytes"] = int(props.total_memory)
        info["device_sm_count"] = int(props.multi_processor_count)
        info["cuda_runtime"] = torch.version.cuda
    else:
        from defrag.driver import default_emulated_driver

        drv = default_emulated_driver()
        info["device_name"] = f"emulated ({drv.name}) on {info['cpu']}"
        info["device_memory_bytes"] = int(drv.api.capacity)
        info["granularity_bytes"] = int(drv.granularity)
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


# --------------------------------------------------------------------------- timing


@dataclasses.dataclass
class Timing:
    """Seconds per call: best and median over repeats (each repeat averages `number` calls)."""

    best: float
    median: float
    repeats: int
    number: int

    @property
    def best_us(self) -> float:
        return self.best * 1e6

    @property
    def median_us(self) -> float:
        return self.median * 1e6


def time_host(fn, *, number: int = 1, repeat: int = 5, warmup: int = 1, setup=None) -> Timing:
    """Wall-clock (time.perf_counter) seconds per call of fn().

    `warmup` untimed calls first; then `repeat` times: `setup()` (untimed, if
    given), `number` calls timed together. Host work only: on a GPU the caller
    synchronizes inside fn if device work must be included.
    """
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    samples = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - t0) / number)
    return Timing(min(samples), statistics.median(samples), repeat, number)


def time_host_interleaved(fns: dict, *, number: int = 1, repeat: int = 5, warmup: int = 1) -> dict:
    """`time_host` for several functions at once, sampled in turn (A, B, A, B, ...).

    On a shared or throttling machine, load changes then hit every function
    alike, so ratios between them are fairer than from back-to-back runs.
    Returns {name: Timing}.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(number):
                fn()
            samples[name].append((time.perf_counter() - t0) / number)
    return {name: Timing(min(s), statistics.median(s), repeat, number) for name, s in samples.items()}


def time_cuda(fn, *, number: int = 10, repeat: int = 5, warmup: int = 3) -> Timing:
    """Device seconds per call of fn() on torch's current stream, by torch.cuda.Event pairs.

    Warm-up, synchronize, then `repeat` samples of `number` back-to-back calls
    between two events; best and median of the samples.
    """
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(number):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e-3 / number)
    return Timing(min(samples), statistics.median(samples), repeat, number)


def device_pool(device: str, capacity: int):
    """A pool of `capacity` bytes on `device`, automatic compaction off: on a GPU its own, else on a fresh
    emulated device twice its size with 2 MiB pages (so the device never runs out before the pool)."""
    import defrag
    from defrag.driver import Driver

    if device.startswith("cuda"):
        return defrag.Pool(device=device, capacity=capacity, auto_compact=False)
    drv = Driver.emulated(capacity=2 * capacity, granularity=2 << 20)
    return defrag.Pool(device=drv, capacity=capacity, auto_compact=False)


def device_sync(device: str) -> None:
    """Wait for the GPU's queued work (nothing to wait for on the emulated device)."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def gbps(nbytes: int, seconds: float) -> float | None:
    """Payload gigabytes (1e9 bytes) per second."""
    return nbytes / seconds / 1e9 if seconds and seconds > 0 else None


# --------------------------------------------------------------------------- adapters for modules owned elsewhere


def bench_batched_launch(device: str, smoke: bool) -> list[dict]:
    """bench_kernels.bench_batched_vs_per_tensor, with a baseline column and the speedup.

    GPU: 10,000 scattered moves of 4 KiB (100 in smoke mode): ONE launch of the
    move kernel through the compactor's launcher (`kernels.launch`) vs torch
    ``copy_`` per tensor, by CUDA events. Emulated: both sides
    run under numba's simulator (64 x 512 B, 8 in smoke mode); the ratio then
    says how much per-launch overhead the simulator has, nothing about a GPU.
    """
    reason = kernel_skip_reason(device)
    if reason:
        raise Skip(reason)
    from . import bench_kernels

    kdev = device if device.startswith("cuda") else "simulator"
    raw = bench_kernels.bench_batched_vs_per_tensor(kdev, smoke=smoke)
    if any("skipped" in r for r in raw):
        raise Skip("; ".join(r["skipped"] for r in raw if "skipped" in r))
    batched = next(r for r in raw if r["launches"] == 1)
    per = next(r for r in raw if r["launches"] != 1)
    gpu = device.startswith("cuda")
    speedup = per["ms"] / batched["ms"] if batched["ms"] else None
    return [{
        "backend": batched["backend"],
        "moves": batched["n_moves"],
        "move_bytes": batched["move_bytes"],
        "method": batched["method"],
        "ms": batched["ms"],
        "baseline": per["method"],
        "baseline_ms": per["ms"],
        "speedup_x": speedup,
        "host_ms": batched.get("host_ms"),
        "baseline_host_ms": per.get("host_ms"),
        "timing": "cuda events, mean of iters" if gpu else "perf_counter, simulator",
        "goal": "batched >= 10x faster than per-tensor copy_ (GPU)",
        "goal_met": (speedup >= 10) if gpu and speedup is not None else None,
    }]


PLANNER_COUNTS = (1_000, 10_000, 100_000, 1_000_000)
PLANNER_SMOKE_COUNTS = (1_000, 10_000)


def bench_planner_adapter(device: str, smoke: bool) -> list[dict]:
    """bench_planner.bench_planner (pure Python: the device does not matter), plus the 100k goal."""
    try:
        from .bench_planner import bench_planner
    except ImportError as exc:
        raise Skip(f"benchmarks/bench_planner.py is not available ({exc})") from None
    counts = PLANNER_SMOKE_COUNTS if smoke else PLANNER_COUNTS
    rows = [dict(r, timing="perf_counter, best of 3") for r in bench_planner(block_counts=counts, seed=0, smoke=smoke)]
    # `seconds_arrays` and `seconds` are the same figure: plan_arrays, what the compactor runs.
    goals = {100_000: 0.3, 1_000_000: 2.0}
    for r in rows:
        if r["blocks"] in goals and "seconds_arrays" in r:
            limit = goals[r["blocks"]]
            r["goal"] = f"plan_arrays < {limit} s at {r['blocks'] // 1000}k live blocks"
            r["goal_met"] = r["seconds_arrays"] < limit
    return rows


def plot_batched_launch(rows, path) -> bool:
    rows = [r for r in rows if "ms" in r]
    if not rows:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.2))
    r = rows[0]
    ax.bar([r["method"], r["baseline"]], [r["ms"], r["baseline_ms"]], color=["tab:blue", "tab:gray"])
    ax.set_ylabel("ms (all moves)")
    ax.set_title(f"{r['moves']} moves of {r['move_bytes']} B ({r['backend']}): {r['speedup_x']:.1f}x", fontsize=9)
    return _save(fig, path)


def plot_planner(rows, path) -> bool:
    pts = sorted((r["blocks"], r["seconds"]) for r in rows if "seconds" in r)
    if not pts:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.loglog([p[0] for p in pts], [p[1] for p in pts], "o-", label="plan time")
    ax.axhline(0.5, color="tab:red", ls="--", lw=1, label="goal at 100k: 0.5 s")
    ax.axvline(100_000, color="tab:red", ls=":", lw=1)
    ax.set_xlabel("live blocks")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=8)
    return _save(fig, path)


# --------------------------------------------------------------------------- plotting helpers


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path) -> bool:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    _pyplot().close(fig)
    return True


# --------------------------------------------------------------------------- output


def _fmt(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "**no**"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        if value == 0:
            return "0"
        mag = abs(value)
        if mag >= 1e5:
            return f"{value:,.0f}"
        if mag >= 100:
            return f"{value:.1f}"
        if mag >= 0.01:
            return f"{value:.3g}"
        return f"{value:.3e}"
    if isinstance(value, int) and abs(value) >= 10_000:
        return f"{value:,}"
    return str(value).replace("|", "\\|")


def _table(rows: list[dict]) -> list[str]:
    cols: list[str] = []
    for r in rows:
        for k in r:
            if k not in cols and k not in ("goal", "goal_met"):
                cols.append(k)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |")
    return lines


GOAL_LABEL_KEYS = ("workload", "method", "pattern", "size_bytes", "blocks", "moves", "workers", "backend")


def _num(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _g(value: float) -> str:
    """Three significant digits, without an exponent: "0.874", "12.3", "1,650"."""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def _x(value: float) -> str:
    return f"{_g(value)}x"


# What a goal row is judged on, as the summary and results.md show it beside the verdict: the first entry
# whose keys the row holds (numbers, or booleans where a key is a yes/no), and whose goal text, where
# `when` is given, holds that word. The order matters where a row holds several figures: install's train
# rows are judged on the median of side-by-side pairs, not `ratio_x`; compaction_gpu's on its ms, not the
# ratio to one copy; a workload on the ratio at the smallest capacity that completes.
_GOAL_FIGURES: tuple = (
    (("reserved_over_live_at_min_capacity_x",), None,
     lambda r: f"reserved/live {_x(r['reserved_over_live_at_min_capacity_x'])} at the smallest capacity"),
    (("map_plus_unmap", "cuCtxSynchronize", "reserved_over_live"), None,
     lambda r: f"maps + unmaps {r['map_plus_unmap']:,}, synchronizes {r['cuCtxSynchronize']:,}, reserved/live "
               f"{_x(r['reserved_over_live'])}"),
    (("median_pair_ratio_x",), None, lambda r: f"{_x(r['median_pair_ratio_x'])} (median of pairs)"),
    (("peak_reserved_gib", "expandable_peak_reserved_gib"), None,
     lambda r: f"peak reserved {_g(r['peak_reserved_gib'])} GiB, expandable segments' "
               f"{_g(r['expandable_peak_reserved_gib'])} GiB"),
    (("ooms", "baseline_ooms"), None, lambda r: f"OOMs {r['ooms']}, the caching allocator's {r['baseline_ooms']}"),
    (("trips_per_1000",), None, lambda r: f"{_g(r['trips_per_1000'])} trips per 1000 allocations"),
    (("byte_errors",), None, lambda r: f"{r['byte_errors']} byte error{'' if r['byte_errors'] == 1 else 's'}"),
    (("us_per_tensor",), None, lambda r: f"{_g(r['us_per_tensor'])} us per tensor"),
    (("seconds_arrays",), None, lambda r: f"{_g(r['seconds_arrays'])} s"),
    (("ms",), " ms", lambda r: f"{_g(r['ms'])} ms"),
    (("ratio_x",), None, lambda r: _x(r["ratio_x"])),
    (("speedup_x",), None, lambda r: _x(r["speedup_x"])),
)
_YES_NO = {"served": ("served", "NOT served"), "bytes_ok": ("every byte kept", "bytes LOST")}


def goal_figure(row: dict) -> str | None:
    """The figure a goal row is judged on, in words ("1.32x", "4.1 us per tensor", ...); None when the row
    holds none (a benchmark that failed to measure, or a goal of yes/no answers only)."""
    goal = str(row.get("goal", ""))
    for keys, when, show in _GOAL_FIGURES:
        if all(_num(row.get(k)) for k in keys) and (when is None or when in goal):
            return show(row)
    answers = [_YES_NO[k][0 if row[k] else 1] for k in _YES_NO if isinstance(row.get(k), bool)]
    return ", ".join(answers) or None


def goals_of(results: dict) -> list[dict]:
    """Every goal of every benchmark: name, goal, met (True/False/None), the row's label (`where`) and
    the figures it was judged on (`figures`, `goal_figure` of each row; [] where none).

    Rows that no label key tells apart state one goal, listed once: not met if any of them is not
    met, else met if any is, else not applicable here (None).
    """
    out: list[dict] = []
    seen: dict[tuple, dict] = {}
    for name, res in results["benchmarks"].items():
        for r in res.get("rows", []):
            if "goal" in r:
                label = ", ".join(f"{k}={_fmt(r[k])}" for k in GOAL_LABEL_KEYS if k in r)
                met = r.get("goal_met")
                key = (name, r["goal"], label)
                figure = goal_figure(r)
                if key in seen:
                    g = seen[key]
                    both = (g["met"], met)
                    g["met"] = False if False in both else (True if True in both else None)
                    if figure is not None and figure not in g["figures"]:
                        g["figures"].append(figure)
                    continue
                seen[key] = {"benchmark": name, "goal": r["goal"], "met": met, "where": label,
                             "figures": [figure] if figure is not None else []}
                out.append(seen[key])
    return out


def write_markdown(results: dict, path: Path) -> None:
    m = results["machine"]
    kind = "emulated device" if m["emulated"] else "GPU"
    lines = [
        "# defrag benchmark results",
        "",
        f"- {kind}: **{m['device_name']}** (`{m['device']}`)",
        f"- date {m['date']}; {'smoke' if results['smoke'] else 'full'} run; "
        f"{m['cpus_usable']} usable CPU cores ({m['cpu']}); 1-min load average "
        f"{_fmt(m.get('loadavg_1min_at_start'))} at start, {_fmt(m.get('loadavg_1min_at_end'))} at end",
        f"- torch {m['torch']}, numba {m['numba']} (CUDA simulator {'on' if m['numba_cudasim'] else 'off'}), "
        f"python {m['python']}",
        f"- total {results['seconds']:.1f} s",
    ]
    if results["smoke"]:
        lines.append(f"- **{SMOKE_NOTE}.**")
    if m["emulated"]:
        lines.append("- No GPU figures here: every number below was measured on the emulated device "
                     "(host memory; kernels, where present, under numba's CPU simulator).")
    goals = goals_of(results)
    if goals:
        lines += ["", "## Goals", "", "| benchmark | goal | where | measured | met |", "|---|---|---|---|---|"]
        for g in goals:
            v = verdict(g["met"], results["smoke"])
            met = {"met": "yes", "NOT met": "**no**"}.get(v, v)
            measured = "; ".join(g.get("figures") or [] if g["met"] is not None else []).replace("|", "\\|")
            lines.append(f"| {g['benchmark']} | {g['goal']} | {g['where']} | {measured} | {met} |")
    for name, res in results["benchmarks"].items():
        lines += ["", f"## {name}", "", res["what"], ""]
        if res["status"] == "skipped":
            lines.append(f"Skipped: {res['reason']}")
            continue
        if res["status"] == "error":
            lines += ["Error:", "", "```", res["error"].rstrip(), "```"]
            continue
        lines += _table(res["rows"])
        if res.get("plot"):
            lines += ["", f"![{name}]({res['plot']})"]
        lines.append("")
        lines.append(f"({res['seconds']:.1f} s)")
    path.write_text("\n".join(lines) + "\n")


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and (math.isnan(obj) or math.isinf(obj)):
        return None
    if hasattr(obj, "item") and callable(obj.item):  # numpy / torch scalars
        return obj.item()
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


# --------------------------------------------------------------------------- running


def run(names=None, *, device=None, smoke: bool = False, out="bench-out", progress: bool = True) -> dict:
    """Run benchmarks (all, or `names`) and write results.json, results.md and plots into `out`.

    Returns the results dict. A benchmark that raises is recorded with its
    traceback (status "error") and the others still run.
    """
    prepare_simulator()
    device = resolve_device(device)
    names = list(REGISTRY) if not names else list(names)
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        raise ValueError(f"unknown benchmark(s) {unknown}; registered: {', '.join(REGISTRY)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"machine": machine_info(device), "smoke": bool(smoke), "benchmarks": {}}
    t_all = time.perf_counter()

    from tqdm.auto import tqdm

    bar = tqdm(names, desc="defrag bench", unit="bench", disable=not progress, file=sys.stderr)
    for name in bar:
        bar.set_postfix_str(name)
        bench = REGISTRY[name]
        res = {"what": bench.what, "status": "ok", "rows": [], "seconds": 0.0}
        t0 = time.perf_counter()
        try:
            res["rows"] = list(_resolve(bench.target)(device, smoke))
            if not res["rows"]:
                res.update(status="skipped", reason="the benchmark returned no rows")
        except Skip as exc:
            res.update(status="skipped", reason=str(exc))
        except Exception:  # keep going: one broken benchmark must not hide the others
            res.update(status="error", error=traceback.format_exc())
        res["seconds"] = time.perf_counter() - t0
        if res["status"] == "ok" and bench.plot:
            png = out / f"{name}.png"
            try:
                if _resolve(bench.plot)(res["rows"], png):
                    res["plot"] = png.name
            except Exception:
                res["plot_error"] = traceback.format_exc()
        results["benchmarks"][name] = res
    bar.close()
    results["seconds"] = time.perf_counter() - t_all
    if hasattr(os, "getloadavg"):
        results["machine"]["loadavg_1min_at_end"] = os.getloadavg()[0]
    results = _jsonable(results)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    write_markdown(results, out / "results.md")
    return results


SMOKE_NOTE = ("smoke run: tiny sizes and repeats; figures are for checking the runner, not for judging goals "
              "(goal verdicts read 'not judged (smoke)')")


def verdict(met, smoke: bool) -> str:
    """How a goal row reads: met / NOT met / n/a here, and 'not judged (smoke)' for any figure of a smoke run."""
    if met is None:
        return "n/a here"
    if smoke:
        return "not judged (smoke)"
    return "met" if met else "NOT met"


def summary_lines(results: dict) -> list[str]:
    """What `defrag bench` prints: each benchmark's time and rows, then each goal with the figure it was
    judged on beside its verdict ("measured 1.32x, met"; no figure where the goal does not apply here)."""
    from defrag.stats import counted

    smoke = bool(results.get("smoke"))
    lines = [f"  {SMOKE_NOTE}"] if smoke else []
    width = max([15, *map(len, results["benchmarks"])])
    for name, res in results["benchmarks"].items():
        state = {"ok": counted(len(res["rows"]), "row"), "skipped": f"skipped: {res.get('reason')}",
                 "error": "ERROR (see results.md)"}[res["status"]]
        lines.append(f"  {name:<{width}} {res['seconds']:6.1f} s  {state}")
    for g in goals_of(results):
        figures = g.get("figures") if g["met"] is not None else None
        measured = f"measured {'; '.join(figures)}, " if figures else ""
        where = f" ({g['where']})" if g["where"] else ""
        lines.append(f"  goal [{g['benchmark']}] {g['goal']}{where}: {measured}{verdict(g['met'], smoke)}")
    return lines


def main(args) -> int:
    """Entry point of `defrag bench` (args: smoke, device, out, only).

    Arguments are checked before any benchmark runs; a bad one raises
    `defrag.cli.UsageError` (one line on stderr, exit code 2).
    """
    from defrag.arguments import UsageError, device_arg, device_label, out_dir_arg

    only = [n.strip() for n in (args.only or "").split(",") if n.strip()] or None
    unknown = [n for n in only or () if n not in REGISTRY]
    if unknown:
        raise UsageError(f"--only: unknown benchmark(s) {', '.join(unknown)}; registered: {', '.join(REGISTRY)}")
    out_dir_arg(args.out)
    device = args.device
    if device not in (None, "", "auto"):
        device = device_label(device_arg(device, torch_cuda=True))
    try:
        results = run(only, device=device, smoke=args.smoke, out=args.out)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    m = results["machine"]
    print(f"defrag bench ({'smoke' if results['smoke'] else 'full'}) on {m['device_name']}: "
          f"{results['seconds']:.1f} s; results in {Path(args.out).resolve()}")
    print("\n".join(summary_lines(results)))
    return 1 if any(r["status"] == "error" for r in results["benchmarks"].values()) else 0


if __name__ == "__main__":  # python -m defrag.benchmarks.runner [--smoke] [--device D] [--out DIR] [--only a,b]
    from defrag.cli import main as cli_main

    sys.exit(cli_main(["bench", *sys.argv[1:]]))
