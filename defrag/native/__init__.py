"""defrag's native module: the pool's books (`books.h` over `heap.h`), the allocation fast path
(`module.cpp`), PyTorch's CPU allocator and its pluggable CUDA allocator's entry points over the books
(`cpu_allocator.cpp`, `cuda_allocator.cpp`, sharing `pool_allocator.h`), the pool's C ABI for PyTorch's
CUDA allocator backend (`pool_abi.h`, `pool_abi.cpp`; the backend itself is `defrag.cuda_backend`), the
planner's best fit
(`planner.h`) and its attempts (`plan_attempt.h`).

Every pool keeps its books here (`defrag.core.Core.books`), so the module is
needed from the first pool on: `load_module()` builds it on first use with
torch's own tooling (one line on stderr; about 40 s on a 2-core machine,
`BUILD_TIME`; once per machine, Python and torch version; `defrag.extensions`), and every later process
imports the built library (about 0.1 s). There is no slower fallback to
switch to meanwhile. A machine that cannot build it gets NativeBuildError
saying what to install.

The sources are this folder's C++ files, compiled as one translation unit
(`#line` directives keep compiler messages pointing at the right file).
"""

from __future__ import annotations

import os
import re
import sys
import threading

from ..errors import NativeBuildError

_HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = ("heap.h", "planner.h", "plan_attempt.h", "streams.h", "books.h", "module.cpp", "pool_allocator.h",
           "cpu_allocator.cpp", "cuda_allocator.cpp", "pool_abi.h", "pool_abi.cpp", "op_rescue.cpp")  # in dependency order
_LOCAL_INCLUDE = re.compile(r'^\s*(#pragma once|#include "[^"]+")\s*$')


def source_text() -> str:
    """The one translation unit: every source in order, without `#pragma once` and local includes."""
    parts = []
    for name in SOURCES:
        with open(os.path.join(_HERE, name)) as f:
            lines = f.read().splitlines()
        kept = ["" if _LOCAL_INCLUDE.match(line) else line for line in lines]  # same line numbers
        parts.append(f'#line 1 "defrag/native/{name}"\n' + "\n".join(kept) + "\n")
    return "".join(parts)


# How long the build takes, as the stderr line, README.md and docs/guide.md say it (one translation unit, so
# one compiler process: 35-38 s measured on a 2-core machine, torch 2.13.0+cpu).
BUILD_TIME = "about 40 s on a 2-core machine"

_lock = threading.Lock()
_module = None
_extension = None


def _the_extension():
    global _extension
    if _extension is None:
        from ..extensions import CppExtension  # imports torch

        _extension = CppExtension("defrag_native", "native", source_text(), "defrag's native module", BUILD_TIME)
    return _extension


def load_module():
    """The native module, built first if this machine has not built this very source yet.

    Blocks for the build (one line on stderr says so). Thread-safe; the
    build runs once per process and, through the build folder, once per
    machine. NativeBuildError (one paragraph: why, and what to install) if
    it cannot be had; the failure is remembered, so later calls fail at once.
    """
    global _module
    if _module is not None:
        return _module
    with _lock:
        if _module is None:
            extension = _the_extension()
            from ..extensions import missing_tools

            if not extension.is_built() and extension.failure() is None and missing_tools() is None:
                print(f"defrag: building its native module once for this machine and torch "
                      f"({extension.expected}) in {extension.build_directory()}", file=sys.stderr, flush=True)
            module = extension.load()
            if module is None:
                raise NativeBuildError(
                    f"defrag needs its native module (the pool's books, C++) and could not build it: "
                    f"{extension.failure()}. It is built once with torch's cpp_extension: install a C++ "
                    f"compiler (e.g. `apt install g++`, or `conda install gxx`; or set CXX), ninja "
                    f"(`pip install ninja`) and setuptools, then run again.")
            _module = module
    return _module


def status() -> str:
    """"ready", "built, not loaded yet", "not built yet" or "unavailable: <why>" (no build started)."""
    if _module is not None:
        return "ready"
    extension = _the_extension()
    if extension.failure() is not None:
        return f"unavailable: {extension.failure()}"
    return "built, not loaded yet" if extension.is_built() else "not built yet"


def reset_for_tests() -> None:
    """Forget the loaded module and any failure in this process (the build folder stays)."""
    global _module, _extension
    with _lock:
        _module = None
        _extension = None
