"""`defrag run`: an unmodified program with every allocation in a pool (defrag/run.py).

A run is a process of its own (it replaces PyTorch's CPU allocator process-wide),
forked from the test zygote (tests/forked.py); bad arguments are checked
in-process, since they are refused before anything is installed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from defrag import cli, fastpath

from ..forked import run_python

needs_native = pytest.mark.skipif(fastpath.setting() == "off", reason="DEFRAG_FASTPATH=0: no native allocator")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUMMARY = re.compile(r"^defrag run: exit (\d+) in [\d.]+ s on emulated · peak live .+ · peak reserved .+ · "
                     r"stranded at exit (?:0 B|[\d.]+ \S+ \((?:<1|\d+)% of reserved\)) · (\d+) OOMs? · "
                     r"(\d+) compactions? · (\d+) allocations? in the pool$")


def run(argv, cwd, defrag=True):
    """`defrag run --device emulated ARGV` (`python -m defrag run`, forked from the test zygote: tests/forked.py)
    or `python ARGV` (a fresh interpreter) in `cwd`: (exit code, stdout, stderr)."""
    if defrag:
        proc = defrag_run("--capacity", "256MiB", *argv, cwd=cwd)
    else:
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=240, cwd=cwd, env=env)
    assert "terminate called" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr
    return proc.returncode, proc.stdout, proc.stderr


def defrag_run(*argv, cwd, unset=()) -> subprocess.CompletedProcess:
    """`python -m defrag run --device emulated ARGV` in `cwd`, forked from the test zygote, with the variables
    `unset` removed before the command line starts (defrag reads DEFRAG_* when it uses them)."""
    code = (f"import os, runpy\nfor name in {tuple(unset)!r}:\n    os.environ.pop(name, None)\n"
            "runpy.run_module('defrag', run_name='__main__', alter_sys=True)\n")
    return run_python(code, "run", "--device", "emulated", *argv, cwd=str(cwd), timeout=240)


def split_summary(stderr: str):
    """The program's own stderr and the summary line defrag run printed last."""
    lines = stderr.splitlines()
    assert lines and SUMMARY.match(lines[-1]), f"no summary line at the end:\n{stderr}"
    return "\n".join(lines[:-1]), SUMMARY.match(lines[-1])


PROGRAM = textwrap.dedent("""
    import sys, torch
    print("argv", sys.argv, __name__, __file__.endswith("prog.py"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    loss = model(torch.randn(8, 32)).square().mean()
    loss.backward()
    print("loss", loss.item(), model[0].weight.grad.sum().item())
    if sys.argv[1:2] == ["raise"]:
        def inner():
            raise ValueError("the program's own error")
        inner()
    sys.exit(int(sys.argv[1]) if sys.argv[1:2] and sys.argv[1].isdigit() else None)
""")


@needs_native
@pytest.mark.parametrize("argv", [["prog.py", "7", "--capacity", "x"], ["prog.py", "raise"], ["-m", "prog", "3"]],
                         ids=["exit-code-and-its-own-options", "uncaught-exception", "module"])
def test_the_program_prints_and_exits_as_under_python(tmp_path, argv):
    """Same stdout, same stderr (traceback from the program's first frame), same exit code; then one summary line."""
    (tmp_path / "prog.py").write_text(PROGRAM)
    want = run(argv, tmp_path, defrag=False)
    code, out, err = run(argv, tmp_path)
    program_err, summary = split_summary(err)
    assert (code, out, program_err.strip()) == (want[0], want[1], want[2].strip())
    assert int(summary.group(1)) == code and int(summary.group(4)) > 0  # the program's tensors were the pool's
    if argv[1:2] == ["raise"]:
        assert code == 1 and program_err.splitlines()[1].startswith(f'  File "{tmp_path / "prog.py"}"')


@needs_native
def test_every_tensor_is_the_pools_an_oom_goes_on_and_the_report_says_so(tmp_path):
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        import torch, defrag
        made = defrag.fastpath.module.cpu_allocator_made
        pool = defrag.cpu_allocator.installed()
        assert pool is not None and pool.capacity == 256 << 20
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
        opt = torch.optim.Adam(model.parameters())
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(16, 128)).logsumexp(1).mean().backward()
            opt.step()
        tensors = [*model.parameters(), *(p.grad for p in model.parameters())]
        tensors += [t for state in opt.state.values() for t in state.values() if t.dim()]
        assert len(tensors) == 16 and all(made(t) for t in tensors)
        try:
            torch.empty(1 << 30, dtype=torch.uint8)
        except torch.OutOfMemoryError as exc:
            print("OOM:", "cannot allocate" in str(exc))
        print("after", torch.ones(1000).sum().item(), pool.stats()["num_ooms"])
        # What the pool shows of itself works in install mode too: summary, snapshot, layout and picture.
        import sys
        from defrag import viz
        layout = pool.layout()
        kinds = {b["state"] for b in layout["blocks"]}
        shown = ("Allocated memory" in pool.summary() and sum(s["allocated_size"] for s in pool.snapshot()["segments"])
                 == pool.stats()["allocated_bytes.all.current"] and kinds == {"live"}
                 and not any(b["pinned"] for b in layout["blocks"])  # PyTorch's blocks move at safe points
                 and bool(viz.plot_memory_map(layout, sys.argv[1])))
        print("shown", shown)
    """))
    report = tmp_path / "out" / "report.json"
    report.parent.mkdir()
    code, out, err = run(["--report", str(report), "train.py", str(tmp_path / "map.png")], tmp_path)
    assert code == 0 and out.splitlines() == ["OOM: True", "after 1000.0 1", "shown True"], err
    assert (tmp_path / "map.png").stat().st_size > 10_000
    _, summary = split_summary(err)
    assert summary.group(2) == "1"
    data = json.loads(report.read_text())
    figures = data["summary"]
    assert figures["exit_code"] == 0 and figures["ooms"] == 1 and figures["capacity_bytes"] == 256 << 20
    params = (128 * 256 + 256 + 256 * 8 + 8) * 4
    assert 4 * params <= figures["peak_live_bytes"] <= figures["peak_reserved_bytes"] <= 256 << 20
    assert data["stats"]["allocated_bytes.all.peak"] == figures["peak_live_bytes"]
    assert data["allocator"]["installed"] and data["allocator"]["ooms"] == 1 and data["allocator"]["blocks"] > 16
    assert data["program"] == {"script": "train.py", "module": None, "args": [str(tmp_path / "map.png")]}


@pytest.mark.parametrize("argv, message", [
    (["--bogus", "x.py"], "unknown option --bogus"),
    (["missing.py"], "cannot open the script missing.py: no such file"),
    ([], "no program to run"),
    (["--capacity"], "--capacity needs a value"),
    (["--capacity", "lots", "{prog}"], "--capacity must be a byte count"),
    (["--capacity", "1024TiB", "--device", "emulated", "{prog}"], "is more than the emulated device has"),
    (["--device", "tpu", "{prog}"], "--device 'tpu' is not a device"),
    (["--report", "{tmp}/no/such/folder/r.json", "{prog}"], "cannot write there"),
    (["-m"], "-m needs a module name"),
    (["-m", "no_such_module_anywhere.sub"], "no module named 'no_such_module_anywhere'"),
])
def test_bad_arguments_are_one_line_and_exit_2_before_anything_runs(tmp_path, capsys, argv, message):
    prog = tmp_path / "prog.py"
    prog.write_text("raise SystemExit('the program must not run')\n")
    argv = [a.format(prog=prog, tmp=tmp_path) for a in argv]
    assert cli.main(["run", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1 and message in captured.err, captured.err
    assert captured.err.startswith("defrag run: error: ")


def test_help_names_the_options_and_the_two_forms(capsys):
    assert cli.main(["run", "--help"]) == 0
    out = capsys.readouterr().out
    assert "script.py [args ...]" in out and "-m module [args ...]" in out
    assert all(flag in out for flag in ("--capacity", "--device", "--report"))


@needs_native
def test_the_guide_example_runs_as_written(tmp_path):
    """docs/guide.md section 2: its train.py under its `defrag run` line prints its console block."""
    from .test_guide_examples import EXAMPLES, GUIDE, matches

    section = "2. Your program, unmodified: `defrag run`"
    (program,) = [e for e in EXAMPLES if e.section == section]
    (tmp_path / "train.py").write_text(program.code)
    text = GUIDE.read_text().split(f"## {section}", 1)[1]
    console = text.split("```console\n", 1)[1].split("```", 1)[0].splitlines()
    command, expected = console[0], "\n".join(console[1:]) + "\n"
    assert command.startswith("$ defrag run ")
    argv = command[len("$ defrag run "):].split()
    proc = defrag_run(*argv, cwd=tmp_path, unset=("DEFRAG_EMULATED_CAPACITY", "DEFRAG_EMULATED_GRANULARITY"))
    assert proc.returncode == 0, proc.stderr
    assert matches(expected, proc.stdout + proc.stderr), f"printed:\n{proc.stdout}{proc.stderr}"
    assert json.loads((tmp_path / "mem.json").read_text())["summary"]["peak_live_bytes"] > 0


@needs_native
def test_the_programs_recorded_history_replays_with_its_own_peaks(tmp_path):
    """`--record`: every allocation of an unmodified training run, written as a snapshot; `defrag replay`
    reads it back and finds the run's own peak live, with nothing live before the first event."""
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        import torch
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
        opt = torch.optim.AdamW(model.parameters())
        for _ in range(4):
            x = torch.randn(128, 256)
            opt.zero_grad()
            (model(x) - x).square().mean().backward()
            opt.step()
    """))
    code, _, err = run(["--record", "hist.pickle", "--report", "mem.json", "train.py"], tmp_path)
    assert code == 0, err
    figures = json.loads((tmp_path / "mem.json").read_text())["summary"]
    out = tmp_path / "replay.json"
    assert cli.main(["replay", str(tmp_path / "hist.pickle"), "--dry", "--json", str(out)]) == 0
    (device,) = json.loads(out.read_text())["devices"]
    meta, stats = device["trace"]["meta"], device["trace"]["stats"]
    assert meta["initial_allocs"] == 0 and meta["pre_trace_frees"] == 0  # recorded from before the first allocation
    assert stats["allocs"] == stats["frees"] == figures["allocations"] > 100  # every one of the program's, in and out
    # The trace holds the bytes PyTorch asked for; the pool counts them rounded to 512 B.
    assert figures["peak_live_bytes"] - 512 * stats["peak_live_blocks"] <= stats["peak_live_bytes"] <= \
        figures["peak_live_bytes"]
    defrag_row = next(r for r in device["results"] if r["allocator"] == "defrag")
    assert defrag_row["completed"] and defrag_row["peak_live_bytes"] == stats["peak_live_bytes"]


FRAGMENTER = textwrap.dedent("""
    import torch
    ts = [torch.empty(4 << 20, dtype=torch.uint8) for _ in range(200)]  # 800 MiB
    ts.sort(key=lambda t: t.data_ptr())
    for i, t in enumerate(ts):
        t.fill_(i % 251)
    keep = {i: t for i, t in enumerate(ts) if i % 5 == 0}  # one of every five, by address
    del ts, t
    big = torch.empty(512 << 20, dtype=torch.uint8).fill_(7)
    print("served", int(big[:: 1 << 20].sum()), all(bool((t == i % 251).all()) for i, t in keep.items()))
""")


@needs_native
def test_a_program_that_fragments_pytorchs_allocator_completes_under_defrag_run(tmp_path):
    """Every block PyTorch's ops make is pinned under `defrag run`, yet a request larger than any free run
    is stitched from the pages the program freed; its recorded history replayed shows PyTorch's caching
    allocator (as modelled) running out of memory at the same capacity."""
    (tmp_path / "frag.py").write_text(FRAGMENTER)
    proc = defrag_run("--capacity", "1GiB", "--record", "frag.pickle", "frag.py", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["served", str(7 * 512), "True"], proc.stdout
    assert "0 OOMs" in proc.stderr.splitlines()[-1]
    out = tmp_path / "replay.json"
    assert cli.main(["replay", str(tmp_path / "frag.pickle"), "--dry", "--capacity", "1GiB", "--json", str(out)]) == 0
    (device,) = json.loads(out.read_text())["devices"]
    rows = {r["allocator"]: r for r in device["results"]}
    assert rows["defrag"]["completed"] and rows["defrag"]["ooms"] == 0
    # PyTorch's caching allocator, modelled: every 20 MiB segment keeps one tensor, so no segment can go.
    assert rows["torch (model)"]["ooms"] > 0 and not rows["torch (model)"]["completed"], rows["torch (model)"]


def test_a_tiny_programs_overhead_is_in_bytes_not_thousands_of_percent():
    """Less than a page live (a 10-float program): one 2 MiB page reserved is the whole overhead, said in
    bytes; a program with pages of live data keeps its percentage."""
    from defrag.run import summary_line

    base = {"exit_code": 0, "seconds": 0.1, "device": "emulated", "capacity_bytes": 1 << 30, "page_size_bytes": 2 << 20,
            "stranded_at_exit_bytes": 0, "reserved_at_exit_bytes": 0, "fragmentation_at_exit": 0.0, "ooms": 0,
            "compactions": 0, "allocations": 2}
    tiny = summary_line({**base, "peak_live_bytes": 1024, "peak_reserved_bytes": 2 << 20,
                         "reserved_over_live": (2 << 20) / 1024})
    assert "%  over" not in tiny and "% over live" not in tiny
    assert "peak reserved 2.00 MiB (+2.00 MiB over live, which is under one 2.00 MiB page)" in tiny
    big = summary_line({**base, "peak_live_bytes": 100 << 20, "peak_reserved_bytes": 102 << 20,
                        "reserved_over_live": 1.02})
    assert "peak reserved 102.00 MiB (+2.0% over live)" in big
    assert SUMMARY.match(tiny) and SUMMARY.match(big)
