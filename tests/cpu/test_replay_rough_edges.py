"""`defrag replay` as a user meets it (issue 46): its workers die with it, a history `defrag run --record`
wrote is described as that run, and every line it prints is one a user can act on."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from defrag.traces.format import ALLOC, FREE, Trace

MiB = 1 << 20
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


# ---------------------------------------------------------------------- workers end with their parent
def _children(pid: int) -> set[int]:
    """The live (not zombie) processes whose parent is `pid`."""
    out = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = pathlib.Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state != "Z":
            out.add(int(entry))
    return out


def _alive(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


BUSY_REPLAY = textwrap.dedent("""
    import sys
    from defrag import cli, replay

    def busy(*args, **kwargs):  # a replay that takes as long as the test needs: forever
        while True:
            pass

    replay._run_dry = busy  # the forked workers inherit it
    replay.default_workers = lambda: 2
    sys.exit(cli.main(["replay", sys.argv[1], "--capacity", "64MiB", "--dry"]))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_workers_of_a_replay_end_when_its_process_is_killed(tmp_path):
    """A replay killed by a timeout or the OOM killer gets no chance to stop its workers: they end on their
    own, at once, instead of keeping a core each busy until their replay is done."""
    path = Trace([(ALLOC, i, MiB) for i in range(8)] + [(FREE, i) for i in range(8)], name="t").save(
        tmp_path / "t.jsonl")
    proc = subprocess.Popen([sys.executable, "-c", BUSY_REPLAY, str(path)], env=_env(), cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    workers: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while len(workers) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
            workers = _children(proc.pid)
        assert len(workers) == 2, (proc.poll(), proc.stderr.read().decode()[-2000:] if proc.poll() is not None else "")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 5
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [w for w in workers if _alive(w)], "the workers outlived their parent"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for w in workers:  # before the fix: the busy workers this test started, one by one
            if _alive(w):
                os.kill(w, signal.SIGKILL)
        proc.stderr.close()


# ---------------------------------------------------------------------- whose history it is
KiB = 1 << 10


def _fragmented_history(defrag: dict | None) -> dict:
    """A history like `defrag run --capacity 64MiB` of a program that keeps 2 of every 8 blocks of 256 KiB in
    each 2 MiB page, then asks for 40 MiB (refused: 16 MiB live, 48 MiB stranded); `defrag`: the snapshot's
    "defrag" key (None: PyTorch's own snapshot)."""
    base, entries = 0x7F0000000000, []
    for i in range(32):
        entries.append({"action": "segment_map", "addr": base + i * 2 * MiB, "size": 2 * MiB, "stream": 0})
    for i in range(256):
        entries.append({"action": "alloc", "addr": base + i * 256 * KiB, "size": 256 * KiB, "stream": 0})
    for i in range(256):
        if i % 4:
            for action in ("free_requested", "free_completed"):
                entries.append({"action": action, "addr": base + i * 256 * KiB, "size": 256 * KiB, "stream": 0})
    entries.append({"action": "oom", "addr": 0, "size": 40 * MiB, "device_free": 0, "stream": 0})
    snap = {"device_traces": [entries]}
    if defrag is not None:
        snap["defrag"] = defrag
    return snap


def _report(snap: dict):
    from defrag.replay import replay_devices
    from defrag.traces.snapshot import load_snapshot_devices

    (item,) = load_snapshot_devices(snap, name="frag")
    (rep,) = replay_devices([item], dry=True, baselines=False, workers=1)
    return rep


POOL = {"pools": [{"capacity": 64 * MiB, "device_index": 0}]}


@pytest.mark.parametrize("defrag,label,who", [
    (None, "PyTorch (recorded)", "PyTorch reserved up to 64.00 MiB"),
    (POOL, "defrag pool (recorded)", "The defrag pool reserved up to 64.00 MiB"),
    ({**POOL, "run": {"rescue": False}}, "defrag run (recorded)",
     "Under defrag run, its pool (PyTorch's allocator there) reserved up to 64.00 MiB"),
])
def test_the_recorded_curve_is_named_for_whoever_recorded_it(defrag, label, who):
    from defrag.replay import format_table

    rep = _report(_fragmented_history(defrag))
    assert rep.recorded_label == label
    assert rep.as_dict()["summary"].startswith(who), rep.as_dict()["summary"]
    table = format_table(rep.results, rep.skipped, rep.recorded, recorded_label=rep.recorded_label)
    assert table.splitlines()[2].startswith(label + "  ")


def test_a_defrag_run_with_rescue_that_still_ran_out_is_not_told_to_use_rescue():
    rep = _report(_fragmented_history({**POOL, "run": {"rescue": True}}))
    summary = rep.as_dict()["summary"]
    assert rep.rescue is True and "defrag run --rescue (" not in summary
    assert "This run had --rescue, which could not serve it" in summary
    assert "a pool that moves every tensor would have served the request and run to the end" in summary


def test_a_plain_pool_history_keeps_the_pools_verdict():
    summary = _report(_fragmented_history(POOL)).as_dict()["summary"]
    assert "defrag, which moves tensors, would have served the request and run to the end" in summary
    assert "--rescue" not in summary and "do not move" not in summary


# ---------------------------------------------------------------------- lines a user can act on
def _two_device_snapshot() -> dict:
    from defrag.traces import llm_serving
    from defrag.traces.snapshot import to_snapshot

    snap = to_snapshot(llm_serving(steps=60))
    snap["device_traces"].append(list(snap["device_traces"][0]))
    return snap


def test_replay_prints_no_line_a_user_cannot_act_on(tmp_path, capsys):
    """Issue 46 item 5: no note that two rows' replays were one run (twice), and the rows skipped for want of
    a GPU are one line that says what the (model) rows are, once for all devices."""
    import json
    import pickle

    import torch

    from defrag import cli
    from defrag.replay import NO_GPU_LINE

    path = tmp_path / "two.pickle"
    path.write_bytes(pickle.dumps(_two_device_snapshot()))
    out = tmp_path / "r.json"
    assert cli.main(["replay", str(path), "--dry", "--capacity", "512MiB", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.count("== device ") == 2
    for gone in ("compaction never ran", "meshing never ran", "the same run", "searched jointly", "skipped: no CUDA"):
        assert gone not in text, gone
    if not torch.cuda.is_available():
        assert text.count(NO_GPU_LINE) == 1
        assert "(model)" in NO_GPU_LINE and "CUDA GPU" in NO_GPU_LINE
    data = json.loads(out.read_text())
    for device in data["devices"]:
        rows = {r["allocator"]: r for r in device["results"]}
        assert rows["defrag"]["same_run_as"] == "defrag-mesh" and not rows["defrag"]["notes"]
        if not torch.cuda.is_available():  # the JSON keeps each skipped row with its reason
            assert {s["allocator"] for s in device["skipped"]} == {"torch", "torch-expandable"}


# ---------------------------------------------------------------------- the docs' example sentence
def _quoted_sentence(doc: str) -> str:
    import re

    text = " ".join((ROOT / "docs" / doc).read_text().split())
    (quote,) = re.findall(r'"(PyTorch reserved up to [^"]*?\(model\)\.)"', text)
    return quote


def test_the_docs_example_sentence_is_one_replay_prints():
    """Guide section 1 and traces.md quote the sentence `defrag replay --dry` prints for cs336_ctx128_fullstep
    (a 51 GiB training step, /work/shared/snapshots): the same sentence in both, and the very sentence
    `summary_sentence` writes from the figures it quotes (the pool with meshing named where it needs less)."""
    import re

    from defrag.replay import DeviceReport, MinCapacity, ReplayResult, summary_sentence
    from defrag.traces.snapshot import RecordedReserved

    quote = _quoted_sentence("guide.md")
    assert quote == _quoted_sentence("traces.md")
    GiB = 1 << 30

    def size(text: str) -> int:
        return int(float(text) * GiB)

    live, peak = (size(x) for x in re.match(r"PyTorch reserved up to ([\d.]+) GiB for ([\d.]+) GiB", quote).groups()[::-1])
    needs = dict((name, size(value)) for name, value in re.findall(
        r"(defrag with meshing|defrag|PyTorch with expandable_segments|PyTorch) ([\d.]+) GiB", quote.split(": ", 1)[1]))
    rows = {"defrag": needs["defrag"], "defrag-mesh": needs.get("defrag with meshing", needs["defrag"]),
            "torch-expandable (model)": needs["PyTorch with expandable_segments"], "torch (model)": needs["PyTorch"]}
    results = [ReplayResult(name, "t", peak, MiB, True, "none", 2, peak_live_bytes=live,
                            min_capacity=MinCapacity(b, b - 2 * MiB, True, 1)) for name, b in rows.items()]
    trace = Trace([(ALLOC, 0, live), (FREE, 0)], name="t")
    recorded = RecordedReserved(0, peak, 0, [0, 1], [peak, 0], True)
    assert summary_sentence(DeviceReport(0, trace, peak, "", results, [], recorded)) == quote


SNAPSHOT = pathlib.Path("/work/shared/snapshots/cs336_ctx128_fullstep.pickle")


@pytest.mark.skipif(not SNAPSHOT.is_file(), reason="no /work/shared/snapshots on this machine")
def test_the_docs_example_sentence_is_what_the_replay_of_that_snapshot_prints():
    """The figures too: guide section 1 showed defrag 51.19 GiB where the replay prints 51.08 GiB, and no
    meshing figure (about 6 s on two cores)."""
    from defrag.replay import load_input, replay_devices, summary_sentence

    (rep,) = replay_devices(load_input(SNAPSHOT)[1], dry=True, baselines=False, progress=False)
    assert summary_sentence(rep) == _quoted_sentence("guide.md")


# ---------------------------------------------------------------------- the joint search, pipelined
class _Log:
    """A progress bar that keeps what `_Workers` tells it: ("queued" | "done", spec) in order."""

    def __init__(self):
        self.total, self.events = 0, []
        self._queued = 0

    def update(self, n):
        pass

    def set_postfix_str(self, text, refresh=False):
        done, queued = (int(x) for x in text.split()[0].split("/"))
        self.events.append("queued" if queued > self._queued else "done")
        self._queued = queued

    def refresh(self):
        pass


def _joint_search(trace, workers: int):
    from defrag import replay as R

    key = R._share(trace)
    try:
        job = R._pools_without_phases_job(key, 2 * trace.stats().peak_live_bytes, trace.stats().peak_live_bytes,
                                          page_size=None, series=False, budget_s=None, mesh=True)
        log = _Log()
        (rows,) = R._Workers(workers).run([(0, job)], bar=log)
        return [(r.allocator, r.min_capacity, r.peak_reserved_bytes) for r in rows], log.events
    finally:
        R._SHARED.pop(key, None)


def test_the_next_round_of_the_joint_search_starts_on_a_core_the_round_leaves_idle():
    """Item 13: once one probe of a round has answered, the probes the next round holds whatever the other
    answers run at once; the probes, and so every answer, are those of the search one round after the other,
    and no probe runs that the search does not use."""
    from defrag.traces import llm_serving
    from defrag.traces.snapshot import load_snapshot, to_snapshot

    trace = load_snapshot(to_snapshot(llm_serving(steps=300)))
    inline, inline_log = _joint_search(trace, 1)
    both, log = _joint_search(trace, 2)
    assert both == inline
    assert log.count("queued") == inline_log.count("queued")  # nothing run that the search did not ask for
    # Inline, a round is queued once the one before it is done (nothing outstanding); on two cores a probe is
    # queued right after an answer while the rest of its round is still out.
    def early(events):
        return sum(1 for i, e in enumerate(events) if e == "queued" and i and events[i - 1] == "done"
                   and events[:i].count("done") < events[:i].count("queued"))
    assert early(inline_log) == 0 and early(log) > 0


def test_the_preview_of_a_round_is_in_the_next_round():
    """What `_Round.preview` gives, with the answers in so far, is in the round the search then asks for:
    a probe run early is never wasted."""
    from defrag import replay as R
    from defrag.traces import llm_serving
    from defrag.traces.snapshot import load_snapshot, to_snapshot

    trace = load_snapshot(to_snapshot(llm_serving(steps=300)))
    key = R._share(trace)
    try:
        job = R._pools_without_phases_job(key, 2 * trace.stats().peak_live_bytes, trace.stats().peak_live_bytes,
                                          page_size=None, series=False, budget_s=None, mesh=True)
        rnd = next(job)
        previewed = 0
        while True:
            answers = [R._task(spec) for spec in rnd]
            previews = ([set(rnd.preview({slot: answers[slot]})) for slot in range(len(rnd))]
                        if isinstance(rnd, R._Round) else [])
            try:
                rnd = job.send(answers)
            except StopIteration:
                assert not any(previews)
                break
            for p in previews:
                assert p <= set(rnd)
                previewed += len(p)
        assert previewed > 0
    finally:
        R._SHARED.pop(key, None)
