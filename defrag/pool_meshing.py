"""`PoolMeshing`: pages that cannot move share physical pages, the torch-facing half.

A part of `defrag.pool.Pool`, built over the pool's
`defrag.pool_context.PoolContext`. The machinery is `defrag.mesher` over the
`Core` (torch-free); this only takes the pool's lock and says which threads'
tensors may be copied. The contracts of `mesh` and `unmesh` are the docstrings
of `Pool`'s methods of the same names. What it uses of the context: `core`
(its `gate`, `scope`, `check_open`), `mover` (its stream) and `relieve()`.
"""

from __future__ import annotations

import logging

from .mesher import MeshReport, mesh_core, split_all

_log = logging.getLogger("defrag")


class PoolMeshing:
    """A `Pool`'s `mesh` and `unmesh`, and the meshing step of `trim` (see the module docstring)."""

    def __init__(self, context):
        self.context = context

    def mesh(self, *, release: bool = False, threads: str | None = None, engine: str | None = None) -> MeshReport:
        context = self.context
        core = context.core
        context.relieve()
        with core.gate:
            core.check_open()
            return mesh_core(core, scope=core.scope(threads), stream=context.mover.stream(),
                             release=release, engine=engine)

    def unmesh(self) -> int:
        core = self.context.core
        with core.gate:
            core.check_open()
            return split_all(core)

    def mesh_to_release(self) -> int:
        """`trim`'s first step (the gate held): mesh, releasing the physical pages that frees to the device;
        returns the bytes released. A driver fault rolls that mesh back and is logged."""
        core = self.context.core
        if core.space.sleeping:
            return 0
        report = mesh_core(core, scope=core.scope(None), stream=self.context.mover.stream(), release=True,
                           raise_errors=False)
        if report.error:
            _log.warning("defrag: trim's meshing stopped after a driver fault (rolled back): %s", report.error)
        return report.released_pages * core.page_size
