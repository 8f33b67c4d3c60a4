"""Replays: the accounting model against the real pool, compaction's effect, and the CLI."""

from __future__ import annotations

import json
import pickle
import random

import pytest

from defrag.cli import main as cli_main
from defrag.replay import min_capacity, replay
from defrag.traces import ALLOC, FREE, PHASE, Trace, checkerboard, llm_serving, model_swap, training_from_model
from defrag.dry import DryPool
from defrag.traces.snapshot import to_snapshot

MiB = 1 << 20
PAGE = 2 * MiB


@pytest.fixture(scope="module")
def workloads():
    """Small versions of every generator (the same code paths, seconds to replay for real)."""
    return {
        "llm_serving": llm_serving(steps=400),
        "training_from_model": training_from_model(steps=3, max_len=128, num_layers=2),
        "model_swap": model_swap(swaps=3, requests_per_model=12),
        "checkerboard": checkerboard(total_bytes=32 * MiB, rounds=2),
    }


def _figures(r):
    return (r.peak_live_bytes, r.peak_reserved_bytes, r.ooms, r.compactions, r.compactions_automatic,
            r.moved_bytes, r.moved_tensors, r.error is None)


@pytest.mark.parametrize("name", ["llm_serving", "training_from_model", "model_swap", "checkerboard"])
@pytest.mark.parametrize("tight", [False, True], ids=["roomy", "tight"])
def test_dry_and_real_replays_agree(workloads, name, tight):
    """The dry pool is the real pool's core over the memory-less driver: same peaks, OOMs, compactions,
    bytes moved."""
    trace = workloads[name]
    live = trace.stats().peak_live_bytes
    capacity = int(live * (1.04 if tight else 1.5)) + PAGE
    for compaction in (True, False):
        dry = replay(trace, capacity, dry=True, compaction=compaction)
        real = replay(trace, capacity, dry=False, compaction=compaction)
        assert real.device == "emulated" and dry.dry and not real.dry
        assert _figures(dry) == _figures(real), (compaction, dry, real)
        assert dry.peak_live_bytes == live or dry.ooms or dry.error


def test_dry_pool_keeps_its_books():
    """Random alloc/free/compact with the core's invariant checks, over the memory-less driver."""
    rng = random.Random(7)
    for capacity_pages, auto in ((24, True), (40, False)):
        pool = DryPool(capacity_pages * PAGE, PAGE, auto_compact=auto)
        live, sizes = [], {}
        for step in range(1500):
            if live and rng.random() < 0.45:
                pool.free(live.pop(rng.randrange(len(live))))
            elif rng.random() < 0.02:
                pool.compact()
            else:
                size = rng.choice([rng.randint(1, 300_000), rng.randint(PAGE // 2, 3 * PAGE + 1000)])
                if pool.alloc(step, size):
                    live.append(step)
                    sizes[step] = size
            if step % 25 == 0:
                pool.check_invariants()
        pool.check_invariants()
        st = pool.stats()
        assert st["reserved_bytes.all.peak"] <= capacity_pages * PAGE
        assert st["allocated_bytes.all.current"] == sum(-(-sizes[k] // 512) * 512 for k in live)
        assert pool.driver.api.state()["used_bytes"] == st["pages.total"] * PAGE  # the device's books agree
        pool.close()
        assert pool.driver.api.state() == {"handles": 0, "mappings": 0, "reservations": 0, "used_bytes": 0}


def test_checkerboard_needs_compaction(workloads):
    """At a capacity of exactly the filled bytes, only a compacting pool serves the large requests."""
    trace = workloads["checkerboard"]
    capacity = trace.meta["total_bytes"]
    for dry in (True, False):
        on = replay(trace, capacity, dry=dry, compaction=True)
        off = replay(trace, capacity, dry=dry, compaction=False)
        assert off.ooms > 0 and off.failed_bytes >= off.ooms * 4 * PAGE
        assert on.ooms == 0 and on.completed and on.moved_bytes > 0
        assert on.peak_reserved_bytes <= capacity


_TAILS = ("blocks of a page or more move only by the conveyor, which needs empty pages for its zone and "
          "packs them only where that frees a page, so tails between them remain for sub-page blocks")
_GOAL_MISSES = {
    "llm_serving": "KV caches are multi-page blocks in 512 KiB steps: " + _TAILS + " (this size: 1.041, 1.032 "
                   "before blocks of 4 pages or more were packed end to end, core.PACK_PAGES; the default size "
                   "meets the goal: 286 MiB, where a KV cache is placed by evacuating a window; so does the "
                   "defrag-mesh row, test_meshing_meets_the_goal_the_tails_miss)",
    "training_from_model": "attention activations span a few pages each: " + _TAILS + " (this size: 1.092, "
                           "with or without compaction; the default size meets the goal: 1.019)",
}


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.xfail(reason=_GOAL_MISSES[n], strict=True)) if n in _GOAL_MISSES else n
    for n in ["llm_serving", "training_from_model", "model_swap", "checkerboard"]])
def test_goal_peak_reserved_within_2_percent_of_peak_live(workloads, name):
    """Goal, compaction on: peak reserved <= 1.02 x peak live + one page, at the smallest capacity that completes."""
    trace = workloads[name]
    smallest = min_capacity(trace, compaction=True)
    assert smallest.exact
    r = replay(trace, smallest.bytes, dry=True, compaction=True)
    assert r.completed and r.peak_reserved_bytes <= smallest.bytes
    assert r.meets_goal(1.02), f"{name}: peak reserved / peak live = {r.reserved_over_live:.4f}"


def test_meshing_meets_the_goal_the_tails_miss(workloads):
    """The defrag-mesh row (phase compactions and the ladder also mesh what cannot move): llm_serving's
    stranded tails share physical pages, so at this size it meets the goal the defrag row misses, at a
    smallest capacity no larger."""
    trace = workloads["llm_serving"]
    smallest = min_capacity(trace, allocator="defrag-mesh")
    assert smallest.exact
    r = replay(trace, smallest.bytes, dry=True, compaction=True, mesh=True)
    assert r.allocator == "defrag-mesh" and r.completed and r.peak_reserved_bytes <= smallest.bytes
    assert r.meets_goal(1.02), f"peak reserved / peak live = {r.reserved_over_live:.4f}"
    assert smallest.bytes <= min_capacity(trace, compaction=True).bytes


def test_min_capacity_bisection(workloads):
    trace = workloads["checkerboard"]
    on = min_capacity(trace, compaction=True)
    assert on.exact and on.bytes == trace.meta["total_bytes"]
    off = min_capacity(trace, compaction=False, known_good=2 * trace.meta["total_bytes"])
    assert off.exact and off.bytes > on.bytes and off.failed_below == off.bytes - PAGE
    assert replay(trace, off.bytes, dry=True, compaction=False).completed
    assert not replay(trace, off.failed_below, dry=True, compaction=False).completed
    # A step budget of one cannot narrow the bracket: the answer is an upper bound.
    rough = min_capacity(trace, compaction=False, known_good=2 * trace.meta["total_bytes"], max_steps=1)
    assert not rough.exact and rough.bytes >= off.bytes


def test_a_failed_compaction_stops_the_replay_and_is_reported(workloads, monkeypatch):
    """A compaction that raises (not an OOM) ends the replay with the error named, in both modes."""
    from defrag.errors import CompactionError
    from defrag.pool import Pool

    def refuse_real(self, **kwargs):
        raise CompactionError("the plan needs 9 new pages but only 2 physical pages are free; nothing was moved")

    def refuse_dry(self, **kwargs):
        raise CompactionError("the plan needs 9 new pages but only 2 physical pages are free")

    monkeypatch.setattr(Pool, "compact", refuse_real)
    monkeypatch.setattr(DryPool, "compact", refuse_dry)
    trace = workloads["llm_serving"]
    first_phase = next(i for i, ev in enumerate(trace.events) if ev[0] == PHASE)
    for dry in (True, False):
        r = replay(trace, 2 * trace.stats().peak_live_bytes, dry=dry, compaction=True)
        assert not r.completed and r.ooms == 0
        assert f"at event {first_phase} (phase weights loaded)" in r.error and "9 new pages" in r.error


def test_torch_baselines_skip_without_a_gpu_and_their_child_compiles():
    import torch

    from defrag import replay as replay_module

    compile(replay_module._BASELINE_CHILD, "<torch baseline child>", "exec")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: tests/gpu runs the baselines")
    results, skipped = replay_module.torch_baselines(Trace([(ALLOC, 0, 512)]), 64 * MiB)
    assert results == [] and [s["allocator"] for s in skipped] == ["torch", "torch-expandable"]
    assert all("torch.cuda.is_available() is False" in s["reason"] for s in skipped)


# ---------------------------------------------------------------------- CLI
def test_cli_replays_a_trace_and_writes_json(tmp_path, capsys):
    trace = checkerboard(total_bytes=32 * MiB, rounds=1)
    path = trace.save(tmp_path / "cb.jsonl")
    out = tmp_path / "result.json"
    assert cli_main(["replay", str(path), "--capacity", "64MiB", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "defrag-no-compaction" in text and "goal" not in text  # the benchmarks' language, not the user's
    # One sentence before the table says what happened and what would have helped.
    sentence = text.splitlines()[3]
    assert sentence.startswith("The trace peaks at 31.99 MiB live. The smallest capacity that runs the trace: "
                               "defrag 32.00 MiB, PyTorch with expandable_segments "), sentence
    data = json.loads(out.read_text())
    assert data["capacity"] == 64 * MiB and data["trace"]["kind"] == "trace"
    rows = {r["allocator"]: r for r in data["results"]}
    assert rows["defrag"]["ooms"] == 0 and rows["defrag"]["dry"] is False
    assert rows["defrag"]["peak_live_bytes"] == trace.stats().peak_live_bytes
    assert rows["defrag"]["min_capacity"]["bytes"] == 32 * MiB
    # No GPU here: PyTorch's rows are skipped with the reason, never invented.
    skipped = {s["allocator"]: s["reason"] for s in data["skipped"]}
    if "torch" not in rows:
        assert set(skipped) == {"torch", "torch-expandable"} and "GPU" in skipped["torch"]


def test_cli_replays_a_snapshot_dry(tmp_path, capsys):
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(to_snapshot(llm_serving(steps=200), max_entries=1500)))
    out = tmp_path / "r.json"
    assert cli_main(["replay", str(path), "--capacity", "1GiB", "--dry", "--json", str(out)]) == 0
    assert "ring buffer truncation" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["trace"]["kind"] == "snapshot" and data["dry"] is True
    assert all(r["dry"] for r in data["results"] if r["allocator"].startswith("defrag"))


@pytest.mark.parametrize("make_file,args,fragment", [
    (None, ["--capacity", "lots"], "--capacity must be a byte count"),
    (None, ["--capacity", "1MiB"], "smaller than one page"),
    ("truncated", ["--capacity", "64MiB"], "truncated"),
    ("garbage", ["--capacity", "64MiB"], "not a defrag trace"),
    ("foreign-json", ["--capacity", "64MiB"], "not a defrag trace"),
    ("foreign-pickle", ["--capacity", "64MiB"], "not a PyTorch memory snapshot"),
    ("cut-pickle", ["--capacity", "64MiB"], "truncated pickle"),
    ("missing", ["--capacity", "64MiB"], "cannot read the file"),
    ("empty", ["--capacity", "64MiB"], "empty file"),
])
def test_cli_bad_input_exits_2_with_one_clear_line(tmp_path, capsys, make_file, args, fragment):
    path = tmp_path / "input"
    good = Trace([(ALLOC, 0, 4096), (PHASE, "p"), (FREE, 0)], name="tiny").save(tmp_path / "good.jsonl")
    if make_file is None:
        path = good
    elif make_file == "truncated":
        path.write_bytes(good.read_bytes()[:-5])
    elif make_file == "garbage":
        path.write_bytes(bytes(range(7, 200)))
    elif make_file == "foreign-json":
        path.write_text('{"hello": "world"}\n')
    elif make_file == "foreign-pickle":
        path.write_bytes(pickle.dumps({"state_dict": {}}))
    elif make_file == "cut-pickle":
        path.write_bytes(pickle.dumps(to_snapshot(llm_serving(steps=50)))[:100])
    elif make_file == "empty":
        path.write_bytes(b"")
    assert cli_main(["replay", str(path), *args]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("defrag replay: error:") and fragment in err
    assert len(err.splitlines()) == 1 and "Traceback" not in captured.err + captured.out


@pytest.mark.parametrize("answer", [101, 102, 117, 160, 199, 200, 201, 230])
@pytest.mark.parametrize("split,gallop", [(1, False), (1, True), (2, False), (2, True)])
def test_the_search_finds_the_boundary_on_either_side_of_the_hint(answer, split, gallop):
    """The smallest-capacity search, driven by a monotone oracle (completes from `answer` pages on):
    exact in every mode, the hint tried first, and galloping costs few probes near the hint."""
    from defrag.replay import _search_job

    job = _search_job(None, "defrag", PAGE, 100 * PAGE, known_good=400 * PAGE, hint=200 * PAGE,
                      max_steps=40, split=split, gallop=gallop)
    probed, specs = [], next(job)
    try:
        while True:
            assert 1 <= len(specs) <= split
            pages = [spec[3] // PAGE for spec in specs]
            probed.append(pages)
            specs = job.send([q >= answer for q in pages])
    except StopIteration as stop:
        found = stop.value
    assert found.exact and found.bytes == answer * PAGE and found.failed_below == (answer - 1) * PAGE
    assert 200 in probed[0] and max(probed[0]) == 200  # the hint goes first, the rest of its round below it
    assert found.steps == sum(len(p) for p in probed)
    if gallop and abs(answer - 200) <= 1:
        assert len(probed) <= (3 if split == 2 else 4)  # a boundary next to the hint: found in a few rounds


def test_one_probe_of_the_meshing_pool_answers_for_all_three_pools():
    """Without phase markers the pools run alike until the ladder's rescue: a probe of defrag-mesh says
    whether defrag and defrag-no-compaction complete too (`_answers_for`), exactly as probes of theirs
    would, at capacities just above the peak live bytes, where the pools part ways."""
    from defrag.replay import _answers_for
    from defrag.traces.generators import random_serving

    seen = set()
    for seed in (0, 2):
        trace = random_serving(seed=seed, steps=6000, live_limit=3 << 30)
        assert trace.stats().phases == 0
        floor = -(-trace.stats().peak_live_bytes // PAGE)
        for pages in range(floor, floor + 3):
            said = _answers_for(replay(trace, pages * PAGE, dry=True, mesh=True, stop_at_first_oom=True))
            truth = {name: replay(trace, pages * PAGE, dry=True, compaction=name != "defrag-no-compaction",
                                  mesh=name == "defrag-mesh", stop_at_first_oom=True).completed for name in said}
            assert said == truth, (seed, pages)
            seen.add(tuple(sorted(truth.items())))
    assert len(seen) >= 3  # all fail; only meshing completes; meshing and compaction do; all do


@pytest.mark.parametrize("mesh", [True, False])
@pytest.mark.parametrize("m, d, n, hint", [
    (31224, 31242, 31261, 31254),  # the serving trace's boundaries (80 GB, 2 MiB pages)
    (31197, 31197, 31197, 31200),  # all at the peak live bytes
    (31197, 31199, 31230, 31210),
    (31300, 31300, 31400, 31254),  # above the hint
    (31196, 31196, 31196, None),   # no hint
])
def test_the_joint_search_finds_every_defrag_rows_boundary(mesh, m, d, n, hint):
    """The defrag rows of a trace without phase markers share one search whose every probe answers for all
    of them: driven by monotone oracles (meshing completes from `m` pages on, compaction from `d`, no
    compaction from `n`), each row's answer is exact, two probes a round, and fewer probes than three
    searches of their own would take."""
    from defrag.replay import _ANSWERS, ReplayResult, _pools_without_phases_job

    floor, cap = 31196, 40960
    job = _pools_without_phases_job(None, cap * PAGE, floor * PAGE - 1, page_size=None, series=False,
                                    budget_s=None, mesh=mesh)
    (spec,) = next(job)
    assert spec[:4] == ("replay", None, "defrag-mesh" if mesh else "defrag", cap * PAGE)
    done = ReplayResult(spec[2], "t", cap * PAGE, PAGE, True, "x", 1,
                        search_hint=None if hint is None else hint * PAGE, rescue_steps={"rescues": 0, "meshing": 0})
    specs, probes = job.send([done]), 0
    try:
        while True:
            assert 1 <= len(specs) <= 2 and all(s[0] == "ladder" for s in specs)
            probes += len(specs)
            # Each probe's pool answers for itself and the weaker ones only (`_answers_for`).
            specs = job.send([{k: v for k, v in {"defrag-mesh": q >= m, "defrag": q >= d,
                                                 "defrag-no-compaction": q >= n}.items() if k in _ANSWERS[pool]}
                              for pool, q in ((s[2], s[3] // PAGE) for s in specs)])
    except StopIteration as stop:
        rows = {r.allocator: r.min_capacity for r in stop.value}
    want = {"defrag": d, "defrag-no-compaction": n} | ({"defrag-mesh": m} if mesh else {})
    assert {k: (v.bytes // PAGE, v.exact, v.failed_below // PAGE) for k, v in rows.items()} == {
        k: (v, True, v - 1) for k, v in want.items()}
    assert all(v.steps == probes for v in rows.values())
    assert probes <= 13 * len(want)


def test_a_row_that_fails_at_the_capacity_is_searched_above_it_even_where_weaker_probes_complete_below():
    """Allocators are not monotonic: the pool without compaction may fail at the capacity yet complete
    below it. The joint search's probes below the capacity must not close that row's bracket there: it
    searches upwards from the capacity (doubling), and its answer completes with one page below failing."""
    from defrag.replay import _ANSWERS, ReplayResult, _pools_without_phases_job

    floor, cap = 31196, 40960
    n_ok = lambda q: 31250 <= q < 40000 or q >= 41000  # noqa: E731
    job = _pools_without_phases_job(None, cap * PAGE, floor * PAGE - 1, page_size=None, series=False,
                                    budget_s=None, mesh=True)
    (spec,) = next(job)
    rescued = ReplayResult(spec[2], "t", cap * PAGE, PAGE, True, "x", 1, search_hint=31254 * PAGE,
                           rescue_steps={"rescues": 1, "meshing": 0})
    (own,) = job.send([rescued])  # defrag's run is the meshing pool's; no compaction replays on its own
    assert own[:3] == ("replay", None, "defrag-no-compaction")
    specs = job.send([ReplayResult("defrag-no-compaction", "t", cap * PAGE, PAGE, True, "x", 1, ooms=1,
                                   rescue_steps={"rescues": 1, "meshing": 0})])
    try:
        while True:
            specs = job.send([{k: v for k, v in {"defrag-mesh": q >= 31224, "defrag": q >= 31242,
                                                 "defrag-no-compaction": n_ok(q)}.items() if k in _ANSWERS[pool]}
                              for pool, q in ((s[2], s[3] // PAGE) for s in specs)])
    except StopIteration as stop:
        rows = {r.allocator: r.min_capacity for r in stop.value}
    assert (rows["defrag-no-compaction"].bytes // PAGE, rows["defrag-no-compaction"].exact) == (41000, True)
    assert rows["defrag-no-compaction"].failed_below // PAGE == 40999
    assert (rows["defrag"].bytes // PAGE, rows["defrag-mesh"].bytes // PAGE) == (31242, 31224)
