"""Import defrag from a bare checkout, without `pip install`.

pyproject.toml ships the top-level folders ``kernels/`` and ``benchmarks/`` as
``defrag.kernels`` and ``defrag.benchmarks``, so a plain checkout on
``sys.path`` has ``defrag`` but neither of those. `install()` puts a small
meta-path finder first on ``sys.meta_path`` that maps

    defrag            -> <root>/defrag
    defrag.kernels    -> <root>/kernels
    defrag.benchmarks -> <root>/benchmarks

(their submodules follow through the packages' ``__path__``), so this
checkout is what gets imported even where another copy of defrag is
installed (an editable install of another checkout, say). It imports nothing
from defrag itself and needs only the standard library.

Child processes get the same through this file as a launcher::

    python3 benchmarks/_bare_checkout.py -m pytest tests/gpu      # like python -m pytest
    python3 benchmarks/_bare_checkout.py some_script.py args...   # like python some_script.py

`benchmarks/gpu_check.py` runs every stage that way, and tests/gpu/conftest.py
calls `install()` so that ``python3 -m pytest tests/gpu`` works from a bare
checkout too.

One more thing must happen before numba loads libNVVM, so it lives here as
well: when ``DEFRAG_LIBNVVM`` names a libnvvm.so, `preload_libnvvm()` loads
it first. cuda.pathfinder (which numba-cuda and cuda.bindings use) takes a
libNVVM that is already loaded before searching site-packages, the system
loader path and, last, ``CUDA_HOME``; so this is how to make numba use the
libNVVM of a toolkit no newer than the driver when a newer one is found first
(see gpu_check's ``env`` stage).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# module name -> folder, relative to the checkout's root (pyproject's package-dir)
LAYOUT = {"defrag": "defrag", "defrag.kernels": "kernels", "defrag.benchmarks": "benchmarks"}


class CheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds defrag, defrag.kernels and defrag.benchmarks in one checkout; nothing else."""

    def __init__(self, root: Path):
        self.root = Path(root).resolve()

    def find_spec(self, fullname, path=None, target=None):
        folder = LAYOUT.get(fullname)
        if folder is None:
            return None
        pkg = self.root / folder
        init = pkg / "__init__.py"
        if not init.is_file():
            return None
        return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[str(pkg)])

    def __repr__(self) -> str:
        return f"<defrag CheckoutFinder {self.root}>"


def _under(path, root: Path) -> bool:
    try:
        Path(path).resolve().relative_to(root)
        return True
    except (TypeError, ValueError):
        return False


def install(root: Path | str = ROOT) -> Path:
    """Make `root`'s defrag (with its kernels and benchmarks) the one that imports. Idempotent.

    Raises RuntimeError when a defrag module from somewhere else is already
    imported: it cannot be swapped out safely, so call this first.
    """
    root = Path(root).resolve()
    if not (root / "defrag" / "__init__.py").is_file():
        raise RuntimeError(f"{root} is not a defrag checkout (no defrag/__init__.py)")
    foreign = sorted(name for name, mod in list(sys.modules.items())
                     if (name == "defrag" or name.startswith("defrag."))
                     and getattr(mod, "__file__", None) and not _under(mod.__file__, root))
    if foreign:
        raise RuntimeError(f"defrag is already imported from elsewhere ({sys.modules[foreign[0]].__file__}); "
                           f"install the checkout at {root} before anything imports defrag")
    # First on sys.meta_path, ahead of any installed copy's finder (one per root; re-installing moves it first).
    sys.meta_path[:] = [f for f in sys.meta_path
                        if not (type(f).__name__ == "CheckoutFinder" and getattr(f, "root", None) == root)]
    sys.meta_path.insert(0, CheckoutFinder(root))
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))  # tests/ and anything else at the root
    return root


def imported_from(names=("defrag", "defrag.kernels", "defrag.benchmarks")) -> dict:
    """Where each of `names` was (or would be) imported from: {name: file} (imports them)."""
    import importlib

    out = {}
    for name in names:
        try:
            out[name] = importlib.import_module(name).__file__
        except Exception as exc:  # report, don't crash: the caller prints this
            out[name] = f"not importable: {exc.__class__.__name__}: {exc}"
    return out


def preload_libnvvm(path: str | None = None) -> str | None:
    """`defrag.kernels.arena.preload_libnvvm`, once this checkout is importable (see the module doc)."""
    from defrag.kernels.arena import preload_libnvvm as preload

    return preload(path)


def main(argv: list[str] | None = None) -> None:
    """``_bare_checkout.py -m MODULE args`` or ``_bare_checkout.py SCRIPT args``, with this checkout installed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    # sys.path[0] is this file's folder (benchmarks/): its modules must not shadow anything.
    if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)
    install()
    preload_libnvvm()
    if argv[0] == "-m":
        if len(argv) < 2:
            raise SystemExit("_bare_checkout.py -m needs a module name")
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path.insert(0, str(Path(argv[0]).resolve().parent))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
