"""The defrag trace format: allocations, frees and phase markers, as JSON Lines.

A trace file is UTF-8 text (optionally gzip-compressed), one JSON object per
line. Line 1 is the header, every further line one event::

    {"format": "defrag-trace", "version": 1, "name": "llm-serving", "events": 3, "meta": {...}}
    {"op": "alloc", "id": 0, "size": 1048576}
    {"op": "phase", "name": "decode step 1"}
    {"op": "free", "id": 0}

- ``alloc``: a new block of ``size`` bytes (a positive integer) named ``id``
  (an integer; an id may be reused once its block has been freed);
- ``free``: the block ``id`` dies (it must be live);
- ``phase``: a named point between two steps of the workload (an epoch, a
  decode step, a model swap), where a replay may compact.

The header's ``events`` (optional for hand-written files) is the number of
event lines; a file with fewer is reported as truncated. ``meta`` is free-form
(generator parameters, importer counters). Blank lines are ignored. See
docs/traces.md.

In memory a :class:`Trace` keeps its events as a list of tuples
``("alloc", id, size)``, ``("free", id)``, ``("phase", name)``: compact, and
fast to iterate in a replay loop.
"""

from __future__ import annotations

import gzip
import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

ALLOC, FREE, PHASE = "alloc", "free", "phase"
FORMAT, VERSION = "defrag-trace", 1
ALIGNMENT = 512  # the pool rounds every block to this; peaks below use it too
_GZIP_MAGIC = b"\x1f\x8b"


class TraceError(ValueError):
    """A trace (or snapshot) is malformed, truncated, foreign or inconsistent.

    The message names what is wrong and where (``line``, 1-based, when the
    problem is in a file; ``path`` when one is known).
    """

    def __init__(self, message: str, *, line: int | None = None, path: str | os.PathLike | None = None):
        self.line = line
        self.path = str(path) if path is not None else None
        where = []
        if self.path is not None:
            where.append(self.path)
        if line is not None:
            where.append(f"line {line}")
        super().__init__(f"{': '.join(where)}: {message}" if where else message)


@dataclass
class TraceStats:
    """Figures of a trace that need no allocator (sizes rounded to 512 bytes, as the pool does)."""

    events: int
    allocs: int
    frees: int
    phases: int
    peak_live_bytes: int
    peak_live_blocks: int
    live_at_end_bytes: int
    largest_alloc: int
    total_alloc_bytes: int

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _round(size: int) -> int:
    return -(-size // ALIGNMENT) * ALIGNMENT


@dataclass
class Trace:
    """An allocation trace: a name, free-form ``meta`` and a list of event tuples.

    Guarantees nothing by construction; :meth:`validate` (run by :meth:`load`,
    by the generators and by the snapshot importer) checks that every free
    names a live id, no live id is allocated again, and every size is a
    positive integer.
    """

    events: list = field(default_factory=list)
    name: str = "trace"
    meta: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.events)

    # ------------------------------------------------------------------ building
    def alloc(self, id_: int, size: int) -> None:
        self.events.append((ALLOC, id_, size))

    def free(self, id_: int) -> None:
        self.events.append((FREE, id_))

    def phase(self, name: str) -> None:
        self.events.append((PHASE, name))

    # ------------------------------------------------------------------ checks
    def validate(self) -> "Trace":
        """Raise TraceError naming the first bad event (its index, and its line once saved)."""
        try:
            _check_events(self.events)
        except _EventError as exc:
            raise TraceError(f"event {exc.index} (line {exc.index + 2} once saved): {exc.message}") from None
        return self

    def stats(self) -> TraceStats:
        """Peak live bytes/blocks and counts, by walking the events once."""
        live: dict = {}
        cur = peak = peak_blocks = largest = total = 0
        allocs = frees = phases = 0
        for ev in self.events:
            op = ev[0]
            if op == ALLOC:
                size = _round(ev[2])
                live[ev[1]] = size
                cur += size
                allocs += 1
                total += ev[2]
                largest = max(largest, ev[2])
                if cur > peak:
                    peak = cur
                if len(live) > peak_blocks:
                    peak_blocks = len(live)
            elif op == FREE:
                cur -= live.pop(ev[1])
                frees += 1
            else:
                phases += 1
        return TraceStats(len(self.events), allocs, frees, phases, peak, peak_blocks, cur, largest, total)

    # ------------------------------------------------------------------ files
    def save(self, path: str | os.PathLike) -> Path:
        """Write the trace as JSON Lines (gzip-compressed when the name ends in .gz)."""
        path = Path(path)
        header = {"format": FORMAT, "version": VERSION, "name": self.name, "events": len(self.events),
                  "meta": self.meta}
        dumps = json.JSONEncoder(separators=(",", ":")).encode
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "wt", encoding="utf-8", newline="\n") as f:
            f.write(dumps(header) + "\n")
            lines = []
            for ev in self.events:
                op = ev[0]
                if op == ALLOC:
                    lines.append(f'{{"op":"alloc","id":{ev[1]},"size":{ev[2]}}}')
                elif op == FREE:
                    lines.append(f'{{"op":"free","id":{ev[1]}}}')
                else:
                    lines.append(f'{{"op":"phase","name":{dumps(ev[1])}}}')
                if len(lines) >= 8192:
                    f.write("\n".join(lines) + "\n")
                    lines.clear()
            if lines:
                f.write("\n".join(lines) + "\n")
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Trace":
        """Read and validate a trace file; TraceError (naming the line) for anything wrong."""
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as exc:
            raise TraceError(f"cannot read the file ({exc.strerror or exc})", path=path) from None
        return cls.from_bytes(raw, path=path)

    @classmethod
    def from_bytes(cls, raw: bytes, *, path: str | os.PathLike | None = None) -> "Trace":
        """Parse the bytes of a trace file (plain or gzip); see :meth:`load`."""
        if raw[:2] == _GZIP_MAGIC:
            try:
                raw = gzip.decompress(raw)
            except (EOFError, OSError, gzip.BadGzipFile) as exc:
                raise TraceError(f"truncated or corrupt gzip data ({exc})", path=path) from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise TraceError(f"not a defrag trace: not UTF-8 text (byte {exc.start} is {raw[exc.start]:#04x})",
                             path=path) from None
        return _parse(io.StringIO(text), complete=text.endswith("\n"), path=path)


def _parse(lines, *, complete: bool, path) -> Trace:
    """Parse header and events; `complete` says whether the text ended with a newline."""
    header = None
    events: list = []
    where: list[int] = []  # line number of each event
    numbered = list(enumerate(lines, start=1))
    last_line = numbered[-1][0] if numbered else 0
    for lineno, line in numbered:
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            if header is None:
                raise TraceError("not a defrag trace: the first line is not a JSON header "
                                 f'{{"format": "{FORMAT}", ...}}', line=lineno, path=path) from None
            if lineno == last_line and not complete:
                raise TraceError(f"truncated: the last line is incomplete ({exc.msg})", line=lineno,
                                 path=path) from None
            raise TraceError(f"malformed JSON ({exc.msg} at column {exc.colno})", line=lineno, path=path) from None
        if header is None:
            header = _check_header(obj, lineno, path)
            continue
        events.append(_event(obj, lineno, path))
        where.append(lineno)
    if header is None:
        raise TraceError("empty file: not a defrag trace", path=path)
    declared = header.get("events")
    if declared is not None and declared != len(events):
        if len(events) < declared:
            raise TraceError(f"truncated: the header declares {declared} events but the file has "
                             f"{len(events)}", path=path)
        raise TraceError(f"the header declares {declared} events but the file has {len(events)}", path=path)
    try:
        _check_events(events)
    except _EventError as exc:
        raise TraceError(exc.message, line=where[exc.index], path=path) from None
    name = header.get("name", "trace")
    meta = header.get("meta") or {}
    if not isinstance(meta, dict):
        raise TraceError(f'the header\'s "meta" must be an object, got {type(meta).__name__}', line=1, path=path)
    return Trace(events, name=str(name), meta=meta)


def _check_header(obj, lineno: int, path) -> dict:
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        found = obj.get("format") if isinstance(obj, dict) else type(obj).__name__
        raise TraceError(f'not a defrag trace: the header must have "format": "{FORMAT}" '
                         f"(found {found!r})", line=lineno, path=path)
    version = obj.get("version")
    if version != VERSION:
        raise TraceError(f"unsupported trace version {version!r} (this defrag reads version {VERSION})",
                         line=lineno, path=path)
    declared = obj.get("events")
    if declared is not None and (isinstance(declared, bool) or not isinstance(declared, int) or declared < 0):
        raise TraceError(f'the header\'s "events" must be a non-negative integer, got {declared!r}',
                         line=lineno, path=path)
    return obj


def _int_field(obj: dict, key: str, lineno: int, path) -> int:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(f'{obj.get("op")} needs an integer "{key}", got {value!r}', line=lineno, path=path)
    return value


def _event(obj, lineno: int, path) -> tuple:
    if not isinstance(obj, dict):
        raise TraceError(f"an event must be a JSON object, got {type(obj).__name__}", line=lineno, path=path)
    op = obj.get("op")
    if op == ALLOC:
        return (ALLOC, _int_field(obj, "id", lineno, path), _int_field(obj, "size", lineno, path))
    if op == FREE:
        return (FREE, _int_field(obj, "id", lineno, path))
    if op == PHASE:
        name = obj.get("name")
        if not isinstance(name, str):
            raise TraceError(f'phase needs a string "name", got {name!r}', line=lineno, path=path)
        return (PHASE, name)
    raise TraceError(f'unknown op {op!r} (expected "alloc", "free" or "phase")', line=lineno, path=path)


class _EventError(Exception):
    """Internal: event `index` breaks a rule; callers turn it into a TraceError naming the place."""

    def __init__(self, message: str, index: int):
        self.message, self.index = message, index


def _check_events(events) -> None:
    """The consistency rules of the format; raises _EventError for the first bad event."""
    live = set()
    for i, ev in enumerate(events):
        try:
            op = ev[0]
            if op == ALLOC:
                _, id_, size = ev
                if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
                    raise _EventError(f"alloc {id_!r}: size must be a positive integer, got {size!r}", i)
                if id_ in live:
                    raise _EventError(f"alloc of id {id_!r}, which is already live (double alloc)", i)
                live.add(id_)
            elif op == FREE:
                id_ = ev[1]
                if id_ not in live:
                    raise _EventError(f"free of id {id_!r}, which is not live (unknown id or double free)", i)
                live.remove(id_)
            elif op == PHASE:
                if not isinstance(ev[1], str):
                    raise _EventError(f"phase name must be a string, got {ev[1]!r}", i)
            else:
                raise _EventError(f"unknown op {op!r}", i)
        except (TypeError, ValueError, IndexError) as exc:  # a malformed tuple
            raise _EventError(f"malformed event {ev!r} ({exc})", i) from None
