"""Compile-check defrag's CUDA allocator backend (defrag/native/torch_cuda_backend.cpp) against torch headers.

Without a GPU: the backend's translation unit is compiled (-c, nothing linked, nothing installed) with the
flags `defrag.cuda_backend.compile_command` gives, against

- the installed torch's headers (the README's torch 2.13.0 CPU wheel ships c10/cuda and
  torch/csrc/cuda headers; it lacks c10/cuda/impl/cuda_cmake_macros.h, which the command replaces with
  -DC10_CUDA_NO_CMAKE_CONFIGURE_FILE), and
- each extra torch include folder given with --torch-include (e.g. the torch 2.11.0+cu130 wheel's
  `torch/include`, unzipped by hand outside the repository: `pip download --no-deps torch==2.11.0` then
  `unzip torch-2.11.0-*.whl 'torch/include/*' 'torch/version.py' -d DIR`),

with the CUDA headers of --cuda-include (default: defrag.cuda_backend.cuda_include_dir(), e.g.
/usr/local/cuda-13.0/include). The version macros come from the headers given (torch/version.h), so a
2.11 header set compiles the 2.11 branches of the source.

    python tools/compile_check_backend.py [--torch-include DIR ...] [--cuda-include DIR]

Prints one line per header set: ok / FAILED, the torch version the headers say, seconds; the first
errors on failure. Exit status 1 if any failed.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def header_version(include: str) -> str:
    text = ""
    for where in (("torch", "headeronly", "version.h"), ("torch", "csrc", "api", "include", "torch", "version.h")):
        try:
            with open(os.path.join(include, *where)) as f:
                text += f.read()
        except OSError:
            pass
    m = re.search(r'TORCH_VERSION\s+"([^"]+)"', text)
    if m:
        return m.group(1)
    parts = [re.search(rf"TORCH_VERSION_{k}\s+(\d+)", text) for k in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(p.group(1) if p else "?" for p in parts)


def check(torch_include: list[str] | None, cuda_include: str, label: str) -> bool:
    from defrag import cuda_backend

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "backend.o")
        std = None
        if torch_include is not None:
            v = header_version(torch_include[0]).split(".")
            std = "c++20" if len(v) > 1 and v[0].isdigit() and v[1].isdigit() and (int(v[0]), int(v[1])) >= (2, 14) \
                else "c++17"
        cmd = cuda_backend.compile_command(out, torch_include=torch_include, cuda_include=cuda_include, std=std)
        start = time.perf_counter()
        proc = subprocess.run(cmd, input=cuda_backend.source_text(), text=True, capture_output=True)
        seconds = time.perf_counter() - start
        ok = proc.returncode == 0 and os.path.isfile(out)
    version = header_version((torch_include or __import__("torch.utils.cpp_extension").utils.cpp_extension
                              .include_paths())[0])
    print(f"{label}: torch headers {version}, CUDA headers {cuda_include}: "
          f"{'ok' if ok else 'FAILED'} ({seconds:.1f} s)")
    if not ok:
        errors = [ln for ln in proc.stderr.splitlines() if "error" in ln]
        print("\n".join(errors[:20]) or proc.stderr[-3000:])
    return ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch-include", action="append", default=[],
                        help="another torch wheel's torch/include folder (repeatable)")
    parser.add_argument("--cuda-include", default=None, help="CUDA headers (cuda_runtime_api.h)")
    parser.add_argument("--skip-installed", action="store_true", help="only the --torch-include sets")
    args = parser.parse_args(argv)
    from defrag import cuda_backend

    cuda_include = args.cuda_include or cuda_backend.cuda_include_dir()
    if not cuda_include or not os.path.isfile(os.path.join(cuda_include, "cuda_runtime_api.h")):
        print(f"no CUDA headers (cuda_runtime_api.h) in {cuda_include!r}: give --cuda-include")
        return 1
    ok = True
    if not args.skip_installed:
        import torch

        ok &= check(None, cuda_include, f"installed torch {torch.__version__}")
    for folder in args.torch_include:
        includes = [folder, os.path.join(folder, "torch", "csrc", "api", "include")]
        ok &= check(includes, cuda_include, folder)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
