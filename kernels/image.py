"""The move kernel's GPU module image: compiled once per machine, cached on disk, loaded without numba.

`move_image(cc)` returns a `KernelImage` (the cubin of `_device.move_kernel`
for compute capability ``cc``, its entry symbol, its parameter count) from
the on-disk cache, or compiles it with numba-cuda (seconds, once per machine
and kernel version) and stores it there. A process that finds the image
cached needs neither numba nor libNVVM to launch the kernel: the cubin is
loaded with cuModuleLoadData and launched with cuLaunchKernel through
defrag's driver (`kernels.launch`).

Why not numba's own ``cache=True``: it stores the kernel as PTX, so every
process still links it (and imports numba, about a second) before the first
launch, and it keys the cache on the defining file's modification time only,
not on `_mix.py`, which the kernels also compile.

The cache key is a hash of the kernels' sources (`SOURCES`), the numba-cuda
version, the compute capability, `FORMAT`, and the toolchain that turns them
into a cubin (`toolchain_versions()`: libNVVM's version and file, nvJitLink's version,
the CUDA driver's version, since numba links with the driver where it has no
nvJitLink): an upgraded compiler or driver builds its own image. A cached
image the driver refuses to load is built again (`move_image(...,
rebuild=True)`, which `kernels.launch` asks for). Where: ``$DEFRAG_KERNEL_CACHE``
when set; else ``$XDG_CACHE_HOME/defrag/kernels`` (``~/.cache/defrag/kernels``);
when that cannot be written (a read-only home), a per-user folder in the
temporary directory; when none can, the image lives in memory for this
process only. Files are written to a temporary name and renamed, so
processes compiling at once never read half a file; an unreadable or
inconsistent entry is compiled again and replaced.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from . import abi

_log = logging.getLogger("defrag")

FORMAT = 1
HERE = Path(__file__).resolve().parent
SOURCES = ("_device.py", "_mix.py", "abi.py")  # the kernel's code and the parameter layout launches assume
CACHE_ENV = "DEFRAG_KERNEL_CACHE"
MOVE_SIGNATURE = "void(uint64[::1], int64[:, ::1], int64, int64, int64)"
NAME = "move"


@dataclass(frozen=True)
class KernelImage:
    """A module image to load (`data`), the kernel's entry symbol in it, how many 8-byte parameters
    that entry takes, and where the image came from ("cache", "built", or "host" for a host twin)."""

    data: bytes
    entry: str
    params: int
    origin: str


def numba_cuda_version() -> str:
    try:
        from importlib.metadata import version

        return version("numba-cuda")
    except Exception:  # noqa: BLE001 - metadata absent (a vendored numba-cuda): the key says so
        return "unknown"


def _library_identity(name: str) -> str:
    """The version and file (resolved path, size) of the NVIDIA library `name` that cuda-bindings loads
    ("nvvm", "nvJitLink"), or "none" where there is none: what decides how numba-cuda compiles here."""
    try:
        if name == "nvvm":
            from cuda.bindings import nvvm as lib
        else:
            from cuda.bindings import nvjitlink as lib
        version = ".".join(map(str, lib.version()))
    except Exception:  # noqa: BLE001 - not installed, not loadable: the key says so
        return f"{name} none"
    where = ""
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib

        path = os.path.realpath(load_nvidia_dynamic_lib(name).abs_path)
        where = f" {path} {os.path.getsize(path)}"
    except Exception:  # noqa: BLE001 - an older cuda-pathfinder: the version alone
        pass
    return f"{name} {version}{where}"


def toolchain_versions(driver_version: int | None = None) -> str:
    """What builds the image here, in words, for the cache key: libNVVM's and nvJitLink's versions and
    files, and the CUDA driver's version (`Driver.driver_version()`; None: not asked)."""
    return f"{_library_identity('nvvm')}; {_library_identity('nvJitLink')}; driver {driver_version}"


def cache_key(cc: tuple[int, int], *, sources: tuple[str, ...] = SOURCES, folder: Path = HERE,
              toolchain: str = "") -> str:
    """The cache key of the move kernel's image for compute capability `cc` built by `toolchain` (see the
    module docstring and `toolchain_versions()`)."""
    h = hashlib.sha256(f"defrag-kernel-image {FORMAT} {NAME} {MOVE_SIGNATURE} {numba_cuda_version()} "
                       f"sm_{cc[0]}{cc[1]} {toolchain}".encode())
    for name in sources:
        h.update(name.encode() + b"\0" + (folder / name).read_bytes())
    return h.hexdigest()[:32]


def cache_dirs() -> list[Path]:
    """The folders tried in order (see the module docstring)."""
    from defrag import settings  # the variable's checks live there

    env = settings.kernel_cache()
    if env:
        return [Path(env)]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    return [Path(base) / "defrag" / "kernels", Path(tempfile.gettempdir()) / f"defrag-kernels-{uid}"]


def _files(folder: Path, key: str) -> tuple[Path, Path]:
    return folder / f"{NAME}-{key}.cubin", folder / f"{NAME}-{key}.json"


def load_cached(key: str, dirs: list[Path] | None = None) -> KernelImage | None:
    """The image stored under `key` in the first folder that holds a consistent one, else None."""
    for folder in dirs if dirs is not None else cache_dirs():
        data_path, meta_path = _files(folder, key)
        try:
            meta = json.loads(meta_path.read_text())
            data = data_path.read_bytes()
        except (OSError, ValueError):
            continue
        if (not isinstance(meta, dict) or meta.get("key") != key or meta.get("bytes") != len(data)
                or meta.get("sha256") != hashlib.sha256(data).hexdigest() or meta.get("params") != abi.PARAMS
                or not isinstance(meta.get("entry"), str)):
            _log.info("defrag: kernel cache entry %s in %s is inconsistent; compiling it again", key, folder)
            continue
        return KernelImage(data, meta["entry"], meta["params"], "cache")
    return None


def store(image: KernelImage, key: str, dirs: list[Path] | None = None, *, toolchain: str = "") -> Path | None:
    """Write `image` under `key` into the first folder that takes it; returns that folder, or None when
    none could (the image is then used from memory by this process only)."""
    meta = {"key": key, "entry": image.entry, "params": image.params, "bytes": len(image.data),
            "sha256": hashlib.sha256(image.data).hexdigest(), "numba_cuda": numba_cuda_version(),
            "format": FORMAT, "toolchain": toolchain}
    for folder in dirs if dirs is not None else cache_dirs():
        data_path, meta_path = _files(folder, key)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            for path, payload in ((data_path, image.data), (meta_path, json.dumps(meta).encode())):
                fd, tmp = tempfile.mkstemp(dir=folder, prefix=path.name + ".")
                try:
                    with os.fdopen(fd, "wb") as f:
                        f.write(payload)
                    os.replace(tmp, path)
                except BaseException:
                    try:
                        os.unlink(tmp)
                    except OSError:
                        pass
                    raise
        except OSError as exc:
            _log.info("defrag: cannot write the kernel cache in %s (%s); trying the next place", folder, exc)
            continue
        return folder
    _log.warning("defrag: no writable folder for the kernel cache (tried %s; set %s): the move kernel is "
                 "compiled again in every process", ", ".join(map(str, cache_dirs() if dirs is None else dirs)),
                 CACHE_ENV)
    return None


def move_image(cc: tuple[int, int], *, build=None, dirs: list[Path] | None = None, toolchain: str | None = None,
               rebuild: bool = False) -> KernelImage:
    """The move kernel's image for `cc`: cached, else built (`build(cc)`, default `build_move_image`)
    and stored. `toolchain` is part of the key (default: `toolchain_versions()` without the driver's version).
    `rebuild=True`: built and stored even where the cache holds one (the driver refused that one).
    Raises what building raises (`KernelUnavailableError` without a usable numba-cuda)."""
    if toolchain is None:
        toolchain = toolchain_versions()
    key = cache_key(cc, toolchain=toolchain)
    if not rebuild:
        image = load_cached(key, dirs)
        if image is not None:
            return image
    image = (build or build_move_image)(cc)
    store(image, key, dirs, toolchain=toolchain)
    return image


ELF_MAGIC = b"\x7fELF"


def cubin_bytes(cubin) -> bytes:
    """The bytes of what numba-cuda's `get_cubin` returns: bytes-like up to numba-cuda 0.2x, a cuda.core
    `ObjectCode` (the bytes in `.code`; a str there is the file that holds them) from 0.30 on."""
    if not isinstance(cubin, (bytes, bytearray, memoryview)):
        code = getattr(cubin, "code", None)
        if code is not None:
            cubin = Path(code).read_bytes() if isinstance(code, (str, os.PathLike)) else code
    return bytes(cubin)


def entry_params(ptx: str, entry: str) -> list[str] | None:
    """The parameter types of `.entry entry(...)` in PTX text (e.g. ['u64', ...]), None when absent."""
    m = re.search(r"\.entry\s+" + re.escape(entry) + r"\s*\((.*?)\)", ptx, re.S)
    if m is None:
        return None
    return re.findall(r"\.param\s+\.(\w+)", m.group(1))


def build_move_image(cc: tuple[int, int]) -> KernelImage:
    """Compile `_device.move_kernel` for `cc` with numba-cuda and return its cubin (seconds). Checks the
    compiled entry takes exactly the 8-byte parameters `kernels.abi` packs; `KernelUnavailableError`
    otherwise, or without a GPU (the simulator compiles nothing)."""
    from .arena import KernelUnavailableError, require_backend

    if require_backend():
        raise KernelUnavailableError("the simulator compiles no GPU code: the move kernel's image needs a GPU")
    from . import _device

    kernel = _device.move_kernel.compile(MOVE_SIGNATURE)
    entry = kernel.entry_name
    ptx = kernel.library.get_asm_str(cc=cc)
    params = entry_params(ptx, entry)
    if params is None or len(params) != abi.PARAMS or any(t not in ("u64", "b64", "s64") for t in params):
        raise KernelUnavailableError(
            f"the compiled move kernel's entry {entry} takes parameters {params}, not the {abi.PARAMS} 8-byte "
            f"ones kernels.abi packs (a numba-cuda whose kernel ABI changed?): launches go through numba")
    data = cubin_bytes(kernel.library.get_cubin(cc=cc))
    if not data.startswith(ELF_MAGIC):
        raise KernelUnavailableError(f"numba-cuda's cubin for sm_{cc[0]}{cc[1]} is not an ELF image "
                                     f"({len(data)} bytes starting {data[:8]!r}): launches go through numba")
    return KernelImage(data, entry, abi.PARAMS, "built")
