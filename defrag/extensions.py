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

A build with CUDA (`with_cuda=True`) never initializes CUDA in torch: left
alone, `cpp_extension.load` asks `torch.cuda.get_device_capability()` for the
arch flags, which initializes torch.cuda and PyTorch's own allocator (after
which defrag's cannot be installed; on a CPU torch it raises IndexError).
`cuda_build()` says what the build uses instead: the toolkit
(`find_cuda_home`: one whose include/ holds cuda_runtime.h and
crt/host_config.h, checked, not assumed: torch takes the folder above the
`nvcc` on PATH, which a wrapper script in /usr/local/bin makes /usr/local)
and explicit arch flags (`cuda_archs`: TORCH_CUDA_ARCH_LIST, else each
device's compute capability from the driver through cuda-python). A build
that cannot have them fails with one line that says why, and its user falls
back. The failure remembered on disk is keyed on everything that decides the
build (source, compiler, torch, toolkit, arch flags): a fixed CUDA_HOME is
built again.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import re
import shutil
import sys
import threading
import time
from dataclasses import dataclass

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


# ------------------------------------------------------------------------------------ CUDA builds
CUDA_HEADERS = ("cuda_runtime.h", os.path.join("crt", "host_config.h"))  # cuda_runtime.h includes the second


def _has_headers(home: str) -> bool:
    return all(os.path.isfile(os.path.join(home, "include", h)) for h in CUDA_HEADERS)


def _follow_nvcc(path: str, depth: int = 0) -> str:
    """The real nvcc behind `path`: symlinks resolved, and a wrapper script (``exec /x/bin/nvcc "$@"``)
    followed to the nvcc it runs."""
    real = os.path.realpath(path)
    if depth >= 4:
        return real
    try:
        with open(real, "rb") as f:
            head = f.read(4096)
    except OSError:
        return real
    if not head.startswith(b"#!"):
        return real
    text = head.decode(errors="replace")
    for match in re.finditer(r"""(?:^|[\s;'"=])(/[^\s'";]*/nvcc)(?=[\s'";]|$)""", text, re.M):
        target = match.group(1)
        if os.path.isfile(target) and os.path.realpath(target) != real:
            return _follow_nvcc(target, depth + 1)
    return real


def _cuda_version_key(path: str):
    m = re.search(r"cuda-(\d+)(?:\.(\d+))?", path)
    return (int(m.group(1)), int(m.group(2) or 0)) if m else (0, 0)


def _wheel_homes() -> list[str]:
    """Folders of NVIDIA's CUDA header wheels (nvidia-cuda-runtime, nvidia-cuda-crt) on sys.path."""
    homes = []
    for entry in sys.path:
        if entry and os.path.isdir(os.path.join(entry, "nvidia")):
            homes += sorted(os.path.dirname(os.path.dirname(h))
                            for h in glob.glob(os.path.join(entry, "nvidia", "*", "include", "cuda_runtime.h")))
    return homes


SYSTEM_TOOLKITS = ("/usr/local/cuda", "/usr/local/cuda-*")


def find_cuda_home(*, system: tuple[str, ...] = SYSTEM_TOOLKITS) -> tuple[str | None, str]:
    """A CUDA toolkit to build against: (its folder, how it was found), or (None, what was tried).

    Candidates in order, each taken only if its include/ holds cuda_runtime.h and crt/host_config.h:
    $CUDA_HOME, $CUDA_PATH; the `nvcc` on PATH, followed through symlinks and wrapper scripts; torch's
    own choice (`cpp_extension.CUDA_HOME`); the `system` folders (/usr/local/cuda, then
    /usr/local/cuda-*, newest first); the nvidia-cuda-runtime / nvidia-cuda-crt wheels' folders."""
    candidates: list[tuple[str, str]] = []
    for name in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(name):
            candidates.append((os.environ[name], f"${name}"))
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = _follow_nvcc(nvcc)
        how = f"nvcc on PATH ({nvcc}" + (f" -> {real})" if real != nvcc else ")")
        candidates.append((os.path.dirname(os.path.dirname(real)), how))
        if real != nvcc:
            candidates.append((os.path.dirname(os.path.dirname(nvcc)), f"nvcc on PATH ({nvcc})"))
    try:
        from torch.utils import cpp_extension

        if getattr(cpp_extension, "CUDA_HOME", None):
            candidates.append((cpp_extension.CUDA_HOME, "torch's CUDA_HOME"))
    except ImportError:
        pass
    for pattern in system:
        for home in sorted(glob.glob(pattern), key=_cuda_version_key, reverse=True):
            candidates.append((home, home))
    candidates += [(home, "the nvidia-cuda-runtime wheel") for home in _wheel_homes()]
    tried, seen = [], set()
    for home, how in candidates:
        home = os.path.abspath(home)
        if home in seen:
            continue
        seen.add(home)
        if _has_headers(home):
            return home, how
        tried.append(f"{how}: {home} {'has no include/cuda_runtime.h' if os.path.isdir(home) else 'does not exist'}")
    return None, "; ".join(tried) or "no candidate (no CUDA_HOME, no nvcc on PATH, no /usr/local/cuda)"


_ARCH = re.compile(r"^(\d+)\.(\d+)(a|f)?(\+PTX)?$")


def _driver_capabilities(api=None) -> tuple[list[tuple[int, int]], str]:
    """Each visible device's compute capability from the CUDA driver through cuda-python (`api`, default
    `cuda.bindings.driver`; never torch.cuda), and the reason when there is none."""
    from cuda.bindings import driver as cu

    api = cu if api is None else api
    attr = cu.CUdevice_attribute
    try:
        err, = api.cuInit(0)
        if int(err):
            return [], f"cuInit failed ({err})"
        err, count = api.cuDeviceGetCount()
        if int(err) or not count:
            return [], "the CUDA driver reports no devices"
        found = []
        for i in range(int(count)):
            err, dev = api.cuDeviceGet(i)
            err1, major = api.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
            err2, minor = api.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
            if not (int(err) or int(err1) or int(err2)):
                found.append((int(major), int(minor)))
    except RuntimeError:  # cuda-python without a driver library
        return [], "no CUDA driver library"
    return sorted(set(found)), "" if found else "the CUDA driver answered no compute capability"


def cuda_archs(api=None) -> tuple[list[str] | None, str]:
    """The architectures a CUDA build targets ("9.0", ...) and where they came from: TORCH_CUDA_ARCH_LIST
    when set (but not "native"), else the driver's devices (`_driver_capabilities`), the newest with
    "+PTX" as torch does; (None, why) when neither can say."""
    env = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if env and env != "native":
        return [a for a in re.split(r"[;\s]+", env) if a], "TORCH_CUDA_ARCH_LIST"
    caps, why = _driver_capabilities(api)
    if not caps:
        return None, (f"no GPU to build for ({why}); set TORCH_CUDA_ARCH_LIST (e.g. '9.0') to build without one")
    newest = _torch_newest_arch()
    if newest is not None:  # as torch does: a device newer than this torch's own build gets torch's newest
        caps = sorted({min(cap, newest) for cap in caps})
    archs = [f"{major}.{minor}" for major, minor in caps]
    archs[-1] += "+PTX"
    return archs, "the CUDA driver's devices"


def _torch_newest_arch() -> tuple[int, int] | None:
    """The newest sm_ this torch was built for (`torch.cuda.get_arch_list()`, which initializes nothing),
    None for a torch without CUDA."""
    try:
        sms = [int(m.group(1)) for a in torch.cuda.get_arch_list() if (m := re.match(r"sm_(\d+)", a))]
    except Exception:  # noqa: BLE001 - a torch without CUDA, or one that cannot say
        return None
    return max((sm // 10, sm % 10) for sm in sms) if sms else None


def arch_flags(archs: list[str]) -> list[str]:
    """nvcc's -gencode flags for `archs` ("9.0", "9.0a", "10.0+PTX"), as torch writes them; a named
    architecture ("Hopper") gives none (torch expands it from TORCH_CUDA_ARCH_LIST itself)."""
    flags = []
    for arch in archs:
        m = _ARCH.match(arch)
        if m is None:
            continue
        num = f"{m.group(1)}{m.group(2)}{m.group(3) or ''}"
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if m.group(4):
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags


@dataclass(frozen=True)
class CudaBuild:
    """What a CUDA build uses: the toolkit (`home`, found `how`), the architectures (`archs`, from
    `arch_source`) and their nvcc flags."""

    home: str
    how: str
    archs: tuple[str, ...]
    arch_source: str
    flags: tuple[str, ...]

    def describe(self) -> str:
        return f"CUDA toolkit {self.home} ({self.how}), arch {';'.join(self.archs)} (from {self.arch_source})"


def cuda_build(api=None) -> tuple[CudaBuild | None, str]:
    """What a CUDA build here would use (`CudaBuild`), or (None, why it cannot be made): no toolkit
    with headers, or no architecture to build for. Touches no torch.cuda state."""
    home, how = find_cuda_home()
    if home is None:
        return None, f"no CUDA toolkit with headers found ({how}); set CUDA_HOME to one"
    archs, source = cuda_archs(api)
    if archs is None:
        return None, source
    return CudaBuild(home, how, tuple(archs), source, tuple(arch_flags(archs))), ""


@contextlib.contextmanager
def _cuda_build_environment(build: CudaBuild):
    """torch's build machinery pointed at `build` for the duration: cpp_extension.CUDA_HOME (read when
    it joins include and library paths) and $CUDA_HOME, and TORCH_CUDA_ARCH_LIST (older torch asks for
    arch flags without looking at extra_cuda_cflags: the variable keeps it from asking the device)."""
    from torch.utils import cpp_extension

    saved_home = cpp_extension.CUDA_HOME
    saved_env = {k: os.environ.get(k) for k in ("CUDA_HOME", "TORCH_CUDA_ARCH_LIST")}
    cpp_extension.CUDA_HOME = build.home
    os.environ["CUDA_HOME"] = build.home
    os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(build.archs)
    try:
        yield
    finally:
        cpp_extension.CUDA_HOME = saved_home
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


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
                module = self._import_built(folder)
                if module is None:
                    if not build:
                        raise RuntimeError(f"{self.what} was not built (the build in the background ended "
                                           f"without a library in {folder})")
                    plan = None
                    if self.with_cuda:
                        plan, why = cuda_build()
                        if plan is None:
                            raise RuntimeError(f"cannot build {self.what} with CUDA: {why}")
                    marker = self._failure_marker(folder, plan)
                    if os.path.exists(marker):  # a compile error would cost every process the full build again
                        with open(marker) as f:
                            self._failure = (f"{f.read().strip()} (an earlier build with the same source, compiler, "
                                             f"torch{' and CUDA toolkit' if plan else ''} failed; delete {marker} "
                                             f"to retry)")
                        return None
                    module = self._build(folder, plan)
                self._module = module
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

    def _build(self, folder: str, cuda: CudaBuild | None = None):
        """Build with torch's tooling; with CUDA, against `cuda`'s toolkit and arch flags, never asking
        torch.cuda (see the module docstring)."""
        from torch.utils import cpp_extension

        start = time.perf_counter()
        fresh = not os.path.exists(os.path.join(folder, f"{self.name}.so"))
        if fresh:
            _log.info("defrag: building %s in %s (%s, once per torch version and source%s)", self.what, folder,
                      self.expected, f"; {cuda.describe()}" if cuda else "")
        _drop_stale_lock(folder)
        source = self._source_path(folder)
        _write_if_changed(source, self.source)
        with _cuda_build_environment(cuda) if cuda else contextlib.nullcontext():
            module = cpp_extension.load(self.name, [source], build_directory=folder, extra_cflags=["-O2"],
                                        extra_cuda_cflags=list(cuda.flags) if cuda else None,
                                        with_cuda=True if cuda else None, verbose=False)
        if fresh:
            _log.info("defrag: %s built in %.1f s", self.what, time.perf_counter() - start)
        return module

    def _failure_marker(self, folder: str, cuda: CudaBuild | None = None) -> str:
        """The file that remembers a failed build, named by everything that decides it: the source, the
        compiler (as named and as found), torch's version and, with CUDA, the toolkit and arch flags."""
        cxx = os.environ.get("CXX", "c++")
        found = shutil.which(cxx)
        parts = [self.source, cxx, os.path.realpath(found) if found else "", torch.__version__]
        if cuda is not None:
            parts += [cuda.home, ";".join(cuda.archs), " ".join(cuda.flags)]
        key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]
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
