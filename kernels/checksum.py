"""checksum (device, one launch) and host_checksum (numpy): the same function.

See :mod:`defrag.kernels._mix` for the exact definition. In short: the sum,
modulo 2**64, over the range's 16-byte words of
``fmix64(lo ^ fmix64(hi ^ ((i + 1) * 0x9E3779B97F4A7C15)))``, where (lo, hi)
are the word's two little-endian uint64 halves and i its index within the
range. Position-sensitive, independent of where the range lives, and cheap
to parallelise.
"""

from __future__ import annotations

import numpy as np

from . import _mix
from ._tables import WORD, as_table, segment_table
from .arena import arena_words

_HOST_BLOCK_WORDS = 1 << 20  # bounds host temporaries to a few tens of MiB


def checksum(arena, ranges, *, stream=None) -> np.ndarray:
    """Return the uint64 checksum of each (offset, nbytes) range of ``ranges``, in ONE launch.

    ``ranges`` is an integer array of shape (n, 2); offsets and sizes must be
    multiples of 16 and inside the arena (ValueError otherwise). Ranges may
    overlap. The launch runs on ``stream`` (None = default stream); unlike
    the other kernels this call waits for it and returns a host array of
    shape (n,), entry k equal to ``host_checksum`` of range k's bytes
    (0 for an empty range).
    """
    words, nbytes = arena_words(arena)
    table = as_table(ranges, 2, "ranges", nbytes)
    n = table.shape[0]
    segments, total = segment_table(
        table[:, 0] // WORD, np.arange(n, dtype=np.int64), table[:, 1] // WORD
    )
    if total == 0:
        return np.zeros(n, dtype=np.uint64)

    from . import _device

    stream = _device.as_stream(stream)
    blocks, threads, chunk = _device.launch_dims(total)
    d_segments = _device.cuda.to_device(segments, stream=stream)
    d_out = _device.cuda.to_device(np.zeros(n, dtype=np.uint64), stream=stream)
    _device.checksum_kernel[blocks, threads, stream](
        words, d_segments, np.int64(segments.shape[1] - 1), np.int64(total), np.int64(chunk), d_out
    )
    out = d_out.copy_to_host(stream=stream)
    if isinstance(stream, int):
        _device.cuda.synchronize()
    else:
        stream.synchronize()
    return out


def host_checksum(data) -> int:
    """The checksum of ``data``'s bytes computed on the host with numpy, as a Python int.

    ``data`` is anything exposing a buffer (bytes, bytearray, memoryview, a
    ctypes array, an mmap) or a numpy array (its raw bytes in memory order,
    after making it C-contiguous). Its length must be a multiple of 16
    (ValueError otherwise). Equals ``checksum`` of the same bytes on a device.
    """
    if isinstance(data, np.ndarray):
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    else:
        raw = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
    if raw.size % WORD:
        raise ValueError(f"length {raw.size} is not a multiple of {WORD} bytes")
    pairs = raw.view("<u8").reshape(-1, 2)
    # Array (not scalar) arithmetic throughout: numpy wraps uint64 arrays
    # silently but warns on scalar overflow.
    total = np.zeros(1, dtype=np.uint64)
    for start in range(0, pairs.shape[0], _HOST_BLOCK_WORDS):
        block = pairs[start : start + _HOST_BLOCK_WORDS]
        k = np.arange(start + 1, start + 1 + block.shape[0], dtype=np.uint64) * _mix.GOLDEN
        terms = _mix.fmix64(block[:, 0] ^ _mix.fmix64(block[:, 1] ^ k))
        total += terms.sum(dtype=np.uint64, keepdims=True)
    return int(total[0])
