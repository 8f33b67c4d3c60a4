"""Meshing's hardware premise (issue 26), on a real GPU: one physical page at two virtual pages of one reservation.

A mesh maps its primary's physical handle at every member's virtual page, all inside one region
(one reservation), and the twins' bytes reach the shared page through the move kernel. Two checks:

- driver level: one handle mapped at two pages of ONE reservation, access set on each; bytes
  written with cuMemcpyHtoD through one address read back with cuMemcpyDtoH through the other,
  both ways, and unmapping one alias leaves the other's bytes (a twin unmapped at unmesh);
  ``test_driver_gpu.py`` checks aliasing across two reservations only;
- after the copy kernel: `defrag.kernels.batched_move` copies bytes into the shared page through
  the first address (and others through the second); after a synchronize, each is read back
  through the other address, and every byte outside the copies is unchanged.

Host transfers go through the driver (`Driver.copy_from_host` / `copy_to_host`, pinned buffers
from `alloc_host`), so the first check needs neither torch nor numba. In a rehearsal
(``DEFRAG_GPU_REHEARSAL=1``, no GPU) both run on the emulated device with 2 MiB pages, the kernel
one under numba's simulator (tests/conftest.py turns it on where no GPU is usable); without
either, tests/gpu/conftest.py skips both with the reason.
Nothing here touches the driver at import time.
"""
from __future__ import annotations

import ctypes
import os

import pytest

from defrag.driver import Driver

from .conftest import MODE


class Pages:
    """One reservation of `pages` pages and what the test mapped in it, torn down even when the test fails."""

    def __init__(self, d: Driver, pages: int):
        self.d = d
        self.G = d.granularity
        self.size = pages * self.G
        self.va = d.reserve(self.size)
        self.maps: list[tuple[int, int]] = []
        self.handles: list[int] = []
        self.host: list[int] = []

    def page(self, i: int) -> int:
        return self.va + i * self.G

    def handle(self) -> int:
        h = self.d.create(self.G)
        self.handles.append(h)
        return h

    def map(self, i: int, h: int) -> None:
        self.d.map(self.page(i), self.G, h)
        self.maps.append((self.page(i), self.G))
        self.d.set_access(self.page(i), self.G)  # access per mapping, as a twin remapped alone gets it

    def unmap(self, i: int) -> None:
        self.d.synchronize()  # unmap does not wait for the device
        self.d.unmap(self.page(i), self.G)
        self.maps.remove((self.page(i), self.G))

    def write(self, va: int, data: bytes) -> None:
        """`data` to device address `va` with cuMemcpyHtoD (synchronous; after what the legacy stream queued)."""
        buf = self._pinned(len(data))
        ctypes.memmove(buf, data, len(data))
        self.d.copy_from_host(va, buf, len(data))

    def read(self, va: int, n: int) -> bytes:
        """`n` bytes at device address `va` with cuMemcpyDtoH, after a synchronize."""
        self.d.synchronize()
        buf = self._pinned(n)
        self.d.copy_to_host(buf, va, n)
        return ctypes.string_at(buf, n)

    def _pinned(self, n: int) -> int:
        ptr = self.d.alloc_host(n)
        self.host.append(ptr)
        return ptr

    def close(self) -> None:
        self.d.faults.clear()
        self.d.synchronize()
        for va, size in reversed(self.maps):
            self.d.unmap(va, size)
        for h in reversed(self.handles):
            self.d.release(h)
        self.d.free_address(self.va, self.size)
        for ptr in self.host:
            self.d.free_host(ptr)


@pytest.fixture
def pages(gpu_driver):
    gpu_driver.make_current()
    made: list[Pages] = []

    def make(n: int) -> Pages:
        p = Pages(gpu_driver, n)
        made.append(p)
        return p

    yield make
    for p in reversed(made):
        p.close()


def test_one_handle_at_two_pages_of_one_reservation_is_one_page_of_bytes(pages):
    p = pages(2)
    G = p.G
    h = p.handle()
    p.map(0, h)
    p.map(1, h)
    data = os.urandom(G)
    p.write(p.page(0), data)
    assert p.read(p.page(1), G) == data, "bytes written through the first page are not seen through the second"
    # And back: a write through the second address is seen through the first, its neighbours untouched.
    patch = os.urandom(4096)
    p.write(p.page(1) + G // 2 - 100, patch)
    expected = data[:G // 2 - 100] + patch + data[G // 2 - 100 + 4096:]
    assert p.read(p.page(0), G) == expected
    # A twin unmapped (unmesh, or a dormant twin given back) leaves the other mapping's bytes.
    p.unmap(1)
    assert p.read(p.page(0), G) == expected


def _kernel_skip_reason() -> str | None:
    import defrag.kernels as dk
    try:
        sim = dk.arena.require_backend()
    except dk.KernelUnavailableError as exc:
        return f"needs numba's kernels: {exc}"
    if MODE == "cuda" and sim:
        return "numba.cuda is the simulator (NUMBA_ENABLE_CUDASIM is set): it cannot reach GPU memory"
    if MODE != "cuda" and not sim:
        return "GPU rehearsal: the kernel runs on the emulated device only under NUMBA_ENABLE_CUDASIM=1"
    return None


def test_bytes_the_move_kernel_copies_through_one_alias_are_read_through_the_other(pages):
    why = _kernel_skip_reason()
    if why:
        pytest.skip(why)
    import numpy as np

    import defrag.kernels as dk

    p = pages(3)
    G = p.G
    shared, source = p.handle(), p.handle()
    p.map(0, shared)  # the primary's page (VA1)
    p.map(1, shared)  # a twin remapped onto it (VA2)
    p.map(2, source)  # the twin's old page: where its live bytes come from
    old = os.urandom(G)
    src = os.urandom(G)
    p.write(p.page(0), old)
    p.write(p.page(2), src)
    # Two pieces, as a mesh copies them: one into the shared page through VA1 at offset A, one through
    # VA2 at offset B. Offsets relative to the arena (the whole reservation); all multiples of 16.
    A, B, n = 4096 + 48, G // 2 + 512, 64 << 10
    moves = np.array([[2 * G + A, A, n], [2 * G + B, G + B, n]], dtype=np.int64)
    arena = dk.device_arena(p.va, 3 * G)
    dk.batched_move(arena, moves, validate=True)  # the default stream
    p.d.synchronize()
    expected = bytearray(old)
    expected[A:A + n] = src[A:A + n]
    expected[B:B + n] = src[B:B + n]
    through_va2 = p.read(p.page(1), G)
    through_va1 = p.read(p.page(0), G)
    assert through_va2[A:A + n] == src[A:A + n], "the kernel's copy through VA1 is not seen through VA2"
    assert through_va1[B:B + n] == src[B:B + n], "the kernel's copy through VA2 is not seen through VA1"
    assert through_va1 == through_va2 == bytes(expected), "bytes outside the copies changed"
    assert p.read(p.page(2), G) == src
