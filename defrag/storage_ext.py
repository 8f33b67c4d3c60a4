"""A tiny C++ extension that exchanges two storages' memory, for torch without `_swap_data_ptr_`.

torch >= 2.12 has `UntypedStorage._swap_data_ptr_`. Older torch (2.11 on the
GPU machines, every user on torch < 2.12) has no Python way to give a storage
other memory while its views follow; `resize_` does replace the DataPtr in
place, but only with memory from the storage's own allocator, which Python
cannot set. So this module compiles, on first need and once per torch build,
one C++ function that does the exchange on the `c10::StorageImpl`s directly.

Built with `torch.utils.cpp_extension.load` from a source that includes only
`c10/core/StorageImpl.h` and pybind11 (about 10 s on a 2-core machine; the
`load_inline` route includes all of `torch/extension.h` and takes about 3x
longer). CPU-only sources: no CUDA compiler is needed, and the same function
moves CUDA storages (a DataPtr is device-agnostic). The build goes to
`$DEFRAG_EXT_DIR`, else `$XDG_CACHE_HOME/defrag` or `~/.cache/defrag`, in a
folder per Python and torch version; later processes only re-link-check it.

This module only builds and calls; `defrag.tensors.swap_mode()` decides
whether it is used.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import threading
import time

import torch

_log = logging.getLogger("defrag")

_NAME = "defrag_storage_swap"

_SOURCE = r"""
// Exchange the memory of two c10::StorageImpls: what UntypedStorage._swap_data_ptr_
// does on torch >= 2.12, written against the StorageImpl API of torch 2.1+.
//
// Guarantees: on return, each storage holds the other's DataPtr (pointer, deleter
// and deleter context, device), allocator and resizable flag, so every tensor and
// view over either storage sees the other's memory, and each old memory is freed
// by its own deleter when the storage now holding it dies. Sizes are not touched.
// Either everything is exchanged or, if a check throws, nothing is.
//
// The caller must ensure: both storages are alive, on the same device, with the
// same nbytes; no other thread uses either storage's memory or fields meanwhile.
#include <pybind11/pybind11.h>
#include <c10/core/StorageImpl.h>
#include <cstdint>

static void swap_memory(std::uintptr_t a_cdata, std::uintptr_t b_cdata) {
  auto* a = reinterpret_cast<c10::StorageImpl*>(a_cdata);
  auto* b = reinterpret_cast<c10::StorageImpl*>(b_cdata);
  if (a == b) {
    return;
  }
  // Checks first: these may throw (copy-on-write materialization, storages that
  // forbid data access); nothing has changed yet if they do.
  TORCH_CHECK(a->device() == b->device(), "swap_memory: storages on different devices");
  TORCH_CHECK(!a->resizable() || a->allocator(), "swap_memory: resizable storage without allocator");
  TORCH_CHECK(!b->resizable() || b->allocator(), "swap_memory: resizable storage without allocator");
  c10::DataPtr& a_ptr = a->mutable_data_ptr();
  c10::DataPtr& b_ptr = b->mutable_data_ptr();
  // From here on nothing throws.
  c10::DataPtr held = std::move(a_ptr);
  a->set_data_ptr_noswap(std::move(b_ptr));
  b->set_data_ptr_noswap(std::move(held));
  c10::Allocator* a_allocator = a->allocator();
  bool a_resizable = a->resizable();
  a->set_allocator(b->allocator());
  b->set_allocator(a_allocator);
  a->set_resizable(b->resizable());
  b->set_resizable(a_resizable);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("swap_memory", &swap_memory,
        "Exchange the memory of two StorageImpls (UntypedStorage._cdata ints).");
}
"""

_lock = threading.Lock()
_module = None      # the loaded extension once built
_failure = None     # why it cannot be built/loaded (str), once tried and failed
_build_seconds = None

# A build interrupted by a crash leaves torch's lock file behind, and torch
# then waits for it forever; one older than this is taken as stale.
_STALE_LOCK_S = 600


def build_directory() -> str:
    root = os.environ.get("DEFRAG_EXT_DIR")
    if not root:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(cache, "defrag")
    tag = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}".replace("+", "_")
    return os.path.join(root, f"storage_swap-{tag}")


def _missing_tools() -> str | None:
    """What the build needs and this machine lacks, in words; None if nothing."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx!r} not found; install g++ or set CXX)"
    try:
        from torch.utils import cpp_extension  # imports setuptools
    except ImportError as e:
        return f"torch.utils.cpp_extension cannot be imported ({e}; pip install setuptools)"
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


def load():
    """The extension module, building it on the first call; None if it cannot be had.

    Thread-safe; the build runs at most once per process (and, through the
    build folder, once per machine and torch version). Never raises: a failure
    is remembered, logged once as a WARNING by the caller, and returned as None.
    """
    global _module, _failure, _build_seconds
    if _module is not None or _failure is not None:
        return _module
    with _lock:
        if _module is not None or _failure is not None:
            return _module
        start = time.perf_counter()
        marker = None
        try:
            missing = _missing_tools()
            if missing:
                raise RuntimeError(missing)
            from torch.utils import cpp_extension

            folder = build_directory()
            os.makedirs(folder, exist_ok=True)
            marker = _failure_marker(folder)
            if os.path.exists(marker):  # a compile error would cost every process the full build time again
                with open(marker) as f:
                    _failure = f"{f.read().strip()} (an earlier build failed; delete {marker} to retry)"
                return None
            source = os.path.join(folder, "storage_swap.cpp")
            fresh = not os.path.exists(os.path.join(folder, f"{_NAME}.so"))
            if fresh:
                _log.info("defrag: building the storage-swap extension in %s (about 10-30 s, once per torch version)",
                          folder)
            _drop_stale_lock(folder)
            _write_if_changed(source, _SOURCE)
            _module = cpp_extension.load(_NAME, [source], build_directory=folder,
                                         extra_cflags=["-O2"], verbose=False)
            _build_seconds = time.perf_counter() - start
            if fresh:
                _log.info("defrag: storage-swap extension built in %.1f s", _build_seconds)
        except Exception as e:  # compiler errors, missing headers, unwritable cache, import errors
            _failure = f"{type(e).__name__}: {_first_line(e)}"
            if marker is not None and not os.path.exists(marker) and "Error building extension" in str(e):
                try:
                    with open(marker, "w") as f:
                        f.write(_failure)
                except OSError:
                    pass
        return _module


def failure() -> str | None:
    """Why the extension is unavailable (after a failed `load()`), else None."""
    return _failure


def build_seconds() -> float | None:
    """How long this process's `load()` took (build or up-to-date check plus import)."""
    return _build_seconds


def swap(a: torch.UntypedStorage, b: torch.UntypedStorage) -> None:
    """Exchange the memory of `a` and `b` (same device and nbytes, checked by the caller)."""
    module = load()
    if module is None:
        raise RuntimeError(f"the storage-swap extension is unavailable: {_failure}")
    module.swap_memory(a._cdata, b._cdata)


def _failure_marker(folder: str) -> str:
    key = hashlib.sha256(f"{_SOURCE}\0{os.environ.get('CXX', 'c++')}".encode()).hexdigest()[:12]
    return os.path.join(folder, f"build-failed-{key}.txt")


def _write_if_changed(path: str, text: str) -> None:
    try:
        with open(path) as f:
            if f.read() == text:
                return
    except OSError:
        pass
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)  # atomic: a concurrent build never reads half a file


def _drop_stale_lock(folder: str) -> None:
    lock = os.path.join(folder, "lock")
    try:
        age = time.time() - os.stat(lock).st_mtime
    except OSError:
        return
    if age > _STALE_LOCK_S:
        _log.warning("defrag: removing a stale build lock %s (%.0f s old; a build was interrupted)", lock, age)
        try:
            os.remove(lock)
        except OSError:
            pass


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    # ninja/compiler failures put the useful line ("error: ...") somewhere inside.
    for ln in lines:
        if "error" in ln.lower() and ln is not lines[0]:
            return f"{lines[0][:200]} ... {ln.strip()[:300]}"
    return lines[0][:300] if lines else repr(e)


def _reset_for_tests() -> None:
    """Forget the loaded module and any failure (the build folder stays)."""
    global _module, _failure, _build_seconds
    with _lock:
        _module = _failure = _build_seconds = None
