"""`defrag demo`: a serving workload fragments a pool; a compaction rescues a big request.

The story, on the GPU if one works, else on the emulated device:

1. an LLM server keeps one KV cache per request in a pool; requests arrive
   with varied lengths and finish out of order, so most pages end up holding
   a few surviving caches and a lot of stranded free space;
2. a large request (say, a batch of activations for a new long prompt) fails
   although the pool has enough free memory in total;
3. `pool.compact()` packs the surviving caches into fewer, fuller pages: it
   evacuates sparse pages into the holes of denser ones (it does not slide
   everything to one end); the pages it empties stay mapped and free;
4. the request succeeds: free physical pages, wherever they were freed, are
   stitched into one virtual range. Every surviving cache still holds its
   bytes (checked), and a before/after picture of the memory map is written
   to the output folder.

`main` (the `defrag demo` command) checks its arguments before any work:
a bad one is one line on stderr and exit code 2 (see `defrag.cli`).
"""

from __future__ import annotations

import math
import os
import random
import sys
import time
from dataclasses import dataclass

import torch

from .errors import CudaError
from .oom import OutOfMemoryError
from .pool import Pool
from .units import format_bytes, parse_size


@dataclass(frozen=True)
class Scenario:
    """The demo's serving workload: what is allocated, how much of it finishes, what is asked for next."""

    layers: int = 4
    heads: int = 8
    head_dim: int = 64
    tokens: tuple = (16, 32, 48, 64, 96, 128, 192, 256)  # drawn uniformly per request
    itemsize: int = 2  # bfloat16
    fill: float = 0.85  # requests arrive until this fraction of the capacity is live
    finish: float = 0.75  # then this fraction of them finishes, in random order
    spare_pages: int = 2  # the large request leaves this many pages beyond what the survivors fill

    def shape(self, tokens: int) -> tuple:
        return (self.layers, 2, tokens, self.heads * self.head_dim)

    def cache_bytes(self, tokens: int) -> int:
        return self.layers * 2 * tokens * self.heads * self.head_dim * self.itemsize

    def pages_freed_fraction(self, page_size: int) -> float:
        """Expected fraction of the pool's pages a compaction empties.

        A page holds k = page / (mean cache) caches; after the finishes it
        still holds live data unless all k finished (probability finish**k),
        while the survivors, packed, need (1 - finish) of the filled pages.
        So a compaction empties fill * (finish - finish**k) of the pages.
        """
        mean = sum(self.cache_bytes(t) for t in self.tokens) / len(self.tokens)
        k = page_size / mean
        return self.fill * (self.finish - self.finish ** k)

    def min_capacity(self, page_size: int) -> int | None:
        """The smallest capacity (whole pages) at which the story is expected to work; None: at no capacity.

        The request must be one page larger than anything the fragmented pool
        can place, and the packing is not perfect: a compaction must be
        expected to empty at least two pages. None when a page holds at most
        one cache (nothing to pack).
        """
        freed = self.pages_freed_fraction(page_size)
        if freed <= 0:
            return None
        largest = -(-max(self.cache_bytes(t) for t in self.tokens) // page_size)  # pages of the largest cache
        pages = max(math.ceil(2 / freed), largest + self.spare_pages + 1)
        return pages * page_size


SCENARIO = Scenario()


def _headline(title: str) -> None:
    print(f"\n== {title}")


def _print_stats(pool: Pool) -> dict:
    st = pool.stats()
    print(f"   live {format_bytes(st['allocated_bytes.all.current'])} in {st['live_blocks']} tensors | "
          f"mapped {format_bytes(st['reserved_bytes.all.current'])} ({st['pages.mapped']} pages of "
          f"{format_bytes(st['page_size'])}) | stranded {format_bytes(st['stranded_bytes'])} | "
          f"fragmentation {st['fragmentation']:.0%} | largest request possible now "
          f"{format_bytes(st['largest_free_bytes'])}")
    return st


def _show_progress() -> bool:
    """A live progress bar only when stdout and stderr are both a terminal.

    The bar redraws itself with carriage returns on stderr: in a log file, or
    on a terminal fed by `defrag demo | tee log` (stdout reaches it later than
    stderr), it would land in the middle of the log lines.
    """
    return all(getattr(f, "isatty", lambda: False)() for f in (sys.stdout, sys.stderr))


def run_demo(device=None, out: str = ".", capacity="256MiB", seed: int = 0,
             scenario: Scenario = SCENARIO) -> int:
    """Run the demo; returns a process exit code (0 when every check passed).

    A library entry point: arguments are not checked here beyond what `Pool`
    checks (`main` checks them for the command line).
    """
    with Pool(device=device, capacity=parse_size(capacity, what="capacity"), auto_compact=False) as pool:
        return _story(pool, out, seed, scenario)


def _story(pool: Pool, out, seed: int, sc: Scenario) -> int:
    rng = random.Random(seed)
    t0 = time.perf_counter()
    print(f"defrag demo on {pool.kind} device ({pool.driver.name}); pool capacity "
          f"{format_bytes(pool.capacity)}, pages of {format_bytes(pool.page_size)}")

    _headline("1. Serving: KV caches arrive with varied lengths and finish out of order")
    caches: dict[int, torch.Tensor] = {}
    expected: dict[int, float] = {}
    rid = 0
    while pool.stats()["allocated_bytes.all.current"] < sc.fill * pool.capacity:
        tokens = rng.choice(sc.tokens)
        try:
            kv = pool.empty(sc.shape(tokens), dtype=torch.bfloat16)
        except OutOfMemoryError:
            break
        value = float(rid % 251)
        kv.fill_(value)
        caches[rid], expected[rid] = kv, value
        rid += 1
    finished = rng.sample(sorted(caches), k=int(len(caches) * sc.finish))
    for r in finished:
        del caches[r], expected[r]
    print(f"   {rid} requests served, {len(finished)} finished, {len(caches)} still decoding")
    st = _print_stats(pool)
    before = pool.layout()

    _headline("2. A large request arrives")
    live_pages = -(-st["allocated_bytes.all.current"] // pool.page_size)
    request = pool.capacity - (live_pages + sc.spare_pages) * pool.page_size
    request = max(request, st["largest_free_bytes"] + pool.page_size)
    print(f"   asking for {format_bytes(request)} while {format_bytes(pool.capacity - st['allocated_bytes.all.current'])} "
          f"is free in total")
    try:
        pool.empty((request,), dtype=torch.uint8)
        print("   (it fit without compaction: the workload was not fragmented enough)")
    except OutOfMemoryError as exc:
        print("   without compaction it fails:")
        print("   " + str(exc).replace("\n", "\n   "))

    _headline("3. pool.compact(): pack the surviving caches into fewer, fuller pages")
    progress = _show_progress()
    sys.stdout.flush()  # every line above is out before the bar (on stderr) starts
    report = pool.compact(verify=True, progress=progress)
    sys.stderr.flush()  # and the finished bar is out before the next line
    print(f"   {report}")
    _print_stats(pool)
    after = pool.layout()

    _headline("4. The request again: free physical pages stitched into one virtual range")
    try:
        big = pool.empty((request,), dtype=torch.uint8)
    except OutOfMemoryError as exc:
        print("   ERROR: it still fails after the compaction:")
        print("   " + str(exc).replace("\n", "\n   "))
        return 1
    big.fill_(7)
    print(f"   succeeded: {format_bytes(big.numel())} at {big.data_ptr():#x}")
    bad = [r for r, kv in caches.items() if not bool((kv == expected[r]).all())]
    if bad:
        print(f"   ERROR: {len(bad)} caches lost their bytes")
        return 1
    print(f"   all {len(caches)} surviving caches hold their bytes")
    del big, caches

    from .viz import plot_compaction
    os.makedirs(out, exist_ok=True)
    path = plot_compaction(before, after, os.path.join(out, "defrag-demo.png"), report=report)
    print(f"\n   picture of the memory map before/after: {os.path.abspath(path)}")
    print(f"   done in {time.perf_counter() - t0:.1f} s")
    return 0


def main(args) -> int:
    """`defrag demo` (args: device, capacity, out): every argument is checked before any work.

    A bad one raises `defrag.cli.UsageError` (one line on stderr, exit 2).
    """
    from .arguments import UsageError, capacity_fits, device_arg, out_dir_arg, pool_open_error, size_arg

    out = out_dir_arg(args.out)
    if (out / "defrag-demo.png").is_dir():
        raise UsageError(f"--out {args.out}: {out / 'defrag-demo.png'} is a folder; the picture needs that name")
    driver = device_arg(args.device)
    page = driver.granularity  # the pool's page size
    capacity = size_arg(args.capacity, "--capacity", at_least=page, at_least_what=f"one page ({format_bytes(page)})")
    minimum = SCENARIO.min_capacity(page)
    if minimum is None:
        raise UsageError(f"--device {args.device or 'default'}: pages of {format_bytes(page)} hold at most one of "
                         f"the demo's KV caches: there is nothing to pack")
    if capacity < minimum:
        freed = SCENARIO.pages_freed_fraction(page)
        raise UsageError(
            f"--capacity {format_bytes(capacity)} is too small for the demo's scenario, which needs "
            f"{format_bytes(minimum)} or more on {format_bytes(page)} pages: it fills {SCENARIO.fill:.0%} of the pool "
            f"with KV caches of up to {format_bytes(SCENARIO.cache_bytes(max(SCENARIO.tokens)))} and finishes "
            f"{SCENARIO.finish:.0%} of them, so a compaction is expected to empty {freed:.1%} of the pages, and the "
            f"story needs 2 emptied pages")
    capacity_fits(capacity, driver, need=SCENARIO.fill, why=f"the demo (it fills {SCENARIO.fill:.0%} of the pool)")
    try:
        pool = Pool(device=driver, capacity=capacity, auto_compact=False)
    except (CudaError, ValueError) as exc:  # ValueError: the pool's own refusal, e.g. of its reservation
        raise pool_open_error(exc, capacity) from None
    with pool:
        return _story(pool, out, seed=0, sc=SCENARIO)
