"""Record a trace from real PyTorch code: storage lifetimes, observed on any device.

Method. :class:`TraceRecorder` is a ``TorchDispatchMode``: every aten op
that runs while it is active passes through it. Before and after each op it
*sweeps* the storages it has seen, emitting a ``free`` for each that has died
(a ``StorageWeakRef`` to the StorageImpl expires exactly when the last tensor
or view using it is gone); after the op it emits an ``alloc`` for each output
tensor whose storage it has not seen (views and in-place results share a
storage, so they add nothing). Sizes are ``storage.nbytes()``.

On the ``meta`` device nothing is computed and nothing is allocated, so a
large model's training step is recorded in a fraction of a second on a
laptop, with the same tensors, shapes and lifetimes as on a GPU (autograd's
saved tensors, gradients, optimizer state included).

What it does not see: memory taken outside aten ops (cuBLAS/cuDNN
workspaces, NCCL buffers, the caching allocator's rounding and its
cross-stream delays); storages created before the recorder was entered
(unless it is entered before the model is built, as here); a free is
ordered at the next op boundary, not at the exact Python statement.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .format import Trace


class TraceRecorder(TorchDispatchMode):
    """Records the allocation and death of every storage created by aten ops, as a Trace.

    Use as a context manager around the code to record; call :meth:`phase`
    to insert phase markers; :meth:`trace` returns the validated Trace
    (storages still alive at that point stay live in it).
    """

    def __init__(self, name: str = "recorded"):
        super().__init__()
        self.name = name
        self._trace = Trace(name=name)
        self._live: dict[int, tuple[int, StorageWeakRef]] = {}  # StorageImpl address -> (id, weak ref)
        self._next_id = 0
        self.ops = 0

    def _sweep(self) -> None:
        if not self._live:
            return
        dead = [key for key, (_, ref) in self._live.items() if ref.expired()]
        for key in dead:
            id_, _ = self._live.pop(key)
            self._trace.free(id_)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._sweep()
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        # Storages that died during the op free before its outputs are born
        # (an output may even reuse a dead storage's address as its key).
        self._sweep()
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                storage = t.untyped_storage()
                nbytes = storage.nbytes()
                key = storage._cdata
                if nbytes > 0 and key not in self._live:
                    self._live[key] = (self._next_id, StorageWeakRef(storage))
                    self._trace.alloc(self._next_id, int(nbytes))
                    self._next_id += 1
        return out

    def phase(self, name: str) -> None:
        """Insert a phase marker (after recording every free that already happened)."""
        self._sweep()
        self._trace.phase(name)

    def __exit__(self, *exc):
        self._sweep()
        return super().__exit__(*exc)

    def trace(self) -> Trace:
        """The events recorded so far, validated."""
        self._sweep()
        return self._trace.validate()


def training_from_model(*, seed: int = 0, steps: int = 8, d_model: int = 256, nhead: int = 8,
                        dim_feedforward: int = 1024, num_layers: int = 4, batch: int = 8, min_len: int = 32,
                        max_len: int = 256, dtype: torch.dtype = torch.float32, optimizer: str = "adam") -> Trace:
    """Record ``steps`` training steps of a ``torch.nn.TransformerEncoder`` on the meta device.

    The model (``d_model``, ``nhead``, ``dim_feedforward``, ``num_layers``;
    ``batch_first``, dropout 0.1) and its optimizer (``"adam"`` or ``"sgd"``
    with momentum) are built inside the recorder, so parameters, gradients
    and optimizer state appear as allocations. Each step draws a sequence
    length uniformly from ``[min_len, max_len]`` (the seed fixes them), runs
    forward, a mean-square loss, backward, ``optimizer.step()`` and
    ``zero_grad(set_to_none=True)``. Phase markers: ``"step N"`` before each
    step (the boundary where a trainer would compact), then ``"backward N"``
    and ``"optimizer N"``. The defaults peak at roughly 100-150 MiB.
    """
    rng = np.random.default_rng(seed)
    lengths = [int(x) for x in rng.integers(min_len, max_len + 1, size=steps)]
    with TraceRecorder(name="training-transformer") as rec:
        layer = torch.nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward, dropout=0.1, batch_first=True,
                                                 device="meta", dtype=dtype)
        model = torch.nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        del layer
        model.train()
        if optimizer == "adam":
            opt = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=False)
        elif optimizer == "sgd":
            opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, foreach=False)
        else:
            raise ValueError(f"optimizer must be 'adam' or 'sgd', got {optimizer!r}")
        for step, length in enumerate(lengths, start=1):
            rec.phase(f"step {step}")
            x = torch.randn(batch, length, d_model, device="meta", dtype=dtype)
            loss = model(x).float().pow(2).mean()
            rec.phase(f"backward {step}")
            loss.backward()
            del x, loss
            rec.phase(f"optimizer {step}")
            opt.step()
            opt.zero_grad(set_to_none=True)
        trace = rec.trace()  # the model and optimizer state stay live at the end
    trace.meta = {"generator": "training_from_model", "seed": seed, "steps": steps, "d_model": d_model,
                  "nhead": nhead, "dim_feedforward": dim_feedforward, "num_layers": num_layers, "batch": batch,
                  "sequence_lengths": lengths, "dtype": str(dtype).replace("torch.", ""), "optimizer": optimizer,
                  "recorded_ops": rec.ops, "method": "TorchDispatchMode + StorageWeakRef sweep on the meta device"}
    return trace
