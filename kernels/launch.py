"""The move kernel launched straight through a defrag `Driver`: tens of microseconds of host work per wave.

`MoveLauncher(driver, image)` loads a module image once (`load`, or `start` to
do it in a background thread), then `move(...)` launches one wave. A load that
failed is tried again after a delay (`RETRY_DELAYS`) by the next `load` or
`start`, unless it cannot succeed in this process (`KernelUnavailableError`:
no numba-cuda, another kernel ABI). A cached image the driver refuses
(`origin == "cache"`) is built again once, through ``image_source(rebuild=True)``.
A wave whose launch path raises anything but a `CudaError` (a binding that
takes other arguments than these) turns the launcher off for the process
(`fail`): the caller copies with the copy engine instead.

- the segment table goes through a few reused *slots*, each a page-locked
  host staging buffer (`Driver.alloc_host`), a device buffer
  (`Driver.alloc`) and an event, all made when the kernel loads (never in
  a wave, which may run inside an OOM rescue on a full GPU): the table is
  written into a slot's
  staging buffer, copied to its device buffer on the wave's stream
  (cuMemcpyHtoDAsync), and the slot's event is recorded after the kernel.
  A slot is reused only once its event has completed (its copy has read
  the staging buffer and its kernel the device table), so waves on one
  stream or several never overwrite a table in use, and nothing is
  allocated per wave: a slot grows (to the next power of two) only when a
  wave's table does not fit;
- the kernel is launched with cuLaunchKernel from one parameter buffer
  rewritten in place (`kernels.abi`);
- the geometry comes from the loaded kernel's occupancy at 256 threads per
  block and the SM count (`kernels.geometry`), asked once.

It does not synchronize: the caller waits (one synchronize per compaction).
Thread-safe: one lock around a launch. The image is anything with ``data``,
``entry`` and ``params`` (`kernels.image.KernelImage`): a cubin on a GPU,
host twins on the emulated device (`kernels.host`), where the same code then
runs against the emulated driver.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time

import numpy as np

from defrag.errors import CudaError

from . import abi
from .arena import KernelUnavailableError
from ._tables import WORD, segment_table
from .geometry import THREADS_PER_BLOCK, launch_geometry

_log = logging.getLogger("defrag")

SLOTS = 3
FIRST_SEGMENTS = 4096  # a slot's first table holds this many segments (3 x 4097 int64: 96 KiB)
RETRY_DELAYS = (10.0, 60.0, 600.0)  # seconds after the 1st, 2nd, 3rd and later failed loads before another try


class _Slot:
    """Staging buffer, device table and event of one launch in flight."""

    def __init__(self, driver):
        self.driver = driver
        self.event = driver.create_event()
        self.segments = 0  # capacity
        self.staging = self.device = 0
        self.host_view = None
        self.used = False

    def fit(self, segments: int) -> None:
        """Make room for a table of `segments` segments (the slot's last launch has completed)."""
        if segments <= self.segments:
            return
        cap = max(FIRST_SEGMENTS, 1 << (segments - 1).bit_length())
        nbytes = abi.TABLE_ROWS * (cap + 1) * 8
        self.release_buffers()
        drv = self.driver
        staging = drv.alloc_host(nbytes)
        try:
            device = drv.alloc(nbytes)
        except BaseException:
            drv.free_host(staging)
            raise
        self.staging, self.device, self.segments = staging, device, cap
        self.host_view = np.ctypeslib.as_array((ctypes.c_int64 * (nbytes // 8)).from_address(staging))

    def release_buffers(self) -> None:
        drv = self.driver
        if self.device:
            drv.free(self.device)
            self.device = 0
        if self.staging:
            drv.free_host(self.staging)
            self.staging = 0
        self.segments, self.host_view = 0, None

    def close(self) -> None:
        self.release_buffers()
        if self.event is not None:
            self.driver.destroy_event(self.event)
            self.event = None


class MoveLauncher:
    """One device's move kernel, loaded from `image` and launched through `driver` (see the module docstring).

    States: not loaded; `ready` (loaded, launches go ahead); or failed
    (`error` says why: the caller uses another copy engine; `retry_at` says
    when `load()` or `start()` tries again, None for never). `load()` and
    `start()` are idempotent while loaded or not due; `wait()` waits for a
    load in progress.
    """

    def __init__(self, driver, image_source, *, threads: int = THREADS_PER_BLOCK):
        self.driver = driver
        self._image_source = image_source  # () -> image; may compile (seconds) on a first run
        self.threads = threads
        self.ready = False
        self.error: str | None = None
        self.origin = ""  # where the image came from ("cache", "built", "host")
        self.function = self.module = None
        self.sm_count = self.blocks_per_sm = self.registers = 0
        self.launches = 0
        self._lock = threading.Lock()
        self._load_lock = threading.Lock()  # one load at a time (a background one and a caller's)
        self._loaded = threading.Event()
        self._thread: threading.Thread | None = None
        self._slots: list[_Slot] = []
        self._next = 0
        self._params = abi.MoveParams()
        self.failures = 0  # failed loads so far
        self.retry_at: float | None = None  # time.monotonic() from which a failed load is tried again
        self._clock = time.monotonic

    def _retry_due(self) -> bool:
        """Whether a finished, failed load should be tried again now."""
        return (self._loaded.is_set() and not self.ready and self.retry_at is not None
                and self._clock() >= self.retry_at)

    # ------------------------------------------------------------------ loading
    def start(self) -> None:
        """Load in a background thread (at pool creation: the first compaction then finds it loaded); after
        a failed load, once its retry is due, try again the same way."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            if self._loaded.is_set():
                if not self._retry_due():
                    return
            elif self._thread is not None:
                return
            self._loaded.clear()
            self._thread = threading.Thread(target=self.load, name="defrag-kernel-load", daemon=True)
            self._thread.start()

    def load(self) -> bool:
        """Get the image (cached or compiled), load it, ask its occupancy and the SM count, make the
        slots' tables; True when ready. Any failure is kept in `error` (logged), not raised; a failed load
        is made again once its retry is due (`retry_at`)."""
        with self._load_lock:
            if self._loaded.is_set() and not self._retry_due():
                return self.ready
            return self._load()

    def _image(self, rebuild: bool = False):
        image = self._image_source(rebuild=True) if rebuild else self._image_source()
        if image.params != abi.PARAMS:
            raise KernelUnavailableError(f"the image's entry takes {image.params} parameters, not {abi.PARAMS}")
        return image

    def _load(self) -> bool:
        drv = self.driver
        try:
            image = self._image()
            try:
                module = drv.load_module(image.data)
            except CudaError as exc:
                if getattr(image, "origin", "") != "cache":
                    raise
                # A cubin this driver cannot load (another driver or toolkit wrote it): build it again.
                _log.warning("defrag: the driver refused the cached move kernel image (%s); building it again", exc)
                image = self._image(rebuild=True)
                module = drv.load_module(image.data)
            try:
                function = drv.get_function(module, image.entry)
                blocks_per_sm = drv.occupancy(function, self.threads)
                if blocks_per_sm < 1:
                    raise KernelUnavailableError(f"the kernel cannot run {self.threads} threads per block "
                                                 f"(occupancy 0)")
                self.registers = drv.function_registers(function)
                self.sm_count = drv.multiprocessors()
                self._slots = [_Slot(drv) for _ in range(SLOTS)]
                for slot in self._slots:  # now, not in a wave: a wave may be an OOM rescue on a full GPU
                    slot.fit(FIRST_SEGMENTS)
            except BaseException:
                self._close_slots()
                drv.unload_module(module)
                raise
            self.module, self.function, self.blocks_per_sm = module, function, blocks_per_sm
            self.origin = getattr(image, "origin", "")
            self.ready, self.error, self.retry_at = True, None, None
        except Exception as exc:  # noqa: BLE001 - any reason the kernel cannot be launched this way
            self.failures += 1
            self.error = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, KernelUnavailableError):  # no numba-cuda, another kernel ABI: not in this process
                self.retry_at = None
                again = "not tried again in this process"
            else:
                delay = RETRY_DELAYS[min(self.failures, len(RETRY_DELAYS)) - 1]
                self.retry_at = self._clock() + delay
                again = f"tried again in {delay:.0f} s"
            _log.warning("defrag: the move kernel could not be loaded (%s); copies use the copy engine (%s)",
                         self.error, again)
        finally:
            self._loaded.set()
        return self.ready

    def fail(self, reason: str) -> None:
        """Turn the launcher off for this process: a wave's launch path raised something a driver error
        does not explain (`reason`), so every later wave would too. `ready` is False from now on (the
        module stays loaded until `close`)."""
        with self._lock:
            if not self.ready:
                return
            self.ready, self.error, self.retry_at = False, reason, None
        _log.error("defrag: the move kernel's launch failed (%s); copies use the copy engine from now on "
                   "(a defrag bug: please report it)", reason)

    def wait(self, timeout: float | None = None) -> bool:
        """Load now if nothing started it; else wait for the load in progress. Whether ready."""
        if self._thread is None:
            return self.load()
        self._loaded.wait(timeout)
        return self.ready

    @property
    def loaded(self) -> bool:
        """Whether loading has finished (ready or failed)."""
        return self._loaded.is_set()

    # ------------------------------------------------------------------ launches
    def geometry(self, total_words: int) -> tuple[int, int, int]:
        return launch_geometry(total_words, sm_count=self.sm_count, blocks_per_sm=self.blocks_per_sm,
                               threads=self.threads)

    def move(self, base: int, arena_bytes: int, src: np.ndarray, dst: np.ndarray, size: np.ndarray,
             stream: int = 0) -> None:
        """Queue one launch copying every `size[i]` bytes from ``base + src[i]`` to ``base + dst[i]``.

        Offsets and sizes are byte counts relative to `base` (16-byte aligned), multiples of 16, each
        range inside ``[base, base + arena_bytes)``; no destination overlaps a source or another
        destination (a wave). Not checked here: the callers pass plans' arrays. Asynchronous on
        `stream`. Zero-byte moves are skipped; nothing to move, no launch. RuntimeError when not ready.
        """
        if not self.ready:
            raise RuntimeError(f"the move kernel is not loaded ({self.error or 'load() not called'})")
        table, total = segment_table(src // WORD, dst // WORD, size // WORD)
        if total == 0:
            return
        segments = table.shape[1] - 1
        blocks, threads, chunk = self.geometry(total)
        drv = self.driver
        with self._lock:
            slot = self._slots[self._next]
            self._next = (self._next + 1) % len(self._slots)
            if slot.used:
                drv.wait_event(slot.event)  # its copy and kernel are done with its buffers
            slot.fit(segments)
            k = abi.TABLE_ROWS * (segments + 1)
            slot.host_view[:k] = table.reshape(-1)
            drv.copy_from_host_async(slot.device, slot.staging, k * 8, stream)
            try:
                self._params.set(base, arena_bytes, slot.device, segments, total, chunk)
                drv.launch(self.function, blocks, threads, self._params.address, stream)
                self.launches += 1
            finally:
                # After the copy (and the kernel, when it was launched): the slot is free once this completes.
                slot.used = True
                drv.record_event(slot.event, stream)

    def _close_slots(self) -> None:
        for slot in self._slots:
            slot.close()
        self._slots = []

    def close(self) -> None:
        """Free the slots and unload the module (after the device has finished every launch)."""
        if self._thread is not None:
            self._loaded.wait()
        with self._load_lock, self._lock:
            if self._slots:
                for slot in self._slots:
                    if slot.used:
                        self.driver.wait_event(slot.event)
                self._close_slots()
            if self.module is not None:
                self.driver.unload_module(self.module)
                self.module = self.function = None
            self.ready = False
