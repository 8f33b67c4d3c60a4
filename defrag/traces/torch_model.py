"""A model of PyTorch's CUDA caching allocator, for dry replays without a GPU.

`CachingAllocatorModel` replays PyTorch's placement policy on integer
addresses, with no device and no torch: the same rounding, pools, segment
sizes, best-fit order, splitting and coalescing rules, the same recovery
ladder when a segment cannot be allocated, and ``expandable_segments``. It
keeps ``memory_stats()``' books (``allocated_bytes``, ``reserved_bytes``,
``num_alloc_retries``, ``num_ooms``, ...). ``defrag replay --dry`` runs it
beside the pool as the allocators ``torch (model)`` and
``torch-expandable (model)``.

Written from PyTorch's ``c10/cuda/CUDACachingAllocator.cpp`` (read at commit
001074d25084 of pytorch/pytorch), with the constants and configuration
defaults checked against torch 2.13.0's installed headers
(``c10/core/AllocatorConfig.h``). Function names below are PyTorch's
(``DeviceCachingAllocator::...``):

- ``round_size``: requests round up to a multiple of 512 B (kMinBlockSize),
  at least 512 B; ``roundup_power2_divisions`` (off by default) rounds to
  the next power-of-two division instead.
- ``get_pool``: rounded sizes up to 1 MiB (kSmallSize) go to the small pool,
  larger ones to the large pool; free blocks of a pool are a set ordered by
  (stream, size, address).
- ``get_allocation_size``: a new segment is 2 MiB (kSmallBuffer) for the
  small pool, 20 MiB (kLargeBuffer, ``large_segment_size``) for requests
  under 10 MiB (kMinLargeAlloc), else the request rounded up to 2 MiB
  (kRoundLarge).
- ``get_free_block``: best fit, the smallest free block of the pool that is
  at least the request (lowest address among equal sizes); with
  ``max_split_size`` set, a request under it never takes a block of that
  size or more (the search gives up: a new segment), and a request of that
  size or more takes a block only if it is less than
  ``max_non_split_rounding`` (20 MiB) larger. With expandable segments a
  free block that borders unmapped address space counts as its size plus
  that space, and the search steps to the next larger blocks while they are
  "smaller" so counted.
- ``should_split``: a found block is split when the remainder is at least
  512 B (small pool, or any pool with expandable segments), else (large
  pool) when the request is under ``max_split_size`` and the remainder is
  more than 1 MiB; otherwise the whole block is handed out (and counted as
  allocated). The request takes the block's low end.
- ``malloc``: when no free block fits, ``alloc_block`` (a new segment: fails
  when reserved + the allocation size exceeds the memory limit, as with
  ``set_per_process_memory_fraction``), then ``release_available_cached_blocks``
  (only with ``max_split_size``: free one cached oversize segment that could
  serve the request, else the largest oversize ones until enough) and
  ``alloc_block`` again, then ``release_cached_blocks`` (free every cached
  segment that is entirely free; with expandable segments unmap every whole
  free page) and ``alloc_block`` again (a retry); if that fails, an OOM.
  (``release_available_cached_blocks`` skips expandable blocks, as the newer
  revisions do; the one read asserts on them.)
- ``free_block``: a freed block merges with free neighbours of its segment
  (same mapped state). Segments go back to the device only on the OOM paths
  above and in ``empty_cache``.
- Expandable segments (``find_expandable_block``,
  ``try_allocate_expandable_block``, ``map_block``, ``unmap_block``,
  ``release_expandable_segment``, ``ExpandableSegment::map/unmap``): one
  virtual segment per pool (and stream), 9/8 of the device memory long,
  mapped in pages of 2 MiB (small pool) or 20 MiB (large pool). A request
  that no free block serves is placed at the lowest address where free and
  unmapped space together fit it, and the pages it needs there are mapped
  (all or nothing per call); releasing unmaps every page lying wholly inside
  a free block, and a segment left with nothing mapped is given back.

The memory limit: ``capacity`` is what ``set_per_process_memory_fraction``
imposes (``alloc_block`` refuses when reserved + allocation size would pass
it); ``device_memory`` is the device's physical memory (cudaMalloc and
cuMemCreate fail past it; it also sizes expandable segments' address
space). By default both are ``capacity``: a device of exactly that size, so
reserved never exceeds it. With ``device_memory`` larger (a capped GPU, as
`defrag.replay.torch_baselines` runs PyTorch), expandable segments can map
up to one page beyond ``capacity``, as PyTorch does: its check counts the
allocation size, not the pages mapped.

Not modelled: streams (one stream; no ``record_stream`` events, so blocks
are reusable as soon as freed), CUDA graph private pools and MemPools,
``garbage_collection_threshold`` (off by default), free-memory callbacks,
IPC, memory that CUDA itself or other processes use, and the addresses
cudaMalloc returns (each new segment gets an address above every earlier
one, which matters only when best fit ties between equal-size blocks).
"""

from __future__ import annotations

from sortedcontainers import SortedList

MiB = 1 << 20
K_MIN_BLOCK_SIZE = 512  # kMinBlockSize: every size rounds up to a multiple of this
K_SMALL_SIZE = 1 * MiB  # kSmallSize: the largest "small" request
K_SMALL_BUFFER = 2 * MiB  # kSmallBuffer: small-pool segments (and expandable small-pool pages)
K_MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc: requests under this get a large segment
K_ROUND_LARGE = 2 * MiB  # kRoundLarge: larger requests round up to this
K_LARGE_BUFFER = 20 * MiB  # kLargeBuffer / large_segment_size: large segments, expandable large-pool pages


def roundup_power2_next_division(size: int, divisions: int) -> int:
    """PyTorch's ``roundup_power2_next_division``: `size` rounded up to the next of `divisions` steps
    between the powers of two around it (1200 with 4 divisions: 1280)."""
    if size & (size - 1) == 0:
        return size
    if divisions < 2:
        raise ValueError("only 2 or more divisions are supported")
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)  # power2_floor >> log2(divisions)
    if step == 0:
        return floor << 1
    rounded = size & ~(step - 1)
    return size if rounded == size else rounded + step


def round_size(size: int, divisions: int = 0) -> int:
    """PyTorch's ``round_size``: at least 512 B, a multiple of 512 B (or a power-of-two division)."""
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    if divisions > 1 and size > K_MIN_BLOCK_SIZE * divisions:
        return roundup_power2_next_division(size, divisions)
    return -(-size // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE


def allocation_size(size: int, large_segment: int = K_LARGE_BUFFER) -> int:
    """PyTorch's ``get_allocation_size``: the size of the segment a (rounded) request would get."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return large_segment
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


class Block:
    """A block of a segment: allocated, free (mapped) or, in an expandable segment, unmapped."""

    __slots__ = ("addr", "size", "allocated", "mapped", "prev", "next", "segment", "requested")

    def __init__(self, addr: int, size: int, segment: "Segment", mapped: bool = True):
        self.addr, self.size, self.segment, self.mapped = addr, size, segment, mapped
        self.allocated = False
        self.prev = self.next = None
        self.requested = 0

    def __repr__(self) -> str:
        state = "allocated" if self.allocated else ("free" if self.mapped else "unmapped")
        return f"Block({self.addr:#x}, {self.size}, {state})"


class Segment:
    """A cudaMalloc'd segment, or an expandable segment's reserved address range (`page` > 0)."""

    __slots__ = ("base", "size", "small", "page", "mapped", "head")

    def __init__(self, base: int, size: int, small: bool, page: int = 0):
        self.base, self.size, self.small, self.page = base, size, small, page
        self.mapped = 0 if page else size
        self.head: Block | None = None

    @property
    def expandable(self) -> bool:
        return self.page > 0


class BlockPool:
    """One of PyTorch's two pools: free mapped blocks by (size, address), unmapped blocks by address."""

    __slots__ = ("small", "free", "free_at", "unmapped", "unmapped_at")

    def __init__(self, small: bool):
        self.small = small
        self.free = SortedList()  # (size, addr) of free mapped blocks: PyTorch's BlockComparatorSize
        self.free_at: dict = {}  # addr -> Block
        self.unmapped = SortedList()  # addr of unmapped blocks (expandable segments): BlockComparatorAddress
        self.unmapped_at: dict = {}

    def insert(self, b: Block) -> None:
        if b.mapped:
            self.free.add((b.size, b.addr))
            self.free_at[b.addr] = b
        else:
            self.unmapped.add(b.addr)
            self.unmapped_at[b.addr] = b

    def erase(self, b: Block) -> None:
        if b.mapped:
            self.free.remove((b.size, b.addr))
            del self.free_at[b.addr]
        else:
            self.unmapped.remove(b.addr)
            del self.unmapped_at[b.addr]


class CachingAllocatorModel:
    """PyTorch's caching allocator on one device and one stream, without memory.

    ``malloc(nbytes)`` returns a `Block` or None (an OOM, counted, after the
    recovery ladder, exactly where PyTorch raises OutOfMemoryError);
    ``free(block)``; ``empty_cache()``; ``stats()`` with ``memory_stats()``'
    key names; ``segments()`` like the snapshot's. ``alloc(key, nbytes)`` /
    ``free_key(key)`` name blocks by keys, as `defrag.dry.DryPool` does.

    ``capacity``: the memory limit (``set_per_process_memory_fraction``).
    ``device_memory``: the device's memory (default ``capacity``).
    ``expandable_segments``, ``max_split_size`` (None: unlimited, PyTorch's
    default; else more than 20 MiB, as PyTorch requires),
    ``max_non_split_rounding`` (20 MiB), ``roundup_power2_divisions`` (0:
    off) and ``large_segment_size`` (20 MiB) are PyTorch's
    ``PYTORCH_CUDA_ALLOC_CONF`` settings of those names.
    """

    def __init__(self, capacity: int, *, expandable_segments: bool = False, max_split_size: int | None = None,
                 max_non_split_rounding: int = K_LARGE_BUFFER, roundup_power2_divisions: int = 0,
                 large_segment_size: int = K_LARGE_BUFFER, device_memory: int | None = None):
        capacity = int(capacity)
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        if max_split_size is not None and max_split_size <= K_LARGE_BUFFER:
            raise ValueError(f"max_split_size must be more than 20 MiB (PyTorch's rule), got {max_split_size}")
        if roundup_power2_divisions and (roundup_power2_divisions < 2
                                         or roundup_power2_divisions & (roundup_power2_divisions - 1)):
            raise ValueError(f"roundup_power2_divisions must be 0 or a power of two >= 2, got "
                             f"{roundup_power2_divisions}")
        self.capacity = capacity
        self.device_memory = capacity if device_memory is None else int(device_memory)
        self.expandable = bool(expandable_segments)
        self.max_split_size = max_split_size
        self.max_non_split_rounding = int(max_non_split_rounding)
        self.divisions = int(roundup_power2_divisions)
        self.large_segment = int(large_segment_size)
        self.small = BlockPool(small=True)
        self.large = BlockPool(small=False)
        self.segments_live: dict = {}  # base -> Segment
        self._next_va = 1 << 40  # addresses handed to new segments, each above all earlier ones
        self._keys: dict = {}
        # memory_stats() counters (aggregate pool)
        self.allocated = self.allocated_peak = 0
        self.requested = self.requested_peak = 0
        self.reserved = self.reserved_peak = 0
        self.active_blocks = 0
        self.num_alloc_retries = self.num_ooms = 0
        self.num_device_alloc = self.num_device_free = 0
        self.num_segments = 0

    # ------------------------------------------------------------------ sizes
    def round_size(self, nbytes: int) -> int:
        return round_size(nbytes, self.divisions)

    def allocation_size(self, size: int) -> int:
        return allocation_size(size, self.large_segment)

    # ------------------------------------------------------------------ public API
    def malloc(self, nbytes: int) -> Block | None:
        """PyTorch's ``DeviceCachingAllocator::malloc`` for one stream: a Block, or None for an OOM."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        size = self.round_size(nbytes)
        pool = self.small if size <= K_SMALL_SIZE else self.large
        alloc_size = self.allocation_size(size)
        block = self._get_free_block(pool, size)
        if block is None:
            block = (self._alloc_block(pool, size, alloc_size, False)
                     or (self._release_available_cached_blocks(pool, size)
                         and self._alloc_block(pool, size, alloc_size, False))
                     or (self._release_cached_blocks() and self._alloc_block(pool, size, alloc_size, True)))
            if block is None:
                self.num_ooms += 1
                return None
        if self._should_split(block, size, pool):
            self._split(block, size, pool)
        block.allocated = True
        block.requested = nbytes
        self.allocated += block.size
        if self.allocated > self.allocated_peak:
            self.allocated_peak = self.allocated
        self.requested += nbytes
        if self.requested > self.requested_peak:
            self.requested_peak = self.requested
        self.active_blocks += 1
        return block

    def free(self, block: Block) -> None:
        """PyTorch's ``free`` + ``free_block``: merge with free neighbours, back to the pool's free set."""
        if not block.allocated:
            raise ValueError(f"{block!r} is not allocated")
        block.allocated = False
        self.allocated -= block.size
        self.requested -= block.requested
        self.active_blocks -= 1
        pool = self.small if block.segment.small else self.large
        self._merge(block, block.prev, pool)
        self._merge(block, block.next, pool)
        pool.insert(block)

    def alloc(self, key, nbytes: int) -> bool:
        """`malloc` under `key`; False for an OOM (counted in ``num_ooms``)."""
        if key in self._keys:
            raise KeyError(f"block {key!r} is already live")
        block = self.malloc(nbytes)
        if block is None:
            return False
        self._keys[key] = block
        return True

    def free_key(self, key) -> None:
        self.free(self._keys.pop(key))

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: ``release_cached_blocks``."""
        self._release_cached_blocks()

    def stats(self) -> dict:
        """The aggregate figures of ``torch.cuda.memory_stats()`` that the model keeps."""
        return {
            "allocated_bytes.all.current": self.allocated, "allocated_bytes.all.peak": self.allocated_peak,
            "requested_bytes.all.current": self.requested, "requested_bytes.all.peak": self.requested_peak,
            "reserved_bytes.all.current": self.reserved, "reserved_bytes.all.peak": self.reserved_peak,
            "active.all.current": self.active_blocks, "segment.all.current": self.num_segments,
            "num_alloc_retries": self.num_alloc_retries, "num_ooms": self.num_ooms,
            "num_device_alloc": self.num_device_alloc, "num_device_free": self.num_device_free,
        }

    def segments(self) -> list[dict]:
        """Every segment, low address first: base, size, mapped bytes, expandable, and its blocks as
        (offset, size, "allocated" | "free" | "unmapped")."""
        out = []
        for base in sorted(self.segments_live):
            seg = self.segments_live[base]
            blocks, b = [], seg.head
            while b is not None:
                state = "allocated" if b.allocated else ("free" if b.mapped else "unmapped")
                blocks.append((b.addr - seg.base, b.size, state))
                b = b.next
            out.append({"address": seg.base, "size": seg.size, "mapped": seg.mapped, "small": seg.small,
                        "expandable": seg.expandable, "blocks": blocks})
        return out

    def check_invariants(self) -> None:
        """Blocks tile each segment; free neighbours are merged; the books add up. AssertionError if not."""
        mapped_total = allocated = 0
        free_seen = unmapped_seen = 0
        for base, seg in self.segments_live.items():
            b, addr, mapped, prev = seg.head, base, 0, None
            assert b is not None and b.prev is None, f"segment {base:#x} has no head"
            while b is not None:
                assert b.segment is seg and b.addr == addr and b.size > 0 and b.prev is prev, b
                if prev is not None and not b.allocated and not prev.allocated:
                    assert b.mapped != prev.mapped, f"unmerged neighbours {prev!r} {b!r}"
                pool = self.small if seg.small else self.large
                if b.mapped:
                    mapped += b.size
                    if b.allocated:
                        allocated += b.size
                    else:
                        assert pool.free_at.get(b.addr) is b, f"{b!r} missing from the free set"
                        free_seen += 1
                else:
                    assert seg.expandable and not b.allocated, b
                    assert (b.addr - base) % seg.page == 0 and b.size % seg.page == 0, f"{b!r} not page aligned"
                    assert pool.unmapped_at.get(b.addr) is b, f"{b!r} missing from the unmapped set"
                    unmapped_seen += 1
                addr += b.size
                prev, b = b, b.next
            assert addr == base + seg.size, f"segment {base:#x}: blocks cover {addr - base} of {seg.size} bytes"
            assert mapped == seg.mapped, (mapped, seg.mapped)
            mapped_total += mapped
        for pool in (self.small, self.large):
            assert len(pool.free) == len(pool.free_at) and len(pool.unmapped) == len(pool.unmapped_at)
        assert free_seen == len(self.small.free) + len(self.large.free)
        assert unmapped_seen == len(self.small.unmapped) + len(self.large.unmapped)
        assert mapped_total == self.reserved, (mapped_total, self.reserved)
        assert allocated == self.allocated, (allocated, self.allocated)
        assert self.reserved <= self.device_memory and self.reserved_peak >= self.reserved

    # ------------------------------------------------------------------ placement
    def _get_free_block(self, pool: BlockPool, size: int) -> Block | None:
        """``get_free_block``: best fit by (size, address), PyTorch's oversize and expandable rules."""
        free = pool.free
        i = free.bisect_left((size, -1))
        if i == len(free):
            return None
        block = pool.free_at[free[i][1]]
        if block.segment.expandable:
            # Blocks that border unmapped space count as their size plus that space; step to the next
            # larger blocks while they are smaller so counted (PyTorch's local scan, not a global minimum).
            cur = _expandable_size(block)
            n = len(free)
            while i + 1 < n:
                nxt = pool.free_at[free[i + 1][1]]
                nsize = _expandable_size(nxt)
                if nsize >= cur:
                    break
                i, block, cur = i + 1, nxt, nsize
        mss = self.max_split_size
        if mss is not None:
            if size < mss and block.size >= mss:
                return None  # do not return an oversized block for a smaller request
            if size >= mss and block.size >= size + self.max_non_split_rounding:
                return None  # an oversized block may be rounded up, within a limit
        pool.erase(block)
        return block

    def _should_split(self, block: Block, size: int, pool: BlockPool) -> bool:
        remaining = block.size - size
        if pool.small or self.expandable:
            return remaining >= K_MIN_BLOCK_SIZE
        return (self.max_split_size is None or size < self.max_split_size) and remaining > K_SMALL_SIZE

    def _split(self, block: Block, size: int, pool: BlockPool, *, mapped: bool = True) -> None:
        """``alloc_found_block``'s split: the request keeps the low end, the rest goes back to the pool
        (unmapped, with `mapped=False`: the part of an expandable segment's hole left unmapped)."""
        rest = Block(block.addr + size, block.size - size, block.segment, mapped=mapped)
        rest.prev, rest.next = block, block.next
        if block.next is not None:
            block.next.prev = rest
        block.next = rest
        block.size = size
        pool.insert(rest)

    def _merge(self, dst: Block, src: Block | None, pool: BlockPool) -> int:
        """``try_merge_blocks``: absorb a free neighbour of the same mapped state; its size, or 0."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return 0
        pool.erase(src)
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if src.prev is not None:
                src.prev.next = dst
            else:
                dst.segment.head = dst
        else:
            dst.next = src.next
            if src.next is not None:
                src.next.prev = dst
        dst.size += src.size
        return src.size

    # ------------------------------------------------------------------ new memory
    def _new_address(self, size: int) -> int:
        addr = self._next_va
        self._next_va += -(-size // K_LARGE_BUFFER) * K_LARGE_BUFFER + K_LARGE_BUFFER  # a gap between ranges
        return addr

    def _note_reserved(self, delta: int) -> None:
        self.reserved += delta
        if self.reserved > self.reserved_peak:
            self.reserved_peak = self.reserved

    def _alloc_block(self, pool: BlockPool, size: int, alloc_size: int, retry: bool) -> Block | None:
        """``alloc_block``: a new segment (cudaMalloc of the allocation size) or expandable pages."""
        if retry:
            self.num_alloc_retries += 1
        if self.reserved + alloc_size > self.capacity:  # set_fraction: allowed_memory_maximum
            return None
        if self.expandable:
            return self._try_allocate_expandable_block(pool, size)
        if self.reserved + alloc_size > self.device_memory:  # cudaMalloc itself fails
            return None
        seg = Segment(self._new_address(alloc_size), alloc_size, pool.small)
        block = Block(seg.base, alloc_size, seg)
        seg.head = block
        self.segments_live[seg.base] = seg
        self.num_segments += 1
        self.num_device_alloc += 1
        self._note_reserved(alloc_size)
        return block

    def _release_available_cached_blocks(self, pool: BlockPool, size: int) -> bool:
        """``release_available_cached_blocks``: with ``max_split_size`` set, free one cached oversize segment
        that could serve the request, else the largest oversize ones until their sizes add up to it."""
        mss = self.max_split_size
        if mss is None:
            return False
        key = max(size, mss)
        free = pool.free
        i = free.bisect_left((key, -1))
        if i < len(free):
            block = pool.free_at[free[i][1]]
            if not block.segment.expandable and block.prev is None and block.next is None:
                self._release_block(block, pool)
                return True
        if i == 0:
            return False
        released = 0
        j = i - 1
        while released < key and j >= 0:
            block = pool.free_at[free[j][1]]
            if block.size < mss:
                break
            j -= 1
            if not block.segment.expandable and block.prev is None and block.next is None:
                self._release_block(block, pool)
                released += block.size
        return released >= key

    def _release_cached_blocks(self) -> bool:
        """``release_cached_blocks``: free every entirely free segment (large pool, then small); with
        expandable segments unmap the whole pages inside every free block."""
        for pool in (self.large, self.small):
            to_unmap = []
            for _, addr in list(pool.free):
                block = pool.free_at[addr]
                if block.segment.expandable:
                    to_unmap.append(block)
                elif block.prev is None and block.next is None:
                    self._release_block(block, pool)
            for block in to_unmap:
                self._unmap_block(block, pool)
                if block.prev is None and block.next is None and not block.mapped:
                    self._release_expandable_segment(block, pool)
        return True

    def _release_block(self, block: Block, pool: BlockPool) -> None:
        """``release_block``: cudaFree of a whole cached segment."""
        assert block.prev is None and block.next is None and not block.allocated
        pool.erase(block)
        del self.segments_live[block.segment.base]
        self.num_segments -= 1
        self.num_device_free += 1
        self._note_reserved(-block.size)

    # ------------------------------------------------------------------ expandable segments
    def _find_expandable_block(self, pool: BlockPool, size: int) -> Block:
        """``find_expandable_block``: the lowest address where free and unmapped space fit `size`."""
        for addr in pool.unmapped:
            c = pool.unmapped_at[addr]
            if c.prev is not None and not c.prev.allocated:
                c = c.prev
            room, b = 0, c
            while room < size and b is not None and not b.allocated:
                room += b.size
                b = b.next
            if room >= size:
                return c
        page = K_SMALL_BUFFER if pool.small else self.large_segment
        total = self.device_memory
        vsize = -(-(total + total // 8) // page) * page  # address space for 9/8 of the device's memory
        seg = Segment(self._new_address(vsize), vsize, pool.small, page)
        block = Block(seg.base, vsize, seg, mapped=False)
        seg.head = block
        self.segments_live[seg.base] = seg
        pool.insert(block)
        return block

    def _try_allocate_expandable_block(self, pool: BlockPool, size: int) -> Block | None:
        """``try_allocate_expandable_block``: map what the candidate range lacks, then take it."""
        cand = self._find_expandable_block(pool, size)
        if not cand.mapped and not self._map_block(cand, min(cand.size, size), pool):
            return None
        while cand.size < size:  # free -> unmapped -> ...: map some of the unmapped, merged into the free
            nxt = cand.next
            if not self._map_block(nxt, min(size - cand.size, nxt.size), pool):
                return None
            cand = nxt
        pool.erase(cand)
        return cand

    def _map_block(self, block: Block, size: int, pool: BlockPool) -> bool:
        """``map_block`` / ``ExpandableSegment::map``: map the pages covering [block, block + size),
        all or nothing (cuMemCreate fails past the device's memory)."""
        seg = block.segment
        page = seg.page
        off = block.addr - seg.base
        nbytes = -(-(off + size) // page) * page - off
        if nbytes <= 0 or self.reserved + nbytes > self.device_memory:
            return False
        pool.erase(block)
        block.mapped = True
        if nbytes < block.size:
            self._split(block, nbytes, pool, mapped=False)
        self._merge(block, block.prev, pool)
        self._merge(block, block.next, pool)
        pool.insert(block)
        seg.mapped += nbytes
        self.num_device_alloc += 1
        self._note_reserved(nbytes)
        return True

    def _unmap_block(self, block: Block, pool: BlockPool) -> None:
        """``unmap_block`` / ``ExpandableSegment::unmap``: unmap the pages lying wholly inside a free block."""
        seg = block.segment
        page = seg.page
        off = block.addr - seg.base
        begin = -(-off // page) * page
        end = (off + block.size) // page * page
        if begin >= end:
            return
        pool.erase(block)
        before = begin - off
        if before > 0:
            head = Block(block.addr, before, seg)
            head.prev, head.next = block.prev, block
            if block.prev is not None:
                block.prev.next = head
            else:
                seg.head = head
            block.prev = head
            pool.insert(head)
        after = block.size - before - (end - begin)
        if after > 0:
            tail = Block(seg.base + end, after, seg)
            tail.prev, tail.next = block, block.next
            if block.next is not None:
                block.next.prev = tail
            block.next = tail
            pool.insert(tail)
        block.addr, block.size, block.mapped = seg.base + begin, end - begin, False
        self._merge(block, block.prev, pool)
        self._merge(block, block.next, pool)
        pool.insert(block)
        seg.mapped -= end - begin
        self.num_device_free += 1
        self._note_reserved(-(end - begin))

    def _release_expandable_segment(self, block: Block, pool: BlockPool) -> None:
        """``release_expandable_segment``: a segment with nothing mapped gives its address range back."""
        assert block.size == block.segment.size and not block.mapped
        pool.erase(block)
        del self.segments_live[block.segment.base]


def _expandable_size(b: Block) -> int:
    nxt = b.next
    return b.size + (nxt.size if nxt is not None and not nxt.mapped else 0)
