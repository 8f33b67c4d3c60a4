"""`OutOfMemoryError`: what a user sees when a pool cannot satisfy a request.

It subclasses `torch.OutOfMemoryError`, so existing `except
torch.OutOfMemoryError` handlers keep working; the torch-free layers raise
`defrag.core.OutOfRoom`, which the torch faces turn into this.

`refused_inside_allocator` words the error for a pool installed as
PyTorch's allocator (`defrag.install`, `defrag run`), where the usual
advice (unpin, compact, retry) does not fit: PyTorch's own blocks cannot
move at all.
"""

from __future__ import annotations

import torch

from .units import format_bytes


class OutOfMemoryError(torch.OutOfMemoryError):
    """A pool could not satisfy an allocation request.

    The message names the request, the capacity, what is live, what is stranded
    in half-used pages, what is pinned, and what was already tried. The same
    figures are available as attributes (`requested`, `capacity`, `live`,
    `stranded`, `pinned`, `tried`), and all of them, with those
    `defrag.readout.OutOfRoom` lists, in `figures`.
    """

    def __init__(self, message: str, **figures):
        super().__init__(message)
        self.figures = dict(figures)
        self.requested = figures.get("requested")
        self.capacity = figures.get("capacity")
        self.live = figures.get("live")
        self.stranded = figures.get("stranded")
        self.pinned = figures.get("pinned")
        self.tried = tuple(figures.get("tried", ()))


# How the user sets the capacity of the pool installed as PyTorch's allocator: `defrag run` sets its
# option here (it owns the process); None: the program called defrag.install(pool) itself.
_capacity_option: str | None = None


def set_capacity_option(option: str | None) -> None:
    """Name the command-line option that sets the installed pool's capacity (`defrag run`: "--capacity"),
    so that an out-of-memory error inside PyTorch's allocator names it; None: `defrag.Pool(capacity=...)`."""
    global _capacity_option
    _capacity_option = option


# This process's (rank, world size) when a launcher such as torchrun started it as one of several ranks:
# `defrag run` sets it here, so that an out-of-memory error inside PyTorch's allocator names the rank.
_rank: tuple[int, int] | None = None


def set_rank(rank: tuple[int, int] | None) -> None:
    """Name this process's (rank, world size) under torchrun (`defrag run` does), so that an out-of-memory
    error inside PyTorch's allocator begins "[rank 1/2]"; None: a single process, no rank named."""
    global _rank
    _rank = rank


def capacity_option_value(nbytes: int) -> str:
    """`nbytes` as a size the user can type back ("3GiB", "1624MiB"), rounded up to a whole MiB."""
    gib, mib = 1 << 30, 1 << 20
    return f"{nbytes // gib}GiB" if nbytes % gib == 0 else f"{-(-nbytes // mib)}MiB"


def refused_inside_allocator(error: OutOfMemoryError) -> str:
    """The message for a request PyTorch's allocator made of the installed pool and the pool refused.

    The error's facts (request, capacity, live, stranded, tried, largest
    tensors), then what is true there in place of the pool's own suggestion:
    the request came from inside an operation, which holds its tensors' raw
    addresses, so nothing moves there; how much is stranded between them;
    the capacity that would have served the request now (`--capacity` under
    `defrag run`), unless the device is the limit; freeing what the
    program no longer needs; and, for data the program owns, a `defrag.Pool`
    whose tensors can move. Compacting between steps is named only when the
    pool holds tensors that can move. Falls back to the error's own message
    when it lacks these figures.
    """
    f = error.figures
    if "facts" not in f:
        return str(error)
    if _rank is not None:  # under torchrun: which rank ran out, on the message's first line
        f = {**f, "facts": (f"[rank {_rank[0]}/{_rank[1]}] {f['facts'][0]}", *f["facts"][1:])}
    fb = format_bytes
    nbytes, capacity, live, stranded = f["requested"], f["capacity"], f["live"], f["stranded"]
    movable, need, device = f["movable"], f["capacity_needed"], f["device_total"]
    unmovable = max(live - movable, 0)
    enough = "enough free pages for this request with this layout; later requests may need more"
    knob = (f"run with {_capacity_option} {capacity_option_value(need)} or more ({enough})" if _capacity_option
            else f"make the installed pool with defrag.Pool(capacity={capacity_option_value(need)!r}) or more ({enough})")
    where = "defrag run" if _capacity_option else "defrag.install"
    why = (f"  why: under {where} the pool is PyTorch's allocator, and this request came from inside an operation, "
           f"which holds its tensors' raw addresses: nothing moves there ({fb(unmovable)} of PyTorch's blocks live)")
    helps = []
    fragmented = nbytes <= capacity and live + nbytes <= capacity
    if f["device_full"]:
        why += (f"; and the device gave no more pages (it has {fb(device)} in all; other processes or pools hold "
                f"the rest), so a larger capacity would not help either")
        helps.append("free memory held outside this pool (other processes, other pools' trim())")
    elif nbytes > capacity:
        if nbytes > device:
            why += f"; the request alone is larger than the whole device ({fb(device)})"
            helps.append("split the tensor")
        else:
            why += f"; the request alone is larger than the pool's capacity ({fb(capacity)})"
            helps.append(knob)
    elif fragmented:
        why += (f". Live + request = {fb(live + nbytes)} fits in the capacity ({fb(capacity)}): {fb(stranded)} is "
                f"free but stranded between PyTorch's blocks, in pages that each still hold some of them "
                f"(fragmentation)")
        helps.append(knob if need <= device else f"no capacity: this request would need {fb(need)}, more than "
                                                    f"the device's {fb(device)}")
    else:
        why += (f". Live + request = {fb(live + nbytes)} is more than the capacity ({fb(capacity)}): the program "
                f"needs more memory than the pool has, not a better layout")
        helps.append(knob if need <= device else f"no capacity: this request would need {fb(need)}, more than "
                                                    f"the device's {fb(device)}")
    helps.append("free what the program no longer needs before this request")
    note = _rescue_note()
    if fragmented and not note:
        between = ("defrag run --rescue (the failed operation runs again once, after a compaction that moves "
                   "PyTorch's tensors too) or --compact-at step" if _capacity_option else
                   "defrag.compact() between steps, where no operation runs")
        helps.append(f"let PyTorch's tensors move between operations: {between}")
        helps.append("keep the program's own large, long-lived data (KV caches, buffers) in a defrag.Pool "
                     "(pool.empty, pool.adopt): tensors there can move, and compacting them between steps gives "
                     "back the pages between them")
    if movable:
        helps.append(f"compact this pool's own {fb(movable)} of movable tensors between steps (pool.compact(), "
                     f"or defrag.retry_on_oom): not tried inside PyTorch's allocator, where an op may hold its "
                     f"inputs' addresses")
    lines = [*f["facts"], why + ".", "  what would help: " + "; or ".join(helps) + "."]
    if note:  # the operation's second run, after a rescue (defrag run --rescue): what it moved
        lines.insert(len(f["facts"]), note)
    return "\n".join(lines)


_rescue_note = str  # () -> "" or what the rescue of the failing operation did (`set_rescue_note`)


def set_rescue_note(note) -> None:
    """`note() -> str`: what the rescue of the operation now running again did ("" when none runs again);
    `refused_inside_allocator` adds it to its message (`defrag.rescue.enable` sets it)."""
    global _rescue_note
    _rescue_note = note
