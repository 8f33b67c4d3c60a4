"""Fault injection: make the N-th call of any driver function return a chosen error.

`FaultInjector` wraps a driver API object (the real `cuda.bindings.driver`
module or an `EmulatedCuda`) and forwards every attribute. A planned fault
short-circuits the call: the underlying function is not called, so the fault
has no side effect, exactly like a driver call that failed before doing
anything. Tests use it to prove that every multi-step operation rolls back.
"""

from __future__ import annotations

import threading

from cuda.bindings import driver as cu


class FaultInjector:
    """A transparent proxy over a driver API with a plan of injected failures."""

    def __init__(self, api):
        self._api = api
        self._lock = threading.RLock()  # reentrant: a batch holds it (`held`) across its own plan calls
        self._plans: dict[str, list[list]] = {}  # name -> [[remaining_calls, error, repeat]]
        self.calls: dict[str, int] = {}
        self.injected: list[tuple[str, str]] = []

    def inject(self, name: str, error=cu.CUresult.CUDA_ERROR_UNKNOWN, *, nth: int = 1, repeat: bool = False) -> None:
        """Make the `nth` next call of `name` return `error` (and every later one if `repeat`)."""
        if not name.startswith("cu") or not hasattr(self._api, name):
            raise ValueError(f"unknown driver function {name!r}")
        if nth < 1:
            raise ValueError(f"nth counts from 1, got {nth}")
        if not isinstance(error, cu.CUresult):
            error = cu.CUresult(int(error))
        if error == cu.CUresult.CUDA_SUCCESS:
            raise ValueError("an injected fault must be an error, not CUDA_SUCCESS")
        with self._lock:
            self._plans.setdefault(name, []).append([nth, error, repeat])

    def clear(self) -> None:
        """Forget every planned fault."""
        with self._lock:
            self._plans.clear()

    def pending(self) -> int:
        """How many planned faults have not fired yet."""
        with self._lock:
            return sum(len(v) for v in self._plans.values())

    def held(self):
        """The plan's lock, for a batch to hold from `passing` to `count`: no other thread's driver call
        comes between the plan's answer and the count of the calls it let through."""
        return self._lock

    def passing(self, name: str, n: int) -> int:
        """How many of the next `n` calls of `name` no planned fault stops (the next one after them
        fails, when fewer than `n`). Counts nothing: `count` records the calls a batch then made."""
        with self._lock:
            plans = self._plans.get(name)
            return n if not plans else max(0, min(n, min(plan[0] for plan in plans) - 1))

    def count(self, name: str, n: int) -> None:
        """Record `n` calls of `name` that `passing` let through, as `n` single calls would have been:
        every plan of `name` comes `n` calls closer (none fires: `passing` said so)."""
        if n <= 0:
            return
        with self._lock:
            self.calls[name] = self.calls.get(name, 0) + n
            for plan in self._plans.get(name, ()):
                plan[0] -= n

    def _take(self, name: str):
        with self._lock:
            self.calls[name] = self.calls.get(name, 0) + 1
            plans = self._plans.get(name)
            if not plans:
                return None
            fired = None
            for plan in plans:
                plan[0] -= 1
                if plan[0] <= 0:
                    if fired is None:
                        fired = plan
                    else:
                        plan[0] = 1  # two faults on one call: the later plan fires on the next call
            if fired is None:
                return None
            if fired[2]:
                fired[0] = 1  # fire again on the next call
            else:
                plans.remove(fired)
            self.injected.append((name, fired[1].name))
            return fired[1]

    def __getattr__(self, name: str):
        target = getattr(self._api, name)
        if not name.startswith("cu") or not callable(target):
            return target

        def call(*args):
            error = self._take(name)
            if error is not None:
                return _failed_result(name, error)
            return target(*args)

        call.__name__ = name
        self.__dict__[name] = call  # found directly from now on: __getattr__ runs once per name
        return call


# How many outputs follow the CUresult for each call defrag makes; a failed call
# still returns a tuple of the same length, as cuda-python does.
_OUTPUTS = {
    "cuDeviceGetCount": 1, "cuDeviceGet": 1, "cuDeviceGetName": 1, "cuDeviceTotalMem": 1,
    "cuDriverGetVersion": 1, "cuDevicePrimaryCtxRetain": 1, "cuStreamIsCapturing": 1,
    "cuMemGetInfo": 2, "cuMemGetAllocationGranularity": 1, "cuMemCreate": 1,
    "cuMemAddressReserve": 1, "cuCtxGetCurrent": 1, "cuDeviceGetAttribute": 1, "cuMemAllocHost": 1,
    "cuMemAlloc": 1, "cuEventCreate": 1, "cuModuleLoadData": 1, "cuModuleGetFunction": 1, "cuFuncGetAttribute": 1,
    "cuOccupancyMaxActiveBlocksPerMultiprocessor": 1,
}


def _failed_result(name: str, error):
    return (error,) + (None,) * _OUTPUTS.get(name, 0)
