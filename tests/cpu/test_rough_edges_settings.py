"""Every DEFRAG_* environment variable is parsed in one place and refused plainly (defrag/settings.py).

A value defrag cannot use is one line naming the variable and the value,
exit code 2 from every command before it does anything, and a
`SettingError` from the library where it reads the variable; `defrag
doctor` checks and lists them; docs/api.md lists every one; no variable is
read anywhere without being in `settings.VARIABLES`.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

from defrag import cli, fastpath, settings, tensors
from defrag.driver.emulated import DEFAULT_CAPACITY, DEFAULT_GRANULARITY
from defrag.errors import SettingError
from defrag.extensions import CppExtension

ROOT = pathlib.Path(__file__).resolve().parents[2]

# A value of each variable that defrag cannot use, and a word its one-line error must hold.
JUNK = {
    "DEFRAG_EMULATED_CAPACITY": ("1MiB", "less than one page"),  # parses, but a device of no page at all
    "DEFRAG_EMULATED_GRANULARITY": ("3MiB", "power of two"),
    "DEFRAG_MEMORYLESS_CAPACITY": ("junk", "is not a size"),
    "DEFRAG_MEMORYLESS_GRANULARITY": ("7", "power of two"),
    "DEFRAG_FASTPATH": ("banana", "is not a switch"),
    "DEFRAG_FORCE_NO_SWAP_DATA_PTR": ("sometimes", "is not a switch"),
    "DEFRAG_NO_STORAGE_EXT": ("maybe", "is not a switch"),
    "DEFRAG_EXT_DIR": ("{file}/sub", "is a file, not a folder"),
    "DEFRAG_KERNEL_CACHE": ("{file}", "is a file, not a folder"),
    "DEFRAG_CUDA_BACKEND": ("perhaps", "is not a switch"),
    "DEFRAG_LIBNVVM": ("{tmp}/no-libnvvm.so", "is not a file"),
    "DEFRAG_GPU_REHEARSAL": ("maybe", "is not a switch"),
    "DEFRAG_GPU_FIGURES": ("{tmp}/no-folder/figures.jsonl", "does not exist"),
    "DEFRAG_SNAPSHOTS": ("{tmp}/no-snapshots", "is not a folder"),
}


@pytest.fixture
def clean_env(monkeypatch):
    """No DEFRAG_* variable set, whatever the session's environment holds."""
    for name in list(os.environ):
        if name.startswith("DEFRAG_"):
            monkeypatch.delenv(name)
    return monkeypatch


def _junk(name: str, tmp_path) -> str:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    return JUNK[name][0].format(file=a_file, tmp=tmp_path)


def test_every_variable_has_a_junk_value_checked_here():
    assert set(JUNK) == set(settings.VARIABLES)


@pytest.mark.parametrize("name", sorted(JUNK))
def test_a_junk_value_is_one_line_naming_it_and_exit_2_from_doctor(name, tmp_path, clean_env, capsys):
    value = _junk(name, tmp_path)
    clean_env.setenv(name, value)
    assert cli.main(["doctor"]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("defrag doctor: error: ") and f"{name}={value!r}" in line and JUNK[name][1] in line
    assert "use " in line and "unset it" in line  # what it accepts, and the way back to the default
    assert captured.out == ""


@pytest.mark.parametrize("name", sorted(JUNK))
def test_the_library_raises_the_same_error_where_it_reads_the_variable(name, tmp_path, clean_env):
    clean_env.setenv(name, _junk(name, tmp_path))
    (problem,) = settings.problems()
    with pytest.raises(SettingError, match=re.escape(name)) as raised:
        settings.check_all()
    assert str(raised.value) == str(problem)


@pytest.mark.parametrize("argv", [["run", "prog.py"], ["replay", "trace.jsonl", "--capacity", "64MiB"],
                                  ["demo", "--device", "emulated"], ["bench", "--smoke"], ["doctor"]])
def test_every_command_refuses_a_junk_variable_before_doing_anything(argv, tmp_path, clean_env, capsys):
    clean_env.setenv("DEFRAG_FASTPATH", "banana")
    clean_env.chdir(tmp_path)
    (tmp_path / "prog.py").write_text("open('ran', 'w').write('the program ran')\n")
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and not (tmp_path / "ran").exists() and not (tmp_path / "bench-out").exists()
    (line,) = captured.err.strip().splitlines()
    assert line == (f"defrag {argv[0]}: error: DEFRAG_FASTPATH='banana' is not a switch: use 1 or 0 (also "
                    f"true/false, yes/no, on/off, any case), or wait (the same as 1), or unset it (default 1)")


def test_two_junk_variables_are_two_lines(clean_env, capsys):
    clean_env.setenv("DEFRAG_FASTPATH", "banana")
    clean_env.setenv("DEFRAG_NO_STORAGE_EXT", "maybe")
    assert cli.main(["doctor"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and "DEFRAG_FASTPATH" in lines[0] and "DEFRAG_NO_STORAGE_EXT" in lines[1]


def test_the_readers_parse_what_the_table_says(clean_env, tmp_path):
    for word, on in (("1", True), ("TRUE", True), ("yes", True), ("On", True), ("0", False), ("false", False),
                     ("No", False), ("off", False)):
        clean_env.setenv("DEFRAG_FASTPATH", word)
        assert settings.fastpath() is on and fastpath.setting() == ("on" if on else "off")
    clean_env.delenv("DEFRAG_FASTPATH")
    assert settings.fastpath() is True and settings.no_storage_ext() is False
    clean_env.setenv("DEFRAG_FASTPATH", "")  # empty means unset
    assert settings.fastpath() is True
    clean_env.setenv("DEFRAG_EMULATED_CAPACITY", "512MiB")
    assert settings.device_size("emulated", "capacity") == 512 << 20
    clean_env.setenv("DEFRAG_EXT_DIR", str(tmp_path / "new" / "folder"))
    assert settings.ext_dir() == str(tmp_path / "new" / "folder") and not (tmp_path / "new").exists()
    clean_env.setenv("DEFRAG_GPU_REHEARSAL", "1")
    assert settings.gpu_rehearsal() is True


SWITCH_READERS = {"DEFRAG_FASTPATH": settings.fastpath,
                  "DEFRAG_FORCE_NO_SWAP_DATA_PTR": settings.force_no_swap_data_ptr,
                  "DEFRAG_NO_STORAGE_EXT": settings.no_storage_ext, "DEFRAG_CUDA_BACKEND": settings.cuda_backend,
                  "DEFRAG_GPU_REHEARSAL": settings.gpu_rehearsal}


def test_every_switch_is_read_by_the_one_parser_and_accepts_the_same_spellings(clean_env):
    """Issue 46: DEFRAG_GPU_REHEARSAL=yes was refused where DEFRAG_FASTPATH=yes was accepted."""
    assert set(SWITCH_READERS) == {n for n, v in settings.VARIABLES.items() if v.accepts.startswith(settings.SWITCH)}
    for name, read in SWITCH_READERS.items():
        for word, on in (("1", True), ("0", False), ("true", True), ("FALSE", False), ("Yes", True), ("no", False),
                         ("ON", True), ("off", False), (" yes ", True)):
            clean_env.setenv(name, word)
            assert read() is on, (name, word)
        clean_env.setenv(name, "maybe")
        with pytest.raises(SettingError) as raised:
            read()
        assert str(raised.value) == (f"{name}='maybe' is not a switch: use {settings.VARIABLES[name].accepts}, or "
                                     f"unset it (default {settings.VARIABLES[name].default})")
        assert "\n" not in str(raised.value)
        clean_env.delenv(name)
        assert read() is (settings.VARIABLES[name].default == "1")


def test_fastpath_wait_is_accepted_as_the_guide_says(clean_env, capsys):
    """Issue 46: docs/guide.md's DEFRAG_FASTPATH=wait was refused as 'not a switch'; it reads as on (the
    first pool waits for the native build, as every pool does)."""
    for word in ("wait", "WAIT"):
        clean_env.setenv("DEFRAG_FASTPATH", word)
        assert settings.fastpath() is True and fastpath.setting() == "on" and settings.problems() == []
        assert fastpath.wait() is fastpath.module is not None
    guide = (ROOT / "docs" / "guide.md").read_text()
    assert "DEFRAG_FASTPATH=wait" in guide
    for other in ("DEFRAG_GPU_REHEARSAL", "DEFRAG_CUDA_BACKEND"):  # "wait" is the fast path's word only
        clean_env.setenv(other, "wait")
        with pytest.raises(SettingError, match="is not a switch"):
            SWITCH_READERS[other]()


def test_the_defaults_are_the_drivers(clean_env):
    assert settings.device_size("emulated", "capacity") == DEFAULT_CAPACITY
    assert settings.device_size("emulated", "granularity") == DEFAULT_GRANULARITY
    assert settings.device_size("memoryless", "capacity") == DEFAULT_CAPACITY


def test_a_junk_storage_switch_is_refused_where_the_swap_mode_is_read(clean_env):
    clean_env.setenv("DEFRAG_NO_STORAGE_EXT", "maybe")
    tensors._forget_swap_mode()
    try:
        with pytest.raises(SettingError, match=r"DEFRAG_NO_STORAGE_EXT='maybe'"):
            tensors.swap_mode()
    finally:
        clean_env.delenv("DEFRAG_NO_STORAGE_EXT")
        tensors._forget_swap_mode()


def test_doctor_lists_the_variables_set_and_names_an_unknown_one(clean_env, capsys):
    clean_env.setenv("DEFRAG_EMULATED_CAPACITY", "8GiB")
    clean_env.setenv("DEFRAG_FASTPTH", "0")  # a typo of DEFRAG_FASTPATH
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert f"all {len(settings.VARIABLES)} DEFRAG_* variables checked" in out
    assert "DEFRAG_EMULATED_CAPACITY='8GiB': the emulated device's memory" in out
    assert f"the other {len(settings.VARIABLES) - 1} unset: defaults" in out
    assert "DEFRAG_FASTPTH is set, but defrag reads no such variable" in out


def test_every_defrag_variable_in_the_tree_is_one_of_the_settings():
    """grep the sources, tests and docs for DEFRAG_*: each name is in settings.VARIABLES (a variable read
    somewhere without being validated there would be silently accepted)."""
    names = set()
    for folder in ("defrag", "kernels", "benchmarks", "tests", "docs"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".md") and path.is_file():
                names.update(re.findall(r"\bDEFRAG_[A-Z][A-Z_]*[A-Z]\b", path.read_text(errors="replace")))
    names.update(re.findall(r"\bDEFRAG_[A-Z][A-Z_]*[A-Z]\b", (ROOT / "README.md").read_text()))
    assert names - {"DEFRAG_FASTPTH"} == set(settings.VARIABLES)  # the typo this file's own test sets


def test_no_module_reads_a_defrag_variable_itself():
    """Only defrag/settings.py reads DEFRAG_* from the environment (benchmarks/gpu_check.py, which cannot
    import defrag, is the documented exception)."""
    pattern = re.compile(r"environ(?:\.get)?\s*[\[(]\s*[\"']DEFRAG_|getenv\(\s*[\"']DEFRAG_")
    readers = [str(p.relative_to(ROOT)) for folder in ("defrag", "kernels", "benchmarks")
               for p in (ROOT / folder).rglob("*.py") if pattern.search(p.read_text())]
    assert sorted(readers) == ["benchmarks/gpu_check.py"]


def test_api_md_lists_every_variable_with_its_values():
    api = (ROOT / "docs" / "api.md").read_text()
    table = api.split("## Environment variables", 1)[1]
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `(DEFRAG_[A-Z_]+)` \|.*$", table, re.M)}
    assert set(rows) == set(settings.VARIABLES)
    for name, row in rows.items():
        assert row.count("|") == 5, row  # variable, values, default, what it changes


def test_an_unusable_build_folder_is_named_not_the_compiler(clean_env, tmp_path):
    """DEFRAG_EXT_DIR under a file: the build folder is the problem, so the error names the variable and
    does not send the user to install a compiler; the extension remembers no failure for it."""
    (tmp_path / "a-file").write_text("x")
    clean_env.setenv("DEFRAG_EXT_DIR", str(tmp_path / "a-file" / "sub"))
    ext = CppExtension("defrag_probe_ext", "probe", "int x;", "a probe", "no time")
    with pytest.raises(SettingError, match=r"DEFRAG_EXT_DIR=.*is a file, not a folder"):
        ext.load()
    assert ext.failure() is None


def test_defrag_run_with_an_unusable_build_folder_names_the_folder(tmp_path):
    (tmp_path / "x.py").write_text("print('ran')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEFRAG_")}
    env["DEFRAG_EXT_DIR"] = "/proc/nope" if os.path.isdir("/proc") else str(tmp_path / "x.py" / "nope")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "defrag", "run", "--device", "emulated", "--capacity", "64MiB",
                           "x.py"], cwd=tmp_path, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("defrag run: error: DEFRAG_EXT_DIR=") and "compiler" not in line
