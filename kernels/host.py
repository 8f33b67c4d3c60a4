"""The move kernel's host twins: one launch of `move_kernel`, done on host memory from its packed parameters.

The emulated device has no SMs; it runs a launch of a loaded module's kernel
by calling that kernel's host twin (`defrag.driver.host_kernels`) with the
19 parameter values the launch passed (`kernels.abi`) and the device's memory.
Two twins:

- `run_move` does what the kernel does, segment by segment: read the
  segment table from device memory, copy each segment's 16-byte words from
  ``base + 16 * table[0, m]`` to ``base + 16 * table[1, m]``. It checks what
  a GPU would not (a table that is not a prefix sum, a segment past the
  arena): such a launch touches nothing and fails, so a launcher that packs
  wrong parameters or a wrong table shows as an error or wrong bytes;
- `run_move_simulated` runs the real kernel body (`_device.move_kernel`)
  under numba's CUDA simulator over views of the same memory, with the
  launch's own table and chunk size (and the simulator's small grid: the
  work split does not depend on the grid). Only where the simulator is on.

Both return False (the launch's synchronize then reports an illegal
address) where a range is not device memory the kernel may touch.
"""

from __future__ import annotations

import numpy as np

from . import abi
from ._tables import WORD

ENTRY = "defrag_batched_move"
ENTRY_SIMULATED = "defrag_batched_move_simulated"
#: Registers per thread of the sm_90 build (55 with numba-cuda 0.30.4, allocated in 8s): what the emulated
#: device's occupancy answers from, so the launch geometry there is the one an H200 gets.
REGISTERS = 56


def _table(memory, launch: abi.Launch) -> np.ndarray | None:
    """The launch's (3, m + 1) table as an int64 view of device memory, None where it cannot be read."""
    cols = launch.segments + 1
    s0, s1 = launch.table_strides
    nbytes = s0 * (abi.TABLE_ROWS - 1) + s1 * (cols - 1) + 8
    if s0 < cols * s1 or s1 != 8 or not memory.accessible(launch.table, nbytes, False):
        return None
    return np.ndarray((abi.TABLE_ROWS, cols), dtype=np.int64, buffer=memory.view(launch.table, nbytes),
                      strides=(s0, s1))


def _segments(memory, params):
    """(launch, src words, dst words, sizes in words) of a consistent launch, else None."""
    try:
        launch = abi.unpack(params)
    except ValueError:
        return None
    table = _table(memory, launch)
    if table is None:
        return None
    m, words = launch.segments, launch.arena_bytes // WORD
    src, dst, prefix = table[0, :m].copy(), table[1, :m].copy(), table[2].copy()
    sizes = np.diff(prefix)
    if (prefix[0] != 0 or prefix[m] != launch.total_words or (sizes <= 0).any() or (src < 0).any()
            or (dst < 0).any() or (src + sizes > words).any() or (dst + sizes > words).any()
            or launch.chunk_words < 1 or launch.base % WORD):
        return None
    return launch, src, dst, sizes


def _all_accessible(memory, base: int, starts: np.ndarray, sizes: np.ndarray, write: bool) -> bool:
    """Whether every range [base + 16 * start, + 16 * size) is device memory with (write) access: one
    check per run of overlapping or touching ranges."""
    order = np.argsort(starts, kind="stable")
    lo, hi = starts[order], starts[order] + sizes[order]
    reach = np.maximum.accumulate(hi)
    breaks = np.flatnonzero(lo[1:] > reach[:-1]) + 1
    firsts = lo[np.concatenate(([0], breaks))]
    lasts = reach[np.concatenate((breaks - 1, [lo.size - 1]))]
    return all(memory.accessible(base + a * WORD, (b - a) * WORD, write)
               for a, b in zip(firsts.tolist(), lasts.tolist()))


def _checked(memory, params):
    """`_segments`, and only where every source may be read and every destination written."""
    found = _segments(memory, params)
    if found is None or found[1].size == 0:
        return found
    launch, src, dst, sizes = found
    if not (_all_accessible(memory, launch.base, src, sizes, False)
            and _all_accessible(memory, launch.base, dst, sizes, True)):
        return None
    return found


def run_move(memory, params) -> bool:
    """Copy every segment of the launch's table (see the module docstring); False, touching nothing,
    where it may not."""
    found = _checked(memory, params)
    if found is None:
        return False
    launch, src, dst, sizes = found
    base, copy = launch.base, memory.copy
    for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist()):
        copy(base + d * WORD, base + s * WORD, n * WORD)
    return True


def run_move_simulated(memory, params) -> bool:
    """The real kernel body under numba's CUDA simulator, over the launch's memory (see the module docstring)."""
    found = _checked(memory, params)
    if found is None:
        return False
    launch = found[0]
    base = launch.base
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    from . import _device

    if not _device.SIM:
        raise RuntimeError("run_move_simulated needs numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1)")
    words = np.ndarray((launch.arena_bytes // 8,), dtype=np.uint64, buffer=memory.view(base, launch.arena_bytes))
    table = _table(memory, launch)
    blocks, threads = _device.SIM_GRID
    _device.move_kernel[blocks, threads](FakeCUDAArray(words), FakeCUDAArray(table), np.int64(launch.segments),
                                         np.int64(launch.total_words), np.int64(launch.chunk_words))
    return True
