"""Small C++ extensions of defrag, compiled on first need with torch's own tooling, once per machine.

`CppExtension` builds one source with `torch.utils.cpp_extension.load` into
`$DEFRAG_EXT_DIR`, else `$XDG_CACHE_HOME/defrag` or `~/.cache/defrag`, in a
folder per extension, Python and torch version. A later process whose folder
holds a library built from the same source imports it directly (no compiler
run); a compile error is remembered on disk so that every later process does
not pay the failed build again. Nothing here raises to its caller but a
`SettingError` for a DEFRAG_EXT_DIR it cannot use: an extension that cannot
be had is None plus a one-line reason (`failure()`), and its user falls
back to Python (or says what to install).

Users: `defrag.storage_ext` (exchanging storages' memory on torch < 2.12),
`defrag.native` (the pool's books and the allocation fast path) and
`defrag.cuda_backend` (PyTorch's CUDA allocator backend, built with CUDA).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import sys
import threading
import time

import torch

from . import settings

_log = logging.getLogger("defrag")

# A build interrupted by a crash leaves torch's lock file behind, and torch
# then waits for it forever; one older than this is taken as stale.
_STALE_LOCK_S = 600


def missing_tools() -> str | None:
    """What a build needs and this machine lacks, in words; None if nothing."""
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


class CppExtension:
    """One C++ source built into an importable module on the first `load()`.

    `name`: the module's name; `folder`: the build folder's stem; `source`:
    the C++ text; `what`: how log lines name it; `expected`: the build time to
    announce ("about 10-30 s"); `with_cuda`: compile against the CUDA toolkit's
    headers and link torch's CUDA libraries (c10_cuda, torch_cuda, cudart).
    """

    def __init__(self, name: str, folder: str, source: str, what: str, expected: str, *, with_cuda: bool = False):
        self.name, self.folder, self.source, self.what, self.expected = name, folder, source, what, expected
        self.with_cuda = with_cuda
        self._lock = threading.Lock()
        self._module = None
        self._failure: str | None = None
        self._seconds: float | None = None

    def build_directory(self) -> str:
        """This extension's build folder (not made here). `SettingError` when DEFRAG_EXT_DIR names a folder
        defrag cannot write or make (`defrag.settings.ext_dir`)."""
        root = settings.ext_dir()
        if not root:
            cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
            root = os.path.join(cache, "defrag")
        tag = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}".replace("+", "_")
        # One folder per source too: processes of two defrag versions (an upgrade while one runs, two
        # environments) neither rebuild each other's library nor import it half-way through a rebuild.
        digest = hashlib.sha256(self.source.encode()).hexdigest()[:12]
        return os.path.join(root, f"{self.folder}-{tag}-{digest}")

    def load(self, *, build: bool = True):
        """The module, building it on the first call; None if it cannot be had.

        Thread-safe; the build runs at most once per process (and, through the
        build folder, once per machine, torch version and source). Never raises: a
        failure is remembered and returned as None (`failure()` says why).
        `build=False`: import what is built, never compile (a build elsewhere
        that left no library is then the failure). The one exception:
        `SettingError` when DEFRAG_EXT_DIR names a folder defrag cannot use,
        which no compiler would fix (checked first, remembered as nothing).
        """
        if self._module is not None or self._failure is not None:
            return self._module
        with self._lock:
            if self._module is not None or self._failure is not None:
                return self._module
            start = time.perf_counter()
            marker = None
            folder = self.build_directory()
            try:
                missing = missing_tools()
                if missing:
                    raise RuntimeError(missing)
                os.makedirs(folder, exist_ok=True)
                marker = self._failure_marker(folder)
                if os.path.exists(marker):  # a compile error would cost every process the full build time again
                    with open(marker) as f:
                        self._failure = f"{f.read().strip()} (an earlier build failed; delete {marker} to retry)"
                    return None
                module = self._import_built(folder)
                if module is None and not build:
                    raise RuntimeError(f"{self.what} was not built (the build in the background ended "
                                       f"without a library in {folder})")
                self._module = module or self._build(folder)
                self._seconds = time.perf_counter() - start
            except Exception as e:  # compiler errors, missing headers, unwritable cache, import errors
                self._failure = f"{type(e).__name__}: {_first_line(e)}"
                if marker is not None and not os.path.exists(marker) and "Error building extension" in str(e):
                    try:
                        with open(marker, "w") as f:
                            f.write(self._failure)
                    except OSError:
                        pass
            return self._module

    def is_built(self) -> bool:
        """Whether this machine has the library built from this very source (importable without a compiler)."""
        folder = self.build_directory()
        library = os.path.join(folder, f"{self.name}.so")
        try:
            with open(self._source_path(folder)) as f:
                return f.read() == self.source and os.path.getmtime(library) >= os.path.getmtime(f.name)
        except OSError:
            return False

    def failure(self) -> str | None:
        """Why the extension is unavailable (after a failed `load()`), else None."""
        return self._failure

    def build_seconds(self) -> float | None:
        """How long this process's `load()` took (build or cache check plus import)."""
        return self._seconds

    def reset_for_tests(self) -> None:
        """Forget the loaded module and any failure (the build folder stays)."""
        with self._lock:
            self._module = self._failure = self._seconds = None

    # ------------------------------------------------------------------ internals
    def _source_path(self, folder: str) -> str:
        return os.path.join(folder, f"{self.folder}.cpp")

    def _import_built(self, folder: str):
        """The library already built from this very source, imported without a compiler run; else None."""
        library = os.path.join(folder, f"{self.name}.so")
        if not self.is_built():
            return None
        if self.name in sys.modules:
            return sys.modules[self.name]
        spec = importlib.util.spec_from_file_location(
            self.name, library, loader=importlib.machinery.ExtensionFileLoader(self.name, library))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[self.name] = module
        return module

    def _build(self, folder: str):
        from torch.utils import cpp_extension

        start = time.perf_counter()
        fresh = not os.path.exists(os.path.join(folder, f"{self.name}.so"))
        if fresh:
            _log.info("defrag: building %s in %s (%s, once per torch version and source)", self.what, folder, self.expected)
        _drop_stale_lock(folder)
        source = self._source_path(folder)
        _write_if_changed(source, self.source)
        module = cpp_extension.load(self.name, [source], build_directory=folder, extra_cflags=["-O2"],
                                    with_cuda=True if self.with_cuda else None, verbose=False)
        if fresh:
            _log.info("defrag: %s built in %.1f s", self.what, time.perf_counter() - start)
        return module

    def _failure_marker(self, folder: str) -> str:
        key = hashlib.sha256(f"{self.source}\0{os.environ.get('CXX', 'c++')}".encode()).hexdigest()[:12]
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
