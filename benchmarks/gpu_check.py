"""The GPU check: one command for a GPU machine, from a bare checkout, installing nothing.

    python3 benchmarks/gpu_check.py [--full] [--out DIR]
    python -m defrag.benchmarks.gpu_check [--full] [--out DIR]    # the same, where defrag is installed

DIR defaults to ``gpu-report`` under the current directory.

It imports the checkout it lives in (benchmarks/_bare_checkout.py: no pip, no
network; an installed copy of defrag is ignored) and runs in stages, each a
subprocess with its own timeout inside one overall budget (``--budget``).
The default run (``--smoke`` is the same) fits 5 minutes of GPU time: its
stages' timeouts (``FIVE_MINUTE_PLAN``) sum to 300 s, the benchmarks run at
smoke sizes, and the slower benchmarks and the model stages are dropped with
a line in the report that names them; ``--full`` runs everything, at most
570 s (330 s with ``--full --smoke``). A hang costs one stage, and a stage the
budget leaves no time for is reported as "skipped: out of time budget", not as
a failure:

0. ``tests:first``: the CUDA backend's and the move kernel launcher's GPU
   tests (``FIRST_TESTS`` in tests/gpu), before anything else. Should the env
   stage then pick another libNVVM and these tests had failed, they run once
   more with it (the first run reported as superseded).
1. ``env``: python, torch (its CUDA, ``UntypedStorage._swap_data_ptr_``),
   numba / numba-cuda / cuda-bindings, where defrag, defrag.kernels and
   defrag.benchmarks were imported from, the GPU and the driver's CUDA
   version, ``nvidia-smi``'s read-only view, and libNVVM: which one numba
   loads (path, and how cuda.pathfinder found it), the PTX ISA version it
   emits for the GPU against the newest the driver accepts, whether the
   driver loads that PTX, and one real launch of defrag.kernels. When the PTX
   is too new it looks for a libNVVM no newer than the driver and, if it finds
   one, uses it for every later stage (``DEFRAG_LIBNVVM`` + ``CUDA_HOME``);
   so it does when numba finds no libNVVM at all. The env stage is then run
   again with it, and the first one is reported as superseded.
2. ``tests``: ``pytest tests/gpu``, less the first stage's files (JUnit
   XML, and the figures the tests measured). Without a GPU they skip, or with ``--rehearse`` run as the GPU
   rehearsal on the emulated device (``DEFRAG_GPU_REHEARSAL`` on: 1, true,
   yes or on, read by defrag.settings' switch parser).
3. ``bench:NAME``: one stage per GPU benchmark of `defrag bench`
   (``--only`` picks others) on ``cuda:0``; without a GPU, on the emulated
   device. Benchmarks that measure only the emulated device or the host
   (rescue, planner; workloads, whose full run is mostly CPU-bound dry
   replays) are not run unless named in ``--only``.
4. ``model:native``, ``model:expandable`` (``--full`` on a GPU only;
   ``--no-model`` skips them): the generators' traces (and, in a full run, an 80 GiB-class
   serving trace) replayed on PyTorch's real caching allocator, capped with
   ``set_per_process_memory_fraction``, beside the model of it that dry
   replays use (`defrag.traces.torch_model`), same cap: peak reserved, peak
   live and OOMs side by side.

The report, ``DIR/gpu_report.md`` and ``DIR/gpu_report.json``, is written
before and after every stage, so a run killed at any point still leaves one;
each stage has its log in ``DIR/stage-<name>.log``, benchmark tables and plots
are in ``DIR/bench/``. Without a GPU the report's first line says so, no GPU
figure is reported, and the command exits 0 when what could run worked.
Exit 1: a stage failed or timed out; 2: bad arguments (0 when stages were only
skipped for time: the verdict says which).

This file imports only the standard library at the top: the parent process
never imports torch, numba or defrag, so a broken environment still gets a
report.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BOOTSTRAP = HERE / "_bare_checkout.py"
# A source checkout (defrag/, kernels/, tests/ beside benchmarks/), or an installed defrag.benchmarks?
IS_CHECKOUT = (ROOT / "defrag" / "__init__.py").is_file() and (ROOT / "kernels" / "__init__.py").is_file()

# GPU benchmarks (runner.REGISTRY names) and each one's timeout in seconds: (smoke, full).
GPU_BENCHMARKS = {
    "copy_bandwidth": (45, 90),
    "batched_launch": (45, 60),
    # The compaction's copy at the GPU's bandwidth: the engines' crossover, a mixed wave, the 2 GB compaction,
    # its first run in a fresh process and the automatic trigger (goals judged in the full run).
    "engine_crossover": (45, 90),
    "mixed_wave": (45, 60),
    "compaction_gpu": (120, 240),
    "stitching": (45, 60),
    "alloc_free": (None, 60),  # None: not in the smoke run
    "compaction": (None, 120),
    "sleep": (None, 90),  # issue 15: sleep/wake and offload/reload vs copy_ to pinned host memory
    "install": (90, 150),  # issue 25: install as PyTorch's CUDA allocator vs the caching allocator (child processes)
    # one record: GPT-2-sized training on varying lengths, install vs caching vs expandable, and under a budget
    "install_varying": (None, 240),
}
OTHER_BENCH_TIMEOUT = (60, 150)
MODEL_TIMEOUT = (45, 120)  # per model stage (native, expandable): (smoke, full)
# The env stage builds two C++ extensions when the machine has never built them (storage swap 10-30 s,
# allocation fast path 30-60 s) and compiles the kernels once; every later stage is a fresh process that
# compiles numba kernels again. The smoke budget holds that (a cold run); a warm one ends well before.
ENV_TIMEOUT = 180
# tests/gpu's full run includes seven `defrag run` programs through the CUDA allocator backend (each a
# fresh CUDA process; one compiles a reduce-overhead graph): about 90 s more than before them.
TEST_TIMEOUT = (150, 330)
DEFAULT_BUDGET = (330, 570)  # --full: a stopped stage may take 10 s more: under 6 and 10 minutes
# The backend's and the launcher's GPU tests (issue 45): the first stage of every run, before anything else.
FIRST_TESTS = ("test_first_gpu_run_gpu.py", "test_backend_semantics_gpu.py", "test_torch_blocks_gpu.py",
               "test_torch_backend_gpu.py", "test_kernels_gpu.py")
# The default run (and --smoke) fits 5 minutes of GPU time: each stage's timeout in seconds, in the order the
# stages run; they sum to FIVE_MINUTES, the run's budget. The benchmarks run at smoke sizes; the others
# (alloc_free, compaction, sleep, install, install_varying, mixed_wave, stitching, batched_launch) and the model
# stages are dropped, with a line saying so; --full runs them all (DEFAULT_BUDGET[1]).
FIVE_MINUTES = 300
FIVE_MINUTE_PLAN = {
    "tests:first": 75,
    "env": 60,
    "tests": 75,
    "bench:copy_bandwidth": 20,
    "bench:engine_crossover": 25,
    "bench:compaction_gpu": 45,
}
MIN_STAGE_SECONDS = 10
OUT_OF_TIME = "skipped: out of time budget"  # a stage's summary when the budget left no time for it

# Newest PTX ISA each CUDA driver version accepts (from the PTX ISA release notes).
PTX_ISA_BY_CUDA = {
    (11, 0): (7, 0), (11, 1): (7, 1), (11, 2): (7, 2), (11, 3): (7, 3), (11, 4): (7, 4), (11, 5): (7, 5),
    (11, 6): (7, 6), (11, 7): (7, 7), (11, 8): (7, 8), (12, 0): (8, 0), (12, 1): (8, 1), (12, 2): (8, 2),
    (12, 3): (8, 3), (12, 4): (8, 4), (12, 5): (8, 5), (12, 6): (8, 5), (12, 8): (8, 7), (12, 9): (8, 8),
    (13, 0): (9, 0),
}


# =========================================================================== small helpers (stdlib only)


def max_ptx_isa(driver_version: int) -> tuple[int, int] | None:
    """Newest PTX ISA version a driver of `driver_version` (cuDriverGetVersion, e.g. 13000) loads."""
    if not driver_version or driver_version <= 0:
        return None
    cuda = (driver_version // 1000, (driver_version % 1000) // 10)
    if cuda in PTX_ISA_BY_CUDA:
        return PTX_ISA_BY_CUDA[cuda]
    if cuda[0] >= 13:  # 13.x emits and accepts PTX 9.x
        return (cuda[0] - 4, cuda[1])
    older = [v for k, v in PTX_ISA_BY_CUDA.items() if k <= cuda]
    return max(older) if older else None


def parse_ptx_version(ptx: str) -> tuple[int, int] | None:
    m = re.search(r"^\s*\.version\s+(\d+)\.(\d+)", ptx, re.M)
    return (int(m.group(1)), int(m.group(2))) if m else None


def fmt_version(v) -> str:
    return ".".join(str(x) for x in v) if v else "?"


def toolkit_root(lib_path: str) -> str | None:
    """The CUDA toolkit folder a libnvvm belongs to: the nearest parent holding an ``nvvm/`` folder."""
    p = Path(lib_path).resolve()
    for parent in p.parents:
        if (parent / "nvvm").is_dir():
            return str(parent)
    return None


def libnvvm_candidates() -> list[str]:
    """Every libnvvm.so this machine has in the usual places (toolkits, CUDA_HOME/CUDA_PATH, NVIDIA wheels)."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), *sorted(glob.glob("/usr/local/cuda*")),
             "/opt/cuda", "/usr/lib/cuda", *sorted(glob.glob("/opt/nvidia/*"))]
    dirs = []
    for r in filter(None, roots):
        dirs += [Path(r) / "nvvm" / "lib64", Path(r) / "lib64", Path(r) / "lib"]
    for entry in sys.path:
        if entry and Path(entry).is_dir():
            dirs += [Path(entry) / "nvidia" / sub / "lib" for sub in ("cu13", "cu12")]
            dirs.append(Path(entry) / "nvidia" / "cuda_nvcc" / "nvvm" / "lib64")
    dirs.append(Path("/usr/lib/x86_64-linux-gnu"))
    found, seen = [], set()
    for d in dirs:
        for name in ("libnvvm.so.4", "libnvvm.so"):
            f = d / name
            if f.is_file():
                real = os.path.realpath(f)
                if real not in seen:
                    seen.add(real)
                    found.append(str(f))
                break
    return found


def nvvm_probe(arch: str = "compute_90", *, load_in_driver: bool = False) -> dict:
    """Which libNVVM loads here and the PTX it emits for `arch`; optionally whether the driver loads that PTX.

    Uses cuda.pathfinder and cuda.bindings.nvvm, as numba-cuda does, so a
    libNVVM preloaded from $DEFRAG_LIBNVVM is the one reported.
    """
    out: dict = {"arch": arch}
    try:
        from cuda import pathfinder

        lib = pathfinder.load_nvidia_dynamic_lib("nvvm")
        out.update(path=lib.abs_path, found_via=lib.found_via, realpath=os.path.realpath(lib.abs_path))
    except Exception as exc:  # no libNVVM at all: numba cannot compile for a GPU
        out["error"] = f"{exc.__class__.__name__}: {exc}"
        return out
    try:
        from cuda.bindings import nvvm

        out["nvvm_version"] = list(nvvm.version())
        major, minor, dmajor, dminor = nvvm.ir_version()
        out["ir_version"] = [major, minor, dmajor, dminor]
        ir = (
            'target triple = "nvptx64-unknown-cuda"\n'
            'target datalayout = "e-p:64:64:64-i1:8:8-i8:8:8-i16:16:16-i32:32:32-i64:64:64-i128:128:128-'
            'f32:32:32-f64:64:64-v16:16:16-v32:32:32-v64:64:64-v128:128:128-n16:32:64"\n'
            "define void @defrag_probe() {\nentry:\n  ret void\n}\n"
            "!nvvm.annotations = !{!0}\n"
            '!0 = !{void ()* @defrag_probe, !"kernel", i32 1}\n'
            "!nvvmir.version = !{!1}\n"
            f"!1 = !{{i32 {major}, i32 {minor}, i32 {dmajor}, i32 {dminor}}}\n"
        ).encode()
        prog = nvvm.create_program()
        try:
            nvvm.add_module_to_program(prog, ir, len(ir), "defrag_probe.ll")
            opts = [f"-arch={arch}"]
            nvvm.compile_program(prog, len(opts), opts)
            buf = bytearray(nvvm.get_compiled_result_size(prog))
            nvvm.get_compiled_result(prog, buf)
        finally:
            nvvm.destroy_program(prog)
        ptx = bytes(buf).rstrip(b"\0").decode(errors="replace")
        out["ptx_version"] = list(parse_ptx_version(ptx) or ())
        out["ptx_head"] = [ln for ln in ptx.splitlines() if ln.startswith((".version", ".target"))]
    except Exception as exc:
        out["error"] = f"{exc.__class__.__name__}: {exc}"
        return out
    if load_in_driver:
        out["driver_load"] = driver_loads_ptx(ptx)
    return out


def driver_loads_ptx(ptx: str) -> str:
    """'ok', or the CUresult name the driver answers cuModuleLoadData with (needs a GPU)."""
    try:
        from cuda.bindings import driver as cu

        def check(res):
            err = res[0]
            if err != cu.CUresult.CUDA_SUCCESS:
                raise RuntimeError(cu.CUresult(int(err)).name)
            return res[1] if len(res) > 1 else None

        check(cu.cuInit(0))
        dev = check(cu.cuDeviceGet(0))
        ctx = check(cu.cuDevicePrimaryCtxRetain(dev))
        try:
            check(cu.cuCtxSetCurrent(ctx))
            err, module = cu.cuModuleLoadData(ptx.encode() + b"\0")
            if err != cu.CUresult.CUDA_SUCCESS:
                return cu.CUresult(int(err)).name
            cu.cuModuleUnload(module)
            return "ok"
        finally:
            cu.cuDevicePrimaryCtxRelease(dev)
    except Exception as exc:
        return f"{exc.__class__.__name__}: {exc}"


def quick_gpu_probe() -> tuple[bool, str]:
    """Is a CUDA driver with a GPU usable (cuda.bindings only; no torch)? Mirrors defrag's cuda_driver_usable."""
    try:
        from cuda.bindings import driver as cu
    except Exception as exc:
        return False, f"cuda.bindings unavailable ({exc.__class__.__name__}: {exc})"
    try:
        err, = cu.cuInit(0)
    except RuntimeError as exc:
        return False, f"no CUDA driver library ({exc.__class__.__name__}: {exc})"
    if err != cu.CUresult.CUDA_SUCCESS:
        return False, f"cuInit failed: {cu.CUresult(int(err)).name}"
    err, count = cu.cuDeviceGetCount()
    if err != cu.CUresult.CUDA_SUCCESS or count < 1:
        return False, "the CUDA driver reports no devices"
    return True, f"{count} CUDA device(s)"


REQUIRED_MODULES = ("torch", "numpy", "numba", "cuda.bindings", "sortedcontainers")  # what defrag imports


def missing_packages() -> list[str]:
    """The modules defrag needs that this Python cannot import (found without importing them)."""
    import importlib.util

    missing = []
    for name in REQUIRED_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # a dotted name whose parent is missing
            found = False
        if not found:
            missing.append(name)
    return missing


def registered_benchmarks() -> list[str]:
    """runner.REGISTRY's names, read from its source (the parent never imports defrag)."""
    try:
        return re.findall(r'Benchmark\(\s*"(\w+)"', (HERE / "runner.py").read_text())
    except OSError:
        return []


def _settings():
    """defrag/settings.py (and the errors and units modules it imports) loaded on its own, without the defrag
    package (whose __init__ imports torch: this parent process imports only the standard library)."""
    import importlib.util
    import types

    name = "_gpu_check_defrag_settings"
    if f"{name}.settings" in sys.modules:
        return sys.modules[f"{name}.settings"]
    folder = ROOT / "defrag" if IS_CHECKOUT else HERE.parent  # a checkout, or the installed defrag package
    package = types.ModuleType(name)
    package.__path__ = [str(folder)]
    sys.modules[name] = package
    spec = importlib.util.spec_from_file_location(f"{name}.settings", folder / "settings.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def rehearsal_switch() -> bool:
    """DEFRAG_GPU_REHEARSAL read by defrag.settings' one switch parser (1/true/yes/on ...); SettingError for a
    value that is not a switch."""
    settings = _settings()
    return settings.parse_switch("DEFRAG_GPU_REHEARSAL", os.environ.get("DEFRAG_GPU_REHEARSAL"))


def _tail(text: str, n: int = 4000) -> str:
    return text if len(text) <= n else "...\n" + text[-n:]


# =========================================================================== stages run in a child process


def stage_env(args) -> dict:
    """Everything about this machine that decides whether the GPU path can work (see the module docstring)."""
    import platform
    from importlib import metadata

    info: dict = {"python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform(),
                  "checkout": str(ROOT), "problems": [], "warnings": []}
    spec = importlib.util.spec_from_file_location("_defrag_bare_checkout_env", BOOTSTRAP)
    boot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(boot)
    info["imported_from"] = boot.imported_from()
    for name, where in info["imported_from"].items():
        if not str(Path(str(where)).resolve()).startswith(str(ROOT)):
            info["problems"].append(f"{name} was imported from {where}, not from this checkout ({ROOT})")

    def version(dist):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    info["versions"] = {d: version(d) for d in ("numpy", "numba", "numba-cuda", "cuda-bindings",
                                                "cuda-python", "cuda-pathfinder", "llvmlite", "pytest")}
    import torch

    from defrag import tensors
    from defrag.driver import cuda_driver_usable

    native = bool(getattr(tensors, "NATIVE_SWAP_DATA_PTR", tensors.HAS_SWAP_DATA_PTR))
    info["torch"] = {"version": torch.__version__, "cuda_build": torch.version.cuda, "swap_data_ptr": native}
    if hasattr(tensors, "swap_mode"):
        # How storages move here. On torch < 2.12 the first call builds the storage-swap extension
        # (10-30 s, once per machine): done here, so the test and benchmark stages find it built.
        t0 = time.perf_counter()
        try:
            info["torch"]["swap_mode"] = tensors.swap_mode()
        except Exception as exc:
            info["torch"]["swap_mode"] = f"error: {exc.__class__.__name__}: {exc}"
        info["torch"]["swap_mode_seconds"] = round(time.perf_counter() - t0, 2)
    try:  # the allocation fast path: built (30-60 s once per machine) here, so later stages find it
        from defrag import fastpath

        t0 = time.perf_counter()
        fastpath.wait()
        info["torch"]["fast_path"] = fastpath.status()
        info["torch"]["fast_path_seconds"] = round(time.perf_counter() - t0, 2)
    except ImportError:  # an older checkout without it
        pass
    try:  # PyTorch's CUDA allocator backend (defrag run's route): built here (about a minute, once per machine)
        from defrag import cuda_backend
        from defrag.errors import NativeBuildError

        t0 = time.perf_counter()
        try:
            cuda_backend.load()
            info["torch"]["cuda_backend"] = "built"
            info["torch"]["cuda_backend_features"] = cuda_backend.features()
        except NativeBuildError as exc:
            info["torch"]["cuda_backend"] = f"unavailable: {exc}"
            info["warnings"].append(f"defrag run uses the pluggable allocator route here: {exc}")
        info["torch"]["cuda_backend_seconds"] = round(time.perf_counter() - t0, 2)
    except ImportError:  # an older checkout without it
        pass
    mode = info["torch"].get("swap_mode", "native" if native else "rebind")
    if mode != "native":
        info["warnings"].append(
            f"torch {torch.__version__} has no UntypedStorage._swap_data_ptr_ (torch < 2.12); storages move by "
            + ("the storage-swap extension" if mode == "extension" else
               f"rebinding ({mode}): storages with views the pool did not make stay in place during compaction"))
    ok, reason = cuda_driver_usable()
    gpu = {"driver_usable": ok, "reason": reason}
    try:
        from cuda.bindings import driver as cu

        err, v = cu.cuDriverGetVersion()
        if err == cu.CUresult.CUDA_SUCCESS:
            gpu["driver_cuda_version"] = f"{v // 1000}.{(v % 1000) // 10}"
            gpu["driver_max_ptx"] = list(max_ptx_isa(v) or ())
    except Exception as exc:  # no libcuda: fine on a CPU machine
        gpu["driver_cuda_version"] = None
        gpu["driver_error"] = f"{exc.__class__.__name__}: {exc}"
    gpu["torch_cuda_available"] = bool(torch.cuda.is_available()) if ok else False
    if ok and gpu["torch_cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        gpu.update(name=props.name, capability=list(torch.cuda.get_device_capability(0)),
                   memory_bytes=int(props.total_memory), sm_count=int(props.multi_processor_count))
    elif ok:
        info["problems"].append(f"the CUDA driver works ({reason}) but torch {torch.__version__} cannot use it "
                                "(torch.cuda.is_available() is False: a CPU-only torch build?)")
    info["gpu"] = gpu
    info["is_gpu"] = bool(ok and gpu["torch_cuda_available"])
    info["nvidia_smi"] = nvidia_smi()

    # libNVVM: which one, which PTX, does the driver take it
    cc = gpu.get("capability") or [9, 0]
    arch = f"compute_{cc[0]}{cc[1]}"
    nv = nvvm_probe(arch, load_in_driver=info["is_gpu"])
    nv["DEFRAG_LIBNVVM"] = os.environ.get("DEFRAG_LIBNVVM")
    nv["CUDA_HOME"] = os.environ.get("CUDA_HOME")
    nv["candidates"] = libnvvm_candidates()
    assess_libnvvm(nv, gpu, info["is_gpu"], info["problems"], info["warnings"])
    info["libnvvm"] = nv

    if info["is_gpu"]:
        info["kernel_probe"] = kernel_probe()
        if not info["kernel_probe"].get("ok"):
            info["problems"].append(f"defrag.kernels on the GPU: {info['kernel_probe'].get('error')}")
    try:
        import contextlib
        import io

        from defrag.cli import doctor

        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            doctor(None)
        info["doctor"] = buf.getvalue().strip()
    except Exception as exc:
        info["doctor"] = f"defrag doctor failed: {exc.__class__.__name__}: {exc}"
    return info


def assess_libnvvm(nv: dict, gpu: dict, is_gpu: bool, problems: list, warnings: list) -> None:
    """Judge `nv` (nvvm_probe's answer plus "candidates") against the driver in `gpu`; adds "ptx_ok",
    "advice" and, when numba's libNVVM is missing or emits PTX the driver refuses, "fix": the newest
    candidate the driver accepts (best_libnvvm), or None."""
    limit = tuple(gpu.get("driver_max_ptx") or ())
    ptx = tuple(nv.get("ptx_version") or ())
    nv["ptx_ok"] = None if not (limit and ptx) else ptx <= limit
    missing = bool(nv.get("error"))
    if missing:
        (problems if is_gpu else warnings).append(f"libNVVM: {nv['error']}")
    too_new = nv["ptx_ok"] is False or (nv.get("driver_load") not in (None, "ok"))
    if too_new:
        nv["advice"] = (f"numba's libNVVM ({nv.get('path')}, found via {nv.get('found_via')}) emits PTX "
                        f"{fmt_version(ptx)}, but the driver (CUDA {gpu.get('driver_cuda_version')}) accepts PTX up to "
                        f"{fmt_version(limit)} (cuModuleLoadData: {nv.get('driver_load')}). Use the libNVVM of a "
                        "toolkit no newer than the driver: DEFRAG_LIBNVVM=<toolkit>/nvvm/lib64/libnvvm.so.4 "
                        "CUDA_HOME=<toolkit> (gpu_check does so itself when it finds one). CUDA_HOME alone is not "
                        "enough when the newer libNVVM sits in site-packages or on the loader path: cuda.pathfinder "
                        "searches those first.")
        problems.append(nv["advice"])
    # No libNVVM at all, or one whose PTX the driver refuses: look for one it takes (needs the driver's limit).
    if (too_new or missing) and limit:
        nv["fix"] = best_libnvvm(nv.get("candidates") or [], nv.get("arch") or "compute_90", limit,
                                 skip=nv.get("realpath"))


def nvidia_smi() -> str | None:
    import shutil

    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:  # a read-only query; never changes any setting
        out = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        return (out.stdout or out.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi failed: {exc}"


def best_libnvvm(candidates: list[str], arch: str, limit: tuple, skip: str | None = None) -> dict | None:
    """Probe each candidate libNVVM in its own process; the newest whose PTX the driver accepts, or None."""
    best = None
    for path in candidates:
        if skip and os.path.realpath(path) == skip:
            continue
        try:
            proc = subprocess.run([sys.executable, str(HERE / "gpu_check.py"), "--nvvm-probe", path, "--arch", arch,
                                   "--driver-load"], capture_output=True, text=True, timeout=60)
            res = json.loads(proc.stdout.strip().splitlines()[-1])
        except Exception:
            continue
        ptx = tuple(res.get("ptx_version") or ())
        if not ptx or ptx > limit or res.get("driver_load") not in (None, "ok"):
            continue
        if best is None or ptx > tuple(best["ptx_version"]):
            best = {"DEFRAG_LIBNVVM": path, "CUDA_HOME": toolkit_root(path), "ptx_version": list(ptx),
                    "driver_load": res.get("driver_load")}
    return best


def kernel_probe() -> dict:
    """Compile and run defrag.kernels' move and checksum once on the GPU; check the bytes."""
    t0 = time.perf_counter()
    try:
        import numpy as np
        import torch

        import defrag.kernels as dk

        if dk.is_simulator():
            return {"ok": False, "error": "numba.cuda is the CPU simulator (NUMBA_ENABLE_CUDASIM is set)"}
        half = 1 << 18
        buf = torch.randint(0, 256, (2 * half,), dtype=torch.uint8, device="cuda")
        arena = dk.device_arena(buf.data_ptr(), buf.numel())
        dk.batched_move(arena, np.array([[0, half, half]], dtype=np.int64))
        torch.cuda.synchronize()
        same = bool(torch.equal(buf[:half], buf[half:]))
        sums = dk.checksum(arena, [[0, half], [half, half]])
        ok = same and int(sums[0]) == int(sums[1])
        return {"ok": ok, "seconds_with_compile": time.perf_counter() - t0,
                **({} if ok else {"error": "the move kernel's bytes or checksums are wrong"})}
    except Exception as exc:
        return {"ok": False, "seconds_with_compile": time.perf_counter() - t0,
                "error": f"{exc.__class__.__name__}: {str(exc)[:2000]}"}


def stage_bench(args, name: str) -> dict:
    """One benchmark through `defrag bench`'s runner; merged into DIR/bench/results.json and results.md."""
    from defrag.benchmarks import runner

    out = Path(args.out)
    bench_dir = out / "bench"
    stage_dir = bench_dir / "stages" / name
    results = runner.run([name], device=args.device, smoke=args.smoke, out=stage_dir, progress=False)
    res = results["benchmarks"][name]
    if res.get("plot"):
        res["plot"] = f"stages/{name}/{res['plot']}"
    merged_path = bench_dir / "results.json"
    merged = json.loads(merged_path.read_text()) if merged_path.exists() else None
    if not merged or merged.get("machine", {}).get("device") != results["machine"]["device"]:
        merged = {"machine": results["machine"], "smoke": results["smoke"], "benchmarks": {}, "seconds": 0.0}
    merged["benchmarks"][name] = res
    merged["seconds"] = sum(r.get("seconds", 0.0) for r in merged["benchmarks"].values())
    merged_path.write_text(json.dumps(merged, indent=1) + "\n")
    runner.write_markdown(merged, bench_dir / "results.md")
    return {"benchmark": name, "device": results["machine"]["device"], "status": res["status"],
            "rows": len(res.get("rows", [])), "reason": res.get("reason"),
            "error": _tail(res.get("error") or "", 1500) or None,
            "goals": runner.goals_of({"benchmarks": {name: res}}), "seconds": res.get("seconds"),
            "figures": res.get("rows", [])[:40]}


def model_traces(smoke: bool) -> dict:
    """The traces the model stages replay: small ones for --smoke, else every generator's default and an
    80 GiB-class serving trace; name -> (trace, capacity)."""
    from defrag.traces import GENERATORS, checkerboard, llm_serving

    KiB, MiB, GiB, page = 1 << 10, 1 << 20, 1 << 30, 2 << 20
    if smoke:
        traces = {"llm_serving (steps=400)": llm_serving(seed=0, steps=400),
                  "checkerboard (32 MiB)": checkerboard(seed=0, total_bytes=32 * MiB, rounds=2)}
    else:
        traces = {name: gen(seed=0) for name, gen in GENERATORS.items()}
    out = {name: (t, (-(-int(t.stats().peak_live_bytes * 1.25) // page) + 1) * page) for name, t in traces.items()}
    if not smoke:
        out["llm_serving 80 GiB-class"] = (llm_serving(steps=18000, kv_bytes_per_token=160 * KiB,
                                                       weights_bytes=40 * GiB, hidden=8192, vocab=128000,
                                                       max_batch=64), 80 * GiB)
    return out


def stage_model(args, expandable: bool) -> dict:
    """PyTorch's caching allocator (as PYTORCH_CUDA_ALLOC_CONF, set by the parent, configures it) and its
    model on the same traces and caps, in this process: one row per trace."""
    import torch

    from defrag.replay import replay_model
    from defrag.traces.format import ALLOC, FREE

    if not torch.cuda.is_available():
        return {"rows": [], "reason": "no CUDA GPU"}
    torch.cuda.init()
    total = torch.cuda.get_device_properties(0).total_memory
    rows = []
    for name, (trace, capacity) in model_traces(args.smoke).items():
        row = {"trace": name, "expandable": expandable, "capacity": capacity, "events": len(trace.events)}
        if capacity > total:
            rows.append(dict(row, skipped=f"the cap exceeds the GPU's {total} bytes"))
            continue
        fraction = capacity / total
        allowed = int(fraction * total)  # what PyTorch computes from the fraction (double arithmetic)
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(fraction)
        torch.cuda.reset_peak_memory_stats()
        live, failed, ooms, seen_expandable = {}, set(), 0, None
        t0 = time.perf_counter()
        for ev in trace.events:
            if ev[0] == ALLOC:
                try:
                    live[ev[1]] = torch.empty(ev[2], dtype=torch.uint8, device="cuda")
                except torch.cuda.OutOfMemoryError:
                    ooms += 1
                    failed.add(ev[1])
                if seen_expandable is None and live:
                    segs = torch.cuda.memory._snapshot().get("segments", [])
                    seen_expandable = any(sg.get("is_expandable") for sg in segs)
            elif ev[0] == FREE:
                if live.pop(ev[1], None) is None:
                    failed.discard(ev[1])
        torch.cuda.synchronize()
        st = torch.cuda.memory_stats()
        real_s = time.perf_counter() - t0
        live.clear()
        torch.cuda.empty_cache()
        model = replay_model(trace, allowed, expandable=expandable, device_memory=total)
        rows.append(dict(row, allowed=allowed, real_expandable=seen_expandable,
                         real_peak_reserved=st.get("reserved_bytes.all.peak", 0),
                         real_peak_live=st.get("allocated_bytes.all.peak", 0), real_ooms=ooms,
                         real_retries=st.get("num_alloc_retries", 0), real_seconds=round(real_s, 2),
                         model_peak_reserved=model.peak_reserved_bytes, model_peak_live=model.peak_live_bytes,
                         model_ooms=model.ooms, model_seconds=round(model.seconds, 2)))
    return {"rows": rows, "total_memory": total, "torch": torch.__version__,
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}


def run_child_stage(args) -> int:
    """`--stage NAME`: run one stage in this process and write its JSON to --stage-out."""
    t0 = time.perf_counter()
    try:
        if args.stage == "env":
            data = stage_env(args)
        elif args.stage.startswith("bench:"):
            data = stage_bench(args, args.stage.split(":", 1)[1])
        elif args.stage in ("model:native", "model:expandable"):
            data = stage_model(args, args.stage == "model:expandable")
        else:
            raise SystemExit(f"unknown stage {args.stage!r}")
        data["ok"] = True
    except Exception:
        import traceback

        data = {"ok": False, "error": traceback.format_exc()}
    data["seconds"] = time.perf_counter() - t0
    Path(args.stage_out).write_text(json.dumps(data, indent=1, default=str) + "\n")
    print(json.dumps({k: v for k, v in data.items() if k in ("ok", "status", "error", "is_gpu")}, default=str))
    return 0 if data["ok"] else 1


# =========================================================================== the parent: stages, budget, report


class Check:
    """The parent process: runs the stages as subprocesses and keeps the report up to date."""

    def __init__(self, args):
        self.args = args
        self.out = Path(args.out).resolve()
        self.t0 = time.monotonic()
        self.budget = float(args.budget if args.budget is not None else DEFAULT_BUDGET[1] if args.full else FIVE_MINUTES)
        self.env = dict(os.environ)
        # Stages decide for themselves (a stray NUMBA_ENABLE_CUDASIM=1 would hide a real GPU from numba).
        self.env.pop("NUMBA_ENABLE_CUDASIM", None)
        if args.libnvvm:
            self.env["DEFRAG_LIBNVVM"] = args.libnvvm
            root = toolkit_root(args.libnvvm)
            if root and "CUDA_HOME" not in os.environ:
                self.env["CUDA_HOME"] = root
        self.env["PYTHONUNBUFFERED"] = "1"
        gpu, reason = quick_gpu_probe()
        self.report: dict = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv else "",
            "checkout": str(ROOT), "smoke": bool(args.smoke), "budget_s": self.budget,
            "probe": {"gpu": gpu, "reason": reason, "device_name": None},
            "env": None, "stages": [], "tests": {"ran": False, "reason": "not run yet"},
            "benchmarks": {"device": "cuda:0" if gpu else "emulated", "smoke": bool(args.smoke), "seconds": 0.0,
                           "results": {}, "goals": []},
            "complete": False, "verdict": "incomplete: the check is still running (or was killed)",
        }

    # ------------------------------------------------------------------ budget
    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.budget - self.elapsed()

    # ------------------------------------------------------------------ one subprocess stage
    def run_stage(self, name: str, cmd: list[str], timeout: float, env: dict | None = None) -> dict:
        stage = {"name": name, "status": "running", "seconds": 0.0, "timeout_s": None, "returncode": None,
                 "log": f"stage-{_safe(name)}.log", "summary": "", "output_tail": ""}
        self.report["stages"].append(stage)
        left = self.left()
        if left < MIN_STAGE_SECONDS:
            stage.update(status="skipped", summary=f"{OUT_OF_TIME} ({max(left, 0):.0f} s left of {self.budget:.0f} s; "
                                                   "rerun with a larger --budget)")
            self.write()
            return stage
        timeout = max(1.0, min(timeout, left))
        stage["timeout_s"] = round(timeout, 1)
        self.write()  # a report that shows this stage running, should the whole run be killed now
        print(f"[gpu_check] {name} (timeout {timeout:.0f} s) ...", flush=True)
        log_path = self.out / stage["log"]
        t0 = time.monotonic()
        with open(log_path, "w") as log:
            log.write("$ " + " ".join(cmd) + "\n")
            log.flush()
            # Its own process group (not session): a timeout stops the stage and everything it started,
            # and whoever stops this whole command still reaches the stage too.
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env or self.env, stdout=log, stderr=subprocess.STDOUT,
                                    preexec_fn=os.setpgrp)
            try:
                rc = proc.wait(timeout=timeout)
                stage["status"] = "passed" if rc == 0 else "failed"
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                rc = None
                stage["status"] = "timed out"
            except BaseException:
                _kill_group(proc)
                raise
        stage["returncode"] = rc
        stage["seconds"] = round(time.monotonic() - t0, 2)
        stage["output_tail"] = _tail(log_path.read_text(errors="replace"))
        return stage

    def child(self, stage: str, extra: list[str] = ()) -> list[str]:
        out_file = self.out / f"stage-{_safe(stage)}.json"
        if out_file.exists():
            out_file.unlink()
        launch = ([str(BOOTSTRAP), str(HERE / "gpu_check.py")] if IS_CHECKOUT
                  else ["-m", "defrag.benchmarks.gpu_check"])  # an installed defrag: no checkout to bootstrap
        return [sys.executable, *launch, "--stage", stage, "--stage-out", str(out_file), "--out", str(self.out),
                *extra]

    def child_data(self, stage: str) -> dict | None:
        f = self.out / f"stage-{_safe(stage)}.json"
        try:
            return json.loads(f.read_text())
        except (OSError, ValueError):
            return None

    # ------------------------------------------------------------------ stages
    def do_env(self, label: str = "env") -> None:
        timeout = (min(ENV_TIMEOUT, max(60.0, self.left() * 0.5)) if self.args.full
                   else FIVE_MINUTE_PLAN["env"])
        st = self.run_stage(label, self.child("env"), timeout)
        data = self.child_data("env")
        if data is None or not data.get("ok"):
            st["summary"] = "the environment probe failed" + (f": {data['error'].strip().splitlines()[-1]}"
                                                              if data and data.get("error") else "")
            if st["status"] == "passed":
                st["status"] = "failed"
            self.write()
            return
        self.report["env"] = data
        p = self.report["probe"]
        gpu = data["gpu"]
        reason = gpu.get("reason")
        if gpu.get("driver_usable") and not data["is_gpu"]:
            reason = f"the CUDA driver works but torch {data['torch']['version']} cannot use it"
        p.update(gpu=bool(data["is_gpu"]), reason=reason,
                 device_name=gpu.get("name"), torch_cuda=data["torch"]["cuda_build"],
                 driver_cuda=gpu.get("driver_cuda_version"), nvidia_smi=data.get("nvidia_smi"))
        self.report["benchmarks"]["device"] = "cuda:0" if data["is_gpu"] else "emulated"
        self.report["doctor"] = data.get("doctor")
        nv = data.get("libnvvm") or {}
        parts = [f"torch {data['torch']['version']}" + (f"+CUDA {data['torch']['cuda_build']}"
                                                        if data["torch"]["cuda_build"] else ""),
                 "_swap_data_ptr_ " + ("yes" if data["torch"]["swap_data_ptr"] else "NO")
                 + (f" (swap: {data['torch']['swap_mode']})" if data["torch"].get("swap_mode") else "")]
        if gpu.get("driver_cuda_version"):
            parts.append(f"driver CUDA {gpu['driver_cuda_version']} (PTX <= {fmt_version(gpu.get('driver_max_ptx'))})")
        if nv.get("ptx_version"):
            parts.append(f"libNVVM emits PTX {fmt_version(nv['ptx_version'])}"
                         + ("" if nv.get("ptx_ok") is not False else " (TOO NEW)"))
        if "kernel_probe" in data:
            parts.append("kernels " + ("ok" if data["kernel_probe"].get("ok") else "FAILED"))
        st["summary"] = "; ".join(parts)
        if data["problems"] and data["is_gpu"]:
            st["status"] = "failed"
        st["figures"] = {"problems": data["problems"], "warnings": data["warnings"]}
        self.write()

    def maybe_fix_nvvm(self) -> None:
        env = self.report.get("env") or {}
        fix = (env.get("libnvvm") or {}).get("fix")
        if not fix or self.args.libnvvm or "DEFRAG_LIBNVVM" in os.environ:
            return
        self.env["DEFRAG_LIBNVVM"] = fix["DEFRAG_LIBNVVM"]
        if fix.get("CUDA_HOME"):
            self.env["CUDA_HOME"] = fix["CUDA_HOME"]
        self.report["nvvm_fix"] = fix
        print(f"[gpu_check] using {fix['DEFRAG_LIBNVVM']} (PTX {fmt_version(fix['ptx_version'])}) for the next stages",
              flush=True)
        first = self.report["stages"][-1] if self.report["stages"] else None
        label = "env (with DEFRAG_LIBNVVM)"
        self.do_env(label)
        rerun = self.report["stages"][-1]
        if first is not None and first["name"] == "env" and rerun is not first and rerun["status"] != "skipped":
            # The re-run is the environment every later stage has: its verdict replaces the first one's.
            first["status"] = "superseded"
            first["summary"] = f"superseded by {label}: " + str(first.get("summary") or "")
            self.write()

    def first_tests(self) -> list[str]:
        """The backend's and the launcher's test files this checkout has (FIRST_TESTS), as pytest paths."""
        return [f"tests/gpu/{f}" for f in FIRST_TESTS if (ROOT / "tests" / "gpu" / f).is_file()]

    def do_first_tests(self, label: str = "tests:first") -> None:
        """Stage 0: the CUDA backend's and the move kernel launcher's GPU tests, before anything else."""
        files = self.first_tests()
        if not files:
            return
        self.do_tests(label=label, paths=files, key="tests_first", suffix="_first")

    def maybe_rerun_first_tests(self) -> None:
        """The env stage chose another libNVVM and the first tests failed with the one numba found: once more
        with the env's choice (the first run is then reported as superseded, as the first env stage is)."""
        first = next((s for s in self.report["stages"] if s["name"] == "tests:first"), None)
        if first is None or "nvvm_fix" not in self.report or first["status"] not in ("failed", "timed out"):
            return
        label = "tests:first (with DEFRAG_LIBNVVM)"
        self.do_first_tests(label)
        rerun = self.report["stages"][-1]
        if rerun["name"] == label and rerun["status"] != "skipped":
            first["status"] = "superseded"
            first["summary"] = f"superseded by {label}: " + str(first.get("summary") or "")
            self.write()

    def do_tests(self, label: str = "tests", paths: list[str] | None = None, key: str = "tests",
                 suffix: str = "") -> None:
        args = self.args
        if not (ROOT / "tests" / "gpu").is_dir():
            self.report["stages"].append({"name": label, "status": "skipped", "seconds": 0.0, "returncode": None,
                                          "log": None, "output_tail": "",
                                          "summary": "tests/gpu not found: run from a source checkout of defrag"})
            self.report[key] = {"ran": False, "reason": "tests/gpu not found: run from a source checkout of defrag"}
            self.write()
            return
        xml = self.out / f"gpu_tests{suffix}.xml"
        figures = self.out / f"gpu_test_figures{suffix}.jsonl"
        for f in (xml, figures):
            if f.exists():
                f.unlink()
        env = dict(self.env, DEFRAG_GPU_FIGURES=str(figures))
        gpu = self.report["probe"]["gpu"]
        rehearsal = not gpu and (args.rehearse or rehearsal_switch())
        if rehearsal:
            env["DEFRAG_GPU_REHEARSAL"] = "1"
        else:
            env.pop("DEFRAG_GPU_REHEARSAL", None)
        # -v: one line per test in the log, so a stage killed at its timeout still shows what ran
        if paths is None:  # the rest of tests/gpu: the first stage ran the backend's and the launcher's
            paths = ["tests/gpu", *(f"--ignore={f}" for f in self.first_tests())]
        cmd = [sys.executable, str(BOOTSTRAP), "-m", "pytest", *paths, "-v", "-rfEs", "-p", "no:cacheprovider",
               f"--junitxml={xml}"]
        if args.full:
            timeout = args.test_timeout or TEST_TIMEOUT[0 if args.smoke else 1] * (0.4 if key == "tests_first" else 1)
        else:
            timeout = args.test_timeout or FIVE_MINUTE_PLAN[label.split(" ")[0]]
        st = self.run_stage(label, cmd, timeout, env)
        t = {"ran": st["status"] != "skipped", "mode": "cuda" if gpu else ("rehearsal" if rehearsal else "skipped"),
             "command": "python3 benchmarks/_bare_checkout.py -m pytest " + " ".join(paths) + (
                 " (DEFRAG_GPU_REHEARSAL=1)" if rehearsal else ""),
             "cwd": str(ROOT), "returncode": st["returncode"], "seconds": st["seconds"], "log": st["log"],
             "junit": xml.name}
        t.update(parse_junit(xml) or parse_verbose_log(self.out / st["log"]))
        text = st["output_tail"]
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        t["summary"] = next((ln.strip("= ").strip() for ln in reversed(lines)
                             if re.search(r"\b(passed|failed|skipped|error|no tests ran)\b", ln)),
                            st["status"])
        if not t.get("counts"):
            t["counts"] = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", t["summary"])}
        t["figures"] = read_jsonl(figures)
        if not t["ran"]:
            t["reason"] = st["summary"]
        self.report[key] = t
        if st["status"] == "failed" and st["returncode"] == 5:  # no tests collected
            st["status"] = "passed"
        c = t.get("counts", {})
        label = {"cuda": "on the GPU", "rehearsal": "REHEARSAL on the emulated device",
                 "skipped": "no GPU (not rehearsed)"}[t["mode"]]
        st["summary"] = f"{label}: " + (", ".join(f"{n} {k}" for k, n in c.items() if n) if c else t["summary"])
        st["figures"] = {f["name"]: f"{_num(f['value'])} {f['unit']}" for f in t["figures"]}
        self.write()

    def bench_names(self) -> list[str]:
        if self.args.only:
            return [n.strip() for n in self.args.only.split(",") if n.strip()]
        if not self.args.full:
            return [n.split(":", 1)[1] for n in FIVE_MINUTE_PLAN if n.startswith("bench:")]
        return [n for n, (smoke, full) in GPU_BENCHMARKS.items() if (smoke if self.args.smoke else full)]

    def dropped(self) -> str | None:
        """The line that says what the five-minute run leaves out (None for --full or --only)."""
        if self.args.full or self.args.only:
            return None
        kept = set(self.bench_names())
        names = [n for n in GPU_BENCHMARKS if n not in kept]
        if not self.args.no_model:
            names += ["model:native", "model:expandable"]
        return (f"dropped to fit {FIVE_MINUTES} s of GPU time: {', '.join(names)} (--full runs them, "
                f"in up to {DEFAULT_BUDGET[1]} s)")

    def do_bench(self, name: str) -> None:
        device = self.report["benchmarks"]["device"]
        limits = GPU_BENCHMARKS.get(name, OTHER_BENCH_TIMEOUT)
        smoke = self.args.smoke or not self.args.full  # the five-minute run: smoke sizes
        timeout = (FIVE_MINUTE_PLAN.get(f"bench:{name}") if not self.args.full else None) \
            or limits[0 if smoke else 1] or OTHER_BENCH_TIMEOUT[0 if smoke else 1]
        extra = ["--device", device] + (["--smoke"] if smoke else [])
        st = self.run_stage(f"bench:{name}", self.child(f"bench:{name}", extra), timeout)
        data = self.child_data(f"bench:{name}")
        b = self.report["benchmarks"]
        if data and data.get("ok"):
            b["results"][name] = {"status": data["status"], "rows": data["rows"], "reason": data.get("reason")}
            b["goals"] = [g for g in b["goals"] if g["benchmark"] != name] + data["goals"]
            b["seconds"] += data.get("seconds") or 0.0
            if data["status"] == "error":
                st["status"] = "failed"
                last = (data.get("error") or "").strip().splitlines()
                st["summary"] = "error: " + (last[-1] if last else "see the stage log")
            else:
                st["summary"] = (f"{data['rows']} rows on {data['device']}" if data["status"] == "ok"
                                 else f"skipped: {data.get('reason')}")
                st["figures"] = data.get("figures")
                if data["status"] == "skipped":
                    st["status"] = "skipped"
        else:
            b["results"][name] = {"status": "error" if st["status"] != "skipped" else "skipped", "rows": 0,
                                  "reason": st["status"]}
            if data and data.get("error"):
                st["summary"] = data["error"].strip().splitlines()[-1]
        self.write()

    def do_model(self) -> None:
        """Stage 4: PyTorch's allocator against its model, native then expandable (GPU only)."""
        if not self.report["probe"]["gpu"]:  # no stage at all: nothing to compare against
            self.report["model_vs_real_skipped"] = "no GPU: PyTorch's allocator only runs on a GPU"
            self.write()
            return
        rows = self.report.setdefault("model_vs_real", [])
        for label, conf in (("model:native", None), ("model:expandable", "expandable_segments:True")):
            env = dict(self.env)
            env.pop("PYTORCH_ALLOC_CONF", None)
            env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
            if conf:
                env["PYTORCH_CUDA_ALLOC_CONF"] = conf
            extra = ["--smoke"] if self.args.smoke else []
            st = self.run_stage(label, self.child(label, extra), MODEL_TIMEOUT[0 if self.args.smoke else 1], env)
            data = self.child_data(label)
            if data and data.get("ok"):
                new = data.get("rows", [])
                rows.extend(new)
                done = [r for r in new if "skipped" not in r]
                same = sum(r["model_peak_reserved"] == r["real_peak_reserved"] for r in done)
                worst = max((abs(r["model_peak_reserved"] / r["real_peak_reserved"] - 1) for r in done
                             if r["real_peak_reserved"]), default=0.0)
                st["summary"] = (f"{len(done)} traces: model peak reserved = real on {same}, worst "
                                 f"{100 * worst:.1f}% off" if done else data.get("reason") or "no trace ran")
            elif data and data.get("error"):
                st["summary"] = data["error"].strip().splitlines()[-1]
            self.write()

    # ------------------------------------------------------------------ verdict and report
    def finish(self) -> int:
        stages = self.report["stages"]
        # Superseded stages (an env stage re-run with another libNVVM) and stages skipped for time are not
        # failures of the code; the verdict names the latter.
        out_of_time = [s for s in stages if s["status"] == "skipped" and str(s.get("summary", "")).startswith(OUT_OF_TIME)]
        bad = [s for s in stages if s["status"] in ("failed", "timed out")]
        gpu = self.report["probe"]["gpu"]
        if gpu:
            verdict = ("GPU check passed: every stage that ran passed." if not bad else
                       "GPU check FAILED: " + "; ".join(f"{s['name']} {s['status']}" for s in bad) + ".")
        else:
            verdict = ("No GPU present: no GPU test ran on a GPU and no GPU figure is reported. What could run here "
                       + ("ran without errors." if not bad else
                          "had errors: " + "; ".join(f"{s['name']} {s['status']}" for s in bad) + "."))
        if out_of_time:
            verdict += (f" INCOMPLETE: {len(out_of_time)} stage(s) {OUT_OF_TIME} ("
                        + ", ".join(s["name"] for s in out_of_time) + "); rerun with a larger --budget.")
        self.report.update(verdict=verdict, complete=True, seconds=round(self.elapsed(), 1))
        self.write()
        print(verdict)
        print(f"report: {self.out / 'gpu_report.md'}")
        return 1 if bad else 0

    def write(self) -> None:
        self.report["seconds"] = round(self.elapsed(), 1)
        tmp = self.out / "gpu_report.json.tmp"
        tmp.write_text(json.dumps(self.report, indent=1, default=str) + "\n")
        tmp.replace(self.out / "gpu_report.json")
        tmp = self.out / "gpu_report.md.tmp"
        tmp.write_text(render_markdown(self.report))
        tmp.replace(self.out / "gpu_report.md")


def _kill_group(proc) -> None:
    """Stop a stage's process group (it was started in a group of its own), politely first."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-")


def _num(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def read_jsonl(path: Path) -> list[dict]:
    try:
        return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    except (OSError, ValueError):
        return []


def parse_verbose_log(path: Path) -> dict:
    """Counts and failures from ``pytest -v`` lines (when a killed run left no JUnit XML)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return {}
    found = re.findall(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR)", text, re.M)
    if not found:
        return {}
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    key = {"PASSED": "passed", "FAILED": "failed", "SKIPPED": "skipped", "ERROR": "errors"}
    for _, outcome in found:
        counts[key[outcome]] += 1
    return {"counts": counts, "failures": [{"test": n, "message": o} for n, o in found if o in ("FAILED", "ERROR")],
            "skip_reasons": []}


def parse_junit(path: Path) -> dict:
    """Counts, failures and skip reasons from pytest's JUnit XML (empty when there is none)."""
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {}
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures, skips = [], set()
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        kinds = {child.tag for child in case}
        if "failure" in kinds:
            counts["failed"] += 1
            msg = next(c.get("message", "") for c in case if c.tag == "failure")
            failures.append({"test": name, "message": (msg or "")[:500]})
        elif "error" in kinds:
            counts["errors"] += 1
            msg = next(c.get("message", "") for c in case if c.tag == "error")
            failures.append({"test": name, "message": "error: " + (msg or "")[:500]})
        elif "skipped" in kinds:
            counts["skipped"] += 1
            skips.add(next(c.get("message", "") for c in case if c.tag == "skipped"))
        else:
            counts["passed"] += 1
    return {"counts": counts, "failures": failures, "skip_reasons": sorted(s for s in skips if s)}


def render_markdown(r: dict) -> str:
    p = r["probe"]
    lines = ["# defrag GPU check", ""]
    if p.get("gpu"):
        lines.append(f"**GPU: {p.get('device_name') or 'present'}** (torch CUDA {p.get('torch_cuda')}, driver CUDA "
                     f"{p.get('driver_cuda')}); {r['date']}; {'smoke' if r['smoke'] else 'full'} run")
    else:
        lines.append(f"**NO GPU PRESENT** ({p.get('reason')}). Nothing in this report was measured on a GPU; "
                     f"benchmark figures, if any, are from the emulated device. {r['date']}")
    if p.get("nvidia_smi"):
        lines += ["", f"nvidia-smi: `{p['nvidia_smi']}`"]
    lines += ["", f"**Verdict:** {r['verdict']}", "",
              f"Checkout `{r['checkout']}`; `{r['command']}`; {r['seconds']} s of a {r['budget_s']:.0f} s budget.", "",
              *([f"Not run: {r['dropped']}.", ""] if r.get("dropped") else []),
              "## Stages", "", "| stage | status | seconds | summary |", "|---|---|---|---|"]
    for s in r["stages"]:
        status = s["status"] if s["status"] in ("passed", "skipped", "running", "superseded") else f"**{s['status']}**"
        summary = str(s.get("summary") or "").replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {s['name']} | {status} | {s['seconds']} | {summary} |")
    env = r.get("env")
    if env:
        lines += ["", "## Environment", ""]
        t, g, nv = env["torch"], env["gpu"], env.get("libnvvm") or {}
        lines.append(f"- python {env['python']} ({env['executable']}); {env['platform']}")
        lines.append(f"- torch {t['version']} (CUDA build {t['cuda_build']}); `UntypedStorage._swap_data_ptr_`: "
                     + ("present" if t["swap_data_ptr"] else "**missing** (torch < 2.12)")
                     + (f"; storages move by: {t['swap_mode']} ({t.get('swap_mode_seconds')} s to decide)"
                        if t.get("swap_mode") else "")
                     + (f"; allocation fast path: {t['fast_path']} ({t.get('fast_path_seconds')} s)"
                        if t.get("fast_path") else ""))
        v = env["versions"]
        lines.append("- " + ", ".join(f"{k} {v[k]}" for k in v if v[k]))
        lines.append(f"- driver: {'CUDA ' + g['driver_cuda_version'] if g.get('driver_cuda_version') else 'none'}"
                     + (f", accepts PTX up to {fmt_version(g.get('driver_max_ptx'))}" if g.get("driver_max_ptx") else "")
                     + f"; GPU: {g.get('name') or 'none'} ({g.get('reason')})")
        if nv.get("path"):
            lines.append(f"- libNVVM: `{nv['path']}` (found via {nv.get('found_via')}), NVVM {fmt_version(nv.get('nvvm_version'))}, "
                         f"IR {fmt_version(nv.get('ir_version'))}; emits PTX {fmt_version(nv.get('ptx_version'))} "
                         f"for {nv.get('arch')}" + ({True: " (ok for this driver)", False: " (**too new for this driver**)",
                                                     None: ""}[nv.get("ptx_ok")])
                         + (f"; cuModuleLoadData: {nv['driver_load']}" if nv.get("driver_load") else ""))
        elif nv.get("error"):
            lines.append(f"- libNVVM: not usable ({nv['error']})")
        if nv.get("DEFRAG_LIBNVVM") or nv.get("CUDA_HOME"):
            lines.append(f"- DEFRAG_LIBNVVM={nv.get('DEFRAG_LIBNVVM')} CUDA_HOME={nv.get('CUDA_HOME')}")
        if nv.get("candidates"):
            lines.append("- libNVVMs on this machine: " + ", ".join(f"`{c}`" for c in nv["candidates"]))
        if r.get("nvvm_fix"):
            fx = r["nvvm_fix"]
            lines.append(f"- **used for the later stages**: DEFRAG_LIBNVVM={fx['DEFRAG_LIBNVVM']} "
                         f"CUDA_HOME={fx.get('CUDA_HOME')} (PTX {fmt_version(fx['ptx_version'])})")
        if "kernel_probe" in env:
            k = env["kernel_probe"]
            lines.append("- defrag.kernels on the GPU: " + (f"ok ({k.get('seconds_with_compile', 0):.1f} s with compile)"
                                                             if k.get("ok") else f"**failed**: {k.get('error')}"))
        lines.append("- imported from: " + ", ".join(f"{k} `{w}`" for k, w in env["imported_from"].items()))
        for x in env.get("problems", []):
            lines.append(f"- **problem**: {x}")
        for x in env.get("warnings", []):
            lines.append(f"- warning: {x}")
    tf = r.get("tests_first")
    if tf:
        lines += ["", "## The CUDA backend's and the move kernel launcher's tests (the first stage)", ""]
        if not tf.get("ran"):
            lines.append(f"Not run: {tf.get('reason')}")
        else:
            lines.append(f"`{tf['command']}` (exit {tf['returncode']}, {tf['seconds']} s): **{tf.get('summary')}**")
            for f in tf.get("failures", [])[:20]:
                lines.append(f"- FAILED `{f['test']}`: {f['message'].splitlines()[0] if f['message'] else ''}")
            lines.append(f"\nLog: [{tf['log']}]({tf['log']})")
    t = r["tests"]
    lines += ["", "## tests/gpu" + (" (the rest)" if tf else ""), ""]
    if not t.get("ran"):
        lines.append(f"Not run: {t.get('reason')}")
    else:
        mode = {"cuda": "on the GPU", "rehearsal": "REHEARSAL on the emulated device (2 MiB pages), not on a GPU",
                "skipped": "no GPU: the tests skip (add --rehearse to rehearse them on the emulated device)"}[t["mode"]]
        lines.append(f"`{t['command']}` ({mode}; exit {t['returncode']}, {t['seconds']} s): **{t.get('summary')}**")
        for f in t.get("failures", [])[:20]:
            lines.append(f"- FAILED `{f['test']}`: {f['message'].splitlines()[0] if f['message'] else ''}")
        for reason in t.get("skip_reasons", [])[:8]:
            lines.append(f"- skipped: {reason}")
        if t.get("figures"):
            where = "GPU" if t["mode"] == "cuda" else "emulated device: not GPU figures"
            lines += ["", f"Measured by the tests ({where}; never asserted on):", "",
                      "| test | measurement | value | unit | details |", "|---|---|---|---|---|"]
            for f in t["figures"]:
                extra = ", ".join(f"{k}={_num(v)}" for k, v in f.items()
                                  if k not in ("test", "name", "value", "unit", "backend"))
                lines.append(f"| {f['test']} | {f['name']} | {_num(f['value'])} | {f['unit']} | {extra} |")
        lines.append(f"\nLog: [{t['log']}]({t['log']})")
    b = r["benchmarks"]
    lines += ["", f"## Benchmarks ({b['device']}, {'smoke' if b['smoke'] else 'full'} sizes)", ""]
    if not b["results"]:
        lines.append("None ran.")
    for name, res in b["results"].items():
        state = {"ok": f"{res['rows']} rows", "skipped": f"skipped: {res.get('reason')}"}.get(
            res["status"], f"**{res['status']}** ({res.get('reason') or 'see its stage log'})")
        lines.append(f"- {name}: {state}")
    if b["goals"]:
        lines += ["", "| benchmark | goal | where | met |", "|---|---|---|---|"]
        for g in b["goals"]:
            met = "n/a on this device" if g["met"] is None else ("yes" if g["met"] else "**no**")
            lines.append(f"| {g['benchmark']} | {g['goal']} | {g['where']} | {met} |")
    if b["results"]:
        lines += ["", "Tables and plots: [bench/results.md](bench/results.md)"]
    if r.get("model_vs_real_skipped"):
        lines += ["", "## PyTorch's caching allocator: real vs model", "", f"Not run: {r['model_vs_real_skipped']}"]
    if r.get("model_vs_real"):
        lines += ["", "## PyTorch's caching allocator: real vs model (defrag.traces.torch_model)", "",
                  "Same trace, same cap (`set_per_process_memory_fraction`); MiB.", "",
                  "| trace | allocator | cap | real peak reserved | model peak reserved | model / real | "
                  "real OOMs | model OOMs | real peak live | model peak live |", "|---" * 10 + "|"]
        mib = 1 << 20
        for m in r["model_vs_real"]:
            kind = "expandable" if m["expandable"] else "native"
            if "skipped" in m:
                lines.append(f"| {m['trace']} | {kind} | {m['capacity'] / mib:.0f} | skipped: {m['skipped']} |||||||")
                continue
            ratio = m["model_peak_reserved"] / m["real_peak_reserved"] if m["real_peak_reserved"] else float("nan")
            if m["expandable"] and m.get("real_expandable") is False:
                kind += " (**real segments not expandable**)"
            lines.append(f"| {m['trace']} | {kind} | {m['capacity'] / mib:.0f} | {m['real_peak_reserved'] / mib:.1f} | "
                         f"{m['model_peak_reserved'] / mib:.1f} | {ratio:.4f} | {m['real_ooms']} | {m['model_ooms']} | "
                         f"{m['real_peak_live'] / mib:.1f} | {m['model_peak_live'] / mib:.1f} |")
    failed = [s for s in r["stages"] if s["status"] in ("failed", "timed out")]
    if failed:
        lines += ["", "## Output of failed stages", ""]
        for s in failed:
            lines += [f"### {s['name']} ({s['status']}; log: {s['log']})", "", "```", s["output_tail"][-3000:], "```", ""]
    return "\n".join(lines) + "\n"


# =========================================================================== entry point


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python3 benchmarks/gpu_check.py", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu-report",
                    help="folder for gpu_report.md/.json, the stage logs and bench/ (default: ./gpu-report, "
                         "under the current directory)")
    ap.add_argument("--smoke", action="store_true",
                    help=f"small sizes and fewer benchmarks (the default run is one: at most {FIVE_MINUTES} s)")
    ap.add_argument("--full", action="store_true",
                    help=f"every GPU benchmark at full size and the model stages (at most {DEFAULT_BUDGET[1]} s; "
                         f"with --smoke, {DEFAULT_BUDGET[0]} s)")
    ap.add_argument("--only", default=None, help="comma-separated benchmark names (default: the GPU benchmarks)")
    ap.add_argument("--no-tests", action="store_true", help="do not run tests/gpu")
    ap.add_argument("--no-bench", action="store_true", help="do not run benchmarks")
    ap.add_argument("--no-model", action="store_true",
                    help="do not compare PyTorch's allocator with its model (stage 4, GPU only)")
    ap.add_argument("--rehearse", action="store_true",
                    help="without a GPU, run tests/gpu as the rehearsal on the emulated device (DEFRAG_GPU_REHEARSAL=1)")
    ap.add_argument("--budget", type=float, default=None,
                    help=f"seconds for the whole check (default {FIVE_MINUTES}; with --full {DEFAULT_BUDGET[1]}, "
                         f"or {DEFAULT_BUDGET[0]} with --full --smoke); each stage's timeout is cut to what is left")
    ap.add_argument("--test-timeout", type=float, default=None,
                    help=f"seconds for tests/gpu (default {TEST_TIMEOUT[0]} with --smoke, {TEST_TIMEOUT[1]} without)")
    ap.add_argument("--libnvvm", default=None, help="the libnvvm.so numba must use (sets DEFRAG_LIBNVVM and CUDA_HOME)")
    # internal: one stage in this process (the parent runs these through benchmarks/_bare_checkout.py)
    ap.add_argument("--stage", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--stage-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--device", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--nvvm-probe", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--arch", default="compute_90", help=argparse.SUPPRESS)
    ap.add_argument("--driver-load", action="store_true", help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.nvvm_probe:  # internal: which PTX does this libNVVM emit (own process: one libNVVM per process)
        import ctypes

        try:
            ctypes.CDLL(args.nvvm_probe, mode=os.RTLD_NOW | os.RTLD_GLOBAL)
            res = nvvm_probe(args.arch, load_in_driver=args.driver_load)
        except OSError as exc:
            res = {"error": f"OSError: {exc}"}
        print(json.dumps(res, default=str))
        return 0
    if args.stage:
        return run_child_stage(args)
    names = []
    if args.only:
        known = registered_benchmarks()
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if known and n not in known]
        if unknown:
            print(f"gpu_check: unknown benchmark(s) {unknown}; registered: {', '.join(known)}", file=sys.stderr)
            return 2
    missing = missing_packages()
    if missing:
        print(f"gpu_check: this Python ({sys.executable}) lacks {', '.join(missing)}, which defrag needs: run it "
              f"from an environment that has them (the README's setup line makes one: .venv), or pip install "
              f"them; nothing was run", file=sys.stderr)
        return 2
    try:
        rehearsal_switch()
    except Exception as exc:  # noqa: BLE001 - a SettingError: one line, nothing run
        print(f"gpu_check: {exc}", file=sys.stderr)
        return 2
    if args.full and args.budget is None and args.smoke:
        args.budget = DEFAULT_BUDGET[0]
    if not args.full:
        args.smoke = True  # the five-minute run: the benchmarks at smoke sizes
    Path(args.out).mkdir(parents=True, exist_ok=True)
    check = Check(args)

    def on_term(signum, frame):  # killed from outside: the report says how far it got
        check.report["verdict"] = f"incomplete: stopped by signal {signum} after {check.elapsed():.0f} s"
        check.write()
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    p = check.report["probe"]
    print("[gpu_check] " + ("GPU present" if p["gpu"] else f"NO GPU PRESENT ({p['reason']})")
          + f"; checkout {ROOT}; budget {check.budget:.0f} s", flush=True)
    check.write()
    dropped = check.dropped()
    if dropped:
        check.report["dropped"] = dropped
        print(f"[gpu_check] {dropped}", flush=True)
    if not args.no_tests:  # the backend's and the launcher's tests first, before anything else
        check.do_first_tests()
        print(f"[gpu_check] backend and launcher tests: {check.report.get('tests_first', {}).get('summary')}",
              flush=True)
    check.do_env()
    check.maybe_fix_nvvm()
    p = check.report["probe"]
    print("[gpu_check] " + (f"GPU: {p.get('device_name')}" if p["gpu"] else f"NO GPU PRESENT ({p['reason']})"),
          flush=True)
    if not args.no_tests:
        check.maybe_rerun_first_tests()
        check.do_tests()
        print(f"[gpu_check] tests/gpu: {check.report['tests'].get('summary')}", flush=True)
    if not args.no_bench:
        for name in check.bench_names():
            check.do_bench(name)
            print(f"[gpu_check] bench {name}: {check.report['stages'][-1]['summary']}", flush=True)
    if not args.no_model and args.full:
        check.do_model()
        print("[gpu_check] PyTorch's allocator vs its model: "
              + (check.report.get("model_vs_real_skipped") or check.report["stages"][-1]["summary"]), flush=True)
    return check.finish()


if __name__ == "__main__":
    sys.exit(main())
