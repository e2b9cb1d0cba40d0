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
from minidcut.skipping import SkipDrafting
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
    assert skip(steep_table(), 16).score(drafting(16, 0.25, float(conf[:, 0].sum())))[0] < 0


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

def test_only_a_step_of_drafting_that_is_on_drafts_the_next_block_ahead():
    p = Policy.dcut(steep_table(), RHOS)
    assert p.plan(16).draft and p.plan(16).ahead  # drafting is on
    skip = p.skipping[16]
    skip.state, skip.skipped = "off", 10 ** 6  # a probe is long due
    plan = p.plan(16)
    assert plan.draft and not plan.ahead and skip.state == "off"  # a probe
    assert Policy.static(0.5).plan(16).ahead


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
        return p.skip(16).score(drafting(16, 0.5, 25.0))[0] > 0
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
    assert p.skip(4).state == "off"
    lines = explain(stats, p)
    said = [line for line in lines if line.startswith("drafting is off")]
    assert said and "where the cheapest costs 3.0 AR steps; a probe checks again after" in said[0]
    assert any("realized 1.50: 2.50 tokens per request per step" in line for line in lines)


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
