"""Workloads for replays: the trace format, generators, a recorder and a snapshot importer.

- :mod:`defrag.traces.format`: :class:`Trace` (JSON Lines on disk), :class:`TraceError`;
- :mod:`defrag.traces.generators`: :func:`llm_serving`, :func:`model_swap`, :func:`checkerboard`, and
  :func:`random_serving` (tens of GiB: for dry replays only, so not in ``GENERATORS``);
- :mod:`defrag.traces.training`: :class:`TraceRecorder`, :func:`training_from_model`;
- :mod:`defrag.traces.snapshot`: :func:`load_snapshot` for ``torch.cuda.memory._dump_snapshot`` pickles,
  :func:`load_snapshot_devices` for every device with what PyTorch reserved and the OOMs it recorded.

Dry replays run the pool's own core over the memory-less driver (:mod:`defrag.dry`).

See docs/traces.md.
"""

from .format import ALLOC, FREE, PHASE, Trace, TraceError, TraceStats
from .generators import checkerboard, llm_serving, model_swap, random_serving
from .snapshot import load_snapshot, load_snapshot_devices
from .training import TraceRecorder, training_from_model

GENERATORS = {
    "llm_serving": llm_serving,
    "training_from_model": training_from_model,
    "model_swap": model_swap,
    "checkerboard": checkerboard,
}

__all__ = ["Trace", "TraceError", "TraceStats", "ALLOC", "FREE", "PHASE", "llm_serving", "training_from_model",
           "model_swap", "checkerboard", "random_serving", "load_snapshot", "load_snapshot_devices", "TraceRecorder", "GENERATORS"]
