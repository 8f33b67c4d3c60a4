"""Copying byte ranges inside a pool's device memory: the compaction's moves and the mesher's pieces. No torch.

`copy_ranges(core, stream, engine, moves)` copies (src, dst, nbytes) triples
whose destinations overlap no source and no other destination, with one of
`ENGINES`, queued on `stream`; the caller synchronizes (once, after every wave
of a compaction: stream order keeps the waves in turn):

- "auto" (the GPU's default): each move by the engine that is faster for its
  size: moves of `COPY_ENGINE_MIN_BYTES` or more by the copy engine (one
  cuMemcpyDtoDAsync each), all the others by the move kernel in ONE launch
  (`defrag.kernels.launch.MoveLauncher`: the cubin loaded once per process,
  compiled once per machine, a persistent table, cuLaunchKernel through the
  driver). While the kernel is not loaded yet (a first process still
  compiling it, or a machine where it cannot be built) every move goes to
  the copy engine: a compaction never waits for a compile. A wave whose
  launch path raises anything but a driver error (`CudaError`) turns the
  launcher off for the process and copies that wave with the copy engine
  (a driver error is raised: the compaction rolls that wave back). On the emulated
  device the kernel is its host twin (`defrag.kernels.host`), so the GPU's
  launch path runs there too; on the memory-less device, "driver";
- "memmove": the emulated device's host memory, one `memmove` per move;
- "driver": the copy engine for every move, on `stream`;
- "kernel": the move kernel for every move: on a GPU the launcher (waiting
  for its load), or numba's `batched_move` where the launcher cannot be
  loaded; on the emulated device numba's simulator.

`prepare(driver)` starts loading the GPU's kernel in the background (a pool
does at creation).
"""

from __future__ import annotations

import ctypes
import threading
import weakref

import numpy as np

ENGINES = ("auto", "memmove", "driver", "kernel")

#: engine="auto": a move of at least this many bytes goes to the copy engine, smaller ones to the move
#: kernel. Chosen from the only GPU figures we have (an H200, docs/benchmarks.md): there the copy engine
#: matched torch `copy_` from 64 MiB on (0.997x), where a call's fixed cost is under 1% of the copy,
#: while many small and medium moves need the kernel's single launch. `benchmarks/gpu_check.py` measures
#: the real crossover (bench `engine_crossover`): change this to what it reports.
COPY_ENGINE_MIN_BYTES = 64 << 20

#: The host twin the emulated device's launcher loads (`kernels.host.ENTRY_SIMULATED` runs the real kernel
#: body under numba's simulator; tests switch to it).
EMULATED_TWIN = "defrag_batched_move"


def default_engine(kind: str) -> str:
    """The copy engine a device kind uses unless told otherwise."""
    return {"cuda": "auto", "emulated": "memmove"}.get(kind, "driver")


class WaveMoves(list):
    """A wave's (src, dst, nbytes) triples, plus the same moves as int64 arrays of byte offsets from
    `base` inside an arena of `span` bytes (`arena`: (base, span, src, dst, size)), for the engines that
    take arrays. A slice or copy is a plain list (the arrays then come from the triples)."""

    __slots__ = ("arena",)

    def __init__(self, triples, arena):
        super().__init__(triples)
        self.arena = arena


def copy_ranges(core, stream: int, engine: str, moves: list[tuple[int, int, int]]) -> None:
    """Copy (src, dst, nbytes) triples on `stream` with `engine` (see the module docstring)."""
    if not moves:
        return
    if engine == "memmove":
        memmove = ctypes.memmove
        for src, dst, n in moves:
            memmove(dst, src, n)
    elif engine == "driver":
        copy = core.driver.copy
        for src, dst, n in moves:
            copy(dst, src, n, stream)
    elif engine == "auto":
        _copy_auto(core, stream, moves)
    elif engine == "kernel":
        _copy_kernel(core, stream, moves)
    else:
        raise ValueError(f"unknown copy engine {engine!r}; expected one of {ENGINES}")


def _copy_auto(core, stream: int, moves) -> None:
    driver = core.driver
    launcher = launcher_for(driver)
    if launcher is not None:
        if core.kind == "cuda":
            launcher.start()  # no-op once started (a pool starts it at creation)
        else:
            launcher.wait()  # the host twin loads at once
    if launcher is None or not launcher.ready:
        copy = driver.copy
        for src, dst, n in moves:
            copy(dst, src, n, stream)
        return
    base, span, src, dst, size = arena_of(moves)
    big = size >= COPY_ENGINE_MIN_BYTES
    if big.any():
        copy = driver.copy
        for s, d, n in zip(src[big].tolist(), dst[big].tolist(), size[big].tolist()):
            copy(base + d, base + s, n, stream)
        small = ~big
        src, dst, size = src[small], dst[small], size[small]
    if size.size and not _launch(launcher, base, span, src, dst, size, stream):
        copy = driver.copy
        for s, d, n in zip(src.tolist(), dst.tolist(), size.tolist()):
            copy(base + d, base + s, n, stream)


def _launch(launcher, base, span, src, dst, size, stream) -> bool:
    """`launcher.move(...)`; False (the launcher turned off, `MoveLauncher.fail`) when its launch path
    raised anything but a CudaError: the caller copies these moves another way. Copying them again is
    safe whatever the failed launch queued: within a wave no destination overlaps a source."""
    from .errors import CudaError

    try:
        launcher.move(base, span, src, dst, size, stream)
    except CudaError:
        raise
    except Exception as exc:  # noqa: BLE001 - a launch path that cannot work here (e.g. a binding's TypeError)
        launcher.fail(f"{type(exc).__name__}: {exc}")
        return False
    return True


def _copy_kernel(core, stream: int, moves) -> None:
    if core.kind == "cuda":
        launcher = launcher_for(core.driver)
        if launcher is not None and launcher.wait():
            base, span, src, dst, size = arena_of(moves)
            if _launch(launcher, base, span, src, dst, size, stream):
                return
    from .kernels import batched_move, device_arena
    base, span, rel = relative(moves)
    arena = device_arena(base, span)
    batched_move(arena, rel, stream=kernel_stream(core, stream))


def arena_of(moves):
    """(base, span, src, dst, size): the moves as int64 arrays of byte offsets from `base` (16-byte
    aligned), all inside [base, base + span)."""
    arena = getattr(moves, "arena", None)
    if arena is not None:
        return arena
    base, span, table = relative(moves)
    return base, span, table[:, 0], table[:, 1], table[:, 2]


def relative(moves):
    """Moves (whole 512-byte blocks) as an int64 (n, 3) table relative to the
    smallest arena covering them."""
    lo = min(min(s, d) for s, d, _ in moves)
    hi = max(max(s, d) + n for s, d, n in moves)
    lo -= lo % 512
    table = np.array([(s - lo, d - lo, n) for s, d, n in moves], dtype=np.int64).reshape(-1, 3)
    span = -(-(hi - lo) // 512) * 512
    return lo, span, table


def kernel_stream(core, handle: int):
    """The numba stream the kernels run on: `handle` (0: the default stream) on a GPU, None elsewhere."""
    if core.kind != "cuda":
        return None
    from numba import cuda
    return cuda.external_stream(handle) if handle else cuda.default_stream()


# ---------------------------------------------------------------------- the move kernel's launcher per device
_launchers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Driver -> MoveLauncher
_launchers_lock = threading.Lock()


def launcher_for(driver):
    """This device's `MoveLauncher` (made on first ask, not loaded yet), or None on a device without
    memory. On a GPU its image is the cached (or, once per machine, compiled) cubin; on the emulated
    device the kernel's host twin."""
    if driver.kind not in ("cuda", "emulated"):
        return None
    with _launchers_lock:
        launcher = _launchers.get(driver)
        if launcher is None:
            from .kernels.launch import MoveLauncher
            # The launcher holds the driver weakly: the table buffers go with the device.
            proxy = weakref.proxy(driver)
            source = _gpu_image(proxy) if driver.kind == "cuda" else _host_image(EMULATED_TWIN)
            launcher = _launchers[driver] = MoveLauncher(proxy, source)
        return launcher


def prepare(driver) -> None:
    """Start loading this GPU's move kernel in the background (compiling it first, once per machine),
    so that the first compaction finds it ready. Nothing to do on other devices."""
    if driver.kind == "cuda":
        launcher_for(driver).start()


def _gpu_image(driver):
    def source(rebuild: bool = False):
        from .kernels.image import move_image, toolchain_versions
        return move_image(driver.compute_capability(), toolchain=toolchain_versions(driver.driver_version()),
                          rebuild=rebuild)
    return source


def _host_image(entry: str):
    def source():
        from .driver import host_kernels
        from .kernels import abi, host
        from .kernels.image import KernelImage
        for name, run in ((host.ENTRY, host.run_move), (host.ENTRY_SIMULATED, host.run_move_simulated)):
            host_kernels.register(host_kernels.HostKernel(name, run, params=abi.PARAMS, registers=host.REGISTERS))
        return KernelImage(host_kernels.module_image(entry), entry, abi.PARAMS, "host")
    return source
