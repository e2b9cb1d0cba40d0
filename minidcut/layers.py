"""Building blocks shared by the target and the drafter: RMSNorm, RoPE (default, linear, Llama-3, YaRN),
GQA attention over a static KV cache, SwiGLU MLP and the MoE block (its grouped matmul never syncs with
the host).

Token layout. A forward takes a PACKED batch of T tokens (rows with different token counts, no padding
in the linear layers). Attention alone works on a padded grid [n, Q]: token t sits at grid cell
slot[t] = i * Q + j. Decoding uses Q = 1 (one token per row), verification Q = block_size.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32, cast back, then scale: the order transformers uses (bit-exact parity).
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], with linear, Llama-3 or YaRN scaling applied."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv / factor
    if scaling["rope_type"] == "yarn":
        return yarn_inv_freq(head_dim, theta, scaling)
    # llama3: long wavelengths scaled down by `factor`, short ones kept, a smooth ramp between.
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def yarn_inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN: dimensions that turn more than beta_fast times over the original context keep their
    frequency, those turning fewer than beta_slow times are divided by `factor`, a linear ramp between
    (transformers' formula, truncate included)."""
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(rotations):  # the dimension that turns `rotations` times over old_len positions
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    keep = 1 - ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    return 1.0 / (factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep


def rope_attention_scaling(scaling: dict | None) -> float:
    """The factor transformers multiplies cos and sin by: YaRN's attention_factor (given, or from
    mscale / mscale_all_dim, or 0.1 ln(factor) + 1); 1 for the other rope types."""
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor, m, m_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if m and m_all:
        return float(mscale(factor, m) / mscale(factor, m_all))
    return mscale(factor)


def rope_cos_sin(inv_freq: torch.Tensor, pos: torch.Tensor, dtype: torch.dtype, scale: float = 1.0):
    """cos, sin [*pos.shape, head_dim] for absolute positions `pos`, times `scale` (YaRN's attention
    scaling); fp32 math, then cast."""
    freqs = pos.float()[..., None] * inv_freq  # [..., Dh/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [..., Dh]
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (the layout HF stores q/k weights in). x [..., heads, Dh], cos [..., Dh]."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos[..., None, :] + rotated * sin[..., None, :]


def to_grid(x: torch.Tensor, slot: torch.Tensor, n: int, Q: int) -> torch.Tensor:
    """Packed [T, heads, Dh] -> padded grid [n, heads, Q, Dh]; empty cells are zero."""
    grid = x.new_zeros(n * Q, *x.shape[1:]).index_copy(0, slot, x)  # [n*Q, heads, Dh]
    return grid.view(n, Q, *x.shape[1:]).transpose(1, 2)


def stacked_linear(parts: list[nn.Linear]) -> nn.Linear:
    """One frozen nn.Linear whose output is the parts' outputs side by side (weights and biases stacked
    along the output dimension): several projections of the same input in one matmul."""
    first = parts[0]
    out = nn.Linear(first.in_features, sum(m.out_features for m in parts), bias=first.bias is not None,
                    device=first.weight.device, dtype=first.weight.dtype)
    with torch.no_grad():
        out.weight.copy_(torch.cat([m.weight for m in parts]))
        if out.bias is not None:
            out.bias.copy_(torch.cat([m.bias for m in parts]))
    return out.requires_grad_(False)


class Attention(nn.Module):
    """GQA attention. K/V of every token are written into the static cache at (row, pos) before
    attending, so verification needs no rollback: entries past a row's committed length are masked
    by position and overwritten later."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        H, Dh = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, Dh
        self.q_proj = nn.Linear(H, cfg.num_heads * Dh, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(H, cfg.num_kv_heads * Dh, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(H, cfg.num_kv_heads * Dh, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * Dh, H, bias=cfg.o_proj_bias)
        self.q_norm = RMSNorm(Dh, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(Dh, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.qkv_proj = None  # fuse(): q, k and v in one matmul

    def fuse(self, keep_kv: bool) -> None:
        """One [H, (Hq + 2 Hkv) Dh] projection for q, k and v of the same tokens (one matmul instead of
        three; measured on a 2-core CPU, fp32, 1 thread: 105 -> 53 us for 4 rows at H = 256). keep_kv:
        keep k_proj and v_proj too, for project_kv of other inputs (the drafter's context)."""
        parts = [self.q_proj, self.k_proj, self.v_proj]
        self.qkv_proj, self.split = stacked_linear(parts), [m.out_features for m in parts]
        del self.q_proj
        if not keep_kv:
            del self.k_proj, self.v_proj

    def finish_kv(self, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Projected k, v [T, n_kv * Dh] -> [T, n_kv, Dh] each (k normed and rotated, as the cache holds it)."""
        k = k.view(-1, self.n_kv, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return apply_rope(k, cos, sin), v.view(-1, self.n_kv, self.head_dim)

    def finish_q(self, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q = q.view(-1, self.n_heads, self.head_dim)  # [T, Hq, Dh]
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rope(q, cos, sin)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [T, H] -> k, v [T, n_kv, Dh] (k normed and rotated, as stored in the cache)."""
        return self.finish_kv(self.k_proj(x), self.v_proj(x), cos, sin)

    def project_q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.finish_q(self.q_proj(x), cos, sin)

    def forward(self, x, cos, sin, cache, layout):
        """x [T, H] -> [T, H]. `cache` is (k_cache, v_cache) [R, n_kv, S, Dh] or None;
        `layout` is the Layout of this forward (grid shape, slots, positions, mask)."""
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
            q, (k, v) = self.finish_q(q, cos, sin), self.finish_kv(k, v, cos, sin)
        else:
            q = self.project_q(x, cos, sin)
            k, v = self.project_kv(x, cos, sin)
        qg = to_grid(q, layout.slot, layout.n, layout.Q)  # [n, Hq, Q, Dh]
        if layout.prefill:
            # Prompts start at position 0 in fresh rows: attend causally among the prompt's own tokens
            # (a sliding-window layer's prefill layout carries its own [Q, Q] mask).
            kg, vg = to_grid(k, layout.slot, layout.n, layout.Q), to_grid(v, layout.slot, layout.n, layout.Q)
            out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=layout.mask,
                                                 is_causal=layout.mask is None, enable_gqa=True)
        else:
            kg, vg = None, None
        if cache is not None:
            k_cache, v_cache = cache
            k_cache[layout.row, :, layout.pos] = k
            v_cache[layout.row, :, layout.pos] = v
            if not layout.prefill:  # the first S positions, S from the mask (the step's span)
                S = layout.mask.shape[-1]
                kg, vg = k_cache[: layout.n, :, :S], v_cache[: layout.n, :, :S]  # [n, n_kv, S, Dh], a view
        if not layout.prefill:
            out = attend(qg, kg, vg, layout.mask)
        out = out.transpose(1, 2).reshape(layout.n * layout.Q, -1)[layout.slot]  # [T, Hq*Dh]
        return self.o_proj(out)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention of a decode step: q [n, Hq, Q, Dh] over k, v [n, Hk, S, Dh] (views of the cache) where
    mask [n, 1, Q, S] -> [n, Hq, Q, Dh]. SDPA, except in 16 bits on a CPU, where torch's flash kernel
    runs a step of few queries ~10x slower than batched matmuls (32 ms against 3.3 ms at n = 64,
    S = 320, SmolLM2's heads, one core; in fp32 both take 7 ms): there, fp32 scores, softmax, the
    weighted sum. The scores are k @ q^T, the cache's view untransposed: 14 ms against 60 ms for
    q @ k^T at n = 128, S = 500 (bmm still copies the strided view, less of it)."""
    if q.device.type != "cpu" or q.dtype == torch.float32:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    n, Hq, Q, Dh = q.shape
    Hk, S = k.shape[1], k.shape[2]
    G = Hq // Hk  # query heads per KV head: head h reads KV head h // G
    qT = q.reshape(n * Hk, G * Q, Dh).transpose(1, 2)  # [n*Hk, Dh, G*Q]
    scores = torch.bmm(k.reshape(n * Hk, S, Dh), qT).float().view(n, Hk, S, G, Q) * Dh ** -0.5
    scores = scores.masked_fill(~mask.transpose(2, 3)[:, :, :, None, :], float("-inf"))  # mask as [n, 1, S, 1, Q]
    weights = torch.softmax(scores, dim=2).to(v.dtype).view(n * Hk, S, G * Q)
    return torch.bmm(weights.transpose(1, 2), v.reshape(n * Hk, S, Dh)).view(n, Hq, Q, Dh)


def packable(weight: torch.Tensor) -> bool:
    """Whether a CPU matmul with this weight can use oneDNN with the weight reordered once: fp32 on a
    CPU build with oneDNN; bf16 only where the CPU has bf16 instructions (oneDNN refuses it elsewhere,
    e.g. on an AVX2-only CPU, and plain matmuls run it)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return weight.dtype == torch.float32


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] in oneDNN's own blocked layout (an opaque tensor that only linear() reads)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias, for a plain weight or one from pack_weight."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class PackedLinear(nn.Module):
    """A frozen nn.Linear with its weight packed for oneDNN. Measured on a 2-core AVX-512 CPU, fp32,
    1 thread: 2-3x faster than torch's default (MKL) matmul for 1-16 rows (a decode step, a
    verification), where MKL's small-M path is slow. Eager only: inductor cannot compile the packed
    weight, so compiled runs keep plain weights (api.load_pair(pack=...))."""

    def __init__(self, lin: nn.Linear):
        super().__init__()
        self.register_buffer("weight", pack_weight(lin.weight), persistent=False)
        self.bias = lin.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def pack_linears(module: nn.Module) -> None:
    """Replace every nn.Linear under `module` whose weight is packable by a PackedLinear."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear) and packable(child.weight):
            setattr(module, name, PackedLinear(child))
        else:
            pack_linears(child)


def is_packed(*modules: nn.Module | None) -> bool:
    """Whether any of `modules` holds linear layers packed for oneDNN (eager only; cost tables are
    measured apart for packed and plain weights)."""
    return any(isinstance(m, PackedLinear) for mod in modules if mod is not None for m in mod.modules())


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.gate_up_proj = None  # fuse(): gate and up in one matmul

    def fuse(self) -> None:
        """One [H, 2I] projection for gate and up (one matmul instead of two)."""
        self.gate_up_proj = stacked_linear([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def forward(self, x):
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def native_grouped_mm(x: torch.Tensor) -> bool:
    """Whether torch._grouped_mm multiplies x [M, K] without a host sync: on CPU (any float dtype) and
    with CUDA bf16 on compute capability 9.x / 10.x (its grouped GEMM kernel); elsewhere it loops over
    the groups after copying `offs` to the host. It needs 16-byte aligned rows: K long in x and in the
    transposed expert weights MoE passes as w."""
    if x.shape[1] * x.element_size() % 16:
        return False
    if x.device.type == "cpu":
        return True
    return (x.is_cuda and torch.version.hip is None and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device)[0] in (9, 10))


def tiled_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """grouped_mm without a host sync on any device: each expert's rows are cut into tiles of m rows
    (the last one zero-padded), each tile is multiplied by a gathered copy of its expert's weight in
    one bmm. With m = ceil(M / E) there are at most M // m + min(E, M) tiles, whatever the routing: at
    most 2 min(E, M) weight copies and 2 M rows, so the cost follows the M = T*k routed rows."""
    M, K = x.shape
    E = w.shape[0]
    m = max(1, -(-M // E))  # rows per tile
    n_tiles = (M + min(E, M) * (m - 1)) // m  # a static bound on sum_e ceil(count_e / m)
    counts = torch.diff(offs, prepend=offs.new_zeros(1))  # [E] rows per expert
    tiles = (counts + m - 1) // m  # [E] tiles per expert
    tile_end = torch.cumsum(tiles, 0)  # [E]
    rows = torch.arange(M, device=x.device)
    expert = torch.searchsorted(offs, rows.to(offs.dtype), right=True)  # [M] expert of each row
    slot = (tile_end - tiles)[expert] * m + rows - (offs - counts)[expert]  # [M] row in the tiled layout
    tile_expert = torch.searchsorted(tile_end, torch.arange(n_tiles, device=x.device, dtype=tile_end.dtype),
                                     right=True).clamp(max=E - 1)  # [n_tiles]; unused tiles: any expert
    tiled = x.new_zeros(n_tiles * m, K).index_copy(0, slot, x).view(n_tiles, m, K)
    # Gather the weights as stored ([E, N, K] contiguous under the transposed view) and bmm the view.
    w_tiles = w.mT[tile_expert].mT if w.mT.is_contiguous() else w[tile_expert]  # [n_tiles, K, N]
    return torch.bmm(tiled, w_tiles).view(n_tiles * m, -1)[slot]  # [M, N]


@torch.library.custom_op("minidcut::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows x[offs[e-1]:offs[e]] times w[e] for each expert e. x [M, K], w [E, K, N] -> [M, N].

    One opaque op, so the MoE block stays a single static graph, and no host sync on any device or
    dtype (CUDA-graph safe): torch's grouped GEMM where it has one without a sync, else tiles."""
    if native_grouped_mm(x):
        return torch._grouped_mm(x, w, offs=offs)
    return tiled_grouped_mm(x, w, offs)


@grouped_mm.register_fake
def _(x, w, offs):
    return x.new_empty(x.shape[0], w.shape[2])


class Experts(nn.Module):
    """Expert weights, fused as transformers 5 stores them: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""

    def __init__(self, E: int, H: int, I: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, I))


class MoE(nn.Module):
    """Sparse MoE: fp32 router softmax over all experts, top-k, optional renormalisation, then each
    routed (token, expert) pair computed once: cost is T*k expert rows, never T*E."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(H, E, bias=False)  # the router
        self.experts = Experts(E, H, I)
        self.shared_expert = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(H, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(H, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, E = self.top_k, self.experts.gate_up_proj.shape[0]
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [T, E]
        weight, expert = torch.topk(probs, k, dim=-1)  # [T, k]
        if self.norm_topk_prob:
            weight = weight / weight.sum(-1, keepdim=True)
        weight = weight.to(x.dtype)
        # Sort the T*k (token, expert) pairs by expert so each expert sees one contiguous group.
        flat = expert.flatten()  # [T*k]
        order = torch.argsort(flat, stable=True)  # [T*k]
        token = order // k  # [T*k] source token of each sorted pair
        counts = torch.zeros(E, dtype=torch.int32, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)  # [E] group ends
        xs = x[token]  # [T*k, H]
        gate, up = grouped_mm(xs, self.experts.gate_up_proj.transpose(1, 2), offs).chunk(2, dim=-1)
        ys = grouped_mm(F.silu(gate) * up, self.experts.down_proj.transpose(1, 2), offs)  # [T*k, H]
        ys = ys * weight.flatten()[order, None]
        out = torch.zeros_like(x).index_add_(0, token, ys)  # [T, H]
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = (MoE(cfg) if cfg.is_moe_layer(i)
                    else MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias))

    def fuse(self, keep_kv: bool) -> None:
        """Fused projections (Attention.fuse, MLP.fuse; a MoE's shared expert too): the same math in fewer
        matmuls. Loaded weights keep their checkpoint names until then (load_pair fuses after loading)."""
        self.self_attn.fuse(keep_kv)
        for m in self.mlp.modules():
            if isinstance(m, MLP):
                m.fuse()

    def forward(self, x, cos, sin, cache, layout):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layout)
        return x + self.mlp(self.post_attention_layernorm(x))
