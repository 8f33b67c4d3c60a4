"""Test-wide setup: pick the numba simulator when no GPU driver is present.

numba reads NUMBA_ENABLE_CUDASIM when numba.cuda is first imported, so this
must run before any test module imports defrag.kernels. On a machine with a
working CUDA driver the variable is left alone and kernels run for real.
"""

import os

import pytest

from defrag.driver import cuda_driver_usable

if "NUMBA_ENABLE_CUDASIM" not in os.environ and not cuda_driver_usable()[0]:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

# The native module (defrag.native: the books and the allocation fast path) is built on
# first use; tests build or load it now, before any test times anything.
# DEFRAG_FASTPATH=0 runs the suite with pool.empty on the Python path.
from defrag import fastpath  # noqa: E402

fastpath.wait()


def pytest_collection_finish(session):
    """Move what collection left (torch, numba, hypothesis, the test modules: about 300,000 objects) out of
    the cycle collector's reach. A full collection, automatic or a test's `gc.collect()`, then walks only
    what the tests made since: at 0.1-0.3 s each, they had come to more than a minute of the suite. What
    the tests make is collected as before, and `gc.get_objects()` (defrag.owners) lists all of it: no
    pool and no pool tensor exists before the first test."""
    import gc

    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(session, config, items):
    """The tests of a module that starts programs early (`start_early`, tests/forked.py) run last, so
    those programs run beside the rest of the suite, not while the suite waits for them."""
    early = [item for item in items if hasattr(getattr(item, "module", None), "start_early")]
    if early:
        chosen = set(map(id, early))
        items[:] = [item for item in items if id(item) not in chosen] + early


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    """Each module that defines `start_early(items)` gets its selected tests, before the first test runs."""
    modules: dict = {}
    for item in session.items:
        module = getattr(item, "module", None)
        if hasattr(module, "start_early"):
            modules.setdefault(module, []).append(item)
    for module, items in modules.items():
        module.start_early(items)
