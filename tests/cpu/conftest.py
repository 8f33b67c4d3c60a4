"""Fixtures: fresh emulated devices and pools, and a leak check for each."""

from __future__ import annotations

import gc

import pytest
import torch

import defrag
from defrag.driver import Driver

KiB, MiB = 1 << 10, 1 << 20


# Byte i of seed s's pattern is (131 i + 7919 s) mod 251, which is byte i + k(s) of the seed-0 pattern
# (k(s) = 7919 s / 131 mod 251): one seed-0 tile, cut at k(s), gives every seed's pattern without
# computing it again for each tensor.
_SHIFT = 7919 * pow(131, -1, 251) % 251
_TILE_KEPT = 64 * MiB  # longer patterns are computed for the call and not kept
_tile = torch.empty(0, dtype=torch.uint8)


def _pattern(n: int, seed: int) -> torch.Tensor:
    global _tile
    k = seed * _SHIFT % 251
    tile = _tile
    if tile.numel() < k + n:
        size = max(k + n, min(2 * tile.numel(), _TILE_KEPT), 1 * MiB)
        tile = (torch.arange(size, dtype=torch.int64) * 131).remainder(251).to(torch.uint8)
        if size <= _TILE_KEPT:
            _tile = tile
    return tile[k:k + n]


def fill_pattern(t: torch.Tensor, seed: int) -> None:
    """Write a byte pattern that depends on `seed` and on each byte's position."""
    raw = t.detach().view(-1).view(torch.uint8) if t.numel() else t
    raw.copy_(_pattern(raw.numel(), seed))


def check_pattern(t: torch.Tensor, seed: int) -> bool:
    raw = t.detach().reshape(-1).view(torch.uint8)
    return bool(torch.equal(raw, _pattern(raw.numel(), seed)))


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
    clean = {"handles": 0, "mappings": 0, "reservations": 0, "used_bytes": 0}
    if any(drv.api.state() != clean for pool, drv in made):
        gc.collect()  # a full collection costs ~0.1 s in the suite's process: only when something is held
    for pool, drv in made:
        state = drv.api.state()
        assert state == clean, (
            f"pool #{pool.id} leaked driver resources after close: {state}")
