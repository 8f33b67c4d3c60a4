"""Issue 45 on a GPU: the move kernel's image built, cached, refused and rebuilt, launched through the real
driver (cuLaunchKernel's `extra` an integer); the CUDA backend's build arguments from the driver, with
torch.cuda left uninitialized. Unmeasured until a GPU runs them (the CPU side is
tests/cpu/test_first_gpu_run.py); every test needs CUDA itself and skips in the rehearsal.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from .conftest import fresh_process, last_json

needs_cuda = pytest.mark.needs_cuda("numba-cuda's compile of the move kernel and the real CUDA driver")


def _gpu():
    from defrag.driver import open_driver

    return open_driver("cuda:0")


@needs_cuda
def test_the_move_kernels_image_builds_caches_loads_and_moves_bytes(monkeypatch, tmp_path):
    from defrag import copying
    from defrag.kernels import abi, image
    from defrag.kernels.launch import MoveLauncher

    monkeypatch.setenv(image.CACHE_ENV, str(tmp_path))
    drv = _gpu()
    cc = drv.compute_capability()
    built = image.build_move_image(cc)
    assert built.data.startswith(image.ELF_MAGIC) and built.params == abi.PARAMS and built.entry
    first = MoveLauncher(drv, copying._gpu_image(drv))
    assert first.load(), first.error
    assert first.origin == "built" and list(tmp_path.glob("*.cubin"))
    second = MoveLauncher(drv, copying._gpu_image(drv))
    assert second.load() and second.origin == "cache"
    # One wave through cuLaunchKernel (extra = 0): every byte where it belongs.
    buf = torch.arange(1 << 20, dtype=torch.uint8, device="cuda")
    expected = buf.clone()
    expected[4096:8192] = buf[0:4096]
    second.move(buf.data_ptr(), buf.numel(), np.array([0], np.int64), np.array([4096], np.int64),
                np.array([4096], np.int64), stream=torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert torch.equal(buf, expected) and second.launches == 1
    first.close()
    second.close()


@needs_cuda
def test_a_cached_image_the_driver_refuses_is_built_again(monkeypatch, tmp_path):
    from defrag import copying
    from defrag.kernels import abi, image
    from defrag.kernels.launch import MoveLauncher

    monkeypatch.setenv(image.CACHE_ENV, str(tmp_path))
    drv = _gpu()
    toolchain = image.toolchain_versions(drv.driver_version())
    key = image.cache_key(drv.compute_capability(), toolchain=toolchain)
    image.store(image.KernelImage(image.ELF_MAGIC + b"\0" * 60, "not_a_kernel", abi.PARAMS, "built"), key,
                [tmp_path], toolchain=toolchain)
    launcher = MoveLauncher(drv, copying._gpu_image(drv))
    assert launcher.load(), launcher.error
    assert launcher.origin == "built"
    assert image.load_cached(key, [tmp_path]).entry != "not_a_kernel"  # the rebuild replaced it
    launcher.close()


@needs_cuda
def test_the_backend_build_takes_arch_flags_from_the_driver_and_leaves_torch_cuda_uninitialized():
    """In a fresh process (torch.cuda untouched): the build's arguments (cpp_extension.load captured, no
    compile) carry this GPU's arch flags, and torch.cuda is still not initialized afterwards."""
    proc = fresh_process("""
        import json, os, tempfile, types
        import torch
        from torch.utils import cpp_extension
        from defrag import extensions
        os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        os.environ["DEFRAG_EXT_DIR"] = tempfile.mkdtemp()
        seen = {}
        def load(name, sources, **kw):
            seen.update(flags=kw.get("extra_cuda_cflags"), home=cpp_extension.CUDA_HOME)
            return types.SimpleNamespace()
        cpp_extension.load = load
        ext = extensions.CppExtension("defrag_probe_cuda", "probe_cuda", "int probe;", "a probe", "now",
                                      with_cuda=True)
        ext.load()
        print(json.dumps({"failure": ext.failure(), **seen, "initialized": torch.cuda.is_initialized(),
                          "archs": extensions.cuda_archs()[0]}))
    """)
    out = last_json(proc)
    if out["failure"] and "no CUDA toolkit" in out["failure"]:
        pytest.skip(f"no CUDA toolkit with headers here: {out['failure']}")
    assert out["failure"] is None and out["flags"] and all("arch=compute_" in f for f in out["flags"])
    assert out["initialized"] is False and out["archs"]
