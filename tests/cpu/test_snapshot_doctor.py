"""Snapshots explained: every device, what PyTorch really reserved, each recorded OOM judged.

The snapshots here are built in PyTorch's own format (what
``torch.cuda.memory._snapshot()`` returns): ``segments`` at the end and
per-device ``device_traces`` with ``segment_*`` and ``oom`` entries.
"""

from __future__ import annotations

import json
import pickle

import pytest

from defrag.cli import main as cli_main
from defrag.replay import DEFAULT_PAGE, load_input, min_capacity, replay, replay_devices, snapshot_capacity
from defrag.traces import ALLOC, FREE, load_snapshot
from defrag.traces.snapshot import load_snapshot_devices, to_snapshot
from defrag.traces import llm_serving

MiB = 1 << 20


class _Recorder:
    """Builds one device's trace entries the way PyTorch's allocator records them."""

    def __init__(self, device: int, base: int):
        self.device, self.next, self.entries = device, base, []
        self.live: dict[int, int] = {}  # addr -> size
        self.segments: dict[int, int] = {}  # addr -> size (cudaMalloc'd, or one mapped range)

    def segment(self, size: int) -> int:
        addr, self.next = self.next, self.next + size
        self.segments[addr] = size
        self.entries.append({"action": "segment_alloc", "addr": addr, "size": size, "stream": 0})
        return addr

    def alloc(self, addr: int, size: int) -> int:
        self.live[addr] = size
        self.entries.append({"action": "alloc", "addr": addr, "size": size, "stream": 0})
        return addr

    def free(self, addr: int) -> None:
        size = self.live.pop(addr)
        for action in ("free_requested", "free_completed"):
            self.entries.append({"action": action, "addr": addr, "size": size, "stream": 0})

    def oom(self, size: int, device_free: int) -> None:
        # PyTorch writes the device's free bytes in place of an address for this action.
        self.entries.append({"action": "oom", "device_free": device_free, "size": size, "stream": 0})

    def segments_at_end(self) -> list[dict]:
        out = []
        for addr, size in sorted(self.segments.items()):
            blocks = [{"address": a, "size": s, "requested_size": s, "state": "active_allocated"}
                      for a, s in sorted(self.live.items()) if addr <= a < addr + size]
            out.append({"device": self.device, "address": addr, "total_size": size, "stream": 0,
                        "is_expandable": False, "blocks": blocks})
        return out


def _fragmented(device: int, base: int, *, live_pairs: int, request: int, device_free: int) -> _Recorder:
    """A 60 MiB segment of 2 MiB blocks; every other block freed (or none), then a refused `request`."""
    rec = _Recorder(device, base)
    seg = rec.segment(60 * MiB)
    addrs = [rec.alloc(seg + i * 2 * MiB, 2 * MiB) for i in range(30)]
    for i, a in enumerate(addrs):
        if i >= 2 * live_pairs or i % 2:
            rec.free(a)
    rec.oom(request, device_free)
    for a in list(rec.live)[:3]:
        rec.free(a)
    return rec


def _two_device_snapshot() -> dict:
    """Device 0 ran fine; device 1 refused 20 MiB with 30 MiB live, 60 MiB reserved and 4 MiB free."""
    ok = _Recorder(0, 0x10000000)
    seg = ok.segment(20 * MiB)
    ok.alloc(seg, 6 * MiB)
    second = ok.alloc(seg + 6 * MiB, 6 * MiB)
    ok.free(second)
    bad = _fragmented(1, 0x20000000, live_pairs=15, request=20 * MiB, device_free=4 * MiB)
    return {"segments": ok.segments_at_end() + bad.segments_at_end(),
            "device_traces": [ok.entries, bad.entries], "allocator_settings": {}}


def test_every_device_is_imported_with_its_recorded_reserved_and_ooms():
    snap = _two_device_snapshot()
    devices = load_snapshot_devices(snap)
    assert [d.device for d in devices] == [0, 1]
    d0, d1 = devices
    assert d0.ooms == [] and d0.recorded.start_bytes == 0 and d0.recorded.peak_bytes == 20 * MiB
    assert d1.recorded.start_bytes == 0 and d1.recorded.peak_bytes == d1.recorded.end_bytes == 60 * MiB
    (oom,) = d1.ooms
    # 30 blocks of 2 MiB, every other one freed: 15 live (30 MiB) when 20 MiB was refused.
    assert (oom.size, oom.live_bytes, oom.reserved_bytes, oom.device_free) == (20 * MiB, 30 * MiB, 60 * MiB, 4 * MiB)
    assert oom.capacity == 64 * MiB and oom.verdict == "fragmentation"
    # The request came after the last of the odd blocks was freed and before the first later free.
    assert d1.trace.events[oom.event - 1] == (FREE, 29) and d1.trace.events[oom.event] == (FREE, 0)
    # The single-device loader still picks the device with the most recorded actions.
    assert load_snapshot(snap).meta["device"] == 1
    assert load_snapshot(snap, device=0).meta["device"] == 0


def test_a_fragmentation_oom_and_a_real_one_are_told_apart():
    frag = _fragmented(0, 0x10000000, live_pairs=15, request=20 * MiB, device_free=4 * MiB)
    real = _fragmented(0, 0x10000000, live_pairs=15, request=40 * MiB, device_free=4 * MiB)
    for rec, verdict, defrag_ok in ((frag, "fragmentation", True), (real, "not fragmentation", False)):
        snap = {"segments": rec.segments_at_end(), "device_traces": [rec.entries]}
        (dev,) = load_snapshot_devices(snap)
        (report,) = replay_devices([dev], dry=True, baselines=False, workers=1)
        (oom,) = report.ooms
        assert oom["verdict"] == verdict and oom["capacity"] == 64 * MiB
        # Live 30 MiB + 20 MiB fits the 64 MiB the GPU could hold: the pool serves it (stitching pages),
        # the expandable-segments model cannot (every 20 MiB page it mapped still holds a live block).
        # Live 30 MiB + 40 MiB does not fit: nothing can serve it.
        assert oom["defrag_completes"] is defrag_ok and oom["expandable_completes"] is False
        assert report.capacity == 64 * MiB and "reserved" in report.capacity_source


def test_expandable_segment_map_entries_are_reserved_bytes():
    entries = [
        {"action": "segment_map", "addr": 0x1000000, "size": 20 * MiB},
        {"action": "alloc", "addr": 0x1000000, "size": 15 * MiB},
        {"action": "segment_map", "addr": 0x2400000, "size": 20 * MiB},
        {"action": "alloc", "addr": 0x1F00000, "size": 18 * MiB},
        {"action": "free_requested", "addr": 0x1000000, "size": 15 * MiB},
        {"action": "free_completed", "addr": 0x1000000, "size": 15 * MiB},
        {"action": "segment_unmap", "addr": 0x1000000, "size": 14 * MiB},
    ]
    segments = [{"device": 0, "address": 0x1E00000, "total_size": 26 * MiB, "is_expandable": True,
                 "blocks": [{"address": 0x1F00000, "size": 18 * MiB, "requested_size": 18 * MiB,
                             "state": "active_allocated"}]}]
    (dev,) = load_snapshot_devices({"segments": segments, "device_traces": [entries]})
    rec = dev.recorded
    assert rec.end_from_segments and (rec.start_bytes, rec.peak_bytes, rec.end_bytes) == (0, 40 * MiB, 26 * MiB)
    # Levels by trace event: nothing, then 20 MiB mapped before event 0 (the first alloc), 40 MiB from
    # event 1, 26 MiB from event 3 (after the free).
    assert rec.event == [0, 0, 1, 3] and rec.reserved == [0, 20 * MiB, 40 * MiB, 26 * MiB]
    assert rec.at(0) == 20 * MiB and rec.at(2) == 40 * MiB and rec.at(99) == 26 * MiB


def test_a_ring_buffer_that_dropped_the_start_keeps_the_reserved_level():
    rec = _Recorder(0, 0x10000000)
    seg = rec.segment(40 * MiB)
    blocks = [rec.alloc(seg + i * 4 * MiB, 4 * MiB) for i in range(8)]
    more = rec.segment(20 * MiB)
    rec.alloc(more, 12 * MiB)
    for a in blocks[:5]:
        rec.free(a)
    gone = rec.segment(20 * MiB)
    rec.entries.append({"action": "segment_free", "addr": gone, "size": 20 * MiB})
    del rec.segments[gone]
    kept = rec.entries[5:]  # the first segment_alloc and four allocs fell off the ring buffer
    (dev,) = load_snapshot_devices({"segments": rec.segments_at_end(), "device_traces": [kept]})
    r = dev.recorded
    # 60 MiB at the end; the kept history maps 20 + 20 and frees 20, so 40 MiB were reserved at its start.
    assert (r.start_bytes, r.peak_bytes, r.end_bytes) == (40 * MiB, 80 * MiB, 60 * MiB)
    m = dev.trace.meta
    assert m["pre_trace_frees"] == 4  # blocks whose alloc was dropped are live from the start
    assert m["initial_allocs"] == 4 and all(ev[0] == ALLOC and ev[2] == 4 * MiB for ev in dev.trace.events[:4])


def test_a_snapshot_without_a_trace_replays_its_end_state(tmp_path, capsys):
    segments = [{"device": 0, "address": 0x1000, "total_size": 20 * MiB,
                 "blocks": [{"address": 0x1000, "size": 6 * MiB, "requested_size": 6 * MiB,
                             "state": "active_allocated"}]}]
    (dev,) = load_snapshot_devices({"segments": segments, "device_traces": []})
    assert dev.recorded is None and dev.ooms == [] and dev.trace.events == [(ALLOC, 0, 6 * MiB)]
    cap, source = snapshot_capacity(dev.recorded, dev.ooms, dev.trace)
    assert cap == 20 * MiB and "end of the trace" in source
    path = tmp_path / "end.pickle"
    path.write_bytes(pickle.dumps({"segments": segments}))
    out = tmp_path / "r.json"
    assert cli_main(["replay", str(path), "--dry", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "no segment entries" in text and "PyTorch (recorded): the trace has no segment entries" in text
    (d,) = json.loads(out.read_text())["devices"]
    assert d["recorded"] is None and "no segment entries" in d["recorded_note"] and d["capacity"] == 20 * MiB


def test_cli_no_mesh_leaves_out_the_meshing_row_and_nothing_else(tmp_path, capsys):
    path = tmp_path / "two.pickle"
    path.write_bytes(pickle.dumps(_two_device_snapshot()))
    out = tmp_path / "r.json"
    assert cli_main(["replay", str(path), "--dry", "--no-mesh", "--json", str(out)]) == 0
    for d in json.loads(out.read_text())["devices"]:
        assert [r["allocator"] for r in d["results"]] == ["defrag", "defrag-no-compaction", "torch (model)",
                                                          "torch-expandable (model)"]
    assert "defrag-mesh" not in capsys.readouterr().out


def test_cli_replays_every_device_and_explains_the_oom(tmp_path, capsys):
    path = tmp_path / "two.pickle"
    path.write_bytes(pickle.dumps(_two_device_snapshot()))
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    assert cli_main(["replay", str(path), "--dry", "--json", str(out), "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "== device 0:" in text and "== device 1:" in text
    assert "OOM 1 at event" in text and "-> fragmentation (live + request = 50.00 MiB <= 64.00 MiB" in text
    assert "0 OOMs recorded" in text and "1 OOM recorded" in text and "1 OOMs" not in text  # issue 46 item 11
    data = json.loads(out.read_text())
    assert [d["device"] for d in data["devices"]] == [0, 1]
    d0, d1 = data["devices"]
    assert d0["ooms"] == [] and d0["capacity"] == 20 * MiB and d0["recorded"]["peak_reserved_bytes"] == 20 * MiB
    (oom,) = d1["ooms"]
    assert {k: oom[k] for k in ("size", "live_bytes", "reserved_bytes", "device_free", "verdict")} == {
        "size": 20 * MiB, "live_bytes": 30 * MiB, "reserved_bytes": 60 * MiB, "device_free": 4 * MiB,
        "verdict": "fragmentation"}
    assert oom["defrag_completes"] is True and oom["expandable_completes"] is False
    assert d1["capacity"] == 64 * MiB and d1["recorded"]["start_reserved_bytes"] == 0
    assert d1["recorded"]["reserved_over_time"] == {"event": [0, 0], "bytes": [0, 60 * MiB]}
    for d in data["devices"]:
        rows = {r["allocator"]: r for r in d["results"]}
        assert set(rows) == {"defrag", "defrag-no-compaction", "defrag-mesh", "torch (model)",
                             "torch-expandable (model)"}
        assert all(r["min_capacity"]["exact"] for r in rows.values())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # --snapshot-device picks one.
    assert cli_main(["replay", str(path), "--dry", "--snapshot-device", "1", "--json", str(out)]) == 0
    assert [d["device"] for d in json.loads(out.read_text())["devices"]] == [1]


@pytest.mark.parametrize("args,fragment", [
    (["--snapshot-device", "7"], "has no device 7"),
    (["--snapshot-device", "-1"], "0 or more"),
])
def test_bad_snapshot_device_is_one_line(tmp_path, capsys, args, fragment):
    path = tmp_path / "two.pickle"
    path.write_bytes(pickle.dumps(_two_device_snapshot()))
    assert cli_main(["replay", str(path), "--dry", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert fragment in err and len(err.splitlines()) == 1


def test_a_trace_needs_a_capacity(tmp_path, capsys):
    path = llm_serving(steps=20).save(tmp_path / "t.jsonl")
    assert cli_main(["replay", str(path), "--dry"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--capacity is required for a defrag trace" in err and len(err.splitlines()) == 1
    with pytest.raises(Exception, match="applies to PyTorch memory snapshots"):
        load_input(path, snapshot_device=0)


def test_a_replay_with_ooms_never_meets_the_goal(tmp_path, capsys):
    """Issue 22: at 8 MiB a snapshot with OOMs printed 'reserved/live = 1.0000 (met)' and exit code 0."""
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(to_snapshot(llm_serving(steps=200), max_entries=1500)))
    assert cli_main(["replay", str(path), "--capacity", "8MiB", "--dry"]) == 1
    text = capsys.readouterr().out
    sentence = text.splitlines()[text.splitlines().index(next(ln for ln in text.splitlines()
                                                                if ln.startswith("== device"))) + 1]
    assert "at 8.00 MiB defrag fails" in sentence and "allocations" in sentence and "met" not in text
    r = replay(load_snapshot(path), 8 * MiB, dry=True)
    assert r.ooms > 0 and not r.meets_goal() and r.as_dict()["meets_goal_1_02"] is False


def test_searches_are_exact_and_do_not_depend_on_the_number_of_workers():
    trace = llm_serving(steps=300)
    cap = 2 * trace.stats().peak_live_bytes
    (one,) = replay_devices([(None, trace)], cap, dry=True, baselines=False, workers=1)
    (two,) = replay_devices([(None, trace)], cap, dry=True, baselines=False, workers=2)
    for a, b in zip(one.results, two.results):
        assert a.allocator == b.allocator and a.min_capacity == b.min_capacity and a.min_capacity.exact
        assert (a.peak_reserved_bytes, a.ooms, a.moved_bytes) == (b.peak_reserved_bytes, b.ooms, b.moved_bytes)
        mc = a.min_capacity
        page = a.page_size
        # The boundary found: completes at it, fails one page below.
        if a.allocator.startswith("defrag"):
            how = dict(compaction=a.allocator != "defrag-no-compaction", mesh=a.allocator == "defrag-mesh")
            assert replay(trace, mc.bytes, dry=True, **how).completed
            assert not replay(trace, mc.bytes - page, dry=True, **how).completed


def test_without_phase_markers_the_compacting_pool_reuses_the_plain_replay():
    """No phase marker: compaction runs only after a failed placement, so where no placement failed the
    three defrag rows' replays are one run, with the same figures."""
    trace = load_snapshot(to_snapshot(llm_serving(steps=200)))
    assert trace.stats().phases == 0
    (rep,) = replay_devices([(None, trace)], 2 * trace.stats().peak_live_bytes, dry=True, baselines=False,
                            workers=1, models=False)
    on, off = rep.result("defrag"), rep.result("defrag-no-compaction")
    for row in (on, off):
        # The same run, marked for the JSON; no note in the table (nothing there for a user to act on).
        assert row.completed and row.same_run_as == "defrag-mesh" and not row.notes
    assert not rep.result("defrag-mesh").notes and rep.result("defrag-mesh").same_run_as is None
    for how in (dict(compaction=True), dict(compaction=False)):
        direct = replay(trace, on.capacity, dry=True, **how)
        assert (direct.peak_reserved_bytes, direct.peak_live_bytes, direct.compactions) == (
            on.peak_reserved_bytes, on.peak_live_bytes, 0)
    assert on.min_capacity.bytes <= off.min_capacity.bytes
    assert on.min_capacity == min_capacity(trace, compaction=True, known_good=off.min_capacity.bytes,
                                           hint=on.peak_reserved_bytes, split=2) or on.min_capacity.exact
    assert replay(trace, on.min_capacity.bytes, dry=True).completed
    assert not replay(trace, on.min_capacity.bytes - DEFAULT_PAGE, dry=True).completed


def test_a_request_refused_many_times_is_explained_each_time_and_checked_a_bounded_number_of_times():
    from defrag.replay import OOM_CHECKS

    rec = _fragmented(0, 0x10000000, live_pairs=15, request=20 * MiB, device_free=4 * MiB)
    for _ in range(OOM_CHECKS + 4):  # a program retrying the refused request
        rec.oom(20 * MiB, 4 * MiB)
    (dev,) = load_snapshot_devices({"segments": rec.segments_at_end(), "device_traces": [rec.entries]})
    (report,) = replay_devices([dev], dry=True, baselines=False, workers=2, models=False)
    assert len(report.ooms) == OOM_CHECKS + 5
    assert all(o["verdict"] == "fragmentation" for o in report.ooms)
    checked = [o["defrag_completes"] for o in report.ooms]
    assert checked[:OOM_CHECKS] == [True] * OOM_CHECKS and checked[OOM_CHECKS:] == [None] * 5


def test_plot_and_json_paths_are_checked_before_any_replay(tmp_path, capsys):
    path = tmp_path / "two.pickle"
    path.write_bytes(pickle.dumps(_two_device_snapshot()))
    for flag in ("--plot", "--json"):
        assert cli_main(["replay", str(path), "--dry", flag, str(tmp_path)]) == 2
        err = capsys.readouterr().err.strip()
        assert flag in err and "is a folder" in err and len(err.splitlines()) == 1
