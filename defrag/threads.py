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

This module knows nothing of pools or torch; `defrag.core` decides what a
compaction may move from these facts (`Core.scope`).
"""

from __future__ import annotations

import itertools
import threading
import weakref

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

    A thread inside the gate (waiting to enter, or in) is running the pool's
    own code, not the user's: it cannot be touching its tensors until the
    gate lets it out, which cannot happen while a compaction holds the lock.
    So a compaction may move the blocks of such a *parked* thread. The count
    is per thread and per gate: a thread parked at another pool's gate may
    be let out at any time and is not parked here. Reentrant, like RLock.
    """

    __slots__ = ("_lock", "_inside", "books")

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._inside: dict[int, int] = {}  # token id -> nesting depth; each thread writes only its own key
        # The pool's native books when native code places and releases beside Python: held (`hold`)
        # while a thread is inside, so that they never change under a multi-step Python operation.
        self.books = None

    def __enter__(self) -> ThreadToken:
        token = current_token()
        inside = self._inside
        inside[token.id] = inside.get(token.id, 0) + 1
        try:
            self._lock.acquire()
        except BaseException:  # interrupted while waiting: not inside after all
            self._leave(token.id)
            raise
        if self.books is not None and inside[token.id] == 1:  # the outermost entry
            self.books.hold()
        return token

    def __exit__(self, *exc) -> None:
        tid = current_token().id
        if self.books is not None and self._inside[tid] == 1:
            self.books.unhold()
        self._lock.release()
        self._leave(tid)

    def _leave(self, tid: int) -> None:
        depth = self._inside[tid] - 1
        if depth:
            self._inside[tid] = depth
        else:
            del self._inside[tid]

    @property
    def occupants(self) -> dict:
        """The live dict of threads waiting at or inside the gate (token id -> depth): empty exactly when
        no thread is. Read-only to callers (a fast path checks its size without taking the lock)."""
        return self._inside

    def parked(self, ref) -> bool:
        """Whether the thread behind owner reference `ref` is waiting at or inside this gate."""
        token = ref() if ref is not None else None
        return token is not None and token.id in self._inside
