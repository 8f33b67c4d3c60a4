"""Rescue rate of the automatic trigger on random adversarial traces.

Each trace runs on a fresh small pool (auto_compact on): random allocations
(sizes drawn from a family), frees and pins. Every allocation whose first
placement fails is an OOM *without* defrag's compaction; it is *eligible*
when live + request <= capacity - (pages touched by pinned blocks) x page,
the issue's definition of "compaction could make room" (a request of a page
or more counts whole pages, as its placement needs them). The rescue rate is
rescued / eligible. Families: equal sizes that divide the page (the
canonical case), log-uniform sub-page sizes, and mixed sizes up to three
pages (blocks of a page or more start on page boundaries and never move, so
their tails stay stranded: the hard case).
"""

from __future__ import annotations

import gc
import random

import torch

import defrag
from defrag.driver import Driver

from .runner import Skip

KiB = 1 << 10
PAGE = 64 * KiB

# name -> (size sampler, steps per trace): small sizes need more steps to fill the pool.
FAMILIES = {
    "equal 16 KiB (divides the page)": (lambda rng: 16 * KiB, 300),
    "log-uniform 512 B - 32 KiB": (lambda rng: int(512 * 2 ** rng.uniform(0, 6)), 400),
    "mixed 1 B - 3 pages": (lambda rng: rng.randint(1, 3 * PAGE), 80),
}


def _pinned_pages(pool) -> int:
    pages = set()
    for a in pool.core.blocks():
        if a.pins:
            first, end = pool.core.backing.pages_of(a)
            pages.update((a.region.index, p) for p in range(first, end))
    return len(pages)


def _trace(family, seed: int, steps: int) -> tuple[int, int]:
    rng = random.Random(seed)
    pool = defrag.Pool(device=Driver.emulated(capacity=8 << 20, granularity=PAGE), capacity="1MiB")
    live, eligible, rescued = {}, 0, 0
    try:
        for step in range(steps):
            op = rng.choice(("alloc", "alloc", "alloc", "free", "free", "pin", "big"))
            if op in ("alloc", "big"):
                n = family(rng) if op == "alloc" else PAGE * rng.randint(1, 12)
                cost = -(-n // PAGE) * PAGE if n >= PAGE else -(-n // 512) * 512
                st = pool.stats()
                ok_in_theory = st["allocated_bytes.all.current"] + cost <= pool.capacity - _pinned_pages(pool) * PAGE
                retries = st["num_alloc_retries"]
                try:
                    live[step] = pool.empty(n, dtype=torch.uint8)
                    ok = True
                except defrag.OutOfMemoryError:
                    ok = False
                if pool.stats()["num_alloc_retries"] > retries and ok_in_theory:
                    eligible += 1
                    rescued += ok
            elif op == "free" and live:
                del live[rng.choice(sorted(live))]
            elif op == "pin" and live:
                pool.pin(live[rng.choice(sorted(live))])
    finally:
        live.clear()
        pool.close()
        gc.collect()
    return eligible, rescued


def _fill_free(family, seed: int, rounds: int) -> tuple[int, int]:
    """Rounds of: fill the pool, free a random 30-95 %, pin up to 2, then ask for k pages."""
    rng = random.Random(seed)
    pool = defrag.Pool(device=Driver.emulated(capacity=8 << 20, granularity=PAGE), capacity="1MiB")
    live, eligible, rescued = [], 0, 0
    try:
        for _ in range(rounds):
            pool.auto_compact = False
            while True:
                try:
                    live.append(pool.empty(family(rng), dtype=torch.uint8))
                except defrag.OutOfMemoryError:
                    break
            rng.shuffle(live)
            del live[: int(len(live) * rng.uniform(0.3, 0.95))]
            pinned = rng.sample(live, k=min(len(live), rng.randint(0, 2)))
            for t in pinned:
                pool.pin(t)
            pool.auto_compact = True
            room = pool.capacity - _pinned_pages(pool) * PAGE - pool.stats()["allocated_bytes.all.current"]
            k = rng.randint(1, max(1, room // PAGE + 1))
            retries = pool.stats()["num_alloc_retries"]
            try:
                live.append(pool.empty(k * PAGE, dtype=torch.uint8))
                ok = True
            except defrag.OutOfMemoryError:
                ok = False
            if pool.stats()["num_alloc_retries"] > retries and k * PAGE <= room:
                eligible += 1
                rescued += ok
            if ok:
                del live[-1]  # the next round starts from the survivors
            for t in pinned:
                pool.unpin(t)
            del pinned
    finally:
        live.clear()
        pool.close()
        gc.collect()
    return eligible, rescued


def bench_rescue(device: str, smoke: bool) -> list[dict]:
    """One row per size family: eligible OOMs, rescued, rate."""
    if device != "emulated":
        raise Skip("runs on small emulated pools (it measures policy, not speed)")
    traces = 6 if smoke else 60
    rows = []
    for name, (family, steps) in FAMILIES.items():
        steps = steps // 4 if smoke else steps
        for style in ("random ops", "fill, free, ask"):
            eligible = rescued = 0
            for seed in range(traces):
                if style == "random ops":
                    e, r = _trace(family, seed, steps)
                else:
                    e, r = _fill_free(family, seed, rounds=2 if smoke else 4)
                eligible, rescued = eligible + e, rescued + r
            rows.append({"family": name, "trace": style, "traces": traces, "eligible_ooms": eligible,
                         "rescued": rescued, "rescue_rate": rescued / eligible if eligible else None,
                         "pool": "1 MiB, 64 KiB pages (emulated)"})
    return rows
