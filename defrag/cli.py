"""The `defrag` command: run, demo, doctor, bench, replay."""

from __future__ import annotations

import argparse
import re
import sys

from .arguments import UsageError


def _version(dist: str) -> str:
    from importlib import metadata
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _swap_line(tensors) -> str:
    """How this torch moves a storage with its views (builds the storage-swap extension once if needed)."""
    mode = tensors.swap_mode()
    if mode == "native":
        return "UntypedStorage._swap_data_ptr_ -> compaction can move every pool tensor, views follow"
    if mode == "extension":
        return ("defrag's storage-swap extension (torch < 2.12 lacks _swap_data_ptr_) -> compaction can move "
                "every pool tensor, views follow")
    from . import storage_ext
    why = storage_ext.failure() or "no native swap and no extension"
    return (f"rebinding only ({why}) -> compaction and adopt move a storage only when the pool can prove it "
            f"knows every tensor over it; views and other holders keep a block in place")


def _fast_line() -> str:
    """Whether the native books and pool.empty's C++ fast path are here (loads or builds them once)."""
    from . import fastpath, native
    from .errors import NativeBuildError

    try:
        native.load_module()
    except NativeBuildError as exc:
        return f"unavailable -> no pool can be made here: {exc}"
    if fastpath.setting() == "off":
        return "books native; fast path off (DEFRAG_FASTPATH=0) -> every pool.empty runs the Python ladder"
    return "ready -> pool.empty of any size that mapped pages hold costs about what torch.empty does"


_BACKEND_SERVES = ("memory_stats / memory_allocated / max_memory_allocated / memory_summary, reset_peak_memory_stats, "
                   "cacheInfo (cudnn.benchmark), _record_memory_history / _snapshot / _dump_snapshot, the OOM "
                   "observer, empty_cache, get/set_per_process_memory_fraction, record_stream, CUDA graphs and "
                   "torch.compile(mode='reduce-overhead') (private pools), MemPool; CUDA IPC: one clear error")
_PLUGGABLE_LACKS = ("allocations only: memory_stats and memory_summary, cudnn.benchmark's cacheInfo, snapshots and "
                    "history, the OOM observer, empty_cache, CUDA graph trees and IPC raise PyTorch's "
                    "'CUDAPluggableAllocator does not yet support'; pool.stats() and defrag's own snapshots work")


def _cuda_allocator_lines(gpu_usable: bool) -> list[str]:
    """Which route `defrag.install` of a CUDA pool takes here and what PyTorch's memory APIs do on it (starts
    no build: a backend not built yet is compile-checked, from the cached result when there is one). Without
    a usable GPU or without a CUDA build of torch, one short line: no CUDA route applies."""
    import torch

    from . import cuda_backend, fastpath

    if torch.version.cuda is None or not gpu_usable:
        cpu_torch = f"torch {torch.__version__} is a CPU build"
        why = (f"no usable GPU, and {cpu_torch}" if torch.version.cuda is None and not gpu_usable
               else f"{cpu_torch}: a CUDA build of torch would use the GPU" if torch.version.cuda is None
               else "no usable GPU")
        return [f"defrag run / install on CUDA: does not apply here ({why})"]
    if fastpath.setting() == "off":
        return ["defrag run / install on CUDA: the ctypes fallback (DEFRAG_FASTPATH=0): " + _PLUGGABLE_LACKS]
    why = cuda_backend.unavailable_reason()
    if why is None:
        lines = [f"defrag run / install on CUDA: defrag's CUDA allocator backend ({cuda_backend.status()}) -> "
                 f"answered from the pool: {_BACKEND_SERVES}",
                 f"  backend build: {cuda_backend.build_line()}"]
        features = cuda_backend.features()
        missing = {k: v for k, v in (features or {}).items() if isinstance(v, str) and v.startswith("NOT served")}
        if missing:
            lines.append("  not reached on this torch: " + "; ".join(f"{k} ({v})" for k, v in missing.items()))
        return lines
    lines = [f"defrag run / install on CUDA: PyTorch's pluggable allocator route, because the backend is "
             f"unavailable ({why}) -> {_PLUGGABLE_LACKS}",
             f"  backend build: {cuda_backend.build_line()}"]
    check = cuda_backend.compile_check()
    if check["ok"] is None:
        lines.append(f"  backend source: not compile-checked here ({check['reason']})")
    else:
        verdict = "compiles" if check["ok"] else "does NOT compile: " + check["reason"].splitlines()[0][:200]
        lines.append(f"  backend source: {verdict} against torch {_torch_version()}'s headers"
                     f"{' (cached)' if check['cached'] else ''}")
    return lines


def _torch_version() -> str:
    import torch

    return torch.__version__


def doctor(args) -> int:
    """Say plainly what works here and what does not. Exits 0 (`main` has already refused, with exit
    code 2, a DEFRAG_* variable that holds a value defrag cannot use)."""
    import torch

    from . import settings, tensors
    from .driver import cuda_driver_usable, default_emulated_driver
    from .units import format_bytes

    ok, reason = cuda_driver_usable()
    lines = [
        f"defrag {_version('defrag')}  python {sys.version.split()[0]}",
        f"torch {torch.__version__}: moving storages: " + _swap_line(tensors),
        "allocation fast path: " + _fast_line(),
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
    lines.extend(_cuda_allocator_lines(ok))
    emu = default_emulated_driver()
    lines.append(f"emulated device: '{emu.name}', capacity {format_bytes(emu.api.capacity)}, "
                 f"granularity {format_bytes(emu.granularity)} (DEFRAG_EMULATED_CAPACITY / DEFRAG_EMULATED_GRANULARITY)")
    lines.append(f"settings: all {len(settings.VARIABLES)} DEFRAG_* variables checked (docs/api.md lists them)")
    lines += [f"  {line}" for line in settings.report()]
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


class _OneLineParser(argparse.ArgumentParser):
    """argparse's own errors (a missing or unknown argument, a bad choice) as one line and exit code 2,
    like every other bad argument; `--help` still prints the usage."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # A value that starts like a negative number ("--capacity -1GiB") is a value, so that its own
        # check names what is wrong with it, not argparse's "expected one argument". No option of
        # ours looks like "-<digit>".
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# How long `defrag bench` takes, as its --help says: measured 2026-12-07 on the emulated device, 2 cores of an
# AMD EPYC VM that ran other tests at the same time (1-minute load average 2.4-3.3): the full run 402 s (rescue
# 98 s, install 58 s, sleep 40 s, alloc_mixed 35 s), --smoke 69 s (a first run also compiles the move kernel
# under numba's simulator: 95 s).
_BENCH_TIME = ("A full run takes about 7 min on a 2-core CPU (402 s measured on a busy one; less on a quiet "
               "machine); --only NAMES runs a few.")


def _bench_names() -> str:
    """The names `defrag bench --only` takes (runner.REGISTRY), for its --help; "" where benchmarks is absent."""
    try:
        from .benchmarks.runner import REGISTRY
    except ImportError:
        return ""
    return ", ".join(REGISTRY)


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="defrag", description="Move live GPU tensors to end fragmentation OOMs.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineParser)

    # `defrag run` parses its own arguments (everything after the script is the program's): `main` hands
    # them to defrag.run before argparse; this entry is for `defrag --help`.
    sub.add_parser("run", add_help=False, help="run a program unmodified with every PyTorch allocation in a pool "
                                                "(defrag run [options] script.py args... | -m module args...)")

    p = sub.add_parser("demo", help="build a fragmented pool, watch a big request fail, compact, watch it succeed")
    p.add_argument("--device", default=None, help="'emulated', 'cuda:N' (default: the GPU if one works, else emulated)")
    p.add_argument("--capacity", default="256MiB", help="pool capacity (default 256MiB)")
    p.add_argument("--out", default=".", help="folder for the before/after picture (default: current directory)")
    p.set_defaults(func=demo)

    p = sub.add_parser("doctor", help="versions, GPU and emulated device, and what will and won't work")
    p.set_defaults(func=doctor)

    p = sub.add_parser("bench", help="microbenchmarks side by side with PyTorch's allocator",
                       description=f"Microbenchmarks side by side with PyTorch's allocator. {_BENCH_TIME}")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes, to check the runner (its figures are not judged): about 70 s on a busy 2-core CPU")
    p.add_argument("--device", default=None, help="'emulated' or 'cuda:N' (default: GPU if one works)")
    p.add_argument("--out", default="bench-out", help="folder for results.json, results.md and plots")
    p.add_argument("--only", default=None, metavar="NAMES",
                   help="comma-separated benchmark names to run, of: " + (_bench_names() or "see docs/benchmarks.md"))
    p.set_defaults(func=bench)

    p = sub.add_parser("replay", help="replay an allocation trace or PyTorch memory snapshot")
    p.add_argument("path", help="a defrag trace (.jsonl/.json) or a torch.cuda.memory._dump_snapshot pickle")
    p.add_argument("--capacity", default=None,
                   help="pool capacity, e.g. 80GiB (required for a defrag trace; a snapshot's default: the GPU "
                        "at its OOM, reserved + free, else PyTorch's recorded peak reserved)")
    p.add_argument("--dry", action="store_true",
                   help="the pool's own code over a memory-less device: no bytes are mapped or copied (without it, "
                        "a trace the emulated device could not hold on this machine replays dry anyway, and says so)")
    p.add_argument("--json", default=None, help="write the results as JSON to this path")
    p.add_argument("--plot", default=None,
                   help="draw live and reserved bytes over time for every allocator and device, PyTorch's recorded "
                        "curve on top (PNG, or another format matplotlib writes: .svg, .pdf, ...)")
    p.add_argument("--snapshot-device", type=int, default=None,
                   help="replay only this device of a snapshot (default: every device with recorded actions)")
    p.add_argument("--device", default=None, help="'emulated' or 'cuda:N'")
    p.add_argument("--no-mesh", action="store_true",
                   help="leave out the defrag-mesh row (the pool meshing what cannot move; about half again the "
                        "replay's time)")
    p.set_defaults(func=replay)
    return parser


def main(argv=None) -> int:
    """Run one command; a `UsageError` becomes one line on stderr and exit code 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["run"]:
        return _run(argv[1:])
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
    except SystemExit as exc:  # --help (0), or argparse's own one-line error (2)
        return int(exc.code or 0)
    if extra:
        print(f"defrag {args.command}: error: unrecognized arguments: {' '.join(extra)} "
              f"(see defrag {args.command} --help)", file=sys.stderr)
        return 2
    if _bad_settings(args.command):
        return 2
    from .errors import NativeBuildError, SettingError

    try:
        return int(args.func(args) or 0)
    except (UsageError, SettingError) as exc:  # a bad argument, or a DEFRAG_* variable it cannot use
        print(f"defrag {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except NativeBuildError as exc:  # the machine, not the arguments: what to install, no traceback
        print(f"defrag {args.command}: error: {exc}", file=sys.stderr)
        return 1


def _bad_settings(command: str) -> bool:
    """Whether some DEFRAG_* variable holds a value defrag cannot use; each such one is then one line on
    stderr (checked before any command runs, so none fails half-way on one)."""
    from . import settings

    found = settings.problems()
    for exc in found:
        print(f"defrag {command}: error: {exc}", file=sys.stderr)
    return bool(found)


def _run(argv: list[str]) -> int:
    """`defrag run`: the program's exit code; a bad argument is one line and exit code 2."""
    from . import run
    from .errors import NativeBuildError, SettingError

    if _bad_settings("run"):
        return 2
    try:
        return run.main(argv)
    except UsageError as exc:
        print(f"defrag run: error: {exc} (see defrag run --help)", file=sys.stderr)
        return 2
    except SettingError as exc:
        print(f"defrag run: error: {exc}", file=sys.stderr)
        return 2
    except NativeBuildError as exc:
        print(f"defrag run: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
