"""threads: several threads allocate, write and re-check their tensors while compactions run.

The workload behind both the stress test (`tests/cpu/test_threads.py`, a few
seconds in a subprocess) and `defrag bench --only threads` (longer):

- `workers` threads loop over `empty` + fill, `full` and `zeros`, keep up to
  `keep` tensors each, write them in place (`add_`), and re-check every
  element of every tensor they hold against the value they last wrote. On a
  small pool their allocations fail now and then and compact automatically
  (each moves only its own thread's tensors); every 50 steps a worker also
  compacts explicitly (its own tensors, while the others keep writing theirs).
- one more thread calls `pool.compact()` in a loop over tensors of its own,
  and now and then `pool.compact(threads="all")`, which must refuse
  (`ConcurrencyError`) while the workers run.

Reported: operations (allocations + writes + checks) per second,
compactions (automatic and explicit) and moved tensors per second, OOMs
(expected on a pool this small: the workload keeps it near full), and every
byte error or unexpected exception (there must be none).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
import traceback

import torch

KiB, MiB = 1 << 10, 1 << 20


def thread_stress(pool, *, workers: int = 4, seconds: float = 3.0, keep: int = 12, max_elems: int = 48 * 1024,
                  seed: int = 0) -> dict:
    """Run the workload on `pool` for `seconds`; returns counters and the errors seen (see module doc)."""
    import defrag

    deadline = time.perf_counter() + seconds
    lock = threading.Lock()
    totals = {"allocations": 0, "writes": 0, "checks": 0, "ooms": 0, "worker_compactions": 0,
              "refused_all": 0, "ran_all": 0, "errors": []}

    def note(key, n=1):
        with lock:
            totals[key] += n

    def fail(what):
        with lock:
            totals["errors"].append(what)

    def worker(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        held = []  # (tensor, expected value)
        step = 0
        try:
            while time.perf_counter() < deadline:
                step += 1
                n = rng.randint(256, max_elems)
                dtype = rng.choice((torch.float32, torch.int32))
                value = (index + 1) * 1000 + step % 997
                kind = rng.randrange(3)
                try:
                    if kind == 0:
                        t = pool.empty((n,), dtype=dtype)
                        t.fill_(value)
                    elif kind == 1:
                        t = pool.full((n,), value, dtype=dtype)
                    else:
                        t, value = pool.zeros((n,), dtype=dtype), 0
                except defrag.OutOfMemoryError:
                    note("ooms")
                    if held:
                        held.pop(rng.randrange(len(held)))
                    continue
                note("allocations")
                held.append((t, value))
                if len(held) > keep:
                    held.pop(rng.randrange(len(held)))
                # Write one tensor in place, then re-check every element of every tensor held.
                i = rng.randrange(len(held))
                t, v = held[i]
                t.add_(1)
                held[i] = (t, v + 1)
                note("writes")
                for t, v in held:
                    if not bool((t == v).all()):
                        bad = int((t != v).sum())
                        fail(f"worker {index}: {bad} of {t.numel()} elements differ from {v} "
                             f"(tensor at {t.data_ptr():#x})")
                note("checks", len(held))
                if step % 50 == 0:
                    pool.compact()  # this thread's own tensors, while the others keep writing theirs
                    note("worker_compactions")
        except Exception:
            fail(f"worker {index}: {traceback.format_exc()}")

    def compactor() -> None:
        mine = []
        try:
            while time.perf_counter() < deadline:
                try:
                    mine.append(pool.full((4096,), 7.0))
                except defrag.OutOfMemoryError:
                    pass
                if len(mine) > 6:
                    del mine[::2]
                pool.compact()
                try:
                    pool.compact(threads="all")  # runs only while every worker waits inside a pool call
                    note("ran_all")
                except defrag.ConcurrencyError:
                    note("refused_all")
                for t in mine:
                    if not bool((t == 7.0).all()):
                        fail("compactor thread: its own tensor changed")
                time.sleep(0.001)
        except Exception:
            fail(f"compactor: {traceback.format_exc()}")

    before = pool.stats()
    threads = [threading.Thread(target=worker, args=(i,), name=f"stress-worker-{i}") for i in range(workers)]
    threads.append(threading.Thread(target=compactor, name="stress-compactor"))
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    after = pool.stats()
    pool.check_invariants()
    totals.update(
        seconds=elapsed,
        workers=workers,
        automatic_compactions=after["num_compactions.automatic"] - before["num_compactions.automatic"],
        explicit_compactions=after["num_compactions.explicit"] - before["num_compactions.explicit"],
        moved_tensors=after["compaction.moved_tensors"] - before["compaction.moved_tensors"],
        moved_bytes=after["compaction.moved_bytes"] - before["compaction.moved_bytes"],
    )
    totals["operations"] = totals["allocations"] + totals["writes"] + totals["checks"]
    return totals


def stress_pool(device: str = "emulated", capacity: str = "6MiB", page_size: str = "256KiB"):
    """A pool small enough that the workload fills it: on the emulated device, one of its own with
    256 KiB pages (the default emulated device has 2 MiB); on a GPU, the device's own page size."""
    import defrag
    from defrag.driver import Driver

    if device == "emulated":
        cap = defrag.parse_size(capacity)
        driver = Driver.emulated(capacity=4 * cap, granularity=defrag.parse_size(page_size))
        return defrag.Pool(device=driver, capacity=cap)
    return defrag.Pool(device=device, capacity=max(defrag.parse_size(capacity), 32 * MiB))


def bench_threads(device: str, smoke: bool) -> list[dict]:
    """Operations, compactions and moved tensors per second under threads (no byte error allowed)."""
    rows = []
    for workers in ((2, 4) if smoke else (2, 4, 8)):
        seconds = 1.0 if smoke else 8.0
        with stress_pool(device) as pool:
            r = thread_stress(pool, workers=workers, seconds=seconds)
        rows.append({
            "workers": workers,
            "seconds": round(r["seconds"], 2),
            "ops_per_s": round(r["operations"] / r["seconds"]),
            "allocs_per_s": round(r["allocations"] / r["seconds"]),
            "compactions_per_s": round((r["automatic_compactions"] + r["explicit_compactions"]) / r["seconds"], 1),
            "automatic_compactions": r["automatic_compactions"],
            "moved_tensors_per_s": round(r["moved_tensors"] / r["seconds"], 1),
            "ooms": r["ooms"],
            "byte_errors": len(r["errors"]),
            "goal": "no byte error, no crash",
            "goal_met": not r["errors"],
        })
    return rows


def main(argv=None) -> int:
    """`python -m defrag.benchmarks.bench_threads`: one run, JSON on stdout; exit 1 on any error."""
    parser = argparse.ArgumentParser(description="thread stress on one pool (see the module docstring)")
    parser.add_argument("--device", default="emulated")
    parser.add_argument("--capacity", default="6MiB")
    parser.add_argument("--page-size", default="256KiB")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    with stress_pool(args.device, args.capacity, args.page_size) as pool:
        result = thread_stress(pool, workers=args.workers, seconds=args.seconds, seed=args.seed)
    print(json.dumps(result))
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
