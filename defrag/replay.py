"""Replay an allocation trace (or every device of a PyTorch memory snapshot) against allocators.

``defrag replay PATH [--capacity SIZE] [--dry] [--json OUT] [--plot PNG]
[--snapshot-device N] [--device DEV]`` runs the trace (for a snapshot: each
device's, at the capacity the snapshot implies unless ``--capacity`` says,
beside what PyTorch really reserved, with each recorded OOM explained) against

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
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .compactor import collector_paused
from .dry import DryPool
from .errors import CompactionError
from .stats import counted
from .traces.format import ALLOC, FREE, Trace, TraceError
from .traces.snapshot import peaks_per_stretch
from .traces.torch_model import CachingAllocatorModel
from .units import format_bytes, parse_size

DEFAULT_PAGE = 2 << 20
PROGRESS_EVENTS = 50_000  # show a progress bar (on a terminal) for traces at least this long
MIN_CAPACITY_STEPS = 14
SEARCH_BUDGET_S = 60.0  # per smallest-capacity search in the CLI; the result says when it stopped early
MIN_CAPACITY_MAX_STEPS = 28  # probes per search in the CLI: enough for one page out of 2^28
MAX_WORKERS = 4
OOM_CHECKS = 16  # recorded OOMs per device whose refused request is tried on defrag and the expandable model
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
    # Reserved bytes over the trace (when asked for): (event indices, bytes), each point the most
    # reserved from that event to the next point's. Not in `as_dict`: it is for pictures.
    series: tuple | None = field(default=None, repr=False)
    # Where a search for the smallest capacity should start (dry pools: `DryPool.peak_held_bytes`);
    # not in `as_dict`: it is the search's, not a figure of the replay.
    search_hint: int | None = field(default=None, repr=False)
    # A dry pool's `DryPool.rescue_steps`: which pools' runs this one's was (`_answers_for`); not in
    # `as_dict` either.
    rescue_steps: dict | None = field(default=None, repr=False)
    # The row whose replay at this capacity was this row's too (`_same_run`): the same run, so the same
    # figures; None when this row ran its own.
    same_run_as: str | None = None

    @property
    def completed(self) -> bool:
        """Every allocation succeeded and the pool raised nothing."""
        return self.ooms == 0 and self.error is None

    @property
    def reserved_over_live(self) -> float:
        return self.peak_reserved_bytes / self.peak_live_bytes if self.peak_live_bytes else 1.0

    def meets_goal(self, ratio: float = 1.02) -> bool:
        """Peak reserved <= ratio x peak live + one page, in a replay that completed.

        A replay with a failed allocation never meets the goal: its peaks
        leave out the memory it could not place.
        """
        return self.completed and self.peak_reserved_bytes <= ratio * self.peak_live_bytes + self.page_size

    def as_dict(self) -> dict:
        series, self.series = self.series, None
        try:
            out = asdict(self)
        finally:
            self.series = series
        out.pop("series", None)
        out.pop("search_hint", None)
        out.pop("rescue_steps", None)
        out["completed"] = self.completed
        out["reserved_over_live"] = self.reserved_over_live
        out["meets_goal_1_02"] = self.meets_goal()
        return out


# ---------------------------------------------------------------------- loading
def load_any(path: str | os.PathLike) -> tuple[Trace, str]:
    """A trace file or a snapshot pickle (plain or gzip), told apart by content; ("trace"|"snapshot").

    A snapshot gives the device `load_snapshot` picks; `load_input` gives every device.
    """
    from .traces.snapshot import load_snapshot, read_pickle

    body = _read_body(path)
    if _is_pickle(body):
        return load_snapshot(read_pickle(body, path=path), name=Path(path).name), "snapshot"
    return _parse_body(body, path)


def _read_body(path) -> bytes:
    try:
        raw = Path(path).read_bytes()
    except IsADirectoryError:
        raise TraceError("is a directory, not a trace file", path=path) from None
    except OSError as exc:
        raise TraceError(f"cannot read the file ({exc.strerror or exc})", path=path) from None
    if not raw:
        raise TraceError("empty file: not a defrag trace or a PyTorch memory snapshot", path=path)
    if raw[:2] == b"\x1f\x8b":
        try:
            return gzip.decompress(raw)
        except (EOFError, OSError) as exc:
            raise TraceError(f"truncated or corrupt gzip data ({exc})", path=path) from None
    return raw


def _is_pickle(body: bytes) -> bool:
    return body[:64].lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"\x80")  # pickle protocol 2 and later


def _parse_body(body: bytes, path) -> tuple[Trace, str]:
    head = body[:64].lstrip(b"\xef\xbb\xbf \t\r\n")
    if head.startswith(b"{"):
        return Trace.from_bytes(body, path=path), "trace"
    preview = body[:16]
    raise TraceError(f"not a defrag trace (JSON Lines starting with a header) nor a PyTorch memory snapshot "
                     f"(a pickle); the file starts with {preview!r}", path=path)


# ---------------------------------------------------------------------- engines
def _work_bar(progress: bool | None):
    """The bar over a whole replay's work (`replay_devices`): every replay and every probe of every
    smallest-capacity search, counted in trace events, on stderr. None with ``progress`` False; with
    None it draws only on a terminal (tqdm's own test)."""
    if progress is False:
        return None
    from tqdm.auto import tqdm
    bar = tqdm(total=0, desc="replays and capacity searches", unit="ev", unit_scale=True, leave=False,
               file=sys.stderr, disable=None if progress is None else False)
    if bar.disable:  # not a terminal
        bar.close()
        return None
    return bar


def _progress(total: int, progress: bool | None, desc: str):
    if progress is False or (progress is None and total < PROGRESS_EVENTS):
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, unit="ev", unit_scale=True, leave=False,
                disable=None if progress is None else False)


def replay(trace: Trace, capacity, *, device=None, dry: bool = False, compaction: bool = True,
           page_size=None, progress: bool | None = None, stop_at_first_oom: bool = False,
           series: bool = False, mesh: bool = False) -> ReplayResult:
    """Replay `trace` on a defrag pool of `capacity` (bytes or "8GiB") and return what happened.

    ``compaction``: compact at every phase marker and on a failed allocation
    (else neither). ``mesh`` (with ``compaction``; the ``defrag-mesh`` row):
    those compactions also mesh what they cannot move, and so does the
    ladder before it gives up (`defrag.mesher`); without it neither meshes. ``dry``: on `DryPool` (the pool's core, no memory); otherwise a
    real `defrag.Pool` on ``device`` (None: the GPU if one works, else the
    emulated device). A failed allocation is counted and skipped (its free is
    ignored). ``stop_at_first_oom`` ends the replay at the first failure (for
    capacity searches). ``series``: also record reserved bytes over the
    trace (`ReplayResult.series`, at most `traces.snapshot.SERIES_POINTS` points, each the
    most reserved in its stretch: the pages mapped after each event). Does not compute
    ``min_capacity`` (see :func:`min_capacity`).
    """
    capacity = parse_size(capacity, what="capacity")
    page = DEFAULT_PAGE if page_size is None else parse_size(page_size, what="page_size")
    if capacity < page:
        raise ValueError(f"capacity {format_bytes(capacity)} is smaller than one page ({format_bytes(page)})")
    mesh = bool(mesh and compaction)
    name = "defrag-mesh" if mesh else "defrag" if compaction else "defrag-no-compaction"
    if dry:
        return _replay_dry(trace, capacity, page, compaction, name, progress, stop_at_first_oom, series, mesh)
    return _replay_real(trace, capacity, page, device, compaction, name, progress, stop_at_first_oom, mesh,
                        series)


class _Run:
    """One pass over a trace's events against `alloc(key, nbytes) -> bool` and `free(key)`.

    A failed allocation is counted (`ooms`, `failed_bytes`) and its later free
    skipped; phase markers call `compact` when given. `i` is the index of the
    event being replayed, for error messages.
    """

    def __init__(self):
        self.i = self.ooms = self.failed_bytes = 0

    def drive(self, trace, alloc, free, compact, bar, stop_at_first_oom: bool, reserved=None) -> None:
        if reserved is not None:
            return self._drive_sampled(trace, alloc, free, compact, bar, stop_at_first_oom, reserved)
        failed: set = set()
        i = 0
        try:  # `i` kept in a local (the loop runs once per event), `self.i` set once it stops
            for i, ev in enumerate(trace.events):
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
                if bar is not None and i % 4096 == 0:
                    bar.n = i
                    bar.refresh()
        finally:
            self.i = i

    def _drive_sampled(self, trace, alloc, free, compact, bar, stop_at_first_oom, reserved) -> None:
        """`drive`, reading ``reserved()`` after every event into `self.reserved` (one int64 per event).

        A second copy of the loop so that replays without a picture pay nothing for it.
        """
        import numpy as np

        out = self.reserved = np.zeros(len(trace.events), dtype=np.int64)
        failed: set = set()
        for self.i, ev in enumerate(trace.events):
            op = ev[0]
            if op == ALLOC:
                if not alloc(ev[1], ev[2]):
                    self.ooms += 1
                    self.failed_bytes += ev[2]
                    failed.add(ev[1])
                    if stop_at_first_oom:
                        out[self.i:] = reserved()
                        break
            elif op == FREE:
                if failed and ev[1] in failed:
                    failed.discard(ev[1])
                else:
                    free(ev[1])
            elif compact is not None:
                compact()
            out[self.i] = reserved()
            if bar is not None and self.i % 4096 == 0:
                bar.n = self.i
                bar.refresh()


def _replay_dry(trace, capacity, page, compaction, name, progress, stop_at_first_oom, series=False,
                mesh=False) -> ReplayResult:
    t0 = time.perf_counter()
    model = DryPool(capacity, page, auto_compact=compaction, auto_mesh=mesh)
    run = _Run()
    error = None
    bar = _progress(len(trace.events), progress, f"{name} (dry)")
    compact = (lambda: model.compact(mesh=mesh)) if compaction else None
    try:
        with collector_paused():  # the pool's objects are acyclic: collections here find next to nothing
            run.drive(trace, model.alloc, model.free, compact, bar, stop_at_first_oom,
                      model.reserved_bytes if series else None)
    except CompactionError as exc:
        error = _pool_error(exc, run.i, trace.events[run.i])
    finally:
        if bar is not None:
            bar.close()
    ooms, failed_bytes = run.ooms, run.failed_bytes
    st = model.stats()
    model.discard()
    return ReplayResult(name, trace.name, model.capacity, page, True, "none (memory-less device)", len(trace.events),
                        peak_live_bytes=st["allocated_bytes.all.peak"],
                        peak_reserved_bytes=st["reserved_bytes.all.peak"], ooms=ooms, failed_bytes=failed_bytes,
                        compactions=st["num_compactions"], compactions_automatic=st["num_compactions.automatic"],
                        moved_bytes=st["compaction.moved_bytes"], moved_tensors=st["compaction.moved_tensors"],
                        seconds=time.perf_counter() - t0, error=error,
                        series=_window_max(run.reserved, run.i + 1) if series else None,
                        search_hint=model.peak_held_bytes, rescue_steps=dict(model.rescue_steps))


def _window_max(values, used: int) -> tuple[list, list]:
    """(event indices, values) of `values[:used]` in at most `traces.snapshot.SERIES_POINTS` points,
    each the most from its index to the next one's, so no peak is lost however long the trace;
    ([0], [0]) for nothing."""
    return peaks_per_stretch(values[:max(used, 1)]) if len(values) else ([0], [0])


def replay_model(trace: Trace, capacity, *, expandable: bool = False, progress: bool | None = None,
                 stop_at_first_oom: bool = False, series: bool = False, **settings) -> ReplayResult:
    """Replay `trace` on the model of PyTorch's caching allocator (`defrag.traces.torch_model`).

    The allocator is ``"torch-expandable (model)"`` with ``expandable`` (PyTorch's
    ``expandable_segments:True``), else ``"torch (model)"``; ``settings`` go to
    `CachingAllocatorModel` (``max_split_size``, ``device_memory``, ...). As in
    the GPU baseline, a failed allocation is counted and skipped (its free is
    ignored), and peak live / peak reserved are ``allocated_bytes.all.peak`` /
    ``reserved_bytes.all.peak`` (whole blocks: a block handed out unsplit
    counts whole). Phase markers do nothing (PyTorch has no compaction).
    ``series``: also record reserved bytes over the trace, as `replay` does.
    """
    capacity = parse_size(capacity, what="capacity")
    name = "torch-expandable (model)" if expandable else "torch (model)"
    t0 = time.perf_counter()
    model = CachingAllocatorModel(capacity, expandable_segments=expandable, **settings)
    run = _Run()
    bar = _progress(len(trace.events), progress, name)
    try:
        run.drive(trace, model.alloc, model.free_key, None, bar, stop_at_first_oom,
                  (lambda: model.reserved) if series else None)
    finally:
        if bar is not None:
            bar.close()
    ooms, failed_bytes = run.ooms, run.failed_bytes
    st = model.stats()
    return ReplayResult(name, trace.name, capacity, MODEL_PAGE, True, "none (model of PyTorch's caching allocator)",
                        len(trace.events), peak_live_bytes=st["allocated_bytes.all.peak"],
                        peak_reserved_bytes=st["reserved_bytes.all.peak"], ooms=ooms, failed_bytes=failed_bytes,
                        seconds=time.perf_counter() - t0,
                        series=_window_max(run.reserved, run.i + 1) if series else None)


def _pool_error(exc: Exception, index: int, event: tuple) -> str:
    what = f"{event[0]} {event[1]}" + (f" ({format_bytes(event[2])})" if event[0] == ALLOC else "")
    return f"the pool raised {type(exc).__name__} at event {index} ({what}): {exc}"


def _open_real_pool(capacity: int, page: int, device, compaction: bool, mesh: bool = False):
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
    pool = Pool(spec, capacity=capacity, page_size=page, auto_compact=compaction, auto_mesh=mesh)
    return pool, own_driver


def _replay_real(trace, capacity, page, device, compaction, name, progress, stop_at_first_oom,
                 mesh=False, series=False) -> ReplayResult:
    import torch

    from .errors import CompactionError
    from .oom import OutOfMemoryError

    t0 = time.perf_counter()
    pool, own_driver = _open_real_pool(capacity, page, device, compaction, mesh)
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
            # As the dry pool: meshing only in the defrag-mesh row.
            compact = (lambda: pool.compact(progress=False, mesh=mesh)) if compaction else None
            space = pool.core.space  # read only: the pages mapped now, as the dry pool reads them
            run.drive(trace, alloc, tensors.pop, compact, bar, stop_at_first_oom,
                      (lambda: space.mapped * page) if series else None)
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
                        seconds=time.perf_counter() - t0, error=error,
                        series=_window_max(run.reserved, run.i + 1) if series else None)


def min_capacity(trace: Trace, *, compaction: bool = True, page_size=None, known_good: int | None = None,
                 known_bad: int | None = None, hint: int | None = None, max_steps: int = MIN_CAPACITY_STEPS,
                 tolerance: float = 0.0, budget_s: float | None = None,
                 allocator: str | None = None, split: int = 1) -> MinCapacity:
    """Smallest capacity (whole pages) at which a dry replay completes, by bisection.

    ``allocator``: None (or ``"defrag"`` / ``"defrag-no-compaction"`` /
    ``"defrag-mesh"``) searches the pool (None: ``compaction`` says which); a `TORCH_MODELS` name searches that
    model of PyTorch's allocator (pages of 2 MiB unless ``page_size`` says).

    The bracket starts at ``ceil(peak live / page) - 1`` pages (cannot
    complete) or ``known_bad``, and ``known_good`` (or a capacity found by
    doubling from the peak live). The first round also probes ``hint``
    (e.g. the peak reserved of a completed replay); each round probes
    ``split`` capacities (the same rounds whether they run one after the
    other or at once, so the answer does not depend on the machine). Stops
    when the bracket is one page wide (``exact``) or narrower than
    ``tolerance`` of the answer, after ``max_steps`` replays, or once
    ``budget_s`` seconds are spent. Failing probes stop at their first
    failed allocation. Completion is not monotonic in capacity for any of
    these allocators: the answer is the boundary the search found.
    """
    allocator, page = _allocator_and_page(allocator, compaction, page_size)
    key = _share(trace)
    try:
        job = _search_job(key, allocator, page, trace.stats().peak_live_bytes, known_good=known_good,
                          known_bad=known_bad, hint=hint, max_steps=max_steps, tolerance=tolerance,
                          budget_s=budget_s, split=split)
        return _Workers(1).run([(0, job)])[0]
    finally:
        _SHARED.pop(key, None)


def _allocator_and_page(allocator: str | None, compaction: bool, page_size) -> tuple[str, int]:
    if allocator is None:
        allocator = "defrag" if compaction else "defrag-no-compaction"
    if allocator not in POOLS and allocator not in TORCH_MODELS:
        raise ValueError(f"unknown allocator {allocator!r}: 'defrag', 'defrag-no-compaction', 'defrag-mesh' or one of "
                         f"{sorted(TORCH_MODELS)}")
    page = ((DEFAULT_PAGE if allocator in POOLS else MODEL_PAGE) if page_size is None
            else parse_size(page_size, what="page_size"))
    return allocator, page


class _Bracket:
    """One smallest-capacity search's bracket, in pages: `lo` is known to fail, `hi` to complete (None:
    no capacity known to complete yet; the search doubles from the peak live bytes until one does).

    `propose` gives a round's capacities, `learn` takes the answers of a whole
    round (any capacities: a joint search's other brackets' too). The rounds
    depend only on the answers. Rounds: the hint first, then (``gallop``)
    down from the smallest capacity known to complete in steps of 1, 2, 4,
    ... pages until one fails (up from the largest known to fail in the same
    steps when the hint itself fails), then bisection.
    """

    def __init__(self, lo: int, hi: int | None, hint: int | None, gallop: bool, floor: int):
        self.lo, self.hi, self.hint = lo, hi, hint
        self.start_hi = hi  # the smallest capacity known to complete before any probe of this bracket's
        self.first = True  # the hint's round has not been proposed
        self.mode, self.step = ("down" if gallop else None), 1
        self.doubling = None if hi is not None else max(lo + 1, floor)  # the next capacity tried while hi is None

    def open(self, tolerance: float) -> bool:
        return self.hi is None or (self.hi - self.lo > 1 and (self.hi - self.lo) > tolerance * self.hi)

    def propose(self, k: int, taken=()) -> list[int]:
        """Up to `k` capacities for the next round (none already in `taken`, the other brackets' points)."""
        if self.hi is None:
            return [] if self.doubling in taken else [self.doubling]
        lo, hi = self.lo, self.hi
        # The hint leads the first round, whoever proposes it (in a joint search another bracket may have).
        anchor = self.hint if self.first and self.hint is not None and lo < self.hint < hi else None
        points = [anchor] if anchor is not None and anchor not in taken else []
        self.first = False
        # Galloping (pools): a pool's peak reserved at a roomier capacity is usually within a few pages of
        # its smallest capacity, on either side. Down from the smallest capacity known to complete in
        # steps of 1, 2, 4, ... pages while they complete; up from the largest known to fail in the same
        # steps when the hint itself fails; bisection once a round holds both answers.
        if self.mode == "down":
            top = hi if anchor is None else anchor
            while len(points) < k and top - self.step > lo:
                top, self.step = top - self.step, self.step * 2
                if top not in taken:
                    points.append(top)
        elif self.mode == "up":
            bottom = lo
            while len(points) < k and bottom + self.step < hi:
                bottom, self.step = bottom + self.step, self.step * 2
                if bottom not in taken:
                    points.append(bottom)
        while len(points) < k:
            # Fill the round by halving the widest gap left; below the hint when it is in the round
            # (it usually completes, so what lies above it is unlikely to matter).
            ceiling = hi if anchor is None else anchor
            edges = sorted({lo, ceiling, *(q for q in (*points, *taken) if lo < q <= ceiling)})
            gap, a = max((b - a, a) for a, b in zip(edges, edges[1:]))
            if gap <= 1:
                break
            points.append(a + gap // 2)
        return points

    def needs(self, q: int) -> bool:
        """Whether an answer at `q` pages would narrow this bracket (`learn` ignores the others)."""
        return q > self.lo and (self.hi is None or q < self.hi)

    def learn(self, points: list[int], answers: list) -> None:
        """A round's answers: `answers[i]` says whether `points[i]` pages completed (None: not known, at a
        capacity this bracket does not `need`)."""
        known = [(q, ok) for q, ok in zip(points, answers) if ok is not None]
        points, answers = [q for q, _ in known], [ok for _, ok in known]
        if self.hi is None:
            # Only capacities above the largest known to fail count (as inside a bracket below): a pool
            # that completes below a capacity it failed at says nothing of where its boundary lies.
            good = [q for q, ok in zip(points, answers) if ok and q > self.lo]
            bad = [q for q, ok in zip(points, answers) if not ok]
            if good:
                self.hi = self.start_hi = min(good)
                self.lo = max([self.lo, *(q for q in bad if q < self.hi)])
                return
            self.lo = max([self.lo, *bad])
            while self.doubling <= self.lo:  # the next capacity tried lies above every failure known
                self.doubling *= 2
            return
        inside = sorted((q, ok) for q, ok in zip(points, answers) if self.lo < q < self.hi)
        good = [q for q, ok in inside if ok]
        if good:
            self.hi = good[0]
        # A failure above a completing capacity (allocators are not monotonic) says nothing of the bracket.
        bad = [q for q, ok in inside if not ok and q < self.hi]
        if bad:
            self.lo = max(bad)
        # Down to a failure: bisection between it and the last capacity that completed; up from it only
        # when nothing below the first known to complete has (the hint itself failed).
        if (self.mode == "down" and bad) or (self.mode == "up" and good):
            self.mode = "up" if self.mode == "down" and self.hi == self.start_hi else None
            self.step = 1

    def result(self, page: int, steps: int) -> MinCapacity:
        if self.hi is None:
            return MinCapacity(None, self.lo * page if self.lo >= 1 else None, False, steps)
        return MinCapacity(self.hi * page, self.lo * page if self.lo >= 1 else None, self.hi - self.lo <= 1, steps)


def _start(page: int, peak_live: int, known_good, known_bad) -> tuple[int, int | None, int]:
    """A search's first bracket (lo, hi or None, floor) in pages: fewer pages than the live bytes need
    fail; `known_bad` fails; `known_good` completes (unless it is below what the live bytes need)."""
    floor = max(1, -(-peak_live // page))
    lo = floor - 1
    if known_bad is not None:
        lo = max(lo, known_bad // page)
    hi = known_good // page if known_good is not None else None
    if hi is not None and hi <= lo:
        hi = None  # a "good" capacity below what the live bytes need cannot be
    return lo, hi, floor


def _search_job(key, allocator: str, page: int, peak_live: int, *, known_good=None, known_bad=None, hint=None,
                max_steps: int = MIN_CAPACITY_STEPS, tolerance: float = 0.0, budget_s=None, split: int = 1,
                gallop: bool = False):
    """A generator: yields rounds of probe tasks, receives whether each completed, returns a MinCapacity.

    Rounds of ``split`` probes (a `_Bracket`'s); while no capacity is known
    to complete, one probe per round, doubling from the peak live bytes.
    """
    deadline = None if budget_s is None else time.perf_counter() + budget_s
    lo, hi, floor = _start(page, peak_live, known_good, known_bad)
    bracket = _Bracket(lo, hi, None if hint is None else -(-hint // page), gallop, floor)
    steps = 0
    while bracket.open(tolerance) and steps < max_steps and (deadline is None or time.perf_counter() <= deadline):
        points = sorted(bracket.propose(split))
        if not points:
            break
        answers = yield [("probe", key, allocator, q * page, page) for q in points]
        steps += len(points)
        bracket.learn(points, answers)
    return bracket.result(page, steps)


# ---------------------------------------------------------------------- work on both cores
POOLS = ("defrag", "defrag-no-compaction", "defrag-mesh")
_REFUSED = "refused request"  # the key of a recorded OOM's request added back into a trace
_SHARED: dict = {}  # key -> Trace; forked workers inherit it, so a trace is never pickled


def _share(trace: Trace) -> int:
    key = id(trace)
    _SHARED[key] = trace
    return key


def _run_dry(trace: Trace, allocator: str, capacity: int, page: int, *, stop: bool,
             series: bool = False) -> ReplayResult:
    if allocator in TORCH_MODELS:
        return replay_model(trace, capacity, expandable=TORCH_MODELS[allocator], progress=False,
                            stop_at_first_oom=stop, series=series)
    return replay(trace, capacity, dry=True, compaction=allocator != "defrag-no-compaction", page_size=page,
                  progress=False, stop_at_first_oom=stop, series=series, mesh=allocator == "defrag-mesh")


def _task(spec: tuple):
    """One unit of work, in a worker or inline: ("replay", ...) -> ReplayResult; ("probe" | "oom", ...) ->
    whether the dry replay completed; ("ladder", ...) -> {allocator: completed} for the pools whose runs
    that one dry replay was (`_answers_for`)."""
    kind, key, allocator, capacity, page = spec[:5]
    trace = _SHARED[key]
    if kind == "replay":
        return _run_dry(trace, allocator, capacity, page, stop=False, series=spec[5])
    if kind == "ladder":
        return _answers_for(_run_dry(trace, allocator, capacity, page, stop=True))
    if kind == "oom":
        event, size = spec[5], spec[6]
        # The refused request, served at the point PyTorch refused it and freed at once: what it
        # would have held afterwards is not recorded.
        events = trace.events[:event] + [(ALLOC, _REFUSED, size), (FREE, _REFUSED)] + trace.events[event:]
        trace = Trace(events, name=trace.name)
    return _run_dry(trace, allocator, capacity, page, stop=True).completed


class _Workers:
    """Runs jobs (generators that yield rounds of tasks) on up to `n` forked processes, inline when n <= 1.

    Tasks of a lower priority number go first. The answers are the same
    however many processes run them: a job sees a whole round's answers at
    once, in the order it asked.
    """

    def __init__(self, n: int):
        import multiprocessing

        self.n = max(1, int(n))
        if self.n > 1 and "fork" not in multiprocessing.get_all_start_methods():
            self.n = 1
        self.context = multiprocessing.get_context("fork") if self.n > 1 else None

    def run(self, jobs: list, bar=None) -> list:
        """`jobs`: (priority, generator) pairs; returns each generator's return value, in order.

        A round a job yields may be a `_Round`: once some of its answers are in, the tasks its next round
        is sure to hold (`_Round.preview`) run early on a core the round leaves idle, and the next round
        takes their answers. Probes ("probe", "ladder": answers that are plain values) asked for twice
        run once. `bar` (a tqdm bar, or None): advanced by each task's trace length when the task is
        done; its total grows as tasks are queued.
        """
        import heapq
        import itertools
        from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

        out = [None] * len(jobs)
        queue: list = []  # (priority, order, task id)
        tasks: dict = {}  # task id -> [spec, waiters [(job, slot)], done, value]
        shared: dict = {}  # spec -> task id, for specs whose answers any job may take
        waiting: dict = {}  # job -> [answers, how many are missing, the round]
        order = itertools.count()
        tally = {"queued": 0, "done": 0}
        preview = self.n > 1  # inline, a task run early would only run in another order

        def counted(spec, queueing: bool) -> None:
            if bar is None:
                return
            events = len(_SHARED[spec[1]].events)
            if queueing:
                tally["queued"] += 1
                bar.total += events
            else:
                tally["done"] += 1
                bar.update(events)
            bar.set_postfix_str(f"{tally['done']}/{tally['queued']} replays", refresh=False)
            bar.refresh()

        def task_for(spec, priority, waiter):
            """The task answering `spec`: one already queued, running or done where its answer is a plain
            value any job may take (`waiter` added to it), else a new one in the queue."""
            tid = shared.get(spec) if spec[0] in ("probe", "ladder") else None
            if tid is None:
                tid = next(order)
                tasks[tid] = [spec, [], False, None]
                if spec[0] in ("probe", "ladder"):
                    shared[spec] = tid
                counted(spec, True)
                heapq.heappush(queue, (priority, tid, tid))
            if waiter is not None:
                tasks[tid][1].append(waiter)
            return tasks[tid]

        def advance(j: int, answers) -> None:
            gen = jobs[j][1]
            try:
                specs = next(gen) if answers is None else gen.send(answers)
            except StopIteration as stop:
                out[j] = stop.value
                return
            waiting[j] = [[None] * len(specs), len(specs), specs, set()]
            ready = []
            for slot, spec in enumerate(specs):
                task = task_for(spec, jobs[j][0], (j, slot))
                if task[2]:
                    ready.append((slot, task[3]))
            for slot, value in ready:
                deliver(j, slot, value)

        def deliver(j: int, slot: int, value) -> None:
            w = waiting[j]
            w[0][slot] = value
            w[1] -= 1
            w[3].add(slot)
            if w[1] == 0:
                del waiting[j]
                advance(j, w[0])
            elif preview and isinstance(w[2], _Round):
                for spec in w[2].preview({i: w[0][i] for i in w[3]}):
                    task_for(spec, jobs[j][0], None)

        def finish(tid: int, value) -> None:
            task = tasks[tid]
            counted(task[0], False)
            task[2], task[3] = True, value
            waiters, task[1] = task[1], []
            if task[0][0] not in ("probe", "ladder"):
                del tasks[tid]
            for j, slot in waiters:
                deliver(j, slot, value)

        for j in range(len(jobs)):
            advance(j, None)
        if self.n == 1:
            while queue:
                tid = heapq.heappop(queue)[2]
                finish(tid, _task(tasks[tid][0]))
            return out
        with ProcessPoolExecutor(self.n, mp_context=self.context, initializer=_end_with_parent,
                                 initargs=(os.getpid(),)) as pool:
            running: dict = {}
            while queue or running:
                while queue and len(running) < self.n:
                    tid = heapq.heappop(queue)[2]
                    running[pool.submit(_task, tasks[tid][0])] = tid
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for fut in done:
                    finish(running.pop(fut), fut.result())
        return out


def _end_with_parent(parent: int) -> None:
    """A worker's first act: end when the process that started it dies.

    A parent killed by a timeout or the OOM killer never shuts its pool
    down, and its workers would each keep a core busy until their task is
    done. On Linux the kernel sends the worker SIGKILL when its parent dies
    (``prctl(PR_SET_PDEATHSIG)``: a worker holds nothing that needs
    cleaning up); a parent that died before that call is caught by the
    check after it (the worker was re-parented, so its parent is no longer
    `parent`). Elsewhere only that check applies.
    """
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            import signal

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1: PR_SET_PDEATHSIG
        except (OSError, AttributeError):  # no libc to call: the check below still runs
            pass
    if os.getppid() != parent:
        os._exit(1)


def default_workers() -> int:
    """Processes for dry replays: every core this process may use, at most `MAX_WORKERS`."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_WORKERS, cores))


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
        return [], [{"allocator": n, "reason": reason, "no_gpu": True} for n, _ in names]
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
RECORDED = "PyTorch (recorded)"
# The recorded row's name by who recorded the snapshot (`SnapshotDevice.recorded_by`): under `defrag run`
# the pool was PyTorch's allocator, and the curve is that pool's.
RECORDED_BY = {"PyTorch": RECORDED, "defrag pool": "defrag pool (recorded)", "defrag run": "defrag run (recorded)"}


NO_GPU_LINE = ("PyTorch's real allocator replays only on a CUDA GPU (none here): the rows marked (model) are "
               "a model of it")


def format_table(results: list[ReplayResult], skipped: list[dict], recorded=None,
                 recorded_missing: bool = False, recorded_label: str = RECORDED, no_gpu_line: bool = True) -> str:
    """A plain-text table of the results (with a "PyTorch (recorded)" row, or `recorded_label`, when
    `recorded`, a `defrag.traces.snapshot.RecordedReserved`, is given, or one saying "not recorded" with
    `recorded_missing`), then one line per allocator skipped for a reason of its own; the rows skipped
    because there is no GPU get `NO_GPU_LINE`, once (``no_gpu_line``; False: none, e.g. after a first
    device's table said it)."""
    head = ["allocator", "peak live", "peak reserved", "reserved/live", "OOMs", "compactions", "moved",
            "min capacity", "seconds"]
    rows = []
    if recorded is not None:
        rows.append([recorded_label, "-", format_bytes(recorded.peak_bytes), "-", "-", "-", "-", "-", "-"])
    elif recorded_missing:
        rows.append([recorded_label, "-", "not recorded", "-", "-", "-", "-", "-", "-"])
    for r in results:
        mc = r.min_capacity
        if mc is None:
            mcap = "-"
        elif mc.bytes is None:
            mcap = "not found" + (f" (> {format_bytes(mc.failed_below)})" if mc.failed_below else "")
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
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    for r in results:
        if r.error:
            lines.append(f"{r.allocator}: stopped: {r.error}")
        for note in r.notes:
            lines.append(f"{r.allocator}: {note}")
    for s in skipped:
        if not s.get("no_gpu"):
            lines.append(f"{s['allocator']}: skipped: {s['reason']}")
    if no_gpu_line and any(s.get("no_gpu") for s in skipped):
        lines.append(NO_GPU_LINE)
    return "\n".join(lines)


@dataclass
class DeviceReport:
    """One device's replays: the results at its capacity, what PyTorch recorded, each recorded OOM explained.

    ``device`` is the snapshot's device index (None for a defrag trace).
    ``capacity_source`` says where the capacity came from. ``recorded`` is a
    `defrag.traces.snapshot.RecordedReserved` (None without segment entries);
    ``ooms`` one dict per recorded OOM (see `explain_oom`).
    """

    device: int | None
    trace: Trace
    capacity: int
    capacity_source: str
    results: list
    skipped: list
    recorded: object = None
    ooms: list = field(default_factory=list)
    live_series: tuple | None = field(default=None, repr=False)
    # Who recorded it (`SnapshotDevice.recorded_by`): "PyTorch", "defrag pool" or "defrag run" (its pool was
    # PyTorch's allocator); `rescue`: whether that defrag run had --rescue (None: not known).
    recorded_by: str = "PyTorch"
    rescue: bool | None = None

    @property
    def recorded_by_defrag(self) -> bool:
        """A defrag pool wrote the snapshot: the recorded curve is its reserved bytes."""
        return self.recorded_by != "PyTorch"

    @property
    def recorded_label(self) -> str:
        """The recorded row's name: "PyTorch (recorded)", "defrag pool (recorded)" or "defrag run (recorded)"."""
        return RECORDED_BY.get(self.recorded_by, RECORDED)

    def result(self, allocator: str) -> ReplayResult | None:
        return next((r for r in self.results if r.allocator == allocator), None)

    def recorded_vs_models(self) -> dict:
        """Each torch model's peak reserved over PyTorch's recorded peak (1.0: the same), at this capacity."""
        if self.recorded is None or not self.recorded.peak_bytes:
            return {}
        return {r.allocator: r.peak_reserved_bytes / self.recorded.peak_bytes
                for r in self.results if r.allocator in TORCH_MODELS}

    def as_dict(self) -> dict:
        return {
            "device": self.device, "capacity": self.capacity, "capacity_source": self.capacity_source,
            "trace": {"name": self.trace.name, "stats": self.trace.stats().as_dict(), "meta": self.trace.meta},
            "results": [r.as_dict() for r in self.results], "skipped": self.skipped,
            "recorded_by": self.recorded_by, "recorded_by_rescue": self.rescue,
            "recorded": None if self.recorded is None else {k: v for k, v in self.recorded.as_dict().items()},
            "recorded_note": None if self.recorded is not None or self.device is None else NO_SEGMENT_ENTRIES,
            "models_over_recorded_peak_reserved": self.recorded_vs_models(),
            "ooms": self.ooms,
            "summary": summary_sentence(self),
        }


NO_SEGMENT_ENTRIES = ("the trace has no segment entries (segment_alloc/free/map/unmap): what PyTorch reserved "
                      "over time is not recorded")


def snapshot_capacity(recorded, ooms: list, trace: Trace, page: int = DEFAULT_PAGE,
                      pool_capacity: int | None = None) -> tuple[int, str]:
    """The capacity a snapshot's device implies, and where it comes from.

    A snapshot a defrag pool recorded (``pool_capacity``: `SnapshotDevice.pool_capacity`, e.g.
    ``defrag run --record``): that pool's capacity, its limit then. At a
    recorded OOM: PyTorch's reserved bytes + the device's free bytes
    there (the most over the OOMs), what this process could hold on that GPU.
    Otherwise PyTorch's recorded peak reserved. Without segment entries:
    the reserved bytes at the end (``segments``) or the peak live bytes
    rounded up to a page, whichever is more. Never less than one page.
    """
    if pool_capacity:
        return max(pool_capacity, page), "the capacity of the defrag pool that recorded it"
    known = [(o.capacity, o) for o in ooms if o.capacity is not None]
    if known:
        cap, o = max(known, key=lambda x: x[0])
        return max(cap, page), (f"the GPU at the OOM at event {o.event}: PyTorch's reserved "
                                f"{format_bytes(o.reserved_bytes)} + the device's free {format_bytes(o.device_free)}")
    if recorded is not None:
        return max(recorded.peak_bytes, page), "PyTorch's recorded peak reserved"
    live = -(-trace.stats().peak_live_bytes // page) * page
    end = trace.meta.get("reserved_bytes_at_snapshot") or 0
    if end >= live:
        return max(end, page), "no segment entries: PyTorch's reserved bytes at the end of the trace (segments)"
    return max(live, page), "no segment entries: the peak live bytes, rounded up to a page"


def explain_oom(oom, defrag_completes: bool | None, expandable_completes: bool | None,
                capacity: int | None = None) -> dict:
    """A recorded OOM as a dict: the request, live, reserved and free bytes then, the capacity it is judged
    at (``capacity``, e.g. --capacity; default the GPU's then: reserved + free, also `recorded_capacity`),
    the verdict there ("fragmentation" when live + request fit in it), and whether defrag / the
    expandable-segments model complete the workload at it with the refused request served there
    (None: not tried)."""
    cap = oom.capacity if capacity is None else capacity
    verdict = ("unknown" if cap is None else
               "fragmentation" if oom.live_bytes + oom.size <= cap else "not fragmentation")
    return {"event": oom.event, "size": oom.size, "live_bytes": oom.live_bytes,
            "reserved_bytes": oom.reserved_bytes, "device_free": oom.device_free, "capacity": cap,
            "recorded_capacity": oom.capacity, "verdict": verdict, "defrag_completes": defrag_completes,
            "expandable_completes": expandable_completes}


def _oom_job(key, oom, capacity: int, given: bool):
    """Both checks of one recorded OOM; at `capacity` when it was given (--capacity, which the verdict
    is then judged at too), else at the GPU's capacity then (reserved + free), or `capacity` when that
    is not recorded (the verdict is then "unknown")."""
    cap = max(capacity if given or oom.capacity is None else oom.capacity, DEFAULT_PAGE)
    a, b = yield [("oom", key, "defrag", cap, DEFAULT_PAGE, oom.event, oom.size),
                  ("oom", key, "torch-expandable (model)", cap, MODEL_PAGE, oom.event, oom.size)]
    return explain_oom(oom, a, b, cap if given else None)


def _oom_unchecked(oom, capacity: int | None):
    return explain_oom(oom, None, None, capacity)
    yield  # a job that needs no work: a generator that returns at once


def _allocator_job(key, allocator: str, capacity: int, peak_live: int, *, dry: bool, device, page_size,
                   progress, series: bool, budget_s, split: int):
    """A generator: the replay at `capacity`, then the search for the smallest capacity; returns [result]."""
    _, page = _allocator_and_page(allocator, True, None if allocator in TORCH_MODELS else page_size)
    if dry or allocator in TORCH_MODELS:
        (r,) = yield [("replay", key, allocator, capacity, page, series)]
    else:
        r = replay(_SHARED[key], capacity, device=device, dry=False, compaction=allocator != "defrag-no-compaction",
                   page_size=page, progress=progress, mesh=allocator == "defrag-mesh", series=series)
    r.min_capacity = yield from _search_job(
        key, allocator, page, peak_live, known_good=r.capacity if r.completed else None,
        known_bad=None if r.completed else r.capacity, hint=_hint(r),
        max_steps=MIN_CAPACITY_MAX_STEPS, budget_s=budget_s, split=split, gallop=allocator in POOLS)
    return [r]


def _hint(r: ReplayResult) -> int | None:
    """Where the search for `r`'s smallest capacity starts: for a completed dry pool replay, the most
    bytes of pages that held blocks (its peak reserved includes the empty pages the growth policy
    keeps mapped: up to 1.10 x what is live); else the peak reserved."""
    if not r.completed:
        return None
    return r.search_hint if r.search_hint is not None else r.peak_reserved_bytes


_WEAKEST_FIRST = ("defrag-no-compaction", "defrag", "defrag-mesh")
_ANSWERS = {"defrag-no-compaction": {"defrag-no-compaction"}, "defrag": {"defrag", "defrag-no-compaction"},
            "defrag-mesh": {"defrag-mesh", "defrag", "defrag-no-compaction"}}  # whose runs `_answers_for` tells


def _answers_for(r: ReplayResult) -> dict:
    """Whether each defrag pool completes, from one dry run `r` of the most capable pool asked for
    (defrag-mesh, or defrag) on a trace without phase markers: {allocator: completed}.

    Without phase markers the three pools run the same code until a
    placement fails and the ladder calls its rescue (`compactor.rescue`):
    the pool without compaction fails at the first rescue, the pool without
    meshing at the first rescue that goes on to meshing. So where `r` never
    rescued its run is all three's, and where it never meshed it is
    defrag's too; where it did, the weaker pool failed there. Exact for a
    probe (which stops at its first failure) and for a whole replay alike.
    """
    # How often `r`'s run went where each pool's leaves it: no compaction fails at its first rescue, no
    # meshing at its first meshing. For `r`'s own pool that answer is its own: defrag never meshes, and
    # the pool without compaction, once it rescues, has failed.
    parted = {"defrag-no-compaction": r.rescue_steps["rescues"], "defrag": r.rescue_steps["meshing"],
              "defrag-mesh": 0}
    return {name: r.completed and not parted[name] for name in _ANSWERS[r.allocator]}


def _same_run(r: ReplayResult, allocator: str) -> ReplayResult:
    """`r` as the row of `allocator`, whose replay at r's capacity was the same run (`_answers_for`): the same
    figures, marked in `ReplayResult.same_run_as` (the JSON's), with no note in the table: nothing there
    for a user to act on."""
    return ReplayResult(**{**{f: getattr(r, f) for f in r.__dataclass_fields__}, "allocator": allocator,
                           "notes": [], "min_capacity": None, "same_run_as": r.allocator})


def _pools_without_phases_job(key, capacity: int, peak_live: int, *, page_size, series: bool, budget_s,
                              mesh: bool, split: int = 2):
    """Every defrag pool on a dry trace without phase markers; returns [defrag, defrag-no-compaction]
    and, with ``mesh``, defrag-mesh after them.

    Every replay runs the most capable pool asked for (defrag-mesh, else
    defrag) and answers for the others where its run was theirs
    (`_answers_for`): the replay at `capacity` is every row's when no
    placement failed; the weaker rows get replays of their own only where
    it was not. The smallest capacities come from one joint search: each
    round probes ``split`` capacities (one per core), proposed by the
    brackets still open (`_Bracket`, widest first), and every answer
    narrows every bracket. Each row's `MinCapacity.steps` is the joint
    search's probes (all rows'); the joint search has ``budget_s`` seconds
    and `MIN_CAPACITY_MAX_STEPS` probes for each row, shared.
    """
    top = "defrag-mesh" if mesh else "defrag"
    rows = ["defrag", "defrag-no-compaction"] + (["defrag-mesh"] if mesh else [])
    _, page = _allocator_and_page(top, True, page_size)
    (r,) = yield [("replay", key, top, capacity, page, series)]
    answers = _answers_for(r)
    results = {top: r}
    for name in rows:
        if name != top and answers[name] and r.completed:
            results[name] = _same_run(r, name)
    missing = [name for name in rows if name not in results]
    if missing:
        own = yield [("replay", key, name, capacity, page, series) for name in missing]
        results.update(zip(missing, own))
    brackets = {}
    for name in rows:
        done = results[name]
        lo, hi, floor = _start(page, peak_live, done.capacity if done.completed else None,
                               None if done.completed else done.capacity)
        hint = _hint(done)
        if name == "defrag-mesh":
            # Meshing makes do with fewer pages than the hint (the peak held where pages were plenty)
            # says, by as much as it finds to mesh: a bisection below the other rows' answers finds it
            # in fewer probes than a gallop down from the hint would. Without a hint, every row bisects.
            hint = None
        hint = None if hint is None else -(-hint // page)
        useful = hint is not None and lo < hint and (hi is None or hint < hi)
        brackets[name] = _Bracket(lo, hi, hint if useful else None, useful, floor)
    deadline = None if budget_s is None else time.perf_counter() + budget_s * len(rows)
    steps, most = 0, MIN_CAPACITY_MAX_STEPS * len(rows)
    while steps < most and (deadline is None or time.perf_counter() <= deadline):
        points, specs = _joint_round(brackets, rows, key, page, split)
        if not points:
            break
        said = yield _Round(specs, _next_round_preview(brackets, rows, key, page, split, points, specs,
                                                       steps + len(points) < most))
        steps += len(points)
        for name, b in brackets.items():
            b.learn(points, [a.get(name) for a in said])
    for name in rows:
        results[name].min_capacity = brackets[name].result(page, steps)
    return [results[name] for name in rows]


def _joint_round(brackets: dict, rows: list, key, page: int, split: int) -> tuple[list[int], list[tuple]]:
    """The joint search's next round: its capacities in pages, ascending, and a ladder task for each
    (`_pools_without_phases_job`). Proposing changes the brackets (a gallop's step, the hint's turn)."""
    open_ = sorted((b for b in brackets.values() if b.open(0.0)),
                   key=lambda b: -(math.inf if b.hi is None else b.hi - b.lo))
    points: list[int] = []
    for b in open_ * split:  # widest first, one each, until the round is full
        if len(points) >= split:
            break
        points += b.propose(1, points)
    points.sort()
    # Each probe runs the weakest pool whose run answers every bracket that still needs that
    # capacity (the others ignore it): no compaction stops at the first rescue, no meshing at the
    # first rescue that would mesh, and neither pays for what comes after.
    specs = []
    for q in points:
        needs = {name for name, b in brackets.items() if b.needs(q)}
        pool = next(name for name in _WEAKEST_FIRST if needs <= _ANSWERS[name] and name in rows)
        specs.append(("ladder", key, pool, q * page, page))
    return points, specs


def _next_round_preview(brackets: dict, rows: list, key, page: int, split: int, points: list, specs: list,
                        more: bool):
    """For a round of the joint search under way: given the answers known so far ({slot: answer}), the
    ladder tasks the next round holds whatever the others answer, so that a core the round leaves idle
    can run them early (`_Workers`). The next round is computed, not guessed: on copies of the brackets,
    once for every answer the tasks still running could give; a task is early only where every one of
    them proposes it. So the search, its probes and its answers are the same as without the preview.
    `more`: whether the search's step limit allows another round at all."""
    import copy
    import itertools

    def preview(known: dict) -> list:
        if not more:
            return []
        open_slots = [i for i in range(len(specs)) if i not in known]
        choices = []
        for i in open_slots:
            names = sorted(_ANSWERS[specs[i][2]])
            choices.append([dict(zip(names, bits)) for bits in itertools.product((False, True), repeat=len(names))])
        common = None
        for outcome in itertools.product(*choices):
            said = [known[i] if i in known else outcome[open_slots.index(i)] for i in range(len(specs))]
            trial = copy.deepcopy(brackets)
            for name, b in trial.items():
                b.learn(points, [a.get(name) for a in said])
            nxt = set(_joint_round(trial, rows, key, page, split)[1])
            common = nxt if common is None else common & nxt
            if not common:
                return []
        return sorted(common or ())

    return preview


class _Round(list):
    """A round of tasks a job yields to `_Workers`, with `preview(known)`: the tasks its next round is sure
    to hold given the answers `known` so far ({slot: answer}), which may run before the round is over."""

    def __init__(self, specs, preview):
        super().__init__(specs)
        self.preview = preview


def replay_devices(items: list, capacity: int | None = None, *, dry: bool = False, device=None, page_size=None,
                   baselines: bool = True, models: bool = True, progress: bool | None = None,
                   search_budget_s: float | None = SEARCH_BUDGET_S, workers: int | None = None,
                   series: bool = False, mesh: bool = True) -> list[DeviceReport]:
    """Replay each of `items` (`SnapshotDevice`s, or (None, Trace) pairs) and explain its recorded OOMs.

    Each device runs at `capacity`, or (None) the capacity its snapshot
    implies (`snapshot_capacity`). Per device: the pool with and without
    compaction, and (``mesh``) with compaction and meshing, the models of
    PyTorch's allocator (``models``), each with its smallest capacity, and for every recorded OOM whether the pool and the
    expandable-segments model complete with the refused request served.
    Dry replays and searches run on ``workers`` processes (default: both
    cores of this machine); the figures do not depend on how many. PyTorch
    on a GPU (``baselines``) runs after them, in this process's children.
    """
    workers = default_workers() if workers is None else workers
    plans, jobs = [], []
    try:
        for item in items:
            dev, trace = (item.device, item.trace) if hasattr(item, "trace") else item
            recorded, ooms = getattr(item, "recorded", None), list(getattr(item, "ooms", []) or [])
            if capacity is not None:
                cap, source = capacity, "--capacity"
            elif dev is not None:
                cap, source = snapshot_capacity(recorded, ooms, trace,
                                                pool_capacity=getattr(item, "pool_capacity", None))
            else:
                raise ValueError("a capacity is needed for a trace that is not a snapshot")
            key = _share(trace)
            st = trace.stats()
            first = len(jobs)
            if dry and st.phases == 0:
                jobs.append(((0, len(plans)), _pools_without_phases_job(
                    key, cap, st.peak_live_bytes, page_size=page_size, series=series, budget_s=search_budget_s,
                    mesh=mesh)))
            for name in POOLS:
                if (dry and st.phases == 0) or (name == "defrag-mesh" and not mesh):
                    continue  # all of them in the job above; or no meshing row asked for
                # The pool with compaction is the slowest replay: first in line, and its search probes
                # two capacities per round so both cores can share it.
                jobs.append(((0 if name == "defrag" else 1, len(plans)), _allocator_job(
                    key, name, cap, st.peak_live_bytes, dry=dry, device=device, page_size=page_size,
                    progress=progress, series=series, budget_s=search_budget_s,
                    split=2 if name == "defrag" else 1)))
            for name in TORCH_MODELS if models else ():
                jobs.append(((3, len(plans)), _allocator_job(
                    key, name, cap, st.peak_live_bytes, dry=True, device=None, page_size=None, progress=False,
                    series=series, budget_s=search_budget_s, split=1)))
            n_results = len(jobs) - first
            for i, oom in enumerate(ooms):
                # Each check is two replays of the whole trace: a program that retried a refused request
                # thousands of times gets its first OOM_CHECKS checked, every one explained in numbers.
                given = capacity is not None
                jobs.append(((2, len(plans)), _oom_job(key, oom, cap, given) if i < OOM_CHECKS
                             else _oom_unchecked(oom, cap if given else None)))
            plans.append((dev, trace, cap, source, recorded, first, n_results, len(ooms),
                          (getattr(item, "recorded_by", "PyTorch"), getattr(item, "rescue", None))))
        # Real replays run in this process (their devices are not for forked children).
        bar = _work_bar(progress)
        try:
            done = _Workers(workers if dry else 1).run(jobs, bar)
        finally:
            if bar is not None:
                bar.close()
    finally:
        for item in items:
            _SHARED.pop(id(item.trace if hasattr(item, "trace") else item[1]), None)
    reports = []
    for dev, trace, cap, source, recorded, first, n, n_ooms, (by, rescue) in plans:
        results = [r for job in done[first:first + n] for r in job]
        skipped: list[dict] = []
        if baselines:
            extra, skipped = torch_baselines(trace, cap)
            results += extra
        reports.append(DeviceReport(dev, trace, cap, source, results, skipped, recorded,
                                    done[first + n:first + n + n_ooms],
                                    live_series=live_series(trace) if series else None,
                                    recorded_by=by, rescue=rescue))
    return reports


def live_series(trace: Trace) -> tuple[list, list]:
    """(event indices, bytes) of the bytes live over the trace (sizes as recorded), at most
    `traces.snapshot.SERIES_POINTS` points, each the most in its stretch."""
    import numpy as np

    sizes: dict = {}
    delta = np.zeros(len(trace.events), dtype=np.int64)
    for i, ev in enumerate(trace.events):
        if ev[0] == ALLOC:
            sizes[ev[1]] = delta[i] = ev[2]
        elif ev[0] == FREE:
            delta[i] = -sizes.pop(ev[1])
    return _window_max(np.cumsum(delta), len(delta))


def run_all(trace: Trace, capacity: int, *, dry: bool = False, device=None, page_size=None,
            baselines: bool = True, progress: bool | None = None,
            search_budget_s: float | None = SEARCH_BUDGET_S,
            models: bool = True, workers: int | None = None) -> tuple[list[ReplayResult], list[dict]]:
    """(a) and (b) at `capacity` plus their smallest capacities; (d) the models of PyTorch's allocator
    (``models``), with theirs; (c) when a GPU is present (``baselines``).

    Each smallest-capacity search gets ``search_budget_s`` seconds (None: no
    limit; the step cap still applies). Dry work runs on ``workers``
    processes (see `replay_devices`).
    """
    (report,) = replay_devices([(None, trace)], capacity, dry=dry, device=device, page_size=page_size,
                               baselines=baselines, models=models, progress=progress,
                               search_budget_s=search_budget_s, workers=workers)
    return report.results, report.skipped


def _smallest(r: ReplayResult | None) -> str | None:
    """A result's smallest capacity in words ("51.19 GiB", "at most 2.25 GiB", "more than 80.00 GiB"),
    None when it was not searched."""
    mc = None if r is None else r.min_capacity
    if mc is None:
        return None
    if mc.bytes is None:
        return f"more than {format_bytes(mc.failed_below)}" if mc.failed_below else "not found"
    return format_bytes(mc.bytes) if mc.exact or mc.failed_below is None else f"at most {format_bytes(mc.bytes)}"


def summary_sentence(report: DeviceReport) -> str:
    """What happened on one device and what would have helped, in a user's words (the table follows).

    What happened: the recorded peak reserved (else what the snapshot's
    segments held at the end, else nothing) against the peak live bytes;
    the recorded OOMs, and whether live + request fit in the capacity
    (fragmentation) or not; without recorded OOMs, whether defrag fails at
    the capacity. What would have helped: whether
    defrag and PyTorch with expandable segments (the model) run to the end
    with each refused request served where it failed, and the smallest
    capacity that runs the trace for defrag (and its meshing row when that
    needs less), PyTorch with expandable segments and PyTorch (the models).
    """
    fb = format_bytes
    live = report.trace.stats().peak_live_bytes
    who = {"defrag run": "under defrag run, its pool (PyTorch's allocator there)",
           "defrag pool": "the defrag pool"}.get(report.recorded_by, "PyTorch")
    rec, ooms = report.recorded, report.ooms
    happened = []
    if rec is not None:
        over = rec.peak_bytes / live - 1 if live else 0.0
        happened.append(f"{who} reserved up to {fb(rec.peak_bytes)} for {fb(live)} live"
                        + (f" ({over:+.1%})" if abs(over) >= 0.0005 else ""))
    elif report.trace.meta.get("reserved_bytes_at_snapshot"):
        end = report.trace.meta["reserved_bytes_at_snapshot"]
        happened.append(f"{who} held {fb(end)} at the end for a peak of {fb(live)} live (its reserved bytes over "
                        f"time are not recorded)")
    else:
        happened.append(f"the trace peaks at {fb(live)} live")
    if ooms:
        n = len(ooms)
        judged = [o for o in ooms if o["verdict"] != "unknown"]
        frag = sum(o["verdict"] == "fragmentation" for o in judged)
        caps = {o["capacity"] for o in judged}
        within = fb(caps.pop()) if len(caps) == 1 else "the capacity"
        text = f"and ran out of memory {'once' if n == 1 else f'{n} times'}"
        if not judged:
            text += " (the GPU's capacity then is not recorded: fragmentation or not is unknown)"
        elif frag == len(judged):
            text += f" with the memory there but fragmented (live + request fit in {within})"
        elif frag == 0:
            text += f": live + request did not fit in {within}, so it needed more memory, not a better layout"
        else:
            text += f"; {frag} of {len(judged)} times the memory was there but fragmented (live + request fit in {within})"
        happened[-1] += " " + text if not text.startswith(":") else text
    d = report.result("defrag")
    if not ooms and d is not None and not d.completed:
        happened.append(f"at {fb(report.capacity)} defrag fails {d.ooms} allocation{'s' if d.ooms != 1 else ''}"
                        if d.ooms else f"at {fb(report.capacity)} defrag stops ({d.error})")
    helped = []
    checked = [o for o in ooms if o["defrag_completes"] is not None]
    if checked:
        a = sum(bool(o["defrag_completes"]) for o in checked)
        b = sum(bool(o["expandable_completes"]) for o in checked)
        if report.recorded_by == "defrag run":
            helped.append(_run_verdict(report, a, len(checked)))
            if len(checked) == 1:
                helped.append(f"PyTorch with expandable_segments would{'' if b else ' not'} (model)")
            else:
                helped.append(f"PyTorch with expandable_segments in {b} (model)")
        elif len(checked) == 1:
            helped.append("defrag, which moves tensors, would have served the request and run to the end" if a
                          else "defrag would not have served the request either")
            helped.append(f"PyTorch with expandable_segments would{'' if b else ' not'} (model)")
        else:
            helped.append(f"with each refused request served, defrag runs to the end in {a} of {len(checked)} "
                          f"cases, PyTorch with expandable_segments in {b} (model)")
    needs = []
    plain = report.result("defrag-no-compaction")
    if report.recorded_by == "defrag run" and _smallest(plain):
        # That run's pool moved nothing inside an operation: the pool without compaction is the run as it
        # ran; the one that compacts at a failed request is what --rescue comes closest to.
        # (With --rescue on, the run moved at some failed requests: its figure lies between the two.)
        moving = "a pool that moves every tensor" if report.rescue else "with --rescue"
        if _smallest(d) and _smallest(d) != _smallest(plain):
            needs.append(f"defrag run {_smallest(plain)}{' without moves' if report.rescue else ''}, "
                         f"{moving} {_smallest(d)}")
        else:
            needs.append(f"defrag run {_smallest(plain)}")
    elif _smallest(d):
        needs.append(f"defrag {_smallest(d)}")
    mesh = report.result("defrag-mesh")
    if report.recorded_by == "defrag run":
        pass  # no option of defrag run turns meshing on or off: the figures above are its choices
    elif (_smallest(mesh) and _smallest(d) and mesh.min_capacity.bytes is not None
            and d.min_capacity.bytes is not None and mesh.min_capacity.bytes < d.min_capacity.bytes):
        needs.append(f"defrag with meshing {_smallest(mesh)}")
    models = [f"{words} {_smallest(report.result(name))}"
              for name, words in (("torch-expandable (model)", "PyTorch with expandable_segments"),
                                  ("torch (model)", "PyTorch")) if _smallest(report.result(name))]
    if models:
        needs.append(", ".join(models) + " (model)")
    if needs:
        helped.append("the smallest capacity that runs the trace" + (" less the refused requests" if ooms else "")
                      + ": " + ", ".join(needs))

    def sentence(parts: list) -> str:
        text = "; ".join(parts)
        if text and not text.startswith("defrag"):  # the project's name keeps its lower case
            text = text[:1].upper() + text[1:]
        return text + "." if text else ""

    return " ".join(x for x in (sentence(happened), sentence(helped)) if x)


def _run_verdict(report: DeviceReport, served: int, checked: int) -> str:
    """What would have served the refused requests of a run recorded under `defrag run`, in its options'
    words. Its pool was PyTorch's allocator: PyTorch's tensors move there only at safe points, and a request
    made inside an operation is served only by `--rescue` (the operation unwinds, the pool compacts with
    PyTorch's tensors moving, and it runs again). The dry defrag replay moves every tensor at the failed
    request, which is what --rescue comes closest to."""
    cases = "the request" if checked == 1 else f"{served} of the {checked} refused requests"
    if not served:
        return ("moving tensors would not have served the request either" if checked == 1 else
                f"moving tensors would have served none of the {checked} refused requests")
    if report.rescue:
        return (f"this run had --rescue, which could not serve it (the failed operation's own tensors stay where "
                f"they are, and one that writes an argument never runs again); a pool that moves every tensor "
                f"would have served {cases}" + (" and run to the end" if checked == 1 else ""))
    return (f"defrag run --rescue (an operation that runs out of memory runs again after PyTorch's tensors "
            f"move) would have served {cases}" + (" and run to the end" if checked == 1 else "")
            + " (replayed on a pool that moves tensors when a request fails)")


def _recorded_line(report: DeviceReport) -> str:
    rec = report.recorded
    if rec is None:
        end = report.trace.meta.get("reserved_bytes_at_snapshot")
        return (f"{report.recorded_label}: {NO_SEGMENT_ENTRIES}" + (f"; reserved at the end {format_bytes(end)} (segments)"
                                                      if end else ""))
    text = (f"{report.recorded_label}: reserved at the start {format_bytes(rec.start_bytes)}, peak {format_bytes(rec.peak_bytes)}, "
            f"end {format_bytes(rec.end_bytes)} ({len(rec.event) - 1} change{'' if len(rec.event) == 2 else 's'}"
            f"{'' if rec.end_from_segments else '; no segments list: the start is the least level that fits'})")
    ooms = {r.allocator: r.ooms for r in report.results}
    diffs = [f"{name} {ratio - 1:+.1%}" + (f" ({counted(ooms[name], 'OOM')} at this capacity)" if ooms.get(name)
                                          else "")
             for name, ratio in report.recorded_vs_models().items()]
    if diffs:
        text += "; peak reserved against it: " + ", ".join(diffs)
    return text


def _oom_lines(report: DeviceReport) -> list[str]:
    lines = []
    for i, o in enumerate(report.ooms, 1):
        fb = format_bytes
        where = (f"OOM {i} at event {o['event']}: request {fb(o['size'])}, live {fb(o['live_bytes'])}, "
                 f"reserved {'unknown' if o['reserved_bytes'] is None else fb(o['reserved_bytes'])}, "
                 f"device free {'unknown' if o['device_free'] is None else fb(o['device_free'])}")
        if o["capacity"] is None:
            why = "unknown (the GPU's capacity then is not recorded)"
        else:
            need = o["live_bytes"] + o["size"]
            given = report.capacity_source == "--capacity"
            why = (f"{o['verdict']} (live + request = {fb(need)} {'<=' if need <= o['capacity'] else '>'} "
                   f"{fb(o['capacity'])} = {'--capacity' if given else 'reserved + free'})")

        def yes(v):
            return f"not tried (only the first {OOM_CHECKS} are)" if v is None else ("yes" if v else "no")

        lines.append(f"  {where} -> {why}; with it served there, defrag completes: {yes(o['defrag_completes'])}, "
                     f"torch-expandable (model) completes: {yes(o['expandable_completes'])}")
    return lines


# (color, line style, width) per allocator in the picture; PyTorch (recorded) is red, the OOMs red dotted.
_PLOT_STYLE = {"defrag": ("tab:blue", "-", 1.4), "defrag-no-compaction": ("tab:cyan", "--", 1),
               "defrag-mesh": ("tab:purple", ":", 1.4),
               "torch (model)": ("tab:green", "-", 1), "torch-expandable (model)": ("tab:orange", "-", 1),
               "torch": ("tab:olive", "-", 1), "torch-expandable": ("tab:brown", "-", 1)}


def plot_devices(reports: list[DeviceReport], path) -> None:
    """`devices_figure(reports)` written to `path` (the format from its suffix; PNG without one, to that
    very path: matplotlib would add ".png" to it)."""
    import matplotlib.pyplot as plt

    fig = devices_figure(reports)
    try:
        fig.savefig(path, dpi=110, format=None if Path(str(path)).suffix else "png")
    finally:
        plt.close(fig)


def devices_figure(reports: list[DeviceReport]):
    """One panel per device: live bytes and each allocator's reserved bytes over the trace (every result
    with a series: `replay_devices(..., series=True)`), PyTorch's recorded reserved bytes dashed on top of
    them, the capacity used, and the recorded OOMs as vertical lines. A matplotlib Figure (Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(reports), 1, figsize=(13, 3.6 * len(reports)), squeeze=False)
    for ax, rep in zip(axes[:, 0], reports):
        top = max([rep.capacity] + ([rep.recorded.peak_bytes] if rep.recorded is not None else [])
                  + [r.peak_reserved_bytes for r in rep.results])
        unit, uname = (float(1 << 30), "GiB") if top >= 2 << 30 else (float(1 << 20), "MiB")
        # x: events replayed so far. A replay's value after event i shows from i + 1; PyTorch's recorded
        # level from event e on is what it held before e ran, so it shows from e.
        if rep.live_series is not None:
            x, y = rep.live_series
            ax.step([i + 1 for i in x], [v / unit for v in y], where="post", color="black", lw=1.2, label="live")
        if rep.recorded is not None:
            # Drawn over every replayed curve (zorder), dashed, so that it stays visible where a replay
            # reserves exactly what PyTorch did.
            rec = rep.recorded
            xs = list(rec.event) + [len(rep.trace.events)]
            ax.step(xs, [v / unit for v in rec.reserved] + [rec.reserved[-1] / unit], where="post", lw=2.0,
                    ls=(0, (6, 3)), color="tab:red", zorder=5, label=f"{rep.recorded_label}: reserved")
        for r in rep.results:
            if r.series is None:
                continue
            x, y = r.series
            color, style, width = _PLOT_STYLE.get(r.allocator, (None, "-", 1))
            ax.step([i + 1 for i in x], [v / unit for v in y], where="post", lw=width, ls=style, color=color,
                    label=f"{r.allocator}: reserved" + ("" if r.completed else f" ({counted(r.ooms, 'OOM')})"))
        for i, o in enumerate(rep.ooms):
            ax.axvline(o["event"], color="tab:red", ls=":", lw=1, label="recorded OOM" if i == 0 else None)
        ax.axhline(rep.capacity / unit, color="grey", ls="--", lw=0.8, label=f"capacity ({format_bytes(rep.capacity)})")
        title = rep.trace.name if rep.device is None else f"{rep.trace.name}: device {rep.device}"
        ax.set_title(f"{title} ({len(rep.trace.events):,} events)", fontsize=10)
        ax.set_xlabel("events replayed")
        ax.set_ylabel(uname)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the curves, not on them
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _check_real_pool(capacity: int, device) -> None:
    """Open (and close) the pool a real replay will use, so that a device or capacity that cannot work
    is a `defrag.cli.UsageError` before any work, not a traceback half-way."""
    from .arguments import pool_open_error
    from .errors import CudaError

    try:
        pool, own_driver = _open_real_pool(capacity, DEFAULT_PAGE, device, True)
    except (CudaError, OSError, ValueError) as exc:  # ValueError: the pool's own refusal, e.g. of its reservation
        raise pool_open_error(exc, capacity, hint=", or --dry (the pool's own code over a memory-less device) for capacities this "
                                                  "large") from None
    pool.close()
    if own_driver is not None:
        own_driver.close()


def load_input(path, *, snapshot_device: int | None = None) -> tuple[str, list]:
    """("trace", [(None, Trace)]) or ("snapshot", [SnapshotDevice, ...]) from a file, told apart by content.

    TraceError (naming the file) for anything that is neither; ``snapshot_device`` picks one device of a
    snapshot (TraceError if it has no such device) and is an error for a trace.
    """
    from .traces.snapshot import load_snapshot_devices, read_pickle

    body = _read_body(path)
    if _is_pickle(body):
        data = read_pickle(body, path=path)
        return "snapshot", load_snapshot_devices(data, device=snapshot_device, name=Path(path).name)
    trace, kind = _parse_body(body, path)
    if snapshot_device is not None:
        raise TraceError("--snapshot-device applies to PyTorch memory snapshots; this is a defrag trace", path=path)
    return kind, [(None, trace)]


def _plot_format(value) -> None:
    """`UsageError` unless matplotlib can write a picture to `value` (decided by its suffix; none: PNG)."""
    from .arguments import UsageError

    suffix = Path(str(value)).suffix.lower().lstrip(".")
    if not suffix:
        return
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix not in formats:
        raise UsageError(f"--plot {value}: matplotlib cannot draw a .{suffix} file; name a picture, e.g. "
                         f"{Path(str(value)).with_suffix('.png')} (also {', '.join('.' + f for f in sorted(formats) if f != 'png')})")


def _host_memory_available() -> int | None:
    """MemAvailable from /proc/meminfo in bytes; None where there is no such file."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def emulation_limit(items: list, capacity: int | None) -> str | None:
    """Why replaying `items` without --dry on the emulated device could not fit this machine, or None.

    The emulated device keeps one memfd (an open file) per physical page
    and, once compaction copies into a page, the page's bytes in host
    memory. The estimate per device: its peak live bytes or PyTorch's
    recorded peak reserved, whichever is more, plus a quarter for what
    fragmentation adds, at most the capacity; the most over the devices
    (they replay one after the other), against ``ulimit -n`` (less 64 files
    for the process's own) and against the host memory available now.
    """
    import resource

    page = DEFAULT_PAGE
    need = 0
    for item in items:
        dev, trace = (item.device, item.trace) if hasattr(item, "trace") else item
        recorded = getattr(item, "recorded", None)
        cap = capacity if capacity is not None else snapshot_capacity(
            recorded, getattr(item, "ooms", []), trace, pool_capacity=getattr(item, "pool_capacity", None))[0]
        peak = max(trace.stats().peak_live_bytes, recorded.peak_bytes if recorded is not None else 0)
        need = max(need, min(cap, peak + peak // 4 + page))
    pages = -(-need // page)
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and pages + 64 > soft:
        return (f"could need about {pages} pages of {format_bytes(page)}, one open file each, more than "
                f"`ulimit -n` allows ({soft})")
    available = _host_memory_available()
    if available is not None and pages * page > 0.8 * available:
        return (f"could need about {format_bytes(pages * page)} of host memory (each page compaction writes "
                f"into), more than this machine has available ({format_bytes(available)})")
    return None


def main(args) -> int:
    """The `defrag replay` command: load, replay every device, print a section per device, write --json/--plot.

    Bad input (arguments, a file that is not a trace) raises `defrag.cli.UsageError`:
    one line on stderr, exit code 2, before any replay runs. Without
    --dry on the emulated device, a trace this machine could not hold
    (`emulation_limit`) replays dry, and the first line says why. Exit
    code 1 when the compacting pool fails an allocation (or stops) at its
    capacity on some device; 0 when it completes on every device.
    """
    from .arguments import UsageError, device_arg, device_label, out_file_arg, size_arg

    capacity = None
    if args.capacity is not None:
        capacity = size_arg(args.capacity, "--capacity", at_least=DEFAULT_PAGE,
                            at_least_what=f"one page ({format_bytes(DEFAULT_PAGE)})")
    plot = getattr(args, "plot", None)
    for flag, value in (("--json", args.json), ("--plot", plot)):
        if value:
            out_file_arg(value, flag)
    if plot:
        _plot_format(plot)
    snapshot_device = getattr(args, "snapshot_device", None)
    if snapshot_device is not None and snapshot_device < 0:
        raise UsageError(f"--snapshot-device {snapshot_device}: a device index is 0 or more")
    try:
        kind, items = load_input(args.path, snapshot_device=snapshot_device)
    except TraceError as exc:
        hint = "" if capacity is not None else " (see defrag replay --help)"
        raise UsageError(f"{exc}{hint}") from None
    if kind == "trace" and capacity is None:
        raise UsageError(f"--capacity is required for a defrag trace ({args.path} is not a snapshot, which "
                         "records its GPU); e.g. --capacity 80GiB (see defrag replay --help)")
    device, dry, dry_because = args.device, bool(args.dry), None
    if not dry:
        # A device that cannot work is the user's input, like a bad path; so is a capacity it cannot hold.
        device = device_label(device_arg(args.device))
        if device == "emulated":
            dry_because = emulation_limit(items, capacity)
            dry = dry_because is not None
    if not dry:
        for cap in sorted({capacity} if capacity is not None else
                          {snapshot_capacity(it.recorded, it.ooms, it.trace,
                                             pool_capacity=it.pool_capacity)[0] for it in items}):
            _check_real_pool(cap, device)
    t0 = time.perf_counter()
    first = items[0].trace if kind == "snapshot" else items[0][1]
    print(f"{kind} {first.name!r} ({args.path}): {len(items)} device{'s' if len(items) != 1 else ''} to replay"
          f"{', dry (memory-less device)' if dry else ''}")
    if dry_because:
        print(f"  dry without --dry: a real replay on the emulated device {dry_because}; the dry replay runs "
              f"the pool's own code over a memory-less device, with the same figures")
    try:
        reports = replay_devices(items, capacity, dry=dry, device=device, series=bool(plot),
                                 mesh=not getattr(args, "no_mesh", False))
    except ReplayError as exc:
        raise UsageError(str(exc)) from None
    for n, rep in enumerate(reports):
        st = rep.trace.stats()
        head = "" if rep.device is None else f"== device {rep.device}: "
        print(f"\n{head}{counted(st.events, 'event')}, {counted(st.allocs, 'allocation')}"
              + (f", {counted(st.phases, 'phase marker')}" if st.phases else "")
              + f", peak live {format_bytes(st.peak_live_bytes)}; capacity {format_bytes(rep.capacity)}"
              + ("" if rep.capacity_source == "--capacity" else f" ({rep.capacity_source})"))
        print(summary_sentence(rep))
        print(format_table(rep.results, rep.skipped, rep.recorded, recorded_missing=rep.device is not None,
                           recorded_label=rep.recorded_label, no_gpu_line=n == 0))
        if rep.device is not None:
            print(_recorded_line(rep))
        if rep.ooms:
            print("recorded OOMs (capacity = " + ("--capacity" if rep.capacity_source == "--capacity" else
                                                   f"{'PyTorch' if rep.recorded_by == 'PyTorch' else 'the pool'}'s "
                                                   "reserved + the device's free bytes at each") + "):")
            print("\n".join(_oom_lines(rep)))
        if rep.device is not None:
            m = rep.trace.meta
            print(f"snapshot: {counted(m['entries'], 'recorded action')}, {counted(m['initial_allocs'], 'block')} "
                  f"live before the first ({m['pre_trace_frees']} seen only as "
                  f"{'a free' if m['pre_trace_frees'] == 1 else 'frees'}: ring buffer truncation), "
                  f"{counted(m['skipped_entries'], 'entry', 'entries')} skipped, {counted(m['recorded_ooms'], 'OOM')} "
                  f"recorded")
    seconds = time.perf_counter() - t0
    print(f"\n{len(reports)} device{'s' if len(reports) != 1 else ''} replayed in {seconds:.1f} s")
    if plot:
        try:
            plot_devices(reports, plot)
        except OSError as exc:
            raise UsageError(f"cannot write --plot {plot}: {exc.strerror or exc}") from None
        print(f"wrote {plot}")
    if args.json:
        first_rep = reports[0]
        payload = {
            "trace": {"name": first.name, "path": str(args.path), "kind": kind, "stats": first.stats().as_dict(),
                      "meta": first.meta},
            "capacity": capacity if capacity is not None else first_rep.capacity, "dry": dry,
            "dry_because": dry_because, "device": args.device,
            "devices": [rep.as_dict() for rep in reports],
            # The first device's results, where readers of a single-device replay look for them.
            "results": [r.as_dict() for r in first_rep.results], "skipped": first_rep.skipped,
            "seconds": seconds,
        }
        try:
            Path(args.json).write_text(json.dumps(payload, indent=2, default=str) + "\n")
        except OSError as exc:  # checked up front; the folder can still go away during a long replay
            raise UsageError(f"cannot write --json {args.json}: {exc.strerror or exc}") from None
        print(f"wrote {args.json}")
    failed = [rep for rep in reports if (r := rep.result("defrag")) is not None and not r.completed]
    return 1 if failed else 0
