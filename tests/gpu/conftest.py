"""tests/gpu: on a real GPU, or rehearsed on the emulated device with the GPU's geometry.

Three modes, decided once per session (`MODE`):

- ``"cuda"``: a CUDA driver with a GPU works and torch can use it. Every test
  runs on ``cuda:0``.
- ``"rehearsal"``: no usable GPU and ``DEFRAG_GPU_REHEARSAL=1``. Every test
  that does not need CUDA itself runs on a fresh emulated device with the
  GPU's geometry: 2 MiB pages (the VMM granularity of H100/H200) and the
  same pool capacities as on the GPU. Tests marked ``needs_cuda`` (torch CUDA
  tensors, streams and events, numba's real kernels) skip with their reason.
  CI runs this (README line 3), so the GPU run meets no size assumption for
  the first time.
- otherwise every test here skips, saying why and how to rehearse.

Fixtures: `make_pool` (pools on the test's device; in a rehearsal, each on its
own emulated device, checked for leaks after close), `gpu_driver` (a
`defrag.driver.Driver`: the GPU's, or an emulated one with 2 MiB pages; the
emulated devices here refuse a non-zero `cuMemMap` offset, as CUDA does) and
`figures` (measurements a test reports, never asserts on: printed at the end
of the run and appended as JSON lines to
``$DEFRAG_GPU_FIGURES`` when that is set; gpu_check puts them in its report).

From a bare checkout (nothing pip-installed) this conftest makes the
checkout's ``defrag.kernels`` and ``defrag.benchmarks`` importable
(benchmarks/_bare_checkout.py), and loads ``$DEFRAG_LIBNVVM`` before numba
loads a libNVVM of its own.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import time
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]


def _bootstrap():
    spec = importlib.util.spec_from_file_location("_defrag_bare_checkout", _ROOT / "benchmarks" / "_bare_checkout.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if (_ROOT / "kernels" / "__init__.py").is_file():
        mod.install(_ROOT)
    mod.preload_libnvvm()


_bootstrap()

import torch  # noqa: E402

import defrag  # noqa: E402
from defrag import settings  # noqa: E402
from defrag.driver import Driver, cuda_driver_usable  # noqa: E402

MiB = 1 << 20
GPU_PAGE = 2 * MiB  # the VMM granularity of H100/H200: the rehearsal's page


def _decide() -> tuple[str | None, str]:
    usable, reason = cuda_driver_usable()
    if usable and not torch.cuda.is_available():
        usable, reason = False, (f"the CUDA driver works ({reason}) but torch {torch.__version__} cannot use it "
                                 "(torch.cuda.is_available() is False)")
    if usable:
        return "cuda", reason
    if settings.gpu_rehearsal():
        return "rehearsal", reason
    return None, reason


MODE, WHY = _decide()
REHEARSAL = MODE == "rehearsal"
# A skip reason is one short line: the cause without the driver's own explanation in parentheses.
SHORT_WHY = WHY.split(" (", 1)[0]


def pytest_configure(config):
    config.addinivalue_line("markers", "needs_cuda(reason): needs CUDA itself; skipped in the GPU rehearsal")


def _in_here(item) -> bool:
    return str(Path(str(item.fspath)).resolve()).startswith(str(Path(__file__).resolve().parent))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if not _in_here(item):
            continue  # this hook sees the whole session's items
        if MODE is None:
            item.add_marker(pytest.mark.skip(reason=f"needs a CUDA GPU, none here ({SHORT_WHY}); "
                                                    f"DEFRAG_GPU_REHEARSAL=1 rehearses it on the emulated device"))
        elif REHEARSAL:
            mark = item.get_closest_marker("needs_cuda")
            if mark is not None:
                why = mark.args[0] if mark.args else "needs CUDA itself"
                item.add_marker(pytest.mark.skip(reason=f"GPU rehearsal (no GPU here): {why}"))


def pytest_report_header(config):
    if MODE == "cuda":
        return f"tests/gpu: on {torch.cuda.get_device_name(0)} (cuda:0), torch {torch.__version__}"
    if REHEARSAL:
        return (f"tests/gpu: REHEARSAL on the emulated device with {GPU_PAGE // MiB} MiB pages "
                f"(no GPU here: {WHY})")
    return f"tests/gpu: skipped (no GPU: {WHY})"


# ---------------------------------------------------------------- fresh processes
# PyTorch's CUDA allocator can be replaced only before its first use and never back: tests of
# `install` and `capture` routing run their scenario in a fresh interpreter on this checkout.
BARE = _ROOT / "benchmarks" / "_bare_checkout.py"


def child_env(overrides: dict | None = None) -> dict:
    """This process's environment for a fresh child: PyTorch's allocator settings (PYTORCH_CUDA_ALLOC_CONF)
    cleared, then `overrides` applied (a value of None unsets that variable)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    for name, value in (overrides or {}).items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def fresh_process(script: str, *args, timeout=300, env: dict | None = None):
    """Run `script` (dedented) as a file in a fresh interpreter on this checkout (`_bare_checkout.py`),
    with `child_env(env)`, from the checkout's root; the CompletedProcess."""
    import subprocess
    import sys
    import tempfile
    import textwrap

    fd, path = tempfile.mkstemp(suffix=".py", prefix="defrag_gpu_")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(textwrap.dedent(script))
        return subprocess.run([sys.executable, str(BARE), path, *args], capture_output=True, text=True,
                              timeout=timeout, env=child_env(env), cwd=str(_ROOT))
    finally:
        os.unlink(path)


def last_json(proc) -> dict:
    """The child's last line that starts with "{", parsed (an assertion error naming its stderr if none)."""
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    assert lines, f"no result from the child (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1])


# ---------------------------------------------------------------- devices

def sync(pool_or_device=None) -> None:
    """Wait for the GPU (a no-op in a rehearsal: emulated work is synchronous)."""
    if MODE == "cuda":
        torch.cuda.synchronize()


def emulated_device(capacity: int) -> Driver:
    """A fresh emulated device with the GPU's 2 MiB pages and room for `capacity` plus slack.

    Like CUDA (and every emulated device), it refuses a non-zero `cuMemMap` offset.
    """
    return Driver.emulated(capacity=2 * int(capacity) + 16 * GPU_PAGE, granularity=GPU_PAGE)


@pytest.fixture
def make_pool():
    """``make(capacity, **kwargs)``: a pool on cuda:0, or (rehearsal) on its own emulated device with 2 MiB pages."""
    made = []

    def make(capacity, **kwargs):
        nbytes = defrag.parse_size(capacity)
        if MODE == "cuda":
            pool, drv = defrag.Pool(device="cuda:0", capacity=capacity, **kwargs), None
        else:
            drv = emulated_device(nbytes)
            pool = defrag.Pool(device=drv, capacity=capacity, page_size=GPU_PAGE, **kwargs)
        made.append((pool, drv))
        return pool

    yield make
    sync()
    for pool, _ in made:
        pool.close()
    gc.collect()
    for pool, drv in made:
        if drv is None:
            continue
        state = drv.api.state()
        drv.api.close()
        drv.close()
        assert state == {"handles": 0, "mappings": 0, "reservations": 0, "used_bytes": 0}, (
            f"pool #{pool.id} leaked driver resources after close: {state}")


@pytest.fixture(scope="module")
def gpu_driver():
    """The GPU's driver (`Driver.cuda(0)`), or in a rehearsal an emulated device with 2 MiB pages (1 GiB)."""
    d = Driver.cuda(0) if MODE == "cuda" else Driver.emulated(capacity=1 << 30, granularity=GPU_PAGE)
    yield d
    if d.kind == "emulated":
        d.api.close()
    d.close()


# ---------------------------------------------------------------- figures

_FIGURES: list[dict] = []


class Figures:
    """What a test measured (reported, never asserted on)."""

    def __init__(self, nodeid: str):
        self.nodeid = nodeid

    @property
    def backend(self) -> str:
        return "cuda" if MODE == "cuda" else "emulated"

    def add(self, name: str, value, unit: str, **extra) -> None:
        row = {"test": self.nodeid.split("::")[-1], "name": name, "value": value, "unit": unit,
               "backend": self.backend, **extra}
        _FIGURES.append(row)
        path = settings.gpu_figures()
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(row, default=str) + "\n")


@pytest.fixture
def figures(request):
    return Figures(request.node.nodeid)


def pytest_terminal_summary(terminalreporter):
    if not _FIGURES:
        return
    where = "GPU" if MODE == "cuda" else "EMULATED DEVICE (rehearsal: not GPU figures)"
    terminalreporter.section(f"tests/gpu figures, {where}")
    for r in _FIGURES:
        value = r["value"]
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        terminalreporter.write_line(f"{r['test']}: {r['name']} = {text} {r['unit']}")


def median_time(fn, *, repeat: int = 5, warmup: int = 1, cuda: bool = False) -> float:
    """Median seconds of fn() over `repeat` runs after `warmup`; with cuda=True, a synchronize inside each."""
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - t0)
    samples.sort()
    return samples[len(samples) // 2]
