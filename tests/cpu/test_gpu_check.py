"""benchmarks/gpu_check.py and benchmarks/_bare_checkout.py, on a machine without a GPU.

The GPU machine gets a bare copy of the checkout, nothing pip-installed: the
check must import that copy (not an installed defrag), run in stages with
their own timeouts, write its report before and after every stage, and say
plainly when there is no GPU.
"""

from __future__ import annotations

import atexit
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from defrag.benchmarks import _bare_checkout, gpu_check
from defrag.driver import cuda_driver_usable

from .. import forked

ROOT = Path(__file__).resolve().parents[2]
NO_GPU = pytest.mark.skipif(cuda_driver_usable()[0], reason="a GPU is present: this checks the no-GPU behaviour")


def _bare_copy(dest: Path) -> Path:
    """A bare copy of the checkout (what `git archive` would give) at `dest`, outside any installed path."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for folder in ("defrag", "kernels", "benchmarks", "tests"):
        shutil.copytree(ROOT / folder, dest / folder, ignore=ignore)
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / f, dest / f)
    return dest


@pytest.fixture(scope="module")
def bare(tmp_path_factory) -> Path:
    return _bare_copy(tmp_path_factory.mktemp("bare") / "defrag-checkout")


def _bare_gpu_check(folder: Path):
    """The documented command, typed without --out, from a bare copy made in `folder`, run in `folder`/run:
    (the copy, the folder it ran in, the process)."""
    bare = _bare_copy(folder / "defrag-checkout")
    cwd = folder / "run"
    cwd.mkdir()
    proc = subprocess.run([sys.executable, str(bare / "benchmarks" / "gpu_check.py"), "--smoke", "--only", "stitching"],
                          cwd=cwd, capture_output=True, text=True, timeout=300)
    return bare, cwd, proc


def start_early(items):
    """The bare copy's GPU check (15 s or more) starts with the session, beside the other tests (tests/forked.py)."""
    if not cuda_driver_usable()[0] and any(item.name == "test_gpu_check_from_a_bare_copy_without_a_gpu"
                                           for item in items):
        folder = Path(tempfile.mkdtemp(prefix="defrag-gpu-check-bare-"))
        atexit.register(shutil.rmtree, folder, True)
        forked.start_early("gpu_check bare", _bare_gpu_check, folder)


def test_ptx_limits_of_driver_versions():
    assert gpu_check.max_ptx_isa(13000) == (9, 0)  # the GPU machine's driver
    assert gpu_check.max_ptx_isa(13050) == (9, 5)  # what NVVM 13.5 emits
    assert gpu_check.max_ptx_isa(12080) == (8, 7) and gpu_check.max_ptx_isa(12060) == (8, 5)
    assert gpu_check.max_ptx_isa(12070) == (8, 5)  # no 12.7: the newest older one
    assert gpu_check.max_ptx_isa(0) is None
    assert gpu_check.parse_ptx_version("//\n.version 9.5\n.target sm_90\n") == (9, 5)
    assert (9, 5) > gpu_check.max_ptx_isa(13000)


def test_toolkit_root_of_a_libnvvm(tmp_path):
    lib = tmp_path / "cuda-13.0" / "nvvm" / "lib64"
    lib.mkdir(parents=True)
    (lib / "libnvvm.so.4").write_bytes(b"")
    assert gpu_check.toolkit_root(str(lib / "libnvvm.so.4")) == str(tmp_path / "cuda-13.0")


def test_the_bootstrap_imports_the_bare_copy_not_the_installed_one(bare, tmp_path):
    script = tmp_path / "where.py"
    script.write_text("import json, sys\nsys.path.insert(0, sys.argv[1])\nimport _bare_checkout as b\n"
                      "import defrag.kernels.move, defrag.benchmarks.runner\n"
                      "print(json.dumps({**b.imported_from(), 'move': defrag.kernels.move.__file__}))\n")
    proc = subprocess.run([sys.executable, str(bare / "benchmarks" / "_bare_checkout.py"), str(script),
                           str(bare / "benchmarks")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    where = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(Path(f).resolve().is_relative_to(bare.resolve()) for f in where.values()), where
    assert where["defrag.kernels"].endswith("kernels/__init__.py")


def test_the_bootstrap_refuses_when_another_defrag_is_already_imported(bare):
    import defrag  # this process's defrag is the main checkout's

    assert not Path(defrag.__file__).resolve().is_relative_to(bare.resolve())
    with pytest.raises(RuntimeError, match="already imported from elsewhere"):
        _bare_checkout.install(bare)
    assert not any(getattr(f, "root", None) == bare.resolve() for f in sys.meta_path)


def _check(tmp_path, **kw) -> "gpu_check.Check":
    args = gpu_check.build_parser().parse_args(["--out", str(tmp_path)])
    for k, v in kw.items():
        setattr(args, k, v)
    return gpu_check.Check(args)


def test_a_hanging_stage_times_out_and_the_report_says_so(tmp_path):
    check = _check(tmp_path, budget=60)
    t0 = __import__("time").monotonic()
    stage = check.run_stage("sleepy", [sys.executable, "-c", "import time; print('started', flush=True); "
                                       "time.sleep(60)"], timeout=1)
    assert __import__("time").monotonic() - t0 < 30
    assert stage["status"] == "timed out" and stage["returncode"] is None and "started" in stage["output_tail"]
    check.write()
    report = json.loads((tmp_path / "gpu_report.json").read_text())
    assert report["stages"][0]["status"] == "timed out" and not report["complete"]
    assert "| sleepy | **timed out** |" in (tmp_path / "gpu_report.md").read_text()
    assert check.finish() == 1
    assert json.loads((tmp_path / "gpu_report.json").read_text())["complete"] is True


def test_the_report_is_written_before_each_stage_and_the_budget_is_kept(tmp_path):
    check = _check(tmp_path, budget=60)
    reader = "import json, sys; print('seen:', json.load(open(sys.argv[1]))['stages'][-1]['status'])"
    stage = check.run_stage("reader", [sys.executable, "-c", reader, str(tmp_path / "gpu_report.json")], timeout=30)
    assert stage["status"] == "passed" and "seen: running" in stage["output_tail"]
    check.budget = check.elapsed() + 1  # under MIN_STAGE_SECONDS left
    late = check.run_stage("late", [sys.executable, "-c", "pass"], timeout=30)
    assert late["status"] == "skipped" and late["summary"].startswith("skipped: out of time budget")
    # Out of time is not a failure of the code: exit 0, and the verdict says what did not run and why.
    assert check.finish() == 0
    report = json.loads((tmp_path / "gpu_report.json").read_text())
    assert "out of time budget" in report["verdict"] and "late" in report["verdict"]
    assert "FAILED" not in report["verdict"] and "had errors" not in report["verdict"]


def _stage(name, status, summary=""):
    return {"name": name, "status": status, "seconds": 1.0, "timeout_s": 60, "returncode": 0 if status == "passed"
            else 1, "log": f"stage-{name}.log", "summary": summary, "output_tail": ""}


def test_an_env_stage_superseded_by_the_rerun_with_another_libnvvm_is_not_a_failure(tmp_path, monkeypatch):
    """PTX too new in the first env stage, the re-run with a libNVVM the driver accepts passes: GPU check passed."""
    monkeypatch.delenv("DEFRAG_LIBNVVM", raising=False)
    check = _check(tmp_path, budget=60)
    check.report["probe"]["gpu"] = True
    check.report["stages"].append(_stage("env", "failed", "libNVVM emits PTX 9.5 (TOO NEW)"))
    check.report["env"] = {"libnvvm": {"fix": {"DEFRAG_LIBNVVM": "/usr/local/cuda-13.0/nvvm/lib64/libnvvm.so.4",
                                               "CUDA_HOME": "/usr/local/cuda-13.0", "ptx_version": [9, 0]}}}
    rerun = []

    def fake_env(label="env"):
        rerun.append(label)
        check.report["env"] = None  # (the real stage stores the re-run's full environment here)
        check.report["stages"].append(_stage(label, "passed", "libNVVM emits PTX 9.0"))

    monkeypatch.setattr(check, "do_env", fake_env)
    check.maybe_fix_nvvm()
    assert rerun == ["env (with DEFRAG_LIBNVVM)"]
    assert check.env["DEFRAG_LIBNVVM"].endswith("libnvvm.so.4") and check.env["CUDA_HOME"] == "/usr/local/cuda-13.0"
    check.report["stages"].append(_stage("tests", "passed"))
    first = check.report["stages"][0]
    assert first["status"] == "superseded" and "env (with DEFRAG_LIBNVVM)" in first["summary"]
    assert check.finish() == 0
    report = json.loads((tmp_path / "gpu_report.json").read_text())
    assert report["verdict"].startswith("GPU check passed"), report["verdict"]
    assert "| env | superseded |" in (tmp_path / "gpu_report.md").read_text()


def test_an_env_stage_whose_rerun_also_fails_still_fails_the_check(tmp_path, monkeypatch):
    monkeypatch.delenv("DEFRAG_LIBNVVM", raising=False)
    check = _check(tmp_path, budget=60)
    check.report["probe"]["gpu"] = True
    check.report["stages"].append(_stage("env", "failed"))
    check.report["env"] = {"libnvvm": {"fix": {"DEFRAG_LIBNVVM": "/x/nvvm/lib64/libnvvm.so.4", "ptx_version": [9, 0]}}}
    def fake_env(label="env"):
        check.report["env"] = None
        check.report["stages"].append(_stage(label, "failed"))

    monkeypatch.setattr(check, "do_env", fake_env)
    check.maybe_fix_nvvm()
    assert [s["status"] for s in check.report["stages"]] == ["superseded", "failed"]
    assert check.finish() == 1
    assert "env (with DEFRAG_LIBNVVM) failed" in check.report["verdict"]


def test_a_missing_libnvvm_still_searches_for_one_the_driver_accepts(monkeypatch):
    """numba finds no libNVVM at all: the candidates are still probed, and the one found is used."""
    searched = []

    def fake_best(candidates, arch, limit, skip=None):
        searched.append((list(candidates), arch, limit))
        return {"DEFRAG_LIBNVVM": candidates[0], "CUDA_HOME": "/opt/cuda-13.0", "ptx_version": [9, 0],
                "driver_load": "ok"}

    monkeypatch.setattr(gpu_check, "best_libnvvm", fake_best)
    nv = {"arch": "compute_90", "error": "DynamicLibNotFoundError: libnvvm.so not found",
          "candidates": ["/opt/cuda-13.0/nvvm/lib64/libnvvm.so.4"]}
    problems, warnings = [], []
    gpu_check.assess_libnvvm(nv, {"driver_cuda_version": "13.0", "driver_max_ptx": [9, 0]}, True,
                             problems, warnings)
    assert searched == [(["/opt/cuda-13.0/nvvm/lib64/libnvvm.so.4"], "compute_90", (9, 0))]
    assert nv["fix"]["DEFRAG_LIBNVVM"] == "/opt/cuda-13.0/nvvm/lib64/libnvvm.so.4"
    assert any("libNVVM" in p for p in problems)
    # PTX too new: searched too; a libNVVM that works: not searched.
    searched.clear()
    too_new = {"arch": "compute_90", "path": "/site/nvvm.so", "realpath": "/site/nvvm.so", "ptx_version": [9, 5],
               "candidates": ["/opt/cuda-13.0/nvvm/lib64/libnvvm.so.4"]}
    gpu_check.assess_libnvvm(too_new, {"driver_cuda_version": "13.0", "driver_max_ptx": [9, 0]}, True, [], [])
    assert too_new["ptx_ok"] is False and len(searched) == 1 and too_new["fix"]
    searched.clear()
    fine = {"arch": "compute_90", "path": "/a/nvvm.so", "ptx_version": [9, 0], "driver_load": "ok", "candidates": []}
    gpu_check.assess_libnvvm(fine, {"driver_max_ptx": [9, 0]}, True, p := [], [])
    assert fine["ptx_ok"] is True and not searched and "fix" not in fine and not p


def test_out_defaults_to_a_folder_under_the_current_directory(capsys):
    assert gpu_check.build_parser().parse_args([]).out == "gpu-report"
    with pytest.raises(SystemExit) as info:
        gpu_check.main(["--help"])
    assert info.value.code == 0
    assert "./gpu-report" in " ".join(capsys.readouterr().out.split())


def test_junit_counts_failures_and_skip_reasons(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="a" name="ok"/>'
                   '<testcase classname="a" name="bad"><failure message="assert 1 == 2"/></testcase>'
                   '<testcase classname="a" name="s"><skipped message="needs CUDA"/></testcase>'
                   '</testsuite></testsuites>')
    got = gpu_check.parse_junit(xml)
    assert got["counts"] == {"passed": 1, "failed": 1, "errors": 0, "skipped": 1}
    assert got["failures"] == [{"test": "a::bad", "message": "assert 1 == 2"}]
    assert got["skip_reasons"] == ["needs CUDA"]


def test_an_unknown_benchmark_is_a_usage_error(tmp_path):
    assert gpu_check.main(["--out", str(tmp_path), "--only", "no_such_bench"]) == 2


def test_the_libnvvm_probe_reports_the_ptx_version():
    candidates = gpu_check.libnvvm_candidates()
    if not candidates:
        pytest.skip("no libNVVM on this machine")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--nvvm-probe", candidates[0]],
                          capture_output=True, text=True, timeout=120)
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    if res.get("error"):
        pytest.skip(f"libNVVM {candidates[0]} unusable here: {res['error']}")
    assert len(res["ptx_version"]) == 2 and res["ptx_head"][0].startswith(".version")
    assert Path(res["realpath"]) == Path(candidates[0]).resolve()


@NO_GPU
def test_gpu_check_from_a_bare_copy_without_a_gpu(tmp_path):
    """The documented command, typed without --out: the report goes to ./gpu-report, exit 0, NO GPU PRESENT,
    every stage passes from the bare copy's own files. (--out and --no-tests, on the same code: the installed
    route's run, test_bench_smoke.py::test_gpu_check_on_a_cpu_says_no_gpu_and_exits_0.)"""
    bare, cwd, proc = forked.early("gpu_check bare", _bare_gpu_check, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "NO GPU PRESENT" in proc.stdout
    out = cwd / "gpu-report"
    assert str(out / "gpu_report.md") in proc.stdout
    report = json.loads((out / "gpu_report.json").read_text())
    assert report["complete"] and report["probe"]["gpu"] is False and report["probe"]["reason"]
    assert [(s["name"], s["status"]) for s in report["stages"]] == [
        ("tests:first", "passed"), ("env", "passed"), ("tests", "passed"), ("bench:stitching", "passed")]
    first = report["tests_first"]  # the backend's and the launcher's tests, before anything else
    assert first["ran"] and first["returncode"] == 0 and all(f"tests/gpu/{f}" in first["command"]
                                                             for f in gpu_check.FIRST_TESTS)
    assert "--ignore=tests/gpu/test_kernels_gpu.py" in _tests_command(out)
    assert all(Path(f).resolve().is_relative_to(bare.resolve()) for f in report["env"]["imported_from"].values())
    tests = report["tests"]
    assert tests["ran"] and tests["returncode"] == 0 and tests["mode"] == "skipped"
    assert tests["counts"]["skipped"] > 0 and not tests["counts"].get("failed")
    assert report["benchmarks"]["device"] == "emulated"
    assert report["benchmarks"]["results"]["stitching"]["status"] == "ok"
    assert (out / "bench" / "results.json").exists() and (out / "stage-tests.log").exists()
    assert "NO GPU PRESENT" in (out / "gpu_report.md").read_text().splitlines()[2]


def _tests_command(out: Path) -> str:
    return (out / "stage-tests.log").read_text().splitlines()[0]


def test_the_backend_and_launcher_tests_exist_and_run_first(tmp_path, monkeypatch):
    """Issue 45: the CUDA backend's and the launcher's GPU tests are the first stage, before env."""
    assert all((ROOT / "tests" / "gpu" / f).is_file() for f in gpu_check.FIRST_TESTS)
    assert next(iter(gpu_check.FIVE_MINUTE_PLAN)) == "tests:first"
    ran = []
    monkeypatch.setattr(gpu_check.Check, "run_stage", lambda self, name, cmd, timeout, env=None: (
        ran.append((name, cmd, timeout)) or self.report["stages"].append(
            {"name": name, "status": "passed", "seconds": 0.0, "timeout_s": timeout, "returncode": 0,
             "log": f"stage-{name}.log", "summary": "", "output_tail": ""}) or self.report["stages"][-1]))
    monkeypatch.setattr(gpu_check, "quick_gpu_probe", lambda: (False, "test"))
    monkeypatch.setattr(gpu_check, "missing_packages", lambda: [])
    gpu_check.main(["--out", str(tmp_path)])  # the stub stages write no data: the env stage fails
    names = [n for n, _c, _t in ran]
    assert names[:2] == ["tests:first", "env"] and names[2] == "tests", names
    first_cmd = ran[0][1]
    assert [a for a in first_cmd if a.startswith("tests/gpu")] == [f"tests/gpu/{f}" for f in gpu_check.FIRST_TESTS]
    assert "model:native" not in names and "dropped to fit 300 s" in (tmp_path / "gpu_report.md").read_text()
    # every stage of the default run within the five-minute plan, and the plan within 5 minutes
    plan = gpu_check.FIVE_MINUTE_PLAN
    assert sum(plan.values()) <= 300 and gpu_check.FIVE_MINUTES <= 300
    assert names == list(plan), names
    assert all(t <= plan[n] for n, _c, t in ran)


def test_the_default_budget_is_five_minutes():
    args = gpu_check.build_parser().parse_args([])
    assert not args.full
    assert sum(gpu_check.FIVE_MINUTE_PLAN.values()) <= gpu_check.FIVE_MINUTES <= 300


@pytest.mark.parametrize("raw,on", [("1", True), ("yes", True), ("TRUE", True), ("on", True), ("0", False),
                                     ("no", False), ("", False)])
def test_the_rehearsal_switch_uses_defrags_switch_parser(monkeypatch, raw, on):
    monkeypatch.setenv("DEFRAG_GPU_REHEARSAL", raw)
    assert gpu_check.rehearsal_switch() is on


def test_a_bad_rehearsal_switch_is_a_usage_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("DEFRAG_GPU_REHEARSAL", "maybe")
    monkeypatch.setattr(gpu_check, "missing_packages", lambda: [])
    assert gpu_check.main(["--out", str(tmp_path / "r")]) == 2
    assert "DEFRAG_GPU_REHEARSAL='maybe'" in capsys.readouterr().err and not (tmp_path / "r").exists()


def test_the_numba_cuda_floor_has_the_types_the_kernels_use():
    """kernels/_device.py types its GPU intrinsics with numba.cuda.types, which numba-cuda 0.20 lacks."""
    import re

    from numba.cuda import types

    floor = re.search(r'"numba-cuda>=([\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert tuple(map(int, floor.split("."))) >= (0, 21), f"numba-cuda>={floor} admits 0.20"
    used = set(re.findall(r"\btypes\.(\w+)", (ROOT / "kernels" / "_device.py").read_text()))
    assert {"Array", "int64", "uint64"} <= used
    assert all(hasattr(types, name) for name in used), sorted(n for n in used if not hasattr(types, n))


def test_a_python_without_defrags_packages_is_told_so_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "REQUIRED_MODULES", ("torch", "defrag_no_such_module", "defrag_none.sub"))
    assert gpu_check.missing_packages() == ["defrag_no_such_module", "defrag_none.sub"]
    assert gpu_check.main(["--smoke", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "defrag_no_such_module, defrag_none.sub" in err and "nothing was run" in err
    assert not (tmp_path / "r").exists()
