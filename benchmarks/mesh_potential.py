"""How many physical pages meshing could free when nothing can move (issue 26): measured, not built.

Under ``defrag.install`` PyTorch owns every block by raw pointer, so the pool
never moves one: the pool runs as ``defrag-no-compaction`` (``auto_compact``
off, phase markers ignored). This script replays workloads exactly that way,
dry (`defrag.dry.DryPool`: the pool's own core over the memory-less driver),
and at a few points (the peak of reserved bytes, and evenly spaced events)
reads the pool's layout: every live block (address, rounded size, region)
and every mapped page. Each page holding live data gets an occupancy bitmap
at 512 B granularity (the pool's alignment; a block straddling a page
boundary occupies its piece of each page). Pages whose bitmaps do not
overlap could share one physical page with every virtual address kept
(Mesh, Powers et al., PLDI 2019). Two ways to choose the meshes, both
allowing sets of more than two pages:

- ``greedy``: `defrag.mesh_planner.plan_meshes`, the pool's chooser, with
  its cost rule off: first fit, densest page first, over open meshes (a page
  joins a mesh whose union it does not overlap; ``PROBES`` open meshes are
  tried, half the newest, half at random, so the time is bounded); numpy
  ``uint64`` bitmaps, one AND over a page's probes.
  ``greedy*`` tries every open mesh (exact-ish; only up to ``EXACT_MAX`` pages).
- ``random``: Mesh's SplitMesher: shuffle, split in halves, probe page i of
  one half against page (i + t) mod m of the other for t < ``SPLIT_PROBES``
  (each t is a matching, so it runs vectorized on numpy bit arrays); the
  meshes found become single items and the next round meshes them again
  (``ROUNDS`` rounds).

For each mesh the member with the most live bytes keeps its physical page;
the others' live bytes are copied into it ("copied").

Figures per trace: pages mapped (reserved / page), pages holding live data
("held"), full pages (never meshable), the lower bound ceil(live / page),
pages holding live data after each method, bytes copied, seconds per
method. Also: how many random pairs of partial pages are disjoint (what
randomized matching relies on), and how often the first / last 512 B of a
partial page is live (straddling blocks, a placement effect); and the time
of each method on 100,000 pages drawn from the measured partial pages.

Run: ``python benchmarks/mesh_potential.py [--json out.json] [--quick]``
(about 2 minutes on 2 cores; ``--quick``: fewer samples, no 100k row).
Inputs: the five real snapshots in ``$DEFRAG_SNAPSHOTS`` (default
``/work/shared/snapshots``; missing files are skipped) and the four
generators of `defrag.traces`. Standalone: stdlib, numpy and defrag.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import sys
import time

import numpy as np

from defrag import settings
from defrag.dry import DryPool
from defrag.mesh_planner import plan_meshes
from defrag.replay import snapshot_capacity
from defrag.traces import ALLOC, FREE, GENERATORS
from defrag.traces.snapshot import load_snapshot_devices

PAGE = 2 << 20
GRAIN = 512  # the pool's alignment (defrag.units.ALIGNMENT)
UNITS = PAGE // GRAIN  # bits per page bitmap
WORDS = UNITS // 64
FULL = (1 << UNITS) - 1
PROBES = 128  # greedy: open meshes tried per page (bounds its time at O(pages x PROBES))
SPLIT_PROBES = 64  # random: Mesh's t (probes per page per round)
ROUNDS = 6  # random: SplitMesher rounds (each can merge existing meshes again)
EXACT_MAX = 5000  # greedy*: unbounded probing only on sets this small
SAMPLES = 24  # evenly spaced sample points per trace, besides the peak of reserved
SNAPSHOTS = settings.snapshots() or "/work/shared/snapshots"
SEED = 0


# ---------------------------------------------------------------------- replay and layout
def _replay(trace, capacity: int, stop_at: set[int] | None, on_sample):
    """Replay `trace` on a DryPool with compaction off; call on_sample(i, pool) after event i of `stop_at`.

    Returns (reserved bytes after each event as an int64 array, OOM count). A failed allocation
    is skipped with its free, as `defrag.replay` does.
    """
    pool = DryPool(capacity, PAGE, auto_compact=False)
    reserved = np.zeros(len(trace.events), dtype=np.int64)
    failed: set = set()
    ooms = 0
    for i, ev in enumerate(trace.events):
        op = ev[0]
        if op == ALLOC:
            if not pool.alloc(ev[1], ev[2]):
                ooms += 1
                failed.add(ev[1])
        elif op == FREE:
            if ev[1] in failed:
                failed.discard(ev[1])
            else:
                pool.free(ev[1])
        # phase markers: nothing (no compaction under install)
        reserved[i] = pool.reserved_bytes()
        if stop_at and i in stop_at:
            on_sample(i, pool)
    pool.discard()
    return reserved, ooms


def page_bitmaps(pool) -> dict:
    """The pool's layout as page occupancy: {(region, page): bitmap int} for every page holding live
    data, plus the mapped-page count and live bytes. Read through `Core.layout()` (the documented
    plain-dict picture): blocks (address, size, region) and each region's page states."""
    lay = pool.core.layout()
    regions = {r["index"]: r for r in lay["regions"]}
    mapped = sum(sum(1 for s in r["pages"] if s != "unmapped") for r in lay["regions"])
    maps: dict = {}
    live = 0
    for b in lay["blocks"]:
        if b["state"] == "retired":
            continue
        live += b["size"]
        base = regions[b["region"]]["base"]
        u0 = (b["address"] - base) // GRAIN
        u1 = (b["address"] + b["size"] - base + GRAIN - 1) // GRAIN
        p0, p1 = u0 // UNITS, (u1 - 1) // UNITS
        for p in range(p0, p1 + 1):
            lo = max(u0, p * UNITS) - p * UNITS
            hi = min(u1, (p + 1) * UNITS) - p * UNITS
            key = (b["region"], p)
            maps[key] = maps.get(key, 0) | (((1 << (hi - lo)) - 1) << lo)
    return {"maps": maps, "mapped": mapped, "live": live, "regions": len(lay["regions"])}


# ---------------------------------------------------------------------- the two ways to choose meshes
def _mirror(b: int) -> int:
    """The bitmap of a page filled from the top: unit u live iff unit UNITS - 1 - u was."""
    return int(format(b, f"0{UNITS}b")[::-1], 2)


def _cost(members_pop: list[int]) -> int:
    """Bytes copied for one mesh: every member's live bytes but the fullest member's."""
    return (sum(members_pop) - max(members_pop)) * GRAIN


def mesh_greedy(bitmaps: list[int], probes: int = PROBES, seed: int = SEED) -> dict:
    """The pool's own chooser, `defrag.mesh_planner.plan_meshes`, on these pages with its cost rule off
    (a page holds at most PAGE live bytes): first fit, densest page first, each page trying the
    `probes` / 2 newest open meshes (the sparsest: pages come densest first) and `probes` / 2 others at
    random (identical bitmaps sort together and never mesh), else opening one. O(pages x probes x WORDS).
    "seconds" is the planner's own time on uint64 bitmaps, not this conversion from Python ints."""
    live = np.array([b.bit_count() for b in bitmaps], dtype=np.int64) * GRAIN
    plan = plan_meshes(_as_words(bitmaps), live, max_probes=max(1, probes), seed=seed, max_copy_per_page=PAGE)
    # plan.copied_bytes is _cost's figure: the primary is the member with the most live bytes.
    return {"pages": len(bitmaps) - plan.freed_pages, "copied": plan.copied_bytes,
            "largest_mesh": max((len(g.members) for g in plan.groups), default=1 if bitmaps else 0),
            "meshes": len(plan.groups), "seconds": plan.seconds}


def _as_words(bitmaps: list[int]) -> np.ndarray:
    return np.frombuffer(b"".join(b.to_bytes(UNITS // 8, "little") for b in bitmaps),
                         dtype=np.uint64).reshape(len(bitmaps), WORDS).copy()


def mesh_random(bitmaps: list[int], *, rounds: int = ROUNDS, probes: int = SPLIT_PROBES, seed: int = SEED,
                words: np.ndarray | None = None) -> dict:
    """Mesh's SplitMesher, repeated: shuffle the items, split them in halves L and R, and for
    t < `probes` try L[i] with R[(i + t) mod m] (a matching for each t: no two probes of one t share
    an item, so each runs as one numpy pass); meshed pairs become one item with the union bitmap
    and the next round can mesh them again."""
    t0 = time.perf_counter()
    pops = [b.bit_count() for b in bitmaps]
    bm = _as_words(bitmaps) if words is None else words.copy()
    members: list[list[int]] = [[i] for i in range(len(bitmaps))]
    alive = np.ones(len(bitmaps), dtype=bool)
    rng = np.random.default_rng(seed)
    for _ in range(rounds):
        idx = rng.permutation(np.flatnonzero(alive))
        m = len(idx) // 2
        if m < 1:
            break
        L, R = idx[:m], idx[m:2 * m]
        used_l = np.zeros(m, dtype=bool)
        used_r = np.zeros(m, dtype=bool)
        pairs_l, pairs_r = [], []
        ar = np.arange(m)
        for t in range(min(probes, m)):
            j = (ar + t) % m
            cand = np.flatnonzero(~used_l & ~used_r[j])
            if not cand.size:
                break
            ok = ~(bm[L[cand]] & bm[R[j[cand]]]).any(axis=1)
            li = cand[ok]
            if not li.size:
                continue
            used_l[li] = True
            used_r[j[li]] = True
            pairs_l.append(L[li])
            pairs_r.append(R[j[li]])
        if not pairs_l:
            break
        a = np.concatenate(pairs_l)
        b = np.concatenate(pairs_r)
        bm[a] |= bm[b]
        alive[b] = False
        for x, y in zip(a.tolist(), b.tolist()):
            members[x].extend(members[y])
            members[y] = []
    return _result([members[i] for i in np.flatnonzero(alive).tolist()], pops, time.perf_counter() - t0)


def _result(members: list[list[int]], pops: list[int], seconds: float) -> dict:
    return {"pages": len(members), "copied": sum(_cost([pops[i] for i in ms]) for ms in members if len(ms) > 1),
            "largest_mesh": max((len(ms) for ms in members), default=0),
            "meshes": sum(1 for ms in members if len(ms) > 1), "seconds": seconds}


# ---------------------------------------------------------------------- one sample
def analyse(layout: dict, rng: random.Random) -> dict:
    """Every figure of one layout (see the module docstring)."""
    maps = layout["maps"]
    held = len(maps)
    partial = [b for b in maps.values() if b != FULL]
    full = held - len(partial)
    bound = -(-layout["live"] // PAGE)
    g = mesh_greedy(partial)
    g_all = mesh_greedy(partial, probes=len(partial)) if len(partial) <= EXACT_MAX else None
    r = mesh_random(partial)
    disjoint = None
    if len(partial) >= 2:
        trials = min(2000, len(partial) * (len(partial) - 1) // 2)
        hits = 0
        for _ in range(trials):
            x, y = rng.sample(range(len(partial)), 2)
            hits += not (partial[x] & partial[y])
        disjoint = hits / trials
    # What-if (placement): every other partial page filled from the top instead (its bitmap mirrored).
    # Not a layout the pool can reach as is; an upper bound on what alternating fill directions could give.
    mirrored = [_mirror(b) if k % 2 else b for k, b in enumerate(partial)]
    rm = mesh_random(mirrored)
    first = sum(1 for b in partial if b & 1)
    last = sum(1 for b in partial if b >> (UNITS - 1))
    occ = [b.bit_count() / UNITS for b in partial]
    return {"mapped": layout["mapped"], "held": held, "full": full, "partial": len(partial),
            "live": layout["live"], "bound": bound, "regions": layout["regions"],
            "greedy": full + g["pages"], "greedy_copied": g["copied"], "greedy_s": g["seconds"],
            "greedy_largest": g["largest_mesh"], "greedy_all": None if g_all is None else full + g_all["pages"],
            "random": full + r["pages"], "random_copied": r["copied"], "random_s": r["seconds"],
            "random_largest": r["largest_mesh"],
            "random_mirrored": full + rm["pages"], "random_mirrored_copied": rm["copied"],
            "pair_disjoint": disjoint,
            "partial_first_live": first / len(partial) if partial else None,
            "partial_last_live": last / len(partial) if partial else None,
            "partial_mean_occupancy": sum(occ) / len(occ) if occ else None,
            "_partial": partial}


def run_trace(name: str, trace, capacity: int, samples: int, rng: random.Random) -> dict:
    """Replay twice: once for the reserved-bytes curve (its peak), once stopping at the sample points."""
    t0 = time.perf_counter()
    reserved, ooms = _replay(trace, capacity, None, None)
    n = len(trace.events)
    peak_at = int(np.argmax(reserved))
    points = sorted({peak_at} | {min(n - 1, (k + 1) * n // (samples + 1)) for k in range(samples)})
    layouts: dict = {}
    _replay(trace, capacity, set(points), lambda i, pool: layouts.__setitem__(i, page_bitmaps(pool)))
    rows = []
    for i in points:
        row = analyse(layouts[i], rng)
        row["event"], row["peak"] = i, i == peak_at
        rows.append(row)
    return {"name": name, "events": n, "capacity": capacity, "ooms": ooms,
            "peak_reserved": int(reserved.max()), "rows": rows, "seconds": time.perf_counter() - t0}


# ---------------------------------------------------------------------- inputs
def inputs():
    for path in sorted(glob.glob(os.path.join(SNAPSHOTS, "*.pickle"))):
        for dev in load_snapshot_devices(path):
            cap, _ = snapshot_capacity(dev.recorded, dev.ooms, dev.trace)
            # Compaction off may need more than PyTorch had: twice as much never stops the replay short.
            yield (f"{os.path.basename(path).removesuffix('.pickle')}"
                   + (f" (dev {dev.device})" if dev.device else "")), dev.trace, 2 * cap, "snapshot"
    for name, fn in GENERATORS.items():
        trace = fn()
        cap = 2 * -(-trace.stats().peak_live_bytes // PAGE) * PAGE
        yield name, trace, cap, "generator"


def _pct(x) -> str:
    return "-" if x is None or x != x else f"{x:.0%}"


def _mib(x: int) -> str:
    return f"{x / 2**20:,.1f}"


def _row(res: dict, which: str) -> dict:
    """The sample a table shows: the peak of reserved, or the one with the most pages above the bound."""
    if which == "peak":
        return next(r for r in res["rows"] if r["peak"])
    return max(res["rows"], key=lambda r: (r["held"] - r["bound"], r["event"]))


def table(results: list[dict], which: str) -> str:
    """A Markdown table, one row per trace: the peak sample, the worst sample, or ("mean") the means."""
    head = ("| trace | event | mapped | held (full) | bound | greedy | greedy* | random | copied greedy / random (MiB) "
            "| greedy / random s | pairs disjoint | what-if mirrored |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for res in results:
        if which == "mean":
            rows = res["rows"]

            def avg(key):
                vals = [r[key] for r in rows if r[key] is not None]
                return sum(vals) / len(vals) if vals else float("nan")
            lines.append(f"| {res['name']} | {len(rows)} samples | {avg('mapped'):.0f} | {avg('held'):.0f} "
                         f"({avg('full'):.0f}) | {avg('bound'):.0f} | {avg('greedy'):.0f} | {avg('greedy_all'):.0f} "
                         f"| {avg('random'):.0f} "
                         f"| {_mib(avg('greedy_copied'))} / {_mib(avg('random_copied'))} | {avg('greedy_s'):.3f} / "
                         f"{avg('random_s'):.3f} | {_pct(avg('pair_disjoint'))} | {avg('random_mirrored'):.0f} |")
            continue
        r = _row(res, which)
        lines.append(f"| {res['name']} | {r['event']} | {r['mapped']} | {r['held']} ({r['full']}) | {r['bound']} "
                     f"| {r['greedy']} | {'-' if r['greedy_all'] is None else r['greedy_all']} | {r['random']} | {_mib(r['greedy_copied'])} / {_mib(r['random_copied'])} "
                     f"| {r['greedy_s']:.3f} / {r['random_s']:.3f} | {_pct(r['pair_disjoint'])} "
                     f"| {r['random_mirrored']} |")
    return "\n".join(lines)


def scaling(pool_of_pages: list[int], n: int, rng: random.Random) -> dict:
    """Each method's time on `n` pages drawn (with replacement) from measured partial pages."""
    pages = [rng.choice(pool_of_pages) for _ in range(n)]
    g = mesh_greedy(pages)
    r = mesh_random(pages)
    return {"pages": n, "greedy": g["pages"], "greedy_s": g["seconds"], "random": r["pages"],
            "random_s": r["seconds"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--quick", action="store_true", help="2 samples per trace, no 100k-page timing")
    args = ap.parse_args(argv)
    rng = random.Random(SEED)
    samples = 2 if args.quick else SAMPLES
    results = []
    t0 = time.perf_counter()
    for name, trace, cap, kind in inputs():
        res = run_trace(name, trace, cap, samples, rng)
        res["kind"] = kind
        results.append(res)
        peak = next(r for r in res["rows"] if r["peak"])
        print(f"{name}: {res['events']} events, peak reserved {_mib(res['peak_reserved'])} MiB, "
              f"OOMs {res['ooms']}, held {peak['held']} -> greedy {peak['greedy']} / random {peak['random']} "
              f"(bound {peak['bound']}) [{res['seconds']:.1f} s]", file=sys.stderr, flush=True)
    print("\n## At the peak of reserved bytes (pages of 2 MiB)\n")
    print(table(results, "peak"))
    print("\n## At the sample with the most pages above the bound\n")
    print(table(results, "worst"))
    print("\n## Averaged over the sample points (the peak and evenly spaced events)\n")
    print(table(results, "mean"))
    print("\n## Where partial pages are live (at the peak)\n")
    print("| trace | partial pages | mean occupancy | first 512 B live | last 512 B live | largest mesh greedy / random |")
    print("|---|---|---|---|---|---|")
    for res in results:
        r = next(r for r in res["rows"] if r["peak"])
        if not r["partial"]:
            print(f"| {res['name']} | 0 | - | - | - | - |")
            continue
        print(f"| {res['name']} | {r['partial']} | {r['partial_mean_occupancy']:.0%} | {r['partial_first_live']:.0%} "
              f"| {r['partial_last_live']:.0%} | {r['greedy_largest']} / {r['random_largest']} |")
    scale = None
    if not args.quick:
        drawn = [b for res in results for r in res["rows"] if r["peak"] for b in r["_partial"]]
        if drawn:
            scale = scaling(drawn, 100_000, rng)
            print(f"\n## 100,000 pages drawn from the measured partial pages\n\ngreedy: {scale['greedy']} pages in "
                  f"{scale['greedy_s']:.1f} s; random: {scale['random']} pages in {scale['random_s']:.1f} s "
                  f"(Python + numpy on this machine)")
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")
    if args.json:
        for res in results:
            for r in res["rows"]:
                r.pop("_partial", None)
        with open(args.json, "w") as f:
            json.dump({"results": results, "scaling": scale, "page": PAGE, "grain": GRAIN, "probes": PROBES,
                       "split_probes": SPLIT_PROBES, "rounds": ROUNDS}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
