"""The command line: demo, doctor, and --help for every command."""

from __future__ import annotations

import matplotlib.image as mpimg
import pytest

from defrag import cli

from ..forked import run_module


def test_demo_exits_0_and_writes_the_picture(tmp_path, capsys):
    assert cli.main(["demo", "--device", "emulated", "--capacity", "64MiB", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "without compaction it fails" in out and "succeeded" in out
    assert "surviving caches hold their bytes" in out
    png = tmp_path / "defrag-demo.png"
    assert str(png) in out and mpimg.imread(png).shape[0] > 100


def test_doctor_says_what_works(capsys):
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "_swap_data_ptr_" in out and "numba-cuda" in out and "emulated device" in out
    assert "GPU:" in out
    # Which route defrag.install takes on CUDA here, and what PyTorch's memory APIs do on it.
    assert "defrag run / install on CUDA:" in out
    import torch
    if torch.version.cuda is None:  # issue 46: briefly, not the pluggable route and the backend's headers
        (line,) = [ln for ln in out.splitlines() if ln.startswith("defrag run / install on CUDA:")]
        assert line.startswith("defrag run / install on CUDA: does not apply here (") and "CPU build" in line
        assert "pluggable" not in out and "headers" not in out and "backend source" not in out


def test_doctor_without_a_gpu_says_briefly_that_no_cuda_route_applies():
    """Whatever torch this is: without a usable GPU, one short line, no compile check of the backend."""
    (line,) = cli._cuda_allocator_lines(False)
    assert line.startswith("defrag run / install on CUDA: does not apply here (no usable GPU")
    assert len(line) < 120 and "headers" not in line and "pluggable" not in line


# `python -m defrag ...`, forked from the test zygote (tests/forked.py; test_forked checks it against a fresh one).
@pytest.mark.parametrize("command", [[], ["run"], ["demo"], ["doctor"], ["bench"], ["replay"]])
def test_every_command_has_help(command):
    result = run_module("defrag", *command, "--help", timeout=120)
    assert result.returncode == 0 and "usage: defrag" in result.stdout


def test_unknown_command_is_a_usage_error():
    result = run_module("defrag", "frobnicate", timeout=120)
    assert result.returncode == 2 and "invalid choice" in result.stderr
