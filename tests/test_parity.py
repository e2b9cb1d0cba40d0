"""Parity with Hugging Face transformers on tiny random fp32 checkpoints of every supported family
(tests/tiny.py): logits, greedy generation, every checkpoint layout the loader accepts, bf16 loading,
continuous batching, and both config forms.
"""

import copy
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from minidcut.config import parse_model_config
from minidcut.engine import Engine
from minidcut.layers import PackedLinear, rope_inv_freq
from minidcut.loader import load_target
from minidcut.model import prefill_layout
from tiny import BASE, FAMILIES, make_model

V = BASE["vocab_size"]
MOE = [f for f in FAMILIES if "moe" in f]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> (checkpoint directory, the transformers model it was saved from); built on first use."""
    made = {}

    def get(family):
        if family not in made:
            path = tmp_path_factory.mktemp(family)
            made[family] = (path, make_model(path, family))
        return made[family]

    return get


def prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (length,), generator=g).tolist()


@torch.no_grad()
def minidcut_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits [L, V] of every position of one prompt, from a fresh cache row."""
    model.setup_cache(1, 128)
    layout, _ = prefill_layout([0], [len(ids)], "cpu")
    logits, _ = model(torch.tensor(ids), layout)
    return logits.float()


@torch.no_grad()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0]


@torch.no_grad()
def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    out = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def assert_same_logits(a: torch.Tensor, b: torch.Tensor) -> None:
    """Same weights, same math: equal up to float rounding (BLAS may take a different path for
    differently aligned weight buffers, ~1e-6 here)."""
    assert a.shape == b.shape
    assert (a - b).abs().max().item() <= 1e-5


def generate(model, prompts, n, batch_size, eos_ids=()):
    engine = Engine(model, None, None, batch_size=batch_size, max_seq=128, eos_ids=list(eos_ids),
                    compile=False)
    outputs, _ = engine.generate(prompts, n)
    return outputs


# ---- logits and greedy generation ----------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_logits_match_transformers_to_1e_minus_4(tiny, family):
    path, hf = tiny(family)
    ids = prompt(40, seed=1)
    ref = hf_logits(hf, ids)  # [40, V]
    out = minidcut_logits(load_target(path), ids)
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_of_32_tokens_equals_transformers_generate(tiny, family):
    path, hf = tiny(family)
    prompts = [prompt(5, seed=2), prompt(17, seed=3)]
    refs = [hf_greedy(hf, p, 32) for p in prompts]
    outs = generate(load_target(path), prompts, 32, batch_size=2)
    assert all(len(o) == 32 for o in outs)
    assert outs == refs


def packed(path):
    """The target as api.load_pair gives it on a CPU: linear layers packed for oneDNN."""
    target = load_target(path)
    target.pack()
    assert any(isinstance(m, PackedLinear) for m in target.modules())
    return target


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="a torch build without oneDNN")
@pytest.mark.parametrize("family", FAMILIES)
def test_weights_packed_for_onednn_keep_logits_and_greedy_tokens_of_transformers(tiny, family):
    path, hf = tiny(family)
    ids = prompt(40, seed=1)
    assert (minidcut_logits(packed(path), ids) - hf_logits(hf, ids)).abs().max().item() <= 1e-4
    prompts = [prompt(5, seed=2), prompt(17, seed=3)]
    assert generate(packed(path), prompts, 32, batch_size=2) == [hf_greedy(hf, p, 32) for p in prompts]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("pack", [False, True])
def test_fused_projections_keep_logits_and_greedy_tokens_of_transformers(tiny, family, pack):
    """q/k/v and gate/up in one matmul each (Transformer.fuse, as api.load_pair loads): the same math."""
    if pack and not torch.backends.mkldnn.is_available():
        pytest.skip("a torch build without oneDNN")
    path, hf = tiny(family)

    def fused():
        target = load_target(path)
        target.fuse()
        if pack:
            target.pack()
        assert all(layer.self_attn.qkv_proj is not None for layer in target.model.layers)
        return target
    ids = prompt(40, seed=1)
    assert (minidcut_logits(fused(), ids) - hf_logits(hf, ids)).abs().max().item() <= 1e-4
    prompts = [prompt(5, seed=2), prompt(17, seed=3)]
    assert generate(fused(), prompts, 32, batch_size=2) == [hf_greedy(hf, p, 32) for p in prompts]


# ---- checkpoint layouts --------------------------------------------------------------------------

def fused_expert_tensors(path, transposed: bool) -> dict[str, torch.Tensor]:
    """The per-expert checkpoint at `path` rewritten with fused experts: gate_up_proj [E, 2I, H] and
    down_proj [E, H, I], or [E, H, 2I] and [E, I, H] when `transposed`."""
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    out, experts = {}, {}
    for key, t in tensors.items():
        if ".mlp.experts." in key:  # model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight
            prefix, rest = key.split(".mlp.experts.")
            e, proj = rest.split(".")[:2]
            experts.setdefault(prefix, {}).setdefault(proj, {})[int(e)] = t
        else:
            out[key] = t
    assert experts, "the per-expert checkpoint has no expert tensors"
    for prefix, parts in experts.items():
        n = len(parts["down_proj"])
        gate_up = torch.stack([torch.cat([parts["gate_proj"][e], parts["up_proj"][e]]) for e in range(n)])
        down = torch.stack([parts["down_proj"][e] for e in range(n)])
        if transposed:
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        out[f"{prefix}.mlp.experts.gate_up_proj"] = gate_up.contiguous()
        out[f"{prefix}.mlp.experts.down_proj"] = down.contiguous()
    return out


@pytest.mark.parametrize("transposed", [False, True], ids=["E_out_in", "E_in_out"])
@pytest.mark.parametrize("family", MOE)
def test_fused_expert_checkpoint_loads_to_the_same_logits_as_per_expert_keys(tiny, tmp_path, family,
                                                                             transposed):
    path, hf = tiny(family)
    save_file(fused_expert_tensors(path, transposed), str(tmp_path / "model.safetensors"))
    shutil.copy(path / "config.json", tmp_path / "config.json")
    ids = prompt(40, seed=4)
    per_expert = minidcut_logits(load_target(path), ids)
    fused = minidcut_logits(load_target(tmp_path), ids)
    assert_same_logits(fused, per_expert)
    assert (fused - hf_logits(hf, ids)).abs().max().item() <= 1e-4


def test_fused_transposed_experts_load_when_gate_up_is_square(tmp_path):
    """With hidden = 2 * moe_intermediate gate_up_proj is [E, 64, 64] in both orientations; the
    orientation must then come from down_proj ([E, 64, 32] vs [E, 32, 64]), not be guessed."""
    per_expert = tmp_path / "per_expert"
    hf = make_model(per_expert, "qwen3_moe", moe_intermediate_size=32)
    ids = prompt(40, seed=5)
    ref = hf_logits(hf, ids)
    for transposed in (False, True):
        fused = tmp_path / f"fused_{transposed}"
        fused.mkdir()
        save_file(fused_expert_tensors(per_expert, transposed), str(fused / "model.safetensors"))
        shutil.copy(per_expert / "config.json", fused / "config.json")
        err = (minidcut_logits(load_target(fused), ids) - ref).abs().max().item()
        assert err <= 1e-4, f"transposed={transposed}: logits off by {err:.3g}"


@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_checkpoint_loads_to_the_same_logits(tiny, tmp_path, family):
    path, hf = tiny(family)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (tmp_path / "model.safetensors").exists()
    ids = prompt(40, seed=6)
    assert_same_logits(minidcut_logits(load_target(tmp_path), ids), minidcut_logits(load_target(path), ids))


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_load_keeps_bf16_weights_and_is_as_close_to_fp32_as_transformers_in_bf16(tiny, family):
    path, hf = tiny(family)
    model = load_target(path, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ids = prompt(40, seed=7)
    out, ref = minidcut_logits(model, ids), hf_logits(hf, ids)
    hf_bf16 = hf_logits(copy.deepcopy(hf).to(torch.bfloat16), ids).float()
    assert torch.isfinite(out).all()
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.8
    # The scaled-up random weights make bf16 rounding large (~1.5 on logits of ~10 in transformers
    # too): minidcut's bf16 error must be of the same size as transformers' own.
    assert (out - ref).abs().max().item() <= 2 * (hf_bf16 - ref).abs().max().item()


# ---- continuous batching -------------------------------------------------------------------------

LENGTHS = (3, 11, 26, 7, 19)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_batched_requests_generate_what_each_generates_alone(tiny, family):
    path, _ = tiny(family)
    model = load_target(path)
    prompts = [prompt(L, seed=10 + i) for i, L in enumerate(LENGTHS)]
    alone = [generate(model, [p], 32, batch_size=1)[0] for p in prompts]
    assert generate(model, prompts, 32, batch_size=3) == alone


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_requests_ending_early_at_eos_free_rows_for_waiting_requests_without_changing_outputs(tiny, family):
    path, _ = tiny(family)
    model = load_target(path)
    prompts = [prompt(L, seed=10 + i) for i, L in enumerate(LENGTHS)]
    alone = [generate(model, [p], 32, batch_size=1)[0] for p in prompts]
    eos = alone[1][5]  # request 1 stops after at most 6 tokens; others may stop at other steps
    expected = [out[: out.index(eos) + 1] if eos in out else out for out in alone]
    assert len({len(e) for e in expected}) > 1  # rows really free at different steps
    assert generate(model, prompts, 32, batch_size=3, eos_ids=[eos]) == expected


# ---- config forms ----------------------------------------------------------------------------------

DENSE = dict(model_type="llama", vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512, rms_norm_eps=1e-6)
LLAMA3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)


def test_rope_parameters_and_legacy_rope_scaling_give_the_same_config():
    new = parse_model_config({**DENSE, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0,
                                                           **LLAMA3}})
    legacy = parse_model_config({**DENSE, "rope_theta": 500000.0,
                                 "rope_scaling": {"rope_type": "llama3", **LLAMA3}})
    assert new == legacy
    assert new.rope_theta == 500000.0
    assert new.rope_scaling["rope_type"] == "llama3" and new.rope_scaling["factor"] == 8.0


def test_legacy_rope_scaling_type_key_and_rope_parameters_linear_give_the_same_rope():
    legacy = parse_model_config({**DENSE, "rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 2.0}})
    new = parse_model_config({**DENSE, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}})
    assert new.rope_theta == legacy.rope_theta == 1e6
    assert new.rope_scaling["rope_type"] == legacy.rope_scaling["rope_type"] == "linear"
    assert new.rope_scaling["factor"] == legacy.rope_scaling["factor"] == 2.0
    freqs = [rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling) for c in (new, legacy)]
    assert torch.equal(*freqs)
    assert torch.equal(freqs[0], rope_inv_freq(16, 1e6, None) / 2)


def test_default_rope_in_either_form_means_no_scaling():
    new = parse_model_config({**DENSE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    legacy = parse_model_config({**DENSE, "rope_theta": 1e6})
    assert new == legacy
    assert new.rope_scaling is None and new.rope_theta == 1e6


def test_num_local_experts_and_num_experts_are_the_same_field():
    moe = dict(DENSE, model_type="qwen3_moe", num_experts_per_tok=2, moe_intermediate_size=48)
    a = parse_model_config({**moe, "num_experts": 8})
    b = parse_model_config({**moe, "num_local_experts": 8})
    assert a == b
    assert a.num_experts == 8 and a.is_moe_layer(0)


@pytest.mark.parametrize("head_dim", ["absent", None])
def test_missing_head_dim_is_hidden_size_over_heads(head_dim):
    cfg = dict(DENSE, model_type="qwen2")
    if head_dim != "absent":
        cfg["head_dim"] = head_dim
    assert parse_model_config(cfg).head_dim == 16
    assert parse_model_config({**cfg, "head_dim": 32}).head_dim == 32
