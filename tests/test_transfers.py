"""Host <-> device traffic of a decode step (engine.py, module docstring), counted on a CPU. In the
steady state every step makes one device-to-host copy, and a drafting step one host-to-device copy:
its plan's inputs (gain scale, costs, limits) go over before its verification, the next step's draft
made right after it picks rho* with them, and that pick (rho index and gain) crosses back with this
step's tokens; an AR step's tokens alone, with nothing sent. A step whose rows changed drafts afresh:
its inputs go over in one copy (the staging buffer) and its pick comes back in one more. No .item() at all. No torch.tensor() from host lists, outside the graphs or inside (the selector's budget
vectors are constants of a compiled graph; run eagerly, tensors made once per bucket)."""

from __future__ import annotations

import collections
import dataclasses
import time

import pytest
import torch

from minidcut.batch import Batch, Request
from minidcut.cost_model import CostTable
from minidcut.engine import Engine
from minidcut.loader import load_drafter, load_target
from minidcut.policy import Policy
from minidcut.stats import Stats
from tiny import Alternating, make_drafter, make_model

GRID = [0.0, 0.25, 0.5, 0.75, 1.0]


class Probing(Policy):
    """static 0.5, every step planned as a probe (StepPlan.ahead False: no block drafted ahead)."""

    def __init__(self):
        super().__init__("static", [0.5])

    def plan(self, bucket, behind=0, n_live=None, usable=None):
        return dataclasses.replace(super().plan(bucket, behind, n_live, usable), ahead=False)


def tiny_pair(tmp_path):
    """A 2-layer llama target and a 1-layer drafter."""
    hf = make_model(tmp_path / "target", "llama", num_hidden_layers=2)
    make_drafter(tmp_path / "drafter", hf.config, n_layers=1, target_layer_ids=[1])
    target = load_target(tmp_path / "target")
    return target, load_drafter(tmp_path / "drafter", target)


@pytest.mark.parametrize("forced", [0.5, 0.0])
def test_a_steady_step_copies_once_each_way_when_it_drafts_and_once_back_when_it_does_not(tmp_path, monkeypatch,
                                                                                           forced):
    target, drafter = tiny_pair(tmp_path)
    table = CostTable([4], GRID, [[1.0 if r == forced else 1000.0 for r in GRID]])  # dcut picks `forced`
    policy = Policy.dcut(table, GRID, calibrate=False, skip_drafting=forced > 0)
    if forced == 0.0:  # AR steps only: a dcut policy that never drafts
        policy = Policy.ar()
    engine = Engine(target, drafter if forced else None, policy, batch_size=4, max_seq=96, eos_ids=[], compile=False)
    counts, per_step, inside = collections.Counter(), [], []
    real_counted = engine.runner.graphs.counted

    def counted(key, fn):  # mark the time spent inside a graph
        run = real_counted(key, fn)
        return lambda *a: (inside.append(1), run(*a), inside.pop())[1]
    engine.runner.graphs.counted = counted
    for name, owner in (("item", torch.Tensor), ("cpu", torch.Tensor), ("tolist", torch.Tensor)):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda self, *a, _r=real, _n=name, **k: (counts.update([_n]), _r(self, *a, **k))[1])
    real_tensor, real_copy = torch.tensor, torch.Tensor.copy_
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: (counts.update([] if inside else ["tensor"]),
                                                          real_tensor(*a, **k))[1])
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src, *a, **k: (
        counts.update(["h2d"] if src.untyped_storage().data_ptr() == engine.runner.staging.host.untyped_storage().data_ptr() else []), real_copy(self, src, *a, **k))[1])

    def on_step(stats, rec):
        per_step.append((rec.drafted, dict(counts)))
        counts.clear()
    prompts = [[3 + i, 5, 7, 9, 11] for i in range(4)]  # 4 requests at B = 4: one admission, no compaction
    engine.generate(prompts, 40, on_step=on_step)
    steady = per_step[1:-1]  # the first step includes the admission (prefill), the last step its finish
    assert len(steady) > 5
    for drafted, c in steady:
        assert c.get("tensor", 0) == 0  # no host list turned into a tensor
        assert c.get("h2d", 0) == int(drafted) and c.get("item", 0) == 0 and c.get("cpu", 0) == 1
    assert all(d for d, _ in steady) == (forced > 0)
    if forced:  # the first step drafted afresh after the prefill: one copy each, its pick back in one more
        assert per_step[0][1].get("h2d") == 2 and per_step[0][1].get("cpu", 0) >= 2


def test_a_draft_made_ahead_is_dropped_by_a_step_that_does_not_draft(tmp_path):
    """The next step's draft is made by a drafting step; when the next step runs AR instead, that draft
    belongs to positions that have moved on and must never be used later."""
    target, drafter = tiny_pair(tmp_path)
    engine = Engine(target, drafter, Alternating(2), batch_size=2, max_seq=96, eos_ids=[], compile=False)
    fresh = []
    real_draft = engine.runner.run_draft
    engine.runner.run_draft = lambda *a, **k: (fresh.append(1), real_draft(*a, **k))[1]
    prompts = [[3, 5, 7], [4, 6, 8, 10]]
    out, stats = engine.generate(prompts, 20)
    ar, _ = Engine(target, None, Policy.ar(), batch_size=2, max_seq=96, eos_ids=[], compile=False).generate(prompts, 20)
    assert out == ar
    assert len(fresh) == sum(stats.drafting_hist.values())  # every drafting step drafted afresh


def test_a_probe_drafts_no_block_ahead(tmp_path):
    """A probe's plan says ahead=False: the step after a probe likely runs AR, so it drafts only its own
    block (its cost is then the cost table's: one draft and one verification). Every drafting step then
    drafts afresh, the draft graph runs once per drafting step, and the tokens are still AR's."""
    target, drafter = tiny_pair(tmp_path)
    prompts = [[3, 5, 7], [4, 6, 8, 10]]
    runs = {}
    for name, policy in (("probing", Probing()), ("drafting", Policy.static(0.5))):
        engine = Engine(target, drafter, policy, batch_size=2, max_seq=96, eos_ids=[], compile=False)
        out, stats = engine.generate(prompts, 20)
        runs[name] = (out, stats.steps, sum(n for k, n in engine.runner.graphs.calls.items() if k[0] == "draft"))
    ar, _ = Engine(target, None, Policy.ar(), batch_size=2, max_seq=96, eos_ids=[], compile=False).generate(prompts, 20)
    out, steps, drafts = runs["probing"]
    assert out == ar and drafts == steps
    out, steps, drafts = runs["drafting"]
    assert out == ar and drafts > steps  # drafting steps draft ahead (the last one's draft goes unused)


def test_a_steps_seconds_hold_one_draft_as_a_cost_table_entry_does(tmp_path, monkeypatch):
    """A fresh draft that also drafts ahead runs the draft graph twice; its record's seconds (which
    refine the cost table) leave the first out, and its redraft holds it (the skip controller charges
    it to drafting). A probe drafts afresh and not ahead: its one draft is in its seconds. On a clock
    that moves only while a fresh draft runs (10 s each)."""
    target, drafter = tiny_pair(tmp_path)
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    first = {}
    for name, policy in (("drafting", Policy.static(0.5)), ("probing", Probing())):
        engine = Engine(target, drafter, policy, batch_size=2, max_seq=96, eos_ids=[], compile=False)
        real = engine.runner.run_draft
        monkeypatch.setattr(engine.runner, "run_draft", lambda *a, _r=real: (now.__setitem__(0, now[0] + 10.0), _r(*a))[1])
        records = []
        engine.generate([[3, 5, 7], [4, 6, 8, 10]], 8, on_step=lambda stats, rec: records.append(rec))
        first[name] = records[0].seconds, records[0].redraft  # the first step drafts afresh
    assert first["drafting"] == (0.0, 10.0)  # the fresh draft: charged apart
    assert first["probing"] == (10.0, 0.0)


def test_every_step_sends_its_host_inputs_in_one_copy(tmp_path, monkeypatch):
    """Steps that are not steady ones too: admissions while others decode (the prefill is one copy each
    way of its own), compactions at a batch's tail, catch-ups of the drafter's context after AR steps
    and fresh drafts. Each sends all its host inputs in one copy from the staging buffer; nothing else
    reaches the device from a host list; one copy back, two when a fresh draft syncs on its pick."""
    target, drafter = tiny_pair(tmp_path)
    engine = Engine(target, drafter, Alternating(3), batch_size=4, max_seq=128, eos_ids=[], compile=False)
    counts, per_step, inside, seen = collections.Counter(), [], [], collections.Counter()
    real_counted = engine.runner.graphs.counted

    def counted(key, fn):
        run = real_counted(key, fn)
        return lambda *a: (inside.append(1), run(*a), inside.pop())[1]
    engine.runner.graphs.counted = counted
    for name in ("prefill", "move_rows", "catch_up", "run_draft"):
        real = getattr(engine.runner, name)
        setattr(engine.runner, name, lambda *a, _r=real, _n=name, **k: (seen.update([_n]), counts.update([_n]), _r(*a, **k))[2])
    for name in ("item", "cpu"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _r=real, _n=name, **k: (counts.update([_n]), _r(self, *a, **k))[1])
    real_tensor, real_copy, real_to = torch.tensor, torch.Tensor.copy_, torch.Tensor.to
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: (counts.update(["to device"] if k.get("device") is not None and not inside else []),
                                                          real_tensor(*a, **k))[1])
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: (counts.update(["to device"] if not inside and (
        k.get("device") is not None or any(isinstance(x, (str, torch.device)) for x in a)) else []), real_to(self, *a, **k))[1])
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src, *a, **k: (
        counts.update(["h2d"] if src.untyped_storage().data_ptr() == engine.runner.staging.host.untyped_storage().data_ptr() else []), real_copy(self, src, *a, **k))[1])

    prompts = [[3 + i, 5, 7, 9, 11][: 2 + i % 4] for i in range(7)]
    lengths = [12, 30, 20, 44, 16, 26, 36]  # finishing at different steps: rows free while others decode
    requests = [Request(i, p, n) for i, (p, n) in enumerate(zip(prompts, lengths))]
    pending, batch, stats = collections.deque(requests), Batch.empty(4, engine.device), Stats()
    with torch.inference_mode():
        while pending or batch.live:
            counts.clear()
            engine.step(batch, pending, stats)
            per_step.append(dict(counts))
    # 7 requests on 4 rows: admissions mid-run; the tail compacts; AR steps make drafting catch up
    assert seen["prefill"] > 1 and seen["move_rows"] >= 1 and seen["catch_up"] >= 1 and seen["run_draft"] >= 1
    for c in per_step:
        assert c.get("to device", 0) == 0 and c.get("item", 0) == 0
        assert c.get("h2d", 0) <= 1 + c.get("prefill", 0)
        assert c.get("cpu", 0) <= 1 + c.get("run_draft", 0)
    ar = Engine(target, None, Policy.ar(), batch_size=4, max_seq=128, eos_ids=[], compile=False)
    assert [r.output for r in requests] == [ar.generate([p], n)[0][0] for p, n in zip(prompts, lengths)]


def test_a_draft_made_ahead_picks_rho_with_the_policys_latest_plan(tmp_path):
    """Calibration moves the gain scale every step and CostTable.refine the costs: the draft a step makes
    ahead (for the next step) must choose rho* with that step's plan, not with the inputs of the last
    fresh draft (a one-step lag at most). Checked on the device inputs each draft graph call reads."""
    target, drafter = tiny_pair(tmp_path)
    table = CostTable([1, 2, 4], GRID, [[1.0, 1.1, 1.2, 1.3, 1.4]] * 3)
    policy = Policy.dcut(table, GRID, skip_drafting=False)
    engine = Engine(target, drafter, policy, batch_size=4, max_seq=96, eos_ids=[], compile=False)
    plans, read = [], []
    real_plan = policy.plan
    policy.plan = lambda *a, **k: (plans.append(real_plan(*a, **k)), plans[-1])[1]
    real_graph = engine.runner.graphs.get

    def graph(kind, b, *a, **k):
        fn = real_graph(kind, b, *a, **k)
        if kind != "draft":
            return fn
        n_rho = len(GRID)
        return lambda anchor, pos, inputs, *rest: (read.append((len(plans), inputs[b + 1].item(),
                                                                 inputs[b + 2: b + 2 + n_rho].tolist())),
                                                   fn(anchor, pos, inputs, *rest))[1]
    engine.runner.graphs.get = graph
    engine.generate([[3, 5, 7, 9, 11], [4, 6, 8, 10, 12]], 48)
    assert len(read) > 6 and len({(g, tuple(c)) for _, g, c in read}) > 2  # the plans moved
    for n_plans, gain_scale, cost in read:
        plan = plans[n_plans - 1]  # the latest plan when the draft ran
        assert gain_scale == pytest.approx(plan.gain_scale, rel=1e-6)
        assert cost == pytest.approx(plan.cost, rel=1e-6)


def test_the_draft_made_ahead_counts_as_drafting_in_the_stats(tmp_path, monkeypatch):
    """The next block is drafted inside verify(): its seconds go to stats.seconds['draft'], not 'verify'.
    On a clock that only a draft moves (1 s each), every second is drafting's."""
    target, drafter = tiny_pair(tmp_path)
    engine = Engine(target, drafter, Policy.static(0.5), batch_size=2, max_seq=96, eos_ids=[], compile=False)
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])

    def tick(fn):
        def draft(*x):
            now[0] += 1.0
            return fn(*x)
        return draft
    real_graph = engine.runner.graphs.get
    monkeypatch.setattr(engine.runner.graphs, "get", lambda kind, *a, **k: (
        tick(real_graph(kind, *a, **k)) if kind == "draft" else real_graph(kind, *a, **k)))
    _, stats = engine.generate([[3, 5, 7], [4, 6, 8, 10]], 24)
    drafts = sum(stats.drafting_hist.values())  # every drafting step ran a draft (ahead or fresh), some a
    #                                              second (a fresh one after its rows changed)
    assert drafts > 3 and stats.seconds["draft"] >= drafts and stats.seconds["verify"] == 0


def test_the_drafters_prompt_context_is_charged_to_the_next_drafting_step(tmp_path, monkeypatch):
    """A prefill where drafting is on writes the drafter's context of the prompts: work an AR run never
    does. Its seconds go to the next drafting step's record (StepRecord.prompt_context), once. On a
    clock that moves only while the drafter writes context (1 s a call)."""
    target, drafter = tiny_pair(tmp_path)
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    real = drafter.add_context
    monkeypatch.setattr(drafter, "add_context", lambda *a, **k: (now.__setitem__(0, now[0] + 1.0), real(*a, **k))[1])
    engine = Engine(target, drafter, Policy.static(0.5), batch_size=2, max_seq=96, eos_ids=[], compile=False)
    records = []
    engine.generate([[3, 5, 7], [4, 6, 8, 10], [5, 7, 9]], 12, on_step=lambda stats, rec: records.append(rec))
    charged = [r.prompt_context for r in records]
    assert charged[0] == 1.0 and charged.count(1.0) == 2 and sum(charged) == 2.0  # two prefills, two charges


def test_an_eager_draft_builds_no_tensor_from_host_lists_inside_the_graphs_either(tmp_path, monkeypatch):
    """Run eagerly, the selector's budget vectors are made once per bucket (Graphs.budget_tensor), not
    per draft: on a GPU each would be a host-to-device copy."""
    target, drafter = tiny_pair(tmp_path)
    table = CostTable([4], GRID, [[1.0 if r == 0.5 else 1000.0 for r in GRID]])
    engine = Engine(target, drafter, Policy.dcut(table, GRID, calibrate=False, skip_drafting=False), batch_size=4,
                    max_seq=96, eos_ids=[], compile=False)
    made, per_step, real_tensor = [], [], torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: (made.append(a), real_tensor(*a, **k))[1])
    engine.generate([[3 + i, 5, 7, 9, 11] for i in range(4)], 40,
                    on_step=lambda stats, rec: (per_step.append((rec.drafted, len(made))), made.clear()))
    steady = per_step[1:-1]
    assert len(steady) > 5 and all(drafted for drafted, _ in steady)
    assert all(n == 0 for _, n in steady)
