"""The GPU lane: what only a CUDA device can show. Every test is marked `cuda` and skipped where
torch.cuda.is_available() is False; run them with `python -m pytest -q -m cuda` (tools/gpu_check.py
does, together with the MoE host-sync test of test_moe.py).

- Parity: our bf16 logits on CUDA are as close to the fp32 reference as transformers' own bf16 logits
  (tiny random llama, qwen3, qwen3_moe), and bf16 greedy decoding follows fp32 greedy decoding up to
  the first near-tie.
- Losslessness with CUDA graphs (compile=True: torch.compile(mode="reduce-overhead")): ar, full,
  static 0.25 / 0.5 and dcut (a synthetic cost table with a row per batch bucket) commit exactly the
  tokens eager AR commits, fp32, greedy; 7 ragged prompts on 2 rows, so rows are refilled (continuous
  batching) and the tail runs at the 1-row bucket, a row moved down when the last request sits in row 1
  (docs/method.md, "Batch buckets"; measured on the CPU: static:0.25 moves one). The pair is
  test_engine_lossless.py's agreeing drafter (trained on the CPU in ~15-40 s), so drafts are accepted
  and the compiled verify graphs commit whole blocks, not only bonus tokens.
- Steady state: after Engine.warmup() a dcut run never recompiles, replays a CUDA graph for every
  compiled call of every step, and no graph skipped CUDA graphs; a draft's tensors survive the verify
  graph that reads them.
- Compaction: B = 8 requests of 8 to 120 tokens drain 8 -> 4 -> 2 -> 1 with drafting skipped every
  third step, CUDA graphs at every bucket: AR's tokens, and every verified draft the reference
  drafter's (test_engine_recompile.py's check, 12 more graphs).
- The MoE path: a tiny qwen3_moe target in bf16 (torch._grouped_mm on compute capability 9.x / 10.x,
  the tiled bmm elsewhere) decodes with CUDA graphs as its compiled AR decoding does, up to near-ties.

bf16 comparisons allow near-ties (check_equal_up_to_near_ties) and route MoE tokens to every expert;
fp32 comparisons are exact.

On the CPU: MINIDCUT_CUDA_LANE_ON_CPU=1 runs these tests eagerly on the CPU, all but the one that
counts CUDA graph replays (test_cuda_lane_on_cpu.py does, in the normal suite), so a changed interface
fails here before a GPU session finds it (one did: a GPU run found a stale Engine.draft call).

Budget: about 52 compiled graphs of 2- to 4-layer models at batch buckets 1 to 8, plus the drafter
training; about 3 minutes on one H100.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from torch._dynamo.utils import counters

from minidcut.api import build_policy
from minidcut.cost_model import CostTable
from minidcut.engine import Engine
from minidcut.loader import load_drafter, load_target
from minidcut.model import prefill_layout
from minidcut.policy import Policy
from minidcut.runtime import setup
from test_engine_lossless import AGREE_MAX_NEW, agree_prompts, agreeing_pair  # noqa: F401 (a fixture)
from test_engine_recompile import check_a_compacting_run_is_lossless_at_every_bucket
from tiny import BASE, make_drafter, make_model

ON_CPU = os.environ.get("MINIDCUT_CUDA_LANE_ON_CPU") == "1"  # the interface check (module docstring)
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not ON_CPU and not torch.cuda.is_available(), reason="needs a CUDA device")]
cuda_only = pytest.mark.skipif(ON_CPU, reason="counts CUDA graph replays")

DEVICE = "cpu" if ON_CPU else "cuda"
COMPILE = not ON_CPU  # the engines under test compile (CUDA graphs); references are eager
B = 2  # rows: batch buckets 1 and 2
MAX_SEQ = 128  # every engine on one target has the same cache shape, so they share the cache tensors
N_PROMPTS = 7  # more prompts than rows; odd, so AR runs the last request alone
GRID = [0.0, 0.25, 0.5, 0.75, 1.0]
V = BASE["vocab_size"]
ALL_EXPERTS = dict(num_experts=4, num_experts_per_tok=4)  # routing without a discrete choice (bf16 tests)


@pytest.fixture(scope="module", autouse=True)
def process_settings():
    """What every entry point does once (one graph per (bucket, K) allowed); fp32 matmuls stay fp32,
    so fp32 runs can be compared token for token."""
    setup()
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch._dynamo.reset()  # frees the compiled graphs and their CUDA graph memory pools


def mixed_table(rows=(1, B)) -> CostTable:
    """Cost grows slowly with rho (a row for every batch bucket): dcut switches between budgets."""
    return CostTable(list(rows), GRID, [[1.0 + 0.02 * r * b for r in GRID] for b in rows])


def make_engine(target, drafter, policy, compile: bool = True) -> Engine:
    return Engine(target, drafter if policy.needs_drafter else None, policy, batch_size=B, max_seq=MAX_SEQ,
                  eos_ids=[], compile=compile and COMPILE)


def cudagraph_skips() -> int:
    return counters["inductor"]["cudagraph_skips"]


# ---- near-ties: what bf16 may legitimately change -------------------------------------------------

@torch.no_grad()
def next_logits(model, ids: list[int]) -> torch.Tensor:
    """The model's logits [V] (fp32) for the token after `ids`: one prefill, no cache needed."""
    layout, last = prefill_layout([0], [len(ids)], DEVICE)
    logits, _ = model(torch.tensor(ids, device=DEVICE), layout, logits_idx=last)
    return logits[0].float()


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_equal_up_to_near_ties(outputs, reference, prompts, exact, approx) -> float:
    """Each output equals its reference token for token up to their first difference, if any, which
    must be a near-tie: there the two tokens' exact (fp32) logits differ by at most 4 e, e being how
    far the approximate (bf16) model's logits are from the exact ones at that position. Two bf16
    forwards each within e of the exact logits can only pick tokens whose exact logits are within 2 e;
    a packing, masking or acceptance bug picks an unrelated token. Returns the share of tokens compared."""
    compared = 0
    for prompt, out, ref in zip(prompts, outputs, reference):
        j = first_difference(out, ref)
        compared += j
        if j < len(ref):
            ids = prompt + ref[:j]
            x = next_logits(exact, ids)
            e = (next_logits(approx, ids) - x).abs().max().item()
            gap = abs(x[out[j]].item() - x[ref[j]].item())
            assert gap <= 4 * e, (f"token {j}: {out[j]} instead of {ref[j]}, exact logits {gap:.3g} apart "
                                  f"(bf16 error {e:.3g})")
    return compared / sum(map(len, reference))


# ---- bf16 parity with transformers ----------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    """(family, scale, config overrides) -> (checkpoint directory, transformers model in fp32 on the CPU)."""
    made = {}

    def get(family, scale=3.0, **over):
        key = (family, scale, *sorted(over.items()))
        if key not in made:
            path = tmp_path_factory.mktemp(family)
            made[key] = (path, make_model(path, family, scale=scale, **over))
        return made[key]

    return get


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, V, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids], device=DEVICE)).logits[0].float()


@torch.no_grad()
def our_logits(model, ids: list[int]) -> torch.Tensor:
    layout, _ = prefill_layout([0], [len(ids)], DEVICE)
    return model(torch.tensor(ids, device=DEVICE), layout)[0].float()


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_bf16_logits_on_cuda_are_as_close_to_fp32_as_transformers_bf16(tiny_hf, family):
    """Same weights, three forwards of a 40-token prompt: transformers fp32 (the reference),
    transformers bf16 and ours in bf16. The scaled-up random weights make bf16 rounding large (~1.5 on
    logits of ~10 on the CPU), so the bound is relative to transformers' own bf16 error, as in
    test_parity.py: ours may be at most twice as far from the reference (or 2 % of the largest logit,
    should transformers' error be tiny), with the same top token at >= 80 % of the positions."""
    path, hf = tiny_hf(family)
    ids = prompt(40, seed=7)
    ref = hf_logits(copy.deepcopy(hf).to(DEVICE), ids)
    hf_err = (hf_logits(copy.deepcopy(hf).to(DEVICE, torch.bfloat16), ids) - ref).abs().max().item()
    model = load_target(path, torch.bfloat16, DEVICE)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    out = our_logits(model, ids)
    assert torch.isfinite(out).all()
    assert (out - ref).abs().max().item() <= max(2 * hf_err, 0.02 * ref.abs().max().item())
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.8


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_bf16_greedy_on_cuda_follows_our_fp32_greedy_up_to_the_first_near_tie(tiny_hf, family):
    """Our bf16 AR decoding against our fp32 AR decoding (eager, CUDA), 4 prompts x 24 tokens: equal up
    to the first difference, which must be a near-tie (check_equal_up_to_near_ties). Scale-1 weights
    (not the chaotic scale 3 of the logits test), so at least a quarter of the tokens get compared.
    The MoE routes every token to all its experts here (ALL_EXPERTS): a top-k choice that bf16 rounding
    flips is a jump in the output that no near-tie of the logits explains."""
    path, _ = tiny_hf(family, scale=1.0, **(ALL_EXPERTS if family == "qwen3_moe" else {}))
    exact, approx = load_target(path, torch.float32, DEVICE), load_target(path, torch.bfloat16, DEVICE)
    prompts = [prompt(L, seed=20 + i) for i, L in enumerate((3, 8, 15, 26))]

    def greedy(model):
        return Engine(model, None, Policy.ar(), batch_size=4, max_seq=64, eos_ids=[],
                      compile=False).generate(prompts, 24)[0]

    assert check_equal_up_to_near_ties(greedy(approx), greedy(exact), prompts, exact, approx) >= 0.25


# ---- every policy lossless with CUDA graphs (fp32, greedy) ----------------------------------------

@pytest.fixture(scope="module")
def gpu_pair(agreeing_pair):  # noqa: F811 (the fixture imported above)
    """test_engine_lossless.py's agreeing pair (tiny llama + a trained 1-layer drafter), copied to the
    GPU in fp32, its prompts, and their eager AR outputs: the reference every compiled policy must
    reproduce exactly."""
    target = copy.deepcopy(agreeing_pair[0]).to(DEVICE)
    drafter = copy.deepcopy(agreeing_pair[1]).to(DEVICE)
    drafter.borrow(target)  # the embedding and lm_head are the GPU target's, not the CPU copies
    prompts = agree_prompts(N_PROMPTS)
    ar, stats = make_engine(target, None, Policy.ar(), compile=False).generate(prompts, AGREE_MAX_NEW)
    assert set(stats.bucket_hist) == {1, 2}
    return target, drafter, prompts, ar


@pytest.mark.parametrize("spec", ["ar", "full", "static:0.25", "static:0.5"])
def test_fixed_policies_with_cuda_graphs_commit_exactly_the_ar_tokens(gpu_pair, spec):
    """Two runs: the first compiles, warms up and records the CUDA graphs, the second replays them."""
    target, drafter, prompts, ar = gpu_pair
    counters.clear()
    engine = make_engine(target, drafter, build_policy(spec))
    for _ in range(2):
        outputs, stats = engine.generate(prompts, AGREE_MAX_NEW)
        assert outputs == ar
        assert 1 in stats.bucket_hist  # the last request ran alone, at the 1-row bucket
    if spec != "ar":
        assert stats.tau > 1.5  # drafts were accepted: whole blocks went through the verify graphs
    assert cudagraph_skips() == 0


@pytest.fixture(scope="module")
def dcut_engine(gpu_pair):
    """A compiled dcut engine on the agreeing pair after Engine.warmup(), and the cudagraph skips that
    compiling its graphs caused."""
    target, drafter, _, _ = gpu_pair
    counters.clear()
    engine = make_engine(target, drafter, Policy.dcut(mixed_table(), GRID, calibrate=False))
    engine.warmup()
    return engine, cudagraph_skips()


def test_dcut_after_warmup_never_recompiles_and_commits_the_ar_tokens(gpu_pair, dcut_engine):
    _, _, prompts, ar = gpu_pair
    engine, _ = dcut_engine
    graphs = len(engine.runner.graphs.graphs)
    with torch.compiler.set_stance("fail_on_recompile"):
        outputs, stats = engine.generate(prompts, AGREE_MAX_NEW)
    assert outputs == ar
    assert len(engine.runner.graphs.graphs) == graphs  # warmup() had made every graph the run used
    assert len([r for r in stats.rho_hist if r > 0]) >= 2  # it switched between drafting budgets
    assert stats.tau > 1.5


@cuda_only
def test_steady_state_dcut_steps_replay_a_cuda_graph_per_compiled_call_and_skip_none(gpu_pair, dcut_engine,
                                                                                      monkeypatch):
    """A first run records whatever warmup() left unrecorded; during the second, every step replays
    its verify graph and every drafting step its draft graph too (prefill and the drafter's catch-up
    run eagerly), counted at torch.cuda.CUDAGraph.replay, which CUDA graph trees call."""
    _, _, prompts, ar = gpu_pair
    engine, warmup_skips = dcut_engine
    engine.generate(prompts, AGREE_MAX_NEW)
    skips = cudagraph_skips()
    replays, drafted = [], []
    real_replay = torch.cuda.CUDAGraph.replay

    def counting_replay(graph):
        replays.append(graph)
        return real_replay(graph)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", counting_replay)
    outputs, stats = engine.generate(prompts, AGREE_MAX_NEW, on_step=lambda s, rec: drafted.append(rec.drafted))
    assert outputs == ar
    assert len(drafted) == stats.steps > 0
    assert len(replays) >= stats.steps + sum(drafted)
    assert warmup_skips == 0 and cudagraph_skips() == skips


def test_a_drafts_tensors_stay_unchanged_while_verify_graphs_run(dcut_engine):
    """Runner.verify reads the draft's keep_len after the verify graph ran, and Engine.step its gain.
    Under CUDA graph trees every call of a compiled function may start a new generation, whose replay
    reuses the memory of the previous generation's outputs: a draft's tensors must not live there."""
    engine, _ = dcut_engine
    g = torch.Generator().manual_seed(3)
    anchor = torch.randint(0, V, (B,), generator=g).to(DEVICE)
    anchor_pos = torch.tensor([20, 33], device=DEVICE)
    draft = engine.runner.draft(anchor, anchor_pos, anchor_pos + engine.D + 1, [True] * B, engine.policy.plan(B))
    before = [t.clone() for t in (draft.drafts, draft.keep_lens, draft.gain, draft.log_s)]
    ids = torch.arange(B, device=DEVICE)
    for ri, K in enumerate(engine.runner.graphs.budgets(B)):
        if K:
            engine.runner.graphs.get("verify", B, K)(anchor, anchor_pos, ids, draft.drafts, draft.keep_lens[ri])
    after = [draft.drafts, draft.keep_lens, draft.gain, draft.log_s]
    assert all(torch.equal(x, y) for x, y in zip(before, after))


# ---- the MoE path with CUDA graphs (bf16) ---------------------------------------------------------

def test_moe_target_in_bf16_decodes_with_cuda_graphs_as_its_ar_decoding(tmp_path):
    """A tiny qwen3_moe (2 layers, scale-1 weights) with a random 1-layer drafter, bf16: static:0.5
    (drafts every step: K > 0 packed tokens through the grouped GEMM) and dcut (a two-rho grid, skipping
    on) against compiled AR. Differently packed bf16 forwards need not round alike, so outputs must agree
    up to near-ties (check_equal_up_to_near_ties), on most of the tokens; every token goes to all 4
    experts (ALL_EXPERTS), since a flipped top-k choice is no near-tie of the logits. Uneven routing
    (empty experts, one expert) is test_moe.py's: the grouped GEMM on its own, on CUDA without a sync."""
    hf = make_model(tmp_path / "target", "qwen3_moe", scale=1.0, num_hidden_layers=2, **ALL_EXPERTS)
    make_drafter(tmp_path / "drafter", hf.config, n_layers=1, target_layer_ids=[1])
    target = load_target(tmp_path / "target", torch.bfloat16, DEVICE)
    drafter = load_drafter(tmp_path / "drafter", target, torch.bfloat16, DEVICE)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, V, (L,), generator=g).tolist() for L in (5, 17, 9, 30, 3)]
    counters.clear()
    ar, _ = make_engine(target, None, Policy.ar()).generate(prompts, 40)
    exact = load_target(tmp_path / "target", torch.float32, DEVICE)
    approx = load_target(tmp_path / "target", torch.bfloat16, DEVICE)
    for policy in (Policy.static(0.5), Policy.dcut(mixed_table(), [0.0, 0.5])):
        engine = make_engine(target, drafter, policy)
        for _ in range(2):  # recording, then replaying
            outputs, stats = engine.generate(prompts, 40)
            assert check_equal_up_to_near_ties(outputs, ar, prompts, exact, approx) >= 0.5, policy.label
        assert stats.steps > 0 and sum(map(len, outputs)) == 5 * 40
    assert cudagraph_skips() == 0


def test_a_compiled_run_compacting_8_4_2_1_with_skipped_drafting_is_lossless_with_cuda_graphs(tmp_path):
    """test_engine_recompile.py's compacting run on the device, CUDA graphs at buckets 8, 4, 2 and 1:
    AR's tokens, and every draft verified equal to the reference drafter's (row moves and catch-ups
    between compiled steps leave the right context)."""
    setup(threads=1)
    torch._dynamo.reset()
    hf = make_model(tmp_path / "target", "llama", num_hidden_layers=2)
    W = make_drafter(tmp_path / "drafter", hf.config, n_layers=1, target_layer_ids=[1])
    target = load_target(tmp_path / "target", device=DEVICE)
    cfg = json.loads((tmp_path / "drafter" / "config.json").read_text())
    check_a_compacting_run_is_lossless_at_every_bucket((target, load_drafter(tmp_path / "drafter", target, device=DEVICE)),
                                                       (hf, W, cfg), compile=COMPILE)
