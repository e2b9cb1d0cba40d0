"""The skip rule (minidcut/skipping.py; docs/method.md, "Skipping drafting") by what it does: drafting
stays on where it wins, goes off where it loses, comes back when the workload changes, and probing
costs a bounded share of a run where drafting never pays; the facts it never drafts against; saved
states, the earlier rule's included; and what the engine tells it each step."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from minidcut.cost_model import CostTable
from minidcut.engine import Engine
from minidcut.loader import load_drafter, load_target
from minidcut.policy import Policy, StepRecord
from minidcut.skipping import CONFIDENCE, MAX_BACKOFF, PROBE_SHARE, SkipDrafting
from minidcut.stats import DecayedScores, t_quantile
from tiny import make_drafter, make_model

RHOS = [0.0, 0.25, 0.5, 0.75, 1.0]
B4 = [1.0, 3.0, 3.2, 3.4, 3.6]  # B = 4: a drafting step costs 3-3.6 AR steps; break-even 2 accepted a row
B16 = [1.0, 1.6, 2.2, 2.8, 3.4]  # B = 16, a dense target on a compute-bound machine


def controller(B, row, **kw):
    return SkipDrafting(B, RHOS, CostTable([B], RHOS, [row]), **kw)


def drafting(B, accepted, rho=0.25, n_live=None, **kw):
    """A StepRecord of a drafting step that accepted `accepted` drafts over its rows."""
    return StepRecord(bucket=B, n_live=n_live or B, drafted=True, rho=rho, accepted=accepted, **kw)


def ar_step(B):
    return StepRecord(bucket=B, n_live=B, drafted=False)


def run(s, steps, accepted, admitted=None):
    """`steps` steps of the rule's own choosing: accepted(i) drafts at step i when it drafts (admitted(i)
    requests admitted before it). Returns which steps drafted."""
    drafted = []
    for i in range(steps):
        d = s.draft_now()
        drafted.append(d)
        s.observe(drafting(s.B, accepted(i), admitted=admitted(i) if admitted else 0) if d else ar_step(s.B))
    return drafted


# ---- what the rule does ---------------------------------------------------------------------------

def test_drafting_stays_on_where_it_wins_even_after_poor_first_steps():
    """B = 4: drafting wins with 4 accepted a row (+1.6 AR-step tokens a row a step at rho = 0.25). The
    first steps of a run accept 1.5 a row on average (fresh prompts, a noisy clock): four such steps are
    no evidence at 90 %; drafting runs on every step of 300. Eight are: drafting goes off, and two
    winning probes bring it back within 150 steps (probes are cheap where drafting usually commits
    much). Noise on every step (0 to 8 a row, 4 on average) keeps it on."""
    s = controller(4, B4)
    assert all(run(s, 300, lambda i: [2, 10, 4, 8][i] if i < 4 else 16))
    first = [2, 10, 4, 8, 2, 6, 4, 8]
    s = controller(4, B4)
    drafted = run(s, 300, lambda i: first[i] if i < len(first) else 16)
    off = [i for i, d in enumerate(drafted) if not d]
    assert s.state == "drafting" and 4 <= off[0] <= 8 and len(off) < 150 and s.drafting_steps > 150
    rng = random.Random(0)
    s = controller(4, B4)
    assert all(run(s, 300, lambda i: rng.choice([0, 8, 16, 24, 32])))


def test_drafting_goes_off_where_it_loses_and_stays_off_but_for_probes():
    """B = 16: drafting steps that accept 4 drafts over 16 rows lose 0.35 tokens a row to AR steps. Off
    within a few steps; over 2,000 steps it drafts on under 2 % of them."""
    s = controller(16, B16)
    drafted = run(s, 2000, lambda i: 4)
    assert drafted.index(False) <= 6 and sum(drafted) / len(drafted) < 0.02 and s.state == "off"


def test_a_losing_stretch_after_a_winning_one_switches_drafting_off_and_a_dip_does_not():
    """B = 16, rho = 0.5 (2.2 AR steps) pays above 19.2 accepted drafts a step. After ten steps at 30, a
    lasting stretch at 10 switches drafting off, but not on its first steps: the good ones still weigh."""
    s = controller(16, B16, patience=3)
    for _ in range(10):
        assert s.draft_now()
        s.observe(drafting(16, 30, rho=0.5))
    losing = 0
    while s.draft_now():
        s.observe(drafting(16, 10, rho=0.5))
        losing += 1
        assert losing < 30
    assert losing > 3


def test_drafting_comes_back_when_the_workload_changes():
    """B = 16: drafting loses (4 accepted a step) and goes off; then the prompts change and every draft
    step accepts 60 (+2.1 tokens a row): the probes turn drafting back on within four of them, and it
    stays on. Where drafting still loses, probes never turn it on, and each losing one doubles the wait
    (at most 64x)."""
    s = controller(16, B16)
    run(s, 200, lambda i: 4)
    assert s.state == "off"
    probes, steps = 0, 0
    while s.state == "off":
        if s.draft_now():
            s.observe(drafting(16, 60))
            probes += 1
        else:
            s.observe(ar_step(16))
        steps += 1
    assert 2 <= probes <= 4 and s.failed_probes == 0
    assert all(run(s, 200, lambda i: 60))
    lose = controller(16, B16)
    drafted = run(lose, 3000, lambda i: 4)
    probes_at = [i for i, d in enumerate(drafted) if d and i > drafted.index(False)]
    gaps = [b - a for a, b in zip(probes_at, probes_at[1:])]
    assert lose.state == "off" and lose.failed_probes == len(probes_at)
    assert len(gaps) >= 2 and all(g2 == 2 * g1 for g1, g2 in zip(gaps, gaps[1:]))
    lose.failed_probes = 20
    assert lose.probe_period() == (gaps[0] >> 1) << MAX_BACKOFF  # at most 64x


def test_one_lucky_probe_does_not_turn_drafting_on_and_a_winning_one_does_not_back_off():
    """Off at B = 16 (4 accepted a step); one probe that wins by luck (60 accepted) is one sample, no
    evidence at 90 %: drafting stays off, and the wait does not double; a losing probe after it
    doubles it; two more winning probes in a row turn drafting on."""
    s = controller(16, B16)
    run(s, 20, lambda i: 4)
    assert s.state == "off" and s.failed_probes == 0

    def probe(accepted):
        while not s.draft_now():
            s.observe(ar_step(16))
        s.observe(drafting(16, accepted))
        return s.state, s.failed_probes
    assert probe(60) == ("off", 0)
    assert probe(4) == ("off", 1)
    assert probe(60)[0] == "off" and probe(60) == ("drafting", 0)


def test_where_drafting_never_pays_probing_costs_at_most_its_share_of_the_room_to_win():
    """Drafting steps that accept nothing at B = 16 and 64: over 5,000 steps the probes' extra seconds
    over AR steps stay within PROBE_SHARE of the (1 - 1 / room) drafting could save at best, plus the
    first steps before drafting went off."""
    for B, row in [(16, B16), (64, [1.0, 2.5, 4.0, 5.5, 7.0])]:
        s = controller(B, row)
        cost = dict(zip(RHOS, row))
        extra = 0.0
        for _ in range(5000):
            if s.draft_now():
                extra += cost[1.0] - cost[0.0]  # the rule may pick the dearest budget: priced so
                s.observe(drafting(B, 0, rho=1.0))
            else:
                s.observe(ar_step(B))
        assert s.state == "off" and s.drafting_steps > s.patience
        assert extra / 5000 <= PROBE_SHARE * (1 - 1 / s.room(cost)) + s.patience * cost[1.0] / 5000


def test_a_probe_waits_longer_for_more_catch_up_and_less_where_more_can_be_won():
    """A probe's price is its dearest step over an AR step plus the catch-up it writes (per position, as
    last measured); each AR step earns PROBE_SHARE of the share of time drafting could save at best."""
    s = controller(64, [1.0, 8.0, 9.0, 10.0, 11.0])
    room = s.room(s.cost)
    assert room == pytest.approx(1024 / 11 / 64)
    s.observe(drafting(64, 0, catchup=2.0, caught_up=400))  # 0.005 AR steps a position
    wait = [s.probe_period(behind=b) for b in (0, 800)]
    assert wait == [int(p / (PROBE_SHARE * (1 - 1 / room))) + 1 for p in (10.0, 14.0)]
    wide = controller(16, [1.0, 1.2, 1.4, 1.6, 6.0])  # same dearest step, far more room to win
    narrow = controller(16, [1.0, 5.6, 5.8, 5.9, 6.0])
    assert wide.probe_period() < narrow.probe_period()
    assert controller(1, [1.0, 1.02, 1.04, 1.06, 1.08]).probe_period() == 16  # cheap probes: the shortest wait


def test_one_hard_request_cannot_switch_drafting_off_at_b_1():
    """Blocks of one request are not independent samples: at B = 1 twenty poor blocks of the first
    request keep drafting on; the second request's poor blocks switch it off."""
    s = controller(1, [1.0, 1.3, 1.4, 1.5, 1.6])
    drafted = run(s, 20, lambda i: 0, admitted=lambda i: int(i == 0))
    assert all(drafted) and s.requests == 1
    run(s, 5, lambda i: 0, admitted=lambda i: int(i == 0))
    assert s.state == "off"


def test_what_drafting_pays_around_a_step_counts_against_it_at_its_mean():
    """A draft made afresh (rows changed hands) and the drafter's context of admitted prompts are
    drafting's cost, in AR steps: charged at their mean over the same steps, so one lump moves the mean
    but does not widen the doubt. B = 16: steps at +0.4 tokens a row, every fourth with a 2-AR-step
    lump (a -0.1 mean): charged at its mean drafting goes off within 40 steps; as noise in the scores
    it would stay on longer than a hundred."""
    s = controller(16, B16)
    steady = drafting(16, 16)
    lumpy = dataclasses.replace(steady, redraft=0.5, prompt_context=1.5)
    assert s.score(steady) == pytest.approx((1 + 1 - 1.6, 0.0)) and s.score(lumpy) == pytest.approx((0.4, 2.0))
    assert s.score(drafting(16, 16, n_live=8))[0] == pytest.approx((1 + 2 - 1.6) / 2)  # a tail: its share of rows
    steps = 0
    while s.draft_now():
        s.observe(dataclasses.replace(lumpy if steps % 4 == 0 else steady, admitted=int(steps % 4 == 0)))
        steps += 1
    assert steps < 40
    noise = DecayedScores(0.98)
    for i in range(100):
        noise.add(0.4 - (2.0 if i % 4 == 0 else 0.0))
    assert noise.mean + noise.margin(CONFIDENCE) > 0  # the same steps with lumps as noise: not sure


# ---- facts, not estimates --------------------------------------------------------------------------

def test_never_drafts_where_even_full_acceptance_cannot_beat_ar_nor_on_rows_at_their_end():
    hopeless = controller(64, [1.0, 20.0, 21.0, 22.0, 23.0])
    assert not hopeless.possible and not any(hopeless.draft_now() for _ in range(100))
    s = controller(4, B4, patience=2)
    assert s.draft_now(n_live=3, usable=15) and not s.draft_now(n_live=3, usable=2)
    before = s.state_dict
    for _ in range(10):  # rows with nothing left to draft, and the profiler's timed steps: no evidence
        s.observe(drafting(4, 0, n_live=3, usable=0))
        s.observe(drafting(4, 0, timed=True))
    assert s.state_dict == before
    p = Policy.dcut(CostTable([4], RHOS, [B4]), RHOS)
    assert p.plan(4).draft and not p.plan(4, n_live=3, usable=0).draft and not p.plan(8).draft  # 8: no row


def test_the_bound_is_students_t_on_the_weighted_scores():
    for p, df, exact in [(0.9, 2, 1.886), (0.9, 3, 1.638), (0.9, 10, 1.372), (0.95, 10, 1.812)]:
        assert t_quantile(p, df) == pytest.approx(exact, rel=0.005)
    e = DecayedScores(0.98)
    assert e.margin(CONFIDENCE) == float("inf")
    xs = [1.0, -1.0, 1.0, -1.0]
    for x in xs:
        e.add(x)
    w = [0.98 ** 3, 0.98 ** 2, 0.98, 1.0]
    n = sum(w) ** 2 / sum(x * x for x in w)
    mean = sum(wi * x for wi, x in zip(w, xs)) / sum(w)
    var = (1 - mean ** 2) * n / (n - 1)
    assert e.n == pytest.approx(n) and e.mean == pytest.approx(mean)
    assert e.margin(CONFIDENCE) == pytest.approx(t_quantile(CONFIDENCE, n - 1) * (var / n) ** 0.5)


# ---- saved states ---------------------------------------------------------------------------------

def test_a_state_saved_by_the_earlier_rule_loads_as_drafting_or_off_with_fresh_scores():
    """Tables saved before this rule hold its predecessor's skip state (decayed evidence, lumps, probes,
    a "probing" state): it loads, probing as off, and what it learned is dropped but for the failed
    probes and the catch-up's price. The saved and loaded round trip is test_policy's."""
    earlier = {"state": "probing", "evidence": [3.0, -1.0, 1.0, 2.0], "drafting_steps": 9, "skipped": 0,
               "catchup_per_position": 0.001, "accepted": [1.0, 2.0], "failed_probes": 2, "lumps": [0.0] * 4,
               "requests": 3, "latest": 4, "probes": [0.0] * 4, "probe_lumps": [0.0] * 4}
    p = Policy.dcut(CostTable([16], RHOS, [B16]), RHOS)
    p.load_state({"calibration": p.state["calibration"], "skipping": {"16": earlier}})
    s = p.skipping[16]
    assert s.state == "off" and s.scores.n == 0 and s.failed_probes == 2 and s.catchup_per_position == 0.001
    assert s.accepted.ratio() == 0.5  # what drafting usually commits, as the earlier rule kept it
    p.load_state({"calibration": p.state["calibration"], "skipping": {"16": dict(earlier, state="drafting")}})
    assert p.skipping[16].state == "drafting" and p.plan(16).draft


# ---- the engine's wiring --------------------------------------------------------------------------

@torch.inference_mode()
def test_the_engine_tells_the_rule_each_steps_rows_admissions_and_drafting_costs(tmp_path):
    """Through Engine.step: five requests on two rows. Every request's admission reaches the rule once;
    a drafting step right after an admission carries the prompt's drafter context, and a step whose rows
    changed while drafting ahead its fresh draft; n_live and usable are the batch's. Drafting priced at
    ten AR steps (a random drafter accepts little) loses: the rule switches it off."""
    hf = make_model(tmp_path / "target", "llama", num_hidden_layers=2)
    make_drafter(tmp_path / "drafter", hf.config, n_layers=1, target_layer_ids=[0, 1])
    target = load_target(tmp_path / "target")
    drafter = load_drafter(tmp_path / "drafter", target)
    table = CostTable([1, 2], [0.0, 0.5, 1.0], [[1e-4, 1e-4, 1.5e-4], [1e-4, 1e-4, 1.5e-4]])
    policy = Policy.dcut(table, [0.0, 0.5, 1.0], patience=2, calibrate=False)
    seen = []
    observe = policy.observe
    policy.observe = lambda rec: (seen.append(rec), observe(rec))
    engine = Engine(target, drafter, policy, batch_size=2, max_seq=96, eos_ids=[], compile=False)
    lengths = [6, 20, 9, 14, 7]
    engine.generate([[3, 4, 5], [6, 7], [8, 9, 10, 11], [12], [13, 14]], lengths)
    assert sum(r.admitted for r in seen) == 5 and all(r.n_live <= r.bucket for r in seen)
    assert all(r.prompt_context > 0 for r in seen if r.drafted and r.admitted)
    assert any(r.redraft > 0 for r in seen if r.drafted)
    assert all(r.usable <= r.n_live * engine.D for r in seen)
    table.seconds[1] = [1e-4, 1e-3, 1.5e-3]  # drafting at 10x an AR step: it cannot pay
    seen.clear()
    engine.generate([[3, 4, 5], [6, 7]], 40)
    assert policy.skipping[2].state == "off" and not seen[-1].drafted
