"""Thread ownership: which threads may be using a pool block.

The pool's concurrency contract rests on one fact a compaction can check: the
thread that allocated (or adopted, or claimed) a block. Each thread gets one
`ThreadToken` the first time it touches a pool; a block keeps a weak reference
to its owner's token, and the token dies when its thread ends (it lives in a
`threading.local`, which Python clears at thread exit). So, without locks or
hooks in user code:

- `owner_ref()` is the calling thread's token, as the weak reference blocks
  store (one shared object per thread: storing it costs nothing per block);
- `is_alive(ref)` says whether that thread still runs;
- `describe(ref)` names it for error messages.

From these facts `defrag.movability` decides which blocks a compaction may
move. `Gate` is a pool's lock (its native books'), which knows which threads
wait at it or are inside it (they run the pool's own code: *parked*). This
module knows nothing of torch.
"""

from __future__ import annotations

import itertools
import logging
import threading
import traceback
import weakref

_log = logging.getLogger("defrag")

_ids = itertools.count(1)
_local = threading.local()


class ThreadToken:
    """Stands for one running thread; garbage once the thread has ended."""

    __slots__ = ("id", "name", "ident", "ref", "__weakref__")

    def __init__(self) -> None:
        thread = threading.current_thread()
        self.id = next(_ids)
        self.name = thread.name
        self.ident = thread.ident
        self.ref = weakref.ref(self)

    def __repr__(self) -> str:
        return f"<ThreadToken #{self.id} {self.name}>"


def current_token() -> ThreadToken:
    """The calling thread's token (made on first use; lives as long as the thread)."""
    token = getattr(_local, "token", None)
    if token is None:
        token = _local.token = ThreadToken()
    return token


def owner_ref() -> "weakref.ref[ThreadToken]":
    """The weak reference a block stores to name the calling thread as its owner."""
    return current_token().ref


def is_alive(ref) -> bool:
    """Whether the thread behind `ref` (an `owner_ref()`) is still running."""
    return ref is not None and ref() is not None


def describe(ref) -> str:
    """A thread's name for messages: "thread 'worker-1'" or "an ended thread"."""
    token = ref() if ref is not None else None
    return f"thread {token.name!r}" if token is not None else "an ended thread"


class Gate:
    """A pool's lock that also knows which threads are waiting for it or holding it.

    The lock itself is the pool's native books' (`Books.enter` / `Books.leave`):
    one lock for Python's multi-step operations and native placement and
    release. While a thread is inside, native placement declines and releases
    wait in the books' queue, applied in order when it leaves.

    A thread inside the gate (waiting to enter, or in) is running the pool's
    own code, not the user's: it cannot be touching its tensors until the
    gate lets it out, which cannot happen while a compaction holds the lock.
    So a compaction may move the blocks of such a *parked* thread. The count
    is per thread and per gate: a thread parked at another pool's gate may
    be let out at any time and is not parked here. Reentrant, like RLock.
    """

    __slots__ = ("books", "_inside", "_after")

    # How long one native wait for the lock lasts before Python gets to run its signal handlers
    # (a KeyboardInterrupt reaches a thread waiting at the gate within this).
    WAIT_SLICE = 0.05

    def __init__(self, books) -> None:
        self.books = books  # the pool's native books, whose lock this is
        self._inside: dict[int, int] = {}  # token id -> nesting depth; each thread writes only its own key
        self._after: dict[int, list] = {}  # token id -> work put off until that thread leaves (`run_outside`)

    def __enter__(self) -> ThreadToken:
        token = current_token()
        inside = self._inside
        inside[token.id] = inside.get(token.id, 0) + 1
        try:
            enter = self.books.enter
            while not enter(self.WAIT_SLICE):
                pass  # Python runs pending signal handlers between the tries
        except BaseException:  # interrupted while waiting: not inside after all
            self._leave(token.id)
            raise
        return token

    def __exit__(self, *exc) -> None:
        tid = current_token().id
        outermost = self._inside[tid] == 1
        self.books.leave()
        self._leave(tid)
        if outermost and self._after:
            for fn in self._after.pop(tid, ()):
                try:
                    fn()
                except Exception:  # put-off work (a destructor's) must not fail the call it interrupted
                    _log.error("defrag: work put off until the pool's lock was free raised; ignored\n%s",
                               traceback.format_exc())

    def run_outside(self, fn) -> bool:
        """Put `fn` off if the calling thread is inside the gate: it then runs (no arguments) right after
        that thread leaves the gate's outermost level, outside it, and this returns True. False (the
        caller runs it now) otherwise. For destructors that Python runs in the middle of the pool's own
        code (the cyclic collector): taking the reentrant lock there would change the books under the
        call that holds it."""
        tid = current_token().id
        if tid not in self._inside:
            return False
        self._after.setdefault(tid, []).append(fn)
        return True

    def _leave(self, tid: int) -> None:
        depth = self._inside[tid] - 1
        if depth:
            self._inside[tid] = depth
        else:
            del self._inside[tid]

    def parked(self, ref) -> bool:
        """Whether the thread behind owner reference `ref` is waiting at or inside this gate."""
        token = ref() if ref is not None else None
        return token is not None and token.id in self._inside
