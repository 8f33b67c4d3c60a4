"""Fixtures: fresh emulated devices and pools, and a leak check for each."""

from __future__ import annotations

import gc

import pytest
import torch

import defrag
from defrag.driver import Driver

KiB, MiB = 1 << 10, 1 << 20


def fill_pattern(t: torch.Tensor, seed: int) -> None:
    """Write a byte pattern that depends on `seed` and on each byte's position."""
    raw = t.detach().view(-1).view(torch.uint8) if t.numel() else t
    n = raw.numel()
    raw.copy_((torch.arange(n, dtype=torch.int64) * 131 + seed * 7919).remainder(251).to(torch.uint8))


def check_pattern(t: torch.Tensor, seed: int) -> bool:
    raw = t.detach().reshape(-1).view(torch.uint8)
    n = raw.numel()
    expect = (torch.arange(n, dtype=torch.int64) * 131 + seed * 7919).remainder(251).to(torch.uint8)
    return bool(torch.equal(raw, expect))


@pytest.fixture
def make_pool():
    """Build pools on fresh emulated devices; on teardown, close them and check nothing leaked."""
    made = []

    def make(capacity="2MiB", *, granularity=64 * KiB, device_capacity=None, **kwargs):
        drv = Driver.emulated(capacity=device_capacity or 4 * defrag.parse_size(capacity), granularity=granularity)
        pool = defrag.Pool(device=drv, capacity=capacity, **kwargs)
        made.append((pool, drv))
        return pool

    yield make
    for pool, drv in made:
        pool.close()
    gc.collect()
    for pool, drv in made:
        state = drv.api.state()
        assert state == {"handles": 0, "mappings": 0, "reservations": 0, "used_bytes": 0}, (
            f"pool #{pool.id} leaked driver resources after close: {state}")
