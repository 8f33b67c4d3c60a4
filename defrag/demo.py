"""`defrag demo`: a serving workload fragments a pool; a compaction rescues a big request.

The story, on the GPU if one works, else on the emulated device:

1. an LLM server keeps one KV cache per request in a pool; requests arrive
   with varied lengths and finish out of order, so most pages end up holding
   a few surviving caches and a lot of stranded free space;
2. a large request (say, a batch of activations for a new long prompt) fails
   although the pool has enough free memory in total;
3. `pool.compact()` moves the surviving caches together (progress bar), the
   freed pages are stitched into one range and the request succeeds;
4. every surviving cache still holds its bytes (checked), and a before/after
   picture of the memory map is written to the output folder.
"""

from __future__ import annotations

import os
import random
import time

import torch

from .errors import OutOfMemoryError
from .pool import Pool
from .units import format_bytes, parse_size


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


def run_demo(device=None, out: str = ".", capacity="256MiB", seed: int = 0) -> int:
    """Run the demo; returns a process exit code (0 when every check passed)."""
    rng = random.Random(seed)
    capacity_bytes = parse_size(capacity, what="capacity")
    t0 = time.perf_counter()
    with Pool(device=device, capacity=capacity_bytes, auto_compact=False) as pool:
        print(f"defrag demo on {pool.kind} device ({pool.driver.name}); pool capacity "
              f"{format_bytes(pool.capacity)}, pages of {format_bytes(pool.page_size)}")

        _headline("1. Serving: KV caches arrive with varied lengths and finish out of order")
        layers, heads, head_dim = 4, 8, 64
        caches: dict[int, torch.Tensor] = {}
        expected: dict[int, float] = {}
        rid = 0
        while pool.stats()["allocated_bytes.all.current"] < 0.85 * pool.capacity:
            tokens = rng.choice([16, 32, 48, 64, 96, 128, 192, 256])
            try:
                kv = pool.empty((layers, 2, tokens, heads * head_dim), dtype=torch.bfloat16)
            except OutOfMemoryError:
                break
            value = float(rid % 251)
            kv.fill_(value)
            caches[rid], expected[rid] = kv, value
            rid += 1
        finished = rng.sample(sorted(caches), k=int(len(caches) * 0.75))
        for r in finished:
            del caches[r], expected[r]
        print(f"   {rid} requests served, {len(finished)} finished, {len(caches)} still decoding")
        st = _print_stats(pool)
        before = pool.layout()

        _headline("2. A large request arrives")
        request = pool.capacity - (-(-st["allocated_bytes.all.current"] // pool.page_size) + 2) * pool.page_size
        request = max(request, st["largest_free_bytes"] + pool.page_size)
        print(f"   asking for {format_bytes(request)} while {format_bytes(pool.capacity - st['allocated_bytes.all.current'])} "
              f"is free in total")
        try:
            pool.empty((request,), dtype=torch.uint8)
            print("   (it fit without compaction: the workload was not fragmented enough)")
        except OutOfMemoryError as exc:
            print("   without compaction it fails:")
            print("   " + str(exc).replace("\n", "\n   "))

        _headline("3. pool.compact()")
        report = pool.compact(verify=True, progress=True)
        print(f"   {report}")
        _print_stats(pool)
        after = pool.layout()

        _headline("4. The request again")
        big = pool.empty((request,), dtype=torch.uint8)
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
