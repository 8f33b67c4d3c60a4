"""Driver calls per replayed trace: what the page growth policy costs the driver, against stitching first.

Traces: the issue's serving trace (`defrag.traces.random_serving`, seed 0:
60,000 steps, about 61 GiB live at most) at an 80 GiB capacity, and each
snapshot in ``$DEFRAG_SNAPSHOTS`` (default ``/work/shared/snapshots``; a
missing folder or file is a skipped row with the reason) at the capacity
``defrag replay`` gives it (`defrag.replay.snapshot_capacity`). Smoke: the
serving trace at a tenth (6 GiB live, 8,000 steps) at 8 GiB, no snapshot.

Each trace is replayed dry (`defrag.dry.DryPool`: the pool's own core over
the memory-less driver, which counts every driver call; compaction at phase
markers and on a failed placement, as the ``defrag`` row of ``defrag replay
--dry``), twice in the same run:

- ``growth budget``: the pool's policy (`defrag.page_growth.GrowthPolicy`):
  new pages within 1.10 x (live + request), stitching beyond;
- ``stitch first`` (the baseline): `defrag.page_growth.StitchFirst`, the
  rule before the budget (empty pages elsewhere whenever cached ones fall
  short), everything else the same (windows, batched unmaps, idle donors).

Per row: the calls by name (``cuMemCreate``, ``cuMemMap``, ``cuMemUnmap``,
``cuMemSetAccess``, ``cuCtxSynchronize``), ``map_plus_unmap``, peak live and
peak reserved bytes and their ratio, and (policy rows) ``ratio_x``: the
baseline's maps + unmaps over the policy's. The serving trace's policy row
carries the issue's goals (maps + unmaps <= 113,337, a tenth of what main's
policy made; synchronizes <= 228; peak reserved <= 1.10 x peak live). What
main's code made on the same traces is in docs/benchmarks.md (measured from
its tree: this code cannot run it). Call counts do not depend on the
machine; ``seconds`` (the policy's replay, wall clock) does.
"""

from __future__ import annotations

import os
import time

from defrag import settings

GiB = 1 << 30
PAGE = 2 << 20
SNAPSHOTS = settings.snapshots() or "/work/shared/snapshots"
CALLS = ("cuMemCreate", "cuMemMap", "cuMemUnmap", "cuMemSetAccess", "cuCtxSynchronize")
GOAL_MAP_UNMAP = 113_337  # a tenth of main's 1,133,379 (issue 32)
GOAL_SYNCS = 228
GOAL_RATIO = 1.10


def _traces(smoke: bool) -> list[tuple[str, object, int, str | None]]:
    """(name, trace or None, capacity, skip reason) per trace."""
    from defrag.traces import random_serving

    if smoke:
        return [("random_serving (a tenth)", random_serving(steps=8000, live_limit=6 * GiB), 8 * GiB, None)]
    out = [("random_serving", random_serving(), 80 * GiB, None)]
    names = ["cs336_bcrafton_snapshot", "cs336_ctx128_fullstep", "cs336_medium_1024_inference",
             "eor_counterfactuals_snapshot", "select_n_gpt2_b_snapshot"]
    from defrag.replay import snapshot_capacity
    from defrag.traces.snapshot import load_snapshot_devices

    for name in names:
        path = os.path.join(SNAPSHOTS, name + ".pickle")
        if not os.path.exists(path):
            out.append((name, None, 0, f"{path} not found (set DEFRAG_SNAPSHOTS to the shared snapshots' folder)"))
            continue
        device = load_snapshot_devices(path)[0]
        capacity, _ = snapshot_capacity(device.recorded, device.ooms, device.trace)
        out.append((name, device.trace, capacity, None))
    return out


def _replay(trace, capacity: int, policy) -> tuple[dict, dict, float, int]:
    """(calls by name, stats, seconds, failed allocations) of one dry replay under `policy`."""
    from defrag.dry import DryPool
    from defrag.traces import ALLOC, FREE

    pool = DryPool(capacity, PAGE)
    pool.core.growth = policy
    failed, ooms = set(), 0
    t0 = time.perf_counter()
    for ev in trace.events:
        if ev[0] == ALLOC:
            if not pool.alloc(ev[1], ev[2]):
                failed.add(ev[1])
                ooms += 1
        elif ev[0] == FREE:
            if ev[1] in failed:
                failed.discard(ev[1])
            else:
                pool.free(ev[1])
        else:
            pool.compact()
    seconds = time.perf_counter() - t0
    stats = pool.stats()
    calls = {name: pool.driver.faults.calls.get(name, 0) for name in CALLS}
    pool.discard()
    return calls, stats, seconds, ooms


def bench_page_calls(device: str, smoke: bool) -> list[dict]:
    """Driver calls per trace under the growth policy and stitching first (see the module docstring)."""
    from defrag.page_growth import GrowthPolicy, StitchFirst

    rows = []
    for name, trace, capacity, skip in _traces(smoke):
        if trace is None:
            rows.append({"trace": name, "skipped": skip})
            continue
        measured = {}
        for label, policy in (("stitch first", StitchFirst()), ("growth budget", GrowthPolicy())):
            calls, stats, seconds, ooms = _replay(trace, capacity, policy)
            live, reserved = stats["allocated_bytes.all.peak"], stats["reserved_bytes.all.peak"]
            row = {"trace": name, "policy": label, "capacity_bytes": capacity, **calls,
                   "map_plus_unmap": calls["cuMemMap"] + calls["cuMemUnmap"], "peak_live_bytes": live,
                   "peak_reserved_bytes": reserved, "reserved_over_live": reserved / live if live else 1.0,
                   "ooms": ooms, "seconds": seconds, "device": "memoryless (dry)"}
            measured[label] = row
            rows.append(row)
        new, old = measured["growth budget"], measured["stitch first"]
        new["baseline"] = "stitch first"
        new["baseline_map_plus_unmap"] = old["map_plus_unmap"]
        new["ratio_x"] = old["map_plus_unmap"] / max(1, new["map_plus_unmap"])
        if name == "random_serving":
            rows.append({"trace": name, "policy": "growth budget",
                         "goal": f"maps + unmaps <= {GOAL_MAP_UNMAP:,}, synchronizes <= {GOAL_SYNCS}, peak reserved "
                                 f"<= {GOAL_RATIO:.2f} x peak live (issue 32)",
                         "map_plus_unmap": new["map_plus_unmap"], "cuCtxSynchronize": new["cuCtxSynchronize"],
                         "reserved_over_live": new["reserved_over_live"],
                         "goal_met": bool(new["map_plus_unmap"] <= GOAL_MAP_UNMAP
                                          and new["cuCtxSynchronize"] <= GOAL_SYNCS
                                          and new["peak_reserved_bytes"] <= GOAL_RATIO * new["peak_live_bytes"])})
    return rows
