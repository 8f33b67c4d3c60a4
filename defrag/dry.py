"""`DryPool`: the pool's own core over the memory-less driver, for dry replays of any size.

A dry replay (``defrag replay --dry``) needs the figures a `defrag.Pool` would
produce (peak live, peak mapped, OOMs, bytes moved) for traces far larger
than this machine: an 80 GiB snapshot has 40,960 pages of 2 MiB. `DryPool`
runs the very same `defrag.core.Core` and `defrag.compactor` code as a real
pool, over `defrag.driver.MemorylessCuda`, which keeps the driver's books but
holds no bytes. The one thing that differs is the face: a block's owner is a
plain key instead of a torch storage, and moving it rewrites a dict entry.
So dry and real replays agree by construction; there is no second policy.

Not modelled: time, and device memory filling up below the capacity.
"""

from __future__ import annotations

from .compactor import CompactionReport, compact_core, rescue
from .core import Block, Core, OutOfRoom
from .driver import Driver
from .units import format_bytes, parse_size


class _KeyMover:
    """The compaction's callbacks for blocks owned by keys (see `defrag.compactor.Mover`)."""

    def __init__(self, dry: "DryPool"):
        self.dry = dry

    def stream(self) -> int:
        return 0

    def can_rewrite(self, block: Block) -> str:
        return ""

    def grip(self, block: Block):
        return (block.info,)  # the key, boxed: any key (0, None) is a valid grip

    def grip_all(self, blocks: list) -> list:
        return [(block.info,) for block in blocks]

    def grippable(self, blocks: list) -> list:
        return [True] * len(blocks)

    def destinations(self, blocks: list) -> list:
        return [None] * len(blocks)  # nothing owns a destination but the core: a rolled-back wave frees it

    def check(self, old: Block, held, dest) -> bool:
        return self.dry._blocks.get(held[0]) is old

    def commit(self, old: Block, new: Block, held, dest) -> None:
        self.dry._blocks[held[0]] = new
        self.dry.core.release(old)  # nothing can use it: a key has no in-flight work

    def lets_go(self) -> bool:
        return True  # a key has no in-flight work, and `commit` released the old block

    def move_in_place(self, olds: list, addresses: list, grips: list) -> int:
        # A key keeps naming its block, which the compaction re-addresses: nothing to change here.
        blocks = self.dry._blocks
        for i, (old, grip) in enumerate(zip(olds, grips)):
            if blocks.get(grip[0]) is not old:
                return i
        return -1

    def commit_all(self, dests) -> None:
        return None  # move by move: a dict entry each


class DryPool:
    """A `defrag.Pool` without memory: the same core and compactor, blocks named by keys.

    ``alloc(key, nbytes)`` returns False (and counts an OOM) where the pool
    would raise OutOfMemoryError; ``free(key)``; ``compact()``; ``stats()``
    exactly as `Pool.stats()`.
    """

    def __init__(self, capacity, page_size="2MiB", auto_compact: bool = True, *, virtual_factor: int = 2,
                 auto_mesh: bool = True):
        capacity = parse_size(capacity, what="capacity")
        page_size = parse_size(page_size, what="page_size")
        if page_size <= 0 or page_size % 4096:
            raise ValueError(f"page_size must be a positive multiple of 4 KiB, got {page_size}")
        if capacity < page_size:
            raise ValueError(f"capacity {format_bytes(capacity)} is smaller than one page ({format_bytes(page_size)})")
        pages = capacity // page_size
        # A device exactly the pool's size: dry replays model the pool, not other users of the device.
        self.driver = Driver.memoryless(capacity=pages * page_size, granularity=page_size)
        self.core = Core(self.driver, capacity_pages=pages, page_size=page_size, auto_compact=auto_compact,
                         virtual_factor=virtual_factor, label="dry pool", auto_mesh=auto_mesh)
        self._blocks: dict = {}  # key -> Block
        self._mover = _KeyMover(self)
        self.peak_held_pages = 0  # the most pages that held blocks at once (see `peak_held_bytes`)
        # The rescues the ladder ran ("rescues") and those that went on to meshing ("meshing"): see
        # `defrag.compactor.rescue`.
        self.rescue_steps = {"rescues": 0, "meshing": 0}

    @property
    def capacity(self) -> int:
        return self.core.capacity

    @property
    def page_size(self) -> int:
        return self.core.page_size

    def alloc(self, key, nbytes: int) -> bool:
        """Place a block of `nbytes` under `key`; False (an OOM, counted) where the pool would raise."""
        if key in self._blocks:
            raise KeyError(f"block {key!r} is already live")
        core = self.core
        with core.gate:
            core.drain()
            try:
                block = core.allocate(int(nbytes), self._rescue)
            except OutOfRoom:
                return False
            block.info = key
            self._blocks[key] = block
            held = core.space.mapped - core.books.empty
            if held > self.peak_held_pages:
                self.peak_held_pages = held
            return True

    def _rescue(self, nbytes: int, tried: list[str]):
        return rescue(self.core, self._mover, nbytes, tried, ran=self.rescue_steps)

    def free(self, key) -> None:
        """Free the block `key` (KeyError if it is not live). Its pages stay mapped.

        Outside the gate the books apply a release at once (`Core.release`): what taking the gate,
        queueing the release and draining it would do, without the two calls it costs each free."""
        self.core.release(self._blocks.pop(key))

    def compact(self, *, release: bool = False, mesh: bool = False) -> CompactionReport:
        """An explicit compaction, as `Pool.compact(mesh=False)` runs it (CompactionError where the pool raises
        it); `mesh=True` meshes after the moves, as `Pool.compact()` does by default."""
        with self.core.gate:
            return compact_core(self.core, self._mover, automatic=False, release=release, mesh=mesh)

    @property
    def peak_held_bytes(self) -> int:
        """The most bytes of pages that held at least one block at once (mapped pages minus empty ones,
        after each allocation). Below peak reserved when the growth policy kept empty pages mapped
        (`defrag.page_growth`), and usually within a few pages of the smallest capacity at which a
        replay completes: the search for that capacity starts there. Counts device pages only (a dry
        pool never offloads)."""
        return self.peak_held_pages * self.core.page_size

    def reserved_bytes(self) -> int:
        """Bytes in mapped pages now (`reserved_bytes.all.current`), without building the whole stats dict.

        Cheap enough to read after every event of a replay; does not update the peak.
        """
        return self.core.space.mapped * self.core.page_size

    def stats(self) -> dict:
        """`Pool.stats()`'s keys and values for the same history."""
        with self.core.gate:
            self.core.drain()
            return self.core.stats_locked()

    def check_invariants(self) -> None:
        self.core.check_invariants()
        assert len(self._blocks) == sum(1 for b in self.core.blocks() if not b.retired)

    def discard(self) -> None:
        """Drop the pool without giving its pages back one by one, for a replay that is done with it.

        Its memory-less device is this object's own books and holds nothing
        outside them (no memory, no file, no process-wide state), so they go
        with it; returning tens of thousands of pages first would cost a
        quarter of a short replay. Does not check that the books balance:
        `close` does that.
        """
        self._blocks.clear()
        self.core.books.clear_unattached()  # the Blocks the books hold go now, with the GIL
        self.core.closed = True

    def close(self) -> None:
        """Give every handle, mapping and reservation back (the memory-less device keeps books only)."""
        self._blocks.clear()
        self.core.closed = True
        self.core.space.release_all()
