"""Compaction with the numba move kernel (simulated) over emulated device memory."""

from __future__ import annotations

import gc

import pytest
import torch

import defrag
from defrag.driver import Driver

KiB = 1 << 10
PAGE = 64 * KiB


def _pool():
    return defrag.Pool(device=Driver.emulated(capacity=4 << 20, granularity=PAGE), capacity="512KiB",
                       auto_compact=False)


def _fragmented(pool, sizes):
    ts = [pool.empty(n, dtype=torch.uint8) for n in sizes]
    ts.sort(key=lambda t: t.data_ptr())
    g = torch.Generator().manual_seed(1)
    for t in ts:
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g))
    survivors = [t for i, t in enumerate(ts) if i % 4 == 1]
    return survivors, [t.clone() for t in survivors]


@pytest.mark.parametrize("engine", ["kernel", "memmove"])
def test_kernel_and_memmove_engines_give_the_same_bytes_and_layout(engine):
    # Same pool history for both engines: the plans and so the layouts are equal.
    pool = _pool()
    sizes = [512, 1536, 4096, 512, 8192, 3072] * 12  # 72 blocks over 4 pages
    survivors, expected = _fragmented(pool, sizes)
    filler = pool.empty(PAGE, dtype=torch.uint8)  # a third page, then freed: holes everywhere
    del filler
    report = pool.compact(engine=engine, verify=True)
    assert report.engine == engine and report.moved_tensors > 0
    for t, e in zip(survivors, expected):
        assert torch.equal(t, e)
    layout = [(t.data_ptr() - pool.core.regions[0].base, t.numel()) for t in survivors]
    pool.check_invariants()
    del survivors, t
    gc.collect()
    pool.close()
    test_kernel_and_memmove_engines_give_the_same_bytes_and_layout.layouts[engine] = layout
    other = {"kernel": "memmove", "memmove": "kernel"}[engine]
    if other in test_kernel_and_memmove_engines_give_the_same_bytes_and_layout.layouts:
        assert layout == test_kernel_and_memmove_engines_give_the_same_bytes_and_layout.layouts[other]


test_kernel_and_memmove_engines_give_the_same_bytes_and_layout.layouts = {}
