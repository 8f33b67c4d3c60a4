"""`defrag.distributed`: compaction decided together by every rank of a torch.distributed job.

Each rank (process) has its own pool. A compaction stalls its rank, and in
synchronous data-parallel training (DDP, FSDP) a stalled rank stalls every
rank at the next collective, so the ranks should compact at the same step:
when one rank must, the others are about to wait for it anyway and may as
well use the wait. `compact(pool)` is that decision, made with
torch.distributed's own collectives (nothing here talks to other processes
by any other means):

1. every rank measures its pool: `stranded_bytes` (free bytes inside pages
   that hold live data: what a compaction recovers) and how many allocations
   needed the allocation ladder (their first placement failed:
   `num_alloc_retries` grew) since its previous decision on this pool;
2. one `all_gather` of those figures (a 4-element int64 tensor per rank; on
   the CPU for gloo, on the current CUDA device for NCCL);
3. a rank *asks* for a compaction when its stranded bytes are at least its
   `min_stranded`, or when an allocation needed the ladder and it has
   stranded bytes at all; if any rank asks, every rank compacts its own pool
   now (`Pool.compact`), else none does. Every rank sees the same figures,
   so every rank makes the same decision.

Failures. A rank whose own part fails before the exchange (a bad argument,
a closed pool) still takes part in it, marked as failed, and then raises its
own error; the other ranks raise `CollectiveError` naming it, at once, and
the process group stays usable. A rank that never reaches the collective (it
raised elsewhere, or died) cannot be told apart from a slow one: the others
wait for the process group's timeout (`init_process_group(timeout=...)`,
`new_group(timeout=...)`; torch's default is 30 minutes for gloo, 10 for
NCCL) or until its connection closes, and then raise `CollectiveError`; the
group is then out of step and should be destroyed. A compaction that fails
on one rank after the decision raises there; the others finish theirs.

What this does not do: pools are never shared between ranks, nothing is
moved across devices, and no tensor of DDP's or FSDP's own (gradient
buckets, FSDP's flat parameters) enters a pool unless you `adopt` it. Raw
pointers kept by other code (CUDA graphs, NCCL user-buffer registration)
are the user's to pin; docs/guide.md ("Several GPUs") says what was
checked.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .compactor import CompactionReport
from .errors import CollectiveError, PoolClosedError
from .pool import Pool
from .units import format_bytes, parse_size

__all__ = ["compact", "decide", "stats", "CompactEvery", "Decision", "GatheredStats", "CollectiveError"]

_log = logging.getLogger("defrag")

DEFAULT_MIN_STRANDED = "1GiB"

# num_alloc_retries of each pool at this rank's previous decision on it: the
# ladder signal is "an allocation needed the ladder since then".
_retries_seen: "weakref.WeakKeyDictionary[Pool, int]" = weakref.WeakKeyDictionary()

# The figures each rank contributes, in this order.
_OK, _STRANDED, _RETRIED, _WANTS = range(4)


@dataclass(frozen=True)
class Decision:
    """What the ranks decided together, identical on every rank of the group.

    `stranded[i]`, `retried[i]`: group rank i's stranded bytes and the
    allocations that needed the ladder since its previous decision on its
    pool; `wanted_by`: the group ranks that asked for a compaction;
    `compact`: whether every rank compacts (`wanted_by` is not empty).
    """

    compact: bool
    stranded: tuple[int, ...]
    retried: tuple[int, ...]
    wanted_by: tuple[int, ...]

    def __str__(self) -> str:
        per_rank = ", ".join(format_bytes(s) for s in self.stranded)
        if not self.compact:
            return f"no rank asked for a compaction (stranded per rank: {per_rank})"
        ranks = ", ".join(str(r) for r in self.wanted_by)
        return (f"rank{'s' if len(self.wanted_by) > 1 else ''} {ranks} asked for a compaction: every rank compacts "
                f"(stranded per rank: {per_rank}; ladder climbs per rank: {list(self.retried)})")


def _group_rank(group, what: str) -> tuple[int, int]:
    """(this rank in `group`, the group's size); raises before any collective when there is no group."""
    if not dist.is_available():
        raise RuntimeError(f"{what}: this build of torch has no torch.distributed")
    if not dist.is_initialized():
        raise RuntimeError(f"{what} is a collective and needs a process group: call "
                           f"torch.distributed.init_process_group(...) on every rank first")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"{what}: this process (global rank {dist.get_rank()}) is not a member of the group it was "
                         f"given; call it only on the group's ranks")
    return rank, dist.get_world_size(group)


def _figures_device(group) -> torch.device:
    """Where the exchanged figures live: NCCL moves only CUDA tensors; every other backend takes CPU ones."""
    if str(dist.get_backend(group)) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _run(what: str, collective: str, rank: int, world: int, fn):
    """Run one collective; turn the backend's failure (a timeout, a peer gone) into a CollectiveError."""
    try:
        return fn()
    except RuntimeError as exc:  # gloo timeouts and closed connections; DistBackendError is a RuntimeError
        raise CollectiveError(
            f"{what}: the {collective} across the ranks failed on rank {rank} of {world}: another rank raised or "
            f"exited before reaching it, or did not reach it within the process group's timeout "
            f"(init_process_group(timeout=...)). The process group may now be out of step: destroy it. "
            f"Cause: {type(exc).__name__}: {exc}", collective=what, rank=rank) from exc


def _exchange(what: str, group, local):
    """All-gather each rank's figures, computed by `local()` on every rank.

    `local()` returns the rank's figures (a list of ints) or raises. A rank
    whose `local()` raised still takes part (marked failed), so no rank waits
    for it; then every rank learns who failed and why, the failed ranks
    re-raise their own error and the others raise CollectiveError.
    """
    rank, world = _group_rank(group, what)
    error = None
    try:
        figures = [1, *local()]
    except Exception as exc:  # re-raised below, after the other ranks were told
        error, figures = exc, [0, 0, 0, 0]
    device = _figures_device(group)
    mine = torch.tensor(figures, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    _run(what, "all_gather", rank, world, lambda: dist.all_gather(gathered, mine, group=group))
    rows = [g.tolist() for g in gathered]
    failed = [r for r, row in enumerate(rows) if row[_OK] != 1]
    if failed:
        # Every rank knows someone failed, so every rank takes part in this second exchange.
        notes: list = [None] * world
        note = f"{type(error).__name__}: {error}" if error is not None else ""
        _run(what, "all_gather_object", rank, world, lambda: dist.all_gather_object(notes, note, group=group))
        if error is not None:
            raise error
        described = "; ".join(f"rank {r}: {notes[r]}" for r in failed)
        raise CollectiveError(f"{what}: {'rank' if len(failed) == 1 else 'ranks'} {', '.join(map(str, failed))} "
                              f"of {world} failed before the decision, so no rank compacted ({described})",
                              collective=what, rank=rank, failed_ranks={r: notes[r] for r in failed})
    return rows


def _decide(pool, min_stranded, group, what: str, check=None) -> Decision:
    retries = None

    def local():
        nonlocal retries
        if not isinstance(pool, Pool):
            raise TypeError(f"{what}: pool must be a defrag.Pool, got {type(pool).__name__}")
        threshold = parse_size(min_stranded, what="min_stranded")
        if check is not None:
            check()
        if pool.closed:
            raise PoolClosedError(f"{what}: pool #{pool.id} is closed")
        st = pool.stats()
        retries = st["num_alloc_retries"]
        retried = retries - _retries_seen.get(pool, 0)
        stranded = st["stranded_bytes"]
        wants = stranded >= threshold or (retried > 0 and stranded > 0)
        return [stranded, retried, int(wants)]

    rows = _exchange(what, group, local)
    _retries_seen[pool] = retries  # only after a completed exchange: a failed one loses no ladder climb
    wanted = tuple(r for r, row in enumerate(rows) if row[_WANTS])
    return Decision(bool(wanted), tuple(row[_STRANDED] for row in rows), tuple(row[_RETRIED] for row in rows), wanted)


def decide(pool: Pool, *, min_stranded=DEFAULT_MIN_STRANDED, group=None) -> Decision:
    """The collective decision of `compact` without compacting: a `Decision`, the same on every rank.

    Every rank of `group` (default: the whole job) must call it at the same
    point. It counts as this rank's decision for the ladder signal (the next
    call sees only ladder climbs after this one).
    """
    return _decide(pool, min_stranded, group, "defrag.distributed.decide")


def _compact_options() -> set[str]:
    return {p.name for p in inspect.signature(Pool.compact).parameters.values() if p.kind is p.KEYWORD_ONLY}


def compact(pool: Pool, *, min_stranded=DEFAULT_MIN_STRANDED, group=None, **compact_kwargs) -> CompactionReport | None:
    """Collective compaction: if any rank's pool strands `min_stranded` or more, every rank compacts now.

    A collective: every rank of `group` (default: the whole job) must call it
    at the same point, for example between training steps. `min_stranded`:
    bytes or a size string such as "2MiB"; a rank also asks for a compaction
    when an allocation of its pool needed the allocation ladder since its
    previous call and it has any stranded bytes (0 means compact at every
    call). `compact_kwargs` go to `Pool.compact` (`verify`, `progress`,
    `engine`, `release`, `threads`).

    Returns this rank's `CompactionReport` when the ranks compacted, None
    when none did; every rank returns the same kind of answer. Bad arguments
    and a closed pool raise on their rank after one exchange (the other
    ranks raise `CollectiveError` naming it), so the pool is unchanged and no
    rank hangs; a rank that never calls makes the others raise
    `CollectiveError` after the group's timeout. It does not compact other
    pools of the process, and it does not synchronize the ranks after the
    compaction: the next collective of the training step does.
    """
    what = "defrag.distributed.compact"

    def check():
        unknown = sorted(set(compact_kwargs) - _compact_options())
        if unknown:
            raise TypeError(f"{what}: unknown argument{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} "
                            f"(Pool.compact takes {', '.join(sorted(_compact_options()))})")

    decision = _decide(pool, min_stranded, group, what, check)
    if not decision.compact:
        return None
    _log.info("%s: %s", what, decision)
    return pool.compact(**compact_kwargs)


# ---------------------------------------------------------------------- stats
def summary_line(rank: int, st: dict) -> str:
    """One log line for one rank's `pool.stats()`."""
    return (f"rank {rank}: allocated {format_bytes(st['allocated_bytes.all.current'])}, "
            f"reserved {format_bytes(st['reserved_bytes.all.current'])}, "
            f"stranded {format_bytes(st['stranded_bytes'])} ({st['fragmentation']:.1%}), "
            f"largest free {format_bytes(st['largest_free_bytes'])}, "
            f"compactions {st['num_compactions']} ({st['num_compactions.automatic']} automatic), "
            f"ladder climbs {st['num_alloc_retries']}, OOMs {st['num_ooms']}")


@dataclass(frozen=True)
class GatheredStats:
    """Every rank's `pool.stats()` (`ranks[i]` is group rank i's), gathered on rank 0 by `stats`."""

    ranks: tuple[dict, ...]

    def lines(self) -> list[str]:
        """One summary line per rank, for logs."""
        return [summary_line(r, st) for r, st in enumerate(self.ranks)]

    def __str__(self) -> str:
        return "\n".join(self.lines())


def stats(pool: Pool, group=None) -> GatheredStats | None:
    """Gather every rank's `pool.stats()` on the group's rank 0; None on the other ranks.

    A collective (`gather_object`): every rank of `group` must call it. On
    NCCL, set each rank's CUDA device first (`torch.cuda.set_device`), as
    torch's object collectives require. `str()` of the result is one summary
    line per rank. A rank given something that is not a pool still takes
    part, then raises TypeError; rank 0 then raises CollectiveError naming it.
    """
    what = "defrag.distributed.stats"
    rank, world = _group_rank(group, what)
    error = None
    try:
        if not isinstance(pool, Pool):
            raise TypeError(f"{what}: pool must be a defrag.Pool, got {type(pool).__name__}")
        mine = {"stats": pool.stats()}
    except Exception as exc:  # re-raised below, after rank 0 was told
        error, mine = exc, {"error": f"{type(exc).__name__}: {exc}"}
    dst = 0 if group is None else dist.get_global_rank(group, 0)
    gathered: list | None = [None] * world if rank == 0 else None
    _run(what, "gather_object", rank, world, lambda: dist.gather_object(mine, gathered, dst=dst, group=group))
    if error is not None:
        raise error
    if rank != 0:
        return None
    failed = {r: g["error"] for r, g in enumerate(gathered) if "error" in g}
    if failed:
        described = "; ".join(f"rank {r}: {note}" for r, note in failed.items())
        raise CollectiveError(f"{what}: {len(failed)} of {world} ranks could not give their stats ({described})",
                              collective=what, rank=rank, failed_ranks=failed)
    return GatheredStats(tuple(g["stats"] for g in gathered))


# ---------------------------------------------------------------------- the training-loop hook
class CompactEvery:
    """A training-loop hook: every `every`-th call runs the collective `compact` on every rank.

    Call `step()` once per optimizer step on every rank, at the same point
    (after `optimizer.step()`, before the next forward: nothing of DDP's or
    FSDP's is in flight then). The object is also callable with any
    arguments, so `optimizer.register_step_post_hook(hook)` works as is.
    Calls between the `every`-th ones do nothing and communicate nothing.

    `steps`: calls so far; `compactions`: collective compactions that ran;
    `last_report`: this rank's report of the latest one (None before).
    Arguments are checked here, on each rank, before any collective.
    """

    def __init__(self, pool: Pool, every: int, *, min_stranded=DEFAULT_MIN_STRANDED, group=None, **compact_kwargs):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"CompactEvery: every must be a whole number of steps >= 1, got {every!r}")
        if not isinstance(pool, Pool):
            raise TypeError(f"CompactEvery: pool must be a defrag.Pool, got {type(pool).__name__}")
        parse_size(min_stranded, what="min_stranded")
        unknown = sorted(set(compact_kwargs) - _compact_options())
        if unknown:
            raise TypeError(f"CompactEvery: unknown argument(s) {', '.join(unknown)} for Pool.compact")
        self.pool, self.every, self.min_stranded, self.group = pool, every, min_stranded, group
        self.compact_kwargs = compact_kwargs
        self.steps = 0
        self.compactions = 0
        self.last_report: CompactionReport | None = None

    def step(self) -> CompactionReport | None:
        """Count one step; on every `every`-th, run `compact` and return its result (else None)."""
        self.steps += 1
        if self.steps % self.every:
            return None
        report = compact(self.pool, min_stranded=self.min_stranded, group=self.group, **self.compact_kwargs)
        if report is not None:
            self.compactions += 1
            self.last_report = report
        return report

    def __call__(self, *args, **kwargs) -> CompactionReport | None:
        return self.step()
