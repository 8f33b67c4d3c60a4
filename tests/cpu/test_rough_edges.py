"""What a new user hit on the first day (issue 10), each pinned down by a test."""

from __future__ import annotations

import logging

import pytest
import torch

import defrag

from .conftest import KiB, MiB, check_pattern, fill_pattern


# ---------------------------------------------------------------- OOM advice that is true
def test_oom_on_a_device_smaller_than_the_capacity_blames_the_device(make_pool):
    pool = make_pool("1GiB", granularity=64 * KiB, device_capacity=16 * MiB)
    with pytest.raises(defrag.OutOfMemoryError) as err:
        pool.empty(32 * MiB, dtype=torch.uint8)
    advice = str(err.value).splitlines()[-1]
    assert "the device is the limit" in advice and "larger capacity would not help" in advice
    assert "free tensors" not in advice  # nothing is live


def test_oom_larger_than_capacity_says_how_large(make_pool):
    pool = make_pool("1MiB", granularity=64 * KiB)
    with pytest.raises(defrag.OutOfMemoryError) as err:
        pool.empty(3 * MiB, dtype=torch.uint8)
    advice = str(err.value).splitlines()[-1]
    assert "capacity >= 3.00 MiB" in advice and "free tensors" not in advice


def test_oom_with_live_tensors_suggests_freeing_them(make_pool):
    pool = make_pool("1MiB", granularity=64 * KiB)
    keep = pool.empty(900 * KiB, dtype=torch.uint8)
    with pytest.raises(defrag.OutOfMemoryError) as err:
        pool.empty(512 * KiB, dtype=torch.uint8)
    assert "free tensors you no longer need" in str(err.value).splitlines()[-1]
    del keep


# ---------------------------------------------------------------- torch.utils.swap_tensors
def test_swap_tensors_works_on_pool_tensors(make_pool):
    pool = make_pool("1MiB", granularity=64 * KiB)
    a, b = pool.full((100,), 1.0), pool.full((100,), 2.0)
    torch.utils.swap_tensors(a, b)  # "Cannot swap t1 because it has weakref associated with it" before
    assert bool((a == 2.0).all()) and bool((b == 1.0).all())
    pool.check_invariants()


def test_module_to_with_swap_on_conversion_works_on_an_adopted_module(make_pool):
    pool = make_pool("4MiB", granularity=64 * KiB)
    model = pool.adopt(torch.nn.Linear(64, 64))
    expect = {k: v.clone() for k, v in model.state_dict().items()}
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to(torch.float64)
        model.load_state_dict({k: v.double() for k, v in expect.items()})
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)
    assert model.weight.dtype == torch.float64
    assert torch.equal(model.weight, expect["weight"].double())


# ---------------------------------------------------------------- resize_
def test_resize_grows_a_pool_tensor_inside_the_pool(make_pool):
    pool = make_pool("1MiB", granularity=64 * KiB)
    t = pool.empty(1000, dtype=torch.uint8)
    fill_pattern(t, 3)
    saved = t.clone()
    same = t
    with pytest.raises(RuntimeError, match="not resizable"):
        t.resize_(5000)  # torch itself cannot grow memory it did not allocate
    assert pool.resize_(t, 5000) is same and t.shape == (5000,)
    assert torch.equal(t[:1000], saved) and pool.owns(t)
    pool.resize_(t, 10, 10)  # fits the storage: torch's own resize
    assert t.shape == (10, 10) and pool.owns(t)
    with pytest.raises(ValueError, match="not in pool"):
        pool.resize_(torch.zeros(3), 10)
    pool.check_invariants()


# ---------------------------------------------------------------- what PyTorch users expect
def test_reset_peak_stats(make_pool):
    pool = make_pool("2MiB", granularity=64 * KiB)
    big = pool.empty(1 * MiB, dtype=torch.uint8)
    del big
    small = pool.empty(10 * KiB, dtype=torch.uint8)
    st = pool.stats()
    assert st["allocated_bytes.all.peak"] >= 1 * MiB
    pool.reset_peak_stats()
    st = pool.stats()
    assert st["allocated_bytes.all.peak"] == st["allocated_bytes.all.current"] == 10 * KiB
    assert st["active_bytes.all.peak"] == st["active_bytes.all.current"]
    assert st["reserved_bytes.all.peak"] == st["reserved_bytes.all.current"]
    del small


def test_zeros_like_and_empty_strided(make_pool):
    pool = make_pool("1MiB", granularity=64 * KiB)
    ref = torch.ones(3, 5, dtype=torch.float16)
    z = pool.zeros_like(ref)
    assert z.shape == (3, 5) and z.dtype == torch.float16 and not bool(z.any()) and pool.owns(z)
    s = pool.empty_strided((4, 3), (1, 4), dtype=torch.float32)  # column-major
    assert s.stride() == (1, 4) and s.untyped_storage().nbytes() == 12 * 4 and pool.owns(s)
    s.copy_(torch.arange(12.0).reshape(4, 3))
    assert torch.equal(s, torch.arange(12.0).reshape(4, 3))
    gap = pool.empty_strided((2, 2), (10, 1), dtype=torch.int64)
    assert gap.untyped_storage().nbytes() == 12 * 8
    with pytest.raises(ValueError, match="2 sizes but 1 strides"):
        pool.empty_strided((2, 2), (1,))


def test_adopt_a_list_and_a_dict(make_pool):
    pool = make_pool("1MiB", granularity=64 * KiB)
    tensors = [torch.randn(100), torch.randn(50)]
    state = {"kv": [torch.randn(20), torch.randn(30)], "step": torch.tensor(3)}
    expect = [t.clone() for t in tensors] + [t.clone() for t in state["kv"]] + [state["step"].clone()]
    assert pool.adopt(tensors) is tensors and pool.adopt(state) is state
    got = tensors + state["kv"] + [state["step"]]
    assert all(pool.owns(t) for t in got)
    assert all(torch.equal(a, b) for a, b in zip(got, expect))
    with pytest.raises(TypeError, match="list, tuple or dict"):
        pool.adopt({"x": object()})


def test_on_oom_observers_see_the_error_and_cannot_replace_it(make_pool, caplog):
    pool = make_pool("1MiB", granularity=64 * KiB)
    seen = []
    pool.on_oom.append(seen.append)
    pool.on_oom.append(lambda err: 1 / 0)
    with caplog.at_level(logging.ERROR, logger="defrag"), pytest.raises(defrag.OutOfMemoryError) as err:
        pool.empty(4 * MiB, dtype=torch.uint8)
    assert seen == [err.value] and seen[0].requested == 4 * MiB
    assert "on_oom observer raised" in caplog.text


def test_compaction_report_reads_plainly(make_pool):
    pool = make_pool("1MiB", granularity=64 * KiB)
    text = str(pool.compact())
    assert "moved nothing" in text and "released 0 pages" not in text and "(0 B;" not in text
    ts = [pool.empty(16 * KiB, dtype=torch.uint8) for _ in range(16)]
    for i, t in enumerate(ts):
        fill_pattern(t, i)
    kept = {i: t for i, t in enumerate(ts) if i % 2}
    del ts, t
    text = str(pool.compact())
    assert "moved 4 tensors (64.00 KiB) in 1 wave;" in text and "(2 freed, 128.00 KiB)" in text
    assert all(check_pattern(t, i) for i, t in kept.items())
