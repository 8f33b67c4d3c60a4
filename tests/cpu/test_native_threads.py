"""Threads Python never saw (C++ std::threads, no GIL) allocating and freeing over the native books while
Python threads allocate and compact: every byte checked, nothing a C++ thread uses ever moved.

Each run is a subprocess, so that a crash fails the test instead of killing pytest.
"""

from __future__ import annotations

import pytest

from defrag import fastpath

from ..forked import run_python

pytestmark = pytest.mark.skipif(fastpath.setting() == "off", reason="DEFRAG_FASTPATH=0: no native allocation")

SCRIPT = r"""
import sys, threading, time, torch, defrag
pin_foreign = sys.argv[1] == "pin"
iterations = int(sys.argv[2])
pool = defrag.Pool("emulated", capacity="64MiB")
if not pin_foreign:  # the control run: blocks of C++ threads seen like any other (must break the contract)
    make_face = pool.core.make_face
    def unpinned(*record):
        block = make_face(*record)
        block.pins = 0
        return block
    pool.core.make_face = unpinned
fast = pool.core.fast
installed = sys.argv[3:] == ["install"]  # the C++ threads' at::empty reach the pool as PyTorch's CPU allocator
if installed:
    defrag.install(pool)
sizes = [512, 3000, 4096, 20_000, 65_536, 100, 40_000, 8192]
stop = threading.Event()
result = {}
errors = []

def python_side():
    # Python tensors with holes between them (every other one dropped), compacted each round: the
    # compactions move them while the C++ threads allocate, write and free around them.
    step = 0
    try:
        while not stop.is_set() or step < 3:
            ts = [pool.full((65_536,), float(step * 100 + i), dtype=torch.float32) for i in range(48)]
            keep = [(t, float(step * 100 + i)) for i, t in enumerate(ts) if i % 2]
            del ts
            report = pool.compact(release=True)  # emptied pages unmapped: a stale pointer shows
            result["moved"] = result.get("moved", 0) + report.moved_tensors
            for t, v in keep:
                if not bool((t == v).all()):
                    errors.append(("python tensor changed", v))
            del keep
            step += 1
            time.sleep(0.0005)  # let the C++ threads' trips to Python through the gate
    except Exception as e:
        errors.append(repr(e))

# The C++ threads are started from a Python thread that never uses the pool otherwise: the pool's
# thread registry knows none of them, so only the pinning of what they made keeps the main thread's
# compactions (which then see no other thread at work) off their blocks.
def cpp_side():
    result["churn"] = fast.churn(sizes, iterations, threads=3, live=24, native=not installed, verify=True)
    stop.set()

th = threading.Thread(target=cpp_side)
th.start()
python_side()
th.join()
seconds, failed, corrupted = result["churn"]
try:
    pool.check_invariants()
    pool.empty(10)  # a stale access (a C++ thread writing where a compaction unmapped) is reported here
except Exception as e:
    errors.append(repr(e))
hits = defrag.cpu_allocator.counters()["blocks"] if installed else fast.native_hits
if installed:
    defrag.uninstall()
st = pool.stats()
print("RESULT", failed, corrupted, result.get("moved", 0), hits, st["allocated_bytes.all.current"] == 0,
      len(errors), errors[:3])
"""


def _run(mode: str, iterations: int, *extra: str) -> list[str]:
    proc = run_python(SCRIPT, mode, str(iterations), *extra, timeout=300)  # a process of its own, forked
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    return line.split(maxsplit=7)[1:]


def test_cpp_threads_allocate_and_free_while_python_compacts_and_nothing_they_use_moves():
    failed, corrupted, moved, hits, all_freed, nerrors, errors = _run("pin", 20_000)
    assert (failed, corrupted, nerrors) == ("0", "0", "0"), errors
    assert int(hits) >= 60_000  # every allocation of the C++ threads was native
    assert int(moved) > 0  # compactions really moved Python tensors meanwhile
    assert all_freed == "True"  # every block of both sides came back to the books


def test_cpp_threads_allocate_through_the_installed_allocator_while_python_compacts():
    """The same under `defrag.install`: the C++ threads' at::empty reach the pool as PyTorch's CPU allocator
    (every block pinned: PyTorch holds its pointer) while the main thread's compactions move its own
    tensors around them; every byte on both sides checked."""
    failed, corrupted, moved, blocks, all_freed, nerrors, errors = _run("pin", 20_000, "install")
    assert (failed, corrupted, nerrors) == ("0", "0", "0"), errors
    assert int(blocks) >= 60_000  # every allocation of the C++ threads was a pool block
    assert int(moved) > 0 and all_freed == "True"


def test_the_control_run_without_pinning_breaks_so_the_test_above_can_fail():
    # Without pinning what C++ threads made, compactions move blocks those threads still write:
    # their bytes come back wrong, or the write lands in an unmapped page (a stale access).
    failed, corrupted, moved, hits, all_freed, nerrors, errors = _run("unpinned", 80_000)  # longer: it fails at the first stray move
    assert int(corrupted) > 0 or int(nerrors) > 0, (corrupted, errors)
