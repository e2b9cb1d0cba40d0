"""Tiny random Hugging Face checkpoints for tests: every family minidcut supports, saved with
save_pretrained, weights scaled up so logits are far from ties."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import transformers

from minidcut.policy import Policy

BASE = dict(vocab_size=96, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512,
            rms_norm_eps=1e-6, eos_token_id=None, bos_token_id=None, pad_token_id=None)

FAMILIES = {
    "llama": dict(model_type="llama", tie_word_embeddings=True, head_dim=16,
                  rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                    high_freq_factor=4.0, original_max_position_embeddings=64)),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=False),
    "qwen3": dict(model_type="qwen3", head_dim=32, tie_word_embeddings=False),
    "qwen2_moe": dict(model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=48, shared_expert_intermediate_size=96,
                      decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=False),
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=48, norm_topk_prob=True, head_dim=16),
    "qwen3_moe_nonorm": dict(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                             moe_intermediate_size=48, norm_topk_prob=False),
}


def hf_config(family: str, **over):
    kw = {**BASE, **FAMILIES[family], **over}
    mt = kw.pop("model_type")
    return transformers.AutoConfig.for_model(mt, **kw)


def make_model(path: Path, family: str, seed: int = 0, scale: float = 3.0, **over):
    """Save a random tiny `family` model to `path`; returns the transformers model (fp32, eval)."""
    torch.manual_seed(seed)
    cfg = hf_config(family, **over)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.dim() >= 2:
                p.copy_(torch.randn_like(p) * scale / p.shape[-1] ** 0.5)
            else:
                p.normal_(0, 0.1)
    model.save_pretrained(path)
    return model


def make_drafter(path: Path, target_cfg, n_layers: int = 2, block_size: int = 16, mask_token_id: int = 1,
                 seed: int = 0, target_layer_ids=None, scale: float = 1.0, **config):
    """A z-lab-layout DFlash drafter directory with random weights, sized to `target_cfg`
    (a transformers config); `config` adds or replaces config.json fields (rope, sliding window, ...).
    Returns the tensors it saved."""
    from safetensors.torch import save_file
    torch.manual_seed(seed)
    H = target_cfg.hidden_size
    heads, kv, hd, inter = 4, 2, 16, 2 * H
    taps = target_layer_ids or [1, target_cfg.num_hidden_layers - 2][:n_layers]
    t = {"fc.weight": torch.randn(H, len(taps) * H) * scale / (len(taps) * H) ** 0.5,
         "hidden_norm.weight": 1 + 0.1 * torch.randn(H), "norm.weight": 1 + 0.1 * torch.randn(H)}
    for i in range(n_layers):
        p = f"layers.{i}."
        shapes = {"self_attn.q_proj.weight": (heads * hd, H), "self_attn.k_proj.weight": (kv * hd, H),
                  "self_attn.v_proj.weight": (kv * hd, H), "self_attn.o_proj.weight": (H, heads * hd),
                  "mlp.gate_proj.weight": (inter, H), "mlp.up_proj.weight": (inter, H),
                  "mlp.down_proj.weight": (H, inter)}
        for k, s in shapes.items():
            t[p + k] = torch.randn(s) * scale / s[1] ** 0.5
        for k, d in (("input_layernorm.weight", H), ("post_attention_layernorm.weight", H),
                     ("self_attn.q_norm.weight", hd), ("self_attn.k_norm.weight", hd)):
            t[p + k] = 1 + 0.1 * torch.randn(d)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in t.items()}, str(path / "model.safetensors"))
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": H,
           "num_hidden_layers": n_layers, "num_attention_heads": heads, "num_key_value_heads": kv,
           "head_dim": hd, "intermediate_size": inter, "vocab_size": target_cfg.vocab_size,
           "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512,
           "block_size": block_size, "num_target_layers": target_cfg.num_hidden_layers,
           "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": taps},
           "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu", **config}
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return t


def make_tokenized_pair(root: Path, vocab_size: int = 300) -> tuple[Path, Path]:
    """A tiny llama target WITH a byte-level BPE tokenizer (trained on a few stdlib files) and a
    random z-lab-layout drafter whose mask token is the tokenizer's <|mask|>: what the CLI, the examples
    and the tools need. Returns (target_dir, drafter_dir)."""
    import shutil
    import sysconfig

    from tools.train_tokenizer import train_tokenizer
    corpus = root / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("bisect.py", "heapq.py", "textwrap.py", "string.py"):
        shutil.copy(stdlib / name, corpus / name)
    tok = train_tokenizer(corpus, vocab_size)
    target, drafter = root / "target", root / "drafter"
    hf = make_model(target, "llama", vocab_size=len(tok), max_position_embeddings=1024)
    tok.save_pretrained(target)
    make_drafter(drafter, hf.config, mask_token_id=tok.convert_tokens_to_ids("<|mask|>"))
    return target, drafter


class Alternating(Policy):
    """static 0.5 that skips drafting on every `period`-th step: the AR steps between leave the drafter's
    context behind for the next drafting step to catch up, and drop any draft made ahead."""

    def __init__(self, period: int):
        super().__init__("static", [0.5])
        self.period, self.n = period, 0

    def plan(self, bucket, behind=0, n_live=None, usable=None):
        self.n += 1
        return dataclasses.replace(super().plan(bucket, behind, n_live, usable), draft=self.n % self.period != 0)
