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

From these facts, `Users` (one per core: the threads that used it) gives a
compaction its `Scope`, and `Scope.blocker` is the one test of whether a
block may move. This module knows nothing of torch.
"""

from __future__ import annotations

import itertools
import logging
import threading
import traceback
import weakref
from dataclasses import dataclass

from .errors import ConcurrencyError

_log = logging.getLogger("defrag")

THREAD_MODES = (None, "own", "all")

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


@dataclass(frozen=True)
class Scope:
    """Which blocks one compaction may move (see `Users.scope`)."""

    mine: object  # the caller's owner reference (owner_ref())
    idle: frozenset  # token ids of other threads parked at the gate: their blocks may move
    everything: bool  # no other thread that used the core is running: every unpinned block may move

    def blocker(self, block, can_rewrite=None) -> str:
        """Why a compaction of this scope may not move `block` ("" when it may): the one movability test.

        A block stays where it is while pinned, retired (an old location
        awaiting release), pending (released, the device not done with it),
        offloaded, or owned by a thread this scope may not disturb; then the
        face's own verdict, `can_rewrite(block) -> str` ("" when the face can
        rewrite the block's owner).
        """
        if block.pins:
            return "pinned"
        if block.retired:
            return "retired (awaiting release)"
        if block.pending:
            return "released, waiting for the device to finish with it"
        if block.offloaded:
            return "offloaded to host memory (pool.reload(t) brings it back)"
        if not (self.everything or block.owner is self.mine):
            reason = self._thread_reason(block)
            if reason:
                return reason
        return can_rewrite(block) if can_rewrite is not None else ""

    def mesh_blocker(self, block) -> str:
        """Why a mesh of this scope may not copy `block`'s page ("" when it may): `blocker` minus pins and
        the face's verdict, since meshing changes no address. Between the copy and the remap a write
        by another thread to the block would be lost, so its thread rule stays."""
        if block.retired:
            return "retired (awaiting release)"
        if block.pending:
            return "released, waiting for the device to finish with it"
        if block.offloaded:
            return "offloaded to host memory"
        if not (self.everything or block.owner is self.mine):
            return self._thread_reason(block)
        return ""

    def _thread_reason(self, block) -> str:
        if block.shared:
            return "shared between threads (pool.share), and another thread that used the pool is running"
        if not is_alive(block.owner):
            return ("its thread has ended, and another thread that used the pool is running (it may have "
                    "been handed the tensor: pool.claim(t) there makes it that thread's)")
        if block.owner().id not in self.idle:
            return (f"owned by {describe(block.owner)}, which is running and may be using it: "
                    f"that thread's own compactions move it")
        return ""


class Users:
    """The threads that used one core (each block's owner is one of them), and the scopes they give."""

    __slots__ = ("_refs", "gate", "label")

    def __init__(self, gate: Gate, label: str):
        self._refs: dict[int, object] = {}  # token id -> owner ref
        self.gate = gate
        self.label = label

    def current(self):
        """The calling thread's owner reference, remembering that this thread used the core."""
        token = current_token()
        ref = token.ref
        if self._refs.get(token.id) is not ref:
            self._refs[token.id] = ref
        return ref

    def note(self, refs) -> None:
        """Remember the threads behind owner references `refs` (blocks made where the core did not see)."""
        for ref in refs:
            token = ref() if ref is not None else None
            if token is not None and self._refs.get(token.id) is not ref:
                self._refs[token.id] = ref

    def _others_alive(self, mine) -> list:
        others = []
        for tid, ref in list(self._refs.items()):
            if not is_alive(ref):
                del self._refs[tid]
            elif ref is not mine:
                others.append(ref)
        return others

    def scope(self, mode=None) -> Scope:
        """What a compaction called from this thread may move now (the gate is held).

        A thread is *busy* when it used the core, still runs, and is not
        parked at the gate. None: the caller's blocks and those of parked
        threads, plus blocks of ended threads and shared blocks when no
        other thread is busy; "own": the caller's blocks only; "all": every
        unpinned block, refused with ConcurrencyError while another thread
        is busy.
        """
        if mode not in THREAD_MODES:
            raise ValueError(f"threads must be None, 'own' or 'all', got {mode!r}")
        mine = self.current()
        if mode == "own":
            return Scope(mine, frozenset(), everything=False)
        idle, busy = set(), []
        for ref in self._others_alive(mine):
            if self.gate.parked(ref):
                idle.add(ref().id)
            else:
                busy.append(ref)
        if mode == "all" and busy:
            names = ", ".join(describe(r) for r in busy[:5]) + (" ..." if len(busy) > 5 else "")
            raise ConcurrencyError(
                f"compact(threads='all') needs every other thread that used {self.label} to have ended "
                f"(or to wait inside a pool call), but {len(busy)} still run ({names}): join them first, "
                f"or call pool.compact() in each thread to move its own tensors")
        return Scope(mine, frozenset(idle), everything=not busy)
