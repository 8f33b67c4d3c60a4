"""`defrag run`: a program's syntax error and its Ctrl-C print as `python prog.py` prints them (issue 46 item 7).

The program runs in-process through `defrag.run._run_program` (no pool: what is
checked is how the program is run and its end reported); `python` itself runs
the same program in a subprocess, without torch, for what it prints.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from defrag import run

PROGRAMS = {
    "syntax-error": ("prog.py", "x = 1\ndef f(:\n    pass\n"),
    "ctrl-c": ("prog.py", textwrap.dedent("""
        def step():
            raise KeyboardInterrupt  # what Ctrl-C raises where the program is
        step()
    """)),
    "module-syntax-error": ("prog_mod.py", "y = [1,\nz = 2 +\n"),
    # A syntax error in a module the program imports: the program's own frames, then the file and caret.
    "imported-syntax-error": ("prog.py", "import broken\n"),
}


@pytest.mark.parametrize("case", list(PROGRAMS))
def test_it_prints_what_python_prints_with_its_exit_code(tmp_path, capsys, monkeypatch, case):
    name, source = PROGRAMS[case]
    (tmp_path / name).write_text(source)
    (tmp_path / "broken.py").write_text("def g(:\n")
    monkeypatch.chdir(tmp_path)
    module = case.startswith("module")
    argv = ["-m", name[:-3]] if module else [str(tmp_path / name)]
    want = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    code = run._run_program(run.parse(argv))
    err = capsys.readouterr().err
    # Python ends an uncaught KeyboardInterrupt by SIGINT (-2 here, 130 in a shell); defrag run exits 130.
    assert (code, want.returncode) == ((130, -2) if case == "ctrl-c" else (1, 1)), (code, want.returncode)
    assert "defrag" not in err and "runpy" not in err and "importlib" not in err, err
    if module:  # python -m prints runpy's and importlib's frames first; defrag run only the error itself
        at = f'  File "{tmp_path / name}"'
        assert err == at + want.stderr.split(at, 1)[1], f"defrag run printed:\n{err}\npython printed:\n{want.stderr}"
        assert "Traceback" not in err
    else:
        assert err == want.stderr, f"defrag run printed:\n{err}\npython printed:\n{want.stderr}"
    if case == "syntax-error":
        assert "Traceback" not in err and err.splitlines()[-1].startswith("SyntaxError: ")
    if case == "ctrl-c":
        assert err.startswith(f'Traceback (most recent call last):\n  File "{tmp_path / name}", line 4, in <module>')
