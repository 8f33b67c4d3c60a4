"""`HostMemory`: every host-memory side effect of the emulated device, and nothing else.

`defrag.driver.emulated.EmulatedCuda` checks each driver call's rules and
keeps its books, then asks its `host_memory` for what happens in the
process's memory:

- a physical page is a memfd of its size (`create_page`, `release_page`);
- a reservation is a PROT_NONE, MAP_NORESERVE mapping, over-reserved and
  trimmed to the requested alignment (`reserve`, `free_reserved`);
- mapping maps the memfd MAP_SHARED|MAP_FIXED with no access (`map`), so one
  page mapped at two addresses shares its bytes; access is mprotect
  (`protect`); unmapping buries each granule under the tombstone (`unmap`,
  below); a forked child maps every page again copy-on-write (`privatize`),
  so that its writes stay its own, as fork treats any host memory;
- copies are memmove, memsets are memset (`copy`, `fill`);
- a pinned host buffer is an anonymous mapping whose pages are faulted in at
  once, as page-locking does (`alloc_pinned`, `free_pinned`).

The tombstone: a shared, never-written memfd of one granule mapped read/write
over every unmapped granule, so that a stale access (a kernel still using an
old address) lands there instead of killing the process, and allocates a host
page in it that `touched_unmapped()` reports (`stale_probe_fd()` is the file a
fast path fstat's for the same answer). A GPU reports such an access as an
illegal address.

Every method runs after the device has checked the call's rules, under the
device's lock (the one given here, which `touched_unmapped` and
`stale_probe_fd` take themselves); none checks a rule.
`defrag.driver.memoryless.AddressCounter` is this class with no bytes behind
its addresses.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import threading

MEMFD_NAME = "defrag-emulated-page"
TOMBSTONE_NAME = "defrag-emulated-unmapped"

# Protections of a mapped granule, as mprotect takes them (and as the device's books record them).
PROT_NONE = 0
PROT_READ = mmap.PROT_READ
PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE

_MAP_SHARED = mmap.MAP_SHARED
_MAP_PRIVATE = mmap.MAP_PRIVATE
_MAP_ANONYMOUS = mmap.MAP_ANONYMOUS
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)  # Linux: fault every page in at mmap time
_MAP_FAILED = ctypes.c_void_p(-1).value
_FALLOC_PUNCH_HOLE = 0x01 | 0x02  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
# Without restype/argtypes ctypes truncates 64-bit pointers to int.
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.fallocate.restype = ctypes.c_int
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_libc.mprotect.restype = ctypes.c_int
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def _os_mmap(addr: int, size: int, prot: int, flags: int, fd: int = -1, offset: int = 0) -> int:
    """libc mmap; the address it mapped, or OSError (with errno) if it failed."""
    result = _libc.mmap(addr or None, size, prot, flags, fd, offset)
    if result is None or result == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap failed: {os.strerror(err)}")
    return result


def _os_check(rc: int, what: str) -> None:
    """OSError (with errno) unless the libc call `what` returned 0."""
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what} failed: {os.strerror(err)}")


class HostMemory:
    """The host side of one emulated device: memfd pages, mmap'd address space, the tombstone.

    `granularity` is the device's (a multiple of the host page size): the
    size of the tombstone and of each granule buried under it. `lock` is the
    device's lock.
    """

    #: Whether `map` does anything: False where a mapping holds no bytes (`AddressCounter`), so a batch of
    #: maps need not call it page by page.
    maps_bytes = True

    def __init__(self, granularity: int, lock: threading.RLock):
        self.granularity = granularity
        self._lock = lock
        self._tombstone: int | None = None  # memfd mapped over every unmapped granule (see `unmap`)

    # ---------------------------------------------------------------- physical pages
    def create_page(self, size: int) -> int | None:
        """Back a new physical allocation of `size` bytes; returns its fd, or None if out of memory."""
        fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
        except OSError:
            os.close(fd)
            return None
        return fd

    def release_page(self, fd: int) -> None:
        """Free a physical allocation's memory (it is no longer mapped anywhere)."""
        os.close(fd)

    # ---------------------------------------------------------------- pinned host buffers
    def alloc_pinned(self, size: int) -> int | None:
        """Page-locked host memory of `size` bytes (here: an anonymous mapping, its pages faulted in at
        once, as page-locking does); its address, or None."""
        try:
            return _os_mmap(0, size, PROT_RW, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_POPULATE)
        except OSError:
            return None

    def free_pinned(self, ptr: int, size: int) -> None:
        """Free a buffer from `alloc_pinned`."""
        _os_check(_libc.munmap(ptr, size), "munmap")

    # ---------------------------------------------------------------- linear device memory (cuMemAlloc)
    def alloc_linear(self, size: int) -> int | None:
        """Device memory outside the VMM calls (cuMemAlloc: a kernel's tables): an anonymous read/write
        mapping, touched only when written; its address, or None."""
        try:
            return _os_mmap(0, size, PROT_RW, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE)
        except OSError:
            return None

    def free_linear(self, ptr: int, size: int) -> None:
        """Free a buffer from `alloc_linear`."""
        _os_check(_libc.munmap(ptr, size), "munmap")

    #: Whether device addresses have bytes behind them that a kernel's host twin may read and write.
    runs_kernels = True

    def view(self, ptr: int, nbytes: int):
        """A writable memoryview of `nbytes` at `ptr` (accessible device memory)."""
        return memoryview((ctypes.c_uint8 * nbytes).from_address(ptr)).cast("B")

    # ---------------------------------------------------------------- address space
    def reserve(self, size: int, alignment: int) -> int | None:
        """Reserve `size` bytes of address space aligned to `alignment`; the base, or None if exhausted."""
        # Over-reserve by the alignment, then trim both ends: mmap only
        # promises host-page alignment.
        span = size + alignment
        try:
            raw = _os_mmap(0, span, PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE)
        except OSError:
            return None
        base = (raw + alignment - 1) // alignment * alignment
        if base > raw:
            _os_check(_libc.munmap(raw, base - raw), "munmap")
        tail = raw + span - (base + size)
        if tail:
            _os_check(_libc.munmap(base + size, tail), "munmap")
        return base

    def free_reserved(self, base: int, size: int) -> None:
        """Give back a reservation's address space (nothing is mapped inside it)."""
        _os_check(_libc.munmap(base, size), "munmap")

    def drop_tombstone(self) -> None:
        """The device's last reservation is gone, so no granule is buried: close the tombstone (a later
        `unmap` or `stale_probe_fd` makes a new one)."""
        if self._tombstone is not None:
            os.close(self._tombstone)  # no granule of it is mapped any more
            self._tombstone = None

    def map(self, ptr: int, size: int, fd: int, offset: int) -> None:
        """Map `size` bytes of the allocation `fd` from `offset` at `ptr`, with no access."""
        _os_mmap(ptr, size, PROT_NONE, _MAP_SHARED | _MAP_FIXED, fd, offset)

    def privatize(self, ptr: int, size: int, fd: int, offset: int, prots: bytearray) -> None:
        """In a forked child: map [ptr, ptr+size) of `fd` from `offset` again, MAP_PRIVATE (copy-on-write),
        with each granule's protection `prots[i]`: what the child writes stays the child's, as fork
        gives any host memory, instead of landing in the parent's pages through the shared memfd."""
        _os_mmap(ptr, size, PROT_NONE, _MAP_PRIVATE | _MAP_FIXED, fd, offset)
        g = self.granularity
        i = 0
        while i < len(prots):  # one mprotect per run of equal protections
            j = i
            while j < len(prots) and prots[j] == prots[i]:
                j += 1
            if prots[i] != PROT_NONE:
                self.protect(ptr + i * g, (j - i) * g, prots[i])
            i = j

    def unmap(self, ptr: int, size: int) -> None:
        """Unmap [ptr, ptr+size): map the tombstone over each granule instead of PROT_NONE.

        A real GPU turns an access to an unmapped page into an illegal-address
        error; a host would segfault, killing the process. So an unmapped
        granule of the emulated device is backed by one shared, never-written
        memfd: a stale read or write (a kernel still using a tensor's old
        address) lands there harmlessly and allocates a host page in it, which
        `touched_unmapped()` reports. The device itself still treats the range
        as unmapped (copies, memsets and SetAccess refuse it).
        """
        g = self.granularity
        tombstone = self._tombstone_fd()
        for va in range(ptr, ptr + size, g):
            _os_mmap(va, g, PROT_RW, _MAP_SHARED | _MAP_FIXED, tombstone, 0)

    def protect(self, ptr: int, size: int, prot: int) -> None:
        """Set the access of mapped [ptr, ptr+size) to `prot` (PROT_NONE, PROT_READ or PROT_RW)."""
        _os_check(_libc.mprotect(ptr, size, prot), "mprotect")

    # ---------------------------------------------------------------- bytes
    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """Copy `nbytes` between accessible ranges (they may overlap)."""
        ctypes.memmove(dst, src, nbytes)

    def fill(self, dst: int, value: int, nbytes: int) -> None:
        """Set `nbytes` bytes of an accessible range to the byte `value`."""
        ctypes.memset(dst, value, nbytes)

    # ---------------------------------------------------------------- stale accesses
    def _tombstone_fd(self) -> int:
        """The tombstone's fd, made now if there is none (lock held)."""
        if self._tombstone is None:
            fd = os.memfd_create(TOMBSTONE_NAME, os.MFD_CLOEXEC)
            os.ftruncate(fd, self.granularity)
            self._tombstone = fd
        return self._tombstone

    def stale_probe_fd(self) -> int:
        """The file whose allocated blocks are the stale accesses `touched_unmapped` reports, made now if
        needed (a fast path reads it with fstat). Valid while any reservation of this device lives."""
        with self._lock:
            return self._tombstone_fd()

    def touched_unmapped(self) -> int:
        """Bytes of unmapped device memory read or written since the last call (host pages), then reset.

        0 unless something accessed an address whose page was unmapped: on a
        GPU that access would have been an illegal-address error.
        """
        fd = self._tombstone
        try:
            if fd is None or not os.fstat(fd).st_blocks:
                return 0  # the common case, without the lock
        except OSError:
            pass  # closed meanwhile (the device is closing): decide under the lock
        with self._lock:
            fd = self._tombstone
            if fd is None:
                return 0
            touched = os.fstat(fd).st_blocks * 512
            if touched:
                _os_check(_libc.fallocate(fd, _FALLOC_PUNCH_HOLE, 0, self.granularity), "fallocate")
            return touched
