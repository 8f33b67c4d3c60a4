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
import re
from collections import Counter

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
