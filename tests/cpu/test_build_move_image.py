"""tools/build_move_image.py: a real build of the move kernel's image for sm_90 without a GPU (issue 45).

Runs the script as a user would (a child process per architecture, libNVVM and ptxas from a CUDA toolkit
on this machine); skipped, with the reason, where no toolkit with libNVVM, libdevice and ptxas is found.
About 7 s on 2 cores (numba's import and one NVVM compile in the child)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tools", "build_move_image.py")


def _tool():
    spec = importlib.util.spec_from_file_location("build_move_image", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tool = _tool()
TOOLKIT, LIBNVVM, WHY = tool.find_toolkit()
needs_toolkit = pytest.mark.skipif(TOOLKIT is None, reason=f"no NVVM to build with: {WHY}")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("cubins")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    proc = subprocess.run([sys.executable, SCRIPT, "--arch", "sm_90", "--out", str(out)], capture_output=True,
                          text=True, env=env, timeout=240)
    return proc, out / "move-sm_90.cubin"


@needs_toolkit
def test_sm90_image_builds_and_passes_its_checks(built):
    proc, cubin = built
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("sm_90:")]
    assert len(line) == 1 and line[0].startswith("sm_90: ok:"), proc.stdout
    assert "19 parameters of 8 bytes (param bank 152 B)" in line[0]
    data = cubin.read_bytes()
    assert data.startswith(b"\x7fELF")
    from defrag.kernels import abi

    entry = line[0].split("entry ", 1)[1].split(",", 1)[0]
    assert "move_kernel" in entry
    facts = tool.check_cubin(data, entry, abi.PARAMS)
    assert facts["problems"] == [] and facts["params"] == abi.PARAMS and facts["param_sizes"] == [8]
    from defrag.kernels import host

    assert 0 < facts["registers"] <= host.REGISTERS  # what the emulated device's occupancy assumes


@needs_toolkit
def test_the_checks_refuse_a_wrong_image(built):
    proc, cubin = built
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = cubin.read_bytes()
    entry = [ln for ln in proc.stdout.splitlines() if ln.startswith("sm_90:")][0].split("entry ", 1)[1].split(",")[0]
    assert tool.check_cubin(bytearray(data), entry)["problems"]  # not bytes
    assert tool.check_cubin(b"PK" + data[2:], entry)["problems"]  # no ELF magic
    assert tool.check_cubin(data, entry + "x")["problems"]  # another entry
    assert any("not 20" in p for p in tool.check_cubin(data, entry, 20)["problems"])  # another parameter count


def test_a_missing_toolkit_is_a_clear_failure(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("DEFRAG_LIBNVVM", raising=False)
    assert tool.main(["--arch", "sm_90", "--toolkit", str(tmp_path)]) == 1
    assert "no CUDA toolkit with libNVVM" in capsys.readouterr().out
