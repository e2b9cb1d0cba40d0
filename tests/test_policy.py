"""The policy (docs/method.md, "Choosing rho", "Calibration", "Skipping drafting"): the paper's rule as
the engine composes it, the calibration and the skip-drafting controller, each on its own."""

import dataclasses
import json

import pytest
import torch

from minidcut import dcut
from minidcut.calibration import Calibration
from minidcut.cost_model import CostTable
from minidcut.engine import Engine
from minidcut.loader import load_target
from minidcut.policy import Policy, StepRecord
from minidcut.skipping import CONFIDENCE, PROBE_SHARE, Evidence, SkipDrafting, t_quantile
from tiny import make_model

RHOS = [0.0, 0.25, 0.5, 0.75, 1.0]


def steep_table():
    """Dense target on a compute-bound machine: verify cost grows with the verified token count."""
    return CostTable([16, 64], RHOS, [[1.0, 1.6, 2.2, 2.8, 3.4], [1.0, 2.5, 4.0, 5.5, 7.0]])


def flat_table():
    """MoE-like: nearly flat in rho (the paper's profile of an MoE target: 80 / 85 / 86 / 91 ms)."""
    return CostTable([16, 64], RHOS, [[1.0, 1.10, 1.12, 1.14, 1.16], [1.0, 1.06, 1.08, 1.09, 1.14]])


def skip(table, B, **kw):
    """A skip controller of batch size B over the table's row."""
    return SkipDrafting(B, RHOS, table, **kw)


def drafting(B, rho, predicted, accepted=None, n_live=None, seconds=0.0, catchup=0.0, caught_up=0, usable=None):
    """A StepRecord of a drafting step."""
    return StepRecord(bucket=B, n_live=n_live or B, drafted=True, rho=rho, predicted=predicted,
                      accepted=int(predicted) if accepted is None else accepted, seconds=seconds, catchup=catchup,
                      caught_up=caught_up, usable=usable)


def ar_step(B, seconds=0.0, n_live=None):
    return StepRecord(bucket=B, n_live=n_live or B, drafted=False, seconds=seconds)


def period(price, room, floor=16):
    """The probe period the docs state: a probe's price in AR steps over what each AR step earns,
    PROBE_SHARE of the (1 - 1 / room) of an AR step drafting could save at best; at least the floor."""
    return max(floor, int(price / (PROBE_SHARE * (1 - 1 / room))) + 1)


# ---- the paper's rule, as the engine composes it ---------------------------------------------------

class FixedDrafter(torch.nn.Module):
    """A stand-in drafter whose every draft has confidence `conf` (its token: 1)."""

    block_size, taps = 16, ()

    def __init__(self, conf: float, vocab: int):
        super().__init__()
        self.conf, self.vocab = conf, vocab

    def setup_cache(self, rows, max_seq):
        pass

    def add_context(self, *args, **kw):
        pass

    def tokens(self, idx):
        return idx

    def forward(self, target, anchor, anchor_pos, span=None):
        probs = torch.full((anchor.shape[0], self.block_size - 1, self.vocab), (1 - self.conf) / (self.vocab - 1))
        probs[..., 1] = self.conf
        return probs.log()  # [B, D, V]


@pytest.mark.parametrize("gain, expected", [("committed", 0.25), ("accepted", 0.5)])
def test_rho_star_as_the_engine_composes_it(tmp_path, gain, expected):
    """B = 2, every confidence 0.7, calibrated gain scale 0.5, costs 1.6 / 1.8 / 2.4 / 3.0 for rho =
    0.25 .. 1 (rho = 0 priced as a drafting step). Expected committed tokens per second, 0.5 * gain + 2
    anchors, is highest at rho = 0.25; without the anchors (the paper's gain) at rho = 0.5. Dropping the
    calibration scale (gain + anchors) would choose 0.5 as well: this pins the composition."""
    make_model(tmp_path, "llama", num_hidden_layers=1)
    target = load_target(tmp_path)
    table = CostTable([2], RHOS, [[1.0, 1.6, 1.8, 2.4, 3.0]])
    policy = Policy.dcut(table, RHOS, count_anchors=gain == "committed")
    engine = Engine(target, FixedDrafter(0.7, target.cfg.vocab_size), policy, batch_size=2, max_seq=64,
                    compile=False)
    policy.calibration.gain_scale = 0.5
    z = torch.zeros(2, dtype=torch.long)
    draft = engine.runner.draft(z, z + 3, z + 19, [True, True], policy.plan(2))
    assert policy.rhos[draft.rho_index] == expected
    # The same decision by hand: argmax (scale * gain + anchors) / cost.
    g = dcut.select(torch.full((2, 15), 0.7), torch.full((2,), 15), engine.runner.graphs.budgets(2)).gains
    by_hand = (0.5 * g + (2 if gain == "committed" else 0)) / torch.tensor([1.6, 1.6, 1.8, 2.4, 3.0])
    assert int(torch.argmax(by_hand)) == draft.rho_index


def choose(table, B, conf, **kw):
    """The dcut policy's in-graph decision, run eagerly: rho* for confidences conf [B, D]."""
    policy = Policy.dcut(table, RHOS, **kw)
    Ks = [dcut.budget(r, B, conf.shape[1]) for r in RHOS]
    gain = dcut.select(conf, torch.full((B,), conf.shape[1]), Ks).gains
    return RHOS[int(policy.choose(gain, torch.tensor(float(B)), torch.tensor(1.0), torch.tensor(policy.plan(B).cost)))]


def test_choose_is_the_first_argmax_of_committed_tokens_over_cost():
    p = Policy.dcut(steep_table(), RHOS, calibrate=False)
    gain = torch.tensor([0.0, 4.0, 6.0, 7.0])  # expected accepted drafts; 8 live requests add 8 anchors
    assert int(p.choose(gain, torch.tensor(8.0), torch.tensor(1.0), torch.tensor([80.0, 85, 86, 91]))) == 3  # flat
    assert int(p.choose(gain, torch.tensor(8.0), torch.tensor(1.0), torch.tensor([1.0, 2.0, 3.0, 4.0]))) == 0  # steep
    tie = torch.tensor([0.0, 8.0, 8.0, 8.0])
    assert int(p.choose(tie, torch.tensor(8.0), torch.tensor(1.0), torch.tensor([1.0, 2.0, 2.0, 2.0]))) == 0


def test_rho_choice_prunes_hard_on_steep_costs_and_keeps_more_on_flat_costs():
    torch.manual_seed(0)
    conf = torch.rand(64, 15) * 0.3 + 0.7  # a decent drafter: confidences 0.7..1.0
    assert choose(steep_table(), 64, conf) <= 0.25
    assert choose(flat_table(), 64, conf) >= 0.75


def test_hopeless_drafts_fall_back_to_ar():
    conf = torch.full((16, 15), 0.02)
    # Without skip drafting, the step itself falls back to rho = 0 (an AR verification).
    assert choose(steep_table(), 16, conf, skip_drafting=False) == 0.0
    # With it, the paid-for draft keeps the smallest budget, and the step counts as lost to AR.
    assert choose(steep_table(), 16, conf) == 0.25
    assert skip(steep_table(), 16).gain_over_ar(drafting(16, 0.25, float(conf[:, 0].sum()))) < 0


def test_a_drafting_step_prices_rho_zero_as_a_drafting_step_when_drafting_can_be_skipped():
    costs = Policy.dcut(steep_table(), RHOS).plan(16).cost
    assert costs[0] == costs[1] == pytest.approx(1.6)  # the draft is paid: rho = 0 saves nothing
    q = Policy.dcut(steep_table(), RHOS, skip_drafting=False)  # no other way back to AR steps
    assert q.plan(16).cost[0] == pytest.approx(1.0)


@pytest.mark.parametrize("skip_drafting", [True, False])
def test_a_bucket_without_a_table_row_is_measured_first_and_never_drafts_without_one(skip_drafting):
    p = Policy.dcut(steep_table(), RHOS, skip_drafting=skip_drafting)
    assert p.plan(16).draft and not p.plan(32).draft  # 32 was not measured: no costs to decide with
    assert not p.needs_row(16) and p.needs_row(32)  # the engine measures it before its first step there
    assert not Policy.static(0.5).needs_row(32) and Policy.static(0.5).plan(32).draft


# ---- calibration -----------------------------------------------------------------------------------

def test_calibration_tracks_realized_over_predicted_accepted_drafts():
    cal = Calibration()
    for _ in range(200):  # an over-confident drafter: realizes half of what it predicts
        cal.observe(drafting(64, 0.25, 10.0, accepted=5))
    assert cal.gain_scale == pytest.approx(0.5, rel=0.02)
    off = Calibration(enabled=False)
    for _ in range(50):
        off.observe(drafting(64, 0.25, 10.0, accepted=5))
    assert off.gain_scale == 1.0


def test_steps_refine_the_entry_they_ran_at_and_one_outlier_moves_it_little():
    p = Policy.dcut(steep_table(), RHOS)
    for _ in range(20):
        p.observe(ar_step(16, seconds=1.2))
    assert p.costs(16)[0] == pytest.approx(1.2, rel=0.01)  # the table's 1.0 is forgotten
    p.observe(ar_step(16, seconds=100.0))  # a GC pause or a compile: clamped to 3x, one of 20
    assert p.costs(16)[0] < 1.35
    assert p.costs(16)[1:] == steep_table().row(16, RHOS)[1:] and p.costs(64) == steep_table().row(64, RHOS)


def test_a_drafting_step_that_kept_nothing_refines_no_entry_and_nocal_refines_none():
    p = Policy.dcut(steep_table(), RHOS)
    p.observe(drafting(16, 0.0, 0.1, seconds=5.0))
    assert p.costs(16) == steep_table().row(16, RHOS)
    q = Policy.dcut(steep_table(), RHOS, calibrate=False)
    q.observe(ar_step(16, seconds=5.0))
    assert q.costs(16) == steep_table().row(16, RHOS)


# ---- skipping drafting -----------------------------------------------------------------------------

def test_skip_drafting_switches_off_after_patience_and_reprobes_backing_off():
    # B = 16: a drafting step costs 1.01-1.04 AR steps, so a probe that keeps nothing loses 0.04 AR steps
    # at most (priced at the dearest budget), far less than the AR steps earn: probe_every (5) sets the
    # period, doubled by each probe in a row that left drafting off.
    s = skip(CostTable([16], RHOS, [[1.0, 1.01, 1.02, 1.03, 1.04]]), 16, patience=3, probe_every=5)
    drafted = []
    for _ in range(80):  # rho* = 0 (nothing kept) whenever it drafts
        d = s.draft_now()
        drafted.append(d)
        s.observe(drafting(16, 0.0, 0.1) if d else ar_step(16))
    assert drafted[:3] == [True, True, True] and s.state == "off"
    assert not any(drafted[3:7])  # switched off...
    probes = [i for i, d in enumerate(drafted) if d][3:]
    assert probes == [7, 7 + 10, 7 + 10 + 20, 7 + 10 + 20 + 40]  # ...then probes 5, 10, 20, 40 AR steps apart
    assert s.failed_probes == 4 and s.probe_period() == 80


def test_a_probe_that_turns_drafting_on_resets_the_backoff():
    s = skip(steep_table(), 16, patience=2, probe_every=4)
    for _ in range(2):
        s.observe(drafting(16, 0.25, 0.0))
    for _ in range(3):  # three losing probes: the floor is 4 * 8
        while not s.draft_now():
            s.observe(ar_step(16))
        s.observe(drafting(16, 0.25, 0.0))
    assert s.state == "off" and s.backoff == 3
    while not s.draft_now():
        s.observe(ar_step(16))
    s.observe(drafting(16, 0.25, 60.0))  # 1 + 60 / 16 tokens a row: drafting pays again
    assert s.state == "drafting" and s.backoff == 0


def test_winning_probes_turn_drafting_back_on_once_the_mean_gain_is_above_zero():
    """B = 16, steep table: a drafting step at rho = 0.25 costs 1.6 AR steps. Eight steps that kept
    nothing lose 0.6 AR-step tokens per row each: drafting goes off. Probes that commit 1 + 40 / 16 =
    3.5 tokens per row (1.9 more than AR steps in their time) pull the evidence's mean up by their
    weight, so the third would lift it above zero; but two such probes already say on their own, with
    90 % confidence, that drafting wins now, and replace the evidence: drafting is on after the second.
    They won, so the probe period does not back off. Noisy probes that barely pay (+0.15 on average,
    -0.35 and +0.65 in turn) say nothing with confidence over eight probes and leave the mean below
    zero; probes that lose double the period each time."""
    def probes(predicted, n):
        s = skip(steep_table(), 16, patience=8, probe_every=3)
        for _ in range(8):
            s.draft_now()
            s.observe(drafting(16, 0.0, 0.1))
        assert s.state == "off" and s.gain == pytest.approx(-0.6)
        states, backoffs = [], []
        for i in range(n):
            while not s.draft_now():
                s.observe(ar_step(16))
            assert s.state == "probing"
            s.observe(drafting(16, 0.25, predicted[i % len(predicted)]))
            states.append(s.state)
            backoffs.append(s.backoff)
        return states, backoffs, s
    w = [0.98 ** i for i in range(11)]  # weights, newest first
    k = next(k for k in range(1, 4) if 1.9 * sum(w[:k]) - 0.6 * sum(w[k:k + 8]) > 0)
    assert k == 3  # the mean alone
    states, backoffs, s = probes([38.0, 42.0], 2)
    assert states == ["off", "drafting"] and backoffs == [0, 0]
    assert s.evidence.n == pytest.approx(1.98 ** 2 / (1 + 0.98 ** 2))  # the two probes' samples alone
    states, backoffs, s = probes([4.0, 20.0], 8)
    assert states == ["off"] * 8 and s.gain < 0 and s.probes.lower() < 0
    assert backoffs == [1, 1, 2, 2, 3, 3, 4, 4]  # the losing ones (-0.35) back off, the winning ones do not
    states, backoffs, s = probes([0.0], 3)
    assert states == ["off"] * 3 and backoffs == [1, 2, 3]


def test_a_probe_above_the_mean_does_not_undo_a_switch_off():
    """Drafting goes off on the step the bound crosses zero, so the bound sits just below zero there: a
    probe above the samples' mean lifts it back above zero. On the bound alone drafting would be on again
    at once (traced at B = 4 on the demo pair: probes turned it on with mean gains of -0.6 and -0.2 tokens
    a row, and it drafted on for 30 and 200 steps where it lost 15-20 %). On the mean, it stays off."""
    s = skip(CostTable([4], RHOS, [[1.0, 3.0, 3.2, 3.4, 3.6]]), 4)  # break-even: 2 accepted drafts a row
    accepted = [4, 12, 2, 9, 3, 10, 1, 8, 5, 6, 2, 7, 4, 11, 3, 6]  # 1.5 a row on average: gain -0.5
    i = 0
    while s.state == "drafting":
        assert s.draft_now()
        s.observe(drafting(4, 0.25, 0.0, accepted=accepted[i % len(accepted)]))
        i += 1
    assert s.evidence.upper() - s.lumps.mean < 0 and s.gain < 0
    while not s.draft_now():
        s.observe(ar_step(4))
    s.observe(drafting(4, 0.25, 0.0, accepted=10))  # 2.5 a row: +0.5, well above the mean
    assert s.evidence.upper() - s.lumps.mean > 0  # no longer sure that drafting loses...
    assert s.gain < 0 and s.state == "off" and s.backoff == 0  # ...but it most likely does: off, no backoff


def test_policy_never_drafts_where_the_table_says_even_perfect_drafts_cannot_beat_ar():
    # B = 64: an AR step costs 1.0, any drafting step >= 20: even all K accepted cannot pay for it.
    hopeless = skip(CostTable([64], RHOS, [[1.0, 20.0, 21.0, 22.0, 23.0]]), 64)
    assert not hopeless.possible and not hopeless.draft_now() and not hopeless.draft_now()
    assert skip(steep_table(), 64).possible


def test_a_probes_frequency_follows_the_room_to_win():
    """Two B = 16 rows whose probes cost the same (the dearest budget 6 AR steps, nothing accepted so far):
    where a middle budget would commit 7.7x an AR step's tokens per second at full acceptance, probes
    come (1 - 1 / 7.7) / (1 - 1 / 2.7) times as often as where the best is 2.7x: in proportion to the
    share of the time drafting could save."""
    wide = skip(CostTable([16], RHOS, [[1.0, 1.2, 1.4, 1.6, 6.0]]), 16)
    narrow = skip(CostTable([16], RHOS, [[1.0, 5.6, 5.8, 5.9, 6.0]]), 16)
    assert wide.room(wide.cost) == pytest.approx((16 + 180) / 1.6 / 16)  # rho = 0.75 is the best
    assert narrow.room(narrow.cost) == pytest.approx((16 + 240) / 6.0 / 16)  # rho = 1
    assert wide.probe_price() == narrow.probe_price() == pytest.approx(5.0)
    assert wide.probe_period() == period(5.0, wide.room(wide.cost))
    assert narrow.probe_period() == period(5.0, narrow.room(narrow.cost))
    ratio = (1 - 1 / wide.room(wide.cost)) / (1 - 1 / narrow.room(narrow.cost))
    assert narrow.probe_period() / wide.probe_period() == pytest.approx(ratio, rel=0.05)
    b1 = skip(CostTable([1, 64], RHOS, [[1.0, 1.02, 1.04, 1.06, 1.08], [1.0, 8.0, 9.0, 10.0, 11.0]]), 1)
    assert b1.probe_period() == 16  # a probe costs 0.08 of an AR step: the floor applies
    b64 = skip(CostTable([1, 64], RHOS, [[1.0, 1.02, 1.04, 1.06, 1.08], [1.0, 8.0, 9.0, 10.0, 11.0]]), 64)
    room = b64.room(b64.cost)
    assert room == pytest.approx(1024 / 11 / 64) and b64.probe_period() == period(10.0, room)
    for _ in range(30):  # drafting steps that get 5 drafts per row accepted: a probe commits 6 tokens a row
        b64.observe(drafting(64, 0.25, 5.0 * 64))
    assert b64.probe_period() == period(5.0, room)  # it loses 11 - 6 AR steps


def test_where_drafting_never_pays_probing_costs_at_most_its_share_of_the_room_to_win():
    """Drafting steps that accept nothing, at B = 16 and 64: off after `patience` steps, and over 5,000
    steps the probes' extra seconds (over AR steps) stay within PROBE_SHARE * (1 - 1 / room) of the run."""
    for B, row in [(16, [1.0, 1.6, 2.2, 2.8, 3.4]), (64, [1.0, 2.5, 4.0, 5.5, 7.0])]:
        s = skip(CostTable([B], RHOS, [row]), B)
        cost = dict(zip(RHOS, row))
        extra = 0.0
        for _ in range(5000):
            if s.draft_now():
                extra += cost[1.0] - cost[0.0]  # the rule may pick the dearest budget: priced so
                s.observe(drafting(B, 1.0, 0.0))
            else:
                s.observe(ar_step(B))
        assert s.state == "off" and s.drafting_steps > 4
        assert extra / 5000 <= PROBE_SHARE * (1 - 1 / s.room(cost)) + (s.patience * cost[1.0]) / 5000


def test_probes_are_priced_at_the_dearest_budget_the_rule_may_pick():
    """Budgets a cost row never measured (inf: they cannot win) are never picked, so they do not price
    a probe: with rho 0.75 and 1 unmeasured, the dearest a probe can cost is rho 0.5's 4 AR steps."""
    pruned = skip(CostTable([64], RHOS, [[1.0, 3.0, 4.0, float("inf"), float("inf")]]), 64)
    assert pruned.probe_period() == period(3.0, pruned.room(pruned.cost))


def test_a_probes_catch_up_is_priced_per_position_it_writes():
    s = skip(CostTable([64], RHOS, [[1.0, 8.0, 9.0, 10.0, 11.0]]), 64)
    room = s.room(s.cost)
    assert s.probe_period(behind=1000) == period(10.0, room)  # not measured yet
    s.observe(drafting(64, 0.25, 0.0, catchup=2.0, caught_up=400))  # 2 AR steps for 400 positions
    assert s.catchup_per_position == pytest.approx(0.005)
    assert s.probe_period() == period(10.0, room)  # nothing to catch up
    assert s.probe_period(behind=800) == period(14.0, room)


def test_a_probe_waits_while_its_catch_up_grows_faster_than_ar_steps_earn_it_then_runs_on_fresh_rows():
    """B = 64: catching up a position costs 0.5 % of an AR step, so the 64 positions a skipped step adds
    cost 0.32 AR steps, more than each AR step earns (PROBE_SHARE of 1 - 1 / ~6). With the same rows
    no probe ever pays; once new requests took the rows (their prompts' context was written at
    prefill), one does."""
    s = skip(CostTable([64], RHOS, [[1.0, 2.0, 2.2, 2.4, 2.6]]), 64, patience=2)
    assert PROBE_SHARE * (1 - 1 / s.room(s.cost)) < 0.32
    for _ in range(2):  # nothing accepted: drafting goes off
        s.observe(drafting(64, 0.25, 0.0, catchup=0.5, caught_up=100))
    assert s.state == "off" and s.catchup_per_position == pytest.approx(0.005)
    assert not any(s.draft_now(behind=64 * (i + 1)) for i in range(2000))
    assert s.draft_now(behind=64)  # 2001 AR steps earned far more than a probe with 64 positions to write


def test_only_a_step_of_drafting_that_is_on_drafts_the_next_block_ahead():
    p = Policy.dcut(steep_table(), RHOS)
    assert p.plan(16).draft and p.plan(16).ahead  # drafting is on
    skip = p.skipping[16]
    skip.state, skip.skipped = "off", 10 ** 6  # a probe is long due
    plan = p.plan(16)
    assert plan.draft and not plan.ahead and skip.state == "probing"
    assert Policy.static(0.5).plan(16).ahead


def test_a_draft_made_afresh_counts_against_drafting():
    """A step whose rows changed drafts afresh and then ahead: the table entry it refines keeps one
    draft, but the controller charges drafting for the other (StepRecord.redraft) too, with the catch-up
    and the prompts' context: kept apart from the samples, as their own mean over the same steps (the
    evidence's weights), which the decision subtracts."""
    s = skip(steep_table(), 16)  # rho .25 costs 1.6 AR steps
    steady = drafting(16, 0.25, 16.0, seconds=1.6)
    lumpy = dataclasses.replace(steady, redraft=0.2, catchup=0.2, prompt_context=0.2)
    assert s.gain_over_ar(steady) == s.gain_over_ar(lumpy) == pytest.approx(1 + 1 - 1.6)
    assert s.lump_over_ar(lumpy) == pytest.approx(0.6) and s.lump_over_ar(steady) == 0.0
    s.observe(lumpy)
    assert s.gain == pytest.approx(1 + 1 - 1.6 - 0.6)
    s.observe(steady)  # no lump this step: the first one's 0.6 over both steps, by their weights
    assert s.lumps.mean == pytest.approx(0.98 * 0.6 / (0.98 + 1))
    assert s.gain == pytest.approx(0.4 - 0.98 * 0.6 / 1.98)
    assert s.evidence.upper() - s.lumps.mean == pytest.approx(
        s.evidence.upper() - 0.98 * 0.6 / 1.98)  # the bound the decision reads


def test_a_runs_first_lump_is_paid_once_over_its_first_steps():
    """A run's first drafting step pays the first prompt's context (2 AR steps); the next three pay
    nothing. Over the four, drafting paid 2 AR steps: the decision charges their weighted mean, about
    0.5 a step. Charged at the rate so far to each sample as it came (2, 1, 2/3, 1/2), the four would
    have paid 4.2 AR steps, twice what they did."""
    s = skip(steep_table(), 16)
    first = dataclasses.replace(drafting(16, 0.25, 16.0), prompt_context=2.0)
    s.observe(first)
    for _ in range(3):
        s.observe(drafting(16, 0.25, 16.0))
    w = [0.98 ** 3, 0.98 ** 2, 0.98, 1.0]
    assert s.lumps.mean == pytest.approx(2.0 * w[0] / sum(w))
    assert s.lumps.mean * 4 == pytest.approx(2.0, rel=0.05)
    assert s.gain == pytest.approx(1 + 1 - 1.6 - 2.0 * w[0] / sum(w))


def test_one_hard_request_cannot_switch_drafting_off_at_b_1():
    """Blocks of one request are not independent samples: at B = 1, eight poor steps of the first
    request keep drafting on; the same evidence over a second request's first `patience` blocks switches
    it off. At B = 4 the
    first step's four rows are four requests already."""
    s = skip(CostTable([1], RHOS, [[1.0, 1.3, 1.4, 1.5, 1.6]]), 1)
    s.observe(dataclasses.replace(drafting(1, 0.25, 0.0), admitted=1))
    for _ in range(7):
        s.observe(drafting(1, 0.25, 0.0))
    assert s.losing and s.state == "drafting" and s.requests == 1
    s.observe(dataclasses.replace(drafting(1, 0.25, 0.0), admitted=1))
    for _ in range(3):  # at B = 1 the second request gives `patience` samples of its own
        assert s.requests == 2 and s.state == "drafting"
        s.observe(drafting(1, 0.25, 0.0))
    assert s.state == "off"
    s4 = skip(CostTable([4], RHOS, [[1.0, 1.3, 1.4, 1.5, 1.6]]), 4)
    for i in range(4):
        s4.observe(dataclasses.replace(drafting(4, 0.25, 0.0), admitted=4 if i == 0 else 0))
    assert s4.requests == 4 and s4.state == "off"


def test_a_probe_after_an_admission_is_charged_the_prompts_context_over_the_steps_not_whole():
    """B = 1, where drafting commits three tokens a step for 1.3 AR steps. Four poor first steps (two
    requests) turned drafting off; the probe lands on the first block of a newly admitted request, whose
    prompt's context for the drafter cost 3 AR steps. Charged whole to the probe's sample, that probe
    would lose (3 - 1.3 - 3 < 0) and back the next probe off; as a lump, its own step won (no backoff),
    and the lump's share falls with every step after it: the second probe turns drafting on again, the
    two probes saying with confidence that drafting wins net of their lumps (1.7 - 3 * 0.98 / 1.98)
    and replacing the evidence (the mean net of the lumps: -0.51, then +0.22). Its catch-up of the
    positions skipped while off is the probe budget's, not a lump."""
    s = skip(CostTable([1], RHOS, [[1.0, 1.3, 1.4, 1.5, 1.6]]), 1, patience=2)
    for i in range(4):  # two requests, one after the other, two steps each
        assert s.draft_now()
        s.observe(dataclasses.replace(drafting(1, 0.25, 0.0), admitted=int(i in (0, 2))))
    assert s.state == "off"
    s.state, s.skipped = "probing", 0  # a probe is due
    probe = dataclasses.replace(drafting(1, 0.25, 2.0), prompt_context=3.0, catchup=0.5, caught_up=50)
    assert s.gain_over_ar(probe) - s.lump_over_ar(probe) < 0 and s.lump_over_ar(probe) == pytest.approx(3.0)
    s.observe(probe)
    w = [0.98 ** 4, 0.98 ** 3, 0.98 ** 2, 0.98, 1.0]
    assert s.lumps.mean == pytest.approx(3.0 / sum(w))
    gains = [s.gain]
    while s.state == "off":
        assert s.failed_probes == 0
        s.state, s.skipped = "probing", 0
        s.observe(drafting(1, 0.25, 2.0))
        gains.append(s.gain)
    assert [round(g, 2) for g in gains] == [-0.51, 0.22] and s.state == "drafting"
    assert s.gain == pytest.approx(1.7 - 3.0 * 0.98 / 1.98)


def test_at_b_1_the_latest_request_must_give_patience_samples_itself():
    """B = 1: a hard first request (sixteen poor blocks) and one poor block of the next cannot switch
    drafting off; the next request's fourth poor block can. A good second request keeps it on."""
    def run(second):
        s = skip(CostTable([1], RHOS, [[1.0, 1.3, 1.4, 1.5, 1.6]]), 1)
        for i in range(16):
            s.observe(dataclasses.replace(drafting(1, 0.25, 0.0), admitted=int(i == 0)))
        states = []
        for i, acc in enumerate(second):
            s.observe(dataclasses.replace(drafting(1, 0.25, 0.0, accepted=acc), admitted=int(i == 0)))
            states.append(s.state)
        return s, states
    s, states = run([0, 0, 0, 0])
    assert s.requests == 2 and states == ["drafting", "drafting", "drafting", "off"]
    s, states = run([3, 3, 3, 3, 3, 3])
    assert states == ["drafting"] * 6 and s.losing is False


def test_at_b_1_probes_that_clearly_win_outvote_the_blocks_of_requests_gone():
    """B = 1, a drafting step costs 1.3 AR steps. Two hard requests (40 and 4 blocks, nothing accepted:
    -0.3 a block) switch drafting off; the requests after them accept 1-3 drafts a block (+0.7 to +2.7).
    Forty-four poor samples would take five such probes to outweigh on the mean (eighty AR steps at
    least, where drafting wins 1.3-3x); three probes already say with confidence that drafting wins,
    and drafting is on again at the third."""
    s = skip(CostTable([1], RHOS, [[1.0, 1.3, 1.4, 1.5, 1.6]]), 1)
    for i in range(44):
        s.observe(dataclasses.replace(drafting(1, 0.25, 0.0), admitted=int(i in (0, 40))))
    assert s.state == "off" and s.gain == pytest.approx(-0.3)
    probes = 0
    while s.state == "off":
        while not s.draft_now():
            s.observe(ar_step(1))
        s.observe(drafting(1, 0.25, 0.0, accepted=[3, 1, 2][probes % 3]))
        probes += 1
    assert probes == 3 and s.backoff == 0
    w = [0.98 ** i for i in range(60)]  # newest first
    on_the_mean = next(k for k in range(1, 20) if sum(w[i] * [3, 1, 2][(k - 1 - i) % 3] - 0.3 * w[i]
                                                       for i in range(k)) - 0.3 * sum(w[k:k + 44]) > 0)
    assert on_the_mean == 5


def test_losing_probes_pile_up_so_one_lucky_probe_does_not_turn_drafting_on():
    """B = 16, steep table: rho = 0.25 costs 1.6 AR steps. Drafting went off and ten probes since each
    committed 1.25 tokens a row (0.35 fewer than AR steps in their time): the evidence says drafting
    loses, so a probe that commits 2.5 tokens a row (+0.9) leaves drafting off. Such probes in a row (the
    prompts changed) turn it on at the fourth: twelve samples at -0.35 outweigh three at +0.9."""
    s = skip(steep_table(), 16, patience=2)
    for _ in range(2):
        assert s.draft_now()
        s.observe(drafting(16, 0.25, 4.0))

    def probe(predicted):
        while not s.draft_now():
            s.observe(ar_step(16))
        s.observe(drafting(16, 0.25, predicted))
        return s.state

    for _ in range(10):
        assert probe(4.0) == "off"
    assert s.losing and s.evidence.mean == pytest.approx(-0.35)
    states = [probe(24.0)]
    while states[-1] == "off":
        states.append(probe(24.0))
    w = [0.98 ** i for i in range(20)]  # newest first
    k = next(k for k in range(1, 8) if 0.9 * sum(w[:k]) - 0.35 * sum(w[k:k + 12]) > 0)
    assert states[0] == "off" and len(states) == k == 4


def test_the_bound_is_students_t_on_the_weighted_samples():
    """Evidence: weights RUN_DECAY ** age, the mean's one-sided upper bound at CONFIDENCE; the t quantile
    close to the tabled values (0.9: df 2: 1.886, df 3: 1.638, df 10: 1.372, df 30: 1.310; 0.95: df 3:
    2.353, df 10: 1.812)."""
    assert CONFIDENCE == 0.9
    for p, df, exact in [(0.9, 2, 1.886), (0.9, 3, 1.638), (0.9, 10, 1.372), (0.9, 30, 1.310), (0.95, 3, 2.353),
                         (0.95, 10, 1.812)]:
        assert t_quantile(p, df) == pytest.approx(exact, rel=0.005)
    e = Evidence()
    assert e.upper() == float("inf")
    for x in [1.0, -1.0, 1.0, -1.0]:
        e.add(x)
    w = [0.98 ** 3, 0.98 ** 2, 0.98, 1.0]
    n = sum(w) ** 2 / sum(x * x for x in w)
    mean = sum(wi * x for wi, x in zip(w, [1.0, -1.0, 1.0, -1.0])) / sum(w)
    var = (sum(w) / sum(w) - mean ** 2) * n / (n - 1)
    assert e.n == pytest.approx(n) and e.mean == pytest.approx(mean)
    assert e.upper() == pytest.approx(mean + t_quantile(CONFIDENCE, n - 1) * (var / n) ** 0.5)


def test_drafting_stays_on_where_it_pays_even_if_its_first_steps_are_poor():
    """B = 4, a drafting step costs 3.0-3.6 AR steps (break-even: 2 accepted drafts a row). The first
    four steps accept 1.5 +- 1 a row (a noisy machine's first steps on fresh prompts), every later one 4:
    four poor steps are no evidence at 90 %, and drafting runs on all of 300 steps. Eight poor steps
    are: drafting goes off for a probe period (the probe budget's, as the docs price it); the first
    probe wins but leaves the mean below zero, so it does not back off, and the second, a shorter period
    later (drafting now usually gets more accepted), turns drafting back on for good. The profiler's timed steps (one state, repeated) do not
    count toward the decision."""
    def run(first):
        s = skip(CostTable([4], RHOS, [[1.0, 3.0, 3.2, 3.4, 3.6]]), 4)
        for acc in [0, 0, 0, 0]:
            s.observe(dataclasses.replace(drafting(4, 0.25, 0.0, accepted=acc), timed=True))
        assert s.drafting_steps == 0 and s.state == "drafting"
        drafted, periods = [], []
        for i in range(300):
            d = s.draft_now()
            drafted.append(d)
            s.observe(drafting(4, 0.25, 0.0, accepted=first[i] if i < len(first) else 16) if d else ar_step(4))
            if s.state == "off" and d:
                periods.append(s.probe_period())
        assert s.state == "drafting"
        return drafted, periods
    drafted, _ = run([2, 10, 4, 8])  # drafts accepted over the 4 rows: 1.5 a row
    assert all(drafted)
    drafted, periods = run([2, 10, 4, 8, 2, 6, 4, 8])
    off = [i for i, d in enumerate(drafted) if not d]
    k = off[0]  # drafting steps before it went off (poor ones: k <= 8)
    assert len(periods) == 2 and 4 <= k <= 8  # off, a probe that won but left the mean below zero, on
    assert off == list(range(k, k + periods[0] - 1)) + list(range(k + periods[0], k + sum(periods) - 1))
    for j, p in enumerate(periods):  # each period as the docs price it, on what drafting usually gets
        accepted = [2, 10, 4, 8, 2, 6, 4, 8][:k] + [16] * j
        w = [0.995 ** (len(accepted) - 1 - i) for i in range(len(accepted))]  # ACCEPTED_DECAY a step
        usual = sum(wi * a for wi, a in zip(w, accepted)) / (4 * sum(w))
        price = 3.6 - (1 + usual)  # the dearest step less what drafting usually commits
        assert p == period(price, (4 + 60) / 3.6 / 4)  # rho = 1 at full acceptance is the best
    assert sum(periods) < 150  # drafting pays 1.4-1.7x here: the budget brings the probes well inside the run


def test_steps_with_few_live_rows_weigh_what_they_commit():
    """B = 8, a drafting step costs 3 AR steps. Full-batch steps commit 2.5 tokens a row (8 rows: 4 tokens
    fewer than AR steps in their time); at the end of a batch one live row keeps more of the budget and
    commits 7 (4 more). Two tail steps and six full ones, over and over: 16 tokens lost each time, so drafting
    must switch off, though the tail steps win by more per row than the full ones lose."""
    s = skip(CostTable([8], RHOS, [[1.0, 3.0, 3.2, 3.4, 3.6]]), 8, patience=2)
    switched_off = False
    for _ in range(3):
        for n_live, predicted in [(1, 6.0)] * 2 + [(8, 12.0)] * 6:  # a batch's tail, then the next batch
            if s.draft_now():
                s.observe(drafting(8, 0.25, predicted, n_live=n_live))
            else:
                switched_off = True
                s.observe(ar_step(8, n_live=n_live))
    assert switched_off


def test_rows_at_their_end_neither_draft_nor_teach_the_controller_anything():
    """B = 4, a drafting step at rho .25 costs 3 AR steps. Three rows with one token left each (no draft
    can be emitted) cannot pay even at full acceptance: the step runs AR, and drafting steps timed on
    such rows (the profiler's, at a batch's tail) leave the bucket's state as it was; with rows that can
    emit 5 drafts each, drafting is on and losing steps count."""
    s = skip(CostTable([4], RHOS, [[1.0, 3.0, 3.2, 3.4, 3.6]]), 4, patience=2)
    assert s.state == "drafting" and s.draft_now(n_live=3, usable=15)
    assert not s.draft_now(n_live=3, usable=0) and not s.draft_now(n_live=3, usable=2)
    before = s.state_dict
    for _ in range(10):
        s.observe(drafting(4, 0.25, 0.0, accepted=0, n_live=3, usable=0))
    assert s.state_dict == before
    for _ in range(10):
        s.observe(drafting(4, 0.25, 0.0, accepted=0, n_live=3, usable=15))
    assert s.state == "off" and s.losing
    p = Policy.dcut(CostTable([4], RHOS, [[1.0, 3.0, 3.2, 3.4, 3.6]]), RHOS)
    assert p.plan(4).draft and not p.plan(4, n_live=3, usable=0).draft and p.plan(4, n_live=3, usable=15).draft


def test_probes_are_priced_on_what_drafting_usually_gets_not_on_the_last_hard_stretch():
    """B = 1, a drafting step costs 2.9 AR steps. 200 steps that commit 4 tokens (drafting pays), then a
    hard request (nothing accepted): drafting switches off within 30 steps, but probes stay cheap (the long
    mean is ~2.4 accepted drafts, so a probe is expected to win), so they come every probe_every steps
    instead of every ~127 (what the hard stretch alone would price them at)."""
    s = skip(CostTable([1], RHOS, [[1.0, 2.9, 3.0, 3.1, 3.2]]), 1)
    for _ in range(200):
        s.observe(drafting(1, 0.25, 3.0))
    hard = 0
    while s.draft_now():  # the hard request, a second one: drafting switches off
        s.observe(dataclasses.replace(drafting(1, 0.25, 0.0), admitted=int(hard == 0)))
        hard += 1
    assert hard <= 30
    steps = 1  # the AR step that draft_now() just chose
    s.observe(ar_step(1))
    while not s.draft_now():
        s.observe(ar_step(1))
        steps += 1
    assert steps + 1 == s.probe_every  # the probe is step probe_every after switching off


def test_drafting_switches_off_when_drafting_steps_lose_to_ar_steps_on_average():
    """B = 16, steep table: rho = 0.5 costs 2.2 AR steps, so a step pays only above 1.2 * 16 = 19.2
    accepted drafts. One acceptance is noisy: the running mean over recent
    drafting steps decides, so a short dip does not switch drafting off and a lasting one does."""
    s = skip(steep_table(), 16, patience=3)
    for _ in range(10):  # 30 accepted drafts per step: drafting pays, stays on
        assert s.draft_now()
        s.observe(drafting(16, 0.5, 30.0))
    assert s.gain_over_ar(drafting(16, 0.5, 30.0)) > 0 > s.gain_over_ar(drafting(16, 0.5, 10.0))
    losing = 0
    while s.draft_now():  # 10 per step: an AR step commits faster
        s.observe(drafting(16, 0.5, 10.0))
        losing += 1
        assert losing < 30
    assert 3 < losing  # not on the first losing steps: the 10 good ones still weigh
    q = skip(steep_table(), 16, patience=3)
    for _ in range(3):  # losing from the start: off after `patience` drafting steps
        assert q.draft_now()
        q.observe(drafting(16, 0.5, 10.0))
    assert not q.draft_now()


def test_the_decision_counts_what_drafting_steps_committed_not_what_they_were_predicted_to():
    """B = 16, steep table: rho = 0.5 pays above 19.2 accepted drafts a step. Steps predicted to get 30
    (the rule picks the rho whose prediction is highest, so the pick's prediction runs high) that get 10
    switch drafting off; steps predicted at 10 that get 30 keep it on."""
    over = skip(steep_table(), 16, patience=3)
    for _ in range(10):
        if over.draft_now():
            over.observe(drafting(16, 0.5, 30.0, accepted=10))
    assert over.state == "off"
    under = skip(steep_table(), 16, patience=3)
    for _ in range(10):
        assert under.draft_now()
        under.observe(drafting(16, 0.5, 10.0, accepted=30))
    assert under.state == "drafting"


def test_noisy_acceptance_that_pays_on_average_keeps_drafting_on():
    """B = 16, rho = 0.5 pays above 19.2 accepted drafts. A stream of one step at 80 and four
    at 5 (mean 20) pays on average although four steps in five lose: drafting stays on. The same
    stream shifted down (one at 40, four at 5: mean 12) loses on average, clearly enough for the bound
    to say so within ~50 steps of memory: drafting goes off."""
    def drafted_share(high):
        s = skip(steep_table(), 16, patience=4)
        drafted = 0
        for i in range(200):
            if s.draft_now():
                drafted += 1
                s.observe(drafting(16, 0.5, high if i % 5 == 0 else 5.0))
            else:
                s.observe(ar_step(16))
        return drafted / 200
    assert drafted_share(80.0) == 1.0
    assert drafted_share(40.0) < 0.3


def policy_after(draft_s, ar_s=None):
    """A dcut policy at B = 16 (steep table) after five rho = 0.5 drafting steps measured at draft_s
    seconds (the table says 2.2) and five AR steps at ar_s seconds (the table says 1.0)."""
    p = Policy.dcut(steep_table(), RHOS, patience=3)
    for _ in range(5):
        p.observe(drafting(16, 0.5, 25.0, seconds=draft_s))
    if ar_s is not None:
        for _ in range(5):
            p.observe(ar_step(16, seconds=ar_s))
    p.calibration.gain_scale = 1.0
    return p


def test_measured_step_seconds_refine_the_costs_that_decide_whether_drafting_pays():
    """B = 16, steep table (one sample per entry): rho = 0.5 is priced at 2.2 AR steps, so 25 predicted
    accepted drafts per step pay ((25 + 16) / 2.2 > 16 / 1). When the loop measures drafting steps at
    twice the table's seconds, they no longer do ((25 + 16) / 4.0 < 16); when both kinds run twice as
    slow, they still do."""
    def pays(p):
        return p.skip(16).gain_over_ar(drafting(16, 0.5, 25.0)) > 0
    assert pays(policy_after(2.2))
    assert policy_after(4.4, ar_s=1.0).costs(16)[2] == pytest.approx((2.2 + 5 * 4.4) / 6)
    assert not pays(policy_after(4.4, ar_s=1.0))
    assert pays(policy_after(4.4, ar_s=2.0))  # a slower machine, not a dearer draft
    assert policy_after(4.4).costs(16)[0] == 1.0  # no AR step measured yet: the table's


def test_measured_costs_switch_drafting_off_where_the_table_is_too_optimistic():
    """The engine's loop pays 3x the table's drafting step (host work the profile did not see): the
    calibrated skip decision switches drafting off; with calibration off, drafting stays on."""
    on = {}
    for calibrate in (True, False):
        p = Policy.dcut(steep_table(), RHOS, patience=3, calibrate=calibrate)
        for _ in range(6):
            p.observe(drafting(16, 0.5, 25.0, seconds=6.6) if p.plan(16).draft else ar_step(16, seconds=1.0))
        on[calibrate] = p.plan(16).draft
    assert on == {True: False, False: True}


def test_policy_state_outlives_a_generate_call_and_the_skip_state_is_per_batch_size():
    p = Policy.dcut(steep_table(), RHOS, patience=2, probe_every=5)
    p.observe(drafting(16, 0.25, 10.0, accepted=5))  # a calibration sample: half the drafts accepted
    for _ in range(2):  # two drafting steps that chose rho = 0: drafting switches off at B = 16
        p.plan(16)
        p.observe(drafting(16, 0.0, 0.0))
    assert not p.plan(16).draft  # nothing is forgotten between steps or generate() calls
    scale = p.calibration.gain_scale
    assert scale < 1.0
    assert p.plan(64).draft and p.calibration.gain_scale == scale  # B = 64 decides on its own
    p.reset()
    assert p.calibration.gain_scale == 1.0 and p.plan(16).draft


def test_policy_state_saved_and_loaded_continues_where_it_stopped():
    p = Policy.dcut(steep_table(), RHOS, patience=2, probe_every=5)
    p.observe(drafting(16, 0.25, 10.0, accepted=5, seconds=3.2))
    for _ in range(2):
        p.plan(16)
        p.observe(drafting(16, 0.0, 0.0))
    q = Policy.dcut(steep_table(), RHOS, patience=2, probe_every=5)
    q.load_state(json.loads(json.dumps(p.state)))  # through JSON, as in the table's file
    assert q.state == p.state and not q.plan(16).draft and q.skipping[16].state == "off"
    assert q.calibration.gain_scale == p.calibration.gain_scale < 1.0
    assert "seconds" not in q.state["calibration"]  # step costs live in the table, not in the state
    for bad in ({}, {"calibration": {"gain_scale": "x"}, "skipping": {}},
                {"calibration": p.state["calibration"], "skipping": {"16": {"state": "maybe"}}}):
        r = Policy.dcut(steep_table(), RHOS)
        with pytest.raises(ValueError, match="not a saved policy state"):
            r.load_state(bad)
        assert r.calibration.gain_scale == 1.0 and r.plan(16).draft  # nothing half-loaded


def test_the_summary_of_a_bucket_where_drafting_is_off_says_what_drafting_committed_and_what_it_costs():
    """B = 4, drafting steps cost 3.0-3.6 AR steps; four drafting steps that each got 6 drafts accepted
    over 4 rows (1 + 6 / 4 = 2.5 tokens a row a step, the bonus counted) switch drafting off."""
    from minidcut.explain import explain
    from minidcut.stats import Stats

    p = Policy.dcut(CostTable([4], RHOS, [[1.0, 3.0, 3.2, 3.4, 3.6]]), RHOS, calibrate=False)
    stats = Stats()
    for _ in range(4):
        rec = drafting(4, 0.25, 6.0, accepted=6)
        p.observe(rec)
        stats.add(dataclasses.replace(rec, kept=15), 1.0)
    assert p.skip(4).state == "off" and p.skip(4).usual_accepted == pytest.approx(1.5)
    said = [line for line in explain(stats, p) if line.startswith("drafting is off")]
    assert said and "committed 2.50 tokens per request per step, where the cheapest costs 3.0 AR steps" in said[0]


def test_drafting_off_says_where_a_prefill_may_leave_the_drafters_context_for_later():
    p = Policy.dcut(steep_table(), RHOS, patience=2)
    assert not p.drafting_off(16) and not p.drafting_off(32)  # drafting on; 32: no row, no controller
    for _ in range(2):
        p.plan(16)
        p.observe(drafting(16, 0.25, 0.0))
    assert p.drafting_off(16) and not p.drafting_off(64)
    assert Policy.dcut(CostTable([64], RHOS, [[1.0, 20.0, 21.0, 22.0, 23.0]]), RHOS).drafting_off(64)  # never drafts
    assert not Policy.dcut(steep_table(), RHOS, skip_drafting=False).drafting_off(16)
    assert not Policy.static(0.5).drafting_off(16) and not Policy.ar().drafting_off(16)


def test_a_restored_controller_prices_drafting_with_the_drafters_depth():
    """A saved state is restored (load_table -> build_policy) before an Engine sets the policy's depth:
    the controllers made then must follow the drafter's D, not the default 15."""
    p = Policy.dcut(steep_table(), RHOS)
    p.plan(16)
    q = Policy.dcut(steep_table(), RHOS)
    q.load_state(json.loads(json.dumps(p.state)))
    assert q.skipping[16].D == 15
    q.depth = 7
    assert q.skipping[16].D == 7 and q.skip(64).D == 7
    assert q.skipping[16].room(q.skipping[16].cost) == pytest.approx((16 + dcut.budget(1.0, 16, 7)) / 3.4 / 16)
