"""defrag's environment variables (``DEFRAG_*``): what each accepts, in one place.

Every ``DEFRAG_*`` variable defrag, its tests or its benchmarks read is a
`Variable` in `VARIABLES`; code that needs one calls its reader here
(`fastpath`, `device_size`, `ext_dir`, ...) instead of reading
``os.environ``. A reader returns the parsed value, or the default when the
variable is unset or empty, and raises `SettingError` (one line: the
variable, the value it holds, what it accepts) for anything else: a value
defrag cannot use is never ignored or guessed at.

The `defrag` command checks every variable before any command runs
(`problems`: one line each, exit code 2), and `defrag doctor` lists them
(`report`). The values are read from the environment on every call, so
tests may change them; nothing here is cached.

No torch and no driver: the core layers read their variables here too.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from dataclasses import dataclass

from .errors import SettingError
from .units import format_bytes, parse_size

__all__ = ["Variable", "VARIABLES", "SWITCH", "parse_switch", "fastpath", "force_no_swap_data_ptr", "no_storage_ext",
           "device_size", "ext_dir", "libnvvm", "gpu_rehearsal", "gpu_figures", "snapshots", "problems", "check_all",
           "unknown", "report"]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
SWITCH = "1 or 0 (also true/false, yes/no, on/off, any case)"  # what every on/off variable accepts
_DEVICE_SIZE_DEFAULTS = {"CAPACITY": 16 << 30, "GRANULARITY": 2 << 20}


@dataclass(frozen=True)
class Variable:
    """One environment variable: its name, what it accepts, its default and what it changes (for docs,
    `defrag doctor` and error messages)."""

    name: str
    accepts: str
    default: str
    meaning: str


VARIABLES: dict[str, Variable] = {v.name: v for v in (
    Variable("DEFRAG_EMULATED_CAPACITY", "a positive size ('16GiB', '512MiB', a byte count)", "16GiB",
             "the emulated device's memory (memfd pages cost nothing until written)"),
    Variable("DEFRAG_EMULATED_GRANULARITY", "a power of two of at least the host page size ('2MiB', '64KiB')",
             "2MiB", "the emulated device's page size (what H100/H200 report)"),
    Variable("DEFRAG_MEMORYLESS_CAPACITY", "a positive size", "16GiB",
             "the memory-less device's size (dry replays; it holds no bytes)"),
    Variable("DEFRAG_MEMORYLESS_GRANULARITY", "a power of two of at least the host page size", "2MiB",
             "the memory-less device's page size"),
    Variable("DEFRAG_FASTPATH", SWITCH + ", or wait (the same as 1)", "1",
             "pool.empty's native fast path (off: the Python ladder serves every request, and defrag.install "
             "cannot work)"),
    Variable("DEFRAG_FORCE_NO_SWAP_DATA_PTR", SWITCH, "0",
             "on: defrag acts as if torch lacked UntypedStorage._swap_data_ptr_ (tests of the older-torch paths)"),
    Variable("DEFRAG_NO_STORAGE_EXT", SWITCH, "0",
             "on: the storage-swap extension is never built (torch < 2.12 then moves storages by rebinding only)"),
    Variable("DEFRAG_EXT_DIR", "a folder defrag can write (made if missing)", "$XDG_CACHE_HOME/defrag or "
             "~/.cache/defrag", "where the native module and extensions are built, once per torch version"),
    Variable("DEFRAG_KERNEL_CACHE", "a folder defrag can write (made if missing)", "$XDG_CACHE_HOME/defrag/kernels "
             "or ~/.cache/defrag/kernels, else a folder in the temp dir", "where the compiled move kernel is kept, "
             "once per machine, kernel source and compute capability"),
    Variable("DEFRAG_CUDA_BACKEND", SWITCH, "1",
             "on: defrag run and defrag.install hand PyTorch defrag's own CUDA allocator backend where it can be "
             "built; 0: PyTorch's pluggable-allocator route (the entry points alone)"),
    Variable("DEFRAG_LIBNVVM", "the path of a libnvvm.so", "unset: numba finds its own",
             "the libNVVM numba compiles the kernels with (one no newer than the driver)"),
    Variable("DEFRAG_GPU_REHEARSAL", SWITCH, "0",
             "on: without a GPU, tests/gpu rehearse on the emulated device with 2 MiB pages"),
    Variable("DEFRAG_GPU_FIGURES", "a file path whose folder exists", "unset: not written",
             "tests/gpu append each figure they measure there, one JSON object a line"),
    Variable("DEFRAG_SNAPSHOTS", "a folder", "unset: benchmarks look in /work/shared/snapshots",
             "the real snapshots benchmarks/mesh_potential.py reads"),
)}


def _raw(name: str) -> str | None:
    """The variable's value, None when unset or empty (empty means "the default", as unset)."""
    value = os.environ.get(name)
    return value if value else None


def _refuse(name: str, raw: str, why: str) -> SettingError:
    """The one-line error: the variable, its value, `why` it cannot be used, what it accepts, its default."""
    v = VARIABLES[name]
    return SettingError(f"{name}={raw!r} {why}: use {v.accepts}, or unset it (default {v.default})")


def parse_switch(name: str, raw: str | None, extra: tuple[str, ...] = ()) -> bool:
    """The one parser of every on/off variable: `raw` (None or "" for unset: the variable's default) as a
    bool. Accepts 1/0, true/false, yes/no, on/off in any case, around spaces, and the `extra` words (read
    as on); `SettingError` (one line: the variable, its value, what it accepts) for anything else."""
    if raw is None or not raw.strip():
        return VARIABLES[name].default == "1"
    word = raw.strip().lower()
    if word in _TRUE or word in extra:
        return True
    if word in _FALSE:
        return False
    raise _refuse(name, raw, "is not a switch")


def _flag(name: str, extra: tuple[str, ...] = ()) -> bool:
    return parse_switch(name, _raw(name), extra)


def fastpath() -> bool:
    """DEFRAG_FASTPATH: whether pools attach the native allocation fast path (default on). "wait" reads as
    on: the first pool waits for the native build, as every pool does since the books are native."""
    return _flag("DEFRAG_FASTPATH", ("wait",))


def force_no_swap_data_ptr() -> bool:
    """DEFRAG_FORCE_NO_SWAP_DATA_PTR: act as if torch lacked `_swap_data_ptr_` (default off)."""
    return _flag("DEFRAG_FORCE_NO_SWAP_DATA_PTR")


def no_storage_ext() -> bool:
    """DEFRAG_NO_STORAGE_EXT: never build the storage-swap extension (default off)."""
    return _flag("DEFRAG_NO_STORAGE_EXT")


def device_size(kind: str, what: str) -> int:
    """DEFRAG_<KIND>_<WHAT> in bytes: `kind` "emulated" or "memoryless", `what` "capacity" (a positive
    size, default 16 GiB) or "granularity" (a power of two of at least the host page size, default
    2 MiB, as H100/H200 report: the pool aligns to it)."""
    name = f"DEFRAG_{kind.upper()}_{what.upper()}"
    default = _DEVICE_SIZE_DEFAULTS[what.upper()]
    raw = _raw(name)
    if raw is None:
        return default
    try:
        value = parse_size(raw, what=name)
    except ValueError:
        value = None
    if what.upper() == "GRANULARITY":
        if value is None or value < mmap.PAGESIZE or value & (value - 1):
            raise SettingError(f"{name}={raw!r} is not a granularity: use a power of two of at least the host "
                               f"page size ({format_bytes(mmap.PAGESIZE)}), such as '2MiB' (what H100/H200 report) "
                               f"or '64KiB', or unset it (default {format_bytes(default)})")
    elif value is None or value <= 0:
        raise SettingError(f"{name}={raw!r} is not a size: use a positive byte count or a string like "
                           f"'16GiB' or '512MiB', or unset it (default {format_bytes(default)})")
    else:
        try:
            page = device_size(kind, "granularity")
        except SettingError:
            page = None  # that variable's own error says so
        if page is not None and value < page:
            raise SettingError(f"{name}={raw!r} is less than one page of that device ({format_bytes(page)}, "
                               f"DEFRAG_{kind.upper()}_GRANULARITY): use at least that, or unset it (default "
                               f"{format_bytes(default)})")
    return value


def _can_write_in(folder: str) -> str | None:
    """None when a file can be made in `folder` (tried: as root, permission bits say nothing), else why not."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def _nearest_existing(path: str) -> str:
    probe = os.path.abspath(path)
    while not os.path.lexists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    return probe


def ext_dir() -> str | None:
    """DEFRAG_EXT_DIR: the folder to build defrag's native module and extensions in, or None (unset: the
    cache folder, `defrag.extensions` decides). Refused unless it is a folder defrag can write, or a
    folder it can make (its nearest existing parent is a folder it can write in); nothing is made here."""
    return _writable_folder("DEFRAG_EXT_DIR")


def kernel_cache() -> str | None:
    """DEFRAG_KERNEL_CACHE: the folder the compiled move kernel is kept in, or None (unset: the cache
    folder, `defrag.kernels.image` decides). Refused like DEFRAG_EXT_DIR."""
    return _writable_folder("DEFRAG_KERNEL_CACHE")


def cuda_backend() -> bool:
    """DEFRAG_CUDA_BACKEND: whether CUDA installs use defrag's own allocator backend where it can be built
    (default on)."""
    return _flag("DEFRAG_CUDA_BACKEND")


def _writable_folder(name: str) -> str | None:
    """The folder variable `name` names, or None (unset): a folder defrag can write, or one it can make."""
    raw = _raw(name)
    if raw is None:
        return None
    path = os.path.expanduser(raw)
    if os.path.isdir(path):
        why = _can_write_in(path)
        if why:
            raise _refuse(name, raw, f"is a folder defrag cannot write in ({why})")
        return path
    if os.path.lexists(path):
        raise _refuse(name, raw, "is a file, not a folder")
    parent = _nearest_existing(path)
    if not os.path.isdir(parent):
        raise _refuse(name, raw, f"cannot be made: {parent} is a file, not a folder")
    why = _can_write_in(parent)
    if why:
        raise _refuse(name, raw, f"cannot be made: nothing can be written in {parent} ({why})")
    return path


def libnvvm() -> str | None:
    """DEFRAG_LIBNVVM: the libNVVM to load before numba does, or None (unset). Refused unless it names a file."""
    raw = _raw("DEFRAG_LIBNVVM")
    if raw is None:
        return None
    if not os.path.isfile(os.path.expanduser(raw)):
        raise _refuse("DEFRAG_LIBNVVM", raw, "is not a file" if not os.path.isdir(raw) else "is a folder, not a file")
    return os.path.expanduser(raw)


def gpu_rehearsal() -> bool:
    """DEFRAG_GPU_REHEARSAL: whether tests/gpu rehearse on the emulated device without a GPU (default off)."""
    return _flag("DEFRAG_GPU_REHEARSAL")


def gpu_figures() -> str | None:
    """DEFRAG_GPU_FIGURES: the file tests/gpu append their figures to, or None (unset). Refused when it is
    a folder or its folder does not exist."""
    raw = _raw("DEFRAG_GPU_FIGURES")
    if raw is None:
        return None
    path = os.path.expanduser(raw)
    if os.path.isdir(path):
        raise _refuse("DEFRAG_GPU_FIGURES", raw, "is a folder, not a file")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise _refuse("DEFRAG_GPU_FIGURES", raw, f"cannot be written: the folder {folder} does not exist")
    return path


def snapshots() -> str | None:
    """DEFRAG_SNAPSHOTS: the folder of real snapshots the benchmarks read, or None (unset). Refused unless
    it is a folder."""
    raw = _raw("DEFRAG_SNAPSHOTS")
    if raw is None:
        return None
    path = os.path.expanduser(raw)
    if not os.path.isdir(path):
        raise _refuse("DEFRAG_SNAPSHOTS", raw, "is not a folder")
    return path


_READERS = {
    "DEFRAG_EMULATED_CAPACITY": lambda: device_size("emulated", "capacity"),
    "DEFRAG_EMULATED_GRANULARITY": lambda: device_size("emulated", "granularity"),
    "DEFRAG_MEMORYLESS_CAPACITY": lambda: device_size("memoryless", "capacity"),
    "DEFRAG_MEMORYLESS_GRANULARITY": lambda: device_size("memoryless", "granularity"),
    "DEFRAG_FASTPATH": fastpath,
    "DEFRAG_FORCE_NO_SWAP_DATA_PTR": force_no_swap_data_ptr,
    "DEFRAG_NO_STORAGE_EXT": no_storage_ext,
    "DEFRAG_EXT_DIR": ext_dir,
    "DEFRAG_KERNEL_CACHE": kernel_cache,
    "DEFRAG_CUDA_BACKEND": cuda_backend,
    "DEFRAG_LIBNVVM": libnvvm,
    "DEFRAG_GPU_REHEARSAL": gpu_rehearsal,
    "DEFRAG_GPU_FIGURES": gpu_figures,
    "DEFRAG_SNAPSHOTS": snapshots,
}


def problems() -> list[SettingError]:
    """Every variable in `VARIABLES` that holds a value defrag cannot use, as its `SettingError` (in the
    order of `VARIABLES`); [] when all are usable."""
    out = []
    for name in VARIABLES:
        try:
            _READERS[name]()
        except SettingError as exc:
            out.append(exc)
    return out


def check_all() -> None:
    """`SettingError` for the first variable that holds a value defrag cannot use; None when all are usable."""
    found = problems()
    if found:
        raise found[0]


def unknown() -> list[str]:
    """``DEFRAG_*`` names set in the environment that defrag reads nowhere (a typo, most likely)."""
    return sorted(n for n in os.environ if n.startswith("DEFRAG_") and n not in VARIABLES)


def report() -> list[str]:
    """For `defrag doctor`: one line per variable that is set (its value and what it changes), one saying
    how many are unset (their defaults apply), then one per unknown ``DEFRAG_*`` name. Assumes
    `problems()` found nothing."""
    lines = [f"{name}={_raw(name)!r}: {VARIABLES[name].meaning}" for name in VARIABLES if _raw(name) is not None]
    unset = len(VARIABLES) - len(lines)
    lines.append(f"{'all' if not lines else 'the other'} {unset} unset: defaults" if unset else "none unset")
    lines += [f"{name} is set, but defrag reads no such variable (a typo? docs/api.md lists the variables)"
              for name in unknown()]
    return lines
