"""`PoolMeshing`: pages that cannot move share physical pages, the torch-facing half.

A part of `defrag.pool.Pool` (a mixin it inherits). The machinery is
`defrag.mesher` over the `Core` (torch-free); this only takes the pool's lock
and says which threads' tensors may be copied. What it relies on from the
`Pool`: `core` (its `gate`, `scope`) and, from its `_context`
(`defrag.pool_context.PoolContext`), `mover` (its stream) and `relieve()`.
"""

from __future__ import annotations

import logging

from .mesher import MeshReport, mesh_core, split_all

_log = logging.getLogger("defrag")


class PoolMeshing:
    """The `Pool`'s `mesh` and `unmesh`, and the meshing step of `trim` (see the module docstring)."""

    def mesh(self, *, release: bool = False, threads: str | None = None, engine: str | None = None) -> MeshReport:
        """Share physical pages between pages whose live bytes are disjoint at page offsets, moving no
        tensor (every address stays; pinned tensors and PyTorch-owned blocks too): each group's live
        bytes are copied into one physical page mapped at every page of the group, and the others'
        physical pages are freed (cached; released to the device with `release=True`).
        `threads` and `engine` as for `compact`. A driver fault rolls back the group it hit (every byte and
        mapping as before) and is raised. Returns a `defrag.mesher.MeshReport`."""
        self._context.relieve()
        with self.core.gate:
            self.core.check_open()
            return mesh_core(self.core, scope=self.core.scope(threads), stream=self._context.mover.stream(),
                             release=release, engine=engine)

    def unmesh(self) -> int:
        """Give every meshed page a physical page of its own again (bytes intact); returns how many.
        ValueError (nothing changed for the rest) when the pool has too few free physical pages."""
        with self.core.gate:
            self.core.check_open()
            return split_all(self.core)

    def _mesh_to_release(self) -> int:
        """`trim`'s first step (the gate held): mesh, releasing the physical pages that frees to the device;
        returns the bytes released. A driver fault rolls that mesh back and is logged."""
        if self.core.space.sleeping:
            return 0
        report = mesh_core(self.core, scope=self.core.scope(None), stream=self._context.mover.stream(), release=True,
                           raise_errors=False)
        if report.error:
            _log.warning("defrag: trim's meshing stopped after a driver fault (rolled back): %s", report.error)
        return report.released_pages * self.core.page_size
