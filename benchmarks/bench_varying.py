"""install_varying: a transformer trained on a different sequence length every step, under `defrag.install`.

The workload that sent 136 of every 1000 allocations of a GPT-2 step into the pool's Python code on
an H200: a decoder-sized transformer (GPU: d 768, 12 layers, 12 heads, vocab 50,257, GPT-2 small's
shapes, from `torch.nn`, built from seed 0), AdamW, about 16k tokens a step at a sequence length
drawn (seeded) from 64-1024, so tensor shapes change every step. Each allocator runs in a child
process of its own (PyTorch's CUDA allocator cannot be swapped back in a process):

- ``plain``: PyTorch's caching allocator; ``expandable``: the same with
  ``expandable_segments:True``; ``install``: the pool as PyTorch's CUDA allocator.
- After ``warmup_steps`` untimed steps, ``steps`` steps are timed one by one (synchronized). Each
  child reports the median step, peak reserved and peak allocated (the pool's `stats()` under
  install, `torch.cuda.max_memory_*` otherwise), and, under install, the allocations made and the
  trips to the pool's Python code over the timed steps (the CUDA entry's counters).
- Budget: the caching allocator again, capped (`set_per_process_memory_fraction`) at 1.05 x the
  pool's peak reserved, and the pool at that capacity; an OOM in a step is caught, counted and the
  run goes on (the step is skipped).

Rows: step time install / plain (goal <= 1.02), peak reserved install <= expandable segments',
trips to Python <= 1 per 1000 allocations after warm-up, and the budget row (install completes with
no OOM where plain OOMs). On the emulated device (no GPU) the same code is rehearsed with a small
model on CPU tensors (the pool as PyTorch's CPU allocator): plain and install only, no expandable
segments and no budget (a CPU allocator has no cap); only the trips goal (a count, not a time) is
judged there.
"""

from __future__ import annotations

import json
import statistics
import sys

from .runner import Skip, run_child

STEP_GOAL_X = 1.02
TRIPS_GOAL_PER_1000 = 1.0
BUDGET_OVER_POOL_PEAK = 1.05
GPU_MODEL = {"d": 768, "layers": 12, "heads": 12, "vocab": 50257, "tokens": 16384,
             "lengths": [64, 128, 192, 256, 384, 512, 768, 1024]}
CPU_MODEL = {"d": 64, "layers": 2, "heads": 4, "vocab": 1000, "tokens": 2048, "lengths": [32, 64, 96, 128, 192, 256]}
FULL = {"warmup_steps": 6, "steps": 24}
SMOKE = {"warmup_steps": 2, "steps": 3}


def _child_main() -> int:
    """One allocator's run in a process of its own: spec (JSON) on stdin, one JSON line on stdout."""
    import os
    import random
    import time

    spec = json.loads(sys.stdin.read())
    if spec["mode"] == "expandable":
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"  # before torch touches CUDA
    import torch
    from torch import nn

    import defrag
    from defrag import allocator_install, cpu_allocator

    device = spec["device"]
    tdev = "cpu" if device == "emulated" else device
    torch.set_num_threads(1)
    pool = None
    if spec["mode"] == "install":
        pool = defrag.Pool(device=device, capacity=spec["capacity"])
        defrag.install(pool)
    elif spec.get("budget") and tdev != "cpu":
        total = torch.cuda.get_device_properties(tdev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, spec["budget"] / total), tdev)
    sync = (lambda: torch.cuda.synchronize(tdev)) if tdev != "cpu" else (lambda: None)
    m = spec["model"]
    torch.manual_seed(0)
    model = nn.ModuleDict({
        "emb": nn.Embedding(m["vocab"], m["d"]),
        "layers": nn.TransformerEncoder(nn.TransformerEncoderLayer(m["d"], m["heads"], 4 * m["d"], dropout=0.0,
                                                                   batch_first=True, norm_first=True), m["layers"]),
        "head": nn.Linear(m["d"], m["vocab"])}).to(tdev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    lengths = random.Random(0)

    def step() -> bool:
        seq = lengths.choice(m["lengths"])
        x = torch.randint(0, m["vocab"], (max(1, m["tokens"] // seq), seq), device=tdev)
        try:
            logits = model["head"](model["layers"](model["emb"](x)))
            nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten()).backward()
            opt.step()
            return True
        except torch.OutOfMemoryError:
            return False
        finally:
            opt.zero_grad(set_to_none=True)

    def counters() -> dict:
        if pool is None:
            return {}
        if tdev == "cpu":
            c = cpu_allocator.counters()
            return {"allocs": c["blocks"], "asked": c["asked"]}
        c = allocator_install.installed(pool.device.index or 0).counters()
        return {"allocs": c["allocs"], "asked": c["asked"]}

    for _ in range(spec["warmup_steps"]):
        step()
    sync()
    before = counters()
    times, ooms = [], 0
    for _ in range(spec["steps"]):
        t0 = time.perf_counter()
        ok = step()
        sync()
        if ok:
            times.append(time.perf_counter() - t0)
        else:
            ooms += 1
    after = counters()
    if pool is not None:
        st = pool.stats()
        reserved, allocated = st["reserved_bytes.all.peak"], st["allocated_bytes.all.peak"]
    elif tdev != "cpu":
        reserved, allocated = torch.cuda.max_memory_reserved(tdev), torch.cuda.max_memory_allocated(tdev)
    else:
        reserved = allocated = 0  # PyTorch's CPU allocator keeps no such figures
    out = {"mode": spec["mode"], "step_s": times, "ooms": ooms, "peak_reserved": reserved,
           "peak_allocated": allocated, "parameters": sum(p.numel() for p in model.parameters())}
    if pool is not None:
        out.update(allocs=after["allocs"] - before["allocs"], asked=after["asked"] - before["asked"])
    print(json.dumps(out))
    return 0


def _run(spec: dict) -> dict:
    module = __spec__.name if __spec__ is not None else __name__
    return run_child(module, "_child_main", spec, f"the varying-length benchmark's {spec['mode']} child")


def bench_install_varying(device: str, smoke: bool) -> list[dict]:
    """The rows of the module docstring."""
    cfg = SMOKE if smoke else FULL
    gpu = device != "emulated"
    if gpu:
        import torch

        if not torch.cuda.is_available():
            raise Skip(f"{device}: torch sees no CUDA device")
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        if free < 48 << 30:
            raise Skip(f"{device} has {free >> 30} GiB free; the GPT-2-sized rows need 48 GiB")
        capacity, model = int(free * 0.9) // (2 << 20) * (2 << 20), GPU_MODEL
    else:
        capacity, model = 1 << 30, CPU_MODEL
    base = dict(cfg, device=device, model=model, capacity=capacity)
    runs = {mode: _run(dict(base, mode=mode)) for mode in (("plain", "expandable", "install") if gpu
                                                            else ("plain", "install"))}
    where = "GPU" if gpu else "emulated rehearsal, CPU tensors"
    what = (f"transformer d {model['d']}, {model['layers']} layers, vocab {model['vocab']}, AdamW; "
            f"{model['tokens']} tokens a step at lengths {model['lengths'][0]}-{model['lengths'][-1]} ({where})")
    median_ms = {k: statistics.median(r["step_s"]) * 1e3 if r["step_s"] else float("nan") for k, r in runs.items()}
    inst = runs["install"]
    trips = 1000 * inst["asked"] / max(inst["allocs"], 1)
    rows = [{
        "workload": what, "row": "step time", "method": "defrag.install(pool)",
        "baseline": "PyTorch's caching allocator" if gpu else "PyTorch's CPU allocator", "device": device,
        "ms": median_ms["install"], "baseline_ms": median_ms["plain"],
        "ratio_x": median_ms["install"] / median_ms["plain"],
        "expandable_ms": median_ms.get("expandable"),
        "steps": len(inst["step_s"]), "parameters": inst["parameters"],
        "goal": f"install <= {STEP_GOAL_X:g}x the caching allocator's step (GPU)",
        "goal_met": (median_ms["install"] / median_ms["plain"] <= STEP_GOAL_X) if gpu else None,
    }, {
        "workload": what, "row": "trips to Python after warm-up", "method": "defrag.install(pool)",
        "device": device, "allocations": inst["allocs"], "trips": inst["asked"], "trips_per_1000": trips,
        "goal": f"<= {TRIPS_GOAL_PER_1000:g} trip to the pool's Python code per 1000 allocations",
        "goal_met": trips <= TRIPS_GOAL_PER_1000,  # judged on the CPU too: the count, not a time
    }]
    if gpu:
        rows.append({
            "workload": what, "row": "peak reserved", "method": "defrag.install(pool)", "device": device,
            "peak_reserved_gib": inst["peak_reserved"] / 2**30, "peak_allocated_gib": inst["peak_allocated"] / 2**30,
            "expandable_peak_reserved_gib": runs["expandable"]["peak_reserved"] / 2**30,
            "plain_peak_reserved_gib": runs["plain"]["peak_reserved"] / 2**30,
            "goal": "install's peak reserved <= expandable segments'",
            "goal_met": inst["peak_reserved"] <= runs["expandable"]["peak_reserved"],
        })
        budget = int(inst["peak_reserved"] * BUDGET_OVER_POOL_PEAK) // (2 << 20) * (2 << 20)
        capped = _run(dict(base, mode="plain", budget=budget))
        pooled = _run(dict(base, mode="install", capacity=budget))
        rows.append({
            "workload": what, "row": f"under a budget of {budget / 2**30:.1f} GiB", "method": "defrag.install(pool)",
            "device": device, "ooms": pooled["ooms"], "baseline_ooms": capped["ooms"], "steps": cfg["steps"],
            "ms": statistics.median(pooled["step_s"]) * 1e3 if pooled["step_s"] else None,
            "goal": "where the caching allocator OOMs, install completes with no OOM",
            "goal_met": (pooled["ooms"] == 0) if capped["ooms"] else None,
        })
    return rows
