"""Rough edges of the command line a new user found (issue 10).

Every command answers a bad argument with one line on stderr and exit code 2,
in command-line terms, before doing any work; smoke benchmark figures are not
judged; the demo's picture, legend and words agree with what compaction does;
log lines and the progress bar do not interleave.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from defrag import cli, viz
from defrag.benchmarks import runner
from defrag.demo import SCENARIO, Scenario, run_demo
from defrag.driver import cuda_driver_usable, default_emulated_driver
from defrag.pool import Pool
from defrag.traces.format import ALLOC, FREE, PHASE, Trace
from defrag.units import format_bytes

from ..terminal import on_a_terminal

NO_GPU = pytest.mark.skipif(cuda_driver_usable()[0], reason="a GPU is present: this checks the no-GPU behaviour")
README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
PAGE = default_emulated_driver().granularity


def _one_line_exit_2(capsys, argv) -> str:
    """Run `defrag argv`: exit 2, one line on stderr naming the command, nothing on stdout (no work done)."""
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith(f"defrag {argv[0]}: error: "), err
    assert len(err.splitlines()) == 1 and "Traceback" not in captured.err
    assert captured.out == "", "the command did work before refusing its arguments"
    return err


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "a-file"
    path.write_text("not a folder\n")
    return path


@pytest.fixture
def trace_path(tmp_path):
    return Trace([(ALLOC, 0, 4096), (PHASE, "p"), (FREE, 0)], name="tiny").save(tmp_path / "tiny.jsonl")


# ---------------------------------------------------------------------- demo: bad arguments
@pytest.mark.parametrize("args,fragment", [
    (["--capacity", "abc"], "--capacity must be a byte count"),
    (["--capacity", "1MiB"], "smaller than one page"),
    (["--capacity", "64TiB"], "is more than the emulated device has"),
    (["--capacity", "8MiB"], "too small for the demo's scenario"),
    (["--device", "gpu"], "--device 'gpu' is not a device"),
])
def test_demo_bad_arguments_are_one_line_and_exit_2(capsys, tmp_path, args, fragment):
    err = _one_line_exit_2(capsys, ["demo", "--device", "emulated", "--out", str(tmp_path), *args])
    assert fragment in err
    assert not (tmp_path / "defrag-demo.png").exists()


def test_demo_out_under_a_file_is_refused_before_the_demo_runs(capsys, a_file):
    err = _one_line_exit_2(capsys, ["demo", "--device", "emulated", "--capacity", "32MiB",
                                    "--out", str(a_file / "pictures")])
    assert str(a_file) in err and "not a folder" in err


def test_demo_minimum_capacity_is_computed_from_the_scenario(capsys, tmp_path, monkeypatch):
    minimum = SCENARIO.min_capacity(PAGE)
    assert minimum % PAGE == 0
    err = _one_line_exit_2(capsys, ["demo", "--device", "emulated", "--out", str(tmp_path),
                                    "--capacity", str(minimum - PAGE)])
    assert f"needs {format_bytes(minimum)} or more" in err
    # A scenario with caches twice as large strands more per page: its own minimum, in its own words.
    bigger = Scenario(layers=2 * SCENARIO.layers)
    assert bigger.min_capacity(PAGE) != minimum
    monkeypatch.setattr("defrag.demo.SCENARIO", bigger)
    err = _one_line_exit_2(capsys, ["demo", "--device", "emulated", "--out", str(tmp_path),
                                    "--capacity", str(bigger.min_capacity(PAGE) - PAGE)])
    assert f"needs {format_bytes(bigger.min_capacity(PAGE))} or more" in err
    # Pages holding at most one cache: nothing to pack, at any capacity.
    assert Scenario(tokens=(1 << 20,)).min_capacity(PAGE) is None


def test_demo_at_its_minimum_capacity_tells_the_whole_story(capsys, tmp_path):
    minimum = SCENARIO.min_capacity(PAGE)
    assert cli.main(["demo", "--device", "emulated", "--capacity", str(minimum), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "without compaction it fails" in out and "succeeded" in out
    assert (tmp_path / "defrag-demo.png").exists()


def test_run_demo_below_its_minimum_reports_instead_of_raising(capsys, tmp_path):
    # The library entry point does not check its arguments; when the request still
    # fails after the compaction it says so and returns 1 (no traceback).
    assert run_demo(device="emulated", capacity="6MiB", out=str(tmp_path)) == 1
    assert "ERROR: it still fails after the compaction" in capsys.readouterr().out


# ---------------------------------------------------------------------- --device in command-line terms
@NO_GPU
@pytest.mark.parametrize("argv", [
    ["demo", "--device", "cuda:0"],
    ["replay", "TRACE", "--capacity", "64MiB", "--device", "cuda:0"],
    ["bench", "--smoke", "--device", "cuda:0"],
])
def test_asking_for_a_gpu_without_one_answers_in_cli_terms(capsys, tmp_path, trace_path, argv):
    argv = [str(trace_path) if a == "TRACE" else a for a in argv]
    if argv[0] != "replay":
        argv += ["--out", str(tmp_path / "out")]
    err = _one_line_exit_2(capsys, argv)
    assert "no GPU is usable" in err and "--device emulated" in err
    assert "device='emulated'" not in err and "device=None" not in err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------- replay and bench: checked up front
def test_replay_capacity_the_device_cannot_reserve_is_one_line(capsys, trace_path):
    err = _one_line_exit_2(capsys, ["replay", str(trace_path), "--capacity", "100000TiB", "--device", "emulated"])
    assert "cannot set up a pool this large" in err and "--dry" in err


def test_replay_json_is_checked_before_the_replay_runs(capsys, trace_path, a_file, tmp_path):
    err = _one_line_exit_2(capsys, ["replay", str(trace_path), "--capacity", "64MiB", "--dry",
                                    "--json", str(a_file / "out.json")])
    assert "--json" in err and "not a folder" in err
    err = _one_line_exit_2(capsys, ["replay", str(trace_path), "--capacity", "64MiB", "--dry",
                                    "--json", str(tmp_path)])
    assert "is a folder" in err


def test_bench_out_under_a_file_is_one_line(capsys, a_file):
    err = _one_line_exit_2(capsys, ["bench", "--smoke", "--device", "emulated", "--out", str(a_file / "x")])
    assert "--out" in err and "not a folder" in err


def test_the_argument_checks_are_shared():
    # One helper each for sizes, devices and output paths, used by every command.
    for module in ("defrag/demo.py", "defrag/replay.py", "benchmarks/runner.py"):
        text = (README.parent / module).read_text()
        assert "from .arguments import" in text or "from defrag.arguments import" in text, module
        assert "device_arg(" in text and ("out_dir_arg(" in text or "out_file_arg(" in text), module
    assert "parse_size(args." not in (README.parent / "defrag/replay.py").read_text()


# ---------------------------------------------------------------------- bench --smoke: figures not judged
def _results(smoke: bool, met) -> dict:
    return {"smoke": smoke, "seconds": 1.0,
            "machine": {"emulated": True, "device_name": "emulated", "device": "emulated", "date": "d",
                        "cpus_usable": 1, "cpu": "cpu", "torch": "t", "numba": "n", "numba_cudasim": True,
                        "python": "p"},
            "benchmarks": {"b": {"what": "w", "status": "ok", "seconds": 0.1,
                                 "rows": [{"method": "m1", "goal": "g1", "goal_met": met},
                                          {"method": "m2", "goal": "g2", "goal_met": None}]}}}


def test_smoke_goal_verdicts_are_not_judged(tmp_path):
    lines = runner.summary_lines(_results(True, False))
    text = "\n".join(lines)
    assert text.count("smoke run: tiny sizes and repeats") == 1
    assert "NOT met" not in text and "g1 (method=m1): not judged (smoke)" in text and "g2 (method=m2): n/a here" in text
    runner.write_markdown(_results(True, False), tmp_path / "results.md")
    md = (tmp_path / "results.md").read_text()
    assert md.count("smoke run: tiny sizes and repeats") == 1 and "**no**" not in md and "not judged (smoke)" in md
    # A full run judges.
    text = "\n".join(runner.summary_lines(_results(False, False)))
    assert "smoke run" not in text and "g1 (method=m1): NOT met" in text


def test_bench_smoke_says_so_on_screen_once(capsys, tmp_path):
    assert cli.main(["bench", "--smoke", "--device", "emulated", "--only", "alloc_free", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("figures are for checking the runner, not for judging goals") == 1
    assert "NOT met" not in out and "not judged (smoke)" in out
    assert "figures are for checking the runner" in (tmp_path / "results.md").read_text()


# ---------------------------------------------------------------------- the picture and the words
def _fragmented_then_compacted():
    pool = Pool("emulated", capacity="32MiB", auto_compact=False)
    import torch

    ts = [pool.empty((256 << 10,), dtype=torch.uint8) for _ in range(32)]  # 8 per page
    kept = ts[::4]
    del ts
    before = pool.layout()
    report = pool.compact()
    return pool, kept, before, report, pool.layout()


def _legend(fig) -> list[str]:
    return [t.get_text() for leg in fig.legends for t in leg.get_texts()]


def test_legend_lists_only_the_states_in_the_picture():
    pool, kept, before, report, after = _fragmented_then_compacted()
    try:
        fig = viz.plot_compaction(before, after, report=report)
        labels = _legend(fig)
        assert viz.LABELS["live"] in labels and viz.LABELS["stranded"] in labels
        assert viz.LABELS["pinned"] not in labels and viz.LABELS["retired"] not in labels  # none in this pool
        if after["cached_pages"]:
            assert any(label.startswith("cached") for label in labels)
        # A page-filling tensor alone: no stranded space, no empty page either.
        import torch

        full = Pool("emulated", capacity="8MiB", auto_compact=False)
        x = full.empty((PAGE,), dtype=torch.uint8)
        labels = _legend(viz.plot_memory_map(full.layout()))
        assert labels == [viz.LABELS["live"], viz.LABELS["unmapped"]]
        full.pin(x)
        assert _legend(viz.plot_memory_map(full.layout()))[0] == viz.LABELS["pinned"]
        del x
        full.close()
    finally:
        del kept
        pool.close()


def test_the_picture_and_the_readme_say_what_compaction_does():
    pool, kept, before, report, after = _fragmented_then_compacted()
    try:
        fig = viz.plot_compaction(before, after, report=report)
        words = " ".join(t.get_text() for t in fig.texts).replace("\n", " ")
        assert "holes of fuller pages" in words and "does not slide" in words
    finally:
        del kept
        pool.close()
    readme = README.read_text()
    assert "into contiguous pages" not in readme
    assert "packs them\ninto fewer, fuller pages" in readme and "into one virtual range" in readme


# ---------------------------------------------------------------------- log lines and the progress bar
def _demo_argv(tmp_path) -> list[str]:
    return [sys.executable, "-m", "defrag", "demo", "--device", "emulated", "--capacity", "32MiB",
            "--out", str(tmp_path)]


def test_demo_log_has_no_progress_bar_mixed_into_it(tmp_path):
    # stdout and stderr to one pipe, as in `defrag demo > demo.log 2>&1`.
    proc = subprocess.run(_demo_argv(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    log = proc.stdout.decode()
    assert proc.returncode == 0, log
    assert "\r" not in log and "defrag compact:" not in log
    lines = log.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("== 3."))
    assert lines[at + 1].startswith("   Compaction (explicit")


def test_demo_on_a_terminal_draws_the_bar_on_its_own_line(tmp_path):
    screen, rc = on_a_terminal(_demo_argv(tmp_path), columns=120)
    assert rc == 0
    screen = screen.replace("\r\n", "\n")
    head, _, rest = screen.partition("== 3.")
    headline, _, rest = rest.partition("\n")
    bar, _, rest = rest.partition("\n")
    assert "pack the surviving caches" in headline and "defrag compact" not in headline
    assert bar.startswith("\rdefrag compact:") and "100%" in bar  # the bar, alone on its line
    assert rest.startswith("   Compaction (explicit")
    assert "defrag compact" not in head + rest


# ---------------------------------------------------------------------- argparse's own errors
@pytest.mark.parametrize("argv", [
    ["replay"],                                   # missing path and --capacity
    ["replay", "x.json"],                         # missing --capacity
    ["bench", "--smokes"],                        # unknown option
    ["demo", "--capacity"],                       # option without its value
])
def test_argparse_errors_are_one_line_too(capsys, argv):
    err = _one_line_exit_2(capsys, argv)
    assert "usage:" not in err and "--help" in err


def test_an_unknown_command_is_one_line(capsys):
    assert cli.main(["bogus"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("defrag: error: ") and len(err.splitlines()) == 1 and "invalid choice" in err


def test_help_still_prints_the_usage(capsys):
    assert cli.main(["replay", "--help"]) == 0
    assert "usage: defrag replay" in capsys.readouterr().out
