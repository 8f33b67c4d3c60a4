"""`defrag run`: an unmodified program with every allocation in a pool, in the spirit of `torchrun`.

``defrag run [--capacity C] [--device D] [--report PATH] script.py args...``
``defrag run [options] -m module args...``

Makes a pool, installs it as PyTorch's allocator (`defrag.install`: on the
emulated device PyTorch's CPU allocator, so every CPU tensor of the program
lives in the pool; on a GPU PyTorch's CUDA allocator), then runs the program
as ``__main__`` with its own ``sys.argv``, as ``python script.py args`` or
``python -m module args`` would, and exits with its exit code. At the end it
prints one summary line on stderr (the program's stdout stays the program's
own): peak live, peak reserved, the bytes stranded at exit in partly used
pages and their share of the reserved bytes (once the program's own objects
are collected), OOMs, compactions; with
``--report PATH`` it also writes the pool's stats as JSON, with the first and
the last out-of-memory refusal as they were then (the request, live, stranded
and reserved bytes, the capacity the message advised, the pool's stats).

What it guarantees: the install happens before the program's first line
runs, so every allocation the program makes goes to the pool (except those
the allocator hands to PyTorch's own allocator by rule: a forked child's, see
`defrag.cpu_allocator`); an uncaught exception prints its traceback as Python
would (from the program's first frame) and exits 1; ``sys.exit(code)`` exits
with that code; Ctrl-C exits 130. The summary and the report are written
whatever the exit code. Bad arguments (an unknown option, a missing script or
module, a capacity the device cannot hold, a report path that cannot be
written) get one line and exit code 2 before anything runs.

Under torchrun (``torchrun --nproc-per-node N --no-python defrag run ... train.py``:
torchrun outside, one `defrag run` per worker; the other way round is refused,
since torchrun's workers would run outside any pool), each rank (RANK,
WORLD_SIZE > 1) writes its own report and history (``mem.json`` ->
``mem.rank1.json``), its summary line and out-of-memory message begin with
``[rank 1/2]``, and without ``--device`` it takes the GPU ``cuda:$LOCAL_RANK``.

What it does not do: it cannot see allocations of child processes started
with ``spawn`` (they are fresh interpreters, PyTorch's own allocator serves
them), nor report when the program ends with ``os._exit`` (no summary).
"""

from __future__ import annotations

import builtins
import gc
import json
import os
import runpy
import sys
import time
import traceback
import types
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from .arguments import UsageError

__all__ = ["main", "parse", "RunArgs", "summary_line"]

USAGE = ("usage: defrag run [--capacity C] [--device D] [--report PATH] [--record PATH] [--rescue]\n"
         "                  [--compact-at step [--compact-min SIZE]] script.py [args ...]  (or -m module [args ...])")

HELP = USAGE + """

Run a Python program unmodified with every PyTorch allocation in a defrag pool.

options (before the script or -m):
  --capacity C     pool capacity, e.g. 40GiB (default: the device's free memory)
  --device D       'emulated' or 'cuda:N' (default: the GPU if one works, cuda:$LOCAL_RANK under
                   torchrun, else emulated; on the emulated device the program's CPU tensors live in
                   the pool)
  --report PATH    write the pool's stats (peaks included) as JSON to PATH at the end (under torchrun
                   one file per rank: mem.json -> mem.rank0.json, mem.rank1.json; --record too)
  --record PATH    record the program's allocation history and write it at the end as a memory
                   snapshot (PyTorch's pickle format): `defrag replay PATH` replays it, PyTorch's
                   memory_viz draws it (the newest 1,000,000 events are kept, about
                   0.5 KiB of host memory each)
  --rescue         an operation that runs out of memory runs again once, after a compaction that
                   moves PyTorch's tensors too (at that safe point the operation has unwound)
  --compact-at step
                   compact after each optimizer.step() (torch's global optimizer hooks) when the
                   pool's stranded bytes reach --compact-min; PyTorch's tensors move there too
  --compact-min SIZE
                   the stranded bytes that make --compact-at step compact (default: 1/16 of the
                   capacity)
  -m MODULE        run a library module as a script, like python -m
  -h, --help       show this help

Prints one summary line on stderr at the end; exits with the program's exit code.
With torchrun, defrag run goes inside it, once per worker:
  torchrun --nproc-per-node 2 --no-python defrag run [options] train.py [args ...]"""

_VALUED = ("--capacity", "--device", "--report", "--record", "--compact-at", "--compact-min")
_FLAGS = ("--rescue",)
COMPACT_AT = ("step",)
RECORD_ENTRIES = 1_000_000  # events `--record` keeps (the newest); a training step makes a few hundred


@dataclass
class RunArgs:
    """What `defrag run` was asked: its options, and the program (a script path or a module) with its argv."""

    capacity: str | None = None
    device: str | None = None
    report: str | None = None
    record: str | None = None
    rescue: bool = False
    compact_at: str | None = None
    compact_min: str | None = None
    script: str | None = None
    module: str | None = None
    args: list[str] = field(default_factory=list)
    help: bool = False


def parse(argv: list[str]) -> RunArgs:
    """Split `argv` into defrag's options and the program; `UsageError` for an unknown or incomplete option.

    defrag's options come first; the first token that is not one of them (the
    script), ``-m MODULE`` or ``--`` ends them, and everything after belongs to
    the program, options included (``defrag run train.py --capacity 1`` passes
    ``--capacity 1`` to train.py).
    """
    out = RunArgs()
    i = 0
    while i < len(argv):
        token = argv[i]
        if token in ("-h", "--help"):
            out.help = True
            return out
        if token == "--":
            i += 1
            break
        name, eq, value = token.partition("=")
        if name in _VALUED:
            if not eq:
                if i + 1 >= len(argv):
                    raise UsageError(f"{name} needs a value")
                value = argv[i + 1]
                i += 1
            setattr(out, name[2:].replace("-", "_"), value)
            i += 1
            continue
        if token in _FLAGS:
            setattr(out, token[2:], True)
            i += 1
            continue
        if token.startswith("-m"):  # "-m module" or "-mmodule", as python takes it
            module = token[2:] or (argv[i + 1] if i + 1 < len(argv) else "")
            if not module:
                raise UsageError("-m needs a module name")
            out.module = module
            out.args = argv[i + (1 if token[2:] else 2):]
            return out
        if token.startswith("-") and token != "-":
            raise UsageError(f"unknown option {token} (defrag's options go before the script: {USAGE.splitlines()[0][7:]})")
        break
    if i >= len(argv):
        raise UsageError("no program to run: give a script (defrag run train.py args...) or -m module")
    out.script, out.args = argv[i], argv[i + 1:]
    return out


# Launchers that start the program's workers as new processes, which PyTorch's own allocator serves:
# under `defrag run` they would run outside any pool. `defrag run` goes inside them instead.
_LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch")
_LAUNCHER_SCRIPTS = ("torchrun",)
# torchrun's options that take no value (every other option takes the next token, unless written with =).
_LAUNCHER_FLAGS = ("--standalone", "--no-python", "--no_python", "-m", "--module", "--run-path", "--run_path",
                   "--use-env", "--use_env")


def _defrag_options(args: RunArgs) -> list[str]:
    """The `defrag run` options of `args`, as typed."""
    out = []
    for name in ("capacity", "device", "report", "record", "compact_at", "compact_min"):
        if getattr(args, name) is not None:
            out += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return out + (["--rescue"] if args.rescue else [])


def _launcher_refusal(args: RunArgs) -> str | None:
    """The one line that refuses `defrag run torchrun ...` (or -m torch.distributed.run / launch) and gives
    the command that works: torchrun outside, `defrag run` in each worker; None for any other program."""
    import shlex

    if args.module in _LAUNCHER_MODULES:
        what = f"-m {args.module}"
    elif args.script is not None and Path(args.script).name in _LAUNCHER_SCRIPTS:
        what = args.script
    else:
        return None
    launcher, program, module, i = [], [], False, 0
    rest = list(args.args)
    while i < len(rest):  # torchrun's own options, up to its program
        token = rest[i]
        if not token.startswith("-"):
            program = rest[i:]
            break
        if token in ("-m", "--module"):
            module = True  # its program is a module: `defrag run -m` runs it
        elif token in _LAUNCHER_FLAGS or "=" in token:
            launcher += [token] if token not in ("--no-python", "--no_python") else []
        else:  # an option with its value
            launcher += rest[i:i + 2]
            i += 1
        i += 1
    mine = _defrag_options(args)
    if program:
        inner = ["defrag", "run", *mine, *(["-m"] if module else []), *program]
        recipe = "torchrun " + shlex.join([*launcher, "--no-python", *inner])
    else:
        recipe = " ".join(["torchrun [its options] --no-python defrag run", *map(shlex.quote, mine), "train.py [args]"])
    return (f"{what} starts torchrun's workers as new processes, which PyTorch's own allocator would serve "
            f"outside any pool: run defrag run inside torchrun instead, in each worker: {recipe} (or torchrun "
            f"... -m defrag run ...; docs/guide.md section 2)")


def _checked(args: RunArgs):
    """The driver and capacity `args` name, and the report and record paths (absolute); `UsageError` before
    anything runs."""
    from .arguments import capacity_fits, device_arg, out_file_arg, size_arg

    if args.compact_at is not None and args.compact_at not in COMPACT_AT:
        raise UsageError(f"--compact-at {args.compact_at}: the one safe point it knows is 'step' (after each "
                         f"optimizer.step())")
    if args.compact_min is not None and args.compact_at is None:
        raise UsageError("--compact-min needs --compact-at step")
    refusal = _launcher_refusal(args)
    if refusal is not None:
        raise UsageError(refusal)
    if args.script is not None:
        path = Path(args.script)
        if not path.exists():
            raise UsageError(f"cannot open the script {args.script}: no such file")
        if path.is_dir() and not (path / "__main__.py").is_file():
            raise UsageError(f"cannot run {args.script}: a folder without __main__.py")
    if args.module is not None:
        from importlib.util import find_spec

        top = args.module.partition(".")[0]
        saved_path = list(sys.path)
        sys.path[0:1] = [os.getcwd()]  # where python -m looks first
        try:
            found = bool(top) and find_spec(top) is not None  # imports nothing for a top-level name
        except (ImportError, ValueError):
            found = False
        finally:
            sys.path[:] = saved_path
        if not found:
            raise UsageError(f"-m {args.module}: no module named {top!r}")
    # Absolute now: the program may change its working directory (Hydra does) before they are written.
    # Under torchrun every rank writes its own file (mem.json -> mem.rank1.json): one path, many writers.
    rank = launched_rank()
    report = out_file_arg(_for_rank(args.report, rank), "--report").absolute() if args.report is not None else None
    record = out_file_arg(_for_rank(args.record, rank), "--record").absolute() if args.record is not None else None
    if record is not None and report is not None and record == report:
        raise UsageError(f"--record and --report name the same file ({args.record}): give each its own")
    # Without --device, each rank of a node takes the GPU its LOCAL_RANK names (torchrun sets it).
    driver = device_arg(args.device, torch_cuda=True, local_rank=os.environ.get("LOCAL_RANK"))
    if args.capacity is None:
        free, _ = driver.mem_info()
        capacity = free - free % driver.granularity
        if capacity < driver.granularity:
            raise UsageError(f"the device has {free} bytes free, less than one page: nothing to make a pool of")
    else:
        capacity = size_arg(args.capacity, "--capacity", at_least=driver.granularity,
                            at_least_what=f"one page ({driver.granularity} bytes)")
        capacity_fits(capacity, driver, why="the program's pool")
    if args.compact_min is not None:
        size_arg(args.compact_min, "--compact-min", at_least=1, at_least_what="one byte")
    return driver, capacity, report, record


def launched_rank() -> tuple[int, int] | None:
    """(rank, world size) when a launcher such as torchrun started this process as one of several ranks
    (RANK and WORLD_SIZE set, WORLD_SIZE > 1); None otherwise."""
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    return (rank, world) if world > 1 and 0 <= rank < world else None


def _for_rank(path: str, rank: tuple[int, int] | None) -> str:
    """`path` as rank r writes it: mem.json -> mem.rank1.json (no rank: `path` itself)."""
    if rank is None:
        return path
    full = Path(os.path.expanduser(path))
    return str(full.with_name(f"{full.stem}.rank{rank[0]}{full.suffix}"))


def _open_pool(driver, capacity: int, *, record: bool = False, rank: tuple[int, int] | None = None):
    """A pool on `driver`, installed as PyTorch's allocator (`record`: recording its history from before
    the install; `rank`: (rank, world size) under torchrun, named by its OOM messages); `UsageError` when
    this machine cannot."""
    from . import install
    from .arguments import pool_open_error
    from .errors import CudaError, NotSupportedError
    from .oom import set_capacity_option, set_rank
    from .pool import Pool

    try:
        pool = Pool(device=driver, capacity=capacity)
    except (CudaError, OSError, MemoryError) as exc:
        raise pool_open_error(exc, capacity) from None
    if record:
        pool.record_history(max_entries=RECORD_ENTRIES)
    try:
        install(pool)
    except NotSupportedError as exc:
        pool.close()
        raise UsageError(f"cannot install the pool here: {exc}") from None
    set_capacity_option("--capacity")  # an OOM inside PyTorch's allocator names the option, not Pool(capacity=)
    set_rank(rank)  # and the rank it happened on, under torchrun
    return pool


def _compact_after_steps(pool, min_stranded: int):
    """`--compact-at step`: after every `optimizer.step()` of any optimizer (torch's global post hook), a
    compaction of every open pool (one safe point: PyTorch's tensors move too) when `pool`'s stranded
    bytes reach `min_stranded`. A step that needs none costs one look at the pool's free ranges. Returns
    the hook's handle; `counts` on it says how many steps ran and how many compacted."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from .pool import compact

    counts = {"steps": 0, "compactions": 0}

    def after_step(optimizer, args, kwargs):
        counts["steps"] += 1
        if pool.closed:
            return
        with pool.core.gate:
            stranded, _ = pool.core.stranded()
        if stranded >= min_stranded:
            compact()
            counts["compactions"] += 1

    handle = register_optimizer_step_post_hook(after_step)
    handle.counts = counts
    return handle


# Frames that run the program, not the program's own: this module's, runpy's, and the import machinery's
# (`-m module` compiles the module through it).
_RUNNER_FILES = frozenset({os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<frozen runpy>",
                           "<frozen importlib._bootstrap>", "<frozen importlib._bootstrap_external>"})


def _program_frames(tb):
    """The traceback from the program's own first frame on (the frames that ran it dropped), as
    `python prog.py` prints it; None when no frame is the program's: a SyntaxError in the script itself,
    which Python prints as its file, line and caret only."""
    start = tb
    while start is not None and (start.tb_frame.f_code.co_filename in _RUNNER_FILES
                                 or os.path.abspath(start.tb_frame.f_code.co_filename) in _RUNNER_FILES):
        start = start.tb_next
    return start


def _exit_code(exc: SystemExit) -> int:
    """What Python's own exit would give for `sys.exit(code)` (a message is printed, code 1)."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF if code >= 0 else code % 256
    print(code, file=sys.stderr)
    return 1


def _exec_as_main(script: str) -> None:
    """Run the file `script` (an absolute path) as Python runs a script: a fresh `__main__` module whose
    `__file__` is the absolute path, `sys.argv[0]` as given (runpy.run_path would make it the path it ran),
    the previous `__main__` back afterwards."""
    from importlib.machinery import SourceFileLoader

    with open(script, "rb") as f:
        source = f.read()
    code = compile(source, script, "exec", dont_inherit=True)
    module = types.ModuleType("__main__")
    module.__dict__.update(__file__=script, __cached__=None, __package__=None, __spec__=None,
                           __loader__=SourceFileLoader("__main__", script), __builtins__=builtins)
    previous = sys.modules.get("__main__")
    sys.modules["__main__"] = module
    try:
        exec(code, module.__dict__)
    finally:
        if previous is not None:
            sys.modules["__main__"] = previous


def _run_program(args: RunArgs) -> int:
    """Run the program as __main__ with its own argv and sys.path[0]; its exit code, as Python's would be."""
    saved_argv, saved_path = sys.argv, list(sys.path)
    try:
        if args.module is not None:
            from importlib.util import find_spec

            sys.path[0:1] = [os.getcwd()]
            try:
                spec = find_spec(args.module)
            except (ImportError, ValueError) as exc:
                raise UsageError(f"-m {args.module}: {exc}") from None
            if spec is None:
                raise UsageError(f"-m {args.module}: no module named {args.module!r}")
            sys.argv = [spec.origin or args.module, *args.args]
            runpy.run_module(args.module, run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(args.script)
            sys.argv = [args.script, *args.args]
            sys.path[0:1] = [script if os.path.isdir(script) else os.path.dirname(script)]
            if os.path.isfile(script) and not zipfile.is_zipfile(script):
                _exec_as_main(script)
            else:  # a folder with __main__.py, or a zip application
                runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as exc:
        return _exit_code(exc)
    except UsageError:
        raise
    except BaseException as exc:  # noqa: BLE001 - the program's own uncaught exception (Ctrl-C too), as Python would
        traceback.print_exception(type(exc), exc, _program_frames(exc.__traceback__))
        return 130 if isinstance(exc, KeyboardInterrupt) else 1
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
        sys.stdout.flush()


def _allocator_counters(pool) -> dict:
    """What the installed allocator counted: the CPU allocator's counters, or the CUDA entry's for the
    pool's device (or the ctypes fallback's)."""
    from . import allocator_install, cpu_allocator

    counters = cpu_allocator.counters()
    if counters.get("installed"):
        return counters
    route = allocator_install.installed(getattr(pool.driver, "ordinal", None))
    if route is None:
        return {}
    if hasattr(route, "counters"):  # the native route (allocator_install.CudaInstall)
        return route.counters()
    return {name: getattr(route, name) for name in ("allocs", "frees", "failures", "errors", "foreign_frees")}


def summary(pool, exit_code: int, seconds: float, rank: tuple[int, int] | None = None) -> dict:
    """The figures of the summary line and the report: peaks, fragmentation, OOMs, compactions; `rank`:
    (rank, world size) under torchrun."""
    from .arguments import device_label

    stats = pool.stats()
    peak_live, peak_reserved = stats["allocated_bytes.all.peak"], stats["reserved_bytes.all.peak"]
    return {
        "exit_code": exit_code,
        # Under torchrun (WORLD_SIZE > 1): which rank this is; None for a single process.
        "rank": rank[0] if rank else None,
        "world_size": rank[1] if rank else None,
        "seconds": round(seconds, 3),
        "device": device_label(pool.driver),
        "capacity_bytes": stats["capacity_bytes"],
        "page_size_bytes": stats["page_size"],
        "peak_live_bytes": peak_live,
        "peak_reserved_bytes": peak_reserved,
        "reserved_over_live": round(peak_reserved / peak_live, 4) if peak_live else None,
        # At exit, once the program's objects are collected: bytes free inside pages that still hold live
        # blocks, and their share of the reserved bytes (stats' "fragmentation": stranded / reserved).
        "stranded_at_exit_bytes": stats["stranded_bytes"],
        "reserved_at_exit_bytes": stats["reserved_bytes.all.current"],
        "fragmentation_at_exit": stats["fragmentation"],
        "ooms": stats["num_ooms"],
        "compactions": stats["num_compactions"],
        "allocations": stats["num_allocs"],
        # PyTorch's own tensors moved at safe points (defrag.owners), and operations rescued (--rescue).
        "torch_moved_tensors": stats["compaction.torch_moved_tensors"],
        "torch_moved_bytes": stats["compaction.torch_moved_bytes"],
        "rescued_operations": _rescued(),
    }


def _rescued() -> int:
    from . import fastpath

    if fastpath.module is None:
        return 0
    return int(fastpath.module.rescue_counters()["rescued"])


def summary_line(figures: dict) -> str:
    """One line a person reads at the end of the run.

    The overhead over live is a percentage, except when less than one page
    was live: then a whole page reserved reads as thousands of percent, so it
    is given in bytes.
    """
    from .stats import counted
    from .units import format_bytes

    over = figures["reserved_over_live"]
    live, reserved = figures["peak_live_bytes"], figures["peak_reserved_bytes"]
    page = figures.get("page_size_bytes") or 0
    if over and live < page:
        over_text = f" (+{format_bytes(reserved - live)} over live, which is under one {format_bytes(page)} page)"
    else:
        over_text = f" (+{(over - 1) * 100:.1f}% over live)" if over else ""
    return (f"{_prefix(figures)}: exit {figures['exit_code']} in {figures['seconds']:.1f} s on {figures['device']} · "
            f"peak live {format_bytes(figures['peak_live_bytes'])} · peak reserved "
            f"{format_bytes(figures['peak_reserved_bytes'])}{over_text} of {format_bytes(figures['capacity_bytes'])} · "
            f"{_stranded_text(figures)} · {counted(figures['ooms'], 'OOM')} · "
            f"{counted(figures['compactions'], 'compaction')} · {counted(figures['allocations'], 'allocation')} in the pool"
            + (f" · moved {figures['torch_moved_tensors']} of PyTorch's tensors "
               f"({format_bytes(figures['torch_moved_bytes'])})" if figures.get("torch_moved_tensors") else "")
            + (f" · {counted(figures['rescued_operations'], 'operation')} rescued" if figures.get("rescued_operations")
               else ""))


class _OomWatch:
    """`pool.on_oom`: the run's first and last out-of-memory refusals as they were at that moment (the
    report's `first_oom` and `last_oom`; its stats are otherwise taken at exit)."""

    def __init__(self, pool, started: float):
        self.pool, self.started = pool, started
        self.first = self.last = None

    def __call__(self, error) -> None:
        self.last = _oom_figures(error, self.pool, time.perf_counter() - self.started)
        if self.first is None:
            self.first = self.last


def _advised_capacity(figures: dict) -> str | None:
    """The capacity the out-of-memory message advises ("run with --capacity X or more"), as it is typed
    there; None where it advises none (the device is the limit, or the request needs more than it has).
    The same cases as `defrag.oom.refused_inside_allocator`."""
    from .oom import capacity_option_value

    if "facts" not in figures or figures["device_full"]:
        return None
    nbytes, capacity, need, device = (figures["requested"], figures["capacity"], figures["capacity_needed"],
                                      figures["device_total"])
    if nbytes > capacity:
        return capacity_option_value(need) if nbytes <= device else None
    return capacity_option_value(need) if need <= device else None


def _oom_figures(error, pool, seconds: float) -> dict:
    """One refusal for the report: the request, what was live, stranded and reserved then, the capacity
    the message advises, and the pool's stats at that moment."""
    from .units import parse_size

    f = error.figures
    advised = _advised_capacity(f)
    try:
        stats = pool.stats()
    except Exception as exc:  # noqa: BLE001 - an observer must not fail the OOM the program gets
        stats = {"error": repr(exc)}
    return {
        "seconds": round(seconds, 3),
        "requested_bytes": f.get("requested"),
        "capacity_bytes": f.get("capacity"),
        "live_bytes": f.get("live"),
        "stranded_bytes": f.get("stranded"),
        "reserved_bytes": f.get("reserved"),
        "pinned_bytes": f.get("pinned"),
        "device_full": f.get("device_full"),
        "advised_capacity": advised,  # as the message's "run with --capacity X" types it
        "advised_capacity_bytes": parse_size(advised) if advised else None,
        "tried": list(f.get("tried", ())),
        "stats": stats,
    }


def _prefix(figures: dict) -> str:
    """'defrag run', or under torchrun 'defrag run [rank 1/2]': how this process's lines begin."""
    rank = (figures["rank"], figures["world_size"]) if figures.get("world_size") else None
    return f"defrag run [rank {rank[0]}/{rank[1]}]" if rank else "defrag run"


def _stranded_text(figures: dict) -> str:
    """What is stranded at exit, in bytes first: "stranded at exit 1.20 MiB (25% of reserved)". A small
    run's few stranded KiB are a large share of its few reserved pages; the bytes say how little that is."""
    from .units import format_bytes

    stranded, share = figures.get("stranded_at_exit_bytes"), figures["fragmentation_at_exit"]
    if stranded is None:  # figures from before the bytes were counted: the share alone
        return f"stranded at exit {share * 100:.0f}% of reserved"
    if not stranded:
        return "stranded at exit 0 B"
    percent = "<1" if share < 0.01 else f"{share * 100:.0f}"
    return f"stranded at exit {format_bytes(stranded)} ({percent}% of reserved)"


def _write_report(path: Path, figures: dict, pool, args: RunArgs, ooms: _OomWatch | None = None) -> None:
    """The report as JSON, written whole or not at all (a temporary file renamed into place)."""
    report = {"program": {"script": args.script, "module": args.module, "args": args.args},
              "summary": figures, "allocator": _allocator_counters(pool), "stats": pool.stats(),
              "first_oom": ooms.first if ooms else None, "last_oom": ooms.last if ooms else None}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def _write_snapshot(path: Path, pool) -> None:
    """The pool's snapshot with its recorded history, pickled as `torch.cuda.memory._dump_snapshot` writes
    one, whole or not at all."""
    import pickle

    snapshot = pool.snapshot()
    pool.record_history(False)
    # Marks the history as `defrag run`'s (a key PyTorch's tools ignore): `defrag replay` then describes this
    # run, whose pool was PyTorch's allocator, and says whether --rescue (moves inside a failed operation) ran.
    rescue = False
    if "defrag.rescue" in sys.modules:
        try:
            from .native import load_module

            rescue = bool(load_module().rescue_counters().get("enabled_here"))
        except Exception:  # noqa: BLE001 - None: unknown, rather than lose the history
            rescue = None
    snapshot["defrag"]["run"] = {"rescue": rescue}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        pickle.dump(snapshot, f)
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    """`defrag run`: check, make and install the pool, run the program, summarize; the program's exit code.

    `UsageError` (one line, exit code 2 in `defrag.cli.main`) for bad
    arguments, before the program runs.
    """
    args = parse(argv)
    if args.help:
        print(HELP)
        return 0
    driver, capacity, report, record = _checked(args)
    # The rank as the launcher started this process (the program may set RANK or WORLD_SIZE itself later).
    rank = launched_rank()
    pool = _open_pool(driver, capacity, record=record is not None, rank=rank)
    if args.rescue:
        from . import rescue

        try:
            rescue.enable()
        except RuntimeError as exc:
            raise UsageError(f"--rescue: {exc}") from None
    if args.compact_at == "step":
        from .arguments import size_arg

        _compact_after_steps(pool, size_arg(args.compact_min, "--compact-min") if args.compact_min is not None
                             else max(capacity // 16, pool.page_size))
    started = time.perf_counter()
    ooms = _OomWatch(pool, started)
    pool.on_oom.append(ooms)
    try:
        code = _run_program(args)
    except UsageError:  # -m a.b whose package has no b: nothing of the program ran
        if pool.kind == "emulated":  # PyTorch's CUDA allocator cannot be changed back
            from . import uninstall

            uninstall()
            pool.close()
        raise
    seconds = time.perf_counter() - started
    # The program's module is gone, but its objects may sit in reference cycles (a module's functions
    # hold its globals) until the collector happens to run: collect now, so that "at exit" is the same
    # figure every run (what the program left live once its own objects are freed).
    gc.collect()
    figures = summary(pool, code, seconds, rank)
    if report is not None:
        try:
            _write_report(report, figures, pool, args, ooms)
        except OSError as exc:
            print(f"{_prefix(figures)}: could not write the report {report}: {exc}", file=sys.stderr)
    if record is not None:
        try:
            _write_snapshot(record, pool)
        except OSError as exc:
            print(f"{_prefix(figures)}: could not write the history {record}: {exc}", file=sys.stderr)
    sys.stderr.write(summary_line(figures) + "\n")  # one write: the ranks under torchrun share a stderr
    sys.stderr.flush()
    return code
