"""defrag's CUDA allocator backend (native/torch_cuda_backend.cpp, `defrag.cuda_backend`) without a GPU.

The backend links c10_cuda, which a CPU build of torch lacks, so here it is compile-checked only: its
source is compiled to an object file against the installed torch's headers (a CPU wheel ships
c10/cuda's) and a CUDA toolkit's headers, when both are present; the result is remembered per source
digest, so only the first run after a change pays the compile (about 10-30 s). Loading and running it
needs CUDA torch and a GPU (tests/gpu/test_torch_backend_gpu.py).
"""

from __future__ import annotations

import pytest

from defrag import cuda_backend
from defrag.errors import NativeBuildError


def test_the_backend_compiles_against_this_torchs_headers_and_the_cuda_headers():
    result = cuda_backend.compile_check()
    if result["ok"] is None:
        pytest.skip(f"cannot compile-check the CUDA allocator backend here: {result['reason']}")
    assert result["ok"], f"the backend does not compile against torch {result.get('torch')}:\n{result['reason']}"


def test_the_compile_check_fails_a_source_that_does_not_compile(monkeypatch, tmp_path):
    monkeypatch.setenv("DEFRAG_EXT_DIR", str(tmp_path))  # its own cache: the real result stays
    good = cuda_backend.source_text()
    monkeypatch.setattr(cuda_backend, "source_text", lambda: "#error a broken backend\n" + good)
    result = cuda_backend.compile_check()
    if result["ok"] is None:
        pytest.skip(f"cannot compile-check here: {result['reason']}")
    assert result["ok"] is False and "a broken backend" in result["reason"], result
    again = cuda_backend.compile_check()  # remembered for this source: no second compile
    assert again["cached"] and again["ok"] is False


def test_without_cuda_torch_the_backend_is_unavailable_and_says_why(monkeypatch):
    import torch

    if torch.version.cuda is not None:
        pytest.skip("this torch has CUDA")
    why = cuda_backend.unavailable_reason()
    assert why is not None and "without CUDA" in why, why
    with pytest.raises(NativeBuildError, match="without CUDA"):
        cuda_backend.load()
    assert cuda_backend.status().startswith("unavailable: ") and cuda_backend.features() is None
    monkeypatch.setenv("DEFRAG_CUDA_BACKEND", "0")
    assert cuda_backend.unavailable_reason() == "turned off (DEFRAG_CUDA_BACKEND=0)"


def test_the_cpu_install_is_unchanged_by_the_cuda_backend(make_pool):
    import torch

    import defrag
    from defrag import cpu_allocator

    pool = make_pool(capacity="32MiB")
    before = torch.get_default_dtype()
    try:
        assert defrag.install(pool) is pool and cpu_allocator.installed() is pool
        x = torch.ones(4096)
        assert pool.owns_address(x.data_ptr()) and float(x.sum()) == 4096.0
        del x
    finally:
        defrag.uninstall()
    assert cpu_allocator.installed() is None and torch.get_default_dtype() == before
