"""`defrag bench --smoke` and the GPU check script, end to end on the emulated device.

These check that every registered benchmark produces rows (or says why it
skipped), that the outputs exist and agree with each other, and that nothing
claims a GPU figure where there is no GPU. They never assert on timings.
"""

from __future__ import annotations

import atexit
import json
import math
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from defrag import cli
from defrag.benchmarks import runner
from defrag.driver import cuda_driver_usable

from .. import forked

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _smoke_run(out: Path):
    """`defrag bench --smoke --device emulated --out OUT`, a program of its own: (exit code, OUT, results)."""
    proc = subprocess.run([sys.executable, "-m", "defrag", "bench", "--smoke", "--device", "emulated", "--out", str(out)],
                          capture_output=True, text=True, timeout=900, env=forked.checkout_env())
    results = out / "results.json"
    assert results.is_file(), f"exit {proc.returncode}, no results.json:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.returncode, out, json.loads(results.read_text())


def _folder(prefix: str) -> Path:
    out = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, out, True)
    return out


def start_early(items):
    """The smoke run (about a minute), the GPU check's and the GPU install rows' children start with the
    session, beside the other tests (tests/forked.py)."""
    if any("smoke" in item.fixturenames for item in items):
        forked.start_early("bench --smoke", _smoke_run, _folder("defrag-bench-smoke-"))
    if any(item.name == "test_gpu_check_on_a_cpu_says_no_gpu_and_exits_0" for item in items):
        out = _folder("defrag-gpu-check-")
        forked.start_early("gpu_check installed", lambda: (_gpu_check_installed(out), out))
    if any(item.name == "test_the_gpu_install_rows_code_runs_rehearsed_on_the_cpu" for item in items):
        from defrag.benchmarks import bench_install  # its children do the work; this thread waits for them

        forked.start_early("gpu install rows", bench_install._bench_separate, "emulated", True)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    return forked.early("bench --smoke", _smoke_run, tmp_path_factory.mktemp("bench"))


def test_every_registered_benchmark_has_rows_or_a_reason(smoke):
    rc, out, results = smoke
    assert rc == 0, (out / "results.md").read_text()
    assert list(results["benchmarks"]) == list(runner.REGISTRY)
    for name, res in results["benchmarks"].items():
        assert res["status"] in ("ok", "skipped"), f"{name}: {res.get('error')}"
        if res["status"] == "ok":
            assert res["rows"], name
            assert all(isinstance(r, dict) and r for r in res["rows"]), name
        else:
            assert res["reason"].strip(), name


def test_markdown_and_plots_exist(smoke):
    _, out, results = smoke
    md = (out / "results.md").read_text()
    for name, res in results["benchmarks"].items():
        assert f"## {name}" in md
        if res["status"] == "ok" and runner.REGISTRY[name].plot:
            png = out / res["plot"]
            assert png.stat().st_size > 1000, name
            assert png.read_bytes()[:8] == PNG_MAGIC, name
            assert f"]({res['plot']})" in md


def test_machine_info_says_emulated(smoke):
    _, _, results = smoke
    m = results["machine"]
    assert m["emulated"] is True and m["device"] == "emulated"
    assert m["torch"] and m["date"] and "emulated" in m["device_name"]
    assert results["smoke"] is True


def test_no_gpu_figures_or_gpu_goals_on_the_emulated_device(smoke):
    _, _, results = smoke
    for name, res in results["benchmarks"].items():
        for r in res["rows"]:
            assert r.get("backend") != "cuda" and r.get("device") not in ("cuda", "cuda:0"), (name, r)
            if "goal" in r:
                assert r["goal_met"] in (True, False, None), (name, r)
                if "GPU" in r["goal"] and "emulated" not in r["goal"]:
                    assert r["goal_met"] is None, f"{name}: a GPU goal was judged without a GPU: {r}"


def test_ratios_are_computed_from_the_same_rows(smoke):
    _, _, results = smoke
    b = results["benchmarks"]
    for r in b["alloc_free"]["rows"]:
        assert math.isclose(r["ratio_x"], r["us_per_op"] / r["baseline_us_per_op"], rel_tol=1e-9)
        assert r["goal_met"] == (r["ratio_x"] <= 3.0)
    for r in b["copy_bandwidth"]["rows"]:
        if "gbps" in r:
            assert math.isclose(r["ratio_x"], r["gbps"] / r["baseline_gbps"], rel_tol=1e-9)
    comp = {r["method"]: r for r in b["compaction"]["rows"]}
    whole = comp["pool.compact() whole call"]
    assert whole["moved_bytes"] > 0 and whole["pages_after"] < whole["pages_before"]
    assert whole["same_moves_every_round"] is True
    assert math.isclose(whole["ratio_x"], whole["gbps"] / whole["baseline_gbps"], rel_tol=1e-9)
    mixed = [r for r in b["alloc_mixed"]["rows"] if "us_per_op" in r]
    assert [r["pattern"] for r in mixed] == ["mixed, steady", "mixed, first calls of a fresh process",
                                             "mixed, from a C++ thread"]
    for r in mixed:
        assert math.isclose(r["ratio_x"], r["us_per_op"] / r["baseline_us_per_op"], rel_tol=1e-9)
        assert r["goal_met"] == (r["ratio_x"] <= 1.5)
    assert 0 <= mixed[0]["python_path_calls"] <= mixed[0]["calls"]
    if mixed[0]["fast_path"] == "ready":  # built here: the fresh processes load it too
        assert mixed[1]["fast_path"] == "attached"
    assert mixed[2]["calls"] == mixed[0]["calls"] and mixed[2]["python_trips"] >= 0
    (over,) = b["compaction_overhead"]["rows"]
    assert over["moved_tensors"] > 0 and over["same_moves_every_round"] is True
    assert over["dropped"] == round(0.7 * over["tensors"]) and over["moved_bytes"] > 0
    assert over["min_us_per_tensor"] <= over["us_per_tensor"]
    assert over["goal_met"] == (over["us_per_tensor"] <= 5.0)
    rand = {r["method"]: r for r in b["compaction_random"]["rows"]}["pool.compact() whole call"]
    assert rand["moved_bytes"] > 0 and rand["pages_after"] < rand["pages_before"]
    assert rand["same_moves_every_round"] is True
    assert math.isclose(rand["ratio_x"], rand["gbps"] / rand["baseline_gbps"], rel_tol=1e-9)
    assert math.isclose(rand["ratio_vs_per_move_x"], rand["per_move_baseline_ms"] / rand["ms"], rel_tol=1e-9)
    assert rand["goal_met"] == (rand["ratio_x"] >= 0.7)
    inst = b["install"]
    if inst["status"] == "ok":  # skipped without the native fast path (DEFRAG_FASTPATH=0): install needs it
        steps = [r for r in inst["rows"] if "ms" in r]
        assert [r["workload"] for r in steps] == ["training step: mlp", "training step: transformer",
                                                  "training step: conv"]
        for r in steps:
            assert math.isclose(r["ratio_x"], r["ms"] / r["baseline_ms"], rel_tol=1e-9)
            assert r["min_pair_ratio_x"] <= r["median_pair_ratio_x"] <= r["max_pair_ratio_x"]
            assert r["goal_met"] == (r["median_pair_ratio_x"] <= 1.1)
            assert r["pool_blocks_per_step"] > 0 and r["declined"] == 0, r  # the steps' tensors were the pool's
        calls = [r for r in inst["rows"] if "ns_per_op" in r]
        assert len(calls) == 4
        for r in calls:
            assert math.isclose(r["ratio_x"], r["ns_per_op"] / r["baseline_ns_per_op"], rel_tol=1e-9)
            assert r["pool_blocks"] > 0 and r["declined"] == 0, r
    for r in b["workloads"]["rows"]:
        if "peak_live_bytes" in r:
            assert r["peak_reserved_bytes"] >= r["peak_live_bytes"] > 0, r
            assert math.isclose(r["reserved_over_live_x"], r["peak_reserved_bytes"] / r["peak_live_bytes"])


def test_only_filters_and_unknown_names_are_refused(tmp_path, capsys):
    assert cli.main(["bench", "--smoke", "--device", "emulated", "--only", "stitching", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert list(results["benchmarks"]) == ["stitching"]
    assert cli.main(["bench", "--smoke", "--only", "no_such_bench", "--out", str(tmp_path / "x")]) == 2
    assert "no_such_bench" in capsys.readouterr().err


def test_a_failing_benchmark_is_reported_and_the_others_still_run(tmp_path, monkeypatch):
    def bench_boom(device, smoke):
        raise RuntimeError("boom")

    monkeypatch.setattr(runner, "bench_boom", bench_boom, raising=False)
    monkeypatch.setitem(runner.REGISTRY, "boom", runner.Benchmark("boom", "runner:bench_boom", "always fails"))
    rc = cli.main(["bench", "--smoke", "--device", "emulated", "--only", "boom,stitching", "--out", str(tmp_path)])
    assert rc == 1
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["benchmarks"]["boom"]["status"] == "error"
    assert "RuntimeError: boom" in results["benchmarks"]["boom"]["error"]
    assert results["benchmarks"]["stitching"]["status"] == "ok"


@pytest.mark.skipif(cuda_driver_usable()[0], reason="a GPU is present: this checks the no-GPU behaviour")
def test_asking_for_a_gpu_without_one_is_a_clear_error(tmp_path, capsys):
    assert cli.main(["bench", "--smoke", "--device", "cuda:0", "--out", str(tmp_path)]) == 2
    assert "no GPU is usable" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


@pytest.mark.skipif(cuda_driver_usable()[0], reason="a GPU is present: this checks the no-GPU behaviour")
def _gpu_check_installed(out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "defrag.benchmarks.gpu_check", "--out", str(out), "--smoke",
                           "--only", "stitching", "--no-tests"], capture_output=True, text=True, timeout=300)


def test_gpu_check_on_a_cpu_says_no_gpu_and_exits_0(tmp_path):
    """The installed module's route; its tests stage (pytest tests/gpu, all skipped here) is the same code as
    the bare copy's, which test_gpu_check.py::test_gpu_check_from_a_bare_copy_without_a_gpu runs."""
    proc, out = forked.early("gpu_check installed", lambda out: (_gpu_check_installed(out), out), tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "NO GPU PRESENT" in proc.stdout
    md = (out / "gpu_report.md").read_text()
    assert "NO GPU PRESENT" in md.splitlines()[2]
    report = json.loads((out / "gpu_report.json").read_text())
    assert report["complete"] and report["probe"]["gpu"] is False and report["probe"]["reason"]
    assert [(s["name"], s["status"]) for s in report["stages"]] == [("env", "passed"), ("bench:stitching", "passed")]
    assert report["benchmarks"]["device"] == "emulated"
    assert (out / "bench" / "results.json").exists()


def test_the_summary_prints_each_goal_once(smoke):
    """Two rows with the same goal (threads: 2 and 4 workers) read as two different lines, never the same twice."""
    _, _, results = smoke
    lines = runner.summary_lines(results)
    goals = [ln for ln in lines if ln.lstrip().startswith("goal [")]
    assert goals and len(goals) == len(set(goals)), "\n".join(goals)
    threads = [ln for ln in goals if ln.lstrip().startswith("goal [threads]")]
    assert len(threads) == len(results["benchmarks"]["threads"]["rows"])
    assert all("workers=" in ln for ln in threads), threads


def test_goal_rows_that_no_label_tells_apart_are_one_goal():
    rows = [{"goal": "no crash", "goal_met": True}, {"goal": "no crash", "goal_met": True},
            {"goal": "no crash", "goal_met": None}, {"goal": "fast", "goal_met": False}]
    goals = runner.goals_of({"benchmarks": {"b": {"rows": rows}}})
    assert [(g["goal"], g["met"]) for g in goals] == [("no crash", True), ("fast", False)]
    bad = runner.goals_of({"benchmarks": {"b": {"rows": rows + [{"goal": "no crash", "goal_met": False}]}}})
    assert [(g["goal"], g["met"]) for g in bad] == [("no crash", False), ("fast", False)]


def test_bench_help_lists_the_names_only_takes(capsys):
    try:
        rc = cli.main(["bench", "--help"])
    except SystemExit as exc:  # argparse's own exit, where main lets it through
        rc = exc.code
    assert rc in (0, None)
    text = " ".join(capsys.readouterr().out.split())
    for name in runner.REGISTRY:
        assert name in text, name
    assert cli.main(["bench", "--smoke", "--only", "stitching,nope", "--out", "unused-bench-out"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "nope" in err and "stitching" in err


@pytest.mark.skipif(__import__("defrag").fastpath.setting() == "off", reason="DEFRAG_FASTPATH=0: install needs it")
def test_the_gpu_install_rows_code_runs_rehearsed_on_the_cpu():
    """The GPU rows' children (install vs plain, each in processes of its own) on the emulated device: the
    code the GPU check runs, its rows shaped as on a GPU, the installed side's allocations in its pool."""
    from defrag.benchmarks import bench_install

    step, alloc = forked.early("gpu install rows", bench_install._bench_separate, "emulated", True)
    assert step["pool_allocs"] > 0 and step["ms"] > 0 and step["baseline_ms"] > 0 and step["ratio_x"] > 0
    assert "emulated rehearsal" in step["workload"] and alloc["calls"] == bench_install.SEPARATE_SMOKE["calls"]
    assert alloc["ns_per_op"] > 0 and alloc["baseline_ns_per_op"] > 0


def test_the_engine_rows_move_every_byte_and_the_trigger_serves_its_request(smoke):
    """The copy engines' rows on the emulated device (the GPU's launch path against host twins): bytes
    checked in every row; the automatic trigger's request needed a compaction and got one."""
    _, _, results = smoke
    b = results["benchmarks"]
    cross = b["engine_crossover"]["rows"]
    assert all(r["bytes_ok"] for r in cross if "size_bytes" in r)
    assert cross[-1]["constant_bytes"] > 0
    (wave,) = b["mixed_wave"]["rows"]
    assert wave["bytes_ok"] and wave["goal_met"] is None
    rows = {r["method"]: r for r in b["compaction_gpu"]["rows"]}
    assert rows["pool.compact()"]["bytes_ok"] and rows["pool.compact()"]["moved_tensors"] > 0
    auto = rows["automatic trigger serving a request"]
    assert auto["request_bytes"] > auto["free_before_bytes"]
    assert auto["served"] and auto["automatic_compactions"] >= 1 and auto["bytes_ok"] and auto["goal_met"]
