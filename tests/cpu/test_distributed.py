"""defrag.distributed over real processes: gloo process groups of 2 and 3 ranks on the emulated device.

Each world size is spawned once (module fixture): every rank runs the same
scenarios in order, on its own pools, and writes what it saw (figures,
decisions, errors, bytes) to a JSON file after each scenario; the tests
below assert on those files. The worker is this module's `worker()`, run
as `python -c` in a subprocess with a hard deadline: a hang fails the test
and every rank is killed. The last scenario makes one rank never reach the
collective and checks that the others raise within the subgroup's timeout.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import datetime
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

import pytest
import torch

import defrag
import defrag.distributed as ddist
from defrag.driver import Driver

from .. import forked

ROOT = pathlib.Path(__file__).resolve().parents[2]
KiB, MiB = 1 << 10, 1 << 20
PAGE = 64 * KiB  # the workers' emulated granularity: small pages keep every scenario cheap
T = 256 * KiB  # min_stranded in the decision scenarios
SHORT_TIMEOUT = 4.0  # seconds: the subgroup of the timeout scenario (ranks arrive within it even on a busy machine)
SPAWN_DEADLINE = 150.0  # seconds for a whole world: far above a normal run, so only a hang reaches it


# ---------------------------------------------------------------------- the spawned side
def _pool(auto_compact=False, capacity="4MiB"):
    drv = Driver.emulated(capacity=64 * MiB, granularity=PAGE)
    return defrag.Pool(device=drv, capacity=capacity, auto_compact=auto_compact)


def _strand(pool, nbytes, *, block=16 * KiB):
    """Leave about `nbytes` stranded: fill pages with 16 KiB blocks, keep one in four."""
    per_page = PAGE // block
    pages = -(-nbytes // (PAGE - block))
    ts = [pool.empty(block, dtype=torch.uint8) for _ in range(pages * per_page)]
    ts.sort(key=lambda t: t.data_ptr())
    return ts[::per_page]


def _scenario_decisions(rank, world, pool):
    """Rounds with known per-rank fragmentation; each rank reports what it had and what it got."""
    plans = {"nobody": set(), "rank0": {0}, "last": {world - 1}, "all": set(range(world))}
    rounds = []
    for name, fragmented in [*plans.items(), ("under", "under")]:
        keep = [pool.empty(8 * KiB, dtype=torch.uint8)]  # every rank holds something
        if name == "under":
            keep += _strand(pool, T // 2)  # stranded, but below min_stranded everywhere
        elif rank in fragmented:
            keep += _strand(pool, 3 * T)
        before = pool.stats()
        report = ddist.compact(pool, min_stranded=T)  # a size in bytes ...
        after = pool.stats()
        rounds.append({"name": name, "stranded": before["stranded_bytes"], "compacted": report is not None,
                       "moved": report.moved_tensors if report else 0,
                       "stranded_after": after["stranded_bytes"],
                       "compactions": after["num_compactions"] - before["num_compactions"]})
        del keep
    # ... or a size string: the same rule.
    keep = _strand(pool, 3 * T) if rank == 0 else []
    decision = ddist.decide(pool, min_stranded="256KiB")
    rounds.append({"name": "decide", "stranded": pool.stats()["stranded_bytes"], "compacted": decision.compact,
                   "wanted_by": list(decision.wanted_by), "all_stranded": list(decision.stranded)})
    del keep
    return rounds


def _scenario_ladder(rank, world, pool):
    """The last rank's allocation needs the ladder (and fails) while it strands less than min_stranded."""
    keep = []
    if rank == world - 1:
        keep = _strand(pool, 5 * MiB // 2)  # live blocks on 54 of the 64 pages
        try:
            pool.empty(2 * MiB, dtype=torch.uint8)  # 32 pages: 10 are free, and no compaction runs
            failed = False
        except defrag.OutOfMemoryError:
            failed = True
        assert failed, "the fragmented 4 MiB pool should refuse 2 MiB without compacting"
    stranded = pool.stats()["stranded_bytes"]
    first = ddist.compact(pool, min_stranded="16MiB")
    second = ddist.compact(pool, min_stranded="16MiB")  # the climb was seen: no new one since
    del keep
    return {"stranded": stranded, "first": first is not None, "second": second is not None,
            "moved": first.moved_tensors if first else 0}


def _scenario_bad_args(rank, world, pool):
    out = {}
    keep = _strand(pool, 3 * T)
    fingerprint = lambda: (pool.stats(), [(t.address, t.nbytes) for t in pool.live_tensors()])
    before = fingerprint()
    for name, kwargs in [("negative", {"min_stranded": -1}), ("unit", {"min_stranded": "2 parsecs"}),
                         ("kwarg", {"min_stranded": 0, "verfy": True})]:
        try:
            ddist.compact(pool, **kwargs)
            out[name] = "no error"
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    try:
        ddist.compact("not a pool", min_stranded=0)
    except Exception as exc:
        out["not_a_pool"] = f"{type(exc).__name__}: {exc}"
    # Only rank 1 passes a bad threshold: it raises its own error, the others learn at once who failed.
    t0 = time.monotonic()
    try:
        ddist.compact(pool, min_stranded=-5 if rank == 1 else 0)
        out["one_rank"] = "no error"
    except Exception as exc:
        out["one_rank"] = f"{type(exc).__name__}: {exc}"
        out["one_rank_failed"] = {str(k): v for k, v in getattr(exc, "failed_ranks", {}).items()}
    out["one_rank_seconds"] = time.monotonic() - t0
    # Rank 0 hands over a closed pool.
    closed = _pool()
    closed.close()
    try:
        ddist.compact(closed if rank == 0 else pool, min_stranded=0)
        out["closed"] = "no error"
    except Exception as exc:
        out["closed"] = f"{type(exc).__name__}: {exc}"
    out["unchanged"] = fingerprint() == before
    # The group is still in step: a normal call works and compacts everywhere.
    out["after"] = ddist.compact(pool, min_stranded=0) is not None
    del keep
    return out


def _scenario_stats(rank, world, pool):
    keep = [pool.empty((rank + 1) * 4 * KiB, dtype=torch.uint8)]
    mine = pool.stats()
    gathered = ddist.stats(pool)
    out = {"mine": mine["allocated_bytes.all.current"], "is_none": gathered is None}
    if gathered is not None:
        out["allocated"] = [st["allocated_bytes.all.current"] for st in gathered.ranks]
        out["lines"] = gathered.lines()
        out["text"] = str(gathered)
    try:  # the last rank hands over something that is not a pool
        out["bad"] = repr(ddist.stats("not a pool" if rank == world - 1 else pool))
    except Exception as exc:
        out["bad"] = f"{type(exc).__name__}: {exc}"
    del keep
    return out


def _scenario_hook(rank, world, pool):
    hook = ddist.CompactEvery(pool, every=3, min_stranded=T)
    keep, results = [], []
    for step in range(7):
        if rank == 0:
            keep += _strand(pool, 2 * T)  # more stranded bytes every step, on one rank only
        results.append(hook() is not None)  # callable, as an optimizer step post hook calls it
    del keep
    return {"compacted": results, "steps": hook.steps, "compactions": hook.compactions}


def _ddp_run(rank, world, *, pooled, gbv, steps=4):
    """SGD with DDP on the same data; with `pooled`, parameters (and grads) live in a pool that compacts."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(1234)  # the same initial weights on every rank and in both runs
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    pool = _pool() if pooled else None
    if pooled:
        pool.adopt(model)  # before DDP: the reducer is built over pool tensors
    net = DDP(model, gradient_as_bucket_view=gbv)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    params = list(model.parameters())
    gen = torch.Generator().manual_seed(rank)
    info = {"param_moves": 0, "grad_moves": 0, "grads_in_pool": 0, "compactions": 0, "losses": []}
    anchor = None
    for step in range(steps):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # grads persist, so the pool can hold them
        info["losses"].append(loss.item())
        if not pooled:
            continue
        pool.adopt(model)  # grads made by DDP since (with gradient_as_bucket_view: its bucket's storage)
        info["grads_in_pool"] = sum(pool.owns(p.grad) for p in params)
        # A large block starts a fresh page and leaves its last page's tail free: the parameters'
        # page is then the sparse one, and the compaction moves them (and the grads) into that tail.
        # The new anchor is made while the old one lives (the pool reuses a freed range for the next
        # request of its size: made after the old one died, it would land where that one was).
        anchor = pool.empty(PAGE + 4 * KiB, dtype=torch.uint8)
        before = [(p.data_ptr(), p.grad.data_ptr()) for p in params]
        report = ddist.compact(pool, min_stranded=16 * KiB)
        assert report is not None, "every rank strands its parameters' page: every rank compacts"
        info["compactions"] += 1
        after = [(p.data_ptr(), p.grad.data_ptr()) for p in params]
        info["param_moves"] += sum(b[0] != a[0] for b, a in zip(before, after))
        info["grad_moves"] += sum(b[1] != a[1] for b, a in zip(before, after))
        pool.check_invariants()
    state = [p.detach().clone() for p in params]
    del net, opt, anchor
    return state, info


def _scenario_ddp(rank, world):
    out = {}
    for gbv in (False, True):
        plain, _ = _ddp_run(rank, world, pooled=False, gbv=gbv)
        pooled, info = _ddp_run(rank, world, pooled=True, gbv=gbv)
        # Ranks must agree with each other too: gather a checksum of rank 0's... every rank's weights.
        digest = torch.cat([p.flatten() for p in pooled]).double().sum().reshape(1)
        digests = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
        torch.distributed.all_gather(digests, digest)
        out[str(gbv)] = {**info, "equal": all(torch.equal(a, b) for a, b in zip(plain, pooled)),
                         "same_on_every_rank": len({d.item() for d in digests}) == 1}
    return out


def _fsdp_run(rank, world, *, pooled, steps=4):
    """FSDP (FULL_SHARD, CPU, gloo); with `pooled`, its sharded flat parameter is adopted between steps."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(1234)
    net = FSDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8)),
               device_id=torch.device("cpu"))
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    pool = _pool() if pooled else None
    gen = torch.Generator().manual_seed(rank)
    moves = adopted = 0
    anchor = None
    for step in range(steps):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
        if pooled:
            pool.adopt(net)  # between steps FSDP holds only the sharded flat parameter
            adopted = sum(pool.owns(p) for p in net.parameters())
            # Made while the last one lives, so it does not land where that one was (see _ddp_run).
            anchor = pool.empty(PAGE + 4 * KiB, dtype=torch.uint8)
            before = [p.data_ptr() for p in net.parameters()]
            assert ddist.compact(pool, min_stranded=16 * KiB) is not None
            moves += sum(b != p.data_ptr() for b, p in zip(before, net.parameters()))
    del anchor
    with FSDP.summon_full_params(net):
        full = [p.detach().clone() for p in net.parameters()]
    return full, moves, adopted


def _scenario_fsdp(rank, world):
    plain, _, _ = _fsdp_run(rank, world, pooled=False)
    pooled, moves, adopted = _fsdp_run(rank, world, pooled=True)
    return {"equal": len(plain) == len(pooled) and all(torch.equal(a, b) for a, b in zip(plain, pooled)),
            "moves": moves, "adopted": adopted, "params": len(plain)}


def _scenario_timeout(rank, world, pool):
    """A subgroup with a short timeout: the last rank raises in its own code and never calls compact."""
    group = torch.distributed.new_group(backend="gloo", timeout=datetime.timedelta(seconds=SHORT_TIMEOUT))
    out = {"normal": ddist.compact(pool, min_stranded=0, group=group) is not None}
    t0 = time.monotonic()
    try:
        if rank == world - 1:
            raise RuntimeError("simulated failure in this rank's training step")
        ddist.compact(pool, min_stranded=0, group=group)
        out["error"] = "no error"
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["collective"] = getattr(exc, "collective", None)
    out["seconds"] = time.monotonic() - t0
    torch.distributed.barrier()  # the default group is another context: still in step
    return out


def worker() -> None:
    """One rank: `python -c "...worker()" RANK WORLD STORE OUTDIR`."""
    rank, world, store, outdir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], pathlib.Path(sys.argv[4])
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                         timeout=datetime.timedelta(seconds=30))
    results: dict = {}
    path = outdir / f"rank{rank}.json"
    try:
        pool = _pool()
        for name, fn in [("decisions", _scenario_decisions), ("ladder", _scenario_ladder),
                         ("bad_args", _scenario_bad_args), ("stats", _scenario_stats), ("hook", _scenario_hook),
                         ("ddp", lambda r, w, p: _scenario_ddp(r, w)),
                         ("fsdp", lambda r, w, p: _scenario_fsdp(r, w)), ("timeout", _scenario_timeout)]:
            t0 = time.monotonic()
            results[name] = fn(rank, world, pool)
            results.setdefault("seconds", {})[name] = round(time.monotonic() - t0, 3)
            pool.check_invariants()
            path.write_text(json.dumps(results))
    except BaseException:
        results["crash"] = traceback.format_exc()
        path.write_text(json.dumps(results))
        raise
    finally:
        torch.distributed.destroy_process_group()


# ---------------------------------------------------------------------- the test side
def spawn(world: int, tmp: pathlib.Path, code: str, args_for, *, deadline: float, env=None) -> list[subprocess.CompletedProcess]:
    """Start `world` Python processes; kill all of them if one fails and the rest do not follow, or at `deadline`."""
    procs = []
    logs = []
    for rank in range(world):
        log = open(tmp / f"log{rank}.txt", "w+")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, "-c", code, *args_for(rank)], cwd=ROOT, stdout=log,
                                      stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}))
    start = time.monotonic()
    first_failure = None
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if first_failure is None and any(p.poll() not in (None, 0) for p in procs):
                first_failure = now
            if now - start > deadline or (first_failure is not None and now - first_failure > 20):
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    out = []
    for rank, (p, log) in enumerate(zip(procs, logs)):
        log.seek(0)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, log.read(), ""))
        log.close()
    return out


def run_world(world: int, tmp: pathlib.Path) -> list[dict]:
    store = tmp / "store"
    t0 = time.monotonic()
    done = spawn(world, tmp, "from tests.cpu.test_distributed import worker; worker()",
                 lambda rank: [str(rank), str(world), str(store), str(tmp)], deadline=SPAWN_DEADLINE)
    elapsed = time.monotonic() - t0
    logs = "\n".join(f"--- rank {r} (exit {c.returncode}) ---\n{c.stdout[-3000:]}" for r, c in enumerate(done))
    assert elapsed < SPAWN_DEADLINE, f"a rank hung; every rank was killed after {elapsed:.0f} s\n{logs}"
    assert all(c.returncode == 0 for c in done), f"a rank failed\n{logs}"
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]


WORLDS = (2, 3)  # 3: a first, a middle and a last rank (4 gave nothing more, and on 2 cores took half a minute)


def _spawn_worlds(folder: pathlib.Path) -> dict:
    """Every world, spawned at the same time: one's imports and waits (gloo's, the timeout scenario's
    seconds) overlap the other's work. {world size: its ranks' results, or what failed}."""
    def one(world):
        try:
            (folder / f"world{world}").mkdir(parents=True, exist_ok=True)
            return run_world(world, folder / f"world{world}")
        except BaseException as exc:  # noqa: BLE001 - re-raised by the tests of that world only
            return exc

    with concurrent.futures.ThreadPoolExecutor(len(WORLDS)) as pool:
        return dict(zip(WORLDS, pool.map(one, WORLDS)))


def start_early(items):
    """The worlds (half a minute) start with the session, beside the other tests (tests/forked.py)."""
    if any("ranks" in item.fixturenames for item in items):
        folder = pathlib.Path(tempfile.mkdtemp(prefix="defrag-worlds-"))
        atexit.register(shutil.rmtree, folder, True)
        forked.start_early("gloo worlds", _spawn_worlds, folder)


@pytest.fixture(scope="module")
def worlds(tmp_path_factory) -> dict:
    return forked.early("gloo worlds", _spawn_worlds, tmp_path_factory.mktemp("worlds"))


@pytest.fixture(params=WORLDS, ids=lambda w: f"{w}ranks")
def ranks(request, worlds):
    got = worlds[request.param]
    if isinstance(got, BaseException):
        raise got
    return got


def test_every_rank_makes_the_same_decision_and_it_follows_the_rule(ranks):
    world = len(ranks)
    rounds = [r["decisions"] for r in ranks]
    for i, name in enumerate(x["name"] for x in rounds[0]):
        seen = [rank_rounds[i] for rank_rounds in rounds]
        decisions = {s["compacted"] for s in seen}
        assert len(decisions) == 1, f"round {name}: ranks disagree: {seen}"
        expected = any(s["stranded"] >= T for s in seen)
        assert decisions == {expected}, f"round {name}: stranded {[s['stranded'] for s in seen]}, decided {decisions}"
    by_name = {x["name"]: i for i, x in enumerate(rounds[0])}
    assert [rounds[0][by_name[n]]["compacted"] for n in ("nobody", "rank0", "last", "all", "under")] == [
        False, True, True, True, False]
    decide = [r[by_name["decide"]] for r in rounds]
    assert all(d["wanted_by"] == [0] for d in decide)  # only rank 0 strands 256 KiB or more
    assert all(d["all_stranded"] == [x["stranded"] for x in decide] for d in decide)
    assert world == len(decide)


def test_one_fragmented_rank_makes_every_rank_compact(ranks):
    last = len(ranks) - 1
    for name, fragmented in (("rank0", 0), ("last", last)):
        seen = [next(x for x in r["decisions"] if x["name"] == name) for r in ranks]
        assert all(s["compacted"] and s["compactions"] == 1 for s in seen), seen
        frag = seen[fragmented]
        assert frag["stranded"] >= 2 * T and frag["moved"] > 0 and frag["stranded_after"] < T
        others = [s for r, s in enumerate(seen) if r != fragmented]
        assert all(s["stranded"] < T and s["moved"] == 0 for s in others)  # compacted, nothing to move


def test_below_the_threshold_no_rank_compacts(ranks):
    for r in ranks:
        for name in ("nobody", "under"):
            s = next(x for x in r["decisions"] if x["name"] == name)
            assert not s["compacted"] and s["compactions"] == 0
    under = [next(x for x in r["decisions"] if x["name"] == "under") for r in ranks]
    assert all(0 < s["stranded"] < T for s in under)  # stranded, but not enough, on every rank


def test_an_allocation_that_needed_the_ladder_makes_every_rank_compact(ranks):
    last = ranks[-1]["ladder"]
    assert 0 < last["stranded"] < 16 * MiB and last["moved"] > 0
    assert all(r["ladder"]["first"] for r in ranks)
    assert not any(r["ladder"]["second"] for r in ranks)  # a climb is counted once


def test_bad_arguments_raise_clear_errors_on_every_rank_and_change_nothing(ranks):
    for rank, r in enumerate(ranks):
        b = r["bad_args"]
        assert b["negative"].startswith("ValueError: min_stranded must be >= 0 bytes, got -1")
        assert b["unit"].startswith("ValueError: min_stranded must be a byte count") and "2 parsecs" in b["unit"]
        assert b["kwarg"].startswith("TypeError: defrag.distributed.compact: unknown argument verfy")
        assert b["not_a_pool"].startswith("TypeError: defrag.distributed.compact: pool must be a defrag.Pool")
        assert b["unchanged"] and b["after"]
        if rank == 1:
            assert b["one_rank"].startswith("ValueError: min_stranded must be >= 0 bytes, got -5")
        else:
            assert b["one_rank"].startswith("CollectiveError: defrag.distributed.compact: rank 1 of")
            assert "min_stranded must be >= 0 bytes" in b["one_rank"] and list(b["one_rank_failed"]) == ["1"]
            assert b["one_rank_seconds"] < 10  # told at once, not after the group's 30 s timeout
        if rank == 0:
            assert b["closed"].startswith("PoolClosedError: defrag.distributed.compact: pool #")
        else:
            assert b["closed"].startswith("CollectiveError: defrag.distributed.compact: rank 0 of")
            assert "PoolClosedError" in b["closed"]


def test_stats_gathers_every_rank_on_rank_zero(ranks):
    world = len(ranks)
    assert [r["stats"]["is_none"] for r in ranks] == [False] + [True] * (world - 1)
    got = ranks[0]["stats"]
    assert got["allocated"] == [r["stats"]["mine"] for r in ranks]
    assert got["allocated"] == [(rank + 1) * 4 * KiB for rank in range(world)]
    assert len(got["lines"]) == world and got["text"] == "\n".join(got["lines"])
    assert all(line.startswith(f"rank {i}: allocated {defrag.format_bytes((i + 1) * 4 * KiB)}")
               for i, line in enumerate(got["lines"]))
    last = world - 1
    assert got["bad"] == (f"CollectiveError: defrag.distributed.stats: 1 of {world} ranks could not give their "
                          f"stats (rank {last}: TypeError: defrag.distributed.stats: pool must be a defrag.Pool, got str)")
    assert ranks[last]["stats"]["bad"].startswith("TypeError: defrag.distributed.stats: pool must be a defrag.Pool")
    assert all(r["stats"]["bad"] == "None" for r in ranks[1:last])


def test_the_hook_compacts_every_nth_step_on_every_rank(ranks):
    for r in ranks:
        h = r["hook"]
        assert h["compacted"] == [False, False, True, False, False, True, False]
        assert h["steps"] == 7 and h["compactions"] == 2


@pytest.mark.parametrize("gbv", ["False", "True"], ids=["grads_apart", "gradient_as_bucket_view"])
def test_ddp_with_pooled_parameters_and_collective_compactions_matches_plain_ddp(ranks, gbv):
    for rank, r in enumerate(ranks):
        d = r["ddp"][gbv]
        assert d["equal"], f"rank {rank}: parameters differ from plain DDP"
        assert d["same_on_every_rank"]
        assert d["compactions"] == 4
        # Compactions between steps really moved the parameters and, once in the pool, the grads
        # (how often depends on where the pool places each anchor: at least once each, mostly more).
        assert d["param_moves"] >= 4 * 2, d
        assert d["grads_in_pool"] == 4 and d["grad_moves"] >= 4 * 2, d


def test_fsdp_with_its_sharded_parameter_in_a_pool_matches_plain_fsdp(ranks):
    for rank, r in enumerate(ranks):
        f = r["fsdp"]
        assert f["equal"], f"rank {rank}: parameters differ from plain FSDP"
        assert f["adopted"] == 1 and f["moves"] >= 2, f  # one flat parameter, moved by compactions between steps


def test_a_rank_that_never_reaches_the_collective_makes_the_others_raise_not_hang(ranks):
    world = len(ranks)
    for rank, r in enumerate(ranks):
        t = r["timeout"]
        assert t["normal"]
        if rank == world - 1:
            assert t["error"] == "RuntimeError: simulated failure in this rank's training step"
            continue
        assert t["error"].startswith(f"CollectiveError: defrag.distributed.compact: the all_gather across the ranks "
                                     f"failed on rank {rank} of {world}"), t["error"]
        assert "timeout" in t["error"] and t["collective"] == "defrag.distributed.compact"
        assert SHORT_TIMEOUT - 0.5 < t["seconds"] < SHORT_TIMEOUT + 10


# ---------------------------------------------------------------------- in this process
def test_without_a_process_group_it_raises_before_any_collective():
    pool = defrag.Pool(device=Driver.emulated(capacity=16 * MiB, granularity=PAGE), capacity="1MiB")
    try:
        keep = _strand(pool, 512 * KiB)
        before = pool.stats()
        for call in (lambda: ddist.compact(pool, min_stranded=0), lambda: ddist.decide(pool),
                     lambda: ddist.stats(pool)):
            with pytest.raises(RuntimeError, match="is a collective and needs a process group: call "
                                                   r"torch.distributed.init_process_group\(...\)"):
                call()
        assert pool.stats() == before
        hook = ddist.CompactEvery(pool, every=2, min_stranded=0)
        assert hook.step() is None  # not the 2nd step: nothing to communicate
        with pytest.raises(RuntimeError, match="needs a process group"):
            hook.step()
        del keep
    finally:
        pool.close()


def test_the_hook_checks_its_arguments_when_made():
    pool = defrag.Pool(device=Driver.emulated(capacity=16 * MiB, granularity=PAGE), capacity="1MiB")
    try:
        for every in (0, -1, 2.5, True, "3"):
            with pytest.raises(ValueError, match="every must be a whole number of steps >= 1"):
                ddist.CompactEvery(pool, every=every)
        with pytest.raises(ValueError, match="min_stranded must be a byte count"):
            ddist.CompactEvery(pool, every=1, min_stranded="lots")
        with pytest.raises(TypeError, match="unknown argument"):
            ddist.CompactEvery(pool, every=1, verfy=True)
        with pytest.raises(TypeError, match="pool must be a defrag.Pool"):
            ddist.CompactEvery(object(), every=1)
    finally:
        pool.close()


def test_the_guide_ddp_example_runs_as_written(tmp_path):
    """docs/guide.md "Several GPUs": its example, saved as a file and run with python, on 2 gloo ranks."""
    guide = (ROOT / "docs" / "guide.md").read_text()
    section = guide.split("## 16. Several GPUs", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    script = tmp_path / "train.py"
    script.write_text(code)

    def run():
        # PYTHONFAULTHANDLER: an abort prints every thread's Python stack, so a failure says where it was.
        return subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                              timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONFAULTHANDLER": "1",
                                                "MASTER_PORT": str(_free_port())})
    proc = run()
    if proc.returncode != 0 and "terminate called without an active exception" in proc.stderr \
            and proc.stdout.count("rank 1: allocated") == 1:
        # A rank aborting in C++ at exit after the whole example ran and printed what it should: seen in
        # one CI run and in one full-suite run under heavy load, never in 45 runs of the example alone
        # under load. Likely torch's teardown, not ours: gloo's threads (gloo_tcp_loop, pt_gloo_runloop)
        # still run after destroy_process_group(), until the process exits, with or without the DDP
        # module deleted first. Said (with the faulthandler stacks), and run once more: a second abort,
        # or any other failure, fails the test.
        warnings.warn(f"the guide's DDP example aborted at exit once; rerun. stderr:\n{proc.stderr[-4000:]}")
        proc = run()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    # Two processes share the pipe: a line of one may land inside a line of the other, so no anchors.
    steps = {r: [int(s) for s in re.findall(rf"rank {r}: compacted at step (\d+), moved \d+ tensors", out)]
             for r in (0, 1)}
    assert steps[0] == steps[1] == [2, 4, 6], out  # what the guide says: the same steps on both ranks
    assert re.search(r"^rank 0: allocated .*\nrank 1: allocated ", out, re.M), out  # stats' lines, on rank 0 only
    assert out.count("rank 0: allocated") == 1


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
