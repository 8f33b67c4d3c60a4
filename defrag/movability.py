"""Which blocks a compaction may move: the pool's threads rule and `Scope.blocker`, the one movability test.

A compaction, explicit or automatic, moves a block only when no other
thread can be using it (the contract is written out in `defrag.pool`).
`Users` (one per core) remembers the threads that used the core and gives
a compaction from the calling thread its `Scope`; `Scope.blocker(block)`
says why a block may not move ("" when it may): pinned, retired, pending,
offloaded, owned by a thread this scope may not disturb, or the face's own
verdict. The facts it rests on (who owns a block, which threads still run or
wait at the pool's lock) come from `defrag.threads`. Knows nothing of torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConcurrencyError
from .threads import Gate, current_token, describe, is_alive

THREAD_MODES = (None, "own", "all")


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
        reason = self._state_reason(block, " (pool.reload(t) brings it back)")
        if reason:
            return reason
        return can_rewrite(block) if can_rewrite is not None else ""

    def mesh_blocker(self, block) -> str:
        """Why a mesh of this scope may not copy `block`'s page ("" when it may): `blocker` minus pins and
        the face's verdict, since meshing changes no address. Between the copy and the remap a write
        by another thread to the block would be lost, so its thread rule stays."""
        return self._state_reason(block)

    def _state_reason(self, block, reload_hint: str = "") -> str:
        """What `blocker` and `mesh_blocker` share: a retired, pending or offloaded block (`reload_hint`
        after the offload reason), or one owned by a thread this scope may not disturb; "" otherwise."""
        if block.retired:
            return "retired (awaiting release)"
        if block.pending:
            return "released, waiting for the device to finish with it"
        if block.offloaded:
            return "offloaded to host memory" + reload_hint
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
