"""Skipped drafting does not cost the drafter its context: while drafting is off, verification only
holds the target's taps, and the next drafting step writes the missing context K/V from them
(runner.Runner.catch_up, in the step's one host-to-device copy), reporting the seconds it took to the
policy. Checked against the K/V computed from scratch over the committed text, with a control where the
catch-up is switched off (the check must then fail)."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from minidcut.engine import Engine
from minidcut.layers import rope_cos_sin
from minidcut.loader import load_drafter, load_target
from minidcut.model import prefill_layout
from minidcut.policy import Policy
from tiny import make_drafter, make_model


class SkipsThenDrafts(Policy):
    """static rho = 0.5, but the first `skips` steps do not draft (like dcut with drafting switched off)."""

    def __init__(self, skips: int):
        super().__init__("static", [0.5])
        self.skips, self.catchups, self.behind = skips, [], []

    def plan(self, bucket, behind=0, n_live=None, usable=None):
        self.skips -= 1
        self.behind.append(behind)
        return dataclasses.replace(super().plan(bucket, behind, n_live, usable), draft=self.skips < 0)

    def observe(self, rec):
        self.catchups.append((rec.catchup, rec.caught_up))


@pytest.fixture
def pair(tmp_path):
    hf = make_model(tmp_path / "target", "llama", num_hidden_layers=3)
    make_drafter(tmp_path / "drafter", hf.config, n_layers=2, target_layer_ids=[0, 2])
    target = load_target(tmp_path / "target")
    return target, load_drafter(tmp_path / "drafter", target)


def context_kv_error(target, drafter, prompts, outputs) -> float:
    """Max |drafter context K/V in the cache - K/V from scratch| over every committed position
    before each row's last anchor."""
    err = 0.0
    for row, (p, o) in enumerate(zip(prompts, outputs)):
        seq = torch.tensor(p + o[:-1])  # positions < the last anchor
        layout, _ = prefill_layout([0], [len(seq)], seq.device)
        target.setup_cache(1, 64)
        _, taps = target(seq, layout, taps=drafter.taps)
        feats = drafter.hidden_norm(drafter.fc(taps))
        pos = torch.arange(len(seq))
        cos, sin = rope_cos_sin(drafter.inv_freq, pos, feats.dtype)
        for layer, cache in zip(drafter.layers, drafter.caches):
            k, v = layer.self_attn.project_kv(feats, cos, sin)  # [T, n_kv, Dh]
            err = max(err, (cache.k[row, :, pos].transpose(0, 1) - k).abs().max().item(),
                      (cache.v[row, :, pos].transpose(0, 1) - v).abs().max().item())
    return err


@pytest.mark.parametrize("catch_up", [True, False])
@torch.inference_mode()
def test_drafting_after_skipped_steps_sees_the_whole_context(pair, monkeypatch, catch_up):
    target, drafter = pair
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 90, (L,), generator=g).tolist() for L in (7, 12)]
    if not catch_up:
        from minidcut.runner import Runner
        monkeypatch.setattr(Runner, "catch_up", lambda self, sent: 0.0)
    policy = SkipsThenDrafts(skips=6)
    engine = Engine(target, drafter, policy, batch_size=2, max_seq=64, eos_ids=[], compile=False)
    outputs, stats = engine.generate(prompts, 24)
    assert stats.rho_hist[0.0] == 6 and stats.rho_hist[0.5] >= 1  # skipped 6 steps, then drafted
    if catch_up:  # only the first drafting step caught up: the 2 x 6 positions the plans were told of
        assert policy.behind[:7] == [0, 2, 4, 6, 8, 10, 12] and policy.behind[7] == 0
        assert policy.catchups[6][0] > 0 and policy.catchups[6][1] == 12
        assert policy.catchups[:6] == [(0.0, 0)] * 6 and not any(c for c, _ in policy.catchups[7:])
    err = context_kv_error(target, drafter, prompts, outputs)
    if catch_up:
        assert err < 1e-4
    else:
        assert err > 1e-2  # the control: without the catch-up, the skipped steps' context is missing


@torch.inference_mode()
def test_a_step_that_does_not_draft_runs_none_of_the_drafters_layers(pair):
    """While drafting is off a step costs what an AR step does, plus one copy of the taps: the fusion
    (fc) runs at the prefill and at the catch-up, never in a skipped step."""
    target, drafter = pair
    fused = []  # tokens through fc, per call
    drafter.fc.register_forward_hook(lambda m, args, out: fused.append(args[0].shape[0]))
    per_step = []
    engine = Engine(target, drafter, SkipsThenDrafts(skips=5), batch_size=2, max_seq=64, eos_ids=[], compile=False)
    engine.generate([[3, 4, 5], [6, 7, 8, 9]], 20, on_step=lambda stats, rec: per_step.append(list(fused)))
    assert per_step[0] == [7]  # step 1: the prefill (3 + 4 prompt tokens), nothing after it
    assert per_step[4] == [7]  # steps 1-5 skipped drafting: no fc after the prefill
    assert per_step[5][:2] == [7, 10]  # step 6 drafts: first the catch-up of 2 rows x 5 positions


class OffThenDrafts(SkipsThenDrafts):
    """SkipsThenDrafts whose drafting is off (as a skip controller's state says) until it drafts."""

    def drafting_off(self, bucket):
        return self.skips > 0


@torch.inference_mode()
def test_a_prefill_where_drafting_is_off_leaves_the_prompts_context_to_the_catch_up(pair):
    """Where drafting is off a prefill runs none of the drafter's layers either: it holds the prompts'
    taps, and the first drafting step writes their context with the skipped steps'. The context then
    matches the one computed from scratch, and the tokens are AR's."""
    target, drafter = pair
    fused = []  # tokens through fc, per call
    drafter.fc.register_forward_hook(lambda m, args, out: fused.append(args[0].shape[0]))
    prompts, per_step = [[3, 4, 5], [6, 7, 8, 9]], []
    policy = OffThenDrafts(skips=5)
    engine = Engine(target, drafter, policy, batch_size=2, max_seq=64, eos_ids=[], compile=False)
    outputs, stats = engine.generate(prompts, 20, on_step=lambda s, rec: per_step.append(list(fused)))
    assert per_step[4] == []  # the prefill and 5 skipped steps: no fc
    assert per_step[5][0] == 7 + 10  # the catch-up: 3 + 4 prompt positions, and 2 rows x 5 steps
    assert policy.behind[:6] == [7, 9, 11, 13, 15, 17] and policy.catchups[5][1] == 17
    assert context_kv_error(target, drafter, prompts, outputs) < 1e-4
    ar, _ = Engine(target, None, Policy.ar(), batch_size=2, max_seq=64, eos_ids=[], compile=False).generate(prompts, 20)
    assert outputs == ar


@torch.inference_mode()
def test_the_engine_reports_each_steps_seconds_to_the_policy(pair):
    """Cost calibration needs the loop's measured step seconds: drafting steps and AR steps both."""
    from minidcut.cost_model import CostTable
    target, drafter = pair
    # Drafting steps priced at 10x an AR step: the random drafter's steps lose, drafting goes off.
    table = CostTable([1, 2], [0.0, 0.5, 1.0], [[1e-4, 1e-3, 1.5e-3], [1e-4, 1e-3, 1.5e-3]])
    policy = Policy.dcut(table, [0.0, 0.5, 1.0], patience=2, probe_every=4)
    seen = []
    observe = policy.observe
    policy.observe = lambda rec: (seen.append(rec), observe(rec))
    engine = Engine(target, drafter, policy, batch_size=2, max_seq=96, compile=False)
    engine.generate([[3, 4, 5], [6, 7]], 30)
    assert {r.drafted for r in seen} == {True, False}  # the random drafter loses: drafting switches off
    assert all(r.seconds > 0 for r in seen)
    assert table.row(2, [0.0, 0.5])[0] != 1e-4 and table.samples[1][0] > 1  # both refined by the loop's steps


@torch.inference_mode()
def test_a_runs_decode_seconds_hold_the_policys_plan_and_feedback(pair):
    """tok/s is generated tokens over prefill + decode seconds: a policy's work before and after each
    step (plan, observe) counts, as it does in the wall time a user waits."""
    class Slow(SkipsThenDrafts):
        def plan(self, bucket, behind=0, n_live=None, usable=None):
            time.sleep(0.01)
            return super().plan(bucket, behind, n_live, usable)

        def observe(self, rec):
            time.sleep(0.01)
            super().observe(rec)

    target, drafter = pair
    engine = Engine(target, drafter, Slow(skips=3), batch_size=2, max_seq=64, eos_ids=[], compile=False)
    _, stats = engine.generate([[3, 4, 5], [6, 7]], 12)
    assert stats.seconds["bookkeeping"] >= 0.02 * stats.steps
    assert stats.decode_seconds >= 0.02 * stats.steps + stats.seconds["verify"]
