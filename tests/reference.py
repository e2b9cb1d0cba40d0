"""The DFlash drafter's reference, written from the DFlash description and z-lab's drafter
(tests/test_drafter.py says what it computes): one request at a time, from the raw checkpoint tensors
and Hugging Face's hidden states, everything recomputed with no cache."""

import math

import torch
import torch.nn.functional as F
import transformers
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding


def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, cos, sin):
    """x [T, heads, Dh] rotated (rotate-half form) by cos, sin [T, Dh]."""
    x1, x2 = x.chunk(2, -1)
    return x * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]


def hf_rotary(cfg, pos):
    """cos, sin [T, Dh] at positions pos [T]: transformers' Qwen3 rotary embedding on the drafter's
    config.json (what z-lab's drafter uses), rope scaling included."""
    cos, sin = Qwen3RotaryEmbedding(transformers.Qwen3Config(**cfg))(torch.zeros(1), pos[None])
    return cos[0], sin[0]


def visible(cfg, i, qpos, kpos):
    """[q, k] bool: which keys draft layer i's block queries read, as z-lab's drafter masks them."""
    hf = transformers.Qwen3Config(**cfg)
    sliding = hf.layer_types[i] == "sliding_attention"
    causal = sliding if cfg.get("is_causal") is None else cfg["is_causal"]
    window = hf.sliding_window if sliding else None
    d = qpos[:, None] - kpos[None, :]  # [q, k]
    ok = torch.ones_like(d, dtype=torch.bool)
    if causal:
        ok &= d >= 0
    if window is not None:
        ok &= d < window
        if not causal:
            ok &= -d < window
    return ok


@torch.no_grad()
def reference_draft(W, cfg, hf_target, committed, anchor):
    """Logits [block_size - 1, V] for ONE request: committed tokens (the context, positions
    0..n-1) and the anchor at position n. W: the drafter's checkpoint tensors; cfg: its config.json."""
    n = len(committed)
    bs = cfg.get("block_size") or cfg["dflash_config"]["block_size"]
    nh, nkv, Dh = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    ids = cfg["dflash_config"]["target_layer_ids"]
    hs = hf_target(torch.tensor([committed]), output_hidden_states=True).hidden_states
    taps = torch.cat([hs[i + 1][0] for i in ids], -1)  # [n, n_taps*H]: hidden_states[id + 1]
    ctx = rms(taps @ W["fc.weight"].T, W["hidden_norm.weight"])  # [n, H]
    x = hf_target.model.embed_tokens(torch.tensor([anchor] + [cfg["dflash_config"]["mask_token_id"]] * (bs - 1)))
    pos_blk = torch.arange(n, n + bs)
    pos_all = torch.arange(n + bs)
    cos, sin = hf_rotary(cfg, pos_all)  # [n + bs, Dh]
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        h = rms(x, W[p + "input_layernorm.weight"])  # [bs, H]
        q = rope(rms((h @ W[p + "self_attn.q_proj.weight"].T).view(bs, nh, Dh), W[p + "self_attn.q_norm.weight"]),
                 cos[n:], sin[n:])
        kv_in = torch.cat([ctx, h])  # [n + bs, H]: context features are NOT input-normed
        k = rope(rms((kv_in @ W[p + "self_attn.k_proj.weight"].T).view(-1, nkv, Dh), W[p + "self_attn.k_norm.weight"]),
                 cos, sin)
        v = (kv_in @ W[p + "self_attn.v_proj.weight"].T).view(-1, nkv, Dh)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(Dh)
        att = torch.softmax(scores.masked_fill(~visible(cfg, i, pos_blk, pos_all), -math.inf), -1)
        o = torch.einsum("hqk,khd->qhd", att, v).reshape(bs, nh * Dh)
        x = x + o @ W[p + "self_attn.o_proj.weight"].T
        h = rms(x, W[p + "post_attention_layernorm.weight"])
        x = x + (F.silu(h @ W[p + "mlp.gate_proj.weight"].T) * (h @ W[p + "mlp.up_proj.weight"].T)) @ W[p + "mlp.down_proj.weight"].T
    return hf_target.lm_head(rms(x, W["norm.weight"])[1:])  # [bs - 1, V]
