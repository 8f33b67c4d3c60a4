"""The heap's alignment and error; the heap itself is native (`defrag/native/heap.h`).

`Heap` (best fit over integer offsets: blocks, split, coalesce; free ranges
inserted and removed as the core maps and unmaps pages) lives in C++ so that
the pool's books (`defrag/native/books.h`) can place and free without the
GIL; `defrag.native.load_module().Heap` is its Python binding, with the
same API and guarantees the pure-Python heap had (every failing call raises
HeapError and changes nothing). That pure-Python heap is kept as the test
suite's reference model (`tests/cpu/heap_model.py`), run side by side with
the native one (`tests/cpu/test_native_heap.py`).
"""
from __future__ import annotations

ALIGNMENT = 512  # bytes: PyTorch's own rounding of every allocation


class HeapError(ValueError):
    """Misuse of a Heap: double free, unknown block, overlap, bad size or alignment."""
