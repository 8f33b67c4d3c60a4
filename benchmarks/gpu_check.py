"""The GPU check: one command that runs tests/gpu and every benchmark, and writes one report.

    python -m defrag.benchmarks.gpu_check --out DIR [--smoke] [--only a,b] [--no-tests]

Steps:

1. probe: is a CUDA driver with a GPU usable here (`cuda_driver_usable`, and
   ``torch.cuda.is_available()``)? `defrag doctor`'s text goes in the report.
2. tests: ``python -m pytest tests/gpu`` in a subprocess, from the source
   checkout this module belongs to (its log in ``DIR/gpu_tests.log``, JUnit
   XML in ``DIR/gpu_tests.xml``). Without a GPU they skip, with the reason.
3. benchmarks: the `defrag bench` runner on ``cuda:0``, or, without a GPU, on
   the emulated device (``DIR/bench/``: results.json, results.md, plots).
4. report: ``DIR/gpu_report.md`` and ``DIR/gpu_report.json``.

Without a GPU the report says so in its first line, contains no GPU figure,
and the command exits 0 when everything it could run worked. Exit 1: a GPU
test failed or a benchmark raised; 2: bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path


def probe() -> dict:
    """Whether a GPU is usable, and why not; plus nvidia-smi's one-line view when it exists."""
    from defrag.driver import cuda_driver_usable

    ok, reason = cuda_driver_usable()
    info = {"gpu": False, "reason": reason, "device_name": None, "nvidia_smi": None}
    if ok:
        import torch

        if torch.cuda.is_available():
            info.update(gpu=True, device_name=torch.cuda.get_device_name(0), torch_cuda=torch.version.cuda)
        else:
            info["reason"] = (f"the CUDA driver works ({reason}) but torch {torch.__version__} cannot use it "
                              "(torch.cuda.is_available() is False: a CPU-only torch build?)")
    smi = shutil.which("nvidia-smi")
    if smi:  # read-only query; never changes any setting
        try:
            out = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
            info["nvidia_smi"] = (out.stdout or out.stderr).strip()
        except (OSError, subprocess.TimeoutExpired) as exc:
            info["nvidia_smi"] = f"nvidia-smi failed: {exc}"
    return info


def doctor_text() -> str:
    from defrag.cli import doctor

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        doctor(None)
    return buf.getvalue().strip()


def tests_dir() -> Path | None:
    """tests/gpu of the source checkout (this file is benchmarks/gpu_check.py in it), or of the cwd."""
    for root in (Path(__file__).resolve().parents[1], Path.cwd()):
        if (root / "tests" / "gpu").is_dir():
            return root
    return None


def run_gpu_tests(out: Path, timeout: float) -> dict:
    """pytest tests/gpu in a subprocess; returns counts, exit code and the summary line."""
    root = tests_dir()
    if root is None:
        return {"ran": False, "reason": "tests/gpu not found: run from a source checkout of defrag"}
    log, xml = out / "gpu_tests.log", out / "gpu_tests.xml"
    cmd = [sys.executable, "-m", "pytest", "tests/gpu", "-q", "-rA", "-p", "no:cacheprovider", f"--junitxml={xml}"]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=timeout)
        text, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        text = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        text += f"\n[gpu_check] pytest timed out after {timeout:.0f} s\n"
        code = None
    log.write_text(text)
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    summary = next((ln.strip("= ").strip() for ln in reversed(lines)
                    if re.search(r"\b(passed|failed|skipped|error|no tests ran)\b", ln)), lines[-1] if lines else "")
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", summary)}
    skip_reasons = sorted({m.strip() for m in re.findall(r"SKIPPED \[\d+\] [^:]+(?::\d+)?: (.*)", text)})
    return {"ran": True, "command": "python " + " ".join(cmd[1:]), "cwd": str(root), "returncode": code,
            "seconds": time.perf_counter() - t0, "summary": summary, "counts": counts,
            "skip_reasons": skip_reasons, "log": log.name, "junit": xml.name}


def write_report(report: dict, out: Path) -> None:
    (out / "gpu_report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    p, t, b = report["probe"], report["tests"], report["benchmarks"]
    lines = ["# defrag GPU check", ""]
    if p["gpu"]:
        lines.append(f"**GPU: {p['device_name']}** (torch CUDA {p.get('torch_cuda')}); {report['date']}")
    else:
        lines += [f"**NO GPU PRESENT** ({p['reason']}).",
                  "",
                  "Nothing in this report was measured on a GPU: the GPU tests skip, and the benchmarks below ran "
                  "on the emulated device (host memory, kernels under numba's CPU simulator). "
                  f"{report['date']}"]
    if p.get("nvidia_smi"):
        lines += ["", f"nvidia-smi: `{p['nvidia_smi']}`"]
    lines += ["", "## defrag doctor", "", "```", report["doctor"], "```", "", "## tests/gpu", ""]
    if not t.get("ran"):
        lines.append(f"Not run: {t.get('reason')}")
    else:
        state = "timed out" if t["returncode"] is None else f"exit {t['returncode']}"
        lines.append(f"`{t['command']}` ({state}, {t['seconds']:.1f} s): **{t['summary']}**")
        for reason in t["skip_reasons"][:5]:
            lines.append(f"- skipped: {reason}")
        lines.append(f"\nFull log: [{t['log']}]({t['log']})")
    lines += ["", f"## Benchmarks ({b['device']}, {'smoke' if b['smoke'] else 'full'} run, {b['seconds']:.1f} s)", ""]
    for name, res in b["results"].items():
        state = {"ok": f"{res['rows']} rows", "skipped": f"skipped: {res.get('reason')}",
                 "error": "**error** (see bench/results.md)"}[res["status"]]
        lines.append(f"- {name}: {state}")
    if b["goals"]:
        lines += ["", "| benchmark | goal | where | met |", "|---|---|---|---|"]
        for g in b["goals"]:
            met = "n/a on this device" if g["met"] is None else ("yes" if g["met"] else "**no**")
            lines.append(f"| {g['benchmark']} | {g['goal']} | {g['where']} | {met} |")
    lines += ["", "Tables and plots: [bench/results.md](bench/results.md)", ""]
    lines += ["## Verdict", "", report["verdict"], ""]
    (out / "gpu_report.md").write_text("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m defrag.benchmarks.gpu_check", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for gpu_report.md/.json, the test log and bench/")
    ap.add_argument("--smoke", action="store_true", help="benchmarks at smoke sizes")
    ap.add_argument("--only", default=None, help="comma-separated benchmark names (default: all)")
    ap.add_argument("--no-tests", action="store_true", help="do not run tests/gpu")
    ap.add_argument("--test-timeout", type=float, default=900.0, help="seconds allowed for tests/gpu (default 900)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from . import runner

    runner.prepare_simulator()  # only when no GPU works; before anything imports numba.cuda
    t0 = time.perf_counter()
    info = probe()
    print("GPU: " + (info["device_name"] if info["gpu"] else f"NO GPU PRESENT ({info['reason']})"), flush=True)
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "probe": info, "doctor": doctor_text()}

    if args.no_tests:
        report["tests"] = {"ran": False, "reason": "--no-tests"}
    else:
        print("tests/gpu ...", flush=True)
        report["tests"] = run_gpu_tests(out, args.test_timeout)
        print(f"tests/gpu: {report['tests'].get('summary') or report['tests'].get('reason')}", flush=True)

    device = "cuda:0" if info["gpu"] else "emulated"
    only = [n.strip() for n in (args.only or "").split(",") if n.strip()] or None
    try:
        results = runner.run(only, device=device, smoke=args.smoke, out=out / "bench")
    except ValueError as exc:
        print(f"gpu_check: {exc}", file=sys.stderr)
        return 2
    report["benchmarks"] = {
        "device": device, "smoke": results["smoke"], "seconds": results["seconds"],
        "machine": results["machine"], "goals": runner.goals_of(results),
        "results": {n: {"status": r["status"], "rows": len(r["rows"]), "reason": r.get("reason")}
                    for n, r in results["benchmarks"].items()},
    }
    bench_errors = [n for n, r in results["benchmarks"].items() if r["status"] == "error"]
    t = report["tests"]
    tests_failed = t.get("ran") and t.get("returncode") not in (0, 5)  # 5: no tests collected
    if info["gpu"]:
        verdict = ("GPU check passed: tests/gpu passed and every benchmark ran."
                   if not tests_failed and not bench_errors else
                   f"GPU check FAILED: tests {'failed' if tests_failed else 'passed'}; "
                   f"benchmark errors: {', '.join(bench_errors) or 'none'}.")
    else:
        verdict = ("No GPU present: GPU tests and GPU benchmarks were not run and no GPU figure is reported. "
                   "What could run here (the emulated benchmarks"
                   + (", tests/gpu collection and skips" if t.get("ran") else "") + ") "
                   + ("ran without errors." if not bench_errors and not tests_failed else
                      f"had errors: benchmarks {', '.join(bench_errors) or 'none'}; tests "
                      f"{'failed' if tests_failed else 'ok'}."))
    report["verdict"] = verdict
    report["seconds"] = time.perf_counter() - t0
    write_report(report, out)
    print(verdict)
    print(f"report: {(out / 'gpu_report.md').resolve()}")
    return 1 if (tests_failed or bench_errors) else 0


if __name__ == "__main__":
    sys.exit(main())
