"""Cost tables and the adaptive rho choice (PAPER.md section 3 step 5)."""

import json

import pytest
import torch

from minidcut import dcut
from minidcut.cost_model import CostTable, CostTableError, table_path
from minidcut.policy import PROBE_BUDGET, Policy

RHOS = [0.0, 0.25, 0.5, 0.75, 1.0]


def steep_table():
    """Dense target on a compute-bound machine: verify cost grows with the verified token count."""
    return CostTable([16, 64], RHOS, [[1.0, 1.6, 2.2, 2.8, 3.4], [1.0, 2.5, 4.0, 5.5, 7.0]])


def flat_table():
    """MoE-like: nearly flat in rho (PAPER.md: 80 / 85 / 86 / 91 ms)."""
    return CostTable([16, 64], RHOS, [[1.0, 1.10, 1.12, 1.14, 1.16], [1.0, 1.06, 1.08, 1.09, 1.14]])


def test_cost_table_round_trips_through_json(tmp_path):
    t = CostTable([1, 8], RHOS, [[1, 2, 3, 4, 5], [2, 3, 4, 5, 6]], {"device": "x"})
    back = CostTable.load(t.save(tmp_path / "t.json"))
    assert back.batch_sizes == t.batch_sizes and back.rhos == t.rhos
    assert back.seconds == t.seconds and back.meta == t.meta


def test_cost_interpolates_linearly_in_batch_size_and_rho():
    t = CostTable([8, 16], [0.0, 1.0], [[1.0, 3.0], [2.0, 6.0]])
    assert t.cost(8, 0.5) == pytest.approx(2.0)
    assert t.cost(12, 0.0) == pytest.approx(1.5)
    assert t.cost(12, 1.0) == pytest.approx(4.5)
    assert t.cost(4, 1.0) == pytest.approx(3.0)  # below the table: the smallest profiled size
    assert t.cost(32, 1.0) == pytest.approx(12.0)  # above: proportional to B


def test_missing_table_is_a_clear_error(tmp_path):
    with pytest.raises(CostTableError, match="not found"):
        CostTable.load(tmp_path / "nope.json")


@pytest.mark.parametrize("text", ["{not json", json.dumps({"rhos": [0, 1]}),
                                  json.dumps({"batch_sizes": [1], "rhos": [0, 1], "seconds": [[1.0]]}),
                                  json.dumps({"batch_sizes": [1], "rhos": [0, 1], "seconds": [[1.0, -2.0]]})])
def test_corrupt_table_is_a_clear_error(tmp_path, text):
    p = tmp_path / "bad.json"
    p.write_text(text)
    with pytest.raises(CostTableError):
        CostTable.load(p)


def choose(table, B, conf, **kw):
    """The dcut policy's in-graph decision, run eagerly: rho* for confidences conf [B, D]."""
    policy = Policy.dcut(table, RHOS, **kw)
    Ks = [dcut.budget(r, B, conf.shape[1]) for r in RHOS]
    log_s = dcut.prefix_scores(conf, torch.full((B,), conf.shape[1]))
    gain = dcut.gains(log_s, Ks, torch.tensor(float(B)))
    return RHOS[int(dcut.choose_rho(gain, policy.cost_vector(B, "cpu")))]


def pays(policy, predicted, n_live, rho) -> bool:
    """Whether one drafting step is predicted to commit more tokens than AR steps in its time."""
    value, ar_equiv = policy.step_value(predicted, n_live, rho)
    return value > ar_equiv


def test_rho_choice_prunes_hard_on_steep_costs_and_keeps_more_on_flat_costs():
    torch.manual_seed(0)
    B, D = 64, 15
    conf = torch.rand(B, D) * 0.3 + 0.7  # a decent drafter: confidences 0.7..1.0
    steep, flat = choose(steep_table(), B, conf), choose(flat_table(), B, conf)
    assert steep <= 0.25
    assert flat >= 0.75


def test_hopeless_drafts_fall_back_to_ar():
    conf = torch.full((16, 15), 0.02)
    # Without skip drafting, the step itself falls back to rho = 0 (an AR verification).
    assert choose(steep_table(), 16, conf, skip_drafting=False) == 0.0
    # With it, the paid-for draft keeps the smallest budget, and the step counts as lost to AR.
    assert choose(steep_table(), 16, conf) == 0.25
    p = Policy.dcut(steep_table(), RHOS, calibrate=False)
    p.configure(16, 15)
    assert not pays(p, float(conf[:, 0].sum()), 16, 0.25)


def test_skip_drafting_switches_off_after_patience_and_reprobes():
    # B = 16: a drafting step costs 1.04 AR steps, so a probe that keeps nothing loses 0.04 AR steps:
    # the probe period is 0.04 / PROBE_BUDGET + 1 = 5 steps, probe_every.
    cheap = CostTable([16], RHOS, [[1.0, 1.04, 1.05, 1.06, 1.07]])
    p = Policy.dcut(cheap, RHOS, patience=3, probe_every=5)
    p.configure(16, 15)
    drafted = []
    stream = [0] * 3 + [0] * 20  # rho* = 0 (K = 0) whenever the policy drafts
    for K in stream:
        d = p.draft_now()
        drafted.append(d)
        p.observe(0.1 if d else None, 0, K if d else 0, 16)
    assert drafted[:3] == [True, True, True]
    assert not any(drafted[3:7])  # switched off...
    assert drafted[7]  # ...then a probe after probe_every steps,
    assert [i for i, d in enumerate(drafted) if d][3:] == [7, 12, 17, 22]  # one every probe period


def test_skip_drafting_turns_back_on_when_a_probe_finds_a_budget_worth_verifying():
    """B = 16, steep table: a drafting step at rho = 0.25 costs 1.6 AR steps. Two steps that kept nothing
    lose 0.6 AR-step tokens per row each; a probe that is predicted to commit 1 + 40 / 16 = 3.5 tokens
    per row (1.9 more than AR steps in its time) outweighs them: drafting is back on. A probe that
    barely pays (1 + 12 / 16 = 1.75, +0.15) does not outweigh them."""
    def after_probe(predicted):
        p = Policy.dcut(steep_table(), RHOS, patience=2, probe_every=3, calibrate=False)
        p.configure(16, 15)
        for _ in range(2):
            p.draft_now()
            p.observe(0.1, 0, 0, 16, 0.0)
        while not p.draft_now():
            p.observe(None, 0, 0)
        p.observe(predicted, int(predicted), 64, 16, 0.25)
        return [p.draft_now() for _ in range(2)]  # (probes are cheap here: the next comes after 3)
    assert all(after_probe(40.0))
    assert not any(after_probe(12.0))


def test_calibration_tracks_realized_over_predicted_accepted_drafts():
    p = Policy.dcut(steep_table(), RHOS)
    for _ in range(200):  # an over-confident drafter: realizes half of what it predicts
        p.observe(10.0, 5, 64)
    assert p.gain_scale == pytest.approx(0.5, rel=0.02)
    q = Policy.dcut(steep_table(), RHOS, calibrate=False)
    for _ in range(50):
        q.observe(10.0, 5, 64)
    assert q.gain_scale == 1.0


def test_policy_never_drafts_where_the_table_says_even_perfect_drafts_cannot_beat_ar():
    # B = 64: an AR step costs 1.0, any drafting step >= 20: even all K accepted cannot pay for it.
    hopeless = CostTable([64], RHOS, [[1.0, 20.0, 21.0, 22.0, 23.0]])
    p = Policy.dcut(hopeless, RHOS)
    p.configure(64, 15)
    assert not p.drafting_possible and not p.draft_now()
    p = Policy.dcut(steep_table(), RHOS)
    p.configure(64, 15)
    assert p.drafting_possible and p.draft_now()


def test_probes_are_rarer_where_drafting_costs_more_than_an_ar_step():
    p = Policy.dcut(CostTable([1, 64], RHOS, [[1.0, 1.1, 1.2, 1.3, 1.4], [1.0, 8.0, 9.0, 10.0, 11.0]]), RHOS)
    assert p.probe_period(1) == p.probe_every  # a probe costs 0.1 of an AR step: the floor applies
    assert p.probe_period(64) >= 7.0 / PROBE_BUDGET  # 7 extra AR steps per probe, <= PROBE_BUDGET of the time
    p.configure(64, 15)
    for _ in range(30):  # drafting steps that get 5 drafts per row accepted: a probe commits 6 tokens a row
        p.observe(5.0 * 64, 5 * 64, 960, 64, 0.25)
    assert p.probe_period(64) == pytest.approx(1 + 2.0 / PROBE_BUDGET, abs=1)  # it loses 8 - 6 AR steps, not 7


def test_steps_with_few_live_rows_weigh_what_they_commit():
    """B = 8, a drafting step costs 3 AR steps. Full-batch steps commit 2.5 tokens a row (8 rows: 4 tokens
    fewer than AR steps in their time); at the end of a batch one live row keeps more of the budget and
    commits 7 (4 more). Two tail steps and six full ones, over and over: 16 tokens lost each time, so drafting
    must switch off, though the tail steps win by more per row than the full ones lose."""
    p = Policy.dcut(CostTable([8], RHOS, [[1.0, 3.0, 3.2, 3.4, 3.6]]), RHOS, calibrate=False, patience=2)
    p.configure(8, 15)
    switched_off = False
    for _ in range(3):
        for n_live, predicted in [(1, 6.0)] * 2 + [(8, 12.0)] * 6:  # a batch's tail, then the next batch
            if p.draft_now():
                p.observe(predicted, int(predicted), 30, n_live, 0.25)
            else:
                switched_off = True
                p.observe(None, 0, 0, n_live)
    assert switched_off


def test_probes_are_priced_on_what_drafting_usually_gets_not_on_the_last_hard_stretch():
    """B = 1, a drafting step costs 2.9 AR steps. 200 steps that commit 4 tokens (drafting pays), then a
    hard request (nothing accepted): drafting switches off within 30 steps, but probes stay cheap (the long
    mean is ~2.4 accepted drafts, so a probe is expected to win), so they come every probe_every steps
    instead of every ~127 (what the hard stretch alone would price them at)."""
    p = Policy.dcut(CostTable([1], RHOS, [[1.0, 2.9, 3.0, 3.1, 3.2]]), RHOS, calibrate=False)
    p.configure(1, 15)
    for _ in range(200):
        p.observe(3.0, 3, 4, 1, 0.25)
    hard = 0
    while p.draft_now():  # the hard request: drafting switches off
        p.observe(0.0, 0, 4, 1, 0.25)
        hard += 1
    assert hard <= 30
    steps = 1  # the AR step that draft_now() just chose
    p.observe(None, 0, 0)
    while not p.draft_now():
        p.observe(None, 0, 0)
        steps += 1
    assert steps + 1 == p.probe_every  # the probe is step probe_every after switching off


def test_a_probes_catch_up_of_the_drafters_context_makes_probes_rarer():
    p = Policy.dcut(CostTable([64], RHOS, [[1.0, 8.0, 9.0, 10.0, 11.0]]), RHOS, calibrate=False)
    p.configure(64, 15)
    assert p.probe_period(64) == pytest.approx(1 + 7.0 / PROBE_BUDGET, abs=1)  # 7 AR steps lost a probe
    p.observe(0.0, 0, 240, 64, 0.25, catchup=2.0)  # a probe that first spent 2 AR steps catching up
    assert p.probe_period(64) == pytest.approx(1 + 9.0 / PROBE_BUDGET, abs=1)


def test_policy_state_outlives_a_generate_call_but_skip_state_restarts_for_another_batch_size():
    p = Policy.dcut(steep_table(), RHOS, patience=2, probe_every=5)
    p.configure(16, 15)
    p.observe(10.0, 5, 64, 16, 0.25)  # a calibration sample: half of the predicted drafts were accepted
    for _ in range(2):  # two drafting steps that chose rho = 0: drafting switches off
        p.draft_now()
        p.observe(10.0, 5, 0)
    p.configure(16, 15)  # what the next generate() call does: nothing is forgotten
    assert not p.draft_now()
    scale = p.gain_scale
    assert scale < 1.0
    p.configure(64, 15)  # another batch size: the skip decision is learned again, calibration kept
    assert p.draft_now() and p.gain_scale == scale
    p.reset()
    assert p.gain_scale == 1.0


def test_table_path_names_device_models_and_dtype_and_changes_with_a_model_config(tmp_path):
    for name in ("target", "drafter"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text('{"hidden_size": 64}')
    path = table_path("cpu", tmp_path / "target", tmp_path / "drafter", torch.float32, tmp_path)
    assert path.parent == tmp_path and path.name.startswith("cpu") and "__target-" in path.name
    assert "__drafter-" in path.name and path.name.endswith("__float32.json")
    assert table_path("cpu", tmp_path / "target", tmp_path / "drafter", torch.float32, tmp_path) == path
    (tmp_path / "drafter" / "config.json").write_text('{"hidden_size": 64, "block_size": 8}')  # retrained
    assert table_path("cpu", tmp_path / "target", tmp_path / "drafter", torch.float32, tmp_path) != path


def test_a_drafting_step_prices_rho_zero_as_a_drafting_step_when_drafting_can_be_skipped():
    p = Policy.dcut(steep_table(), RHOS)
    costs = p.cost_vector(16, "cpu").tolist()
    assert costs[0] == costs[1] == pytest.approx(1.6)  # the draft is paid: rho = 0 saves nothing
    q = Policy.dcut(steep_table(), RHOS, skip_drafting=False)  # no other way back to AR steps
    assert q.cost_vector(16, "cpu").tolist()[0] == pytest.approx(1.0)


def test_drafting_switches_off_when_drafting_steps_are_predicted_to_lose_to_ar_steps_on_average():
    """B = 16, steep table: rho = 0.5 costs 2.2 AR steps, so a step pays only above 1.2 * 16 = 19.2
    predicted accepted drafts (calibrated). One acceptance is noisy: the running mean over recent
    drafting steps decides, so a short dip does not switch drafting off and a lasting one does."""
    p = Policy.dcut(steep_table(), RHOS, patience=3, calibrate=False)
    p.configure(16, 15)
    for _ in range(10):  # 30 predicted accepted drafts per step: drafting pays, stays on
        assert p.draft_now()
        p.observe(30.0, 30, 120, 16, 0.5)
    assert pays(p, 30.0, 16, 0.5) and not pays(p, 10.0, 16, 0.5)
    losing = 0
    while p.draft_now():  # 10 per step: an AR step commits faster
        p.observe(10.0, 10, 120, 16, 0.5)
        losing += 1
        assert losing < 30
    assert 3 < losing  # not on the first losing steps: the 10 good ones still weigh
    q = Policy.dcut(steep_table(), RHOS, patience=3, calibrate=False)
    q.configure(16, 15)
    for _ in range(3):  # losing from the start: off after `patience` drafting steps
        assert q.draft_now()
        q.observe(10.0, 10, 120, 16, 0.5)
    assert not q.draft_now()


def test_measured_step_seconds_rescale_the_costs_that_decide_whether_drafting_pays():
    """B = 16, steep table: rho = 0.5 is priced at 2.2 AR steps, so 25 predicted accepted drafts per step
    pay ((25 + 16) / 2.2 > 16 / 1). When the loop measures drafting steps at twice the table's seconds,
    they no longer do ((25 + 16) / 4.4 < 16); when both kinds run twice as slow, they still do."""
    def policy(draft_s, ar_s=None):
        p = Policy.dcut(steep_table(), RHOS, patience=3)
        p.configure(16, 15)
        p.gain_scale = 1.0
        for _ in range(5):
            p.observe(25.0, 25, 120, 16, 0.5, seconds=draft_s)
        if ar_s is not None:
            p.observe(None, 0, 0, seconds=ar_s)
        return p
    assert pays(policy(2.2), 25.0, 16, 0.5)
    assert policy(4.4, ar_s=1.0).cost_scale(True) == pytest.approx(2.0)
    assert not pays(policy(4.4, ar_s=1.0), 25.0, 16, 0.5)
    assert pays(policy(4.4, ar_s=2.0), 25.0, 16, 0.5)  # a slower machine, not a dearer draft
    assert policy(4.4).cost_scale(False) == 1.0  # no AR step measured yet: the table's
    # A drafting step that kept nothing (rho = 0) is compared with the table's smallest drafting step.
    p = Policy.dcut(steep_table(), RHOS)
    p.configure(16, 15)
    p.observe(0.1, 0, 0, 16, 0.0, seconds=1.6)
    assert p.cost_scale(True) == pytest.approx(1.0)


def test_measured_costs_switch_drafting_off_where_the_table_is_too_optimistic():
    """The engine's loop pays 3x the table's drafting step (host work the profile did not see): the
    calibrated skip decision switches drafting off; with calibration off, drafting stays on."""
    on = {}
    for calibrate in (True, False):
        p = Policy.dcut(steep_table(), RHOS, patience=3, calibrate=calibrate)
        p.configure(16, 15)
        for _ in range(6):
            if p.draft_now():
                p.observe(25.0, 25, 120, 16, 0.5, seconds=6.6)
            else:
                p.observe(None, 0, 0, seconds=1.0)
        on[calibrate] = p.draft_now()
    assert on == {True: False, False: True}


def test_one_outlier_step_moves_the_cost_scale_little():
    p = Policy.dcut(steep_table(), RHOS)
    p.configure(16, 15)
    for _ in range(20):
        p.observe(None, 0, 0, seconds=1.0)
    p.observe(None, 0, 0, seconds=100.0)  # a GC pause or a compile
    assert p.cost_scale(False) < 1.3


def test_noisy_acceptance_that_pays_on_average_keeps_drafting_on():
    """B = 16, rho = 0.5 pays above 19.2 predicted accepted drafts. A stream of one step at 80 and four
    at 5 (mean 20) pays on average although four steps in five lose: drafting stays on. The same
    stream shifted down (one at 60, four at 5: mean 16) loses on average: drafting goes off."""
    def drafted_share(high):
        p = Policy.dcut(steep_table(), RHOS, patience=4, calibrate=False)
        p.configure(16, 15)
        drafted = 0
        for i in range(200):
            if p.draft_now():
                drafted += 1
                p.observe(high if i % 5 == 0 else 5.0, 0, 120, 16, 0.5)
            else:
                p.observe(None, 0, 0)
        return drafted / 200
    assert drafted_share(80.0) == 1.0
    assert drafted_share(60.0) < 0.2


def test_profiled_costs_are_made_nondecreasing_in_rho_by_pooling_violators():
    from minidcut.profiler import nondecreasing
    assert nondecreasing([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert nondecreasing([18.0, 30.0, 19.0, 20.0]) == pytest.approx([18.0, 23.0, 23.0, 23.0])  # one noisy spike
    assert nondecreasing([35.0, 36.0, 32.0, 38.0]) == pytest.approx([34.333, 34.333, 34.333, 38.0], abs=1e-3)
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]
    out = nondecreasing(xs)
    assert all(a <= b for a, b in zip(out, out[1:])) and sum(out) == pytest.approx(sum(xs))
