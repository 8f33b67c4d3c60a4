"""The rescue of an operation that ran out of memory, for a whole program (`defrag run --rescue`).

`enable()` makes every top-level torch operation of the calling thread run
under a C++ dispatcher fallback (`defrag/native/op_rescue.cpp`). When an
operation fails with an out-of-memory error, it has unwound: nothing holds
its tensors' addresses but their storages, so this is a safe point. The
fallback then calls `_rescue` here, which

1. pins the operation's tensor arguments (their blocks stay where they are);
2. compacts every open pool with PyTorch's own blocks moving (their owners
   matched once, `defrag.owners`), meshing what cannot move;
3. unpins them; the fallback runs the operation again, once, with the same
   arguments. A second failure propagates.

What it does not do: it never runs again an operation that writes to an
argument (in-place, `out=`), which may have written part of its result
before it failed; it rescues only the threads that enabled it (and the
workers PyTorch runs on their behalf); a random operation that ran out of
memory after drawing its numbers draws again.

Cost on the happy path: the C++ fallback copies each operation's argument
references (no data); `benchmarks/bench_rescue.py` measures it against a
Python `TorchDispatchMode` (docs/benchmarks.md).
"""

from __future__ import annotations

import logging
import traceback
from collections import Counter

from .units import format_bytes

_log = logging.getLogger("defrag")

# What the last rescue did, for the OOM message of an operation it could not save (one line), and the
# PyTorch-made bytes it moved in all.
last_note = ""


def enable() -> None:
    """Rescue the calling thread's operations that run out of memory (see the module docstring).
    RuntimeError when the native module cannot (its dispatcher key is taken)."""
    from . import oom
    from .native import load_module

    module = load_module()
    module.enable_rescue(_rescue)
    # A request refused inside the operation's second run says what the rescue moved and could not.
    oom.set_rescue_note(lambda: last_note if module.rescue_retrying() else "")


def disable() -> bool:
    """The calling thread's operations are no longer rescued; False when they were not."""
    from .native import load_module

    return bool(load_module().disable_rescue())


def counters() -> dict:
    """Operations rescued (failed, then ran again and succeeded), failed (the rescue freed nothing, or
    the second run failed too), and mutating (an operation that writes an argument ran out of memory:
    never run again)."""
    from .native import load_module

    out = dict(load_module().rescue_counters())
    out.pop("enabled_here", None)
    return out


def _rescue(arguments: list) -> bool:
    """Called by the fallback, with the GIL, after an operation ran out of memory: compact at this safe
    point with the operation's tensor `arguments` pinned (`retry.arguments_pinned`, as `retry_on_oom`).
    True when the compaction ran (the operation runs again, once, even if nothing was freed: its second
    failure's message then says what the rescue did); False when it failed. Never raises (it is called
    across the C boundary)."""
    global last_note
    try:
        from .pool import open_pools, safe_point
        from .retry import arguments_pinned

        pools = [p for p in open_pools() if not p.closed]
        moved, stuck = 0, Counter()
        with safe_point(pools), arguments_pinned(pools, arguments):
            for pool in pools:
                moved += pool.compact().moved_bytes
        for pool in pools:  # a safe point of its own: the owners as they are after the moves
            for t in pool.live_tensors():
                if not t.movable:
                    stuck[t.reason] += t.block_bytes
        worst = "; ".join(f"{format_bytes(n)} {why}" for why, n in stuck.most_common(2))
        last_note = (f"  rescue: at the failed operation, a compaction moved {format_bytes(moved)} of tensors"
                     + (f"; could not move {format_bytes(sum(stuck.values()))} ({worst})" if stuck else ""))
        # Run it again even when nothing was freed: its second failure then says what the rescue did.
        return True
    except Exception:
        _log.error("defrag: the rescue of an operation that ran out of memory failed\n%s", traceback.format_exc())
        return False
