"""The CUDA backend answering as PyTorch's own allocator does (issue 45 items 3-9), on the CPU.

- The emulated driver knows stream capture as CUDA does (synchronize, a wait on an event recorded outside
  the capture, event queries: refused, counted, the capture invalidated), so a forbidden call fails here.
- The pool's books during a capture (native/streams.h), driven by fake events: no event query, no wait of
  a capturing stream on an event recorded outside its capture, no synchronize.
- The pool ABI's budget (`defrag_pool_set_budget`, PyTorch's setMemoryFraction): lower and higher, pages
  beyond it given back, new pages only within it.
The backend's own C++ (deleters, cacheInfo, stats without a pool, emptyCache) needs CUDA: tests/gpu.
"""

from __future__ import annotations

import ctypes

import pytest

from defrag import fastpath
from defrag.core import Core
from defrag.driver import Driver
from defrag.driver.emulated import EmulatedCuda, R

from ..forked import run_clean
from .test_pool_abi import PRELUDE as ABI_PRELUDE

PAGE = 64 * 1024
A, B = 0x1000, 0x2000


# ------------------------------------------------------------------------ the emulated driver's rules
def emulated():
    api = EmulatedCuda()
    assert api.cuInit(0)[0] == R.CUDA_SUCCESS
    err, dev = api.cuDeviceGet(0)
    err, ctx = api.cuDevicePrimaryCtxRetain(dev)
    api.cuCtxSetCurrent(ctx)
    return api


def test_the_emulated_driver_refuses_what_cuda_forbids_during_a_capture():
    api = emulated()
    err, outside = api.cuEventCreate(0)
    assert api.cuEventRecord(outside, A)[0] == R.CUDA_SUCCESS
    assert api.begin_capture(B, 0)[0] == R.CUDA_SUCCESS
    assert api.cuStreamIsCapturing(B)[1].name.endswith("ACTIVE") and api.cuStreamIsCapturing(A)[1].name.endswith("NONE")
    err, inside = api.cuEventCreate(0)
    assert api.cuEventRecord(inside, B)[0] == R.CUDA_SUCCESS
    assert api.stream_wait_event(B, inside, 0)[0] == R.CUDA_SUCCESS  # within the capture: legal
    assert api.stream_wait_event(B, outside, 1)[0] == R.CUDA_SUCCESS  # external: legal
    assert api.capture_violations == []
    assert api.stream_wait_event(B, outside, 0)[0] == R.CUDA_ERROR_STREAM_CAPTURE_ISOLATION
    assert api.cuCtxSynchronize()[0] == R.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
    assert api.cuStreamSynchronize(A)[0] == R.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
    assert api.cuEventQuery(outside)[0] == R.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
    assert api.cuEventQuery(inside)[0] == R.CUDA_ERROR_CAPTURED_EVENT
    assert api.cuEventSynchronize(outside)[0] == R.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
    assert [name for name, _ in api.capture_violations] == ["cuStreamWaitEvent", "cuCtxSynchronize",
                                                            "cuStreamSynchronize", "cuEventQuery", "cuEventQuery",
                                                            "cuEventSynchronize"]
    assert api.cuStreamIsCapturing(B)[1].name.endswith("INVALIDATED")
    assert api.end_capture(B)[0] == R.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
    # After the capture everything is legal again.
    assert api.cuCtxSynchronize()[0] == R.CUDA_SUCCESS and api.cuEventQuery(outside)[0] == R.CUDA_SUCCESS


def test_a_clean_capture_ends_with_a_graph():
    api = emulated()
    assert api.begin_capture(B, 0)[0] == R.CUDA_SUCCESS
    err, graph = api.end_capture(B)
    assert err == R.CUDA_SUCCESS and graph is not None and api.capture_violations == []


def test_the_pools_ladder_during_a_capture_makes_no_forbidden_call():
    """A pool over the emulated device places blocks (pages mapped, blocks freed and placed again) while a
    stream captures: nothing the capture forbids is called."""
    import torch

    import defrag

    MiB = 1 << 20
    pool = defrag.Pool("emulated", capacity="64MiB", auto_compact=False)
    api = pool.driver.api
    keep = [pool.empty(MiB // 2, dtype=torch.uint8) for _ in range(4)]
    seg = pool.alloc_segment(3 * MiB, stream=B)
    assert api.begin_capture(B, 0)[0] == R.CUDA_SUCCESS
    try:
        more = [pool.empty(5 * MiB, dtype=torch.uint8) for _ in range(3)]  # pages mapped
        del keep[1:3], more[0]
        pool.free_segment(seg)
        again = pool.empty(4 * MiB, dtype=torch.uint8)
        seg = pool.alloc_segment(2 * MiB, stream=B)
    finally:
        err, _ = api.end_capture(B)
    assert api.capture_violations == [], api.capture_violations
    assert err == R.CUDA_SUCCESS
    pool.free_segment(seg)
    del more, again, keep
    pool.close()


# ------------------------------------------------------------------- the books' side (streams.h)
pytestmark_native = pytest.mark.skipif(fastpath.setting() == "off", reason="DEFRAG_FASTPATH=0: no native books")


def _lib():
    from defrag import cuda_backend

    return cuda_backend.pool_abi()


def fake_core(pages: int = 16) -> Core:
    core = Core(Driver.memoryless(capacity=pages * PAGE, granularity=PAGE), capacity_pages=pages, page_size=PAGE,
                auto_compact=False)
    core.books.set_streams("fake")
    return core


def alloc(core, nbytes, stream):
    with core.gate:
        core.drain()
        return core.allocate(nbytes, stream=stream)


def release(core, block):
    with core.gate:
        core.release(block)


@pytestmark_native
def test_a_capturing_stream_never_waits_for_an_event_recorded_outside_its_capture():
    core = fake_core()
    lib = _lib()
    unordered_before = ctypes.c_int64(0)
    lib.defrag_pool_capture_counts(0, None, ctypes.byref(unordered_before))
    a = alloc(core, 4 * PAGE, A)
    release(core, a)  # A freed a range into the books
    assert lib.defrag_pool_capture(0, B, 1) == 0
    try:
        b = alloc(core, 4 * PAGE, B)  # B captures: no wait on an event recorded on A, no synchronize
        events = core.books.fake_events()
        assert events["waits"] == [], events
    finally:
        assert lib.defrag_pool_capture(0, B, 0) == 0
    unordered = ctypes.c_int64(0)
    lib.defrag_pool_capture_counts(0, None, ctypes.byref(unordered))
    assert unordered.value == unordered_before.value + 1
    release(core, b)
    # After the capture the fence is made as before.
    a2 = alloc(core, 4 * PAGE, A)
    release(core, a2)
    b2 = alloc(core, 4 * PAGE, B)
    assert (B, A) in core.books.fake_events()["waits"]
    release(core, b2)


@pytestmark_native
def test_pending_frees_are_not_queried_during_a_capture():
    core = fake_core()
    lib = _lib()
    a = alloc(core, 4 * PAGE, A)
    core.books.record_stream(a.address, a, B) if hasattr(core.books, "record_stream") else core.record_stream(a, B)
    release(core, a)
    assert core.books.pending == 1
    core.books.fake_finish(B)
    assert lib.defrag_pool_capture(0, A, 1) == 0
    try:
        with core.gate:
            core.drain()  # polls pending: no event query while a capture is underway
        assert core.books.pending == 1
    finally:
        assert lib.defrag_pool_capture(0, A, 0) == 0
    with core.gate:
        core.drain()
    assert core.books.pending == 0


# --------------------------------------------------------------------- the budget (setMemoryFraction)
# test_pool_abi's prelude (a registered 64 MiB pool, `lib`, `alloc`, `free`, `stats`), with the device's total
# memory and a buffer for the refusals.
PRELUDE = ABI_PRELUDE + r"""
register()
total = pool.driver.total_memory
why = ctypes.create_string_buffer(4096)

def fraction():
    f = ctypes.c_double(-1)
    assert lib.defrag_pool_memory_fraction(0, ctypes.byref(f)) == OK
    return f.value
"""


@pytestmark_native
def test_set_memory_fraction_lowers_and_raises_the_pools_budget():
    run_clean(PRELUDE + r"""
assert lib.defrag_pool_set_budget(0, 0.0, why, len(why)) == ERROR and b"(0, 1]" in why.value
assert lib.defrag_pool_set_budget(0, 1.5, why, len(why)) == ERROR
assert lib.defrag_pool_set_budget(9, 0.5, why, len(why)) == NO_POOL
# Lower than the capacity: 16 MiB.
low = 16 * MiB / total
assert lib.defrag_pool_set_budget(0, low, why, len(why)) == OK, why.value
assert pool.capacity == 16 * MiB and abs(fraction() - low) < 1e-9
status, p1, _ = alloc(12 * MiB)
assert status == OK
status, p2, _ = alloc(12 * MiB)
assert status == OOM, status  # beyond the budget
# Higher than it was made with (up to the device).
high = 48 * MiB / total
assert lib.defrag_pool_set_budget(0, high, why, len(why)) == OK, why.value
assert pool.capacity == 48 * MiB
status, p2, _ = alloc(12 * MiB)
assert status == OK
# Lower than what is held: live pages stay, the budget is reached as they empty (emptyCache).
assert lib.defrag_pool_set_budget(0, 8 * MiB / total, why, len(why)) == OK, why.value
assert pool.capacity >= 24 * MiB
assert lib.defrag_pool_free(0, p2, None) > 0
assert lib.defrag_pool_empty_cache(0, None) == OK
assert pool.capacity < 24 * MiB, pool.capacity
assert lib.defrag_pool_free(0, p1, None) > 0
assert lib.defrag_pool_empty_cache(0, None) == OK
assert pool.capacity == 8 * MiB and abs(fraction() - 8 * MiB / total) < 1e-9
# The old entry keeps its meaning (ABI 2): the capacity stays.
assert lib.defrag_pool_set_memory_fraction(0, 1.0, why, len(why)) == OK and pool.capacity == 8 * MiB
print("ok")
""", ends_with="ok", timeout=240)
