"""The numba CUDA kernels and their launch configuration (imported on first use).

Importing this module imports ``numba.cuda``; the public modules import it
lazily, after :func:`defrag.kernels.arena.require_backend` has confirmed a GPU
or the simulator. ``@cuda.jit`` without a signature compiles each kernel on its
first launch.

Work split (shared by all three kernels)
----------------------------------------
The host turns the n requests (moves, fills or checksum ranges) into a table
of segments in 16-byte words and an exclusive prefix sum ``P`` of their sizes
(``P[n]`` = total words W; see ``_tables.segment_table``). The flat word space
``[0, W)`` is cut into fixed chunks of ``chunk`` words, regardless of where
segments begin or end. A *team* of 32 consecutive threads (one warp on a GPU)
takes chunks in a grid-stride loop; for each chunk it does ONE binary search
in ``P`` for the segment holding the chunk's first word, then walks forward
through the segments overlapping the chunk, its 32 lanes covering
consecutive 16-byte words (512 contiguous bytes per warp access, coalesced).
All control flow is uniform within a team. So 10k tiny moves share chunks
(a 512-byte move is one warp-wide access) while a huge move is spread over
every team in the grid, all in one launch. The checksum kernel has each lane
sum the mix terms of its words of a segment and add that partial sum to the
range's output with one 64-bit atomic add (wrapping addition is associative
and commutative, so the result does not depend on the split).

16-byte access
--------------
On a GPU, ``load16``/``store16`` are numba ``@intrinsic``s that emit LLVM
``load``/``store <2 x i64>, align 16`` through a pointer cast to the global
address space, which the NVPTX backend lowers to one 128-bit
``ld.global.v2.b64`` / ``st.global.v2.b64`` per word (checked by lowering
these kernels to PTX with llvmlite's NVPTX backend; see
tests/sim/test_kernels.py). The obvious alternatives do not get there in
numba-cuda 0.30: copying the four elements of a (N, 4) uint32 view, or
building a ``cuda.uint32x4`` from them, stays four 32-bit accesses (numba
only promises element alignment), and assigning a 16-byte record copies it
byte by byte. The arena is passed as a uint64 view whose base must be
16-byte aligned and every index is a whole 16-byte word, so each access is
naturally aligned. The move loop issues four independent loads per lane
before their four stores (the compiler cannot hoist loads over stores it
must assume alias, since sources and destinations share the arena).

Under the simulator the same kernel bodies run as Python; the helpers are
plain Python over the uint64 view, and the checksum arithmetic is the same
``_mix`` source compiled with ``numba.njit`` instead of as a device function.

Grid sizing
-----------
GPU: `defrag.kernels.geometry.launch_geometry`: 256 threads (8 teams) per
block, at most one resident wave of blocks (SMs x blocks per SM), and chunks
fine enough that a wave of 1 MiB or more reaches every SM. The launcher
(`kernels.launch`) asks the loaded kernel's occupancy; numba's own launches
here (`launch_dims`) assume ``BLOCKS_PER_SM`` (4: what the sm_90 build's 55
registers per thread allow at 256 threads). Simulator: ``SIM_GRID`` (2
blocks of 32 threads: each simulated thread is a Python thread, so keep it
small).
"""

from __future__ import annotations

import functools
import threading

import numpy as np
from numba import cuda

from . import _mix
from .geometry import launch_geometry

TEAM = 32  # threads sharing one chunk: a warp on a GPU
SIM = bool(cuda.config.ENABLE_CUDASIM)

THREADS_PER_BLOCK = 256
BLOCKS_PER_SM = 4  # the sm_90 build's occupancy at 256 threads (55 registers per thread)
SIM_GRID = (2, 32)  # (blocks, threads per block) under the simulator
SIM_CHUNK_WORDS = 64  # 1 KiB: small enough that test plans span many chunks

# Device helpers are inlined by NVVM on a GPU (the simulator's jit has no such option).
_INLINE = {} if SIM else {"forceinline": True}

if SIM:
    import numba

    _MASK64 = (1 << 64) - 1
    _atomic_lock = threading.Lock()

    def load16(words, w):
        """(lo, hi) uint64 pair of 16-byte word w."""
        return words[2 * w], words[2 * w + 1]

    def store16(words, w, pair):
        words[2 * w] = pair[0]
        words[2 * w + 1] = pair[1]

    def atomic_add_u64(out, i, value):
        """Wrapping atomic add (the simulator's own cuda.atomic.add warns on overflow)."""
        with _atomic_lock:
            out[i] = np.uint64((int(out[i]) + int(value)) & _MASK64)

    _mix_word_cpu = numba.njit(_mix.mix_word)

    def mix_word(lo, hi, i):
        # njit returns a Python int; keep it a uint64 so it re-enters numba typed as one.
        return np.uint64(_mix_word_cpu(lo, hi, i))

    def add_u64(a, b):
        return np.uint64((int(a) + int(b)) & _MASK64)
else:
    from llvmlite import ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    _VEC = ir.VectorType(ir.IntType(64), 2)
    _GLOBAL = 1  # NVVM address space of global memory

    def _word_pointer(context, builder, array_type, array, index_type, index):
        """Pointer to 16-byte word ``index`` of a uint64 array, as <2 x i64> addrspace(1)*."""
        ary = context.make_array(array_type)(context, builder, value=array)
        i = context.cast(builder, index, index_type, types.int64)
        elem = builder.gep(ary.data, [builder.mul(i, ir.Constant(ir.IntType(64), 2))])
        vec = builder.bitcast(elem, _VEC.as_pointer())
        return builder.addrspacecast(vec, _VEC.as_pointer(_GLOBAL))

    def _check(words, w):
        if not (
            isinstance(words, types.Array)
            and words.dtype == types.uint64
            and words.ndim == 1
            and isinstance(w, types.Integer)
        ):
            raise TypeError(f"load16/store16 take (uint64[::1] array, integer), got ({words}, {w})")

    @intrinsic
    def load16(typingctx, words, w):
        """One 128-bit load of 16-byte word w; returns the (lo, hi) uint64 pair."""
        _check(words, w)
        pair = types.UniTuple(types.uint64, 2)

        def codegen(context, builder, sig, args):
            ptr = _word_pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            vec = builder.load(ptr, align=16)
            lo = builder.extract_element(vec, ir.Constant(ir.IntType(32), 0))
            hi = builder.extract_element(vec, ir.Constant(ir.IntType(32), 1))
            return context.make_tuple(builder, pair, [lo, hi])

        return pair(words, w), codegen

    @intrinsic
    def store16(typingctx, words, w, pair):
        """One 128-bit store of the (lo, hi) uint64 pair to 16-byte word w."""
        _check(words, w)
        if not (isinstance(pair, types.UniTuple) and pair.count == 2 and pair.dtype == types.uint64):
            raise TypeError(f"store16 takes a (uint64, uint64) tuple, got {pair}")

        def codegen(context, builder, sig, args):
            ptr = _word_pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            lo = builder.extract_value(args[2], 0)
            hi = builder.extract_value(args[2], 1)
            vec = ir.Constant(_VEC, ir.Undefined)
            vec = builder.insert_element(vec, lo, ir.Constant(ir.IntType(32), 0))
            vec = builder.insert_element(vec, hi, ir.Constant(ir.IntType(32), 1))
            builder.store(vec, ptr, align=16)
            return context.get_dummy_value()

        return types.void(words, w, pair), codegen

    @cuda.jit(device=True, **_INLINE)
    def atomic_add_u64(out, i, value):
        cuda.atomic.add(out, i, value)

    mix_word = cuda.jit(device=True, **_INLINE)(_mix.mix_word)
    add_u64 = cuda.jit(device=True, **_INLINE)(_mix.add_u64)


@cuda.jit(device=True, **_INLINE)
def find_segment(table, n, g):
    """Index m of the segment holding flat word g: table[2, m] <= g < table[2, m + 1]."""
    lo = 0
    hi = n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if table[2, mid] <= g:
            lo = mid
        else:
            hi = mid
    return lo


@cuda.jit
def move_kernel(words, table, n, total, chunk):
    """Copy segment m's words table[0, m] + k to table[1, m] + k (16-byte words)."""
    tid = cuda.grid(1)
    team = tid // TEAM
    lane = tid - team * TEAM
    stride = (cuda.gridsize(1) // TEAM) * chunk
    c0 = team * chunk
    while c0 < total:
        c1 = min(c0 + chunk, total)
        m = find_segment(table, n, c0)
        g = c0
        while g < c1:
            end = min(table[2, m + 1], c1)
            skip = g - table[2, m]
            src = table[0, m] + skip
            dst = table[1, m] + skip
            count = end - g
            j = lane
            while j + 3 * TEAM < count:
                a = load16(words, src + j)
                b = load16(words, src + j + TEAM)
                c = load16(words, src + j + 2 * TEAM)
                d = load16(words, src + j + 3 * TEAM)
                store16(words, dst + j, a)
                store16(words, dst + j + TEAM, b)
                store16(words, dst + j + 2 * TEAM, c)
                store16(words, dst + j + 3 * TEAM, d)
                j += 4 * TEAM
            while j < count:
                store16(words, dst + j, load16(words, src + j))
                j += TEAM
            g = end
            m += 1
        c0 += stride


@cuda.jit
def fill_kernel(words, table, n, total, chunk, pattern):
    """Store the uint64 ``pattern`` twice into every word of every segment (start table[0, m])."""
    tid = cuda.grid(1)
    team = tid // TEAM
    lane = tid - team * TEAM
    stride = (cuda.gridsize(1) // TEAM) * chunk
    pair = (pattern, pattern)
    c0 = team * chunk
    while c0 < total:
        c1 = min(c0 + chunk, total)
        m = find_segment(table, n, c0)
        g = c0
        while g < c1:
            end = min(table[2, m + 1], c1)
            dst = table[0, m] + (g - table[2, m])
            count = end - g
            j = lane
            while j < count:
                store16(words, dst + j, pair)
                j += TEAM
            g = end
            m += 1
        c0 += stride


@cuda.jit
def checksum_kernel(words, table, n, total, chunk, out):
    """Add every word's mix term of segment m (start table[0, m]) into out[table[1, m]]."""
    tid = cuda.grid(1)
    team = tid // TEAM
    lane = tid - team * TEAM
    stride = (cuda.gridsize(1) // TEAM) * chunk
    c0 = team * chunk
    while c0 < total:
        c1 = min(c0 + chunk, total)
        m = find_segment(table, n, c0)
        g = c0
        while g < c1:
            end = min(table[2, m + 1], c1)
            first = g - table[2, m]  # word index within the range
            base = table[0, m] + first
            count = end - g
            j = lane
            if j < count:
                lo, hi = load16(words, base + j)
                acc = mix_word(lo, hi, first + j)
                j += TEAM
                while j < count:
                    lo, hi = load16(words, base + j)
                    acc = add_u64(acc, mix_word(lo, hi, first + j))
                    j += TEAM
                atomic_add_u64(out, table[1, m], acc)
            g = end
            m += 1
        c0 += stride


@functools.lru_cache(maxsize=None)
def _sm_count(device_id: int) -> int:
    return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)


def launch_dims(total_words: int) -> tuple[int, int, int]:
    """Return ``(blocks, threads_per_block, chunk_words)`` for a launch over total_words."""
    if SIM:
        blocks, threads = SIM_GRID
        return blocks, threads, SIM_CHUNK_WORDS
    return launch_geometry(total_words, sm_count=_sm_count(cuda.get_current_device().id),
                           blocks_per_sm=BLOCKS_PER_SM, threads=THREADS_PER_BLOCK)


def as_stream(stream):
    """numba stream argument: the given stream, or 0 (the default stream) for None."""
    return 0 if stream is None else stream
