"""Config fields that change the math, each against transformers on tiny random fp32 checkpoints
(tests/tiny.py): attention and MLP biases, YaRN rope, sliding-window attention. Logits within 1e-4 and
32 greedy tokens identical, as in test_parity.py. Fields minidcut does not implement are a one-line
ConfigError naming the field, never silently ignored.
"""

import json

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from minidcut.config import ConfigError, parse_model_config
from minidcut.layers import rope_attention_scaling, rope_inv_freq
from minidcut.loader import load_target
from minidcut.model import causal_layout, prefill_layout
from test_parity import generate, hf_greedy, hf_logits, minidcut_logits, prompt
from tiny import make_model

YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, rope_theta=10000.0)

CASES = {
    # transformers' Llama: attention_bias on q, k, v AND o; mlp_bias on gate, up, down.
    "llama_attention_bias": ("llama", dict(attention_bias=True)),
    "llama_mlp_bias": ("llama", dict(mlp_bias=True)),
    "qwen3_attention_bias": ("qwen3", dict(attention_bias=True)),  # q, k, v and o too
    "qwen2_moe_without_qkv_bias": ("qwen2_moe", dict(qkv_bias=False)),
    "llama_yarn": ("llama", dict(rope_scaling=YARN)),
    "qwen3_yarn_attention_factor": ("qwen3", dict(rope_scaling={**YARN, "attention_factor": 1.3,
                                                                "beta_fast": 16, "beta_slow": 2})),
    "qwen2_yarn_mscale_no_truncate": ("qwen2", dict(rope_scaling={**YARN, "mscale": 0.8, "mscale_all_dim": 0.5,
                                                                  "truncate": False})),
    "qwen3_moe_yarn": ("qwen3_moe", dict(rope_scaling=YARN)),
    # Sliding windows of 6 positions: prompts of 5..40 tokens and 32 new ones run far past them.
    "qwen2_sliding_from_layer_1": ("qwen2", dict(use_sliding_window=True, sliding_window=6, max_window_layers=1)),
    "qwen3_sliding_layer_types": ("qwen3", dict(use_sliding_window=True, sliding_window=6, layer_types=[
        "sliding_attention", "full_attention", "sliding_attention", "sliding_attention"])),
    "qwen2_moe_sliding": ("qwen2_moe", dict(use_sliding_window=True, sliding_window=6, max_window_layers=4)),
    "qwen3_moe_sliding": ("qwen3_moe", dict(use_sliding_window=True, sliding_window=6)),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """case -> (checkpoint directory, the transformers model it was saved from); built on first use."""
    made = {}

    def get(case):
        if case not in made:
            family, over = CASES[case]
            path = tmp_path_factory.mktemp(case)
            made[case] = (path, make_model(path, family, **over))
        return made[case]

    return get


@pytest.mark.parametrize("case", CASES)
def test_prompt_logits_match_transformers_to_1e_minus_4(tiny, case):
    path, hf = tiny(case)
    ids = prompt(40, seed=1)
    out = minidcut_logits(load_target(path), ids)
    assert (out - hf_logits(hf, ids)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("case", CASES)
def test_greedy_generation_of_32_tokens_equals_transformers_generate(tiny, case):
    path, hf = tiny(case)
    prompts = [prompt(5, seed=2), prompt(17, seed=3)]
    refs = [hf_greedy(hf, p, 32) for p in prompts]
    assert generate(load_target(path), prompts, 32, batch_size=2) == refs


def test_the_checkpoints_really_carry_the_fields(tiny):
    """Guards the cases above against a field that transformers dropped: each one changes the model."""
    model = load_target(tiny("llama_attention_bias")[0])
    assert model.model.layers[0].self_attn.o_proj.bias is not None
    assert load_target(tiny("llama_mlp_bias")[0]).model.layers[0].mlp.down_proj.bias is not None
    assert load_target(tiny("qwen2_moe_without_qkv_bias")[0]).model.layers[0].self_attn.q_proj.bias is None
    assert load_target(tiny("qwen3_yarn_attention_factor")[0]).rope_scale == 1.3
    assert load_target(tiny("qwen2_sliding_from_layer_1")[0]).cfg.sliding_layers == [1, 2, 3]
    assert load_target(tiny("qwen2_moe_sliding")[0]).cfg.sliding_layers == [0, 2]
    assert load_target(tiny("qwen3_moe_sliding")[0]).cfg.sliding_layers == [0, 1, 2, 3]


def test_the_sliding_window_changes_the_logits(tiny):
    """The sliding cases really test a window: without it the same checkpoint gives other logits."""
    model = load_target(tiny("qwen2_sliding_from_layer_1")[0])
    ids = prompt(40, seed=1)
    windowed = minidcut_logits(model, ids)
    model.cfg.sliding_layers = []
    assert (minidcut_logits(model, ids) - windowed).abs().max().item() > 1e-2


@torch.no_grad()
def test_verification_forwards_of_several_tokens_per_row_match_transformers_on_sliding_layers(tiny):
    """What D-cut verification runs: rows at different positions, several new tokens each (a padded
    [n, Q] grid), reading a cache that holds more than the window."""
    path, hf = tiny("qwen3_sliding_layer_types")
    model = load_target(path)
    seqs, starts, counts = [prompt(40, seed=5), prompt(40, seed=6)], [20, 9], [5, 8]
    model.setup_cache(2, 128)
    layout, _ = prefill_layout([0, 1], starts, "cpu")
    model(torch.tensor(seqs[0][:starts[0]] + seqs[1][:starts[1]]), layout)
    refs = [hf_logits(hf, s) for s in seqs]  # [40, V] each
    for _ in range(3):
        row = torch.tensor([i for i, c in enumerate(counts) for _ in range(c)])
        col = torch.cat([torch.arange(c) for c in counts])
        pos = torch.tensor(starts)[row] + col
        logits, _ = model(torch.tensor([seqs[r][p] for r, p in zip(row.tolist(), pos.tolist())]),
                          causal_layout(row, pos, col, 2, max(counts), 128))
        ref = torch.stack([refs[r][p] for r, p in zip(row.tolist(), pos.tolist())])
        assert (logits - ref).abs().max().item() <= 1e-4
        starts = [s + c for s, c in zip(starts, counts)]


@pytest.mark.parametrize("case", ["llama_yarn", "qwen2_sliding_from_layer_1"])
def test_legacy_and_derived_config_forms_give_the_same_logits(tiny, tmp_path, case):
    """YaRN in legacy rope_theta + rope_scaling form; sliding layers derived from use_sliding_window and
    max_window_layers when the config.json has no layer_types (as older Qwen2 configs)."""
    path, hf = tiny(case)
    cfg = json.loads((path / "config.json").read_text())
    if case == "llama_yarn":
        rope = cfg.pop("rope_parameters")
        cfg.update(rope_theta=rope.pop("rope_theta"), rope_scaling=rope)
    else:
        del cfg["layer_types"]
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ids = prompt(40, seed=4)
    assert (minidcut_logits(load_target(tmp_path), ids) - hf_logits(hf, ids)).abs().max().item() <= 1e-4


# ---- the rope and the layer types, field by field ---------------------------------------------------

BASE = dict(vocab_size=96, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=16,
            max_position_embeddings=512)


@pytest.mark.parametrize("rope", [
    {},
    {"truncate": False},
    {"beta_fast": 8, "beta_slow": 0.5},
    {"attention_factor": 0.9},
    {"mscale": 1.0, "mscale_all_dim": 0.7},
    {"factor": None},  # transformers: max_position_embeddings / original_max_position_embeddings
    {"top_level_original_max_position_embeddings": 128},  # wins over the rope dict's value
])
def test_yarn_inv_freq_and_attention_scaling_equal_transformers(rope):
    over = {}
    if "top_level_original_max_position_embeddings" in rope:
        over["original_max_position_embeddings"] = rope.pop("top_level_original_max_position_embeddings")
    raw = dict(BASE, model_type="qwen3", rope_parameters={**YARN, "rope_theta": 1e6, **rope}, **over)
    hf_cfg = transformers.AutoConfig.for_model(**raw)
    ref_inv, ref_scale = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    cfg = parse_model_config(raw)
    assert torch.equal(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling), ref_inv)
    assert rope_attention_scaling(cfg.rope_scaling) == pytest.approx(ref_scale, rel=1e-12)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen2_moe"])
@pytest.mark.parametrize("use, window, first", [(True, 6, 2), (True, 6, 0), (True, 6, 9), (False, 6, 1),
                                                 (True, None, 1)])
def test_sliding_layers_are_derived_as_transformers_derives_layer_types(family, use, window, first):
    raw = dict(BASE, model_type=family, num_hidden_layers=6, use_sliding_window=use, sliding_window=window,
               max_window_layers=first)
    hf_cfg = transformers.AutoConfig.for_model(**raw)
    sliding = [i for i, t in enumerate(hf_cfg.layer_types) if t == "sliding_attention"]
    if sliding and not hf_cfg.sliding_window:  # transformers cannot build that mask: refused
        with pytest.raises(ConfigError, match="use_sliding_window"):
            parse_model_config(raw)
        return
    cfg = parse_model_config(raw)
    assert cfg.sliding_layers == sliding
    assert cfg.sliding_window == (hf_cfg.sliding_window or None)


# ---- refused fields ---------------------------------------------------------------------------------------

DENSE = dict(BASE, model_type="llama", intermediate_size=128)


@pytest.mark.parametrize("field, value", [
    ("hidden_act", "gelu"),
    ("partial_rotary_factor", 0.5),
    ("attn_logit_softcapping", 50.0),
    ("final_logit_softcapping", 30.0),
    ("is_causal", False),
    ("quantization_config", {"quant_method": "fp8"}),
])
def test_a_field_that_changes_the_math_and_is_not_implemented_is_a_config_error_naming_it(field, value):
    with pytest.raises(ConfigError, match=field) as e:
        parse_model_config({**DENSE, field: value})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("rope, field", [
    ({"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"rope_type": "longrope", "rope_theta": 1e4}, "'longrope'"),
    ({"full_attention": {"rope_type": "default", "rope_theta": 1e4}}, "rope_parameters per layer type"),
])
def test_unsupported_rope_parameters_are_a_config_error_naming_the_field(rope, field):
    with pytest.raises(ConfigError, match=field):
        parse_model_config({**DENSE, "rope_parameters": rope})


def test_sliding_layers_without_a_window_are_a_config_error_for_a_target():
    """transformers itself cannot build the mask then (it has no sliding_window)."""
    with pytest.raises(ConfigError, match="use_sliding_window"):
        parse_model_config(dict(BASE, model_type="qwen3", layer_types=["sliding_attention"] * 4))


def test_harmless_and_ignored_fields_load():
    """pretraining_tp is no longer read by transformers 5; llama has no sliding window at all."""
    cfg = parse_model_config({**DENSE, "pretraining_tp": 2, "attention_dropout": 0.1, "hidden_act": "silu",
                              "use_sliding_window": True, "sliding_window": 4})
    assert cfg.sliding_layers == [] and cfg.window(0) is None
