"""tests/forked.py: a scenario forked from the zygote ends as the same `python -c` run by subprocess would."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ..forked import ROOT, checkout_env, run_module, run_python

SCRIPT = r"""
import atexit, os, sys
atexit.register(lambda: print("atexit ran"))
print(__name__, sys.argv[1:], os.getcwd(), sys.stdin.read() == "")
print("to stderr", file=sys.stderr)
if sys.argv[1] == "raise":
    raise ValueError("boom")
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("how", ["0", "3", "raise"])
def test_a_forked_run_reports_what_a_fresh_interpreter_would(how):
    forked = run_python(SCRIPT, how)
    plain = subprocess.run([sys.executable, "-c", SCRIPT, how], capture_output=True, text=True, timeout=120,
                           env=checkout_env(), cwd=ROOT, stdin=subprocess.DEVNULL)
    assert forked.returncode == plain.returncode == (1 if how == "raise" else int(how))
    assert forked.stdout == plain.stdout and "atexit ran" in forked.stdout
    assert forked.stdout.startswith(f"__main__ ['{how}'] {ROOT} True")
    assert forked.stderr.startswith("to stderr")
    assert forked.stderr.rstrip().endswith("ValueError: boom") == (how == "raise")


def test_a_killed_child_and_a_timeout_are_reported_as_subprocess_does(tmp_path):
    assert run_python("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)").returncode == -11
    with pytest.raises(subprocess.TimeoutExpired):
        run_python("import time; print('started', flush=True); time.sleep(60)", timeout=2)
    after = run_python("import sys; print(sys.argv[1])", "still serving", cwd=str(tmp_path))
    assert after.returncode == 0 and after.stdout == "still serving\n"
    assert run_python("import os; print(os.getcwd())", cwd=str(tmp_path)).stdout.strip() == str(tmp_path)


def test_a_script_file_runs_as_python_file_would(tmp_path):
    script = tmp_path / "example.py"
    code = "import sys\nprint(sys.argv, __file__ == sys.argv[0])\nraise SystemExit(sys.argv[1])\n"
    script.write_text(code)
    forked = run_python(code, "7", path=str(script), cwd=str(tmp_path))
    assert forked.returncode == 1 and forked.stderr == "7\n"  # SystemExit("7"): printed, exit 1, as python does
    assert forked.stdout == f"{[str(script), '7']} True\n"


def test_a_module_runs_as_python_m_would():
    forked = run_module("defrag", "frobnicate")  # a usage error: argparse's prog, message and exit status
    plain = subprocess.run([sys.executable, "-m", "defrag", "frobnicate"], capture_output=True, text=True,
                           timeout=120, env=checkout_env(), cwd=ROOT, stdin=subprocess.DEVNULL)
    assert forked.returncode == plain.returncode == 2
    assert forked.stdout == plain.stdout and forked.stderr == plain.stderr and "invalid choice" in forked.stderr
    shown = run_module("defrag", "--help")
    assert shown.returncode == 0 and shown.stdout.startswith("usage: defrag")
