"""Trace format, generators, the storage-lifetime recorder and the snapshot importer."""

from __future__ import annotations

import collections
import gzip
import pickle

import pytest
import torch

from defrag.traces import (ALLOC, FREE, PHASE, Trace, TraceError, TraceRecorder, checkerboard, llm_serving,
                           load_snapshot, model_swap, training_from_model)
from defrag.traces.snapshot import to_snapshot

MiB = 1 << 20


@pytest.fixture(scope="module")
def small_training():
    return training_from_model(steps=3, max_len=128, num_layers=2)


def _live_curve(trace: Trace) -> list[int]:
    """Live bytes (unrounded) after every event."""
    live, cur, out = {}, 0, []
    for ev in trace.events:
        if ev[0] == ALLOC:
            live[ev[1]] = ev[2]
            cur += ev[2]
        elif ev[0] == FREE:
            cur -= live.pop(ev[1])
        out.append(cur)
    return out


# ---------------------------------------------------------------------- format
@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_save_load_round_trip(tmp_path, suffix):
    trace = Trace([(ALLOC, 0, 4096), (PHASE, 'step "1"'), (ALLOC, 7, 3 * MiB), (FREE, 0), (ALLOC, 0, 1),
                   (FREE, 7)], name="unit", meta={"seed": 3, "nested": {"a": [1, 2]}})
    path = trace.save(tmp_path / f"t{suffix}")
    if suffix.endswith(".gz"):
        assert path.read_bytes()[:2] == b"\x1f\x8b"
    back = Trace.load(path)
    assert back.events == trace.events
    assert back.name == "unit" and back.meta == trace.meta
    # The saved header counts the events (the loader uses it to detect truncation).
    first = (gzip.open(path, "rt") if suffix.endswith(".gz") else open(path)).readline()
    assert '"events":6' in first


def _write(tmp_path, lines, *, newline_at_end=True):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + ("\n" if newline_at_end else ""))
    return path


HEADER = '{"format": "defrag-trace", "version": 1, "name": "x"}'


@pytest.mark.parametrize("lines,line,fragment", [
    ([HEADER, '{"op": "alloc", "id": 1, "size": 10}', '{"op": "free", "id": 2}'], 3, "free of id 2"),
    ([HEADER, '{"op": "alloc", "id": 1, "size": 10}', '{"op": "alloc", "id": 1, "size": 5}'], 3, "double alloc"),
    ([HEADER, '{"op": "alloc", "id": 1, "size": -4}'], 2, "positive integer"),
    ([HEADER, '{"op": "alloc", "id": 1, "size": 0}'], 2, "positive integer"),
    ([HEADER, '{"op": "alloc", "id": 1}'], 2, 'integer "size"'),
    ([HEADER, '{"op": "alloc", "id": 1, "size": 1.5}'], 2, 'integer "size"'),
    ([HEADER, '{"op": "resize", "id": 1}'], 2, "unknown op"),
    ([HEADER, '{"op": "phase"}'], 2, 'string "name"'),
    ([HEADER, '{"op": "alloc", "id": 1, "size": 10}', '{"op": "free", "id": 1', '{"op": "phase", "name": "a"}'],
     3, "malformed JSON"),
    ([HEADER, '[1, 2]'], 2, "JSON object"),
    (['{"format": "something-else", "version": 1}'], 1, "not a defrag trace"),
    (['{"version": 1}'], 1, "not a defrag trace"),
    (['{"format": "defrag-trace", "version": 7}'], 1, "unsupported trace version 7"),
    (["hello world"], 1, "not a defrag trace"),
])
def test_load_errors_name_the_line(tmp_path, lines, line, fragment):
    path = _write(tmp_path, lines)
    with pytest.raises(TraceError) as info:
        Trace.load(path)
    assert info.value.line == line
    assert f"line {line}" in str(info.value) and fragment in str(info.value)
    assert str(path) in str(info.value)


def test_truncated_files_say_truncated(tmp_path):
    trace = Trace([(ALLOC, i, 512) for i in range(10)], name="cut")
    full = trace.save(tmp_path / "full.jsonl").read_bytes()
    # Cut inside the last line: the incomplete line is named.
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(full[:-7])
    with pytest.raises(TraceError, match=r"line 11: truncated: the last line is incomplete"):
        Trace.load(cut)
    # Cut at a line boundary: the header's event count catches it.
    lines = full.split(b"\n")
    cut.write_bytes(b"\n".join(lines[:6]) + b"\n")
    with pytest.raises(TraceError, match=r"truncated: the header declares 10 events but the file has 5"):
        Trace.load(cut)
    # A gzip stream cut short.
    gz = tmp_path / "cut.jsonl.gz"
    gz.write_bytes(gzip.compress(full)[:-20])
    with pytest.raises(TraceError, match="truncated or corrupt gzip"):
        Trace.load(gz)
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    with pytest.raises(TraceError, match="empty file"):
        Trace.load(empty)


def test_validate_names_the_event():
    bad = Trace([(ALLOC, 1, 100), (FREE, 1), (FREE, 1)])
    with pytest.raises(TraceError, match=r"event 2 \(line 4 once saved\): free of id 1"):
        bad.validate()
    with pytest.raises(TraceError, match="event 0.*malformed event"):
        Trace([(ALLOC, 1)]).validate()


def test_stats_rounds_like_the_pool():
    st = Trace([(ALLOC, 1, 1), (ALLOC, 2, 513), (FREE, 1), (PHASE, "p"), (ALLOC, 3, 100)]).stats()
    assert (st.allocs, st.frees, st.phases) == (3, 1, 1)
    assert st.peak_live_bytes == 512 + 1024 and st.live_at_end_bytes == 1024 + 512
    assert st.largest_alloc == 513 and st.peak_live_blocks == 2


# ---------------------------------------------------------------------- generators
def _frees_order_differs_from_allocs(trace: Trace) -> bool:
    order = [ev[1] for ev in trace.events if ev[0] == ALLOC]
    freed = [ev[1] for ev in trace.events if ev[0] == FREE]
    rank = {id_: i for i, id_ in enumerate(order)}
    ranks = [rank[i] for i in freed]
    return ranks != sorted(ranks)


@pytest.mark.parametrize("make", [
    lambda seed: llm_serving(seed=seed, steps=300),
    lambda seed: model_swap(seed=seed, swaps=3, requests_per_model=10),
    lambda seed: checkerboard(seed=seed, total_bytes=16 * MiB, rounds=2),
], ids=["llm_serving", "model_swap", "checkerboard"])
def test_generators_are_valid_and_deterministic(make):
    a, b, c = make(0), make(0), make(1)
    a.validate()
    assert a.events == b.events and a.meta == b.meta
    assert a.events != c.events
    st = a.stats()
    assert 0 < st.peak_live_bytes <= 512 * MiB
    assert st.phases > 0 and st.frees > 0
    assert a.meta["seed"] == 0


def test_llm_serving_finishes_out_of_order_and_grows_caches():
    trace = llm_serving(steps=600)
    m = trace.meta
    assert m["out_of_order_finishes"] > 10 and m["kv_grows"] > 10
    assert m["requests_finished"] > 20
    assert _frees_order_differs_from_allocs(trace)
    phases = [ev[1] for ev in trace.events if ev[0] == PHASE]
    assert phases[0] == "weights loaded" and "decode step 8" in phases
    # Weights stay live to the end: the first 8 allocations are never freed.
    freed = {ev[1] for ev in trace.events if ev[0] == FREE}
    assert not freed & set(range(8))
    # KV caches of one request are chunked: sizes are multiples of chunk x bytes per token.
    chunk = m["kv_chunk_tokens"] * m["kv_bytes_per_token"]
    assert sum(1 for ev in trace.events if ev[0] == ALLOC and ev[2] % chunk == 0) > m["requests_admitted"]


def test_model_swap_loads_unloads_and_evicts_adapters():
    trace = model_swap(swaps=4, requests_per_model=16, adapters=6)
    phases = [ev[1] for ev in trace.events if ev[0] == PHASE]
    kinds = collections.Counter(p.split()[0] for p in phases)
    assert kinds == {"load": 4, "serve": 4, "unload": 4}
    assert trace.meta["adapter_evictions"] > 0 and trace.meta["adapter_loads"] > trace.meta["adapter_evictions"]
    assert _frees_order_differs_from_allocs(trace)
    # Everything is freed by the end.
    assert trace.stats().live_at_end_bytes == 0


def test_checkerboard_strands_half_of_every_page():
    page = 2 * MiB
    trace = checkerboard(total_bytes=32 * MiB, page_size=page, rounds=2)
    curve = _live_curve(trace)
    marks = {ev[1]: i for i, ev in enumerate(trace.events) if ev[0] == PHASE}
    for r in range(2):
        filled = curve[marks[f"punch {r}"] - 1]
        punched = curve[marks[f"large {r}"] - 1]
        assert 31 * MiB < filled <= 32 * MiB
        assert punched == pytest.approx(filled / 2, rel=0.01)
    larges = [ev[2] for ev in trace.events if ev[0] == ALLOC and ev[2] >= page]
    assert larges and all(size == 4 * page for size in larges)
    assert trace.stats().live_at_end_bytes == 0


# ---------------------------------------------------------------------- recorder
def test_recorder_orders_frees_before_later_allocs_and_ignores_views():
    with TraceRecorder() as rec:
        a = torch.empty(100, device="meta")
        b = a + 1
        v = b.view(10, 10)  # a view: no new storage
        b.mul_(2)  # in place: no new storage
        del a
        c = b * 2
        rec.phase("mid")
        del b, v
        d = c.sum()
    trace = rec.trace()
    assert trace.events == [(ALLOC, 0, 400), (ALLOC, 1, 400), (FREE, 0), (ALLOC, 2, 400), (PHASE, "mid"),
                            (FREE, 1), (ALLOC, 3, 4)]
    del c, d


def test_training_recorder_sees_a_real_transformer(small_training):
    trace = small_training
    st = trace.stats()
    assert st.allocs > 300 and st.frees > 200
    phases = [ev[1] for ev in trace.events if ev[0] == PHASE]
    assert phases[:3] == ["step 1", "backward 1", "optimizer 1"] and len(phases) == 9
    sizes = collections.Counter(ev[2] for ev in trace.events if ev[0] == ALLOC)
    d = 256
    # Parameters (built inside the recorder): each layer's in_proj weight is 3d x d fp32 ...
    assert sizes[3 * d * d * 4] >= 2
    # ... and Adam keeps two moments per parameter, allocated in the first optimizer step.
    first_opt = trace.events.index((PHASE, "optimizer 1"))
    after = collections.Counter(ev[2] for ev in trace.events[first_opt:] if ev[0] == ALLOC)
    assert after[3 * d * d * 4] >= 2 * 2
    # Variable sequence lengths: activations of different sizes in different steps.
    lengths = trace.meta["sequence_lengths"]
    assert len(set(lengths)) > 1
    for length in set(lengths):
        assert sizes[8 * length * d * 4] > 0  # a (batch, length, d_model) fp32 activation
    # Gradients die at zero_grad(set_to_none=True): live memory returns near the parameters + state.
    assert st.live_at_end_bytes < st.peak_live_bytes / 2


# ---------------------------------------------------------------------- snapshots
def _entry(action, addr, size, **extra):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": [], **extra}


def _segment(address, blocks, device=0):
    total = sum(b["size"] for b in blocks)
    return {"device": device, "address": address, "total_size": total, "stream": 0, "segment_type": "large",
            "segment_pool_id": (0, 0), "allocated_size": total, "active_size": total, "blocks": blocks}


def _block(address, size, state="active_allocated", requested=None):
    return {"address": address, "size": size, "requested_size": requested or size, "state": state, "frames": []}


def test_snapshot_import_reconstructs_the_start():
    snap = {
        "segments": [
            _segment(0x1000, [_block(0x1000, 1024), _block(0x1400, 512, "inactive"), _block(0x1600, 2048)]),
            _segment(0x9000, [_block(0x9000, 4096, requested=4000)], device=1),
        ],
        "device_traces": [[
            _entry("segment_alloc", 0x1000, 3584),
            _entry("alloc", 0x1600, 2048),  # still live at the end (in segments)
            _entry("free_completed", 0x5000, 700),  # its alloc fell off the ring buffer
            _entry("alloc", 0x1400, 512),
            _entry("free_requested", 0x1400, 512),
            _entry("free_completed", 0x1400, 512),
            _entry("alloc", 0x1400, 300),  # address reuse
            _entry("free_requested", 0x1400, 300),  # never completes: stays live
            _entry("oom", 0, 1 << 40, device_free=0),
            _entry("free", 0x7000, 64),  # legacy action, unknown address: also before the buffer
            {"action": "alloc"},  # no addr/size: skipped
            "garbage",
        ], []],
    }
    trace = load_snapshot(snap)
    m = trace.meta
    assert m["device"] == 0 and m["entries"] == 12
    assert m["pre_trace_frees"] == 2 and m["initial_from_segments"] == 1
    assert m["recorded_ooms"] == 1 and m["frees_never_completed"] == 1 and m["skipped_entries"] == 2
    assert m["segment_actions"] == 1
    # Live before the first action, in address order: 0x1000 (segments), 0x5000 and 0x7000 (frees only).
    assert trace.events[:3] == [(ALLOC, 5, 1024), (ALLOC, 1, 700), (ALLOC, 4, 64)]
    ops = [ev[0] for ev in trace.events[3:]]
    assert ops == [ALLOC, FREE, ALLOC, FREE, ALLOC, FREE]
    st = trace.stats()
    assert st.live_at_end_bytes == 1024 + 2048 + 512  # the 300-byte block is still held (rounded to 512)
    # Device 1 holds only its end state.
    other = load_snapshot(snap, device=1)
    assert other.events == [(ALLOC, 0, 4000)]


def test_snapshot_tolerates_missing_keys_and_old_layouts():
    # Blocks without addresses (older snapshots) are laid out from the segment's address.
    seg = {"address": 0x2000, "total_size": 3072,
           "blocks": [{"size": 1024, "state": "active_allocated"}, {"size": 2048, "state": "inactive"}]}
    trace = load_snapshot({"segments": [seg]})
    assert trace.events == [(ALLOC, 0, 1024)] and trace.meta["device"] == 0
    # A bare list is a list of segments (as torch.cuda._memory_viz reads it).
    assert load_snapshot([seg]).events == trace.events
    # Only device_traces, entries missing sizes.
    trace = load_snapshot({"device_traces": [[_entry("alloc", 16, 100), {"action": "free_completed", "addr": 16},
                                               {"action": "free_completed", "addr": 99}]]})
    assert trace.events == [(ALLOC, 0, 100), (FREE, 0)] and trace.meta["skipped_entries"] == 1
    with pytest.raises(TraceError, match="no allocations to replay"):
        load_snapshot({"segments": [], "device_traces": [[]]})


@pytest.mark.parametrize("keep", [None, 0.5, 0.1])
def test_snapshot_round_trip_and_ring_buffer_truncation(tmp_path, keep):
    original = llm_serving(steps=300)
    total = len(to_snapshot(original)["device_traces"][0])
    max_entries = None if keep is None else int(keep * total)
    snap = to_snapshot(original, max_entries=max_entries)
    path = tmp_path / "snapshot.pickle"
    with open(path, "wb") as f:
        pickle.dump(snap, f)  # what torch.cuda.memory._dump_snapshot writes
    trace = load_snapshot(path)
    assert trace.name == "snapshot.pickle"
    kept = [ev for ev in original.events if ev[0] != PHASE]
    curve = _live_curve(Trace(kept))
    imported = _live_curve(trace)
    # The imported history is the tail of the original: same live bytes after each recorded action.
    n_body = len(trace) - trace.meta["initial_allocs"]
    assert imported[-n_body:] == curve[-n_body:]
    if max_entries is None:
        assert trace.meta["pre_trace_frees"] == 0
        assert trace.stats().peak_live_bytes == Trace(kept).stats().peak_live_bytes
    else:
        assert trace.meta["pre_trace_frees"] > 0 and trace.meta["entries"] == max_entries
        # What was live before the first kept action is live at the start of the import.
        assert imported[trace.meta["initial_allocs"] - 1] == curve[len(curve) - n_body - 1]


def test_snapshot_rejects_foreign_truncated_and_code_pickles(tmp_path):
    cases = {
        "dict.pickle": (pickle.dumps({"weights": [1, 2]}), "not a PyTorch memory snapshot"),
        "int.pickle": (pickle.dumps(42), "not a PyTorch memory snapshot"),
        "counter.pickle": (pickle.dumps(collections.Counter(a=1)), "references collections.Counter"),
        "tensor.pickle": (pickle.dumps(torch.zeros(2)), "references torch"),
        "cut.pickle": (pickle.dumps(to_snapshot(llm_serving(steps=50)))[:-300], "truncated pickle"),
    }
    for name, (raw, fragment) in cases.items():
        path = tmp_path / name
        path.write_bytes(raw)
        with pytest.raises(TraceError, match=fragment) as info:
            load_snapshot(path)
        assert name in str(info.value)
