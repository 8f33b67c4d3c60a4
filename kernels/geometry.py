"""Launch geometry of the work-split kernels from the device's SMs and the kernel's occupancy (pure).

A launch over W 16-byte words is ``blocks`` blocks of ``threads`` threads; each
team of 32 threads takes chunks of ``chunk`` words in a grid-stride loop
(`defrag.kernels._device`). Two things decide the grid:

- the device holds ``sm_count * blocks_per_sm`` blocks at once, where
  ``blocks_per_sm`` is the compiled kernel's occupancy (registers per thread
  and threads per block decide it: cuOccupancyMaxActiveBlocksPerMultiprocessor).
  A grid of that many blocks fills the device once; more blocks would only
  queue behind the first ones, so a big wave gets exactly that and the
  grid-stride loop does the rest;
- a wave too small for 8 KiB chunks to reach every SM gets finer chunks:
  the largest multiple of a warp-wide access (32 words, 512 bytes) that
  still makes at least ``sm_count * teams_per_block`` chunks, so every SM
  gets a block. With 32-word chunks that holds for every wave of at least
  ``sm_count * threads`` words: 1 MiB or more reaches every SM of a device
  with up to 256 SMs at 256 threads per block.
"""

from __future__ import annotations

TEAM = 32  # threads sharing one chunk: a warp
THREADS_PER_BLOCK = 256
MAX_CHUNK_WORDS = 512  # 8 KiB: a team's chunk for big waves
MIN_CHUNK_WORDS = 32  # 512 bytes: one 16-byte word per lane of a team


def launch_geometry(total_words: int, *, sm_count: int, blocks_per_sm: int,
                    threads: int = THREADS_PER_BLOCK) -> tuple[int, int, int]:
    """``(blocks, threads, chunk_words)`` for a launch over ``total_words`` 16-byte words.

    ``blocks`` is at least 1 and at most ``sm_count * blocks_per_sm`` (one
    resident wave of blocks); ``chunk_words`` is a multiple of 32 from 32 to
    512; and whenever ``total_words >= sm_count * threads`` the grid has at
    least ``sm_count`` blocks (every SM busy), within the resident limit.
    ValueError for a non-positive SM count or occupancy, or ``threads`` not a
    positive multiple of 32.
    """
    if sm_count < 1 or blocks_per_sm < 1:
        raise ValueError(f"sm_count and blocks_per_sm must be >= 1, got {sm_count} and {blocks_per_sm} "
                         f"(an occupancy of 0 means the kernel cannot run with {threads} threads per block)")
    if threads < TEAM or threads % TEAM:
        raise ValueError(f"threads per block must be a positive multiple of {TEAM}, got {threads}")
    total_words = max(int(total_words), 0)
    teams = threads // TEAM
    chunk = total_words // (sm_count * teams) // MIN_CHUNK_WORDS * MIN_CHUNK_WORDS
    chunk = min(max(chunk, MIN_CHUNK_WORDS), MAX_CHUNK_WORDS)
    chunks = -(-total_words // chunk)
    blocks = min(max(1, -(-chunks // teams)), sm_count * blocks_per_sm)
    return blocks, threads, chunk
