"""The DFlash drafter (PAPER.md section 2) against a reference written here from the paper alone.

The reference works on the raw checkpoint tensors (z-lab key names) and on Hugging Face's hidden
states, one request at a time, recomputing everything from scratch with no cache:
  context  = hidden_norm(fc(concat of the tapped layers' outputs for the committed tokens))
  per layer: q from the block only; k / v from [context ; block], each through the layer's own
             k_proj / v_proj (+ k_norm, RoPE at absolute positions); attention is not causal
  logits   = target lm_head(norm(block)) on slots 1..block_size-1
minidcut's drafter must match it with requests of different context lengths in one batch, also after
a second round of committed tokens (stale block K/V in its cache must not leak in).
"""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from minidcut.config import ConfigError, default_target_layer_ids, load_drafter_config
from minidcut.loader import load_drafter, load_target
from minidcut.model import causal_layout, prefill_layout
from tiny import hf_config, make_drafter, make_model

MASK = 5


# ---- the reference --------------------------------------------------------------------------------

def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, pos, theta):
    """x [T, heads, Dh] rotated (rotate-half form) to absolute positions pos [T]."""
    Dh = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, Dh, 2).float() / Dh)
    f = pos.float()[:, None] * inv  # [T, Dh/2]
    cos, sin = torch.cat([f, f], -1).cos()[:, None], torch.cat([f, f], -1).sin()[:, None]
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


@torch.no_grad()
def reference_draft(W, cfg, hf_target, committed, anchor):
    """Logits [block_size - 1, V] for ONE request: committed tokens (the context, positions
    0..n-1) and the anchor at position n. W: the drafter's checkpoint tensors; cfg: its config.json."""
    n, bs = len(committed), cfg["block_size"]
    nh, nkv, Dh, theta = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["rope_theta"]
    ids = cfg["dflash_config"]["target_layer_ids"]
    hs = hf_target(torch.tensor([committed]), output_hidden_states=True).hidden_states
    taps = torch.cat([hs[i + 1][0] for i in ids], -1)  # [n, n_taps*H]: OUTPUTS of the tapped layers
    ctx = rms(taps @ W["fc.weight"].T, W["hidden_norm.weight"])  # [n, H]
    x = hf_target.model.embed_tokens(torch.tensor([anchor] + [cfg["dflash_config"]["mask_token_id"]] * (bs - 1)))
    pos_blk = torch.arange(n, n + bs)
    pos_all = torch.arange(n + bs)
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        h = rms(x, W[p + "input_layernorm.weight"])  # [bs, H]
        q = rope(rms((h @ W[p + "self_attn.q_proj.weight"].T).view(bs, nh, Dh), W[p + "self_attn.q_norm.weight"]),
                 pos_blk, theta)
        kv_in = torch.cat([ctx, h])  # [n + bs, H]: context features are NOT input-normed
        k = rope(rms((kv_in @ W[p + "self_attn.k_proj.weight"].T).view(-1, nkv, Dh), W[p + "self_attn.k_norm.weight"]),
                 pos_all, theta)
        v = (kv_in @ W[p + "self_attn.v_proj.weight"].T).view(-1, nkv, Dh)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(Dh), -1)  # no mask at all
        o = torch.einsum("hqk,khd->qhd", att, v).reshape(bs, nh * Dh)
        x = x + o @ W[p + "self_attn.o_proj.weight"].T
        h = rms(x, W[p + "post_attention_layernorm.weight"])
        x = x + (F.silu(h @ W[p + "mlp.gate_proj.weight"].T) * (h @ W[p + "mlp.up_proj.weight"].T)) @ W[p + "mlp.down_proj.weight"].T
    return hf_target.lm_head(rms(x, W["norm.weight"])[1:])  # [bs - 1, V]


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
    _, taps = target(tokens, layout, logits_idx=last, taps=drafter.taps)  # what Engine._prefill does
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


# ---- tests ----------------------------------------------------------------------------------------

@torch.no_grad()
def test_target_taps_are_the_outputs_of_the_tapped_layers(pair):
    hf, _, _, target, drafter, _ = pair
    prompt = [3, 17, 42, 8, 91, 0, 66]
    target.setup_cache(1, 32)
    layout, last = prefill_layout([0], [len(prompt)], "cpu")
    _, taps = target(torch.tensor(prompt), layout, logits_idx=last, taps=drafter.taps)
    hs = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(taps, torch.cat([hs[i + 1][0] for i in drafter.taps], -1), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_drafter_matches_the_uncached_reference_for_a_batch_of_different_context_lengths(pair):
    hf, W, cfg, target, drafter, _ = pair
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
