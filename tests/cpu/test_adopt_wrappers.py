"""`pool.adopt` of tensors with no storage of their own (issue 46 item 17): FSDP2's DTensor parameters are
adopted through their local shards, and a wrapper it cannot see into is one clear error, not PyTorch's raw
"invalid python storage"."""

from __future__ import annotations

import textwrap

import pytest
import torch

import defrag

from ..forked import run_python

FSDP2 = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    import defrag
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train(model, opt, steps):
        torch.manual_seed(1)
        losses = []
        for _ in range(steps):
            loss = model(torch.randn(8, 64)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    plain, plain_opt = make()
    expected = train(plain, plain_opt, 2) + train(plain, plain_opt, 2)
    model, opt = make()
    pool = defrag.Pool(device="emulated", capacity="64MiB")
    fill = pool.empty((2 << 20) - (40 << 10), dtype=torch.uint8)  # freed below: a shard then moves
    pool.adopt(model)                 # DTensor parameters: their local shards move in
    print(type(next(model.parameters())).__name__, all(pool.owns(p.to_local()) for p in model.parameters()))
    losses = train(model, opt, 2)
    pool.adopt(opt)                   # DTensor optimizer state too
    states = [v for s in opt.state.values() for v in s.values() if v.dim()]
    print(len(states), all(pool.owns(v.to_local()) for v in states))
    del fill
    print(pool.compact().moved_tensors > 0)
    losses += train(model, opt, 2)
    print(losses == expected)
    dist.destroy_process_group()
""")


def test_adopt_of_an_fsdp2_model_moves_its_local_shards_and_training_goes_on(tmp_path):
    proc = run_python(FSDP2, str(tmp_path / "store"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["DTensor True", "8 True", "True", "True"], proc.stdout + proc.stderr[-2000:]


class _Opaque(torch.Tensor):
    """A wrapper subclass that says nothing of what it wraps (no __tensor_flatten__): no storage to read."""

    @staticmethod
    def __new__(cls, shape):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(func)


def test_a_wrapper_adopt_cannot_see_into_is_one_clear_error():
    pool = defrag.Pool(device="emulated", capacity="4MiB")
    try:
        for obj in (_Opaque((4, 4)), [torch.zeros(4), _Opaque((2,))]):
            with pytest.raises(ValueError, match=r"adopt: .*_Opaque whose storage cannot be read .*DTensor.*"
                                                 r"t\.to_local\(\)"):
                pool.adopt(obj)
        assert pool.stats()["allocated_bytes.all.current"] == 0  # refused before anything moved
    finally:
        pool.close()
