"""tests/gpu run only where a real CUDA driver and GPU work; elsewhere they skip with the reason."""

import pytest

from defrag.driver import cuda_driver_usable

_usable, _reason = cuda_driver_usable()


def pytest_collection_modifyitems(config, items):
    if _usable:
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU: {_reason}")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)
