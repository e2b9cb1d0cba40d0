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
from tiny import make_model

RHOS = [0.0, 0.25, 0.5, 0.75, 1.0]


def steep_table():
    """Dense target on a compute-bound machine: verify cost grows with the verified token count."""
    return CostTable([16, 64], RHOS, [[1.0, 1.6, 2.2, 2.8, 3.4], [1.0, 2.5, 4.0, 5.5, 7.0]])


def flat_table():
    """MoE-like: nearly flat in rho (the paper's profile of an MoE target: 80 / 85 / 86 / 91 ms)."""
    return CostTable([16, 64], RHOS, [[1.0, 1.10, 1.12, 1.14, 1.16], [1.0, 1.06, 1.08, 1.09, 1.14]])


def drafting(B, rho, predicted, accepted=None, n_live=None, seconds=0.0, usable=None):
    """A StepRecord of a drafting step."""
    return StepRecord(bucket=B, n_live=n_live or B, drafted=True, rho=rho, predicted=predicted,
                      accepted=int(predicted) if accepted is None else accepted, seconds=seconds, usable=usable)


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
    draft = engine.runner.draft(z, z + 3, [15, 15], 2, policy.plan(2))
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


# ---- skipping drafting: the rule's behaviour on a simulated machine -------------------------------

class World:
    """A batch size's two arms as a machine delivers them: a drafting step commits `tokens` per row in
    `draft_s` seconds, an AR step one in `ar_s`; every step's seconds spread by +-`noise` (uniform)."""

    def __init__(self, tokens, draft_s, ar_s=1.0, noise=0.0, seed=0, B=16):
        self.tokens, self.draft_s, self.ar_s, self.noise, self.B = tokens, draft_s, ar_s, noise, B
        self.rng = torch.Generator().manual_seed(seed)

    def jitter(self) -> float:
        return 1.0 + self.noise * (2 * float(torch.rand((), generator=self.rng)) - 1)

    def step(self, draft: bool, poor: bool = False) -> StepRecord:
        if not draft:
            return ar_step(self.B, seconds=self.ar_s * self.jitter())
        accepted = 0 if poor else round((self.tokens - 1) * self.B)
        return drafting(self.B, 0.5, float(accepted), accepted=accepted, seconds=self.draft_s * self.jitter())


def play(policy, world, steps, poor_first=0, B=16) -> tuple[list[bool], float, float]:
    """Run `steps` steps of the policy at B in the world; returns which drafted, and the tokens per row
    and seconds delivered. The first `poor_first` drafting steps accept nothing."""
    drafted, tokens, seconds = [], 0.0, 0.0
    for _ in range(steps):
        draft = policy.plan(B).draft
        rec = world.step(draft, poor=draft and sum(drafted) < poor_first)
        policy.observe(rec)
        drafted.append(draft)
        tokens += 1 + rec.accepted / rec.n_live
        seconds += rec.seconds
    return drafted, tokens, seconds


def flat16():
    """B = 16 only, every drafting budget priced 1.6 AR steps: the table leaves the rule to the clock."""
    return CostTable([16], RHOS, [[1.0, 1.6, 1.6, 1.6, 1.6]])


WINS = dict(tokens=2.5, draft_s=1.6)  # drafting 2.5 / 1.6 = 1.56x an AR step's tokens per second
LOSES = dict(tokens=1.3, draft_s=1.6)  # 1.3 / 1.6 = 0.81x


def test_drafting_stays_on_where_it_wins_even_after_poor_first_steps_on_a_noisy_clock():
    for seed in range(5):
        p = Policy.dcut(flat16(), RHOS, calibrate=False)
        drafted, tokens, seconds = play(p, World(**WINS, noise=0.3, seed=seed), 300, poor_first=3)
        assert sum(drafted[-200:]) >= 195  # on, bar a few tries of AR
        assert tokens / seconds >= 0.95 * 2.5 / 1.6  # within 5 % of drafting every step


def test_drafting_goes_off_where_it_loses():
    p = Policy.dcut(flat16(), RHOS, calibrate=False)
    drafted, _, _ = play(p, World(**LOSES, noise=0.05), 20)
    assert drafted[:3] == [True, True, False]  # on a steady clock: off after its first two steps
    for seed in range(5):  # on a noisy one, within 3 % of AR steps only (AR: 1 token a second)
        p = Policy.dcut(flat16(), RHOS, calibrate=False)
        drafted, tokens, seconds = play(p, World(**LOSES, noise=0.3, seed=seed), 300)
        assert sum(drafted[100:]) <= 20 and tokens / seconds >= 0.97


def test_probing_costs_a_bounded_share_of_a_run_where_drafting_never_pays():
    p = Policy.dcut(flat16(), RHOS, calibrate=False)
    drafted, tokens, seconds = play(p, World(**LOSES, noise=0.1), 4000)
    assert sum(drafted) <= 2 + 6 + 4000 // 256 + 2  # the first steps, one try per doubling, then one per MAX_WAIT
    assert tokens / seconds >= 0.99


def test_drafting_comes_back_when_the_workload_changes_and_goes_again():
    p = Policy.dcut(flat16(), RHOS, calibrate=False)
    off, _, _ = play(p, World(**LOSES, noise=0.2), 100)
    assert sum(off[-50:]) <= 2
    back, _, _ = play(p, World(**WINS, noise=0.2, seed=1), 300)
    first_on = back.index(True)
    assert first_on <= 256 and sum(back[first_on:]) >= 0.95 * len(back[first_on:])
    again, _, _ = play(p, World(**LOSES, noise=0.2, seed=2), 100)
    assert sum(again[20:]) <= 3  # a clear loss ends it within the score's memory


def test_trying_ar_while_drafting_wins_costs_a_bounded_share():
    p = Policy.dcut(flat16(), RHOS, calibrate=False)
    drafted, _, _ = play(p, World(**WINS, noise=0.1), 2000)
    assert len(drafted) - sum(drafted) <= 6 + 2000 // 256 + 1  # one AR try per doubling, then per MAX_WAIT


def test_a_win_smaller_than_the_margin_does_not_flip_the_arm_back_and_forth():
    p = Policy.dcut(flat16(), RHOS, calibrate=False)
    drafted, _, _ = play(p, World(tokens=1.63, draft_s=1.6, noise=0.02), 500)  # drafting 2 % ahead
    switches = sum(a != b for a, b in zip(drafted, drafted[1:]))
    assert switches <= 2 * (6 + 2) and sum(drafted) > 450


def test_what_drafting_pays_around_its_steps_counts_against_it():
    """Drafting steps that win on their own seconds lose once a draft made afresh every step is counted
    (rows changing hands): the rule scores drafting by all it paid."""
    on = {}
    for redraft in (0.0, 1.0):
        p = Policy.dcut(flat16(), RHOS, calibrate=False)
        for _ in range(10):
            draft = p.plan(16).draft
            rec = World(**WINS).step(draft)
            p.observe(dataclasses.replace(rec, redraft=redraft) if draft else rec)
        on[redraft] = p.plan(16).draft
    assert on == {0.0: True, 1.0: False}


def test_steps_that_compiled_or_were_timed_or_could_not_pay_teach_nothing():
    p = Policy.dcut(flat16(), RHOS, calibrate=False)
    s = p.skip(16)
    before = s.state_dict
    s.observe(drafting(16, 0.5, 0.0, seconds=0.0))  # compiled a graph: no seconds
    s.observe(dataclasses.replace(drafting(16, 0.5, 0.0, seconds=5.0), timed=True))  # the profiler's
    s.observe(drafting(16, 0.5, 0.0, seconds=5.0, n_live=1, usable=0))  # rows at their end
    assert s.state_dict == before


def test_rows_at_their_end_do_not_draft():
    p = Policy.dcut(flat16(), RHOS, calibrate=False)
    assert p.plan(16, n_live=16, usable=16 * 15).draft
    assert not p.plan(16, n_live=2, usable=0).draft  # nothing left to draft: cannot pay


def test_policy_never_drafts_where_the_table_says_even_perfect_drafts_cannot_beat_ar():
    """B = 64, a drafting step costs 20+ AR steps: even 64 rows accepting a whole budget cannot pay."""
    p = Policy.dcut(CostTable([64], RHOS, [[1.0, 20.0, 21.0, 22.0, 23.0]]), RHOS)
    assert not any(p.plan(64).draft for _ in range(1000))


def test_only_a_step_whose_next_step_drafts_drafts_ahead():
    p = Policy.dcut(flat16(), RHOS, calibrate=False)
    plans = []
    for _ in range(20):
        plan = p.plan(16)
        plans.append((plan.draft, plan.ahead))
        p.observe(World(**WINS).step(plan.draft))
    for (draft, ahead), (next_draft, _) in zip(plans, plans[1:]):
        assert not draft or ahead == next_draft  # no draft ahead of the AR try


def test_hopeless_drafts_score_below_ar_steps():
    p = Policy.dcut(steep_table(), RHOS, calibrate=False)
    for _ in range(2):
        assert p.plan(16).draft
        p.observe(drafting(16, 0.25, 0.0, accepted=0, seconds=1.6))
    assert p.skip(16).score(True) < p.skip(16).score(False) and not p.plan(16).draft


def test_drafting_is_scored_by_its_measured_seconds_not_by_the_tables():
    """The table prices a drafting step at 1.6 AR steps, where 2.5 tokens a row pay; the loop measures
    6.6 (host work the profile did not see): drafting goes off, calibrated or not."""
    for calibrate in (True, False):
        p = Policy.dcut(flat16(), RHOS, calibrate=calibrate)
        play(p, World(tokens=2.5, draft_s=6.6), 6)
        assert not p.plan(16).draft


def test_the_ar_arm_starts_from_the_tables_entry_then_follows_its_own_steps():
    p = Policy.dcut(flat16(), RHOS, calibrate=False)
    assert p.skip(16).score(False) == pytest.approx(1.0) and p.skip(16).score(True) is None
    for _ in range(200):
        p.skip(16).observe(ar_step(16, seconds=2.0))  # AR steps twice as slow as the table says
    assert p.skip(16).score(False) == pytest.approx(0.5, rel=1e-3)


def lose_twice(p, B=16):
    for _ in range(2):  # drafting steps that accepted nothing at the table's seconds: drafting goes off
        if p.plan(B).draft:
            p.observe(drafting(B, 0.25, 0.0, accepted=0, seconds=1.6))


def test_policy_state_outlives_a_generate_call_and_the_skip_state_is_per_batch_size():
    p = Policy.dcut(steep_table(), RHOS)
    p.observe(drafting(16, 0.25, 10.0, accepted=5))  # a calibration sample: half the drafts accepted
    lose_twice(p)
    assert not p.plan(16).draft  # nothing is forgotten between steps or generate() calls
    scale = p.calibration.gain_scale
    assert scale < 1.0
    assert p.plan(64).draft and p.calibration.gain_scale == scale  # B = 64 decides on its own
    p.reset()
    assert p.calibration.gain_scale == 1.0 and p.plan(16).draft


def test_policy_state_saved_and_loaded_continues_where_it_stopped():
    p = Policy.dcut(steep_table(), RHOS)
    p.observe(drafting(16, 0.25, 10.0, accepted=5, seconds=3.2))
    lose_twice(p)
    q = Policy.dcut(steep_table(), RHOS)
    assert q.load_state(json.loads(json.dumps(p.state))) == []  # through JSON, as in the table's file
    assert q.state == p.state and not q.skipping[16].drafting and not q.plan(16).draft
    assert q.calibration.gain_scale == p.calibration.gain_scale < 1.0
    assert "seconds" not in q.state["calibration"]  # step costs live in the table, not in the state
    for bad in ({}, {"calibration": {"gain_scale": "x"}, "skipping": {}},
                {"calibration": p.state["calibration"], "skipping": {"16": {"drafting": "maybe"}}}):
        r = Policy.dcut(steep_table(), RHOS)
        with pytest.raises(ValueError, match="not a saved policy state"):
            r.load_state(bad)
        assert r.calibration.gain_scale == 1.0 and r.plan(16).draft  # nothing half-loaded


def test_a_state_saved_by_the_earlier_skip_rule_loads_without_its_skip_state(tmp_path):
    """A table saved by the earlier rule (a confidence bound over drafting's gain): its calibration is
    kept, its skip states dropped, said in one line."""
    from minidcut.api import build_policy

    old = {"calibration": {"gain_scale": 0.7, "accepted": {"realized": 7.0, "predicted": 10.0}},
           "skipping": {"16": {"state": "off", "evidence": [1.0, -1.0, 1.0, 1.0], "drafting_steps": 9,
                               "skipped": 3, "catchup_per_position": 0.0, "accepted": [0.0, 0.0],
                               "failed_probes": 1}}}
    table = flat16()
    table.state = old
    lines = []
    p = build_policy("dcut", table=table, log=lines.append)
    assert len(lines) == 1 and "dropped" in lines[0] and "16" in lines[0]
    assert p.calibration.gain_scale == 0.7
    assert p.plan(16).draft and p.skip(16).score(True) is None  # drafting starts from nothing there


def test_the_summary_says_whether_drafting_is_on_and_what_each_arm_delivered():
    from minidcut.explain import explain
    from minidcut.stats import Stats

    p = Policy.dcut(flat16(), RHOS, calibrate=False)
    stats = Stats()
    for _ in range(2):
        assert p.plan(16).draft
        rec = drafting(16, 0.5, 8.0, accepted=8, seconds=1.6)  # 1.5 tokens a row in 1.6 AR steps
        p.observe(rec)
        stats.add(rec, 15, 15, 1.0)
    said = [line for line in explain(stats, p) if line.startswith("drafting is")]
    assert said and said[0].startswith("drafting is off at bucket 16 (drafting steps 1066.7 ms a token per "
                                       "request; AR steps 1000.0 ms")


def test_drafting_off_says_where_a_prefill_may_leave_the_drafters_context_for_later():
    p = Policy.dcut(steep_table(), RHOS)
    assert not p.drafting_off(16) and not p.drafting_off(32)  # drafting on; 32: no row, no controller
    lose_twice(p)
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
