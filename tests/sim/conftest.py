"""tests/sim need numba.cuda to be the simulator or a real GPU; otherwise they skip with the reason.

tests/conftest.py turns the simulator on when no CUDA driver is present; this
only guards against running these tests where that did not happen (e.g.
numba.cuda imported before the variable was set).
"""

import pytest


def _unusable_reason():
    from numba import cuda

    if cuda.config.ENABLE_CUDASIM or cuda.is_available():
        return None
    return (
        "numba.cuda is neither the simulator (set NUMBA_ENABLE_CUDASIM=1 before numba.cuda "
        "is imported) nor backed by a CUDA GPU"
    )


@pytest.fixture(autouse=True, scope="module")
def _needs_numba_cuda():
    reason = _unusable_reason()
    if reason:
        pytest.skip(reason)
