"""PyTorch's CUDA allocator backend over a pool: building it, installing it, and checking that it compiles.

`defrag.install(pool)` of a CUDA pool makes the pool PyTorch's CUDA
allocator. Where it can, it installs defrag's own backend: a C++ subclass of
PyTorch's `c10::cuda::CUDACachingAllocator::CUDAAllocator`
(`native/torch_cuda_backend.cpp`, its own extension module, built here on
first use with `defrag.extensions.CppExtension` and linked against c10_cuda),
which answers every question PyTorch asks its allocator from the pool:
`memory_stats` and friends, `cacheInfo` (cuDNN's benchmark), snapshots and
history (`torch.cuda.memory._record_memory_history`, `_snapshot`,
`_dump_snapshot`, the OOM observer), `empty_cache`, memory fractions,
`record_stream`, CUDA graphs and MemPools (private pools), and a clear error
for CUDA IPC. It reaches the pool only through the pool's C ABI
(`native/pool_abi.h`), found by dlsym in defrag's loaded native module.

Where it cannot be had (torch older than 2.4, torch without CUDA, no CUDA
toolkit to build against, a build that fails, `DEFRAG_CUDA_BACKEND=0`),
`install` keeps the older route: PyTorch's `CUDAPluggableAllocator` over the
native module's entry points, which serves allocations only
(`defrag doctor` says which route this machine gets and why).

`compile_check()` compiles the backend's source to an object file against
the installed torch's headers and a CUDA toolkit's headers, without linking
c10_cuda (a CPU-only torch has the headers but not the library), and
remembers the result per source digest; the tests and `defrag doctor` use it.

This module imports no `defrag.pool`: it sees a pool through its public
methods (`snapshot`, `kind`, `device`, `id`).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time

import torch

from . import settings
from .errors import NativeBuildError

__all__ = ["MIN_TORCH", "PoolStats", "source_text", "unavailable_reason", "load", "install", "status",
           "compile_check", "cuda_include_dir", "pool_abi"]

MIN_TORCH = (2, 4)
_HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native")
SOURCES = ("pool_abi.h", "torch_cuda_backend.cpp")
_LOCAL_INCLUDE = re.compile(r'^\s*(#pragma once|#include "[^"]+")\s*$')

_lock = threading.Lock()
_extension = None
_module = None


def source_text() -> str:
    """The backend's one translation unit: the ABI header, then the backend (local includes dropped,
    `#line` directives keep compiler messages on the right file)."""
    parts = []
    for name in SOURCES:
        with open(os.path.join(_HERE, name)) as f:
            lines = f.read().splitlines()
        kept = ["" if _LOCAL_INCLUDE.match(line) else line for line in lines]
        parts.append(f'#line 1 "defrag/native/{name}"\n' + "\n".join(kept) + "\n")
    return "".join(parts)


def torch_version() -> tuple[int, int]:
    """(major, minor) of the installed torch."""
    major, minor = (int(x) for x in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())
    return major, minor


def cuda_include_dir() -> str | None:
    """The include folder of the CUDA toolkit the backend's build uses (`extensions.find_cuda_home`: one
    whose include/ holds cuda_runtime.h, checked), so the compile check and the build agree; None when
    there is none."""
    from .extensions import find_cuda_home

    home, _ = find_cuda_home()
    return os.path.join(home, "include") if home else None


def build_line() -> str:
    """What the backend's build uses here, in words, for `defrag doctor` (starts nothing): the toolkit
    and how it was found, the arch flags and where they came from; or why a build is impossible."""
    from .extensions import cuda_build

    build, why = cuda_build()
    return f"builds with {build.describe()}" if build else f"cannot be built here: {why}"


def unavailable_reason() -> str | None:
    """Why the backend cannot be built or used here, in words; None when it can (a build may still fail)."""
    if not settings.cuda_backend():
        return "turned off (DEFRAG_CUDA_BACKEND=0)"
    if torch_version() < MIN_TORCH:
        return f"torch {torch.__version__} is older than {MIN_TORCH[0]}.{MIN_TORCH[1]}"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is built without CUDA (no libc10_cuda to link)"
    try:
        from torch.utils import cpp_extension  # noqa: F401
    except ImportError as exc:
        return f"torch.utils.cpp_extension cannot be imported ({exc})"
    from .extensions import cuda_build, missing_tools

    if not _the_extension().is_built():  # a library built earlier needs no toolkit to be loaded
        build, why = cuda_build()
        if build is None:
            return why
    return missing_tools()


def _the_extension():
    global _extension
    if _extension is None:
        from .extensions import CppExtension

        _extension = CppExtension("defrag_cuda_backend", "cuda_backend", source_text(),
                                  "defrag's CUDA allocator backend", "about 1 min", with_cuda=True)
    return _extension


def load():
    """The backend module, built first if needed (one line on stderr says so), attached to the pool's ABI in
    defrag's native module. NativeBuildError (why, and that the pluggable route stays) if it cannot be had."""
    global _module
    if _module is not None:
        return _module
    with _lock:
        if _module is None:
            why = unavailable_reason()
            if why is not None:
                raise NativeBuildError(f"defrag's CUDA allocator backend is unavailable: {why}")
            extension = _the_extension()
            if not extension.is_built() and extension.failure() is None:
                print(f"defrag: building its CUDA allocator backend once for this machine and torch "
                      f"({extension.expected}) in {extension.build_directory()}", file=sys.stderr, flush=True)
            module = extension.load()
            if module is None:
                raise NativeBuildError(f"defrag's CUDA allocator backend could not be built: {extension.failure()}")
            from . import native

            module.attach(native.load_module().__file__)
            _module = module
    return _module


def install(pool, device: int) -> None:
    """Make the backend PyTorch's CUDA allocator, serving `device` from `pool` (already registered with the
    native entry points, `defrag.allocator_install.register_native`): the pool's `snapshot()` answers PyTorch's
    snapshots. RuntimeError (PyTorch's) after PyTorch's first CUDA allocation; NativeBuildError if the
    backend cannot be had (nothing changed then)."""
    module = load()
    module.set_snapshot_source(int(device), pool.snapshot)
    module.install()


def features() -> dict | None:
    """Which of PyTorch's optional allocator methods reach the backend (loaded only if already built: no
    build here), or None."""
    if _module is None:
        if unavailable_reason() is not None or not _the_extension().is_built():
            return None
        try:
            load()
        except NativeBuildError:
            return None
    return dict(_module.features())


def status() -> str:
    """The backend's state here in words, for `defrag doctor` (starts no build)."""
    why = unavailable_reason()
    if why is not None:
        return f"unavailable: {why}"
    if _module is not None:
        return "loaded"
    extension = _the_extension()
    if extension.failure() is not None:
        return f"unavailable: {extension.failure()}"
    return "built" if extension.is_built() else "not built yet (built by the first defrag.install of a CUDA pool)"


# ------------------------------------------------------------------------------------ the pool's ABI
class PoolStats(ctypes.Structure):
    """`DefragPoolStats` of native/pool_abi.h, field for field (int64 each)."""

    _fields_ = [(name, ctypes.c_int64) for name in (
        "struct_size", "allocated_bytes", "allocated_bytes_peak", "active_bytes", "active_bytes_peak",
        "reserved_bytes", "reserved_bytes_peak", "requested_bytes", "inactive_split_bytes", "live_blocks",
        "num_allocs", "num_frees", "num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free",
        "mapped_pages", "page_size", "capacity_bytes", "device_total_bytes", "largest_mapped_free")]


STATUS = {0: "ok", 1: "out of memory", 2: "error", 3: "no pool", 4: "busy"}


def pool_abi() -> ctypes.CDLL:
    """defrag's native module as a ctypes library with the pool ABI's signatures set (the backend's view of
    the pool; the tests call it this way). ctypes releases the GIL around each call, as PyTorch's
    allocator calls do."""
    from . import native

    lib = ctypes.CDLL(native.load_module().__file__)
    i32, i64, p = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
    sigs = {
        "defrag_pool_abi_version": (i32, []),
        "defrag_pool_stats_size": (i64, []),
        "defrag_pool_alloc": (i32, [i32, ctypes.c_size_t, p, ctypes.POINTER(p), ctypes.c_char_p, ctypes.c_size_t]),
        "defrag_pool_free": (i64, [i32, p, ctypes.POINTER(i32)]),
        "defrag_pool_stats": (i32, [i32, ctypes.POINTER(PoolStats)]),
        "defrag_pool_reset_peaks": (i32, [i32]),
        "defrag_pool_reset_accumulated": (i32, [i32]),
        "defrag_pool_largest_block": (i32, [i32, ctypes.POINTER(i64)]),
        "defrag_pool_empty_cache": (i32, [i32, ctypes.POINTER(i64)]),
        "defrag_pool_memory_fraction": (i32, [i32, ctypes.POINTER(ctypes.c_double)]),
        "defrag_pool_set_memory_fraction": (i32, [i32, ctypes.c_double, ctypes.c_char_p, ctypes.c_size_t]),
        "defrag_pool_record_stream": (i32, [i32, p, p]),
        "defrag_pool_set_budget": (i32, [i32, ctypes.c_double, ctypes.c_char_p, ctypes.c_size_t]),
        "defrag_pool_capture": (i32, [i32, p, i32]),
        "defrag_pool_capture_counts": (i32, [i32, ctypes.POINTER(i64), ctypes.POINTER(i64)]),
    }
    for name, (restype, argtypes) in sigs.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def set_pool_budget(pool, nbytes: int) -> int:
    """PyTorch's `set_per_process_memory_fraction` for `pool` (the pool ABI's `defrag_pool_set_budget`, with
    the GIL): the pool may hold `nbytes` of device memory (whole pages, at least one, at most the device's
    memory), lower or higher than before. Empty pages beyond it are given back now (`trim`, no meshing);
    pages holding live blocks stay until they empty (as PyTorch keeps reserved memory), and no page is made
    beyond the budget. Returns the capacity in force (bytes): the budget, or the pages still held where
    more than it."""
    core = pool.core
    page = core.page_size
    total = int(getattr(pool.driver, "total_memory", 0) or 0)
    if total > 0:
        nbytes = min(int(nbytes), total)
    pages = max(1, int(nbytes) // page)
    store = core.space.store
    pool._budget_pages = pages  # a later emptyCache brings the pool down to it
    if store.total > pages:
        pool.trim(mesh=False)
    held = max(pages, store.total)
    core.capacity_pages = held
    core.capacity = held * page
    core.backing.capacity_pages = held
    store.max_pages = held
    return held * page


def apply_pool_budget(pool) -> None:
    """After an emptyCache: a budget below what the pool held when it was set is reached as pages empty."""
    pages = getattr(pool, "_budget_pages", None)
    if pages is not None and pool.core.capacity_pages > pages:
        set_pool_budget(pool, pages * pool.core.page_size)


# ------------------------------------------------------------------------------------ compile check
def _check_key(cxx: str, include: str | None) -> str:
    text = "\0".join([source_text(), torch.__version__, cxx, include or "", sys.version])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _check_folder() -> str:
    root = settings.ext_dir()
    if not root:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(cache, "defrag")
    return os.path.join(root, "cuda-backend-checks")


def compile_command(output: str, *, torch_include: list[str] | None = None, cuda_include: str | None = None,
                    cxx: str | None = None, std: str | None = None) -> list[str]:
    """The compiler command that compiles the backend's source (read from stdin) to the object `output`,
    against torch's headers (`torch_include`, default the installed torch's) and a CUDA toolkit's. `std`:
    the C++ standard (default: C++20 from torch 2.14 on, whose headers need it, else C++17)."""
    from torch.utils import cpp_extension

    cxx = cxx or os.environ.get("CXX", "c++")
    std = std or ("c++20" if torch_version() >= (2, 14) else "c++17")
    includes = torch_include if torch_include is not None else cpp_extension.include_paths()
    abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))
    cmd = [cxx, f"-std={std}", "-fPIC", "-O0", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
           "-DTORCH_EXTENSION_NAME=defrag_cuda_backend", "-DTORCH_API_INCLUDE_EXTENSION_H"]
    if not any(os.path.isfile(os.path.join(d, "c10", "cuda", "impl", "cuda_cmake_macros.h")) for d in includes):
        cmd.append("-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE")  # a CPU build of torch ships c10/cuda without it
    for folder in [*includes, cuda_include, sysconfig.get_paths()["include"]]:
        if folder:
            cmd += ["-isystem", folder]
    return cmd + ["-x", "c++", "-c", "-", "-o", output]


def compile_check(*, refresh: bool = False) -> dict:
    """Compile the backend's source against the installed torch's headers and a CUDA toolkit's headers.

    Returns {"ok": bool, "reason": str, "seconds": float, "cached": bool}: `ok` None with the reason when
    the check cannot run here (no CUDA headers, no c10/cuda headers in torch, no compiler). Remembered per
    source, torch, compiler and headers (a few ms after the first run, about half a minute); `refresh`
    compiles again. Links nothing: a CPU-only torch has c10_cuda's headers, not the library.
    """
    cxx = os.environ.get("CXX", "c++")
    include = cuda_include_dir()
    if shutil.which(cxx) is None:
        return {"ok": None, "reason": f"no C++ compiler ({cxx!r})", "seconds": 0.0, "cached": False}
    if include is None:
        return {"ok": None, "reason": "no CUDA toolkit headers (cuda_runtime_api.h; set CUDA_HOME)",
                "seconds": 0.0, "cached": False}
    from torch.utils import cpp_extension

    if not any(os.path.isfile(os.path.join(d, "c10", "cuda", "CUDACachingAllocator.h"))
               for d in cpp_extension.include_paths()):
        return {"ok": None, "reason": f"torch {torch.__version__} ships no c10/cuda headers", "seconds": 0.0,
                "cached": False}
    if torch_version() < MIN_TORCH:
        return {"ok": None, "reason": f"torch {torch.__version__} is older than the backend supports",
                "seconds": 0.0, "cached": False}
    folder = _check_folder()
    record = os.path.join(folder, f"{_check_key(cxx, include)}.json")
    if not refresh:
        try:
            with open(record) as f:
                return {**json.load(f), "cached": True}
        except (OSError, ValueError):
            pass
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "backend.o")
        proc = subprocess.run(compile_command(out, cuda_include=include), input=source_text(), text=True,
                              capture_output=True)
        ok = proc.returncode == 0 and os.path.isfile(out)
    errors = [ln for ln in proc.stderr.splitlines() if "error" in ln]
    result = {"ok": ok, "reason": "compiled" if ok else "\n".join(errors[:20]) or proc.stderr[-2000:],
              "seconds": round(time.perf_counter() - start, 1), "torch": torch.__version__, "cuda_include": include}
    try:
        os.makedirs(folder, exist_ok=True)
        tmp_record = f"{record}.{os.getpid()}.tmp"
        with open(tmp_record, "w") as f:
            json.dump(result, f)
        os.replace(tmp_record, record)
    except OSError:
        pass
    return {**result, "cached": False}
