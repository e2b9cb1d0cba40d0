"""The target: a from-scratch Llama / Qwen2 / Qwen3 / Qwen2-MoE / Qwen3-MoE decoder.

One packed forward serves prefill, AR decoding and D-cut verification: T tokens from n rows with
different counts per row, written into a static KV cache [rows, kv_heads, max_seq, head_dim] per layer.
It can return the hidden states of chosen layers (the drafter's taps: transformers' hidden_states[id + 1])
and logits for chosen token indices only. Module names match Hugging Face keys, so a checkpoint loads as
it is. Sliding-window layers read a narrower mask of the same layout (windowed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .config import ModelConfig
from .layers import DecoderLayer, RMSNorm, pack_linears, rope_attention_scaling, rope_cos_sin, rope_inv_freq


@dataclass
class Layout:
    """Where the T packed tokens of one forward live.

    row, pos [T]: KV-cache row and absolute position of each token (its K/V is written there).
    slot [T]: cell of the token in the padded attention grid [n, Q].
    mask [n, 1, Q, S] (bool): which cache entries each grid cell may read; None for prefill, which
    attends causally among the prompt's own tokens (prompts start at position 0 in a fresh row)."""

    row: torch.Tensor
    pos: torch.Tensor
    slot: torch.Tensor
    n: int
    Q: int
    mask: torch.Tensor | None
    prefill: bool = False


def causal_layout(row: torch.Tensor, pos: torch.Tensor, col: torch.Tensor, n: int, Q: int,
                  max_seq: int) -> Layout:
    """Layout for tokens appended to rows [0, n) of the cache: a token at position p reads entries
    0..p of its row. Empty grid cells read position 0 (always written) and are discarded."""
    slot = row * Q + col  # [T]
    qpos = torch.zeros(n * Q, dtype=pos.dtype, device=pos.device).index_copy(0, slot, pos)  # [n*Q]
    keys = torch.arange(max_seq, device=pos.device)  # [S]
    mask = keys[None, :] <= qpos[:, None]  # [n*Q, S]
    return Layout(row, pos, slot, n, Q, mask.view(n, 1, Q, max_seq))


def windowed(layout: Layout, window: int) -> Layout:
    """The layout of a sliding-window layer: a token at position p reads only the entries j with
    p - window < j <= p of what `layout` lets it read."""
    device = layout.pos.device
    if layout.prefill:  # the grid column of a prompt token is its position
        i = torch.arange(layout.Q, device=device)
        mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)  # [Q, Q]
        return Layout(layout.row, layout.pos, layout.slot, layout.n, layout.Q, mask[None, None], prefill=True)
    n, Q, S = layout.n, layout.Q, layout.mask.shape[-1]
    qpos = torch.zeros(n * Q, dtype=layout.pos.dtype, device=device).index_copy(0, layout.slot, layout.pos)
    near = torch.arange(S, device=device)[None, :] > qpos[:, None] - window  # [n*Q, S]
    return Layout(layout.row, layout.pos, layout.slot, n, Q, layout.mask & near.view(n, 1, Q, S))


def prefill_layout(rows: list[int], lengths: list[int], device=None) -> tuple[Layout, torch.Tensor]:
    """Layout for prompts of `lengths` entering cache `rows`; returns it and the index of each
    prompt's last token in the packed order [n]. device None: on the host (the engine sends it)."""
    Q, n = max(lengths), len(lengths)
    row = torch.cat([torch.full((L,), r, dtype=torch.long) for r, L in zip(rows, lengths)])
    pos = torch.cat([torch.arange(L) for L in lengths])
    slot = torch.cat([i * Q + torch.arange(L) for i, L in enumerate(lengths)])
    last = torch.tensor(lengths).cumsum(0) - 1
    if device is not None:
        row, pos, slot, last = (t.to(device) for t in (row, pos, slot, last))
    return Layout(row, pos, slot, n, Q, None, prefill=True), last


class KVCache(nn.Module):
    """Static K/V of one layer: [rows, kv_heads, max_seq, head_dim] each. Buffers, so compiled graphs
    see fixed addresses (what CUDA graphs need); not part of the state dict."""

    def __init__(self, rows, kv_heads, max_seq, head_dim, dtype, device):
        super().__init__()
        shape = (rows, kv_heads, max_seq, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling),
                             persistent=False)
        self.rope_scale = rope_attention_scaling(cfg.rope_scaling)
        self.caches = nn.ModuleList()

    @property
    def max_seq(self) -> int:
        return self.caches[0].k.shape[2] if len(self.caches) else 0

    def fuse(self) -> None:
        """q/k/v and gate/up in one matmul each, in every layer (DecoderLayer.fuse); before pack()."""
        for layer in self.model.layers:
            layer.fuse(keep_kv=False)

    def pack(self) -> None:
        """Pack every linear layer (lm_head included) for oneDNN: eager CPU runs (layers.PackedLinear)."""
        pack_linears(self)

    def setup_cache(self, rows: int, max_seq: int) -> None:
        """Allocate the static KV cache, or keep the current one if it has this shape: engines that
        share a target then share the cache tensors, and so the compiled graphs that read them."""
        if len(self.caches) and self.caches[0].k.shape[0] == rows and self.max_seq == max_seq:
            return
        c, w = self.cfg, self.model.embed_tokens.weight
        self.caches = nn.ModuleList(KVCache(rows, c.num_kv_heads, max_seq, c.head_dim, w.dtype, w.device)
                                    for _ in range(c.num_layers))

    def forward(self, tokens: torch.Tensor, layout: Layout, logits_idx: torch.Tensor | None = None,
                taps: tuple[int, ...] = ()):
        """tokens [T] -> (logits [N, V] for tokens logits_idx (all tokens if None),
        taps [T, len(taps) * H]: the tapped layers' outputs concatenated, None if no taps).

        Tap i is transformers' hidden_states[i + 1]: the output of layer i, except for the last layer,
        whose hidden state transformers gives after the final norm."""
        c = self.cfg
        x = self.model.embed_tokens(tokens)  # [T, H]
        cos, sin = rope_cos_sin(self.inv_freq, layout.pos, x.dtype, self.rope_scale)  # [T, Dh]
        sliding = windowed(layout, c.sliding_window) if c.sliding_window and c.sliding_layers else None
        outs = {}  # layer -> its output [T, H], for the taps
        for i, layer in enumerate(self.model.layers):
            cache = (self.caches[i].k, self.caches[i].v) if len(self.caches) else None
            x = layer(x, cos, sin, cache, sliding if c.window(i) else layout)
            outs[i] = x
        if c.num_layers - 1 in taps:
            x = outs[c.num_layers - 1] = self.model.norm(x)  # [T, H]
            h = x if logits_idx is None else x[logits_idx]
        else:
            h = self.model.norm(x if logits_idx is None else x[logits_idx])  # [N, H]
        logits = self.lm_head(h)  # [N, V]
        return logits, (torch.cat([outs[i] for i in taps], dim=-1) if taps else None)
