"""The DFlash drafter against a reference written here from the DFlash description and z-lab's drafter.

The reference works on the raw checkpoint tensors (z-lab key names) and on Hugging Face's hidden
states, one request at a time, recomputing everything from scratch with no cache:
  context  = hidden_norm(fc(concat of hidden_states[id + 1] for the tapped ids, committed tokens))
  per layer: q from the block only; k / v from [context ; block], each through the layer's own
             k_proj / v_proj (+ k_norm, RoPE at absolute positions from transformers' Qwen3 rotary
             embedding on the drafter's config); attention is not causal, unless the layer is (is_causal,
             or unset on a sliding layer), and a sliding window keeps keys within `sliding_window`
             positions (on both sides unless causal), as z-lab's drafter masks it
  logits   = target lm_head(norm(block)) on slots 1..block_size-1
minidcut's drafter must match it with requests of different context lengths in one batch, also after
a second round of committed tokens (stale block K/V in its cache must not leak in).
"""

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from minidcut.config import ConfigError, default_target_layer_ids, load_drafter_config
from minidcut.layers import rope_cos_sin
from minidcut.loader import CheckpointError, load_drafter, load_target
from minidcut.model import causal_layout, prefill_layout
from reference import hf_rotary, reference_draft
from tiny import hf_config, make_drafter, make_model

MASK = 5


# ---- the reference --------------------------------------------------------------------------------

# ---- fixtures -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny qwen3 target (untied lm_head, so head and embedding cannot be confused) + a drafter."""
    root = tmp_path_factory.mktemp("drafter")
    hf = make_model(root / "target", "qwen3")
    W = make_drafter(root / "drafter", hf.config, n_layers=2, mask_token_id=MASK, seed=1)
    cfg = json.loads((root / "drafter" / "config.json").read_text())
    target = load_target(root / "target")
    return hf, W, cfg, target, load_drafter(root / "drafter", target), root


def prefill(target, drafter, prompts, max_seq=96):
    target.setup_cache(len(prompts), max_seq)
    drafter.setup_cache(len(prompts), max_seq)
    layout, last = prefill_layout(list(range(len(prompts))), [len(p) for p in prompts], "cpu")
    tokens = torch.tensor([t for p in prompts for t in p])
    _, taps = target(tokens, layout, logits_idx=last, taps=drafter.taps)  # what Runner.prefill does
    drafter.add_context(taps, layout.row, layout.pos)


def append(target, drafter, rows_tokens, starts, max_seq=96):
    """Commit new tokens to every row (a verification step): target forward + drafter context."""
    n, Q = len(rows_tokens), max(len(t) for t in rows_tokens)
    row = torch.tensor([i for i, t in enumerate(rows_tokens) for _ in t])
    col = torch.tensor([j for t in rows_tokens for j in range(len(t))])
    pos = torch.tensor(starts)[row] + col
    layout = causal_layout(row, pos, col, n, Q, max_seq)
    _, taps = target(torch.tensor([x for t in rows_tokens for x in t]), layout, taps=drafter.taps)
    drafter.add_context(taps, row, pos)


@torch.no_grad()
def assert_matches_reference(hf, W, cfg, target, drafter):
    """The drafter equals reference_draft for 4 requests of different context lengths in one batch,
    then again after a second round of committed tokens of different counts per row."""
    gen = torch.Generator().manual_seed(0)
    lengths = [1, 6, 13, 29]
    prompts = [torch.randint(0, 96, (L,), generator=gen).tolist() for L in lengths]
    anchors = [11, MASK, 70, 2]  # the anchor may itself be the mask id
    prefill(target, drafter, prompts)
    out = drafter(target, torch.tensor(anchors), torch.tensor(lengths))  # [B, D, V]
    assert out.shape == (4, 15, 96)
    for i in range(4):
        torch.testing.assert_close(out[i], reference_draft(W, cfg, hf, prompts[i], anchors[i]),
                                   atol=1e-5, rtol=1e-5)

    # A second round: the committed anchors + accepted drafts (different counts per row) enter the
    # context; the previous block's K/V still sit in the cache past the new context and must not leak.
    new = [[anchors[0]], [anchors[1], 4, 9], [anchors[2], 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
           [anchors[3], 40]]
    append(target, drafter, new, lengths)
    committed = [p + t for p, t in zip(prompts, new)]
    anchors2 = [7, 8, 9, 10]
    out2 = drafter(target, torch.tensor(anchors2), torch.tensor([len(c) for c in committed]))
    for i in range(4):
        torch.testing.assert_close(out2[i], reference_draft(W, cfg, hf, committed[i], anchors2[i]),
                                   atol=1e-5, rtol=1e-5)


def drafter_dir(root, hf, **kw):
    """A drafter for the tiny target `hf` in root / "d": (its tensors, its config.json)."""
    W = make_drafter(root / "d", hf.config, mask_token_id=MASK, seed=1, **kw)
    return W, json.loads((root / "d" / "config.json").read_text())


# ---- tests ----------------------------------------------------------------------------------------

@torch.no_grad()
def test_target_taps_are_transformers_hidden_states_id_plus_1_the_last_layer_after_the_final_norm(pair):
    """z-lab's extract_context_feature takes hidden_states[id + 1]: the output of layer id, but for
    the last layer transformers returns the state after the final norm."""
    hf, _, _, target, _, _ = pair
    prompt = [3, 17, 42, 8, 91, 0, 66]
    L = target.cfg.num_layers
    target.setup_cache(1, 32)
    layout, last = prefill_layout([0], [len(prompt)], "cpu")
    logits, taps = target(torch.tensor(prompt), layout, logits_idx=last, taps=tuple(range(L)))
    ref = hf(torch.tensor([prompt]), output_hidden_states=True)
    for i, tap in enumerate(taps.split(target.cfg.hidden_size, dim=-1)):
        assert (tap - ref.hidden_states[i + 1][0]).abs().max().item() <= 1e-5, f"tap {i}"
    assert (logits - ref.logits[0, last]).abs().max().item() <= 1e-4  # the logits path is unchanged


def test_drafter_matches_the_uncached_reference_for_a_batch_of_different_context_lengths(pair):
    hf, W, cfg, target, drafter, _ = pair
    assert_matches_reference(hf, W, cfg, target, drafter)


@pytest.mark.parametrize("pack", [False, True])
def test_the_fused_pair_load_pair_makes_matches_the_reference_too(pair, pack):
    """What every engine runs: load_pair fuses q/k/v and gate/up (and on a CPU packs the linear layers
    for oneDNN); the drafter's logits still equal the reference's (a wrong fusion would only lower
    acceptance, which losslessness tests cannot see)."""
    from minidcut import load_pair

    hf, W, cfg, _, _, root = pair
    target, drafter, _, _ = load_pair(root / "target", root / "drafter", "float32", "cpu", pack=pack)
    assert all(layer.self_attn.qkv_proj is not None for layer in drafter.layers)
    assert_matches_reference(hf, W, cfg, target, drafter)


def test_a_drafter_tapping_the_last_target_layer_matches_the_reference(tmp_path, pair):
    hf, target = pair[0], pair[3]
    W, cfg = drafter_dir(tmp_path, hf, target_layer_ids=[1, target.cfg.num_layers - 1])
    assert_matches_reference(hf, W, cfg, target, load_drafter(tmp_path / "d", target))


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("rope", [YARN, {**YARN, "attention_factor": 1.2, "beta_fast": 16}],
                         ids=["yarn", "yarn_attention_factor"])
def test_a_yarn_drafter_has_transformers_rope_and_matches_the_reference(tmp_path, pair, rope):
    """The drafter has a rope of its own (its config is a Qwen3 config): YaRN frequencies and the
    attention scaling of cos and sin must be transformers' for that config, as z-lab's drafter uses."""
    hf, target = pair[0], pair[3]
    W, cfg = drafter_dir(tmp_path, hf, rope_scaling=rope)
    drafter = load_drafter(tmp_path / "d", target)
    assert drafter.rope_scale != 1.0
    pos = torch.arange(300)
    cos, sin = rope_cos_sin(drafter.inv_freq, pos, torch.float32, drafter.rope_scale)
    ref_cos, ref_sin = hf_rotary(cfg, pos)
    assert (cos - ref_cos).abs().max().item() <= 1e-6 and (sin - ref_sin).abs().max().item() <= 1e-6
    assert_matches_reference(hf, W, cfg, target, drafter)


@pytest.mark.parametrize("over, causal", [
    # z-lab: a sliding layer is causal unless is_causal says otherwise
    ({"layer_types": ["sliding_attention", "full_attention"], "use_sliding_window": True,
      "sliding_window": 4}, [0]),
    ({"layer_types": ["sliding_attention"] * 2, "use_sliding_window": True, "sliding_window": 5,
      "is_causal": False}, []),
    ({"layer_types": ["sliding_attention", "full_attention"]}, [0]),  # no use_sliding_window: no window
    ({"is_causal": True}, [0, 1]),
], ids=["causal_window_on_layer_0", "bidirectional_windows", "sliding_without_window", "is_causal"])
def test_sliding_and_causal_draft_layers_match_the_reference(tmp_path, pair, over, causal):
    hf, target = pair[0], pair[3]
    W, cfg = drafter_dir(tmp_path, hf, **over)
    drafter = load_drafter(tmp_path / "d", target)
    assert drafter.cfg.causal_layers == causal
    assert_matches_reference(hf, W, cfg, target, drafter)


def test_a_z_lab_layout_directory_loads_with_its_keys_and_config(pair):
    _, W, cfg, target, drafter, root = pair
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{k}" for i in range(2) for k in (
            "input_layernorm.weight", "post_attention_layernorm.weight",
            *(f"self_attn.{p}_proj.weight" for p in "qkvo"), "self_attn.q_norm.weight", "self_attn.k_norm.weight",
            *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")))}
    assert set(W) == expected  # the checkpoint has exactly the z-lab keys (no `model.` prefix)
    assert set(drafter.state_dict()) == expected  # no embedding, no lm_head of its own
    for k, v in W.items():
        assert torch.equal(drafter.state_dict()[k], v), k
    assert {"block_size", "num_target_layers", "dflash_config"} <= set(cfg)
    assert drafter.block_size == 16 and drafter.cfg.mask_token_id == MASK
    assert drafter.taps == tuple(cfg["dflash_config"]["target_layer_ids"]) == (1, 2)


def test_default_target_layer_ids_follow_the_dflash_formula():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B + z-lab drafter
    assert default_target_layer_ids(32, 5) == [1, 8, 15, 22, 29]
    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(4, 1) == [2]
    assert default_target_layer_ids(8, 3) == [1, 3, 5]


@pytest.mark.parametrize("L, n", [(4, 1), (8, 3)])
@torch.no_grad()
def test_a_drafter_without_target_layer_ids_taps_the_default_layers_and_drafts(tmp_path, L, n):
    hf = make_model(tmp_path / "target", "qwen3", num_hidden_layers=L)
    ids = default_target_layer_ids(L, n)
    W = make_drafter(tmp_path / "drafter", hf.config, n_layers=n, mask_token_id=MASK, target_layer_ids=ids)
    cfg_path = tmp_path / "drafter" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["dflash_config"]["target_layer_ids"]
    cfg_path.write_text(json.dumps(cfg))
    target = load_target(tmp_path / "target")
    drafter = load_drafter(tmp_path / "drafter", target)
    assert list(drafter.taps) == ids
    prompt = [4, 8, 15, 16, 23, 42]
    prefill(target, drafter, [prompt], max_seq=32)
    out = drafter(target, torch.tensor([3]), torch.tensor([len(prompt)]))[0]
    cfg["dflash_config"]["target_layer_ids"] = ids
    torch.testing.assert_close(out, reference_draft(W, cfg, hf, prompt, 3), atol=1e-5, rtol=1e-5)


def test_a_drafter_config_with_neither_taps_nor_num_target_layers_is_a_config_error(tmp_path, pair):
    hf = pair[0]
    make_drafter(tmp_path / "d", hf.config, mask_token_id=MASK)
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    del cfg["dflash_config"]["target_layer_ids"], cfg["num_target_layers"]
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="target_layer_ids"):
        load_drafter_config(tmp_path / "d")


@pytest.mark.parametrize("over, kw, message", [
    ({"hidden_size": 32}, {}, r"drafter hidden_size 32 != target hidden_size 64"),
    ({"vocab_size": 50}, {}, r"drafter vocab_size 50 != target vocab_size 96"),
    ({"num_hidden_layers": 6}, {}, r"made for a 6-layer target, this target has 4 layers"),
    ({}, {"target_layer_ids": [1, 4]}, r"target_layer_ids \[1, 4\] do not fit a 4-layer target"),
    ({}, {"mask_token_id": 96}, r"mask_token_id 96 is outside the target vocabulary \(96\)"),
])
def test_a_drafter_that_does_not_fit_the_target_is_a_clear_config_error(tmp_path, pair, over, kw, message):
    target = pair[3]
    make_drafter(tmp_path / "d", hf_config("qwen3", **over), **{"mask_token_id": MASK, **kw})
    with pytest.raises(ConfigError, match=message) as err:
        load_drafter(tmp_path / "d", target)
    assert str(tmp_path / "d") in str(err.value)  # the message names the directory


@pytest.mark.parametrize("field, value", [
    ("selector_rank", 256),  # DFlash2: candidate selector and convolutions
    ("conv_kernel_size", 2),
    ("final_logit_softcapping", 20.0),
    ("output_multiplier", 0.2),
    ("input_embedding_scale", 2.0),
])
def test_a_dflash_config_field_minidcut_does_not_implement_is_a_config_error_naming_it(tmp_path, pair, field,
                                                                                       value):
    make_drafter(tmp_path / "d", pair[0].config, mask_token_id=MASK)
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    cfg["dflash_config"][field] = value
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=f"dflash_config.{field}") as err:
        load_drafter_config(tmp_path / "d")
    assert str(tmp_path / "d") in str(err.value)


def test_the_drafter_layers_refuse_what_the_target_layers_refuse(tmp_path, pair):
    make_drafter(tmp_path / "d", pair[0].config, mask_token_id=MASK, hidden_act="gelu")
    with pytest.raises(ConfigError, match="hidden_act 'gelu'"):
        load_drafter_config(tmp_path / "d")


@torch.no_grad()
def test_a_draft_vocabulary_drafts_from_its_rows_of_the_lm_head(tmp_path, pair):
    """A checkpoint with `draft_vocab` (token ids) loads into a drafter whose logits are the whole
    drafter's at those ids, whose head holds only those rows, and whose tokens() maps indices back."""
    hf, W, _, target, full, root = pair
    vocab = torch.tensor([3, 7, 8, 50, 95, 2])
    shutil.copytree(root / "drafter", tmp_path / "v")
    save_file({**W, "draft_vocab": vocab}, str(tmp_path / "v" / "model.safetensors"))
    small = load_drafter(tmp_path / "v", target)
    assert torch.equal(small.draft_vocab, vocab) and small.head.shape == (6, hf.config.hidden_size)
    prompts = [[5, 9, 13], [1, 2, 3, 4, 5, 6, 7]]
    outs = []
    for d in (full, small):
        prefill(target, d, prompts)
        outs.append(d(target, torch.tensor([4, 60]), torch.tensor([3, 7])))  # [2, D, V], [2, D, 6]
    torch.testing.assert_close(outs[1], outs[0][..., vocab], atol=1e-6, rtol=1e-6)
    idx = outs[1].argmax(-1)
    assert torch.equal(small.tokens(idx), vocab[idx]) and torch.equal(full.tokens(idx), idx)


@pytest.mark.parametrize("vocab", [torch.tensor([1.0, 2.0]), torch.tensor([3, 96]), torch.tensor([[1, 2]]),
                                   torch.tensor([-1, 4])])
def test_a_draft_vocabulary_that_is_not_token_ids_of_the_target_is_a_checkpoint_error(tmp_path, pair, vocab):
    _, W, _, target, _, root = pair
    shutil.copytree(root / "drafter", tmp_path / "v")
    save_file({**W, "draft_vocab": vocab}, str(tmp_path / "v" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"draft_vocab must be token ids of the target's vocabulary \[0, 96\)"):
        load_drafter(tmp_path / "v", target)
