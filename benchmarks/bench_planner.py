"""Planner benchmark: wall time of plan_compaction on fragmented layouts of N live blocks.

What is measured: ``plan_compaction`` alone (best of ``repeats`` runs,
``time.perf_counter``), on the CPU; building the layout is not timed. The
layout is synthetic: 2N blocks allocated back to back over 2 MiB pages
(95% log-uniform 512 B .. 1 MiB, 4% 1 .. 2 MiB, 1% large 2 .. 32 MiB starting
on a page boundary), then a random half freed, leaving N live blocks of which
1% are pinned. The region has 5% spare unmapped pages at its end. This is a
hard case (every page about half full), not a replay of a real workload.

Run: ``python -m defrag.benchmarks.bench_planner [--smoke]``.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from defrag.planner import LiveBlock, plan_compaction

PAGE = 2 << 20
ALIGN = 512


def fragmented_layout(n: int, seed: int = 0, *, pinned: float = 0.01) -> tuple[list[LiveBlock], int]:
    """N live blocks over a region (see the module docstring); returns (blocks, span)."""
    rng = np.random.default_rng(seed)
    total = 2 * n
    kind = rng.random(total)
    small = np.exp(rng.uniform(np.log(ALIGN), np.log(1 << 20), total))
    medium = rng.uniform(1 << 20, PAGE - ALIGN, total)
    large = rng.uniform(PAGE, 16 * PAGE, total)
    sizes = np.where(kind < 0.95, small, np.where(kind < 0.99, medium, large))
    sizes = np.maximum(ALIGN, sizes // ALIGN * ALIGN).astype(np.int64)
    offsets = np.empty(total, np.int64)
    off = 0
    for i, s in enumerate(sizes.tolist()):
        if s >= PAGE:
            off = -(-off // PAGE) * PAGE
        offsets[i] = off
        off += s
    pages = -(-off // PAGE)
    span = (pages + max(1, pages // 20)) * PAGE
    live = np.sort(rng.choice(total, size=n, replace=False))
    pin = rng.random(n) < pinned
    blocks = [
        LiveBlock(int(i), int(o), int(s), not p)
        for i, o, s, p in zip(live.tolist(), offsets[live].tolist(), sizes[live].tolist(), pin.tolist())
    ]
    return blocks, span


def bench_planner(
    block_counts=(1_000, 10_000, 100_000, 1_000_000), seed: int = 0, smoke: bool = False, repeats: int = 3
) -> list[dict]:
    """One row per block count: best planning time and what the plan achieves."""
    if smoke:
        block_counts = (1_000, 10_000)
    rows = []
    for n in block_counts:
        blocks, span = fragmented_layout(n, seed)
        best, plan = float("inf"), None
        for _ in range(repeats):
            t0 = time.perf_counter()
            plan = plan_compaction(blocks, page_size=PAGE, span=span)
            best = min(best, time.perf_counter() - t0)
        live = sum(b.size for b in blocks)
        rows.append(
            {
                "blocks": n,
                "seconds": best,
                "pages_before": plan.pages_before,
                "pages_after": plan.pages_after,
                "pages_lower_bound": plan.pages_lower_bound,
                "moved_bytes": plan.moved_bytes,
                "moved_fraction": plan.moved_bytes / live if live else 0.0,
                "moves": len(plan.moves),
                "waves": len(plan.waves),
            }
        )
    return rows


def format_table(rows: list[dict]) -> str:
    head = f"{'blocks':>9} {'seconds':>8} {'pages before':>12} {'after':>8} {'bound':>8} {'moved':>7} {'moves':>8} {'waves':>5}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['blocks']:>9} {r['seconds']:>8.3f} {r['pages_before']:>12} {r['pages_after']:>8} "
            f"{r['pages_lower_bound']:>8} {r['moved_fraction']:>7.1%} {r['moves']:>8} {r['waves']:>5}"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="1k and 10k blocks only")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(format_table(bench_planner(seed=args.seed, smoke=args.smoke)))


if __name__ == "__main__":
    main()
