"""One compiled graph per (batch bucket, rho) (docs/method.md, "One D-cut step"): once every graph of the
policy's grid has run, a long dcut run that switches between budgets step by step never recompiles.

Two variants of the same check, on one tiny llama and one compiled dcut Engine at B = 2:
- unmarked: torch.compile with the `eager` backend. Dynamo traces and guards exactly as with inductor
  (recompiles are a dynamo matter), without inductor's ~30-60 s per graph on this CPU;
- @slow: the engine's own torch.compile call (inductor, mode="reduce-overhead"), 6 graphs, ~3-8 min
  with a cold compile_cache/.
And Engine.warmup() must leave nothing for a real run to compile. The compacting run (8 -> 4 -> 2 -> 1
with skipped drafting and catch-ups) runs with inductor in the default suite too: 12 graphs, ~2 minutes
from an empty compile cache on a 2-core CPU.
"""

from __future__ import annotations

import json
import pytest
import torch

from minidcut import dcut
from minidcut.cost_model import CostTable
from minidcut.engine import Engine
from minidcut.loader import load_drafter, load_target
from minidcut.policy import Policy
from minidcut.runtime import setup
from reference import reference_draft
from tiny import BASE, Alternating, make_drafter, make_model

B = 2
GRID = [0.0, 0.25, 0.5, 0.75, 1.0]
LENGTHS = (5, 17, 9, 30, 3, 12, 21)  # 7 prompts at B = 2: rows are refilled, the last request runs alone
NEW_TOKENS = 80  # ~7 * 80 / 2 > 200 steps
MAX_SEQ = 160


def mixed_table() -> CostTable:
    """Cost grows slowly with rho: with a random drafter dcut switches between several budgets (rows for
    both batch buckets, 1 and 2)."""
    return CostTable([1, B], GRID, [[1.0 + 0.02 * r * b for r in GRID] for b in (1, B)])


def forcing_table(rho: float) -> CostTable:
    """Every rho but `rho` costs 1000x: dcut chooses `rho` at every drafting step."""
    return CostTable([1, B], GRID, [[1.0 if r == rho else 1000.0 for r in GRID]] * 2)


@pytest.fixture
def tiny_models(tmp_path):
    """(target, drafter) loaded, and (the transformers target, the drafter's tensors, its config.json)
    for the reference drafter."""
    hf = make_model(tmp_path / "target", "llama", num_hidden_layers=2)  # a smaller graph compiles faster
    W = make_drafter(tmp_path / "drafter", hf.config, n_layers=1, target_layer_ids=[1])
    target = load_target(tmp_path / "target")
    cfg = json.loads((tmp_path / "drafter" / "config.json").read_text())
    return (target, load_drafter(tmp_path / "drafter", target)), (hf, W, cfg)


@pytest.fixture
def tiny_pair(tiny_models):
    return tiny_models[0]


@pytest.fixture
def fresh_dynamo():
    setup(threads=1)  # what every entry point does first: one graph per (bucket, K) allowed
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def prompts_and_ar(target):
    """Ragged prompts and their AR outputs (eager). Run before the compiled engine exists, with the
    same B and max_seq: the engines then share the cache tensors the compiled graphs read."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, BASE["vocab_size"], (L,), generator=g).tolist() for L in LENGTHS]
    ar, _ = Engine(target, None, Policy.ar(), batch_size=B, max_seq=MAX_SEQ, eos_ids=[],
                   compile=False).generate(prompts, NEW_TOKENS)
    return prompts, ar


def check_no_recompile_after_warm_up(target, drafter):
    prompts, ar = prompts_and_ar(target)

    policy = Policy.dcut(mixed_table(), GRID, calibrate=False)  # the synthetic costs stay as they are
    engine = Engine(target, drafter, policy, batch_size=B, max_seq=MAX_SEQ, eos_ids=[], compile=True)
    Ks = {dcut.budget(r, B, engine.D) for r in GRID}
    assert len(Ks) == len(GRID)  # 0, 8, 15, 22, 30: five verify buckets
    # Warm-up: every budget of the grid, forced in turn (rho = 0 long enough for dcut to stop drafting,
    # so the AR verify graph also runs without drafts), then the mixed table once; prompts of unequal
    # length; 3 requests at B = 2, so the third runs alone at the 1-row bucket.
    for rho in GRID:
        policy.table = forcing_table(rho)
        policy.reset()
        warm, stats = engine.generate(prompts[:3], 12)
        # The forced budget, and rho = 0 only where no draft can be kept (a request's last token).
        assert set(stats.rho_hist) - {0.0} == ({rho} - {0.0})
        assert warm == [o[:12] for o in ar[:3]] and set(stats.bucket_hist) == {1, 2}
    policy.table = mixed_table()
    policy.reset()
    engine.generate(prompts[:3], 12)
    assert {k for kind, b, k, _ in engine.runner.graphs.graphs if kind == "verify" and b == B} == Ks

    with torch.compiler.set_stance("fail_on_recompile"):
        outputs, stats = engine.generate(prompts, NEW_TOKENS)
    assert outputs == ar
    assert stats.steps >= 200
    assert len([r for r in stats.rho_hist if r > 0]) >= 2  # the run switched between drafting budgets
    assert sum(stats.rho_hist.values()) == stats.steps and set(stats.bucket_hist) == {1, 2}


@pytest.mark.parametrize("draft_vocab", [False, True])
def test_dcut_switching_rho_never_recompiles_after_warm_up(tiny_pair, fresh_dynamo, eager_backend, draft_vocab):
    target, drafter = tiny_pair
    if draft_vocab:  # the draft graph also maps indices of a draft vocabulary to token ids
        drafter.draft_vocab = torch.arange(0, target.cfg.vocab_size, 2)
        drafter.borrow(target)
    check_no_recompile_after_warm_up(target, drafter)


def test_engine_warmup_compiles_every_graph_a_dcut_run_reaches(tiny_pair, fresh_dynamo, eager_backend):
    """Engine.warmup() promises every graph the policy can reach: after it, a dcut run that switches
    budgets (rho = 0 included, with and without drafting) never compiles again."""
    target, drafter = tiny_pair
    prompts, ar = prompts_and_ar(target)
    engine = Engine(target, drafter, Policy.dcut(mixed_table(), GRID, calibrate=False), batch_size=B,
                    max_seq=MAX_SEQ, eos_ids=[], compile=True)
    engine.warmup()
    with torch.compiler.set_stance("fail_on_recompile"):
        outputs, stats = engine.generate(prompts, NEW_TOKENS)
    assert outputs == ar
    assert 0.0 in stats.rho_hist and len(stats.rho_hist) >= 3


def test_warmup_of_one_bucket_runs_every_graph_of_that_bucket_and_no_other(tiny_pair, monkeypatch):
    """tools/gpu_check.py warms one bucket before timing it: Engine.warmup(b, min_batch=b) runs each graph
    the policy can reach at b (a probe's draft and its K = 0 verify too) 3 times, and nothing else, and
    the catch-up a probe runs first once."""
    target, drafter = tiny_pair
    engine = Engine(target, drafter, Policy.dcut(mixed_table(), GRID, calibrate=False), batch_size=B,
                    max_seq=MAX_SEQ, eos_ids=[], compile=False)
    catch_ups = []
    monkeypatch.setattr(drafter, "catch_up", lambda row, pos: catch_ups.append(len(pos)))
    engine.warmup(B, min_batch=B)
    assert catch_ups == [1]
    reachable = engine.reachable(B, min_batch=B)
    assert {k[1] for k in reachable} == {B} and ("draft", B, 0, True) in reachable
    assert ("verify", B, 0, True) in reachable and ("verify", B, 0, False) in reachable
    assert dict(engine.runner.graphs.calls) == {k: 3 for k in reachable}


@pytest.mark.slow
def test_dcut_switching_rho_never_recompiles_after_warm_up_inductor(tiny_pair, fresh_dynamo):
    check_no_recompile_after_warm_up(*tiny_pair)


def cache_pointers(target, drafter) -> list[int]:
    return [c.k.data_ptr() for c in (*target.caches, *drafter.caches)] + [drafter.held_taps.data_ptr()]


def test_profiling_then_decoding_in_one_process_never_recompiles_or_reallocates(tiny_pair, fresh_dynamo,
                                                                              eager_backend):
    """A first run: no cost row yet. Warmup drives every graph the run can reach until it replays (3
    runs each), then the run measures its rows on its own rows through the same engine and graphs and
    decodes: no recompile, the caches are the ones allocated at the start, the output is AR's."""
    target, drafter = tiny_pair
    prompts, ar = prompts_and_ar(target)
    policy = Policy.dcut(CostTable([], GRID, []), GRID)
    engine = Engine(target, drafter, policy, batch_size=B, max_seq=MAX_SEQ, eos_ids=[], compile=True)
    pointers = cache_pointers(target, drafter)
    engine.warmup()
    assert engine.runner.graphs.calls and all(engine.runner.graphs.calls[k] >= 3 for k in engine.reachable())
    with torch.compiler.set_stance("fail_on_recompile"):
        outputs, stats = engine.generate(prompts, NEW_TOKENS)
    assert outputs == ar and stats.seconds["profile"] > 0 and policy.table.batch_sizes == sorted(stats.bucket_hist)
    assert cache_pointers(target, drafter) == pointers


def check_a_compacting_run_is_lossless_at_every_bucket(models, reference, compile: bool = True):
    """B = 8, eight requests asking for 8 to 120 new tokens: the batch compacts 8 -> 4 -> 2 -> 1 as they
    finish, with drafting skipped every third step (and caught up after), compiled; the tokens are AR's.
    Losslessness holds whatever the drafter drafts, so every draft verified is also checked against the
    reference drafter on its request's committed tokens: a row move or a catch-up that left the wrong
    context in the drafter's cache changes the drafts, not the output."""
    target, drafter = models
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, BASE["vocab_size"], (L,), generator=g).tolist() for L in (5, 9, 3, 12, 7, 4, 10, 6)]
    lengths = [8, 16, 24, 40, 56, 72, 96, 120]
    ar, _ = Engine(target, None, Policy.ar(), batch_size=8, max_seq=MAX_SEQ, eos_ids=[],
                   compile=False).generate(prompts, lengths)
    engine = Engine(target, drafter, Alternating(3), batch_size=8, max_seq=MAX_SEQ, eos_ids=[], compile=compile)
    moves, catch_ups, verified = [], [], []
    real_move, real_catch_up, real_get = engine.runner.move_rows, engine.runner.catch_up, engine.runner.graphs.get
    engine.runner.move_rows = lambda *a: (moves.append(1), real_move(*a))[1]
    engine.runner.catch_up = lambda *a: (catch_ups.append(1), real_catch_up(*a))[1]

    def get(kind, b, K=0, write=True, note=""):  # every verify graph's inputs, as it runs
        fn = real_get(kind, b, K, write, note)

        def spy(*args):
            if args[3] is not None:  # anchor, anchor_pos, request_ids, drafts, keep_len
                verified.append([t.to("cpu", copy=True) for t in args[:5]])
            return fn(*args)
        return spy if kind == "verify" else fn
    engine.runner.graphs.get = get
    outputs, stats = engine.generate(prompts, lengths)
    assert outputs == ar
    assert set(stats.bucket_hist) == {8, 4, 2, 1} and moves and catch_ups
    assert {b for (b, rho) in stats.rho_by_bucket if rho is not None} == {8, 4, 2, 1}  # drafting at each
    checked = assert_drafts_match_the_reference(verified, [p + o for p, o in zip(prompts, ar)], *reference)
    assert checked >= 100


def assert_drafts_match_the_reference(verified, sequences, hf, W, cfg) -> int:
    """Every kept draft of every live row verified (anchor, anchor_pos, request_ids, drafts, keep_len per
    step) equals the reference drafter's greedy draft from the request's committed tokens, where the
    reference's top two logits are not a near-tie (1e-3); returns the drafts checked."""
    checked = 0
    for anchor, pos, ids, drafts, keep in verified:
        for r in torch.nonzero(keep).flatten().tolist():
            seq, p, k = sequences[int(ids[r])], int(pos[r]), int(keep[r])
            assert int(anchor[r]) == seq[p]
            logits = reference_draft(W, cfg, hf, seq[:p], seq[p])[:k]  # [k, V]
            top = logits.topk(2, dim=-1).values
            clear = (top[:, 0] - top[:, 1]) > 1e-3
            assert torch.equal(drafts[r, :k][clear], logits.argmax(-1)[clear]), (int(ids[r]), p)
            checked += int(clear.sum())
    return checked


def test_a_compiled_run_compacting_8_4_2_1_with_skipped_drafting_is_lossless(tiny_models, fresh_dynamo, eager_backend):
    check_a_compacting_run_is_lossless_at_every_bucket(*tiny_models)


def test_a_compiled_run_compacting_8_4_2_1_with_skipped_drafting_is_lossless_inductor(tiny_models, fresh_dynamo):
    """The same with the engine's own torch.compile call (inductor): every graph of the four buckets."""
    check_a_compacting_run_is_lossless_at_every_bucket(*tiny_models)


def test_warmup_says_how_many_graphs_and_how_long_before_the_first_compile(tiny_pair, fresh_dynamo, eager_backend,
                                                                           tmp_path):
    """The first compile of these models here can only count its graphs; it records its seconds a graph,
    and the next engine of the same models says how long its graphs will take before compiling any."""
    target, drafter = tiny_pair
    said = []

    def engine():
        e = Engine(target, drafter, Policy.full(), batch_size=2, max_seq=MAX_SEQ, compile=True, on_compile=said.append)
        e.runner.graphs.record = tmp_path / "graph_seconds.json"
        return e

    first = engine()
    n = len(first.reachable())
    first.warmup()
    assert said[0] == f"{n} graphs to compile before the first step: no earlier compile of these models here; the first graph tells"
    assert said[1].startswith("compiling ") and len(said) == n + 1
    per_graph = json.loads((tmp_path / "graph_seconds.json").read_text())[first.runner.graphs.signature()]
    assert per_graph > 0
    said.clear()
    engine().warmup()
    assert said[0].startswith(f"{n} graphs to compile before the first step: ~{n * per_graph / 60:.1f} min at the ")
    said.clear()
    first.warmup()  # nothing left to compile: nothing to say
    assert said == []


def test_graphs_compiled_on_the_way_are_compiling_time_not_a_steps_time(tiny_pair, fresh_dynamo, eager_backend):
    """--warmup first: only the first bucket's graphs before the first step. The run compiles the others
    where it reaches them, still lossless; the steps that compiled, recorded or first replayed a graph
    count as compiling (stats.seconds["compile"]) and carry no seconds (nothing refines a cost from
    them). A second run has nothing left to compile."""
    target, drafter = tiny_pair
    prompts, ar = prompts_and_ar(target)
    engine = Engine(target, drafter, Policy.full(), batch_size=B, max_seq=MAX_SEQ, eos_ids=[], compile=True)
    engine.warmup(B, min_batch=B)
    assert {b for _, b, _, _ in engine.runner.graphs.graphs} == {B}
    recs = []
    outputs, stats = engine.generate(prompts, NEW_TOKENS, on_step=lambda s, r: recs.append(r))
    assert outputs == ar
    assert {b for _, b, _, _ in engine.runner.graphs.graphs} == {1, B}  # compiled where the run reached it
    cold = [r for r in recs if r.seconds == 0.0]
    assert cold and all(r.bucket == 1 for r in cold) and len(cold) <= 3  # the 1-row bucket's first steps
    assert all(r.redraft == 0.0 for r in cold)  # nor is a fresh draft's compiling charged to drafting
    assert stats.seconds["compile"] > 0
    recs.clear()
    outputs, stats = engine.generate(prompts, NEW_TOKENS, on_step=lambda s, r: recs.append(r))
    assert outputs == ar and stats.seconds["compile"] == 0 and all(r.seconds > 0 for r in recs)
