"""The checksum's per-word mix, written once for numpy, numba CPU and numba CUDA.

Definition (all arithmetic modulo 2**64; a range is read as n little-endian
16-byte words, word i being the uint64 pair (lo, hi) = bytes [16i, 16i+8),
[16i+8, 16i+16) counted from the start of the range):

    fmix64(x)       = murmur3 finaliser: x ^= x >> 33; x *= 0xFF51AFD7ED558CCD;
                      x ^= x >> 33; x *= 0xC4CEB9FE1A85EC53; x ^= x >> 33
    word(lo, hi, i) = fmix64(lo ^ fmix64(hi ^ ((i + 1) * 0x9E3779B97F4A7C15)))
    checksum        = sum over i of word(lo_i, hi_i, i)

The index is relative to the range, so a range has the same checksum before
and after a move; mixing it in makes the sum position-sensitive (swapping two
different words changes it, barring a 2**-64 collision); the wrapping sum
makes the terms order-independent, so any number of threads may add them.
A range of zero bytes has checksum 0. This is an integrity check, not a
cryptographic hash.
"""

from __future__ import annotations

import numpy as np

M1 = np.uint64(0xFF51AFD7ED558CCD)
M2 = np.uint64(0xC4CEB9FE1A85EC53)
GOLDEN = np.uint64(0x9E3779B97F4A7C15)
S33 = np.uint64(33)
ONE = np.uint64(1)


def fmix64(x):
    """murmur3's 64-bit finaliser; works on numpy uint64 arrays and in numba."""
    x = x ^ (x >> S33)
    x = x * M1
    x = x ^ (x >> S33)
    x = x * M2
    x = x ^ (x >> S33)
    return x


def mix_word(lo, hi, i):
    """The checksum term of 16-byte word (lo, hi) at word index i of its range.

    Numba-compilable scalar form (device function on a GPU, njit under the
    simulator): ``lo``/``hi`` uint64, ``i`` a non-negative integer.
    """
    # fmix64 is spelled out twice: numba cannot call a plain Python helper, and
    # one straight-line source compiles identically for numba CPU and CUDA.
    x = np.uint64(hi) ^ ((np.uint64(i) + ONE) * GOLDEN)
    x = x ^ (x >> S33)
    x = x * M1
    x = x ^ (x >> S33)
    x = x * M2
    x = x ^ (x >> S33)
    x = np.uint64(lo) ^ x
    x = x ^ (x >> S33)
    x = x * M1
    x = x ^ (x >> S33)
    x = x * M2
    x = x ^ (x >> S33)
    return x


def add_u64(a, b):
    """Wrapping uint64 addition (numba-compilable; avoids numpy scalar overflow warnings)."""
    return np.uint64(a) + np.uint64(b)
