"""Import PyTorch memory snapshots (``torch.cuda.memory._dump_snapshot`` pickles) as traces.

A snapshot (see ``torch.cuda.memory._snapshot``) is a dict with

- ``segments``: the caching allocator's state *when the snapshot was taken*
  (the end of the recorded history): per segment ``device``, ``address``,
  ``total_size`` and ``blocks`` (``address``, ``size``, ``requested_size``,
  ``state`` in ``active_allocated`` / ``active_pending_free`` / ``inactive``);
- ``device_traces``: per device, the last ``max_entries`` allocator actions
  (a ring buffer): ``alloc``, ``free_requested``, ``free_completed``,
  ``segment_alloc``, ``segment_free``, ``segment_map``, ``segment_unmap``,
  ``snapshot``, ``oom``, each with ``addr`` and ``size``.

Reconstruction (the rule PyTorch's own MemoryViz uses). The recorded actions
are replayed per address: ``alloc`` starts a block, ``free_completed`` (or
the legacy ``free``) ends it; ``free_requested`` alone does not release
memory (the allocator holds a block until its free completes), so a block
whose free never completed stays live to the end. Two kinds of blocks were
live *before* the first recorded action and become allocations at the start
of the trace:

- a ``free_completed`` of an address with no recorded ``alloc``: its alloc
  fell off the ring buffer (counted in ``meta["pre_trace_frees"]``);
- an ``active_allocated`` (or pending-free) block in ``segments`` that the
  recorded history does not allocate (``meta["initial_from_segments"]``).

What PyTorch really did is kept beside the trace (:func:`load_snapshot_devices`,
one `SnapshotDevice` per device with recorded actions): its reserved bytes
over the trace from the ``segment_*`` entries (`RecordedReserved`, levelled
by the ``segments`` list at the end, so a truncated ring buffer still gives
the right level), and each ``oom`` entry with the live, reserved and free
bytes when it happened (`RecordedOOM`). It does not model what PyTorch did
not record: memory outside the caching allocator, a
``set_per_process_memory_fraction`` cap, or segments whose entries fell off
the ring buffer (they are only in the start level).

Missing keys are tolerated: entries without the fields they need are skipped
and counted (``meta["skipped_entries"]``); a snapshot without
``device_traces`` yields its end state as allocations; a bare list is read
as a list of segments, as ``torch.cuda._memory_viz`` does. Sizes are the
requested sizes the allocator records (``requested_size`` for blocks).

Security: pickles can run code when loaded. The loader refuses any pickle
that references a class or function (a real snapshot holds only dicts,
lists, strings and numbers) and names what it referenced.
"""

from __future__ import annotations

import bisect
import io
import os
import pickle
from dataclasses import dataclass
from pathlib import Path

from .format import Trace, TraceError

SERIES_POINTS = 2000  # points per curve of bytes over time (each the most in its stretch)


def peaks_per_stretch(values, points: int = SERIES_POINTS) -> tuple[list[int], list[int]]:
    """(first position, most) of each stretch of `values`: at most `points` stretches of one length (the
    last may be shorter), so a curve of any length is drawn in `points` points and loses no peak."""
    import numpy as np

    a = np.asarray(values, dtype=np.int64)
    if a.size == 0:
        return [], []
    width = max(1, -(-a.size // points))
    pad = -a.size % width
    padded = np.concatenate([a, np.full(pad, a[-1], dtype=np.int64)]) if pad else a
    return list(range(0, a.size, width)), padded.reshape(-1, width).max(axis=1).tolist()

_SAFE_GLOBALS = {("builtins", "set"), ("builtins", "frozenset"), ("collections", "OrderedDict")}
_LIVE_STATES = ("active_allocated", "active_pending_free", "active_awaiting_free")


class _SnapshotUnpickler(pickle.Unpickler):
    """Unpickles plain data only: any class or function reference is refused."""

    def find_class(self, module: str, name: str):
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        raise TraceError(f"not a PyTorch memory snapshot: the pickle references {module}.{name} "
                         "(a snapshot holds only plain data; refusing to load it)")


def read_pickle(raw: bytes, *, path=None):
    """Plain data from pickle bytes; TraceError for truncated, corrupt or foreign pickles."""
    try:
        return _SnapshotUnpickler(io.BytesIO(raw)).load()
    except TraceError as exc:
        raise TraceError(str(exc), path=path) from None
    except EOFError:
        raise TraceError("truncated pickle: the data ends before the snapshot is complete", path=path) from None
    except (pickle.UnpicklingError, ValueError, TypeError, IndexError, KeyError, AttributeError,
            MemoryError, OverflowError, UnicodeDecodeError) as exc:
        text = str(exc)
        if "truncated" in text or "ran out of input" in text.lower():
            raise TraceError(f"truncated pickle ({text})", path=path) from None
        raise TraceError(f"corrupt pickle ({type(exc).__name__}: {text})", path=path) from None


def load_snapshot(source, *, device: int | None = None, name: str | None = None) -> Trace:
    """A Trace from a snapshot: a path to a ``_dump_snapshot`` pickle, its bytes, or the dict.

    ``device``: which GPU's history to import (default: the one with the most
    recorded actions, else the one holding the most live memory). Raises
    TraceError naming the problem for truncated, corrupt or foreign input.
    What PyTorch really reserved and the OOMs it recorded are in
    :func:`load_snapshot_devices`.
    """
    return load_snapshot_devices(source, device=device, name=name, every=False)[0].trace


@dataclass
class RecordedReserved:
    """What PyTorch really reserved on one device, from the trace's segment entries.

    ``event`` and ``reserved`` are parallel lists: from trace event
    ``event[i]`` on (an index into the imported trace's events), PyTorch had
    ``reserved[i]`` bytes reserved; the first point is the start of the trace,
    and ``event`` never decreases (several changes between two events are
    several points at one index: the last holds).
    ``segment_alloc`` / ``segment_map`` add their size, ``segment_free`` /
    ``segment_unmap`` take it away. The level at the start is the reserved
    bytes at the end (the ``segments`` list, when the snapshot has it) less
    the recorded changes; without ``segments`` it is the least level that
    never goes negative (``end_from_segments`` False). Does not see segments
    whose entries fell off the ring buffer except through that start level.
    """

    start_bytes: int
    peak_bytes: int
    end_bytes: int
    event: list
    reserved: list
    end_from_segments: bool

    def at(self, event: int) -> int:
        """Reserved bytes while trace event `event` runs (after every change recorded before it)."""
        i = bisect.bisect_right(self.event, event) - 1
        return self.reserved[max(i, 0)]

    def as_dict(self, points: int = SERIES_POINTS) -> dict:
        """The figures, and the curve as ``{"event": [...], "bytes": [...]}`` with at most `points` points
        (each the most in its stretch of points, so the peak stays)."""
        starts, level = peaks_per_stretch(self.reserved, points)
        event = [self.event[i] for i in starts]
        return {"start_reserved_bytes": self.start_bytes, "peak_reserved_bytes": self.peak_bytes,
                "end_reserved_bytes": self.end_bytes, "end_from_segments": self.end_from_segments,
                "changes": len(self.event) - 1, "reserved_over_time": {"event": event, "bytes": level}}


@dataclass
class RecordedOOM:
    """An ``oom`` entry of the trace: a request PyTorch refused.

    ``event``: the index in the imported trace where the request was made
    (the refused allocation is not in the trace; it would go before that
    event). ``size``: the request as recorded (PyTorch records it rounded to
    512 B). ``live_bytes``: bytes in live blocks then, as the importer
    reconstructs them (requested sizes). ``reserved_bytes``: PyTorch's
    reserved bytes then (after the cache was emptied on the OOM path), None
    when the trace has no segment entries. ``device_free``: the device's
    free memory PyTorch recorded (``cudaMemGetInfo``), None if absent.
    """

    event: int
    size: int
    live_bytes: int
    reserved_bytes: int | None
    device_free: int | None

    @property
    def capacity(self) -> int | None:
        """What this process could have held on the GPU then: reserved + free (None if either is unknown)."""
        if self.reserved_bytes is None or self.device_free is None:
            return None
        return self.reserved_bytes + self.device_free

    @property
    def verdict(self) -> str:
        """"fragmentation" when live + request fit in `capacity`, else "not fragmentation"; "unknown"
        when the capacity is not known."""
        cap = self.capacity
        if cap is None:
            return "unknown"
        return "fragmentation" if self.live_bytes + self.size <= cap else "not fragmentation"


@dataclass
class SnapshotDevice:
    """One device's history in a snapshot: the trace, what PyTorch reserved, the OOMs it recorded."""

    device: int
    trace: Trace
    recorded: RecordedReserved | None  # None: the trace has no segment entries
    ooms: list
    # The capacity of the defrag pool(s) that recorded this device (`defrag run --record`,
    # `pool.snapshot()`): the device's limit, as the GPU's memory is PyTorch's. None for PyTorch's own.
    pool_capacity: int | None = None
    # Who recorded it: "PyTorch" (its own allocator), "defrag pool" (`pool.snapshot()`) or "defrag run"
    # (`defrag run --record`, whose pool was PyTorch's allocator); `rescue`: whether that run had --rescue
    # (None: not a defrag run's, or not known).
    recorded_by: str = "PyTorch"
    rescue: bool | None = None


def load_snapshot_devices(source, *, device: int | None = None, name: str | None = None,
                          every: bool = True) -> list[SnapshotDevice]:
    """Every device of a snapshot with recorded actions, low index first (or only ``device``).

    A snapshot whose traces are all empty yields the one device
    :func:`load_snapshot` picks (its end state). ``every=False``: only the
    device :func:`load_snapshot` would pick. Raises TraceError as
    :func:`load_snapshot` does; a device with nothing to replay is left out
    when others have something, an error when it is the one asked for.
    """
    path = None
    if isinstance(source, (str, os.PathLike)):
        path = source
        try:
            raw = Path(source).read_bytes()
        except OSError as exc:
            raise TraceError(f"cannot read the file ({exc.strerror or exc})", path=path) from None
        data = read_pickle(raw, path=path)
        name = name or Path(source).name
    elif isinstance(source, (bytes, bytearray)):
        data = read_pickle(bytes(source))
    else:
        data = source
    try:
        parsed = _Parsed(data)
        if device is not None or not every:
            devices = [parsed.pick(device)]
        else:
            devices = parsed.devices_with_entries() or [parsed.pick(None)]
        out = []
        for d in devices:
            try:
                out.append(parsed.device(d, name or "snapshot"))
            except TraceError:
                if len(devices) == 1:
                    raise
        return out
    except TraceError as exc:
        if path is not None and exc.path is None:
            raise TraceError(str(exc), path=path) from None
        raise


def _describe(obj) -> str:
    if isinstance(obj, dict):
        keys = ", ".join(repr(k) for k in list(obj)[:6])
        return f"a dict with keys {keys}{', ...' if len(obj) > 6 else ''}" if obj else "an empty dict"
    return f"a {type(obj).__name__}"


def _as_int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


_RESERVE = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}


class _Parsed:
    """A snapshot dict, checked, with its end state per device."""

    def __init__(self, data):
        if isinstance(data, list):  # segments only (old snapshots; _memory_viz reads them so)
            data = {"segments": data}
        if not isinstance(data, dict) or not ({"segments", "device_traces"} & set(data)):
            raise TraceError(f"not a PyTorch memory snapshot: expected a dict with 'segments' and "
                             f"'device_traces' (torch.cuda.memory._snapshot()), got {_describe(data)}")
        segments = data.get("segments") or []
        traces = data.get("device_traces") or []
        if not isinstance(segments, list) or not isinstance(traces, list):
            raise TraceError("not a PyTorch memory snapshot: 'segments' and 'device_traces' must be lists, got "
                             f"{type(segments).__name__} and {type(traces).__name__}")
        self.has_segments = "segments" in data
        self.traces = traces
        # Snapshots a defrag pool wrote carry each pool's capacity: per device, their sum.
        self.pool_capacity: dict[int, int] = {}
        extra = data.get("defrag")
        # `defrag run --record` marks its histories (defrag.run._write_snapshot); other defrag snapshots are
        # a pool's (`pool.snapshot()`).
        run = extra.get("run") if isinstance(extra, dict) else None
        self.recorded_by = "defrag run" if isinstance(run, dict) else "defrag pool" if isinstance(extra, dict) else "PyTorch"
        self.rescue = run.get("rescue") if isinstance(run, dict) and isinstance(run.get("rescue"), bool) else None
        for pool in (extra.get("pools") if isinstance(extra, dict) else None) or []:
            cap = _as_int(pool.get("capacity")) if isinstance(pool, dict) else None
            if cap:
                dev = _as_int(pool.get("device_index")) or 0
                self.pool_capacity[dev] = self.pool_capacity.get(dev, 0) + cap
        self.skipped = 0
        # Blocks live at the end, per device: address -> requested size; reserved bytes at the end.
        self.end_blocks: dict[int, dict[int, int]] = {}
        self.end_reserved: dict[int, int] = {}
        for seg in segments:
            if not isinstance(seg, dict):
                self.skipped += 1
                continue
            dev = _as_int(seg.get("device"))
            dev = 0 if dev is None else dev
            self.end_reserved[dev] = self.end_reserved.get(dev, 0) + (_as_int(seg.get("total_size")) or 0)
            cursor = _as_int(seg.get("address"))
            for block in seg.get("blocks") or []:
                if not isinstance(block, dict):
                    self.skipped += 1
                    continue
                size = _as_int(block.get("size"))
                addr = _as_int(block.get("address"))
                if addr is None:
                    addr = cursor  # older snapshots: blocks are contiguous from the segment's address
                cursor = addr + size if addr is not None and size is not None else None
                if block.get("state") not in _LIVE_STATES:
                    continue
                requested = _as_int(block.get("requested_size")) or size
                if addr is None or not requested or requested <= 0:
                    self.skipped += 1
                    continue
                self.end_blocks.setdefault(dev, {})[addr] = requested

    def devices_with_entries(self) -> list[int]:
        return [d for d, t in enumerate(self.traces) if isinstance(t, list) and t]

    def pick(self, device: int | None) -> int:
        traces, end_blocks = self.traces, self.end_blocks
        if device is None:
            counts = [len(t) if isinstance(t, list) else 0 for t in traces]
            if counts and max(counts) > 0:
                return counts.index(max(counts))
            if end_blocks:
                return max(end_blocks, key=lambda d: sum(end_blocks[d].values()))
            return 0
        if device >= len(traces) and device not in end_blocks and (traces or end_blocks):
            raise TraceError(f"the snapshot has no device {device} (it records devices "
                             f"{sorted(set(range(len(traces))) | set(end_blocks))})")
        return device

    def device(self, device: int, name: str) -> SnapshotDevice:
        traces = self.traces
        entries = traces[device] if 0 <= device < len(traces) and isinstance(traces[device], list) else []
        skipped = self.skipped
        initial: list[tuple[int, int, int]] = []  # (addr, size, id) live before the first recorded action
        body: list[tuple] = []
        live: dict[int, tuple[int, int]] = {}  # addr -> (id, size)
        next_id = 0
        counters = {"pre_trace_frees": 0, "implicit_frees": 0, "recorded_ooms": 0, "free_requested": 0,
                    "segment_actions": 0, "snapshot_markers": 0}
        pending_free: set[int] = set()
        changes: list[tuple[int, int]] = []  # (body position, reserved delta)
        ooms: list[tuple[int, int, int | None]] = []  # (body position, size, device free)
        for entry in entries:
            if not isinstance(entry, dict):
                skipped += 1
                continue
            action = entry.get("action")
            addr = _as_int(entry.get("addr"))
            size = _as_int(entry.get("size"))
            if action == "alloc":
                if addr is None or size is None or size <= 0:
                    skipped += 1
                    continue
                if addr in live:  # a free we never saw: end the old block first
                    body.append(("free", live.pop(addr)[0]))
                    counters["implicit_frees"] += 1
                live[addr] = (next_id, size)
                body.append(("alloc", next_id, size))
                next_id += 1
            elif action in ("free_completed", "free"):
                if addr is None:
                    skipped += 1
                    continue
                pending_free.discard(addr)
                if addr in live:
                    body.append(("free", live.pop(addr)[0]))
                elif size is not None and size > 0:
                    # Allocated before the ring buffer's first entry: live from the start.
                    initial.append((addr, size, next_id))
                    body.append(("free", next_id))
                    next_id += 1
                    counters["pre_trace_frees"] += 1
                else:
                    skipped += 1
            elif action == "free_requested":
                counters["free_requested"] += 1
                if addr is not None:
                    pending_free.add(addr)
            elif action == "oom":
                counters["recorded_ooms"] += 1
                # PyTorch writes the device's free memory in place of an address for this action.
                free = _as_int(entry.get("device_free"))
                if size is not None and size > 0:
                    ooms.append((len(body), size, addr if free is None else free))
                else:
                    skipped += 1
            elif action == "snapshot":
                counters["snapshot_markers"] += 1
            elif action in _RESERVE:
                counters["segment_actions"] += 1
                if size is not None and size > 0:
                    changes.append((len(body), _RESERVE[action] * size))
                else:
                    skipped += 1
            elif isinstance(action, str) and action.startswith("segment_"):
                counters["segment_actions"] += 1
            else:
                skipped += 1

        from_segments = 0
        for addr, size in sorted(self.end_blocks.get(device, {}).items()):
            if addr not in live:
                initial.append((addr, size, next_id))
                live[addr] = (next_id, size)
                next_id += 1
                from_segments += 1

        trace = Trace(name=name)
        for _, size, id_ in sorted(initial):
            trace.alloc(id_, size)
        trace.events.extend(body)
        n0 = len(initial)
        recorded = self._recorded(device, changes, n0)
        trace.meta = {
            "source": "torch.cuda.memory._snapshot", "device": device, "entries": len(entries),
            "initial_allocs": n0, "initial_bytes": sum(s for _, s, _ in initial),
            "initial_from_segments": from_segments, "frees_never_completed": len(pending_free & set(live)),
            "skipped_entries": skipped,
            "reserved_bytes_at_snapshot": self.end_reserved.get(device, 0),
            **counters,
        }
        if not trace.events:
            raise TraceError("the snapshot holds no allocations to replay: no recorded alloc/free actions and no "
                             "live blocks in 'segments' (was _record_memory_history enabled?)")
        trace.validate()
        cap = self.pool_capacity.get(device)
        return SnapshotDevice(device, trace, recorded, self._ooms(trace, ooms, n0, recorded, cap), cap,
                              self.recorded_by if cap is not None else "PyTorch", self.rescue)

    def _recorded(self, device: int, changes: list, n0: int) -> RecordedReserved | None:
        if not changes:
            return None
        level, lowest, points = 0, 0, []
        for pos, delta in changes:
            level += delta
            lowest = min(lowest, level)
            points.append((n0 + pos, level))
        from_segments = self.has_segments
        start = self.end_reserved.get(device, 0) - level if from_segments else -lowest
        if start + lowest < 0:  # the end state and the history disagree: never below nothing
            start, from_segments = -lowest, False
        # Several changes before one event keep a point each: the peak between them counts (PyTorch's
        # reserved_bytes peak sees it), and `at` reads the last.
        event = [0] + [ev for ev, _ in points]
        reserved = [start] + [start + lv for _, lv in points]
        return RecordedReserved(start, max(reserved), reserved[-1], event, reserved, from_segments)

    @staticmethod
    def _ooms(trace: Trace, ooms: list, n0: int, recorded: RecordedReserved | None,
              pool_capacity: int | None = None) -> list[RecordedOOM]:
        """The recorded OOMs. For a defrag pool's snapshot, free is at most its capacity minus its reserved
        bytes: older defrag versions recorded capacity minus live bytes, which counted the space stranded
        inside mapped pages as the device's free memory."""
        if not ooms:
            return []
        live_at = live_bytes_at(trace, [n0 + pos for pos, _, _ in ooms])
        out = []
        for (pos, size, free), live in zip(ooms, live_at):
            reserved = None if recorded is None else recorded.at(n0 + pos)
            if pool_capacity is not None and reserved is not None and free is not None:
                free = max(min(free, pool_capacity - reserved), 0)
            out.append(RecordedOOM(n0 + pos, size, live, reserved, free))
        return out


def live_bytes_at(trace: Trace, events: list[int]) -> list[int]:
    """Bytes in live blocks (sizes as recorded) just before each of `events` (ascending indices) runs."""
    out, live, cur, i = [], {}, 0, 0
    for target in events:
        while i < target and i < len(trace.events):
            ev = trace.events[i]
            if ev[0] == "alloc":
                live[ev[1]] = ev[2]
                cur += ev[2]
            elif ev[0] == "free":
                cur -= live.pop(ev[1])
            i += 1
        out.append(cur)
    return out


def to_snapshot(trace: Trace, *, max_entries: int | None = None, device: int = 0,
                base_address: int = 0x7F0000000000) -> dict:
    """The trace as a ``torch.cuda.memory._snapshot()``-shaped dict (for memory_viz, and for tests).

    Each alloc gets an address (a freed address of the same rounded size is
    reused first, as a caching allocator would; otherwise a new one past all
    earlier ones) and becomes ``alloc``; each free becomes ``free_requested``
    then ``free_completed``; phase markers become nothing. ``segments`` holds
    the blocks live at the end, one segment each. With ``max_entries`` only
    the last entries are kept, as the allocator's ring buffer does, so
    :func:`load_snapshot` has to reconstruct what was live before them.
    Sizes are rounded to 512 bytes for addresses and blocks, and kept as
    requested in the entries.
    """
    entries: list[dict] = []
    free_by_size: dict[int, list[int]] = {}
    live: dict = {}  # id -> (addr, size)
    next_addr = base_address
    for ev in trace.events:
        if ev[0] == "alloc":
            size = ev[2]
            rounded = -(-size // 512) * 512
            pool = free_by_size.get(rounded)
            if pool:
                addr = pool.pop()
            else:
                addr, next_addr = next_addr, next_addr + rounded
            live[ev[1]] = (addr, size)
            entries.append({"action": "alloc", "addr": addr, "size": size, "stream": 0, "frames": []})
        elif ev[0] == "free":
            addr, size = live.pop(ev[1])
            for action in ("free_requested", "free_completed"):
                entries.append({"action": action, "addr": addr, "size": size, "stream": 0, "frames": []})
            free_by_size.setdefault(-(-size // 512) * 512, []).append(addr)
    if max_entries is not None:
        entries = entries[-max_entries:] if max_entries > 0 else []
    segments = []
    for addr, size in sorted(live.values()):
        rounded = -(-size // 512) * 512
        segments.append({"device": device, "address": addr, "total_size": rounded, "stream": 0,
                         "segment_type": "large" if rounded > (1 << 20) else "small", "segment_pool_id": (0, 0),
                         "allocated_size": rounded, "active_size": rounded, "requested_size": size,
                         "blocks": [{"address": addr, "size": rounded, "requested_size": size,
                                     "state": "active_allocated", "frames": []}]})
    traces: list[list] = [[] for _ in range(device + 1)]
    traces[device] = entries
    return {"segments": segments, "device_traces": traces, "allocator_settings": {}}
