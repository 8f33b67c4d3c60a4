"""Replay an allocation trace (or a PyTorch memory snapshot) against allocators.

``defrag replay PATH --capacity SIZE [--dry] [--json OUT] [--device DEV]``
runs the trace against

(a) a `defrag.Pool` that compacts at every phase marker and when an
    allocation fails (``auto_compact``);
(b) the same pool with compaction off;
(c) on a CUDA GPU only: PyTorch's caching allocator, natively and with
    ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, each in its own
    subprocess, the capacity imposed with
    ``torch.cuda.set_per_process_memory_fraction``. Without a GPU these rows
    are skipped with the reason; nothing is invented.
(d) ``torch (model)`` and ``torch-expandable (model)``: a model of PyTorch's
    caching allocator (`defrag.traces.torch_model`), natively and with
    expandable segments, on any machine: placement only, no memory.

For each it reports peak live bytes, peak reserved bytes (mapped pages for
the pool, ``reserved_bytes.all.peak`` for PyTorch), the number of
allocations that failed at that capacity (each is skipped and its later
free ignored), compactions and bytes moved, and the smallest capacity at
which the trace completes with no failure, found by bisection over whole
pages with dry replays (a bounded number of steps; the result says how
exact it is).

``--dry`` replays on `defrag.dry.DryPool`: the pool's own core and
compactor over the memory-less driver (the driver's books, no bytes mapped
or copied), so snapshots far larger than this machine replay in seconds and
agree with a real pool by construction.
Without it, (a) and (b) use a real pool: on the emulated device (the
default without a GPU) every block is a real CPU tensor over mapped pages.

Errors that are the input's fault (a file that is truncated, malformed or
not a trace, a capacity that does not parse or that the device cannot hold,
a device that does not work here, a --json path that cannot be written) are
one line on stderr and exit code 2, found before any replay runs.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .dry import DryPool
from .errors import CompactionError
from .traces.format import ALLOC, FREE, Trace, TraceError
from .traces.torch_model import CachingAllocatorModel
from .units import format_bytes, parse_size

DEFAULT_PAGE = 2 << 20
PROGRESS_EVENTS = 50_000  # show a progress bar (on a terminal) for traces at least this long
MIN_CAPACITY_STEPS = 14
SEARCH_BUDGET_S = 15.0  # per smallest-capacity search in the CLI; the result says when it stopped early
# The models of PyTorch's caching allocator: allocator name -> expandable_segments.
TORCH_MODELS = {"torch (model)": False, "torch-expandable (model)": True}
MODEL_PAGE = 2 << 20  # every segment and mapping of PyTorch's allocator is a multiple of 2 MiB


class ReplayError(RuntimeError):
    """A replay could not run (not a problem of the trace itself); the message says why and what to do."""


@dataclass
class MinCapacity:
    """The smallest capacity (whole pages) at which a dry replay completes with no failed allocation.

    ``bytes`` completes; ``failed_below`` is the largest capacity known to
    fail (tried, or below the peak live bytes). The answer is exact when the two are one page
    apart (assuming completion is monotonic in capacity, which allocators
    only approximately are); otherwise ``bytes`` is an upper bound within
    ``bytes - failed_below``.
    """

    bytes: int | None
    failed_below: int | None
    exact: bool
    steps: int

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class ReplayResult:
    """What one replay of a trace did at one capacity."""

    allocator: str  # "defrag", "defrag-no-compaction", "torch", "torch-expandable", or a TORCH_MODELS name
    trace: str
    capacity: int
    page_size: int
    dry: bool
    device: str
    events: int
    peak_live_bytes: int = 0
    peak_reserved_bytes: int = 0
    ooms: int = 0
    failed_bytes: int = 0
    compactions: int = 0
    compactions_automatic: int = 0
    moved_bytes: int = 0
    moved_tensors: int = 0
    seconds: float = 0.0
    min_capacity: MinCapacity | None = None
    error: str | None = None  # the pool raised something other than OutOfMemoryError; the replay stopped
    notes: list = field(default_factory=list)

    @property
    def completed(self) -> bool:
        """Every allocation succeeded and the pool raised nothing."""
        return self.ooms == 0 and self.error is None

    @property
    def reserved_over_live(self) -> float:
        return self.peak_reserved_bytes / self.peak_live_bytes if self.peak_live_bytes else 1.0

    def meets_goal(self, ratio: float = 1.02) -> bool:
        """Peak reserved <= ratio x peak live + one page."""
        return self.peak_reserved_bytes <= ratio * self.peak_live_bytes + self.page_size

    def as_dict(self) -> dict:
        out = asdict(self)
        out["completed"] = self.completed
        out["reserved_over_live"] = self.reserved_over_live
        out["meets_goal_1_02"] = self.meets_goal()
        return out


# ---------------------------------------------------------------------- loading
def load_any(path: str | os.PathLike) -> tuple[Trace, str]:
    """A trace file or a snapshot pickle (plain or gzip), told apart by content; ("trace"|"snapshot")."""
    from .traces.snapshot import load_snapshot, read_pickle

    try:
        raw = Path(path).read_bytes()
    except IsADirectoryError:
        raise TraceError("is a directory, not a trace file", path=path) from None
    except OSError as exc:
        raise TraceError(f"cannot read the file ({exc.strerror or exc})", path=path) from None
    if not raw:
        raise TraceError("empty file: not a defrag trace or a PyTorch memory snapshot", path=path)
    body = raw
    if raw[:2] == b"\x1f\x8b":
        try:
            body = gzip.decompress(raw)
        except (EOFError, OSError) as exc:
            raise TraceError(f"truncated or corrupt gzip data ({exc})", path=path) from None
    head = body[:64].lstrip(b"\xef\xbb\xbf \t\r\n")
    if head.startswith(b"{"):
        return Trace.from_bytes(body, path=path), "trace"
    if head.startswith(b"\x80"):  # pickle protocol 2 and later
        return load_snapshot(read_pickle(body, path=path), name=Path(path).name), "snapshot"
    preview = body[:16]
    raise TraceError(f"not a defrag trace (JSON Lines starting with a header) nor a PyTorch memory snapshot "
                     f"(a pickle); the file starts with {preview!r}", path=path)


# ---------------------------------------------------------------------- engines
def _progress(total: int, progress: bool | None, desc: str):
    if progress is False or (progress is None and total < PROGRESS_EVENTS):
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, unit="ev", unit_scale=True, leave=False,
                disable=None if progress is None else False)


def replay(trace: Trace, capacity, *, device=None, dry: bool = False, compaction: bool = True,
           page_size=None, progress: bool | None = None, stop_at_first_oom: bool = False) -> ReplayResult:
    """Replay `trace` on a defrag pool of `capacity` (bytes or "8GiB") and return what happened.

    ``compaction``: compact at every phase marker and on a failed allocation
    (else neither). ``dry``: on `DryPool` (the pool's core, no memory); otherwise a
    real `defrag.Pool` on ``device`` (None: the GPU if one works, else the
    emulated device). A failed allocation is counted and skipped (its free is
    ignored). ``stop_at_first_oom`` ends the replay at the first failure (for
    capacity searches). Does not compute ``min_capacity`` (see
    :func:`min_capacity`).
    """
    capacity = parse_size(capacity, what="capacity")
    page = DEFAULT_PAGE if page_size is None else parse_size(page_size, what="page_size")
    if capacity < page:
        raise ValueError(f"capacity {format_bytes(capacity)} is smaller than one page ({format_bytes(page)})")
    name = "defrag" if compaction else "defrag-no-compaction"
    if dry:
        return _replay_dry(trace, capacity, page, compaction, name, progress, stop_at_first_oom)
    return _replay_real(trace, capacity, page, device, compaction, name, progress, stop_at_first_oom)


class _Run:
    """One pass over a trace's events against `alloc(key, nbytes) -> bool` and `free(key)`.

    A failed allocation is counted (`ooms`, `failed_bytes`) and its later free
    skipped; phase markers call `compact` when given. `i` is the index of the
    event being replayed, for error messages.
    """

    def __init__(self):
        self.i = self.ooms = self.failed_bytes = 0

    def drive(self, trace, alloc, free, compact, bar, stop_at_first_oom: bool) -> None:
        failed: set = set()
        for self.i, ev in enumerate(trace.events):
            op = ev[0]
            if op == ALLOC:
                if not alloc(ev[1], ev[2]):
                    self.ooms += 1
                    self.failed_bytes += ev[2]
                    failed.add(ev[1])
                    if stop_at_first_oom:
                        break
            elif op == FREE:
                if failed and ev[1] in failed:
                    failed.discard(ev[1])
                else:
                    free(ev[1])
            elif compact is not None:
                compact()
            if bar is not None and self.i % 4096 == 0:
                bar.n = self.i
                bar.refresh()


def _replay_dry(trace, capacity, page, compaction, name, progress, stop_at_first_oom) -> ReplayResult:
    t0 = time.perf_counter()
    model = DryPool(capacity, page, auto_compact=compaction)
    run = _Run()
    error = None
    bar = _progress(len(trace.events), progress, f"{name} (dry)")
    try:
        run.drive(trace, model.alloc, model.free, model.compact if compaction else None, bar, stop_at_first_oom)
    except CompactionError as exc:
        error = _pool_error(exc, run.i, trace.events[run.i])
    finally:
        if bar is not None:
            bar.close()
    ooms, failed_bytes = run.ooms, run.failed_bytes
    st = model.stats()
    model.close()
    return ReplayResult(name, trace.name, model.capacity, page, True, "none (memory-less device)", len(trace.events),
                        peak_live_bytes=st["allocated_bytes.all.peak"],
                        peak_reserved_bytes=st["reserved_bytes.all.peak"], ooms=ooms, failed_bytes=failed_bytes,
                        compactions=st["num_compactions"], compactions_automatic=st["num_compactions.automatic"],
                        moved_bytes=st["compaction.moved_bytes"], moved_tensors=st["compaction.moved_tensors"],
                        seconds=time.perf_counter() - t0, error=error)


def replay_model(trace: Trace, capacity, *, expandable: bool = False, progress: bool | None = None,
                 stop_at_first_oom: bool = False, **settings) -> ReplayResult:
    """Replay `trace` on the model of PyTorch's caching allocator (`defrag.traces.torch_model`).

    The allocator is ``"torch-expandable (model)"`` with ``expandable`` (PyTorch's
    ``expandable_segments:True``), else ``"torch (model)"``; ``settings`` go to
    `CachingAllocatorModel` (``max_split_size``, ``device_memory``, ...). As in
    the GPU baseline, a failed allocation is counted and skipped (its free is
    ignored), and peak live / peak reserved are ``allocated_bytes.all.peak`` /
    ``reserved_bytes.all.peak`` (whole blocks: a block handed out unsplit
    counts whole). Phase markers do nothing (PyTorch has no compaction).
    """
    capacity = parse_size(capacity, what="capacity")
    name = "torch-expandable (model)" if expandable else "torch (model)"
    t0 = time.perf_counter()
    model = CachingAllocatorModel(capacity, expandable_segments=expandable, **settings)
    run = _Run()
    bar = _progress(len(trace.events), progress, name)
    try:
        run.drive(trace, model.alloc, model.free_key, None, bar, stop_at_first_oom)
    finally:
        if bar is not None:
            bar.close()
    ooms, failed_bytes = run.ooms, run.failed_bytes
    st = model.stats()
    return ReplayResult(name, trace.name, capacity, MODEL_PAGE, True, "none (model of PyTorch's caching allocator)",
                        len(trace.events), peak_live_bytes=st["allocated_bytes.all.peak"],
                        peak_reserved_bytes=st["reserved_bytes.all.peak"], ooms=ooms, failed_bytes=failed_bytes,
                        seconds=time.perf_counter() - t0)


def _pool_error(exc: Exception, index: int, event: tuple) -> str:
    what = f"{event[0]} {event[1]}" + (f" ({format_bytes(event[2])})" if event[0] == ALLOC else "")
    return f"the pool raised {type(exc).__name__} at event {index} ({what}): {exc}"


def _open_real_pool(capacity: int, page: int, device, compaction: bool):
    """A Pool and the driver it runs on (an emulated device sized to the capacity by default)."""
    from .driver import Driver, cuda_driver_usable
    from .pool import Pool

    own_driver = None
    spec = device
    if spec is None:
        spec = "cuda:0" if cuda_driver_usable()[0] else "emulated"
    if isinstance(spec, str) and spec == "emulated":
        own_driver = Driver.emulated(capacity=capacity, granularity=page if page % 4096 == 0 else DEFAULT_PAGE)
        spec = own_driver
    pool = Pool(spec, capacity=capacity, page_size=page, auto_compact=compaction)
    return pool, own_driver


def _replay_real(trace, capacity, page, device, compaction, name, progress, stop_at_first_oom) -> ReplayResult:
    import torch

    from .errors import CompactionError
    from .oom import OutOfMemoryError

    t0 = time.perf_counter()
    pool, own_driver = _open_real_pool(capacity, page, device, compaction)
    tensors: dict = {}
    error = None
    bar = _progress(len(trace.events), progress, name)
    run = _Run()
    empty, uint8 = pool.empty, torch.uint8

    def alloc(key, nbytes) -> bool:
        try:
            tensors[key] = empty(nbytes, dtype=uint8)
            return True
        except OutOfMemoryError:
            return False

    try:
        try:
            run.drive(trace, alloc, tensors.pop, (lambda: pool.compact(progress=False)) if compaction else None,
                      bar, stop_at_first_oom)
        except (CompactionError, ValueError) as exc:
            # A compaction that could not run (e.g. its plan needs more physical pages than can be freed).
            error = _pool_error(exc, run.i, trace.events[run.i])
        ooms, failed_bytes = run.ooms, run.failed_bytes
        st = pool.stats()
        where = str(pool.device) if pool.kind == "cuda" else "emulated"
    except OSError as exc:
        if exc.errno == 24:  # EMFILE: the emulated device keeps one memfd per physical page
            raise ReplayError(f"the emulated device needs one open file per {format_bytes(page)} page and ran out "
                              f"({exc.strerror}); use --dry for traces this large, or raise `ulimit -n`") from None
        raise
    finally:
        if bar is not None:
            bar.close()
        tensors.clear()
        pool.close()
        if own_driver is not None:
            own_driver.close()
    return ReplayResult(name, trace.name, pool.capacity, page, False, where, len(trace.events),
                        peak_live_bytes=st["allocated_bytes.all.peak"],
                        peak_reserved_bytes=st["reserved_bytes.all.peak"], ooms=ooms, failed_bytes=failed_bytes,
                        compactions=st["num_compactions"], compactions_automatic=st["num_compactions.automatic"],
                        moved_bytes=st["compaction.moved_bytes"], moved_tensors=st["compaction.moved_tensors"],
                        seconds=time.perf_counter() - t0, error=error)


def min_capacity(trace: Trace, *, compaction: bool = True, page_size=None, known_good: int | None = None,
                 known_bad: int | None = None, hint: int | None = None, max_steps: int = MIN_CAPACITY_STEPS,
                 tolerance: float = 0.002, budget_s: float | None = None,
                 allocator: str | None = None) -> MinCapacity:
    """Smallest capacity (whole pages) at which a dry replay completes, by bisection.

    ``allocator``: None (or ``"defrag"`` / ``"defrag-no-compaction"``) searches
    the pool (``compaction`` says which); a `TORCH_MODELS` name searches that
    model of PyTorch's allocator (pages of 2 MiB unless ``page_size`` says).

    The bracket starts at ``ceil(peak live / page) - 1`` pages (cannot
    complete) or ``known_bad``, and ``known_good`` (or a capacity found by
    doubling from the peak live). The first probes are just above the lower
    bound (within ``tolerance``), then ``hint`` (e.g. the peak reserved of a
    completed replay), then bisection. Stops when the bracket is one page wide
    or narrower than ``tolerance`` of the answer, after ``max_steps``
    replays, or once ``budget_s`` seconds are spent; ``exact`` says whether
    it got to one page. Failing probes stop at their first failed allocation.
    """
    if allocator in ("defrag", "defrag-no-compaction"):
        compaction, allocator = allocator == "defrag", None
    if allocator is not None and allocator not in TORCH_MODELS:
        raise ValueError(f"unknown allocator {allocator!r}: 'defrag', 'defrag-no-compaction' or one of "
                         f"{sorted(TORCH_MODELS)}")
    page = ((DEFAULT_PAGE if allocator is None else MODEL_PAGE) if page_size is None
            else parse_size(page_size, what="page_size"))
    live_pages = max(1, -(-trace.stats().peak_live_bytes // page))
    deadline = None if budget_s is None else time.perf_counter() + budget_s

    def completes(pages: int) -> bool:
        if allocator is not None:
            return replay_model(trace, pages * page, expandable=TORCH_MODELS[allocator], progress=False,
                                stop_at_first_oom=True).completed
        return replay(trace, pages * page, dry=True, compaction=compaction, page_size=page, progress=False,
                      stop_at_first_oom=True).completed

    def out_of_time() -> bool:
        return steps >= max_steps or (deadline is not None and time.perf_counter() > deadline)

    steps = 0
    lo = live_pages - 1  # fails: fewer pages than the live bytes need
    if known_bad is not None:
        lo = max(lo, known_bad // page)
    hi = known_good // page if known_good is not None else None
    if hi is None:
        hi = live_pages
        while True:
            steps += 1
            if completes(hi):
                break
            lo, hi = hi, hi * 2
            if out_of_time():
                return MinCapacity(None, hi * page, False, steps)
    # Two probes first: just above the lower bound (compaction often gets there), then the hint.
    near = lo + max(1, int(tolerance * lo))
    for probe in (near, None if hint is None else -(-hint // page)):
        if probe is None or not lo < probe < hi or out_of_time():
            continue
        steps += 1
        if completes(probe):
            hi = probe
        else:
            lo = probe
    while hi - lo > 1 and (hi - lo) > tolerance * hi and not out_of_time():
        mid = (lo + hi) // 2
        steps += 1
        if completes(mid):
            hi = mid
        else:
            lo = mid
    return MinCapacity(hi * page, lo * page if lo >= 1 else None, hi - lo <= 1, steps)


# ---------------------------------------------------------------------- PyTorch baselines
_BASELINE_CHILD = r"""
# Runs in a fresh process: argv = trace path, capacity bytes, output JSON path, max bisection steps.
import json, sys, time
import torch
from defrag.traces.format import Trace, ALLOC, FREE

path, capacity, out, steps = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
trace = Trace.load(path)
torch.cuda.init()
total = torch.cuda.get_device_properties(0).total_memory


def run(cap, stop):
    # The caching allocator may reserve at most `cap` bytes; each failed allocation is skipped.
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.reset_accumulated_memory_stats()
    live, failed, ooms, failed_bytes = {}, set(), 0, 0
    for ev in trace.events:
        if ev[0] == ALLOC:
            try:
                live[ev[1]] = torch.empty(ev[2], dtype=torch.uint8, device="cuda")
            except torch.cuda.OutOfMemoryError:
                ooms += 1
                failed_bytes += ev[2]
                failed.add(ev[1])
                if stop:
                    break
        elif ev[0] == FREE:
            if live.pop(ev[1], None) is None:
                failed.discard(ev[1])
    torch.cuda.synchronize()
    st = torch.cuda.memory_stats()
    live.clear()
    torch.cuda.empty_cache()
    return st, ooms, failed_bytes


t0 = time.perf_counter()
st, ooms, failed_bytes = run(capacity, False)
result = {"peak_live_bytes": st.get("allocated_bytes.all.peak", 0),
          "peak_reserved_bytes": st.get("reserved_bytes.all.peak", 0),
          "ooms": ooms, "failed_bytes": failed_bytes, "num_ooms_torch": st.get("num_ooms", 0),
          "seconds": time.perf_counter() - t0, "total_memory": total, "capacity_clamped": capacity > total}

# Smallest capacity that completes: bisection over 2 MiB steps, bounded.
page = 2 << 20
lo = max(0, -(-trace.stats().peak_live_bytes // page) - 1)  # below the live bytes nothing completes
hi = -(-capacity // page)
good = ooms == 0
if not good:
    hi = min(total // page, 2 * hi)
    good = run(hi * page, True)[1] == 0
n = 0
while good and hi - lo > 1 and n < steps and hi - lo > 0.002 * hi:
    mid = (lo + hi) // 2
    n += 1
    if run(mid * page, True)[1] == 0:
        hi = mid
    else:
        lo = mid
result["min_capacity"] = {"bytes": hi * page if good else None, "failed_below": lo * page if lo else None,
                          "exact": good and hi - lo <= 1, "steps": n}
with open(out, "w") as f:
    json.dump(result, f)
"""


def torch_baselines(trace: Trace, capacity: int, *,
                    timeout: float = 1800.0) -> tuple[list[ReplayResult], list[dict]]:
    """PyTorch's caching allocator, native and expandable_segments, each in a subprocess (GPU only).

    Returns (results, skipped); each skipped entry is {"allocator", "reason"}.
    """
    import torch

    names = [("torch", None), ("torch-expandable", "expandable_segments:True")]
    if not torch.cuda.is_available():
        reason = (f"no CUDA GPU (torch {torch.__version__}: torch.cuda.is_available() is False); "
                  "PyTorch's allocator only runs on a GPU")
        return [], [{"allocator": n, "reason": reason} for n, _ in names]
    results, skipped = [], []
    with tempfile.TemporaryDirectory(prefix="defrag-replay-") as tmp:
        path = trace.save(Path(tmp) / "trace.jsonl.gz")
        for name, conf in names:
            env = dict(os.environ)
            # The child imports this package from where this process found it.
            root = str(Path(__file__).resolve().parent.parent)
            env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
            env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
            env.pop("PYTORCH_ALLOC_CONF", None)
            if conf:
                env["PYTORCH_CUDA_ALLOC_CONF"] = conf
            out = Path(tmp) / f"{name}.json"
            try:
                proc = subprocess.run([sys.executable, "-c", _BASELINE_CHILD, str(path), str(capacity), str(out),
                                       str(MIN_CAPACITY_STEPS)], env=env, capture_output=True, text=True,
                                      timeout=timeout)
            except subprocess.TimeoutExpired:
                skipped.append({"allocator": name, "reason": f"timed out after {timeout:.0f} s"})
                continue
            if proc.returncode != 0 or not out.exists():
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
                skipped.append({"allocator": name, "reason": f"subprocess failed (exit {proc.returncode}): {tail[0]}"})
                continue
            data = json.loads(out.read_text())
            r = ReplayResult(name, trace.name, capacity, 0, False, "cuda:0", len(trace.events),
                             peak_live_bytes=data["peak_live_bytes"], peak_reserved_bytes=data["peak_reserved_bytes"],
                             ooms=data["ooms"], failed_bytes=data["failed_bytes"], seconds=data["seconds"],
                             min_capacity=MinCapacity(**data["min_capacity"]))
            if data.get("capacity_clamped"):
                r.notes.append(f"capacity exceeds the GPU's {format_bytes(data['total_memory'])}; limited to it")
            results.append(r)
    return results, skipped


# ---------------------------------------------------------------------- report
def format_table(results: list[ReplayResult], skipped: list[dict]) -> str:
    """A plain-text table of the results, then one line per skipped allocator."""
    head = ["allocator", "peak live", "peak reserved", "reserved/live", "OOMs", "compactions", "moved",
            "min capacity", "seconds"]
    rows = []
    for r in results:
        mc = r.min_capacity
        if mc is None:
            mcap = "-"
        elif mc.bytes is None:
            mcap = "not found"
        elif mc.exact or mc.failed_below is None:
            mcap = format_bytes(mc.bytes)
        else:
            mcap = f"{format_bytes(mc.failed_below)} < x <= {format_bytes(mc.bytes)}"
        rows.append([r.allocator + (" (dry)" if r.dry and r.allocator not in TORCH_MODELS else ""),
                     format_bytes(r.peak_live_bytes),
                     format_bytes(r.peak_reserved_bytes), f"{r.reserved_over_live:.3f}",
                     str(r.ooms) + (" +error" if r.error else ""),
                     str(r.compactions) if r.allocator.startswith("defrag") else "-",
                     format_bytes(r.moved_bytes) if r.allocator.startswith("defrag") else "-",
                     mcap, f"{r.seconds:.2f}"])
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    for r in results:
        if r.error:
            lines.append(f"{r.allocator}: stopped: {r.error}")
        for note in r.notes:
            lines.append(f"{r.allocator}: {note}")
    for s in skipped:
        lines.append(f"{s['allocator']}: skipped: {s['reason']}")
    return "\n".join(lines)


def run_all(trace: Trace, capacity: int, *, dry: bool = False, device=None, page_size=None,
            baselines: bool = True, progress: bool | None = None,
            search_budget_s: float | None = SEARCH_BUDGET_S,
            models: bool = True) -> tuple[list[ReplayResult], list[dict]]:
    """(a) and (b) at `capacity` plus their smallest capacities; (d) the models of PyTorch's allocator
    (``models``), with theirs; (c) when a GPU is present (``baselines``).

    Each smallest-capacity search gets ``search_budget_s`` seconds (None: no
    limit; the step cap still applies).
    """
    results = []
    for compaction in (True, False):
        r = replay(trace, capacity, device=device, dry=dry, compaction=compaction, page_size=page_size,
                   progress=progress)
        good = r.capacity if r.completed else None
        bad = r.capacity if not r.completed else None
        r.min_capacity = min_capacity(trace, compaction=compaction, page_size=r.page_size, known_good=good,
                                      known_bad=bad, hint=r.peak_reserved_bytes if r.completed else None,
                                      budget_s=search_budget_s)
        results.append(r)
    if models:
        for name, expandable in TORCH_MODELS.items():
            r = replay_model(trace, capacity, expandable=expandable, progress=progress)
            # A model replay takes a fraction of a second: search to one page (2 MiB).
            r.min_capacity = min_capacity(trace, allocator=name, known_good=r.capacity if r.completed else None,
                                          known_bad=None if r.completed else r.capacity,
                                          hint=r.peak_reserved_bytes if r.completed else None,
                                          max_steps=2 * MIN_CAPACITY_STEPS, tolerance=0.0, budget_s=search_budget_s)
            results.append(r)
    skipped: list[dict] = []
    if baselines:
        extra, skipped = torch_baselines(trace, capacity)
        results += extra
    return results, skipped


def _goal_line(r: ReplayResult) -> str:
    """The goal (compaction on): peak reserved <= 1.02 x peak live + one page, at --capacity and at the smallest."""
    text = (f"goal, compaction on (peak reserved <= 1.02 x peak live + one page): at {format_bytes(r.capacity)} "
            f"reserved/live = {r.reserved_over_live:.4f} ({'met' if r.meets_goal() else 'not met'})")
    mc = r.min_capacity
    if mc is not None and mc.bytes is not None and r.peak_live_bytes:
        met = mc.bytes <= 1.02 * r.peak_live_bytes + r.page_size
        text += (f"; smallest capacity that completes {'' if mc.exact else '<= '}{format_bytes(mc.bytes)} = "
                 f"{mc.bytes / r.peak_live_bytes:.4f} x peak live ({'met' if met else 'not met'})")
    return text


def _check_real_pool(capacity: int, device) -> None:
    """Open (and close) the pool a real replay will use, so that a device or capacity that cannot work
    is a `defrag.cli.UsageError` before any work, not a traceback half-way."""
    from .arguments import pool_open_error
    from .errors import CudaError

    try:
        pool, own_driver = _open_real_pool(capacity, DEFAULT_PAGE, device, True)
    except (CudaError, OSError) as exc:
        raise pool_open_error(exc, capacity, hint=", or --dry (the pool's own code over a memory-less device) for capacities this "
                                                  "large") from None
    pool.close()
    if own_driver is not None:
        own_driver.close()


def main(args) -> int:
    """The `defrag replay` command: load, replay, print a table, write --json.

    Bad input (arguments, a file that is not a trace) raises `defrag.cli.UsageError`:
    one line on stderr, exit code 2.
    """
    from .arguments import UsageError, device_arg, device_label, out_file_arg, size_arg

    capacity = size_arg(args.capacity, "--capacity", at_least=DEFAULT_PAGE,
                        at_least_what=f"one page ({format_bytes(DEFAULT_PAGE)})")
    if args.json:
        out_file_arg(args.json, "--json")
    try:
        trace, kind = load_any(args.path)
    except TraceError as exc:
        raise UsageError(str(exc)) from None
    device = args.device
    if not args.dry:
        # A device that cannot work is the user's input, like a bad path.
        device = device_label(device_arg(args.device))
        _check_real_pool(capacity, device)
    st = trace.stats()
    print(f"{kind} {trace.name!r} ({args.path}): {st.events} events, {st.allocs} allocs, {st.phases} phase "
          f"markers, peak live {format_bytes(st.peak_live_bytes)}; capacity {format_bytes(capacity)}"
          f"{', dry (memory-less device)' if args.dry else ''}")
    if kind == "snapshot":
        m = trace.meta
        print(f"  snapshot device {m['device']}: {m['entries']} recorded actions, {m['initial_allocs']} blocks live "
              f"before the first ({m['pre_trace_frees']} seen only as frees: ring buffer truncation), "
              f"{m['skipped_entries']} entries skipped")
    t0 = time.perf_counter()
    try:
        results, skipped = run_all(trace, capacity, dry=args.dry, device=device)
    except ReplayError as exc:
        raise UsageError(str(exc)) from None
    print(format_table(results, skipped))
    for r in results:
        if r.allocator == "defrag":
            print(_goal_line(r))
    if args.json:
        payload = {
            "trace": {"name": trace.name, "path": str(args.path), "kind": kind, "stats": st.as_dict(),
                      "meta": trace.meta},
            "capacity": capacity, "dry": bool(args.dry), "device": args.device,
            "results": [r.as_dict() for r in results], "skipped": skipped,
            "seconds": time.perf_counter() - t0,
        }
        try:
            Path(args.json).write_text(json.dumps(payload, indent=2, default=str) + "\n")
        except OSError as exc:  # checked up front; the folder can still go away during a long replay
            raise UsageError(f"cannot write --json {args.json}: {exc.strerror or exc}") from None
        print(f"wrote {args.json}")
    return 0

