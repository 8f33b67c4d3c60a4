"""`defrag run` with torchrun (issue 46 items 14, 15 and 16).

torchrun goes outside, `defrag run` inside each worker: `defrag run -m
torch.distributed.run ...` would run every worker outside any pool, so it is
refused with the command that works. Under torchrun (RANK, WORLD_SIZE > 1)
every rank writes its own report and history (mem.json -> mem.rank1.json),
which names the rank, and its summary line and out-of-memory message begin
with it; without --device each rank takes the GPU its LOCAL_RANK names.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

import defrag
from defrag import arguments, cli, fastpath, oom, run
from defrag.arguments import UsageError

from .conftest import KiB, MiB

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
needs_native = pytest.mark.skipif(fastpath.setting() == "off", reason="DEFRAG_FASTPATH=0: no native allocator")


# ---------------------------------------------------------------- item 14: torchrun goes outside
@pytest.mark.parametrize("argv, recipe", [
    (["--capacity", "1GiB", "-m", "torch.distributed.run", "--nproc-per-node", "2", "train.py", "--steps", "3"],
     "torchrun --nproc-per-node 2 --no-python defrag run --capacity 1GiB train.py --steps 3"),
    (["-m", "torch.distributed.launch", "--nproc_per_node=2", "--standalone", "-m", "pkg.train"],
     "torchrun --nproc_per_node=2 --standalone --no-python defrag run -m pkg.train"),
    (["--report", "mem.json", "/usr/local/bin/torchrun", "--nnodes", "1", "--nproc-per-node", "4", "train.py"],
     "torchrun --nnodes 1 --nproc-per-node 4 --no-python defrag run --report mem.json train.py"),
    (["torchrun"], "torchrun [its options] --no-python defrag run train.py [args]"),
], ids=["module-run", "module-launch", "torchrun-script", "no-program"])
def test_a_launcher_under_defrag_run_is_refused_with_the_command_that_works(tmp_path, monkeypatch, capsys, argv,
                                                                           recipe):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("raise SystemExit('the program must not run')\n")
    assert cli.main(["run", *argv]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert captured.out == "" and line.startswith("defrag run: error: "), line
    assert "starts torchrun's workers as new processes" in line and "outside any pool" in line, line
    assert f": {recipe} (or torchrun ... -m defrag run ...;" in line, line
    assert not (tmp_path / "mem.json").exists()


def test_other_programs_are_not_launchers():
    for argv in (["train.py"], ["-m", "torch.distributed"], ["torchrun.py"], ["-m", "torchrun"]):
        assert run._launcher_refusal(run.parse(argv)) is None


# ---------------------------------------------------------------- item 15: one report per rank
@pytest.mark.parametrize("env, rank", [
    ({"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}, (1, 2)),
    ({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}, None),  # one process: no rank named
    ({"LOCAL_RANK": "0"}, None),
    ({"RANK": "x", "WORLD_SIZE": "2"}, None),
    ({}, None),
])
def test_the_rank_is_read_from_the_launchers_environment(monkeypatch, env, rank):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert run.launched_rank() == rank


def test_each_rank_writes_its_own_file_and_its_lines_name_it():
    assert run._for_rank("out/mem.json", (1, 2)) == os.path.join("out", "mem.rank1.json")
    assert run._for_rank("hist.pickle", (0, 8)) == "hist.rank0.pickle"
    assert run._for_rank("report", (3, 4)) == "report.rank3"
    assert run._for_rank("mem.json", None) == "mem.json"
    figures = {"exit_code": 0, "seconds": 0.1, "device": "emulated", "capacity_bytes": 1 << 30,
               "page_size_bytes": 2 << 20, "peak_live_bytes": 4 << 20, "peak_reserved_bytes": 4 << 20,
               "reserved_over_live": 1.0, "stranded_at_exit_bytes": 0, "fragmentation_at_exit": 0.0, "ooms": 0,
               "compactions": 0, "allocations": 2}
    assert run.summary_line({**figures, "rank": 1, "world_size": 2}).startswith("defrag run [rank 1/2]: exit 0 in ")
    assert run.summary_line({**figures, "rank": None, "world_size": None}).startswith("defrag run: exit 0 in ")


def test_an_out_of_memory_error_inside_pytorchs_allocator_names_the_rank(make_pool):
    pool = make_pool("64MiB", granularity=2 * MiB)
    keep = [pool.empty(256 * KiB, dtype=torch.uint8) for _ in range(256)][::4]
    for t in keep:
        pool.pin(t)
    with pytest.raises(defrag.OutOfMemoryError) as err:
        pool.empty(40 * MiB, dtype=torch.uint8)
    oom.set_capacity_option("--capacity")
    try:
        plain = oom.refused_inside_allocator(err.value)
        oom.set_rank((1, 2))
        ranked = oom.refused_inside_allocator(err.value)
    finally:
        oom.set_rank(None)
        oom.set_capacity_option(None)
    assert ranked == "[rank 1/2] " + plain and plain.startswith("defrag ")


# ---------------------------------------------------------------- item 16: LOCAL_RANK's GPU
@pytest.fixture
def gpus(monkeypatch):
    """A machine with `n` GPUs as `device_arg` sees it; returns the device specs it opened."""
    import defrag.driver

    opened = []

    def with_gpus(n: int):
        monkeypatch.setattr(defrag.driver, "cuda_driver_usable",
                            lambda: (n > 0, f"{n} CUDA device(s)" if n else "no CUDA driver library"))
        monkeypatch.setattr(arguments, "gpu_count", lambda: n)
        monkeypatch.setattr(defrag.driver, "open_driver", lambda spec=None: opened.append(spec) or spec)
        return opened
    return with_gpus


def test_without_device_each_rank_takes_the_gpu_its_local_rank_names(gpus):
    opened = gpus(2)
    assert arguments.device_arg(None, local_rank="1") == "cuda:1"
    assert arguments.device_arg(None, local_rank="0") == "cuda:0"
    assert arguments.device_arg(None) is None  # no LOCAL_RANK: the default GPU, as before
    assert arguments.device_arg("cuda:0", local_rank="1") == "cuda:0"  # --device wins
    assert arguments.device_arg("emulated", local_rank="1") == "emulated"
    assert opened == ["cuda:1", "cuda:0", None, "cuda:0", "emulated"]


def test_a_local_rank_without_its_gpu_is_one_clear_line(gpus):
    gpus(2)
    with pytest.raises(UsageError) as err:
        arguments.device_arg(None, local_rank="2")
    assert str(err.value) == ("LOCAL_RANK=2 asks for cuda:2, but this machine has 2 GPUs: start at most 2 ranks per "
                              "node (torchrun --nproc-per-node 2), or give --device cuda:N")
    with pytest.raises(UsageError, match="LOCAL_RANK='a' is not a GPU index"):
        arguments.device_arg(None, local_rank="a")


def test_without_a_gpu_local_rank_changes_nothing(gpus):
    opened = gpus(0)
    assert arguments.device_arg(None, local_rank="3") is None  # the emulated device, as without LOCAL_RANK
    assert opened == [None]


def test_defrag_run_passes_local_rank_to_the_device_choice(tmp_path, monkeypatch):
    seen = {}

    def device_arg(spec, flag="--device", **kwargs):
        seen.update(kwargs, spec=spec)
        raise UsageError("stop here")

    monkeypatch.setattr(arguments, "device_arg", device_arg)
    monkeypatch.setenv("LOCAL_RANK", "1")
    (tmp_path / "train.py").write_text("")
    with pytest.raises(UsageError, match="stop here"):
        run._checked(run.parse([str(tmp_path / "train.py")]))
    assert seen == {"spec": None, "torch_cuda": True, "local_rank": "1"}


# ---------------------------------------------------------------- torchrun itself: two ranks over gloo
# Each line is one write (the ranks share torchrun's stdout; print() writes the newline apart under -u).
PROGRAM = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(1000) * (rank + 1)
    dist.all_reduce(t)
    os.write(1, f"rank {rank} sum {t[0].item()}\\n".encode())
    if rank == 1:
        try:
            torch.empty(1 << 30, dtype=torch.uint8)
        except torch.OutOfMemoryError as exc:
            os.write(1, f"OOM {str(exc).splitlines()[0]}\\n".encode())
    dist.barrier()
    dist.destroy_process_group()
""")


@needs_native
def test_under_torchrun_every_rank_writes_its_own_report_and_history_and_names_itself(tmp_path):
    (tmp_path / "prog.py").write_text(PROGRAM)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    # --standalone: a free port on localhost, so that test runs side by side do not meet.
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "defrag", "run", "--device", "emulated", "--capacity", "64MiB", "--report", "r.json",
                           "--record", "h.pickle", "prog.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h.rank0.pickle", "h.rank1.pickle", "prog.py",
                                                           "r.rank0.json", "r.rank1.json"]
    for rank in (0, 1):
        figures = json.loads((tmp_path / f"r.rank{rank}.json").read_text())["summary"]
        assert (figures["rank"], figures["world_size"], figures["exit_code"]) == (rank, 2, 0)
        assert figures["allocations"] > 0 and figures["ooms"] == rank  # rank 1 ran out once
        assert isinstance(pickle.loads((tmp_path / f"h.rank{rank}.pickle").read_bytes()), dict)
        (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith(f"defrag run [rank {rank}/2]: exit 0 in ")]
        assert f" · {figures['allocations']} allocations in the pool" in line
    assert sorted(ln for ln in proc.stdout.splitlines() if ln.startswith("rank ")) == ["rank 0 sum 3.0",
                                                                                     "rank 1 sum 3.0"]
    (message,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("OOM ")]
    assert message.startswith("OOM [rank 1/2] defrag "), message
