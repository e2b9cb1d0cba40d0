"""Greedy losslessness of the engine (docs/method.md, "Verification"): at temperature 0 every policy (full, static,
dcut) commits exactly the tokens plain AR decoding of the target commits, whatever the batch size, the
prompt lengths, where EOS falls and where max_new_tokens cuts a verified block.

Two kinds of drafter:
- random drafters (make_drafter of tests/tiny.py): they almost never agree with the target, so these runs
  exercise rejection at depth 0, the bonus token, packing of ragged keep_lens and continuous batching;
- an AGREEING drafter, trained here for a few hundred steps (tools/train_drafter.py's pieces) against a
  tiny target built to repeat itself: long accepted runs, EOS and max_new_tokens inside a block.

All runs are eager (compile=False); test_engine_recompile.py covers the compiled graphs.
"""

from __future__ import annotations

import collections
import types

import pytest
import torch

from minidcut.cost_model import CostTable
from minidcut.engine import Engine
from minidcut.loader import load_drafter, load_target
from minidcut.policy import Policy
from tiny import make_drafter, make_model

FAMILIES = ["llama", "qwen3_moe"]
BATCH_SIZES = [1, 3, 8]
PROMPT_LENS = [5, 17, 9, 30, 3, 12, 1, 22, 7, 14, 2]  # ragged; more prompts than rows: rows are refilled
MAX_NEW = 16
MAX_SEQ = 128  # >= longest prompt + max_new_tokens + block (test_finished_rows_* uses the tight bound)
GRID = [0.0, 0.25, 0.5, 0.75, 1.0]


def synthetic_table(slope: float = 0.01) -> CostTable:
    """A cost table covering every batch bucket of B = 1, 3, 8 and the whole grid: cost grows slowly with
    rho * B, so with these drafters dcut picks a mix of every rho (test_dcut_visits_several_rhos)."""
    bs = [1, 2, 3, 4, 8]
    return CostTable(bs, GRID, [[1.0 + slope * r * b for r in GRID] for b in bs])


POLICIES = {
    "full": Policy.full,
    "static0.25": lambda: Policy.static(0.25),
    "static0.5": lambda: Policy.static(0.5),
    "dcut": lambda: Policy.dcut(synthetic_table()),
}


def prompts_for(B: int, lens=PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    """2B + 1 ragged prompts (all 11 for B = 8): every row is refilled at least once."""
    g = torch.Generator().manual_seed(seed)
    n = min(2 * B + 1, len(lens))
    return [torch.randint(0, 96, (L,), generator=g).tolist() for L in lens[:n]]


class RecordingEngine(Engine):
    """An Engine that records the block of tokens each step hands to each request (before the
    EOS / max_new_tokens trim), so a test can see where generation stopped inside a block."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.blocks: dict[int, list[list[int]]] = collections.defaultdict(list)

    def emit(self, batch, row, tokens, stats, on_finish):
        self.blocks[batch.requests[row].index].append(list(tokens))
        super().emit(batch, row, tokens, stats, on_finish)


def run(target, drafter, policy, B, prompts, max_new, eos=(), max_seq=MAX_SEQ, engine_cls=Engine):
    engine = engine_cls(target, drafter, policy, batch_size=B, max_seq=max_seq, eos_ids=list(eos),
                        compile=False)
    outputs, stats = engine.generate(prompts, max_new)
    return outputs, stats, engine


def check_stats(outputs, stats):
    """Stats invariants that hold for every run."""
    assert stats.generated_tokens == sum(len(o) for o in outputs)
    assert stats.requests == len(outputs) == stats.finished
    assert 0.0 <= stats.keep_ratio <= 1.0
    assert sum(stats.rho_hist.values()) == stats.steps > 0
    assert stats.tau >= 1.0


def truncate_at_eos(outputs, eos: int) -> list[list[int]]:
    return [o[: o.index(eos) + 1] if eos in o else o for o in outputs]


def cut_inside_block(engine: RecordingEngine, outputs) -> int:
    """How many requests stopped before the end of the last block they were handed."""
    return sum(sum(map(len, engine.blocks[i])) > len(o) for i, o in enumerate(outputs))


# ---- random tiny pairs ----------------------------------------------------------------------------


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    """(family, target, random drafter) sized to the target's HF config."""
    fam = request.param
    root = tmp_path_factory.mktemp(fam)
    hf = make_model(root / "target", fam)
    make_drafter(root / "drafter", hf.config)
    target = load_target(root / "target")
    return fam, target, load_drafter(root / "drafter", target), hf


@pytest.fixture(scope="module")
def ar_refs(pair):
    """AR outputs per batch size (the reference every policy must reproduce)."""
    _, target, _, _ = pair
    refs = {}
    for B in BATCH_SIZES:
        outputs, stats, _ = run(target, None, Policy.ar(), B, prompts_for(B), MAX_NEW)
        check_stats(outputs, stats)
        assert stats.tau == 1.0 and stats.keep_ratio == 0.0
        refs[B] = outputs
    return refs


def test_ar_reference_equals_transformers_greedy(pair, ar_refs):
    """The reference itself: AR decoding in the engine is transformers' greedy decoding."""
    _, _, _, hf = pair
    for prompt, out in zip(prompts_for(3), ar_refs[3]):
        x = torch.tensor([prompt])
        ids = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW,
                          min_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
        assert ids[0, len(prompt):].tolist() == out


@pytest.mark.parametrize("B", BATCH_SIZES)
@pytest.mark.parametrize("policy", list(POLICIES))
def test_greedy_outputs_equal_ar_for_every_policy(pair, ar_refs, policy, B):
    _, target, drafter, _ = pair
    outputs, stats, _ = run(target, drafter, POLICIES[policy](), B, prompts_for(B), MAX_NEW)
    assert outputs == ar_refs[B]
    check_stats(outputs, stats)
    assert all(len(o) == MAX_NEW for o in outputs)
    if policy == "full":  # every draft that can still be emitted: all but some of each request's last block
        D = drafter.block_size - 1
        assert set(stats.rho_hist) == {1.0} and 0 < stats.drafted - stats.kept <= len(outputs) * D * (D + 1) // 2
    if policy.startswith("static"):
        assert set(stats.rho_hist) == {float(policy[6:])}


def test_dcut_visits_several_rhos(pair):
    """The synthetic table really makes dcut switch between budgets (else the dcut cases above
    would test one static budget)."""
    _, target, drafter, _ = pair
    _, stats, _ = run(target, drafter, POLICIES["dcut"](), 3, prompts_for(3), MAX_NEW)
    assert len([r for r in stats.rho_hist if r > 0]) >= 2


@pytest.mark.parametrize("max_new", [7, 13])
def test_small_max_new_tokens_equal_ar(pair, max_new):
    _, target, drafter, _ = pair
    prompts = prompts_for(3)
    ref, _, _ = run(target, None, Policy.ar(), 3, prompts, max_new)
    assert all(len(o) == max_new for o in ref)
    for name in ("full", "static0.5", "dcut"):
        outputs, stats, _ = run(target, drafter, POLICIES[name](), 3, prompts, max_new)
        assert outputs == ref, name
        check_stats(outputs, stats)


def test_eos_stops_every_policy_where_ar_stops(pair):
    """EOS = a token the AR output produces mid-way: every output is the AR output truncated right
    after its first EOS, for AR and every policy alike."""
    _, target, drafter, _ = pair
    prompts = prompts_for(3)
    free, _, _ = run(target, None, Policy.ar(), 3, prompts, MAX_NEW)
    eos = free[1][MAX_NEW // 2]
    expected = truncate_at_eos(free, eos)
    assert any(len(e) < MAX_NEW for e in expected) and expected != free
    for name in ["ar", *POLICIES]:
        pol = Policy.ar() if name == "ar" else POLICIES[name]()
        outputs, stats, _ = run(target, None if name == "ar" else drafter, pol, 3, prompts, MAX_NEW,
                                eos=[eos])
        assert outputs == expected, name
        check_stats(outputs, stats)


# ---- an agreeing drafter --------------------------------------------------------------------------


TRAIN_STEPS = 300
AGREE_MASK_ID = 95


@pytest.fixture(scope="session")
def agreeing_pair(tmp_path_factory):
    """(target, drafter): a tiny llama target that falls into runs of repeated tokens and short
    transitions between them, and a 1-layer DFlash drafter trained against it for TRAIN_STEPS steps
    (~15-40 s) on its own greedy continuations, with the functions of tools/train_drafter.py.

    The target: scale-3 random weights, embedding x3 plus one shared direction (x2). The shared
    direction gives every token a common key component, so the drafter can learn "attend to the anchor"
    quickly; the large embedding makes the target repeat its input often."""
    path = tmp_path_factory.mktemp("agree") / "target"
    hf = make_model(path, "llama", seed=0, scale=3.0)
    # Imported lazily: the trainer module pulls in transformers and the corpus helpers.
    from tools.train_drafter import build_drafter, drafter_loss, pad_batch, target_features
    with torch.no_grad():
        emb = hf.model.embed_tokens.weight
        emb.mul_(3.0).add_(2.0 * torch.randn(emb.shape[1], generator=torch.Generator().manual_seed(7)))
    hf.save_pretrained(path)
    target = load_target(path)

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 95, (8,), generator=g).tolist() for _ in range(128)]
    gens, _, _ = run(target, None, Policy.ar(), 64, prompts, 56, max_seq=80)
    seqs = [torch.tensor(p + o) for p, o in zip(prompts, gens)]  # 128 x [64]
    args = types.SimpleNamespace(layers=1, block_size=16, intermediate_size=None, anchors=8, decay=7.0, taps=None,
                                 from_target_layers=False)
    torch.manual_seed(0)
    drafter = build_drafter(args, target, AGREE_MASK_ID)
    feats, labels = target_features(target, seqs, drafter.taps)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2, weight_decay=0.0, betas=(0.9, 0.95))
    for _ in range(TRAIN_STEPS):
        idx = torch.randint(0, len(seqs), (8,), generator=g).tolist()
        batch = pad_batch(seqs, feats, labels, [1] * len(seqs), idx)
        loss, _ = drafter_loss(drafter, target, target.lm_head.weight, *batch, args, g)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
    return target, drafter.eval().requires_grad_(False)


def agree_prompts(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 95, (L,), generator=g).tolist() for L in PROMPT_LENS[:n]]


AGREE_MAX_NEW = 40


@pytest.fixture(scope="module")
def agree_refs(agreeing_pair):
    target, _ = agreeing_pair
    return {B: run(target, None, Policy.ar(), B, agree_prompts(2 * B + 1), AGREE_MAX_NEW)[0]
            for B in BATCH_SIZES}


def test_agreeing_drafter_accepts_long_runs(agreeing_pair, agree_refs):
    """The trained drafter really exercises long accepted runs: tau well above 1 and blocks of 8+
    committed tokens, with outputs still equal to AR."""
    target, drafter = agreeing_pair
    outputs, stats, engine = run(target, drafter, Policy.full(), 3, agree_prompts(7), AGREE_MAX_NEW,
                                 engine_cls=RecordingEngine)
    assert outputs == agree_refs[3]
    assert stats.tau >= 2.5, stats.tau
    lengths = [len(b) for blocks in engine.blocks.values() for b in blocks]
    assert max(lengths) >= 12 and sum(n >= 8 for n in lengths) >= 5
    assert sum(n == 1 for n in lengths[1:]) > 0  # and rejections at depth 0 as well
    check_stats(outputs, stats)


@pytest.mark.parametrize("B", BATCH_SIZES)
@pytest.mark.parametrize("policy", list(POLICIES))
def test_agreeing_drafter_outputs_equal_ar(agreeing_pair, agree_refs, policy, B):
    target, drafter = agreeing_pair
    outputs, stats, _ = run(target, drafter, POLICIES[policy](), B, agree_prompts(2 * B + 1),
                            AGREE_MAX_NEW)
    assert outputs == agree_refs[B]
    check_stats(outputs, stats)
    assert stats.tau > 1.5


@pytest.mark.parametrize("max_new", [7, 13])
def test_agreeing_drafter_max_new_tokens_inside_a_block(agreeing_pair, max_new):
    target, drafter = agreeing_pair
    prompts = agree_prompts(7)
    ref, _, _ = run(target, None, Policy.ar(), 3, prompts, max_new)
    for name in POLICIES:
        outputs, stats, engine = run(target, drafter, POLICIES[name](), 3, prompts, max_new,
                                     engine_cls=RecordingEngine)
        assert outputs == ref, name
        assert all(len(o) == max_new for o in outputs)
        check_stats(outputs, stats)
        if name == "full":  # drafts past max_new_tokens are never verified: no block is cut short
            assert cut_inside_block(engine, outputs) == 0


def eos_inside_block(agreeing_pair) -> tuple[int, list[list[int]]]:
    """A token that the full policy commits in the MIDDLE of an accepted block, the first time it
    occurs in that request's output; and the AR outputs without EOS."""
    target, drafter = agreeing_pair
    prompts = agree_prompts(7)
    free, _, _ = run(target, None, Policy.ar(), 3, prompts, AGREE_MAX_NEW)
    _, _, engine = run(target, drafter, Policy.full(), 3, prompts, AGREE_MAX_NEW, engine_cls=RecordingEngine)
    for i, blocks in engine.blocks.items():
        done = 0
        for b in blocks:
            for j, tok in enumerate(b[:-1]):
                if tok not in free[i][: done + j] and done + j >= 2:
                    return tok, free
            done += len(b)
    raise AssertionError("no token first occurs inside a block")


def test_agreeing_drafter_eos_inside_a_verified_block(agreeing_pair):
    """Generation stops at an EOS that was an accepted draft with more accepted tokens after it in
    the same block: outputs are the AR outputs truncated right after that EOS, for every policy."""
    target, drafter = agreeing_pair
    eos, free = eos_inside_block(agreeing_pair)
    expected = truncate_at_eos(free, eos)
    assert expected != free
    prompts = agree_prompts(7)
    ar, _, _ = run(target, None, Policy.ar(), 3, prompts, AGREE_MAX_NEW, eos=[eos])
    assert ar == expected
    for name in POLICIES:
        outputs, stats, engine = run(target, drafter, POLICIES[name](), 3, prompts, AGREE_MAX_NEW,
                                     eos=[eos], engine_cls=RecordingEngine)
        assert outputs == expected, name
        check_stats(outputs, stats)
        if name == "full":
            assert cut_inside_block(engine, outputs) > 0


# ---- finished rows ---------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["full", "static0.5"])
def test_finished_rows_stay_inside_the_cache(agreeing_pair, policy):
    """max_seq = longest prompt + max_new_tokens + block_size is enough for every request (Engine.
    validate accepts it). A row whose request has finished must not keep advancing its positions
    past the cache while other rows are still generating."""
    target, drafter = agreeing_pair
    prompts = agree_prompts(11)
    max_seq = max(map(len, prompts)) + AGREE_MAX_NEW + drafter.block_size
    ref, _, _ = run(target, None, Policy.ar(), 8, prompts, AGREE_MAX_NEW, max_seq=max_seq)
    outputs, stats, _ = run(target, drafter, POLICIES[policy](), 8, prompts, AGREE_MAX_NEW, max_seq=max_seq)
    assert outputs == ref
    check_stats(outputs, stats)


# ---- keyed sampling -------------------------------------------------------------------------------


def sampled(target, drafter, policy, B, prompts, seed):
    engine = Engine(target, drafter, policy, batch_size=B, max_seq=MAX_SEQ, temperature=0.8, top_p=0.95,
                    seed=seed, eos_ids=[], compile=False)
    return engine.generate(prompts, AGREE_MAX_NEW)


def test_sampling_with_a_seed_gives_ar_sampling_text_under_every_policy_and_batch_size(agreeing_pair):
    """The draw for request i's token at position p depends on (seed, i, p) alone, so at temperature > 0
    every policy, at every batch size, emits what AR sampling emits with the same seed; another seed
    gives other text."""
    target, drafter = agreeing_pair
    prompts = agree_prompts(7)
    ref, _ = sampled(target, None, Policy.ar(), 3, prompts, seed=3)
    other, _ = sampled(target, None, Policy.ar(), 3, prompts, seed=4)
    assert ref != other
    for B in (1, 3, 8):
        assert sampled(target, None, Policy.ar(), B, prompts, seed=3)[0] == ref
        for name in POLICIES:
            outputs, stats = sampled(target, drafter, POLICIES[name](), B, prompts, seed=3)
            assert outputs == ref, (name, B)
            assert stats.tau > 1.2  # drafts were accepted: the speculative path ran


def test_a_bf16_drafter_next_to_an_fp32_target_changes_speed_not_output(agreeing_pair, agree_refs, tmp_path):
    """The drafter runs in its own dtype with a bf16 copy of the target's embedding and lm_head: its
    drafts and confidences shift a little, the committed text does not."""
    from minidcut.drafter import DFlashDrafter
    target, drafter = agreeing_pair
    half = DFlashDrafter(drafter.cfg).to(torch.bfloat16)
    half.load_state_dict({k: v.to(torch.bfloat16) for k, v in drafter.state_dict().items()})
    half.inv_freq = drafter.inv_freq
    half.borrow(target)
    assert half.head.dtype == torch.bfloat16 and target.lm_head.weight.dtype == torch.float32
    assert half.head.data_ptr() == half.embed.data_ptr()  # tied in the target: one copy
    for B in (1, 3):
        outputs, stats, _ = run(target, half.eval(), POLICIES["dcut"](), B, agree_prompts(2 * B + 1), AGREE_MAX_NEW)
        assert outputs == agree_refs[B]
        assert stats.tau > 1.5


def test_a_draft_vocabulary_changes_what_can_be_drafted_not_the_output(agreeing_pair, agree_refs):
    """A drafter with a draft vocabulary (tools/train_drafter.py --data-vocab) drafts only its tokens:
    one holding every token the target writes keeps long accepted runs, one holding none of them gets
    nothing accepted, and both commit exactly AR's tokens under every policy."""
    from minidcut.drafter import DFlashDrafter
    target, drafter = agreeing_pair
    written = sorted({t for outs in agree_refs.values() for o in outs for t in o})
    unwritten = [t for t in range(target.cfg.vocab_size) if t not in written][:8]
    for vocab, tau in ((written, (1.5, 16.0)), (unwritten, (1.0, 1.0))):
        sub = DFlashDrafter(drafter.cfg)
        sub.load_state_dict(drafter.state_dict())
        sub.inv_freq, sub.draft_vocab = drafter.inv_freq, torch.tensor(vocab)
        sub.borrow(target)
        assert sub.head.shape[0] == len(vocab)
        for B in (1, 3):
            for name in POLICIES:
                outputs, stats, _ = run(target, sub.eval(), POLICIES[name](), B, agree_prompts(2 * B + 1),
                                        AGREE_MAX_NEW)
                assert outputs == agree_refs[B], (name, B)
                if name == "full":
                    assert tau[0] <= stats.tau <= tau[1], (vocab == written, B, stats.tau)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="a torch build without oneDNN")
def test_a_pair_packed_for_onednn_is_lossless_under_every_policy(tmp_path):
    """What api.load_pair gives on a CPU (linear layers and the drafter's head packed for oneDNN): every
    policy still writes AR's tokens, and an engine refuses to compile packed weights."""
    from minidcut.api import load_pair
    hf = make_model(tmp_path / "target", "qwen3_moe")
    make_drafter(tmp_path / "drafter", hf.config)
    target, drafter, _, _ = load_pair(tmp_path / "target", tmp_path / "drafter", pack=True)
    assert drafter.head.is_mkldnn
    prompts = prompts_for(3)
    ref, _, _ = run(target, None, Policy.ar(), 3, prompts, MAX_NEW)
    assert ref == run(load_target(tmp_path / "target"), None, Policy.ar(), 3, prompts, MAX_NEW)[0]
    for name in POLICIES:
        assert run(target, drafter, POLICIES[name](), 3, prompts, MAX_NEW)[0] == ref, name
    with pytest.raises(ValueError, match="pack=False"):
        Engine(target, drafter, Policy.full(), batch_size=2, max_seq=MAX_SEQ, compile=True)


def test_eager_attention_reads_only_the_live_span(pair, monkeypatch):
    """An eager engine's attention reads the cache only up to the row's furthest token (rounded up to
    runner.SPAN_STEP), not the whole cache, with the outputs AR's all the same (the tests above run
    eager engines with other rows too). One row, so that every recorded position is a live one."""
    import minidcut.drafter
    import minidcut.graphs
    import minidcut.runner

    _, target, drafter, _ = pair
    spans = collections.defaultdict(list)
    real_causal, real_block = minidcut.graphs.causal_layout, minidcut.drafter.block_mask

    def causal(row, pos, col, n, Q, S):
        spans["verify"].append((S, int(pos.max()) + 1))  # the positions its tokens read: 0 .. pos
        return real_causal(row, pos, col, n, Q, S)

    def block(anchor_pos, Bs, S, *a):
        spans["draft"].append((S, int(anchor_pos.max()) + Bs))  # context and block: < anchor_pos + Bs
        return real_block(anchor_pos, Bs, S, *a)
    monkeypatch.setattr(minidcut.graphs, "causal_layout", causal)
    monkeypatch.setattr(minidcut.drafter, "block_mask", block)
    prompts, max_seq, step = prompts_for(1)[:1], 512, minidcut.runner.SPAN_STEP
    outputs = run(target, drafter, Policy.static(0.5), 1, prompts, 40, max_seq=max_seq)[0]
    monkeypatch.undo()
    assert outputs == run(target, None, Policy.ar(), 1, prompts, 40, max_seq=max_seq)[0]
    assert len(spans["verify"]) > 3 and len(spans["draft"]) > 3
    for kind, seen in spans.items():
        assert all(S % step == 0 and need <= S < max_seq for S, need in seen), (kind, seen)
        # at most a rounding step more; a draft made ahead reaches a block further than it needs
        slack = step + (drafter.block_size if kind == "draft" else 0)
        assert all(S - need < slack for S, need in seen), (kind, seen)


def test_a_freed_row_far_past_the_span_keeps_a_key_in_every_window(tmp_path, monkeypatch):
    """A row freed after a long request keeps stepping at its old position, far past the span of the
    short request still decoding. With a sliding window a token there would see no key at all (some
    attention kernels then give NaN, which a later request in that row could read; this CPU's gives
    zeros): such rows are moved inside the span. Every attention mask of the run must let each query
    see a key, and the short request must equal AR."""
    import minidcut.layers
    from minidcut.batch import Batch, Request
    from minidcut.stats import Stats

    hf = make_model(tmp_path / "target", "qwen3", use_sliding_window=True, sliding_window=6,
                    layer_types=["sliding_attention"] * 4, num_hidden_layers=4)
    make_drafter(tmp_path / "drafter", hf.config, sliding_window=6, layer_types=["sliding_attention"] * 2)
    target = load_target(tmp_path / "target")
    drafter = load_drafter(tmp_path / "drafter", target)
    assert target.cfg.sliding_window == 6
    blind = []
    real_sdpa = minidcut.layers.F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, **kw):
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            blind.append(int((~attn_mask.any(-1)).sum()))  # queries that see no key
        return real_sdpa(q, k, v, attn_mask=attn_mask, **kw)
    monkeypatch.setattr(minidcut.layers.F, "scaled_dot_product_attention", sdpa)
    engine = Engine(target, drafter, Policy.static(0.5), batch_size=4, max_seq=256, eos_ids=[], compile=False)
    long_prompt, short_prompt = [3 + i % 40 for i in range(120)], [5, 7, 9]
    # row 0 frees at position ~122; three live rows keep bucket 4, so row 0 steps on inside it
    requests = [Request(0, long_prompt, 2)] + [Request(i, short_prompt[:i], 60) for i in (1, 2, 3)]
    pending, batch, stats = collections.deque(requests), Batch.empty(4, engine.device), Stats()
    with torch.inference_mode():
        while pending or batch.live:
            engine.step(batch, pending, stats)
    monkeypatch.undo()
    assert len(blind) > 20 and sum(blind) == 0
    ar = Engine(target, None, Policy.ar(), batch_size=1, max_seq=256, eos_ids=[], compile=False)
    assert [r.output for r in requests[1:]] == [ar.generate([short_prompt[:i]], 60)[0][0] for i in (1, 2, 3)]


def test_stepping_an_engine_gives_generates_outputs_and_checks_prompts_first(pair, ar_refs):
    """Engine.start steps the same loop as generate, one step per next(); a bad prompt raises at start,
    before any step."""
    _, target, drafter, _ = pair
    engine = Engine(target, drafter, Policy.dcut(synthetic_table()), batch_size=3, max_seq=MAX_SEQ, compile=False)
    requests, stats, steps = engine.start(prompts_for(3), MAX_NEW)
    records = list(steps)
    assert [r.output for r in requests] == ar_refs[3] and len(records) == stats.steps > 0
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        engine.start([[]], MAX_NEW)
