"""Command-line argument checks shared by `defrag demo`, `bench` and `replay`.

Each check returns the parsed value or raises `UsageError`, whose message
speaks in command-line terms; `defrag.cli.main` prints it as one line and
exits 2. Every check runs before any work, so a long run never ends in an
error that its arguments could have told up front.
"""

from __future__ import annotations

import os
import re
from pathlib import Path


class UsageError(Exception):
    """A command-line argument that cannot work here.

    `main` prints the message as one line on stderr, after ``defrag COMMAND:
    error:``, and exits 2: no traceback. The message speaks in command-line
    terms (``--device emulated``), not in Python ones (``device='emulated'``).
    """


def size_arg(value, flag: str, *, at_least: int = 0, at_least_what: str = "") -> int:
    """Bytes from a size argument ("8GiB", "512MiB", "4096"), or `UsageError`.

    `at_least`: the smallest acceptable value, described by `at_least_what`
    (e.g. "one page (2.00 MiB)").
    """
    from .units import parse_size

    try:
        n = parse_size(value, what=flag)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if n < at_least:
        raise UsageError(f"{flag} {value!r} is smaller than {at_least_what or f'{at_least} bytes'}")
    return n


_DEVICE = re.compile(r"emulated|cuda(:\d+)?")


def gpu_count() -> int:
    """How many GPUs the CUDA driver reports (0 when it reports none or cannot be asked)."""
    from .driver.cuda import R, cu

    try:
        err, count = cu.cuDeviceGetCount()
    except RuntimeError:  # no CUDA driver library
        return 0
    return int(count) if err == R.CUDA_SUCCESS else 0


def device_arg(spec, flag: str = "--device", *, torch_cuda: bool = False, local_rank: str | None = None):
    """The `defrag.driver.Driver` a --device value names, or `UsageError` worded for the command line.

    None (or "", "auto"): the GPU if one works, else the emulated device;
    with `local_rank` (a launcher's LOCAL_RANK, e.g. torchrun's) the GPU
    ``cuda:{local_rank}``, so that the ranks of a node each get their own
    (`UsageError` when the node has no such GPU).
    `torch_cuda`: a CUDA device must also be usable by torch (the benchmarks
    compare against torch's own CUDA allocator).
    """
    from .driver import DeviceUnavailableError, cuda_driver_usable, open_driver
    from .errors import CudaError

    text = None if spec in (None, "", "auto") else str(spec)
    if text is not None and not _DEVICE.fullmatch(text):
        raise UsageError(f"{flag} {text!r} is not a device: use {flag} emulated, {flag} cuda or {flag} cuda:N")
    if text is None and local_rank is not None and cuda_driver_usable()[0]:
        count = gpu_count()
        if not local_rank.isdigit():
            raise UsageError(f"LOCAL_RANK={local_rank!r} is not a GPU index: give each rank {flag} cuda:N")
        if int(local_rank) >= count:
            raise UsageError(f"LOCAL_RANK={local_rank} asks for cuda:{local_rank}, but this machine has {count} "
                             f"GPU{'' if count == 1 else 's'}: start at most {count} rank{'' if count == 1 else 's'} "
                             f"per node (torchrun --nproc-per-node {count}), or give {flag} cuda:N")
        text = f"cuda:{int(local_rank)}"
    if text is not None and text.startswith("cuda"):
        ok, reason = cuda_driver_usable()
        if not ok:
            raise UsageError(f"{flag} {text}: no GPU is usable here ({reason}); use {flag} emulated (the CPU "
                             f"emulation), or leave {flag} out (the GPU when one works, else the emulation)")
    try:
        driver = open_driver(text)
    except DeviceUnavailableError as exc:  # the probe above said yes, the device said no
        raise UsageError(f"{flag} {text}: no GPU is usable here ({exc}); use {flag} emulated") from None
    except CudaError as exc:  # e.g. cuda:7 on a machine with one GPU
        raise UsageError(f"{flag} {text}: the CUDA driver refused this device ({exc}); "
                         f"`defrag doctor` lists what works here") from None
    if torch_cuda and driver.kind == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError(f"{flag} {text or 'cuda:0'}: torch {torch.__version__} cannot use the GPU "
                             f"(torch.cuda.is_available() is False); install a CUDA build of torch or use "
                             f"{flag} emulated")
    return driver


def device_label(driver) -> str:
    """'cuda:N' or 'emulated': how a command names the device it runs on."""
    return f"cuda:{driver.ordinal}" if driver.kind == "cuda" else "emulated"


def capacity_fits(capacity: int, driver, flag: str = "--capacity", *, need: float = 1.0, why: str = "") -> None:
    """`UsageError` unless `need` x `capacity` bytes fit in the device's memory.

    `why` says what the command does with the capacity (printed when the free
    memory, not the total, is the limit).
    """
    from .units import format_bytes

    free, total = driver.mem_info()
    where = "the emulated device" if driver.kind == "emulated" else f"{device_label(driver)} ({driver.name})"
    hint = ("; DEFRAG_EMULATED_CAPACITY sets the emulated device's size" if driver.kind == "emulated" else "")
    if capacity > total:
        raise UsageError(f"{flag} {format_bytes(capacity)} is more than {where} has ({format_bytes(total)})"
                         f"{hint}")
    if need * capacity > free:
        raise UsageError(f"{flag} {format_bytes(capacity)}: {why or 'the pool'} needs {format_bytes(need * capacity)}"
                         f" but {where} has {format_bytes(free)} free{hint}")


def pool_open_error(exc: Exception, capacity: int, flag: str = "--capacity", hint: str = "") -> UsageError:
    """A `UsageError` for a pool of `capacity` that the device refused to set up (reserve or map)."""
    from .units import format_bytes

    return UsageError(f"{flag} {format_bytes(capacity)}: the device cannot set up a pool this large ({exc}); "
                      f"use a smaller {flag}{hint}")


def _existing_ancestor(path: Path) -> Path:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe


def out_dir_arg(value, flag: str = "--out") -> Path:
    """A folder the command can write into (it may not exist yet), or `UsageError`.

    Checked before any work, so that a long run never ends in "cannot write".
    The folder is not created here.
    """
    path = Path(os.path.expanduser(str(value)))
    if path.exists():
        if not path.is_dir():
            raise UsageError(f"{flag} {value}: exists and is not a folder")
        if not os.access(path, os.W_OK | os.X_OK):
            raise UsageError(f"{flag} {value}: the folder is not writable")
        return path
    base = _existing_ancestor(path.absolute())
    if not base.is_dir():
        raise UsageError(f"{flag} {value}: cannot create the folder: {base} is a file, not a folder")
    if not os.access(base, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {value}: cannot create the folder: {base} is not writable")
    return path


def out_file_arg(value, flag: str) -> Path:
    """A file path the command can write (its folder must exist), or `UsageError`. Checked before any work."""
    path = Path(os.path.expanduser(str(value)))
    if path.is_dir():
        raise UsageError(f"{flag} {value}: is a folder, not a file")
    if path.exists() and not os.access(path, os.W_OK):
        raise UsageError(f"{flag} {value}: the file is not writable")
    folder = path.absolute().parent
    if not folder.is_dir():
        base = _existing_ancestor(folder)
        why = f"{base} is a file, not a folder" if base.exists() and not base.is_dir() else \
            f"the folder {folder} does not exist"
        raise UsageError(f"{flag} {value}: cannot write there: {why}")
    if not path.exists() and not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {value}: the folder {folder} is not writable")
    return path
