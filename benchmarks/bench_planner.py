"""Planner benchmark: wall time of the planner on fragmented layouts of N live blocks.

What is measured, on the CPU, best of ``repeats`` runs (``time.perf_counter``):
``seconds``, one ``plan_arrays`` call on the layout as numpy arrays (what the
compactor runs: arrays in, arrays out). ``seconds_arrays`` is the same figure
under the name ``runner.bench_planner_adapter`` checks its goals against.

Building the layout is not timed. The layout is synthetic: 2N blocks
allocated back to back over 2 MiB pages (95% log-uniform 512 B .. 1 MiB, 4%
1 .. 2 MiB, 1% large 2 .. 32 MiB starting on a page boundary), then a random
half freed, leaving N live blocks of which 1% are pinned. The region has 5%
spare unmapped pages at its end. This is a hard case (every page about half
full), not a replay of a real workload.

Run: ``python -m defrag.benchmarks.bench_planner [--smoke]``.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from defrag.planner import plan_arrays

PAGE = 2 << 20
ALIGN = 512


def fragmented_arrays(n: int, seed: int = 0, *, pinned: float = 0.01
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """N live blocks over a region (see the module docstring) as arrays.

    Returns ``(ids, offsets, sizes, movable, span)``; ``ids`` are the blocks'
    allocation numbers (increasing).
    """
    rng = np.random.default_rng(seed)
    total = 2 * n
    kind = rng.random(total)
    small = np.exp(rng.uniform(np.log(ALIGN), np.log(1 << 20), total))
    medium = rng.uniform(1 << 20, PAGE - ALIGN, total)
    large = rng.uniform(PAGE, 16 * PAGE, total)
    sizes = np.where(kind < 0.95, small, np.where(kind < 0.99, medium, large))
    sizes = np.maximum(ALIGN, sizes // ALIGN * ALIGN).astype(np.int64)
    # Back to back, except that blocks of a page or more start on a page boundary.
    offsets = np.empty(total, np.int64)
    csum = np.concatenate(([0], np.cumsum(sizes)))
    off, prev = 0, 0
    for k in np.flatnonzero(sizes >= PAGE).tolist() + [total]:
        offsets[prev:k] = off + (csum[prev:k] - csum[prev])
        off += int(csum[k] - csum[prev])
        if k == total:
            break
        off = -(-off // PAGE) * PAGE
        offsets[k] = off
        off += int(sizes[k])
        prev = k + 1
    pages = -(-off // PAGE)
    span = (pages + max(1, pages // 20)) * PAGE
    live = np.sort(rng.choice(total, size=n, replace=False))
    pin = rng.random(n) < pinned
    return live, offsets[live], sizes[live], ~pin, span


def _best(fn, repeats: int):
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def bench_planner(
    block_counts=(1_000, 10_000, 100_000, 1_000_000), seed: int = 0, smoke: bool = False, repeats: int = 3
) -> list[dict]:
    """One row per block count: best planning time and what the plan achieves."""
    if smoke:
        block_counts = (1_000, 10_000)
    rows = []
    for n in block_counts:
        _, offsets, sizes, movable, span = fragmented_arrays(n, seed)
        seconds, plan = _best(lambda: plan_arrays(offsets, sizes, movable, page_size=PAGE, span=span), repeats)
        live = int(sizes.sum())
        rows.append(
            {
                "blocks": n,
                "seconds": seconds,
                "seconds_arrays": seconds,
                "pages_before": plan.pages_before,
                "pages_after": plan.pages_after,
                "pages_lower_bound": plan.pages_lower_bound,
                "moved_bytes": plan.moved_bytes,
                "moved_fraction": plan.moved_bytes / live if live else 0.0,
                "moves": len(plan),
                "waves": plan.waves,
            }
        )
    return rows


def format_table(rows: list[dict]) -> str:
    head = (f"{'blocks':>9} {'seconds':>9} {'pages before':>12} {'after':>8} {'bound':>8} "
            f"{'moved':>7} {'moves':>8} {'waves':>5}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['blocks']:>9} {r['seconds']:>9.3f} {r['pages_before']:>12} "
            f"{r['pages_after']:>8} {r['pages_lower_bound']:>8} {r['moved_fraction']:>7.1%} {r['moves']:>8} "
            f"{r['waves']:>5}"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="1k and 10k blocks only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    print(format_table(bench_planner(seed=args.seed, smoke=args.smoke, repeats=args.repeats)))


if __name__ == "__main__":
    main()
