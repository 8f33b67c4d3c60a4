"""`defrag replay` as a tool for someone who just hit "CUDA out of memory" (defrag/replay.py).

The picture draws every row it promises, with or without --dry, the recorded
curve visible on top; a --plot it cannot write is a bad argument; a history
`defrag run --record` wrote is judged at the capacity the pool had (and at
--capacity when given); a long dry replay shows a progress bar on a
terminal; a snapshot this machine cannot hold replays dry without failing
half-way, and says so; the output starts with a sentence in the user's words;
the docs name every option.
"""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import sys
import textwrap

import pytest

from defrag import cli, fastpath
from defrag import replay as replay_module
from defrag.replay import RECORDED, load_input, replay_devices
from defrag.traces import checkerboard, llm_serving
from defrag.traces.format import ALLOC, FREE, Trace
from defrag.traces.snapshot import to_snapshot

from ..forked import run_module
from ..terminal import on_a_terminal

MiB = 1 << 20
ROOT = pathlib.Path(__file__).resolve().parents[2]
needs_native = pytest.mark.skipif(fastpath.setting() == "off", reason="DEFRAG_FASTPATH=0: no native allocator")
SNAPSHOTS = pathlib.Path("/work/shared/snapshots")


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _labels(fig) -> list[str]:
    return [line.get_label() for ax in fig.axes for line in ax.get_lines()]


# ---------------------------------------------------------------------- the picture
@pytest.mark.parametrize("dry", [False, True])
def test_the_picture_draws_every_row_with_or_without_dry(dry):
    """Without --dry the defrag rows are real pools on the emulated device: they are drawn too."""
    trace = load_input_snapshot(llm_serving(steps=120))
    (rep,) = replay_devices([trace], dry=dry, baselines=False, workers=1, series=True)
    fig = replay_module.devices_figure([rep])
    labels = _labels(fig)
    for r in rep.results:
        assert r.series is not None, r.allocator
        assert any(label.startswith(f"{r.allocator}: reserved") for label in labels), (r.allocator, labels)
    assert "live" in labels and f"{RECORDED}: reserved" in labels
    # The recorded curve stays visible: dashed, and drawn over every replayed curve.
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    recorded = lines[f"{RECORDED}: reserved"]
    assert recorded.get_linestyle() != "-"
    assert all(recorded.get_zorder() > line.get_zorder() for label, line in lines.items() if label != recorded.get_label())
    # The capacity line is the capacity the replay used.
    (cap,) = [line for label, line in lines.items() if label.startswith("capacity")]
    assert cap.get_ydata()[0] * (1 << 30 if rep.capacity >= 2 << 30 else MiB) == pytest.approx(rep.capacity)


def load_input_snapshot(trace: Trace):
    """The trace as a snapshot with segment entries (so it has a recorded curve), loaded back as a device."""
    snap = to_snapshot(trace)
    seg = 0x10000000
    for entries in snap["device_traces"]:
        entries.insert(0, {"action": "segment_alloc", "addr": seg, "size": 512 * MiB, "stream": 0})
    (item,) = load_input_from(snap)
    return item


def load_input_from(snap: dict) -> list:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "s.pickle"
        path.write_bytes(pickle.dumps(snap))
        return load_input(path)[1]


@pytest.mark.parametrize("name", ["out.txt", "out.csv", "out.docx"])
def test_a_plot_format_matplotlib_cannot_write_is_a_bad_argument(tmp_path, capsys, name):
    path = Trace([(ALLOC, 0, 4096), (FREE, 0)], name="t").save(tmp_path / "t.jsonl")
    out = tmp_path / name
    assert cli.main(["replay", str(path), "--capacity", "64MiB", "--dry", "--plot", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and not out.exists()  # refused before any replay
    (line,) = captured.err.strip().splitlines()
    assert line.startswith(f"defrag replay: error: --plot {out}: matplotlib cannot draw a .{name.split('.')[1]} file")
    assert "out.png" in line and ".pdf" in line and ".svg" in line


def test_a_plot_without_a_suffix_or_in_another_picture_format_is_written(tmp_path, capsys):
    path = checkerboard(total_bytes=8 * MiB, rounds=1).save(tmp_path / "cb.jsonl")
    for name in ("picture.svg", "picture"):
        assert cli.main(["replay", str(path), "--capacity", "16MiB", "--dry", "--plot", str(tmp_path / name)]) == 0
        assert (tmp_path / name).stat().st_size > 1000
    assert (tmp_path / "picture.svg").read_text().lstrip().startswith("<?xml")


# ---------------------------------------------------------------------- a history defrag run recorded
FRAG = textwrap.dedent("""
    import torch
    ts = [torch.empty(256 << 10, dtype=torch.uint8) for _ in range(256)]  # 64 MiB: 8 per 2 MiB page
    keep = ts[::4]  # 16 MiB live, two in every page: 48 MiB stranded
    del ts
    big = torch.empty(40 << 20, dtype=torch.uint8)
""")


@pytest.fixture(scope="module")
def recorded_oom(tmp_path_factory):
    """`defrag run --capacity 64MiB --record` of a program whose 40 MiB request fails: the history."""
    if fastpath.setting() == "off":
        pytest.skip("DEFRAG_FASTPATH=0: no native allocator for defrag run")
    tmp = tmp_path_factory.mktemp("recorded")
    (tmp / "frag.py").write_text(FRAG)
    proc = run_module("defrag", "run", "--device", "emulated", "--capacity", "64MiB", "--record", "frag.pickle",
                      "frag.py", cwd=str(tmp), timeout=240)  # forked from the test zygote (tests/forked.py)
    assert proc.returncode == 1 and "OutOfMemoryError" in proc.stderr, proc.stderr[-2000:]
    return tmp / "frag.pickle"


def _replay_json(path, tmp_path, *extra) -> dict:
    out = tmp_path / "r.json"
    cli.main(["replay", str(path), "--dry", "--json", str(out), *extra])
    (device,) = json.loads(out.read_text())["devices"]
    return device


def test_a_recorded_oom_is_judged_at_the_pools_capacity_not_with_its_stranded_space(recorded_oom, tmp_path):
    """The pool's capacity was 64 MiB, all of it mapped at the OOM: the device's free is 0, not the 48 MiB
    stranded inside the mapped pages."""
    device = _replay_json(recorded_oom, tmp_path)
    assert device["capacity"] == 64 * MiB and "defrag pool that recorded it" in device["capacity_source"]
    (oom,) = device["ooms"]
    assert (oom["reserved_bytes"], oom["device_free"], oom["capacity"]) == (64 * MiB, 0, 64 * MiB)
    assert oom["verdict"] == "fragmentation" and oom["live_bytes"] == 16 * MiB
    # A pool that moves tensors packs the 16 MiB and serves 40; expandable segments cannot (every page keeps two).
    assert oom["defrag_completes"] is True and oom["expandable_completes"] is False
    assert device["summary"].startswith("Under defrag run, its pool (PyTorch's allocator there) reserved up to "
                                        "64.00 MiB for 64.00 MiB live and ran out of memory once with the memory "
                                        "there but fragmented")


def test_a_defrag_run_history_is_described_as_that_run(recorded_oom, tmp_path, capsys):
    """Issue 46 item 4: the curve is defrag run's pool's, not PyTorch's; its pool moved nothing inside an
    operation, so what would have served the request is --rescue, and the capacity it needed as it ran is the
    pool's without compaction."""
    assert pickle.loads(recorded_oom.read_bytes())["defrag"]["run"] == {"rescue": False}  # the mark
    device = _replay_json(recorded_oom, tmp_path)
    text = capsys.readouterr().out
    assert RECORDED not in text and "\ndefrag run (recorded)  " in text
    assert "\ndefrag run (recorded): reserved at the start 0 B, peak 64.00 MiB" in text
    assert "recorded OOMs (capacity = the pool's reserved + the device's free bytes at each)" in text
    assert device["recorded_by"] == "defrag run" and device["recorded_by_rescue"] is False
    summary = device["summary"]
    assert ("defrag run --rescue (an operation that runs out of memory runs again after PyTorch's tensors move) "
            "would have served the request and run to the end") in summary, summary
    assert "do not move" not in summary and "defrag, which moves tensors" not in summary
    assert "the smallest capacity that runs the trace less the refused requests: defrag run 64.00 MiB, " in summary
    (item,) = load_input(recorded_oom)[1]
    (rep,) = replay_devices([item], dry=True, baselines=False, workers=1, series=True)
    labels = _labels(replay_module.devices_figure([rep]))
    assert "defrag run (recorded): reserved" in labels and f"{RECORDED}: reserved" not in labels


def test_capacity_changes_the_verdict_of_a_recorded_oom(recorded_oom, tmp_path, capsys):
    device = _replay_json(recorded_oom, tmp_path, "--capacity", "48MiB")
    (oom,) = device["ooms"]
    assert oom["capacity"] == 48 * MiB and oom["recorded_capacity"] == 64 * MiB
    assert oom["verdict"] == "not fragmentation" and oom["defrag_completes"] is False  # 16 + 40 > 48
    out = capsys.readouterr().out
    assert "live + request = 56.00 MiB > 48.00 MiB = --capacity" in out


def test_the_plot_of_a_recorded_oom_draws_the_capacity_used(recorded_oom):
    (item,) = load_input(recorded_oom)[1]
    (rep,) = replay_devices([item], dry=True, baselines=False, workers=1, series=True)
    fig = replay_module.devices_figure([rep])
    (cap,) = [line for line in fig.axes[0].get_lines() if line.get_label().startswith("capacity")]
    assert cap.get_ydata()[0] == 64.0 and cap.get_label() == "capacity (64.00 MiB)"


def test_an_older_defrag_history_with_the_stranded_space_as_free_is_read_right(recorded_oom, tmp_path):
    """defrag before this fix wrote capacity - live as the device's free (48 MiB here): read back, the pool's
    capacity still bounds it."""
    snap = pickle.loads(recorded_oom.read_bytes())
    for entry in snap["device_traces"][0]:
        if entry["action"] == "oom":
            entry["device_free"] = 48 * MiB
    old = tmp_path / "old.pickle"
    old.write_bytes(pickle.dumps(snap))
    (oom,) = _replay_json(old, tmp_path)["ooms"]
    assert oom["device_free"] == 0 and oom["capacity"] == 64 * MiB


# ---------------------------------------------------------------------- progress and size
def _on_a_terminal(argv: list[str], cwd) -> str:
    """What `python -m defrag argv...` writes to stderr on a terminal of 160 columns (stdout elsewhere)."""
    screen, rc = on_a_terminal([sys.executable, "-m", "defrag", *argv], columns=160, stdout=False, cwd=cwd,
                               env=_env())
    assert rc in (0, 1)
    return screen


def test_a_dry_replay_draws_a_progress_bar_on_a_terminal_only(tmp_path):
    path = llm_serving(steps=150).save(tmp_path / "llm.jsonl")
    argv = ["replay", str(path), "--capacity", "512MiB", "--dry"]
    stderr = _on_a_terminal(argv, tmp_path)
    assert "replays and capacity searches" in stderr and "replays]" in stderr and "ev/s" in stderr
    piped = run_module("defrag", *argv, cwd=str(tmp_path), timeout=300)  # forked from the test zygote
    assert piped.returncode == 0 and "replays and capacity searches" not in piped.stderr + piped.stdout


def test_a_trace_this_machine_cannot_hold_replays_dry_and_says_why(tmp_path, capsys, monkeypatch):
    """Without --dry the emulated device needs an open file per 2 MiB page: a trace beyond `ulimit -n`
    replays dry from the start (the same figures), with one line saying so, instead of failing half-way."""
    import resource

    trace = Trace([(ALLOC, i, 4 * MiB) for i in range(40)] + [(FREE, i) for i in range(40)], name="big")
    path = trace.save(tmp_path / "big.jsonl")
    monkeypatch.setattr(resource, "getrlimit", lambda which: (100, 100))
    out = tmp_path / "r.json"
    assert cli.main(["replay", str(path), "--capacity", "256MiB", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0].endswith("dry (memory-less device)")
    assert "dry without --dry: a real replay on the emulated device could need about 101 pages of 2.00 MiB, " \
           "one open file each, more than `ulimit -n` allows (100)" in text.splitlines()[1]
    data = json.loads(out.read_text())
    assert data["dry"] is True and "ulimit -n" in data["dry_because"]
    assert all(r["dry"] for r in data["results"])


def test_a_trace_larger_than_the_host_memory_replays_dry(tmp_path, capsys, monkeypatch):
    trace = Trace([(ALLOC, i, 4 * MiB) for i in range(40)], name="big")
    path = trace.save(tmp_path / "big.jsonl")
    monkeypatch.setattr(replay_module, "_host_memory_available", lambda: 64 * MiB)
    assert cli.main(["replay", str(path), "--capacity", "256MiB"]) == 0
    line = capsys.readouterr().out.splitlines()[1]
    assert "more than this machine has available (64.00 MiB)" in line


def test_a_trace_that_fits_still_replays_on_real_pools(tmp_path, capsys):
    path = checkerboard(total_bytes=8 * MiB, rounds=1).save(tmp_path / "cb.jsonl")
    out = tmp_path / "r.json"
    assert cli.main(["replay", str(path), "--capacity", "16MiB", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["dry"] is False and data["dry_because"] is None
    assert "dry without --dry" not in capsys.readouterr().out


# ---------------------------------------------------------------------- words
def test_the_output_starts_with_a_sentence_and_speaks_no_benchmark_language(tmp_path, capsys):
    snap = to_snapshot(llm_serving(steps=150))
    snap["device_traces"][0].insert(0, {"action": "segment_alloc", "addr": 0x10, "size": 512 * MiB, "stream": 0})
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(snap))
    assert cli.main(["replay", str(path), "--dry"]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("== device 0:"))
    sentence = lines[at + 1]
    assert sentence.startswith("PyTorch reserved up to 512.00 MiB for ")
    assert "The smallest capacity that runs the trace: defrag " in sentence
    assert "PyTorch with expandable_segments" in sentence and sentence.endswith("(model).")
    assert lines[at + 2].startswith("allocator ")  # then the table
    text = "\n".join(lines)
    assert "goal" not in text and "1.02 x" not in text and "the same replay" not in text


def test_every_replay_option_is_documented_in_traces_md_and_the_cli_table():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices["replay"]
    options = {o for a in sub._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
    assert "--no-mesh" in options
    traces = (ROOT / "docs" / "traces.md").read_text()
    table = next(line for line in (ROOT / "docs" / "api.md").read_text().splitlines()
                 if line.startswith("| `defrag replay PATH`"))
    synopsis = traces.split("`defrag replay PATH ", 1)[1].split("` replays", 1)[0]
    for option in options:
        assert f"[{option}" in synopsis and f"`{option}" in traces.replace(f"[{option}", ""), option
        assert f"`{option}" in table, option
    for doc in (traces, table):
        assert "defrag-mesh" in doc


# ---------------------------------------------------------------------- the real snapshots
@pytest.mark.skipif(not SNAPSHOTS.is_dir(), reason="no /work/shared/snapshots on this machine")
@pytest.mark.parametrize("name", ["eor_counterfactuals_snapshot", "select_n_gpt2_b_snapshot"])
def test_a_real_snapshot_replays_with_every_row_drawn(name, tmp_path, capsys):
    png = tmp_path / f"{name}.png"
    assert cli.main(["replay", str(SNAPSHOTS / f"{name}.pickle"), "--dry", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[3].startswith("PyTorch reserved up to ") and png.stat().st_size > 10_000
