"""Host <-> device traffic of a decode step (engine.py, module docstring), counted on a CPU. In the
steady state every step makes one device-to-host copy, and a drafting step one host-to-device copy:
its plan's inputs (live rows, gain scale, costs) go over before its verification, the next step's draft
made right after it picks rho* with them, and that pick (rho index and gain) crosses back with this
step's tokens; an AR step's tokens alone, with nothing sent. A step whose rows changed drafts afresh:
its inputs go over in one copy (the staging buffer) and its pick comes back in one more. Counted
by tests/crossings.py: every conversion of a device tensor to Python or to the host, and every host
tensor or list that reaches the device, inside the graphs too (the selector's budget vectors are
constants of a compiled graph; run eagerly, tensors made once per bucket)."""

from __future__ import annotations

import collections
import dataclasses
import time

import pytest
import torch

from minidcut.batch import Batch, Request
from minidcut.cost_model import CostTable
from minidcut.engine import Engine
from minidcut.graphs import DraftInputs
from minidcut.loader import load_drafter, load_target
from minidcut.policy import Policy
from minidcut.stats import Stats
from crossings import Crossings
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


def test_the_crossing_counter_sees_every_kind_of_crossing():
    """tests/crossings.py itself: conversions of device tensors count, host tensors' do not; a host
    tensor or list meeting a device tensor counts as a copy to the device."""
    dev = torch.zeros(4, device="cpu")  # made before counting: a device tensor
    staging = torch.zeros(4)
    with Crossings(host=[staging]) as c:
        host = torch.arange(4)  # no device named: the host's
        host.tolist(), int(host[0]), (host + 1).sum().item()  # host work: nothing crosses
        assert not c.d2h and not c.h2d
        dev.tolist(), int(dev[0]), bool(dev.sum() > 0), dev[1:].cpu(), dev.numpy()
        assert sum(c.d2h.values()) == 5
        dev[host] = 1.0  # a host index
        dev[[0, 1]] = 2.0  # a Python list as an index
        dev.copy_(staging)  # the staging buffer's one copy
        dev + host  # a host operand
        torch.tensor([1, 2], device="cpu")
        assert sum(c.h2d.values()) == 5 and sum(c.d2h.values()) == 5


def count_per_step(engine, prompts, lengths, calls=("prefill", "run_draft")):
    """Run the engine step by step under a Crossings counter; [(record, d2h, h2d, runner calls)] per
    step, the tokens checked against AR's. After every step the device's per-row state (anchor, its
    position, its last position, the sampling key) is what the host's requests say: the host owns the tokens, the device
    holds a copy the graphs advance (batch.Batch)."""
    target = engine.target
    requests = [Request(i, p, n) for i, (p, n) in enumerate(zip(prompts, lengths))]
    pending, batch, stats, per_step = collections.deque(requests), Batch.empty(engine.batch_size, engine.device), Stats(), []
    seen = collections.Counter()
    for name in calls:
        real = getattr(engine.runner, name)
        setattr(engine.runner, name, lambda *a, _r=real, _n=name, **k: (seen.update([_n]), _r(*a, **k))[1])
    with torch.inference_mode(), Crossings(host=[engine.runner.staging.host]) as c:
        while pending or batch.live:
            seen.clear(), c.d2h.clear(), c.h2d.clear()
            rec = engine.step(batch, pending, stats)
            per_step.append((rec, sum(c.d2h.values()), sum(c.h2d.values()), dict(seen)))
            held = [(int(batch.anchor[i]), int(batch.anchor_pos[i]), int(batch.last[i]), int(batch.request_ids[i]))
                    for i in batch.live]
            assert held == [((r.prompt + r.output)[-1], r.anchor_pos, r.last_pos, r.index)  # (read after the count)
                            for r in (batch.requests[i] for i in batch.live)]
    ar = Engine(target, None, Policy.ar(), batch_size=engine.batch_size, max_seq=engine.max_seq, eos_ids=[], compile=False)
    assert [r.output for r in requests] == [ar.generate([p], n)[0][0] for p, n in zip(prompts, lengths)]
    return per_step


@pytest.mark.parametrize("forced", [0.5, 0.0])
def test_a_steady_step_crosses_once_each_way_when_it_drafts_and_once_back_when_it_does_not(tmp_path, forced):
    """Every crossing counted (tests/crossings.py: conversions of device tensors to Python or to the
    host, host tensors and lists reaching the device, inside the graphs too). In the steady state
    (4 requests at B = 4: one admission, no compaction) a drafting step crosses once each way and an
    AR step once back. The first step also admits (the prefill: one copy each way) and drafts afresh
    (its pick comes back in one more; eager, the bucket's budget vector goes over, once per bucket)."""
    target, drafter = tiny_pair(tmp_path)
    table = CostTable([4], GRID, [[1.0 if r == forced else 1000.0 for r in GRID]])  # dcut picks `forced`
    policy = Policy.dcut(table, GRID, calibrate=False, skip_drafting=False) if forced else Policy.ar()
    engine = Engine(target, drafter if forced else None, policy, batch_size=4, max_seq=96, eos_ids=[], compile=False)
    per_step = count_per_step(engine, [[3 + i, 5, 7, 9, 11] for i in range(4)], [40] * 4)
    steady = per_step[1:-1]  # the last step includes its finish
    assert len(steady) > 5 and all(rec.drafted == (forced > 0) for rec, *_ in steady)
    assert all((d2h, h2d) == (1, int(forced > 0)) for _, d2h, h2d, _ in steady)
    first = per_step[0][1:3]
    assert first == ((3, 3) if forced else (2, 1))


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


def test_every_step_crosses_once_each_way_plus_its_prefill_and_fresh_draft(tmp_path):
    """Steps that are not steady ones too: admissions while others decode (the prefill is one copy each
    way of its own), compactions at a batch's tail, catch-ups of the drafter's context after AR steps
    and fresh drafts. Each sends all its host inputs in one copy; one copy back, one more for a
    prefill and for a fresh draft's pick. Eager, a bucket's first draft also sends its budget vector."""
    target, drafter = tiny_pair(tmp_path)
    engine = Engine(target, drafter, Alternating(3), batch_size=4, max_seq=128, eos_ids=[], compile=False)
    prompts = [[3 + i, 5, 7, 9, 11][: 2 + i % 4] for i in range(7)]
    lengths = [12, 40, 20, 24, 16, 30, 50]  # finishing at different steps: rows free while others decode, and
    #                                          moved rows decode on (two compactions)
    per_step = count_per_step(engine, prompts, lengths, calls=("prefill", "move_rows", "catch_up", "run_draft"))
    seen, buckets = collections.Counter(), set()
    for rec, d2h, h2d, calls in per_step:
        seen.update(calls)
        first_draft = "run_draft" in calls and rec.bucket not in buckets
        buckets |= {rec.bucket} if first_draft else set()
        assert h2d <= 1 + calls.get("prefill", 0) + first_draft
        assert d2h <= 1 + calls.get("prefill", 0) + calls.get("run_draft", 0)
    # 7 requests on 4 rows: admissions mid-run; the tail compacts; AR steps make drafting catch up
    assert seen["prefill"] > 1 and seen["move_rows"] >= 1 and seen["catch_up"] >= 1 and seen["run_draft"] >= 1


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
        def draft(anchor, pos, last, inputs, *rest):
            _, gain_scale, cost = DraftInputs.unpack(inputs, b)
            read.append((len(plans), gain_scale.item(), cost.tolist()))
            return fn(anchor, pos, last, inputs, *rest)
        return draft
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
