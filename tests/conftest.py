"""Test-wide setup: pick the numba simulator when no GPU driver is present.

numba reads NUMBA_ENABLE_CUDASIM when numba.cuda is first imported, so this
must run before any test module imports defrag.kernels. On a machine with a
working CUDA driver the variable is left alone and kernels run for real.
"""

import os

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
