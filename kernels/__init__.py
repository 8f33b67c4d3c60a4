"""defrag.kernels: numba CUDA kernels that move, fill and checksum arena bytes.

Every call takes an *arena* (a 1-D uint8 device array over raw device memory,
from :func:`device_arena`) and a table of byte offsets relative to its start,
all multiples of 16, and does its work in ONE kernel launch with 16-byte
(128-bit) accesses. ``batched_move`` and ``fill`` are asynchronous on the
given stream; ``checksum`` synchronizes and returns host values that equal
``host_checksum`` of the same bytes.

Importing this package is cheap and needs no GPU: numba is imported, and the
kernels compiled, on first use. Calls need a CUDA GPU or the numba simulator
(``NUMBA_ENABLE_CUDASIM=1`` set before numba.cuda is first imported) and
raise :class:`KernelUnavailableError` otherwise. The design (work split,
16-byte access, grid sizing) is documented in :mod:`defrag.kernels._device`.
"""

import numpy as _np

# numba-cuda 0.30 registers an overload for np.row_stack while it compiles a kernel's typing registries;
# numpy 2.5 removed that name (an alias of np.vstack), so with both no kernel compiles at all
# ("module 'numpy' has no attribute 'row_stack'": numba-cuda 0.30.4 with numpy 2.5.2 on the GPU machine,
# 2026-12-04). The alias back, only where it is missing, before numba.cuda is first imported.
if not hasattr(_np, "row_stack"):
    _np.row_stack = _np.vstack

from .arena import KernelUnavailableError, device_arena, is_simulator  # noqa: E402
from .checksum import checksum, host_checksum
from .fill import fill
from .move import batched_move

__all__ = [
    "KernelUnavailableError",
    "batched_move",
    "checksum",
    "device_arena",
    "fill",
    "host_checksum",
    "is_simulator",
]
