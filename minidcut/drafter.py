"""The DFlash block drafter.

One forward fills a whole block: slot 0 holds the anchor (the last committed token), slots 1..D hold
mask_token_id, and each slot's argmax is a draft token. The drafter has no embedding and no lm_head: it
borrows the target's (borrow(); in the drafter's dtype, which may differ from the target's: drafts only
propose, the target decides, so a bf16 drafter next to an fp32 target changes speed, not the output).
A drafter may carry a draft vocabulary (`draft_vocab` [V'], token ids, an optional tensor beside z-lab's):
it then drafts from those tokens only, its softmax over the V' rows of the lm_head it was trained with,
and tokens() maps an index into its logits to a token id. Its context is the target's hidden states at
the tapped layers (transformers' hidden_states[id + 1] for each target_layer_ids entry id: the output of
layer id, after the final norm for the last layer), fused by fc + hidden_norm and projected by every draft
layer's own k_proj / v_proj into a context-only KV cache. Queries come from the block only; attention is bidirectional over
[context ; block]. As in z-lab's drafter, the config may make layers causal (is_causal; unset, the
sliding layers are) and give sliding layers a window (keys less than `sliding_window` positions away).

While the policy has drafting switched off, verification stores the target's taps as they come
([rows, max_seq, n_taps * H], held_taps) and does no drafter work at all: the next drafting step fuses
them and writes the K/V they miss (catch_up), so it drafts with the context of the skipped steps.
Holding the taps instead of the fused features costs n_taps times their memory and keeps fc and
hidden_norm out of every step that does not draft (docs/method.md, "Skipping drafting").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ConfigError, DrafterConfig, ModelConfig
from .layers import (DecoderLayer, RMSNorm, linear, pack_linears, pack_weight, packable, rope_attention_scaling,
                     rope_cos_sin, rope_inv_freq)
from .model import KVCache, Layout


def check_pair(cfg: DrafterConfig, target: ModelConfig, where: str) -> None:
    """A drafter that cannot run on this target is a clear error, not a shape error deep in torch."""
    if cfg.layers.hidden_size != target.hidden_size:
        raise ConfigError(f"{where}: drafter hidden_size {cfg.layers.hidden_size} != target "
                          f"hidden_size {target.hidden_size}")
    if cfg.num_target_layers not in (-1, target.num_layers):
        raise ConfigError(f"{where}: drafter was made for a {cfg.num_target_layers}-layer target, "
                          f"this target has {target.num_layers} layers")
    if any(not 0 <= t < target.num_layers for t in cfg.target_layer_ids):
        raise ConfigError(f"{where}: target_layer_ids {cfg.target_layer_ids} do not fit a "
                          f"{target.num_layers}-layer target")
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        raise ConfigError(f"{where}: mask_token_id {cfg.mask_token_id} is outside the target "
                          f"vocabulary ({target.vocab_size})")
    if cfg.layers.vocab_size != target.vocab_size:
        raise ConfigError(f"{where}: drafter vocab_size {cfg.layers.vocab_size} != target "
                          f"vocab_size {target.vocab_size}")
    if cfg.block_size < 2:
        raise ConfigError(f"{where}: block_size must be >= 2, got {cfg.block_size}")


def block_mask(anchor_pos: torch.Tensor, Bs: int, S: int, causal: bool, window: int | None) -> torch.Tensor:
    """Which cache entries [b, 1, Bs, S] each block slot reads: the context before the anchor and the
    whole block (only the slots up to itself if causal), and with a window only the entries less than
    `window` positions away (on either side unless causal)."""
    keys = torch.arange(S, device=anchor_pos.device)  # [S]
    qpos = anchor_pos[:, None, None] + torch.arange(Bs, device=anchor_pos.device)[:, None]  # [b, Bs, 1]
    visible = (keys < (anchor_pos + Bs)[:, None])[:, None, :].expand(-1, Bs, -1)  # [b, Bs, S]
    if causal:
        visible = visible & (keys <= qpos)
    if window:
        visible = visible & (qpos - keys < window)
        if not causal:
            visible = visible & (keys - qpos < window)
    return visible[:, None]


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        c = cfg.layers
        self.block_size = cfg.block_size
        self.taps = tuple(cfg.target_layer_ids)
        self.fc = nn.Linear(len(self.taps) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.register_buffer("inv_freq", rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling),
                             persistent=False)
        self.rope_scale = rope_attention_scaling(c.rope_scaling)
        self.attention = [(i in cfg.causal_layers, c.window(i)) for i in range(c.num_layers)]  # per layer
        self.caches = nn.ModuleList()
        self.embed = self.head = None  # the target's embedding and lm_head weights (borrow)
        self.register_buffer("draft_vocab", None)  # [V'] token ids drafted from; None: the whole vocabulary

    def borrow(self, target: nn.Module) -> None:
        """Take the target's token embedding and lm_head weights in the drafter's dtype: the target's own
        tensors when the dtypes agree, else copies made once (tied weights: one copy). With a draft
        vocabulary the head is a copy of its rows [V', H]."""
        dt = self.norm.weight.dtype
        emb, head = target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach()
        self.embed = emb.to(dt)
        if self.draft_vocab is not None:
            self.head = self.head_rows(head).to(dt)
        else:
            self.head = self.embed if head.data_ptr() == emb.data_ptr() else head.to(dt)

    def head_rows(self, head: torch.Tensor) -> torch.Tensor:
        """The lm_head rows [V', H] the drafter drafts from: all of them without a draft vocabulary."""
        return head if self.draft_vocab is None else head[self.draft_vocab.to(head.device)]

    def tokens(self, idx: torch.Tensor) -> torch.Tensor:
        """Indices into the drafter's logits -> token ids (the same without a draft vocabulary)."""
        return idx if self.draft_vocab is None else self.draft_vocab[idx]

    def fuse(self) -> None:
        """Fused projections in every draft layer (DecoderLayer.fuse), k_proj and v_proj kept for the
        context's K/V; before pack()."""
        for layer in self.layers:
            layer.fuse(keep_kv=True)

    def pack(self) -> None:
        """Pack the drafter's linear layers and its lm_head for oneDNN (eager CPU runs: layers.PackedLinear)."""
        pack_linears(self)
        if self.head is not None and packable(self.head):
            self.head = pack_weight(self.head)

    def setup_cache(self, rows: int, max_seq: int) -> None:
        """Context K/V per draft layer [rows, kv_heads, max_seq, head_dim] and the held taps
        [rows, max_seq, n_taps * H] (kept if already that shape)."""
        if len(self.caches) and self.caches[0].k.shape[0] == rows and self.caches[0].k.shape[2] == max_seq:
            return
        c, w = self.cfg.layers, self.norm.weight
        self.caches = nn.ModuleList(KVCache(rows, c.num_kv_heads, max_seq, c.head_dim, w.dtype, w.device)
                                    for _ in range(c.num_layers))
        self.register_buffer("held_taps", torch.zeros(rows, max_seq, len(self.taps) * c.hidden_size, dtype=w.dtype,
                                                      device=w.device), persistent=False)  # [rows, max_seq, n_taps*H]

    def add_context(self, taps: torch.Tensor, row: torch.Tensor, pos: torch.Tensor, write: bool = True) -> None:
        """Write the context K/V of verified tokens (write=True), or only hold their taps for a later
        catch_up (write=False: a step that does not draft). taps [T, n_taps * H]; row, pos [T]. Tokens that later
        turn out rejected leave entries past the committed length: never read (the draft mask stops at
        the anchor) and overwritten when that position is committed."""
        taps = taps.to(self.norm.weight.dtype)
        if write:
            self._write_kv(taps, row, pos)
        else:
            self.held_taps[row, pos] = taps

    def catch_up(self, row: torch.Tensor, pos: torch.Tensor) -> None:
        """Write the context K/V at (row, pos) [T] from the held taps (after steps that did not draft)."""
        self._write_kv(self.held_taps[row, pos], row, pos)

    def _write_kv(self, taps: torch.Tensor, row: torch.Tensor, pos: torch.Tensor) -> None:
        """Fuse taps [T, n_taps * H] (fc + hidden_norm) and write every draft layer's context K/V."""
        feats = self.hidden_norm(self.fc(taps))  # [T, H]
        cos, sin = rope_cos_sin(self.inv_freq, pos, feats.dtype, self.rope_scale)
        for layer, cache in zip(self.layers, self.caches):
            k, v = layer.self_attn.project_kv(feats, cos, sin)  # [T, n_kv, Dh]
            cache.k[row, :, pos] = k
            cache.v[row, :, pos] = v

    def forward(self, target: nn.Module, anchor: torch.Tensor, anchor_pos: torch.Tensor,
                span: int | None = None) -> torch.Tensor:
        """Draft one block per row of the cache [0, b). anchor, anchor_pos [b] -> logits [b, D, V] (V' with
        a draft vocabulary: tokens() maps them), with the target's embedding and lm_head (as borrowed,
        or the target's own modules).

        The block's own K/V go into the cache at anchor_pos .. anchor_pos + D: positions that the
        next verification overwrites with real context, so no separate block cache is needed.
        span: the cache positions attention reads (default: all); at least every live row's
        anchor_pos + block (empty rows are moved inside it, so a window never hides every key)."""
        b, Bs, S = anchor.shape[0], self.block_size, span or self.caches[0].k.shape[2]
        if span is not None:
            anchor_pos = anchor_pos.clamp(max=span - Bs)
        offs = torch.arange(Bs, device=anchor.device)  # [Bs]
        block = torch.full((b, Bs), self.cfg.mask_token_id, dtype=anchor.dtype, device=anchor.device)
        block[:, 0] = anchor  # [b, Bs]: anchor, mask, ..., mask
        pos = (anchor_pos[:, None] + offs).flatten()  # [b*Bs]
        row = torch.arange(b, device=anchor.device).repeat_interleave(Bs)  # [b*Bs]
        slot = torch.arange(b * Bs, device=anchor.device)
        layouts = {kind: Layout(row, pos, slot, b, Bs, block_mask(anchor_pos, Bs, S, *kind))
                   for kind in dict.fromkeys(self.attention)}
        embed, head = (self.embed, self.head) if self.embed is not None else (
            target.model.embed_tokens.weight, self.head_rows(target.lm_head.weight))
        x = F.embedding(block.flatten(), embed)  # [b*Bs, H]
        cos, sin = rope_cos_sin(self.inv_freq, pos, x.dtype, self.rope_scale)
        for layer, cache, kind in zip(self.layers, self.caches, self.attention):
            x = layer(x, cos, sin, (cache.k, cache.v), layouts[kind])
        h = self.norm(x).view(b, Bs, -1)[:, 1:].reshape(b * (Bs - 1), -1)  # [b*D, H], contiguous:
        return linear(h, head).view(b, Bs - 1, -1)  # [b, D, V]  (a 3-D strided input makes a slow bmm)
