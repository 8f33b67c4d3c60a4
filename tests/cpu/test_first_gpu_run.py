"""Issue 45, what a CPU can check of the first GPU run: the driver calls as the real binding takes them,
the move kernel's image and launcher, and the extension builds (arch flags, CUDA_HOME) without CUDA.

The real `cuda.bindings.driver` functions check their arguments' types before they look for the driver
library: on a machine without one, a call with arguments the binding takes raises the library's
RuntimeError ("no driver"), one it refuses a TypeError or OverflowError. That is how these tests hold
the emulated driver to the binding: every call a pool session makes is handed to the real function too.
"""

from __future__ import annotations

import ctypes
import gc
import os
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from cuda.bindings import driver as cu

import defrag
from defrag.driver import Driver, EmulatedCuda
from defrag.driver.signatures import _C_INTS, SIGNATURES, conform, parameters

from .conftest import KiB, MiB, check_pattern, fill_pattern

R = cu.CUresult


def _no_gpu_driver() -> str | None:
    """Why the real binding's functions can be called with made-up arguments here (None: they cannot,
    a real driver with a device would act on them)."""
    try:
        err, = cu.cuInit(0)
    except RuntimeError:
        return "no CUDA driver library"
    if err == R.CUDA_SUCCESS:
        return None
    return f"the CUDA driver has no usable device ({R(int(err)).name})"


needs_no_gpu = pytest.mark.skipif(_no_gpu_driver() is None,
                                  reason="a working CUDA driver: the real binding would act on made-up arguments")


def _real(name: str, args: tuple):
    """What the real binding does with `args`: "taken" (it reached the driver, or the missing driver), or
    the exception class it refused them with."""
    try:
        getattr(cu, name)(*args)
    except RuntimeError:  # cuda.pathfinder's DynamicLibNotFoundError: the arguments were converted
        return "taken"
    except Exception as exc:  # noqa: BLE001 - what the binding refused the arguments with
        return type(exc)
    return "taken"  # an error result (a driver without a device)


def _emulated(name: str, args: tuple):
    try:
        conform(name, args)
    except Exception as exc:  # noqa: BLE001
        return type(exc)
    return "taken"


# ---------------------------------------------------------------------------------------- 11: the signatures
def _binding_parameters(name: str) -> list[tuple[str, str]]:
    """(parameter, declared C type or '') from the first line of the binding's docstring."""
    line = getattr(cu, name).__doc__.strip().splitlines()[0]
    inside = re.fullmatch(rf"{name}\((.*)\)", line).group(1)
    out = []
    for part in filter(None, (p.strip() for p in inside.split(", ") if p)):
        head = part.split(":")[0].strip()  # "CUmemAllocationProp prop", "attrib", "unsigned int Flags"
        words = head.replace("*", " * ").split()
        out.append((words[-1], " ".join(words[:-1])))
    return out


def test_the_signature_table_is_the_installed_bindings():
    """Every call the emulated driver answers is in the table, with the binding's own parameter names in
    its order and, where the binding declares a C integer type, that type."""
    emulated = {n for n in dir(EmulatedCuda) if n.startswith("cu") and callable(getattr(EmulatedCuda, n))}
    assert emulated == set(SIGNATURES)
    for name, spec in SIGNATURES.items():
        theirs = _binding_parameters(name)
        assert [p for p, _ in theirs] == list(parameters(name)), name
        for (param, ctype), (_, kind) in zip(theirs, spec):
            if ctype in _C_INTS:
                assert kind == ctype, (name, param)
            elif ctype == "char *":
                assert kind == "char *", (name, param)
            else:
                assert kind not in _C_INTS, (name, param, ctype)


class _IndexOnly:
    def __index__(self):
        return 3


class _IntOnly:
    def __int__(self):
        return 3


def _desc():
    d = cu.CUmemAccessDesc()
    d.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    return d


_PROBES = [None, 0, 1, -1, 255, 256, 2**31, 2**32, 2**63, 2**64, 1.5, "x", b"x", bytearray(b"xy"), [], (),
           ((), ()), (1, 2), [_desc()], (_desc(),), _desc(), cu.CUstream(5), cu.CUdevice(1), cu.CUdeviceptr(4096),
           np.int64(7), np.uint32(7), np.float64(2.0), True, _IndexOnly(), _IntOnly(), ctypes.c_void_p(4096),
           object(), cu.CUmemAllocationProp(), cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT]

_BASE = {  # arguments each call takes (the probes replace one at a time)
    "cuInit": (0,), "cuDeviceGet": (0,), "cuDeviceGetName": (64, cu.CUdevice(0)), "cuDeviceTotalMem": (0,),
    "cuDeviceGetAttribute": (cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 0),
    "cuDevicePrimaryCtxRetain": (0,), "cuDevicePrimaryCtxRelease": (0,), "cuCtxSetCurrent": (cu.CUcontext(1),),
    "cuStreamSynchronize": (cu.CUstream(0),), "cuStreamIsCapturing": (cu.CUstream(0),),
    "cuMemGetAllocationGranularity": (cu.CUmemAllocationProp(), 0),
    "cuMemCreate": (4096, cu.CUmemAllocationProp(), 0), "cuMemRelease": (7,),
    "cuMemAddressReserve": (4096, 0, 0, 0), "cuMemAddressFree": (4096, 4096), "cuMemMap": (4096, 4096, 0, 7, 0),
    "cuMemUnmap": (4096, 4096), "cuMemSetAccess": (4096, 4096, [_desc()], 1),
    "cuMemcpyDtoD": (4096, 8192, 16), "cuMemcpyDtoDAsync": (4096, 8192, 16, cu.CUstream(0)),
    "cuMemsetD8Async": (4096, 1, 16, cu.CUstream(0)), "cuMemAllocHost": (16,), "cuMemFreeHost": (4096,),
    "cuMemcpyDtoH": (4096, 8192, 16), "cuMemcpyHtoD": (4096, 8192, 16),
    "cuMemcpyDtoHAsync": (4096, 8192, 16, cu.CUstream(0)), "cuMemcpyHtoDAsync": (4096, 8192, 16, cu.CUstream(0)),
    "cuMemAlloc": (16,), "cuMemFree": (4096,), "cuEventCreate": (2,), "cuEventRecord": (cu.CUevent(1), 0),
    "cuEventSynchronize": (cu.CUevent(1),), "cuEventQuery": (cu.CUevent(1),), "cuEventDestroy": (cu.CUevent(1),),
    "cuModuleLoadData": (b"image",), "cuModuleUnload": (cu.CUmodule(1),),
    "cuModuleGetFunction": (cu.CUmodule(1), b"move"),
    "cuFuncGetAttribute": (cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS, cu.CUfunction(1)),
    "cuOccupancyMaxActiveBlocksPerMultiprocessor": (cu.CUfunction(1), 256, 0),
    "cuLaunchKernel": (cu.CUfunction(1), 1, 1, 1, 256, 1, 1, 0, cu.CUstream(0), 4096, 0),
}


@needs_no_gpu
def test_the_emulated_driver_refuses_exactly_what_the_binding_refuses():
    """Each parameter of each call, given each probe value: the emulated driver's argument check and
    the real function raise the same exception class, or both take the value."""
    assert set(_BASE) | {n for n, spec in SIGNATURES.items() if not spec} == set(SIGNATURES)
    differ = []
    for name, base in _BASE.items():
        assert _real(name, base) == "taken" == _emulated(name, base), name
        for i in range(len(base)):
            for probe in _PROBES:
                args = base[:i] + (probe,) + base[i + 1:]
                real, ours = _real(name, args), _emulated(name, args)
                if real != ours:
                    differ.append(f"{name} {parameters(name)[i]}={probe!r}: binding {real}, emulated {ours}")
        for args in (base[:-1], base + (0,)):  # a wrong number of arguments
            assert _real(name, args) is TypeError and _emulated(name, args) is TypeError, (name, len(args))
    assert not differ, "\n".join(differ)


def test_the_emulated_launch_takes_extra_as_an_integer_and_refuses_none():
    """cuLaunchKernel's `extra` is a void_ptr: the binding wants an integer there (0: none). The emulated
    driver once wanted None, which holds the GPU's TypeError in place in every CPU test."""
    api = EmulatedCuda(capacity=4 * MiB, granularity=64 * KiB)
    drv = Driver(api, 0, kind="emulated")
    args = (cu.CUfunction(0x999), 1, 1, 1, 32, 1, 1, 0, cu.CUstream(0), 4096)
    with pytest.raises(TypeError, match="an integer is required"):
        api.cuLaunchKernel(*args, None)
    assert api.cuLaunchKernel(*args, 0) == (R.CUDA_ERROR_INVALID_HANDLE,)  # taken; no such function
    assert api.cuLaunchKernel(*args, 16) == (R.CUDA_ERROR_INVALID_HANDLE,)
    api.close()
    drv.close()


# ---------------------------------------------------------------------------------------- a whole session
class RealBindingCheck:
    """A driver API in front of an `EmulatedCuda`: each `cu*` call is first handed, with the same
    arguments, to the real `cuda.bindings.driver` function, where the only outcome allowed is "no
    driver" (or an error result); a TypeError, OverflowError or ValueError there is recorded in
    `refused`. Then the emulated device answers the call."""

    def __init__(self, api):
        self._api = api
        self.refused: list[str] = []
        self.checked: Counter = Counter()

    def __getattr__(self, name):
        target = getattr(self._api, name)
        if not name.startswith("cu") or not callable(target):
            return target
        real = getattr(cu, name)

        def call(*args):
            try:
                real(*args)
            except RuntimeError:
                pass
            except Exception as exc:  # noqa: BLE001 - the binding refused what defrag passed
                self.refused.append(f"{name}{tuple(type(a).__name__ for a in args)}: {type(exc).__name__}: {exc}")
            self.checked[name] += 1
            return target(*args)
        self.__dict__[name] = call
        return call


def _fragment(pool, count=90, seed=3):
    rng = np.random.default_rng(seed)
    made = [pool.empty(int(rng.integers(1, 40)) * 512, dtype=torch.uint8) for _ in range(count)]
    for i, t in enumerate(made):
        fill_pattern(t, i)
    return {i: t for i, t in enumerate(made) if rng.random() < 0.35}


def _session(pool) -> None:
    """Allocate; compact with each engine; mesh, unmesh; sleep, wake: every byte kept."""
    keep = _fragment(pool)
    for n, engine in enumerate(("memmove", "driver", "auto", "kernel")):
        more = _fragment(pool, count=30, seed=10 + n)
        for s, t in more.items():
            fill_pattern(t, 1000 * (n + 1) + s)
            keep[1000 * (n + 1) + s] = t
        pool.compact(engine=engine, verify=engine != "kernel")
    pinned = []
    for i in range(16):  # pages of pinned blocks, a quarter of each kept: something to mesh
        t = pool.empty(16 * KiB, dtype=torch.uint8)
        fill_pattern(t, 5000 + i)
        pool.pin(t)
        pinned.append(t)
    for i, t in enumerate(pinned):
        if i % 4 == (i // 4) % 4:
            keep[5000 + i] = t
        else:
            pool.unpin(t)
    del pinned, t
    gc.collect()
    assert pool.mesh(engine="auto").meshed_pages > 0
    pool.unmesh()  # a meshed pool does not sleep (v1)
    pool.sleep()
    pool.wake()
    assert all(check_pattern(t, s) for s, t in keep.items())
    pool.check_invariants()


@needs_no_gpu
def test_every_driver_call_of_a_pool_session_is_one_the_real_binding_takes():
    """Allocate, compact with each engine, mesh, sleep, wake, close: every driver call defrag makes goes to
    the real cuda-bindings function as well, which must take its arguments (it then finds no driver)."""
    from defrag import copying

    api = EmulatedCuda(capacity=16 * MiB, granularity=64 * KiB)
    check = RealBindingCheck(api)
    drv = Driver(check, 0, kind="emulated")
    pool = defrag.Pool(device=drv, capacity="2MiB", auto_compact=False)
    try:
        _session(pool)
    finally:
        pool.close()
        gc.collect()
        copying.launcher_for(drv).close()
    assert api.state() == {"handles": 0, "mappings": 0, "reservations": 0, "used_bytes": 0}
    assert api.kernel_state() == {"linear_buffers": 0, "linear_bytes": 0, "modules": 0, "events": 0}
    drv.close()
    assert not check.refused, "\n".join(check.refused)
    expected = {"cuMemCreate", "cuMemAddressReserve", "cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuMemRelease",
                "cuMemcpyDtoDAsync", "cuLaunchKernel", "cuMemcpyHtoDAsync", "cuMemAlloc", "cuMemAllocHost",
                "cuEventRecord", "cuModuleLoadData", "cuModuleGetFunction", "cuCtxSynchronize", "cuMemFreeHost",
                "cuCtxGetCurrent", "cuMemcpyDtoHAsync", "cuMemAddressFree", "cuMemFree", "cuModuleUnload"}
    assert expected <= set(check.checked), sorted(expected - set(check.checked))


# ---------------------------------------------------------------------------------------- 10: the image
def _fake_numba(monkeypatch, cubin):
    """numba-cuda's compile of the move kernel, as 0.30 answers it (`get_cubin` as given), on a CPU."""
    import sys
    import types

    from defrag import kernels
    from defrag.kernels import abi, arena

    ptx = (".visible .entry _Z4move(\n" + ",\n".join(f"\t.param .u64 p{i}" for i in range(abi.PARAMS))
           + "\n)\n{\n}\n")

    class Library:
        def get_asm_str(self, cc):
            return ptx

        def get_cubin(self, cc):
            return cubin

    class Kernel:
        def compile(self, signature):
            return types.SimpleNamespace(entry_name="_Z4move", library=Library())

    fake = types.SimpleNamespace(move_kernel=Kernel())
    monkeypatch.setattr(arena, "require_backend", lambda: False)  # as on a GPU
    monkeypatch.setitem(sys.modules, "defrag.kernels._device", fake)
    monkeypatch.setattr(kernels, "_device", fake, raising=False)


CUBIN = b"\x7fELF\x02\x01\x01" + bytes(57)


def test_a_cubin_that_numba_cuda_returns_as_an_object_code_is_the_image(monkeypatch):
    """numba-cuda 0.30's `get_cubin` returns a cuda.core ObjectCode (bytes() of it is a TypeError): the
    image is its `.code`; bytes as older numba-cuda returns them still work."""
    object_code = pytest.importorskip("cuda.core").ObjectCode
    from defrag.kernels import abi, image

    _fake_numba(monkeypatch, object_code.from_cubin(CUBIN))
    built = image.build_move_image((9, 0))
    assert (built.data, built.entry, built.params, built.origin) == (CUBIN, "_Z4move", abi.PARAMS, "built")
    _fake_numba(monkeypatch, bytearray(CUBIN))
    assert image.build_move_image((9, 0)).data == CUBIN
    _fake_numba(monkeypatch, b"// PTX, not a cubin")
    from defrag.kernels import KernelUnavailableError

    with pytest.raises(KernelUnavailableError, match="not an ELF image"):
        image.build_move_image((9, 0))


def test_the_cache_key_follows_the_toolchain_and_the_driver(tmp_path):
    """A new libNVVM, nvJitLink or driver builds its own image (the cache key names them)."""
    from defrag.kernels import abi, image

    built = []

    def build(cc):
        built.append(cc)
        return image.KernelImage(CUBIN, "_Z4move", abi.PARAMS, "built")
    dirs = [tmp_path]
    one = "nvvm 2.0 /cuda-13.0/libnvvm.so.4 1000; nvJitLink none; driver 13000"
    assert image.move_image((9, 0), build=build, dirs=dirs, toolchain=one).origin == "built"
    assert image.move_image((9, 0), build=build, dirs=dirs, toolchain=one).origin == "cache"
    assert image.move_image((9, 0), build=build, dirs=dirs, toolchain=one.replace("13000", "13010")).origin == "built"
    assert image.move_image((9, 0), build=build, dirs=dirs, toolchain=one.replace("1000;", "1001;")).origin == "built"
    assert len(built) == 3
    words = image.toolchain_versions(12080)
    assert words.startswith("nvvm ") and "; nvJitLink " in words and words.endswith("; driver 12080")


def test_a_rebuild_replaces_the_cached_image(tmp_path):
    from defrag.kernels import abi, image

    made = iter([CUBIN, CUBIN[:-1] + b"\x01"])

    def build(cc):
        return image.KernelImage(next(made), "_Z4move", abi.PARAMS, "built")
    dirs = [tmp_path]
    first = image.move_image((9, 0), build=build, dirs=dirs, toolchain="t")
    again = image.move_image((9, 0), build=build, dirs=dirs, toolchain="t", rebuild=True)
    assert again.origin == "built" and again.data != first.data
    assert image.move_image((9, 0), build=build, dirs=dirs, toolchain="t").data == again.data


def test_the_gpu_image_source_keys_on_the_driver_and_can_rebuild(monkeypatch):
    from defrag import copying
    from defrag.kernels import image

    asked = []
    monkeypatch.setattr(image, "move_image", lambda cc, **kw: asked.append((cc, kw)) or "image")

    class FakeGpu:
        def compute_capability(self):
            return (9, 0)

        def driver_version(self):
            return 13000
    source = copying._gpu_image(FakeGpu())
    assert source() == "image" and source(rebuild=True) == "image"
    (cc, kw), (_, kw2) = asked
    assert cc == (9, 0) and kw["toolchain"].endswith("driver 13000") and not kw["rebuild"] and kw2["rebuild"]


# ---------------------------------------------------------------------------------------- 12: the launcher
def _emulated_driver():
    return Driver.emulated(capacity=4 * MiB, granularity=64 * KiB)


def _twin():
    from defrag import copying
    from defrag.kernels import host

    return copying._host_image(host.ENTRY)


def test_the_launchers_tables_are_made_when_it_loads_not_in_a_wave():
    """A wave may run inside an OOM rescue on a full GPU: it allocates nothing (tables up to
    FIRST_SEGMENTS segments), the load made them."""
    from defrag.kernels.launch import SLOTS, MoveLauncher

    from .test_copying import PAGE, Region, _apply, random_wave

    region = Region(8, seed=4)
    drv = region.drv
    launcher = MoveLauncher(drv, _twin())
    assert launcher.load()
    assert drv.faults.calls.get("cuMemAlloc", 0) == SLOTS and drv.faults.calls.get("cuMemAllocHost", 0) == SLOTS
    assert drv.api.kernel_state()["linear_buffers"] == SLOTS
    drv.faults.inject("cuMemAlloc", R.CUDA_ERROR_OUT_OF_MEMORY, repeat=True)  # a full GPU from now on
    drv.faults.inject("cuMemAllocHost", R.CUDA_ERROR_OUT_OF_MEMORY, repeat=True)
    rng = np.random.default_rng(4)
    expected = region.host.copy()
    for _ in range(2 * SLOTS):
        src, dst, size = random_wave(rng, rng.integers(1, 40, 60) * 16, 8 * PAGE)
        _apply(expected, src, dst, size)
        launcher.move(region.base, region.size, src, dst, size)
    drv.synchronize()
    assert np.array_equal(region.host, expected) and drv.faults.injected == []
    drv.faults.clear()
    launcher.close()
    region.close()


def test_a_failed_load_is_tried_again_once_due_and_a_hopeless_one_never():
    from defrag.kernels import KernelUnavailableError
    from defrag.kernels.launch import RETRY_DELAYS, MoveLauncher

    drv = _emulated_driver()
    launcher = MoveLauncher(drv, _twin())
    now = [100.0]
    launcher._clock = lambda: now[0]
    drv.faults.inject("cuModuleLoadData", R.CUDA_ERROR_OUT_OF_MEMORY)  # a GPU full at that moment
    assert launcher.load() is False and "CUDA_ERROR_OUT_OF_MEMORY" in launcher.error
    assert launcher.retry_at == 100.0 + RETRY_DELAYS[0]
    now[0] += RETRY_DELAYS[0] - 1
    assert launcher.load() is False and drv.faults.calls["cuModuleLoadData"] == 1  # not due: not tried
    now[0] += 1
    assert launcher.load() is True and launcher.error is None and drv.faults.calls["cuModuleLoadData"] == 2
    launcher.close()

    # The background route (a GPU's `start`) tries again the same way.
    launcher = MoveLauncher(drv, _twin())
    launcher._clock = lambda: now[0]
    drv.faults.inject("cuModuleGetFunction", R.CUDA_ERROR_UNKNOWN)
    launcher.start()
    assert launcher.wait(30) is False and launcher.loaded
    launcher.start()  # not due: nothing
    assert launcher.wait(30) is False
    now[0] = launcher.retry_at
    launcher.start()
    assert launcher.wait(30) is True and launcher.failures == 1
    launcher.close()

    def hopeless():
        raise KernelUnavailableError("no numba-cuda here")
    launcher = MoveLauncher(drv, hopeless)
    assert launcher.load() is False and launcher.retry_at is None
    now[0] += 1e9
    assert launcher.load() is False and launcher.failures == 1
    assert drv.api.kernel_state() == {"linear_buffers": 0, "linear_bytes": 0, "modules": 0, "events": 0}
    drv.close()


def test_a_cached_image_the_driver_refuses_is_built_again():
    from defrag.kernels import abi, image
    from defrag.kernels.launch import MoveLauncher

    drv = _emulated_driver()
    twin, asked = _twin(), []

    def source(rebuild=False):
        asked.append(rebuild)
        if rebuild:
            return twin()
        return image.KernelImage(CUBIN, "defrag_batched_move", abi.PARAMS, "cache")  # not loadable here
    launcher = MoveLauncher(drv, source)
    assert launcher.load() and asked == [False, True] and launcher.origin == "host"
    launcher.close()
    built = MoveLauncher(drv, lambda: image.KernelImage(CUBIN, "x", abi.PARAMS, "built"))
    assert not built.load() and "CUDA_ERROR_INVALID_IMAGE" in built.error  # a fresh build is not built again
    drv.close()


def test_a_launch_path_that_raises_a_type_error_turns_the_kernel_off_and_copies_the_wave(make_pool, monkeypatch):
    """A TypeError from the launch path (the binding refusing an argument) is no reason to lose a
    compaction: the launcher is off for the process, every move goes to the copy engine."""
    from defrag import copying

    from .test_copying import _fragmented, _intact

    pool = make_pool("4MiB", auto_compact=False)
    keep = _fragmented(pool)

    def refused(*args, **kwargs):
        raise TypeError("an integer is required")
    monkeypatch.setattr(pool.driver, "launch", refused)
    report = pool.compact(engine="auto", verify=True)
    launcher = copying.launcher_for(pool.driver)
    assert report.moved_tensors > 0 and not launcher.ready and "TypeError" in launcher.error
    assert pool.driver.faults.calls["cuMemcpyDtoDAsync"] >= report.moved_tensors
    assert _intact(keep)
    pool.compact(engine="auto", verify=True)  # and later compactions too
    assert _intact(keep)
    pool.check_invariants()


def test_a_copy_path_type_error_in_an_automatic_compaction_is_an_explained_oom(make_pool, monkeypatch):
    """The allocation that triggered the compaction raises OutOfMemoryError naming the failure (not the
    TypeError itself), every tensor keeps its bytes, and the pool rescues the request once it is fixed."""
    from defrag import compactor

    from .test_compaction import fragment

    pool = make_pool("1MiB", auto_mesh=False)
    survivors = fragment(pool)
    real = compactor.copy_ranges

    def refused(*args, **kwargs):
        raise TypeError("an integer is required")
    monkeypatch.setattr(compactor, "copy_ranges", refused)
    with pytest.raises(defrag.OutOfMemoryError, match="TypeError: an integer is required; a defrag bug"):
        pool.empty(pool.capacity // 2, dtype=torch.uint8)
    assert all(check_pattern(t, s) for s, t in survivors.items())
    pool.check_invariants()
    monkeypatch.setattr(compactor, "copy_ranges", real)
    pool.min_compact_interval = 0.0
    big = pool.empty(pool.capacity // 2, dtype=torch.uint8)
    fill_pattern(big, 9)
    assert check_pattern(big, 9) and all(check_pattern(t, s) for s, t in survivors.items())


# ---------------------------------------------------------------------------------------- B: extension builds
def _toolkit(root, *, headers=True):
    """A fake CUDA toolkit under `root`: bin/nvcc and, with `headers`, include/cuda_runtime.h and
    include/crt/host_config.h."""
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "nvcc").write_text("#!/bin/sh\nexit 0\n")
    (root / "bin" / "nvcc").chmod(0o755)
    if headers:
        (root / "include" / "crt").mkdir(parents=True)
        (root / "include" / "cuda_runtime.h").write_text("// fake\n")
        (root / "include" / "crt" / "host_config.h").write_text("// fake\n")
    return root


def _wrapper_on_path(monkeypatch, tmp_path, target):
    """/usr/local/bin/nvcc as these machines have it: a shell script that execs the toolkit's nvcc, alone
    on PATH (with the folder of `c++`, which builds need)."""
    import shutil

    wrapper_bin = tmp_path / "usr-local" / "bin"
    wrapper_bin.mkdir(parents=True)
    (wrapper_bin / "nvcc").write_text(f'#!/bin/sh\nexec {target}/bin/nvcc "$@"\n')
    (wrapper_bin / "nvcc").chmod(0o755)
    tools = {os.path.dirname(shutil.which(t)) for t in ("c++", "ninja") if shutil.which(t)}
    monkeypatch.setenv("PATH", os.pathsep.join([str(wrapper_bin), *sorted(tools)]))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    return wrapper_bin / "nvcc"



def test_a_wrapper_nvcc_on_path_yields_the_toolkit_it_runs(monkeypatch, tmp_path):
    """torch takes the folder above the `nvcc` on PATH (/usr/local for /usr/local/bin/nvcc, no headers);
    the build and the compile check take the toolkit the wrapper runs, checked for its headers."""
    from defrag import cuda_backend, extensions

    real = _toolkit(tmp_path / "cuda-13.0")
    wrapper = _wrapper_on_path(monkeypatch, tmp_path, real)
    home, how = extensions.find_cuda_home()
    assert home == str(real) and str(wrapper) in how and str(real / "bin" / "nvcc") in how
    assert cuda_backend.cuda_include_dir() == str(real / "include")

    # A toolkit without headers is passed over, with what was tried when nothing has them.
    bare = _toolkit(tmp_path / "cuda-bare", headers=False)
    _wrapper_on_path(monkeypatch, tmp_path / "second", bare)
    monkeypatch.setattr(extensions, "_wheel_homes", lambda: [])
    home, tried = extensions.find_cuda_home(system=())
    assert home is None and str(bare) in tried and "cuda_runtime.h" in tried
    monkeypatch.setenv("CUDA_HOME", str(real))  # the user's choice comes first
    assert extensions.find_cuda_home(system=()) == (str(real), "$CUDA_HOME")


class _Captured:
    """`cpp_extension.load` replaced: records its arguments and what torch's build would see."""

    def __init__(self, fail: str | None = None):
        self.calls, self.fail = [], fail

    def __call__(self, name, sources, **kwargs):
        from torch.utils import cpp_extension

        self.calls.append({**kwargs, "CUDA_HOME": cpp_extension.CUDA_HOME,
                           "TORCH_CUDA_ARCH_LIST": os.environ.get("TORCH_CUDA_ARCH_LIST"),
                           "$CUDA_HOME": os.environ.get("CUDA_HOME")})
        if self.fail:
            raise RuntimeError(self.fail)
        import types

        return types.SimpleNamespace(__name__=name)


@pytest.fixture
def cuda_probe(monkeypatch, tmp_path):
    """A CUDA extension in a build folder of its own, a fake toolkit behind a wrapper nvcc, and
    `cpp_extension.load` captured (nothing compiles)."""
    from torch.utils import cpp_extension

    from defrag import extensions

    if extensions.missing_tools():
        pytest.skip(f"no build tools here: {extensions.missing_tools()}")
    monkeypatch.setenv("DEFRAG_EXT_DIR", str(tmp_path / "ext"))
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    toolkit = _toolkit(tmp_path / "cuda-13.0")
    _wrapper_on_path(monkeypatch, tmp_path, toolkit)
    captured = _Captured()
    monkeypatch.setattr(cpp_extension, "load", captured)
    ext = extensions.CppExtension("defrag_probe_cuda", "probe_cuda", "int probe;", "a CUDA probe", "no time",
                                  with_cuda=True)
    return ext, captured, toolkit


def test_a_cuda_build_carries_explicit_arch_flags_and_leaves_torch_cuda_uninitialized(cuda_probe, monkeypatch):
    from torch.utils import cpp_extension

    from defrag import extensions

    ext, captured, toolkit = cuda_probe
    home_before = cpp_extension.CUDA_HOME
    # The arch flags from the driver (cuda-python's device attributes; an emulated device stands in for a
    # GPU): never torch.cuda.get_device_capability(), which initializes CUDA and PyTorch's allocator.
    monkeypatch.setattr(extensions, "_driver_capabilities", lambda api=None: ([(9, 0)], ""))
    assert ext.load() is not None, ext.failure()
    (call,) = captured.calls
    assert call["with_cuda"] is True
    assert call["extra_cuda_cflags"] == ["-gencode=arch=compute_90,code=sm_90",
                                         "-gencode=arch=compute_90,code=compute_90"]
    assert call["TORCH_CUDA_ARCH_LIST"] == "9.0+PTX"  # older torch reads the variable, not the flags
    assert call["CUDA_HOME"] == call["$CUDA_HOME"] == str(toolkit)  # not torch's /usr/local guess
    assert cpp_extension.CUDA_HOME == home_before and "TORCH_CUDA_ARCH_LIST" not in os.environ  # restored
    assert not torch.cuda.is_initialized()

    ext.reset_for_tests()  # TORCH_CUDA_ARCH_LIST, when set, decides
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0 9.0a;10.0+PTX")
    monkeypatch.setattr(extensions.CppExtension, "_import_built", lambda self, folder: None)
    assert ext.load() is not None
    assert captured.calls[-1]["extra_cuda_cflags"] == [
        "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90a,code=sm_90a",
        "-gencode=arch=compute_100,code=sm_100", "-gencode=arch=compute_100,code=compute_100"]
    assert not torch.cuda.is_initialized()


def test_the_driver_gives_each_devices_compute_capability_through_cuda_python():
    from defrag import extensions

    assert extensions._driver_capabilities(EmulatedCuda(capacity=4 * MiB, granularity=64 * KiB)) == ([(9, 0)], "")
    archs, where = extensions.cuda_archs(EmulatedCuda(capacity=4 * MiB, granularity=64 * KiB))
    assert archs == ["9.0+PTX"] and where == "the CUDA driver's devices"
    if _no_gpu_driver() is not None:
        caps, why = extensions._driver_capabilities()
        assert caps == [] and why


def test_an_impossible_cuda_build_falls_back_to_the_pluggable_route_with_one_line(cuda_probe, monkeypatch, caplog):
    """No GPU to ask and no TORCH_CUDA_ARCH_LIST: nothing is compiled, nothing is remembered on disk,
    the backend is unavailable with one line saying why, and the install takes the pluggable route."""
    from defrag import allocator_install, cuda_backend, extensions

    ext, captured, _ = cuda_probe
    monkeypatch.setattr(extensions, "_driver_capabilities", lambda api=None: ([], "no CUDA driver library"))
    assert ext.load() is None and captured.calls == []
    (line,) = ext.failure().splitlines()
    assert "no GPU to build for" in line and "TORCH_CUDA_ARCH_LIST" in line
    assert not list((Path(ext.build_directory())).glob("build-failed-*"))

    monkeypatch.setattr(torch.version, "cuda", "13.0")  # as a CUDA build of torch would
    monkeypatch.setattr(cuda_backend, "_extension", None)
    monkeypatch.setattr(cuda_backend, "_module", None)
    why = cuda_backend.unavailable_reason()
    assert why is not None and "TORCH_CUDA_ARCH_LIST" in why and "\n" not in why
    with caplog.at_level("WARNING", logger="defrag"):
        note = allocator_install._install_backend(None, 0)  # the backend cannot be had: the pluggable route
    assert note is not None and "TORCH_CUDA_ARCH_LIST" in note and "\n" not in note
    assert any("pluggable allocator route" in r.getMessage() for r in caplog.records)
    assert not torch.cuda.is_initialized()


def test_a_failed_build_is_remembered_per_toolkit_so_a_fixed_cuda_home_is_built_again(cuda_probe, monkeypatch, tmp_path):
    from defrag import extensions

    ext, captured, toolkit = cuda_probe
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    captured.fail = "Error building extension 'defrag_probe_cuda': fatal error: cuda_runtime.h: No such file"
    assert ext.load() is None and len(captured.calls) == 1
    assert len(list(Path(ext.build_directory()).glob("build-failed-*"))) == 1
    ext.reset_for_tests()
    assert ext.load() is None and len(captured.calls) == 1  # the same build: not tried again
    assert "an earlier build" in ext.failure()
    ext.reset_for_tests()
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0;10.0")  # other arch flags: tried again
    assert ext.load() is None and len(captured.calls) == 2
    ext.reset_for_tests()
    other = _toolkit(tmp_path / "cuda-fixed")
    monkeypatch.setenv("CUDA_HOME", str(other))  # the user fixed CUDA_HOME: built again, against it
    captured.fail = None
    assert ext.load() is not None and len(captured.calls) == 3
    assert captured.calls[-1]["CUDA_HOME"] == str(other)
    key = {extensions.CppExtension._failure_marker(ext, "f", plan)
           for plan in (None, extensions.cuda_build()[0])}
    assert len(key) == 2


def test_doctor_reports_the_toolkit_and_arch_flags_the_backend_build_will_use(cuda_probe, monkeypatch):
    from defrag import cli, cuda_backend, fastpath

    _, _, toolkit = cuda_probe
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(cuda_backend, "_extension", None)
    monkeypatch.setattr(cuda_backend, "_module", None)
    monkeypatch.setattr(cuda_backend, "compile_check",
                        lambda **kw: {"ok": None, "reason": "not here", "seconds": 0.0, "cached": False})
    monkeypatch.setattr(fastpath, "setting", lambda: "on")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    lines = cli._cuda_allocator_lines(True)
    (build,) = [ln for ln in lines if ln.startswith("  backend build:")]
    assert f"CUDA toolkit {toolkit} (nvcc on PATH" in build and "arch 9.0 (from TORCH_CUDA_ARCH_LIST)" in build
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    monkeypatch.setattr(cuda_backend, "_extension", None)
    from defrag import extensions

    monkeypatch.setattr(extensions, "_driver_capabilities", lambda api=None: ([], "no CUDA driver library"))
    lines = cli._cuda_allocator_lines(True)
    assert any(ln.startswith("defrag run / install on CUDA: PyTorch's pluggable allocator route") for ln in lines)
    (build,) = [ln for ln in lines if ln.startswith("  backend build:")]
    assert build.startswith("  backend build: cannot be built here: no GPU to build for")
    assert not torch.cuda.is_initialized()
