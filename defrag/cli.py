"""The `defrag` command: demo, doctor, bench, replay."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path


class UsageError(Exception):
    """A command-line argument that cannot work here.

    `main` prints the message as one line on stderr, after ``defrag COMMAND:
    error:``, and exits 2: no traceback. The message speaks in command-line
    terms (``--device emulated``), not in Python ones (``device='emulated'``).
    """


# ---------------------------------------------------------------------- argument checks shared by the commands
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


def device_arg(spec, flag: str = "--device", *, torch_cuda: bool = False):
    """The `defrag.driver.Driver` a --device value names, or `UsageError` worded for the command line.

    None (or "", "auto"): the GPU if one works, else the emulated device.
    `torch_cuda`: a CUDA device must also be usable by torch (the benchmarks
    compare against torch's own CUDA allocator).
    """
    from .driver import DeviceUnavailableError, cuda_driver_usable, open_driver
    from .errors import CudaError

    text = None if spec in (None, "", "auto") else str(spec)
    if text is not None and not _DEVICE.fullmatch(text):
        raise UsageError(f"{flag} {text!r} is not a device: use {flag} emulated, {flag} cuda or {flag} cuda:N")
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


def _version(dist: str) -> str:
    from importlib import metadata
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def doctor(args) -> int:
    """Say plainly what works here and what does not. Always exits 0."""
    import torch

    from . import tensors
    from .driver import cuda_driver_usable, default_emulated_driver
    from .units import format_bytes

    ok, reason = cuda_driver_usable()
    lines = [
        f"defrag {_version('defrag')}  python {sys.version.split()[0]}",
        f"torch {torch.__version__}: UntypedStorage._swap_data_ptr_ "
        + ("present -> compaction can move every pool tensor" if tensors.HAS_SWAP_DATA_PTR
           else "MISSING (torch < 2.12) -> compaction and adopt move a storage only when the pool can prove it "
                "knows every tensor over it; views and other holders keep a block in place"),
        f"numba {_version('numba')}, numba-cuda {_version('numba-cuda')}, cuda-python {_version('cuda-python')} "
        f"(cuda-bindings {_version('cuda-bindings')})",
    ]
    if ok:
        from .driver import open_driver
        drv = open_driver("cuda:0")
        free, total = drv.mem_info()
        lines.append(f"GPU: {drv.name}, {format_bytes(total)} total, {format_bytes(free)} free, "
                     f"VMM granularity {format_bytes(drv.granularity)}; torch.cuda.is_available()={torch.cuda.is_available()}")
        lines.append("-> Pool(device=None) uses the GPU; copy kernels run with numba-cuda.")
    else:
        lines.append(f"GPU: none usable ({reason})")
        lines.append("-> Pool(device=None) uses the emulated device (CPU tensors over emulated device memory); "
                     "kernels can run under the numba simulator (NUMBA_ENABLE_CUDASIM=1) for tests.")
    emu = default_emulated_driver()
    lines.append(f"emulated device: '{emu.name}', capacity {format_bytes(emu.api.capacity)}, "
                 f"granularity {format_bytes(emu.granularity)} (DEFRAG_EMULATED_CAPACITY / DEFRAG_EMULATED_GRANULARITY)")
    print("\n".join(lines))
    return 0


def demo(args) -> int:
    from .demo import main as demo_main
    return demo_main(args)


def bench(args) -> int:
    from .benchmarks.runner import main as bench_main
    return bench_main(args)


def replay(args) -> int:
    from .replay import main as replay_main
    return replay_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="defrag", description="Move live GPU tensors to end fragmentation OOMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="build a fragmented pool, watch a big request fail, compact, watch it succeed")
    p.add_argument("--device", default=None, help="'emulated', 'cuda:N' (default: the GPU if one works, else emulated)")
    p.add_argument("--capacity", default="256MiB", help="pool capacity (default 256MiB)")
    p.add_argument("--out", default=".", help="folder for the before/after picture (default: current directory)")
    p.set_defaults(func=demo)

    p = sub.add_parser("doctor", help="versions, GPU and emulated device, and what will and won't work")
    p.set_defaults(func=doctor)

    p = sub.add_parser("bench", help="microbenchmarks side by side with PyTorch's allocator")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: finishes in well under a minute on a CPU")
    p.add_argument("--device", default=None, help="'emulated' or 'cuda:N' (default: GPU if one works)")
    p.add_argument("--out", default="bench-out", help="folder for results.json, results.md and plots")
    p.add_argument("--only", default=None, help="comma-separated benchmark names to run")
    p.set_defaults(func=bench)

    p = sub.add_parser("replay", help="replay an allocation trace or PyTorch memory snapshot")
    p.add_argument("path", help="a defrag trace (.jsonl/.json) or a torch.cuda.memory._dump_snapshot pickle")
    p.add_argument("--capacity", required=True, help="pool capacity, e.g. 80GiB")
    p.add_argument("--dry", action="store_true", help="accounting only: no bytes are mapped or copied")
    p.add_argument("--json", default=None, help="write the results as JSON to this path")
    p.add_argument("--device", default=None, help="'emulated' or 'cuda:N'")
    p.set_defaults(func=replay)
    return parser


def main(argv=None) -> int:
    """Run one command; a `UsageError` becomes one line on stderr and exit code 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UsageError as exc:
        print(f"defrag {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
