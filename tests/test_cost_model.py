"""Cost tables (docs/method.md, "Choosing rho"): rows read only where they were measured, missing rows
measured on the run's own rows when it first reaches their bucket, tables of another machine or setting
ignored, and what the policy learned kept with the table for the next run."""

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from minidcut.api import build_policy, load_table, run_fingerprint, save_table
from minidcut.cost_model import CostTable, CostTableError, fingerprint, table_path
from minidcut.engine import Engine
from minidcut.explain import explain
from minidcut.loader import load_drafter, load_target
from minidcut.policy import Policy
from minidcut.profiler import nondecreasing
from tiny import make_drafter, make_model

RHOS = [0.0, 0.25, 0.5, 0.75, 1.0]


def test_cost_table_round_trips_through_json(tmp_path):
    t = CostTable([1, 8], RHOS, [[1, 2, 3, 4, 5], [2, 3, 4, 5, 6]], {"device": "x"})
    back = CostTable.load(t.save(tmp_path / "t.json"))
    assert back.batch_sizes == t.batch_sizes and back.rhos == t.rhos
    assert back.seconds == t.seconds and back.meta == t.meta


def test_rows_are_read_only_at_measured_batch_sizes_never_scaled():
    t = CostTable([8, 16], [0.0, 1.0], [[1.0, 3.0], [2.0, 6.0]])
    assert t.row(8, [0.0, 1.0]) == [1.0, 3.0] and t.row(16, [1.0]) == [6.0]
    assert t.row(12, [0.0, 1.0]) is None and t.row(32, [0.0]) is None  # no interpolation, no scaling
    assert t.row(8, [0.5]) is None  # nor in rho
    t.add_row(12, [1.5, 4.0])
    assert t.batch_sizes == [8, 12, 16] and t.row(12, [1.0]) == [4.0]
    with pytest.raises(CostTableError):
        t.add_row(4, [1.0])


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


def test_profiled_costs_are_made_nondecreasing_in_rho_by_pooling_violators():
    assert nondecreasing([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert nondecreasing([18.0, 30.0, 19.0, 20.0]) == pytest.approx([18.0, 23.0, 23.0, 23.0])  # one noisy spike
    assert nondecreasing([35.0, 36.0, 32.0, 38.0]) == pytest.approx([34.333, 34.333, 34.333, 38.0], abs=1e-3)
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]
    out = nondecreasing(xs)
    assert all(a <= b for a, b in zip(out, out[1:])) and sum(out) == pytest.approx(sum(xs))


def fp_of(root, **kw) -> dict:
    return {**fingerprint("cpu", root / "target", root / "drafter", torch.float32, False, max_seq=128), **kw}


def test_table_path_names_device_models_dtype_and_positions_and_changes_with_the_fingerprint(tmp_path):
    for name in ("target", "drafter"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text('{"hidden_size": 64}')
    fp = fp_of(tmp_path)
    path = table_path(fp, tmp_path / "target", tmp_path / "drafter", tmp_path)
    assert path.parent == tmp_path and path.name.startswith("cpu") and "__target-" in path.name
    assert "__drafter-" in path.name and "__float32__seq128-" in path.name
    mixed = table_path({**fp, "drafter_dtype": "bfloat16"}, tmp_path / "target", tmp_path / "drafter", tmp_path)
    assert "__float32-bfloat16__" in mixed.name
    assert table_path(fp_of(tmp_path), tmp_path / "target", tmp_path / "drafter", tmp_path) == path
    for other in ({"max_seq": 256}, {"sampling": "sampled"}, {"threads": 99}):
        assert table_path({**fp, **other}, tmp_path / "target", tmp_path / "drafter", tmp_path) != path
    (tmp_path / "drafter" / "config.json").write_text('{"hidden_size": 64, "block_size": 8}')  # retrained
    assert table_path(fp_of(tmp_path), tmp_path / "target", tmp_path / "drafter", tmp_path) != path


def test_runs_whose_caches_round_up_to_the_same_64_positions_share_a_table(tmp_path):
    """An eager run sizes its cache to a multiple of 16 (cli.max_seq): 208 and 256 positions are one
    table, 272 another. A compiled run's graphs read every position: its table is keyed by them (a
    target with 250 positions caps 201 and 240 apart)."""
    key = lambda n, compiled=False: fingerprint("cpu", tmp_path, tmp_path, torch.float32, compiled,  # noqa: E731
                                                max_seq=n)["max_seq"]
    assert key(193) == key(208) == key(256) == 256 and key(272) == 320 and key(64) == 64
    assert key(256, True) == 256 and key(201, True) == 201 and key(240, True) == 240


def test_a_drafter_that_gains_a_draft_vocabulary_gets_a_new_table_and_new_weights_keep_it(tmp_path):
    """Step costs follow the checkpoint's tensor shapes too: a draft vocabulary shrinks the draft's
    lm_head, so the table name and fingerprint change; retrained weights of the same shapes keep both."""
    hf = make_model(tmp_path / "target", "llama", num_hidden_layers=2)
    W = make_drafter(tmp_path / "drafter", hf.config, n_layers=1, target_layer_ids=[1])

    def keys():
        fp = fp_of(tmp_path)
        return table_path(fp, tmp_path / "target", tmp_path / "drafter", tmp_path), fp
    before = keys()
    save_file({k: v + 1 for k, v in W.items()}, str(tmp_path / "drafter" / "model.safetensors"))
    assert keys() == before
    save_file({**W, "draft_vocab": torch.arange(8)}, str(tmp_path / "drafter" / "model.safetensors"))
    after = keys()
    assert after[0] != before[0] and after[1]["drafter_config"] != before[1]["drafter_config"]
    assert after[1]["target_config"] == before[1]["target_config"]


def test_a_row_cut_short_round_trips_as_null_and_is_never_chosen(tmp_path):
    t = CostTable([4], RHOS, [[1.0, 2.0, math.inf, math.inf, math.inf]], state={"x": 1})
    t.save(tmp_path / "t.json")
    assert json.loads((tmp_path / "t.json").read_text())["seconds"] == [[1.0, 2.0, None, None, None]]
    back = CostTable.load(tmp_path / "t.json")
    assert back.row(4, RHOS)[2:] == [math.inf] * 3 and back.state == {"x": 1}
    p = Policy.dcut(back, RHOS, calibrate=False)
    gain = torch.tensor([0.0, 1.0, 50.0, 60.0, 60.0])  # huge gains at the unmeasured budgets
    assert int(p.choose(gain, torch.tensor(4.0), torch.tensor(1.0), torch.tensor(p.plan(4).cost))) == 1
    assert not list(tmp_path.glob("*.tmp"))  # written through a temporary file, then renamed


@pytest.fixture
def pair(tmp_path):
    hf = make_model(tmp_path / "target", "llama", num_hidden_layers=2)
    make_drafter(tmp_path / "drafter", hf.config, n_layers=1, target_layer_ids=[1])
    target = load_target(tmp_path / "target")
    return target, load_drafter(tmp_path / "drafter", target), tmp_path


def run(root, target, drafter, prompts, path, new_tokens=12, log=None):
    """One dcut run as the CLI does it: load the table (and the state), generate, save both."""
    table, file = load_table(target, drafter, root / "target", root / "drafter", False, 64, path=path, log=log)
    policy = build_policy("dcut", table=table, log=log)
    engine = Engine(target, drafter, policy, batch_size=2, max_seq=64, eos_ids=[], compile=False)
    outputs, stats = engine.generate(prompts, new_tokens)
    save_table(policy, file)
    return outputs, stats, policy


def test_a_run_measures_the_buckets_it_reaches_on_its_own_rows_and_the_next_run_reuses_them(pair, monkeypatch):
    import minidcut.profiler as profiler

    target, drafter, root = pair
    path = root / "table.json"
    prompts = [[3, 4, 5, 6], [7, 8, 9], [10, 11]]  # 3 requests at B = 2: buckets 2, then 1 for the tail
    # Every bucket it reaches, the tail's too (whether a tail's row is worth measuring: the next tests).
    monkeypatch.setattr(profiler, "worth_measuring", lambda *a: True)
    ar, _ = Engine(target, None, Policy.ar(), batch_size=2, max_seq=64, eos_ids=[], compile=False).generate(prompts, 12)
    added, add_row = [], CostTable.add_row
    monkeypatch.setattr(CostTable, "add_row", lambda self, B, row, *a: (added.append(list(row)), add_row(self, B, row, *a)))
    out, stats, policy = run(root, target, drafter, prompts, path)
    assert out == ar  # timing steps on the live rows leaves the output as it was
    assert stats.seconds["profile"] > 0 and policy.table.batch_sizes == [1, 2]
    saved = CostTable.load(path)
    assert saved.batch_sizes == [1, 2] and saved.meta["fingerprint"]["max_seq"] == 64 and saved.state == policy.state
    for row in added:  # as measured: drafting steps nondecreasing in rho, the smallest always measured
        finite = [x for x in row[1:] if not math.isinf(x)]
        assert finite and finite == sorted(finite)
    out2, stats2, policy2 = run(root, target, drafter, prompts, path)
    assert out2 == ar and stats2.seconds["profile"] == 0  # nothing left to measure
    assert policy2.table.batch_sizes == saved.batch_sizes  # the same rows, refined by the steps taken
    ran = sum(policy2.table.samples, []) != sum(saved.samples, [])
    assert ran and all(a >= b for a, b in zip(sum(policy2.table.samples, []), sum(saved.samples, [])))


def test_a_row_is_worth_measuring_only_if_the_rows_have_more_ar_steps_left_than_measuring_takes():
    """Measuring times each rho about 1 + LIVE_SAMPLES = 4 times: at the nearest larger bucket's prices
    (an AR step 1.0, drafting steps 3.0) a row at bucket 2 or 4 costs 4 x 13 = 52 AR steps to measure."""
    from minidcut.profiler import worth_measuring

    table = CostTable([8, 16], RHOS, [[1.0, 3.0, 3.0, 3.0, 3.0], [2.0, 9.0, 9.0, 9.0, 9.0]])
    assert not worth_measuring(table, RHOS, 4, 52) and worth_measuring(table, RHOS, 4, 53)
    assert not worth_measuring(table, RHOS, 2, 40)
    assert worth_measuring(table, RHOS, 32, 1)  # no larger row to price it by (a run's first bucket)
    assert worth_measuring(table, RHOS[1:], 4, 1)  # no AR entry to compare with
    pruned = CostTable([8], RHOS, [[1.0, 3.0, 3.0, math.inf, math.inf]])  # unmeasured entries take no time
    assert worth_measuring(pruned, RHOS, 4, 29) and not worth_measuring(pruned, RHOS, 4, 28)


@pytest.mark.parametrize("new_tokens, measured", [(12, False), (60, True)])
def test_a_tail_too_short_to_pay_for_measuring_runs_ar_steps_without_a_row(pair, new_tokens, measured):
    """3 requests at B = 2: the third runs alone at bucket 1 once the first two are done, with
    new_tokens - 1 steps left. Bucket 2's row prices measuring bucket 1 at 52 AR steps: 11 steps left
    are not worth it (AR steps there, said in the stats), 59 are. The output is AR's either way."""
    target, drafter, _ = pair
    prompts = [[3, 4, 5, 6], [7, 8, 9], [10, 11]]
    table = CostTable([2], RHOS, [[1.0, 3.0, 3.0, 3.0, 3.0]])
    policy = Policy.dcut(table, RHOS, calibrate=False)  # the row stays as given (no refining)
    engine = Engine(target, drafter, policy, batch_size=2, max_seq=96, eos_ids=[], compile=False)
    out, stats = engine.generate(prompts, new_tokens)
    ar, _ = Engine(target, None, Policy.ar(), batch_size=2, max_seq=96, eos_ids=[], compile=False).generate(
        prompts, new_tokens)
    assert out == ar and stats.bucket_hist[1] > 0
    assert (table.batch_sizes == [1, 2]) == measured and (stats.seconds["profile"] > 0) == measured
    assert stats.unmeasured == ({} if measured else {1: new_tokens - 1})
    assert stats.drafting_hist[1] == 0 or measured  # no row, no drafting
    said = [line for line in explain(stats, policy) if line.startswith("bucket 1 ran AR steps")]
    assert said == ([] if measured else [f"bucket 1 ran AR steps without a cost row: its rows had at most "
                                         f"{new_tokens - 1} steps left, fewer AR steps' time than measuring its "
                                         "row takes"])


@pytest.mark.parametrize("limit", [15, 1])
@pytest.mark.parametrize("costs, measured", [([1.0, 2.0, 2.2, 2.4, 2.6], 5), ([1.0, 20.0, 40.0, 60.0, 80.0], 2)])
def test_a_live_row_stops_only_where_full_acceptance_could_not_win(pair, monkeypatch, costs, measured, limit):
    """The drafter is unsure on this step (expected accepted drafts 0.01), but a larger budget is left
    unmeasured (and so never chosen) only if it could not win even with every keepable draft accepted:
    at B = 1 with cheap drafting steps, 16 tokens a step at 2.6x an AR step could; at 20x it could not.
    Keepable by any row at this bucket: a row measured on a request one token from its end (limit 1)
    serves every later step there too."""
    import minidcut.profiler as profiler
    from types import SimpleNamespace

    target, drafter, _ = pair
    engine = Engine(target, drafter, Policy.dcut(CostTable([2], RHOS, [[1.0] * 5]), RHOS), batch_size=1,
                    max_seq=64, eos_ids=[], compile=False)
    monkeypatch.setattr(profiler, "timed_step", lambda e, a, p, last, i, live, ri, reach: (costs[ri], None, torch.ones(1)))
    monkeypatch.setattr(engine.runner, "draft", lambda *a, **k: SimpleNamespace(gain=torch.full((5,), 0.01)))
    z = torch.zeros(1, dtype=torch.long)
    row, _, _ = profiler.measure_live(engine, z, z + 3, z + 4 + limit, z, [0], reach=4)
    assert sum(not math.isinf(x) for x in row) == measured
    assert row[:measured] == costs[:measured]


def test_the_ar_entry_is_timed_last_after_a_run_of_untimed_ar_steps(pair, monkeypatch):
    """AR steps that follow other work run slow, and while drafting is on nothing refines the AR entry:
    it is timed again after the drafting cells, after AR_RUN untimed AR steps, and keeps those
    timings. Here every AR step takes less than the one before (8, 7, ... ms): the entry is the
    median of the three timed after the run, not of the first ones."""
    import minidcut.profiler as profiler
    from types import SimpleNamespace

    target, drafter, _ = pair
    engine = Engine(target, drafter, Policy.dcut(CostTable([2], RHOS, [[1.0] * 5]), RHOS), batch_size=1,
                    max_seq=64, eos_ids=[], compile=False)
    order, ar = [], iter(8.0 - i for i in range(40))

    def timed(e, a, p, last, i, live, ri, reach):
        order.append(ri)
        return (next(ar) if ri == 0 else 2.0 + ri) / 1000, None, torch.ones(1)
    monkeypatch.setattr(profiler, "timed_step", timed)
    monkeypatch.setattr(engine.runner, "draft", lambda *a, **k: SimpleNamespace(gain=torch.full((5,), 0.01)))
    z = torch.zeros(1, dtype=torch.long)
    row, samples, _ = profiler.measure_live(engine, z, z + 3, z + 19, z, [0], reach=4)
    first = order.index(1)  # the AR cell first: an untimed step, then LIVE_SAMPLES timed
    assert order[:first] == [0] * (1 + profiler.LIVE_SAMPLES)
    last = len(order) - 1 - order[::-1].index(4)
    assert order[last + 1:] == [0] * (profiler.AR_RUN + profiler.LIVE_SAMPLES)
    n_ar = order.count(0)
    assert row[0] == pytest.approx((8.0 - (n_ar - 2)) / 1000) and samples[0] == profiler.LIVE_SAMPLES  # median of the last 3
    assert row[1:] == pytest.approx([0.003, 0.004, 0.005, 0.006])


@torch.inference_mode()
def test_a_row_measured_on_rows_at_their_end_teaches_the_skip_controller_nothing(pair):
    """A batch's tail can reach a bucket without a cost row while its rows have no token left to draft
    for: the row is measured on them, but their steps, which can accept nothing, do not switch drafting
    off at that bucket for every later batch (and process) that reaches it."""
    from minidcut.batch import Batch, Request
    from minidcut.stats import StepClock, Stats

    target, drafter, _ = pair
    policy = Policy.dcut(CostTable([1], RHOS, [[1.0] * 5]), RHOS)
    engine = Engine(target, drafter, policy, batch_size=2, max_seq=64, eos_ids=[], compile=False)
    batch = Batch.empty(2, engine.device)
    engine.runner.prefill([0, 1], Request.checked([[3, 4, 5], [6, 7]], 1, target.cfg.vocab_size, 16, 64), batch)
    assert [r.limit for r in batch.requests] == [0, 0] and batch.usable(engine.D) == 0
    assert engine.measure_missing_row(batch, 2, [], Stats(), StepClock()) == []  # measured, as a step would
    skip = policy.skip(2)
    assert policy.table.row(2, RHOS) is not None and skip.possible
    assert skip.state == "drafting" and skip.drafting_steps == 0 and skip.scores.n == 0.0


NULL_AR = json.dumps({"batch_sizes": [1], "rhos": RHOS, "seconds": [[None, 1.0, 1.1, 1.2, 1.3]]})


@pytest.mark.parametrize("content, needle", [("{not json", "corrupt"), ('{"batch_sizes": [1]}', "corrupt"),
                                             (NULL_AR, "no rho = 0 entry"), (None, "threads 99 != ")])
def test_a_corrupt_or_foreign_table_is_ignored_with_one_line_and_replaced(pair, content, needle):
    target, drafter, root = pair
    path = root / "table.json"
    if content is None:
        fp = run_fingerprint(target, drafter, root / "target", root / "drafter", False, 64)
        CostTable([1], RHOS, [[9.0] * 5], {"fingerprint": {**fp, "threads": 99}}).save(path)
    else:
        path.write_text(content)
    said = []
    out, _, policy = run(root, target, drafter, [[3, 4, 5]], path, 4, log=said.append)
    assert len(said) == 1 and needle in said[0] and "\n" not in said[0]
    assert CostTable.load(path).meta["fingerprint"]["threads"] == torch.get_num_threads()


def test_a_row_without_its_ar_step_is_refused():
    """A null rho = 0 entry would price an AR step at infinity: drafting could never switch off."""
    with pytest.raises(CostTableError, match="row B = 4 has no rho = 0 entry"):
        CostTable([1, 4], RHOS, [[1.0] * 5, [math.inf, 1.0, 1.1, 1.2, 1.3]])
    CostTable([4], RHOS, [[1.0, 1.1, math.inf, math.inf, math.inf]])  # cut short after rho = 0.25: fine


def test_an_unusable_saved_state_is_ignored_with_one_line(pair):
    target, drafter, root = pair
    path = root / "table.json"
    run(root, target, drafter, [[3, 4, 5]], path, 4)
    saved = json.loads(path.read_text())
    saved["state"] = {"calibration": {"gain_scale": -1}}
    path.write_text(json.dumps(saved))
    said = []
    run(root, target, drafter, [[3, 4, 5]], path, 4, log=said.append)
    assert len(said) == 1 and "learned policy state not used" in said[0]
