"""Synthetic workloads: LLM serving, model/adapter swapping, an adversarial checkerboard.

Each generator is a plain function of its parameters and a ``seed``; the same
arguments give the same trace. Defaults keep the peak live memory at a few
hundred MiB at most so a real replay on the emulated device takes seconds;
every size scales with the parameters. The training workload, recorded from a
real PyTorch model, is in :mod:`defrag.traces.training`.

What each trace contains is stated in its docstring and in ``trace.meta``;
the properties tests rely on (out-of-order finishes, phase markers) are
recorded there as counts.
"""

from __future__ import annotations

import math

import numpy as np

from .format import Trace

KiB, MiB = 1 << 10, 1 << 20


class _Ids:
    """Fresh integer ids for a trace being built."""

    def __init__(self, trace: Trace):
        self.trace = trace
        self.next = 0

    def alloc(self, size: int) -> int:
        id_ = self.next
        self.next += 1
        self.trace.alloc(id_, int(size))
        return id_


def llm_serving(*, seed: int = 0, steps: int = 1500, arrival_rate: float = 0.2, max_batch: int = 32,
                prompt_median: int = 256, output_median: int = 128, length_sigma: float = 0.9,
                max_tokens: int = 4096, kv_bytes_per_token: int = 8 * KiB, kv_chunk_tokens: int = 64,
                hidden: int = 1024, vocab: int = 32000, weights_bytes: int = 48 * MiB,
                phase_every: int = 8) -> Trace:
    """An LLM server's allocations: weights, per-request KV caches, per-step activations.

    Requests arrive as a Poisson process (``arrival_rate`` per step), with
    prompt and output lengths drawn from log-normal distributions (medians
    ``prompt_median`` and ``output_median``, shape ``length_sigma``, capped at
    ``max_tokens`` in all). Up to ``max_batch`` run at once; the rest wait.

    - Weights: ``weights_bytes`` in eight tensors, allocated first, never freed.
    - KV cache: one buffer per request sized for its tokens rounded up to
      ``kv_chunk_tokens`` (``kv_bytes_per_token`` each: 2 x layers x KV heads
      x head dim x dtype bytes; the default 8 KiB is 8 layers, 4 KV heads of
      64, fp16). When a request outgrows it a buffer one chunk larger is
      allocated and the old one freed (the copy-and-grow of a contiguous
      cache). A request's buffer is freed when it finishes, so requests
      finish out of order (``meta["out_of_order_finishes"]`` counts finishes
      that overtake an earlier admitted request still running).
    - Activations: each step allocates hidden states and logits for the batch
      (and a prefill buffer per admitted prompt) and frees them at its end.
    - A phase marker ``"decode step N"`` every ``phase_every`` steps.
    """
    rng = np.random.default_rng(seed)
    trace = Trace(name="llm-serving")
    ids = _Ids(trace)
    chunk = kv_chunk_tokens
    for i in range(8):
        ids.alloc(weights_bytes // 8 + (i % 3) * 4 * KiB)  # slightly uneven tensors, like real layers
    trace.phase("weights loaded")

    def draw_length(median: int) -> int:
        return max(1, int(rng.lognormal(math.log(median), length_sigma)))

    waiting: list[tuple[int, int]] = []  # (prompt, output)
    running: list[dict] = []
    admitted = finished = out_of_order = grows = 0
    for step in range(1, steps + 1):
        for _ in range(rng.poisson(arrival_rate)):
            prompt = min(draw_length(prompt_median), max_tokens - 1)
            output = min(draw_length(output_median), max_tokens - prompt)
            waiting.append((prompt, output))
        # Admit: KV buffer for the prompt, and a prefill activation freed this step.
        transient = []
        while waiting and len(running) < max_batch:
            prompt, output = waiting.pop(0)
            capacity = -(-(prompt + 1) // chunk) * chunk
            running.append({"order": admitted, "tokens": prompt, "left": output, "capacity": capacity,
                            "kv": ids.alloc(capacity * kv_bytes_per_token)})
            admitted += 1
            transient.append(ids.alloc(prompt * hidden * 2 * 3))  # qkv of the prompt, fp16
        if running:
            batch = len(running)
            transient.append(ids.alloc(batch * hidden * 2))       # hidden states
            transient.append(ids.alloc(batch * hidden * 4 * 2))   # MLP intermediate
            transient.append(ids.alloc(batch * vocab * 4))        # fp32 logits
        # Decode one token for every running request; grow caches that are full.
        still = []
        for req in running:
            req["tokens"] += 1
            req["left"] -= 1
            if req["left"] <= 0:
                if any(other["order"] < req["order"] for other in running if other is not req and other["left"] > 0):
                    out_of_order += 1
                trace.free(req["kv"])
                finished += 1
                continue
            if req["tokens"] >= req["capacity"]:
                req["capacity"] += chunk
                new = ids.alloc(req["capacity"] * kv_bytes_per_token)
                trace.free(req["kv"])
                req["kv"] = new
                grows += 1
            still.append(req)
        running = still
        for id_ in reversed(transient):
            trace.free(id_)
        if step % phase_every == 0:
            trace.phase(f"decode step {step}")
    trace.meta = {
        "generator": "llm_serving", "seed": seed, "steps": steps, "arrival_rate": arrival_rate,
        "max_batch": max_batch, "prompt_median": prompt_median, "output_median": output_median,
        "length_sigma": length_sigma, "max_tokens": max_tokens, "kv_bytes_per_token": kv_bytes_per_token,
        "kv_chunk_tokens": kv_chunk_tokens, "hidden": hidden, "vocab": vocab, "weights_bytes": weights_bytes,
        "phase_every": phase_every, "requests_admitted": admitted, "requests_finished": finished,
        "requests_running_at_end": len(running), "requests_waiting_at_end": len(waiting),
        "out_of_order_finishes": out_of_order, "kv_grows": grows,
    }
    return trace.validate()


# A model is a list of (tensor name, shape); bytes = prod(shape) * 2 (fp16/bf16).
def _decoder(hidden: int, layers: int, vocab: int, ff_mult: float = 4.0) -> list[tuple[str, int]]:
    ff = int(hidden * ff_mult)
    tensors = [("embed", vocab * hidden * 2)]
    for i in range(layers):
        tensors += [(f"l{i}.norm1", hidden * 2), (f"l{i}.qkv", 3 * hidden * hidden * 2),
                    (f"l{i}.o", hidden * hidden * 2), (f"l{i}.norm2", hidden * 2),
                    (f"l{i}.up", hidden * ff * 2), (f"l{i}.down", ff * hidden * 2)]
    tensors += [("norm", hidden * 2), ("head", vocab * hidden * 2)]
    return tensors


DEFAULT_MODELS = {
    # name: (hidden, layers, vocab): about 100-200 MiB each in fp16
    "small-wide": (1024, 6, 32000),
    "mid": (896, 10, 32000),
    "deep-narrow": (640, 20, 50257),
}


def model_swap(*, seed: int = 0, models: dict | None = None, swaps: int = 8, requests_per_model: int = 24,
               adapters: int = 6, adapter_rank: int = 16, kv_bytes_per_token: int = 8 * KiB,
               max_batch: int = 8) -> Trace:
    """A server that swaps base models and LoRA adapters while serving.

    ``models`` maps a name to ``(hidden, layers, vocab)`` (fp16 decoder
    weights: embedding, per layer qkv/o/up/down and norms, head; default
    :data:`DEFAULT_MODELS`, 100-200 MiB each). For each of ``swaps`` rounds
    the next model is loaded tensor by tensor (every model once per cycle,
    each cycle in a random order); then
    ``requests_per_model`` requests are served, each picking one of
    ``adapters`` LoRA adapters (rank ``adapter_rank``: two small tensors per
    layer and projection), loaded on first use and evicted least-recently-used
    when more than half of them are resident; requests hold a KV cache and
    finish out of order; finally the model is unloaded (its tensors and its
    adapters freed) while the last requests' caches may still be alive, as
    when a server drains. Phase markers: ``"load NAME"``, ``"serve NAME"``,
    ``"unload NAME"``.
    """
    rng = np.random.default_rng(seed)
    models = dict(models or DEFAULT_MODELS)
    names = list(models)
    trace = Trace(name="model-swap")
    ids = _Ids(trace)
    loads = adapter_loads = adapter_evictions = 0
    kv_live: list[tuple[int, int]] = []  # (finish time, id)
    clock = 0
    cycle: list[str] = []
    for _ in range(swaps):
        if not cycle:  # every model once per cycle, in a random order
            cycle = [names[int(i)] for i in rng.permutation(len(names))]
        name = cycle.pop(0)
        hidden, layers, vocab = models[name]
        trace.phase(f"load {name}")
        weights = [ids.alloc(size) for _, size in _decoder(hidden, layers, vocab)]
        loads += 1
        trace.phase(f"serve {name}")
        resident: dict[int, list[int]] = {}  # adapter -> tensor ids, in LRU order
        for _ in range(requests_per_model):
            clock += 1
            adapter = int(rng.integers(adapters))
            if adapter in resident:
                resident[adapter] = resident.pop(adapter)
            else:
                if len(resident) >= max(1, adapters // 2):
                    victim = next(iter(resident))
                    for id_ in resident.pop(victim):
                        trace.free(id_)
                    adapter_evictions += 1
                resident[adapter] = [ids.alloc(adapter_rank * hidden * 2) for _ in range(layers * 4 * 2)]
                adapter_loads += 1
            tokens = int(rng.lognormal(math.log(384), 0.8)) + 1
            kv_live.append((clock + int(rng.integers(1, 2 * max_batch)), ids.alloc(tokens * kv_bytes_per_token)))
            act = [ids.alloc(max_batch * hidden * 2 * 4), ids.alloc(max_batch * vocab * 4)]
            for id_ in reversed(act):
                trace.free(id_)
            # Requests whose time has come finish (not in arrival order).
            due = [kv for kv in kv_live if kv[0] <= clock]
            kv_live = [kv for kv in kv_live if kv[0] > clock]
            for _, id_ in due:
                trace.free(id_)
        trace.phase(f"unload {name}")
        order = rng.permutation(len(weights))
        for i in order:
            trace.free(weights[int(i)])
        for tensors in resident.values():
            for id_ in tensors:
                trace.free(id_)
        # Half of the in-flight requests drain now; the rest outlive the swap.
        rng.shuffle(kv_live)
        drained, kv_live = kv_live[: len(kv_live) // 2], kv_live[len(kv_live) // 2:]
        for _, id_ in drained:
            trace.free(id_)
    for _, id_ in kv_live:
        trace.free(id_)
    trace.meta = {
        "generator": "model_swap", "seed": seed, "models": {k: list(v) for k, v in models.items()},
        "swaps": swaps, "requests_per_model": requests_per_model, "adapters": adapters,
        "adapter_rank": adapter_rank, "kv_bytes_per_token": kv_bytes_per_token, "max_batch": max_batch,
        "model_loads": loads, "adapter_loads": adapter_loads, "adapter_evictions": adapter_evictions,
    }
    return trace.validate()


def checkerboard(*, seed: int = 0, total_bytes: int = 128 * MiB, page_size: int = 2 * MiB,
                 rounds: int = 3, large_pages: int = 4) -> Trace:
    """The adversarial pattern for any allocator that cannot move memory.

    Each round fills ``total_bytes`` with small blocks (a size below a page,
    drawn per round from page/8, page/6, page/5, page/3 with the seed),
    frees every other one, so every page stays about half full and no page is
    empty, then asks for large blocks of ``large_pages`` pages until the freed
    bytes are requested again. Without moving live blocks those large
    requests fail at a capacity of ``total_bytes`` (every page is still in
    use); with compaction they fit. At the end of a round all blocks are
    freed. Phase markers: ``"fill R"``, ``"punch R"``, ``"large R"``.
    """
    rng = np.random.default_rng(seed)
    trace = Trace(name="checkerboard")
    ids = _Ids(trace)
    divisors = [8, 6, 5, 3]
    for r in range(rounds):
        small = page_size // divisors[int(rng.integers(len(divisors)))]
        small -= small % 512
        trace.phase(f"fill {r}")
        blocks = [ids.alloc(small) for _ in range(total_bytes // small)]
        trace.phase(f"punch {r}")
        keep = []
        for i, id_ in enumerate(blocks):
            if i % 2:
                trace.free(id_)
            else:
                keep.append(id_)
        freed = (len(blocks) - len(keep)) * small
        trace.phase(f"large {r}")
        large = large_pages * page_size
        bigs = [ids.alloc(large) for _ in range(freed // large)]
        for id_ in keep + bigs:
            trace.free(id_)
    trace.meta = {"generator": "checkerboard", "seed": seed, "total_bytes": total_bytes, "page_size": page_size,
                  "rounds": rounds, "large_pages": large_pages}
    return trace.validate()


GiB = 1 << 30


def random_serving(*, seed: int = 0, steps: int = 60000, free_probability: float = 0.45,
                   live_limit: int = 60 * GiB) -> Trace:
    """A server's allocations at three scales, freed in random order: the page policy's stress test.

    Each of ``steps`` steps frees a random live block with probability
    ``free_probability``, or whenever more than ``live_limit`` bytes are live;
    otherwise it allocates a size drawn evenly from one of three scales (each
    chosen with probability 1/3): a multiple of 512 B under 32 KiB (metadata,
    small activations), a multiple of 256 KiB under 128 MiB (KV-cache buffers)
    or a multiple of 64 MiB under 1 GiB (batches of prefill activations). The
    live bytes climb to ``live_limit`` and hover there, every size class
    freed out of order, so a pool keeps meeting large requests that no free
    range fits while empty pages lie scattered. With the defaults the peak
    live is about 61 GiB: replay it dry at an 80 GiB capacity. No phase
    markers. ``meta`` records the parameters and the allocation count per
    scale.
    """
    rng = np.random.default_rng(seed)
    trace = Trace(name="random-serving")
    live: dict[int, int] = {}  # id -> size
    keys: list[int] = []  # live ids, in an order that makes a random pick O(1)
    total = 0
    scales = [0, 0, 0]
    next_id = 0
    for _ in range(steps):
        if keys and (rng.random() < free_probability or total > live_limit):
            i = int(rng.integers(len(keys)))
            id_ = keys[i]
            keys[i] = keys[-1]
            keys.pop()
            total -= live.pop(id_)
            trace.free(id_)
            continue
        scale = int(rng.integers(3))
        if scale == 0:
            size = 512 * int(rng.integers(1, 32 * KiB // 512))
        elif scale == 1:
            size = 256 * KiB * int(rng.integers(1, 128 * MiB // (256 * KiB)))
        else:
            size = 64 * MiB * int(rng.integers(1, GiB // (64 * MiB)))
        scales[scale] += 1
        id_, next_id = next_id, next_id + 1
        live[id_] = size
        keys.append(id_)
        total += size
        trace.alloc(id_, size)
    trace.meta = {"generator": "random_serving", "seed": seed, "steps": steps,
                  "free_probability": free_probability, "live_limit": live_limit,
                  "allocs_small": scales[0], "allocs_medium": scales[1], "allocs_large": scales[2]}
    return trace.validate()
