"""Train a DFlash-architecture block drafter for any target minidcut loads (docs/method.md, "DFlash drafting").

Recipe. The target is frozen; the drafter borrows its embed_tokens and lm_head. Training sequences are
the target's OWN greedy continuations of corpus windows (self-distillation: at inference the drafter
continues the target's text, so that is the text it should learn). For every sequence we keep the
target's tapped hidden states and its greedy next token at every position. Each step draws many random
anchors per sequence; a block is the anchor plus block_size - 1 mask tokens at the following positions.
A block's queries see the context features strictly before its anchor and their own block
(bidirectionally), never another block. Slot k is trained with cross-entropy against the target's greedy
token at position anchor + k, weighted by exp(-(k - 1) / decay): early slots matter most, since a draft
is only useful if all before it are accepted.

Data: by default the target continues windows of the stdlib corpus here; `--data FILE` trains on a
data file of tools/distill.py instead (e.g. chat answers; anchors then start at each answer's first
token). Sequences may differ in length: a slot whose label lies past its sequence's end is not counted.
Such data is the target's greedy text already, so its labels are its next tokens and the features pass
stops at the last tapped layer (`--features-dtype bfloat16` halves it again on CPUs with bf16 instructions).

Cost. On a CPU a step's time goes mostly to the frozen lm_head (every trained slot against the whole
vocabulary) and the draft layers. `--data-vocab` runs the training softmax over the tokens that occur in
the data only: SmolLM2's chat data uses 9,481 of 49,152 tokens. Those tokens are saved with the drafter
as its draft vocabulary (`draft_vocab`), so at inference it drafts from them with the softmax it was
trained with, and its lm_head pass shrinks by the same factor.

Start: fresh weights, or `--from-target-layers`: the draft layers begin as copies of the target's last
layers (they already turn hidden states into the lm_head's input), which lowered the loss faster on
SmolLM2-135M (models/smollm2-135m-instruct-dflash/README.md).

The output directory has z-lab's key names and config keys, so minidcut loads it like a z-lab drafter.

    python tools/train_drafter.py --target models/llama-stdlib-4m --out models/llama-stdlib-4m-dflash
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from safetensors.torch import save_file

# Run as a script: import from the repo root, and never let tools/profile.py shadow the stdlib module.
if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from tools import corpus  # noqa: E402
from minidcut.config import DrafterConfig, default_target_layer_ids, parse_model_config  # noqa: E402
from minidcut.drafter import DFlashDrafter  # noqa: E402
from minidcut.engine import Engine  # noqa: E402
from minidcut.layers import rope_cos_sin  # noqa: E402
from minidcut.loader import load_drafter, load_target  # noqa: E402
from minidcut.model import prefill_layout  # noqa: E402
from minidcut.runtime import write_atomically  # noqa: E402


PACE_STEPS = 10  # steps timed to size a --seconds budget


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", required=True, help="target model directory (HF layout)")
    p.add_argument("--out", required=True, help="output drafter directory")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=2, help="number of draft layers")
    p.add_argument("--taps", default=None,
                   help="comma-separated target layer ids to tap (default: z-lab's formula, docs/method.md)")
    p.add_argument("--intermediate-size", type=int, default=None, help="draft MLP width (default: target's)")
    p.add_argument("--mask-token", default="<|mask|>", help="mask token (a token of the target's tokenizer)")
    p.add_argument("--mask-token-id", type=int, default=None, help="mask token id (overrides --mask-token)")
    p.add_argument("--corpus", default=None, help="text corpus directory (default: the Python stdlib)")
    p.add_argument("--data", default=None, help="train on this tools/distill.py data file instead of "
                   "distilling corpus windows (--sequences, --prompt-len, --seq-len, --corpus are then unused)")
    p.add_argument("--features-cache", default=None,
                   help="keep the target's tapped features in this file (made once, then reused; extended "
                        "when --data has grown since)")
    p.add_argument("--features-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="dtype of the target forward that makes the tapped features (kept in bf16 either way): "
                        "bfloat16 ran 2.1x faster on a CPU with bf16 instructions; its SmolLM2 features differ "
                        "from fp32's by 0.3-0.8%% (bf16 storage alone: 0.2%%)")
    p.add_argument("--bf16", action="store_true",
                   help="train under bfloat16 autocast (fp32 master weights): several times faster on "
                        "CPUs with bf16 instructions, far slower without them (AVX2 only: 120 s a step vs "
                        "4.4 s in fp32)")
    p.add_argument("--sequences", type=int, default=1024, help="self-distilled training sequences")
    p.add_argument("--prompt-len", type=int, default=64, help="corpus tokens before each continuation")
    p.add_argument("--seq-len", type=int, default=256, help="prompt + greedy continuation length")
    p.add_argument("--anchors", type=int, default=16, help="random anchors (blocks) per sequence per step")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--decay", type=float, default=7.0, help="slot-weight decay exp(-(k-1)/decay)")
    p.add_argument("--data-vocab", action="store_true",
                   help="train the softmax over the tokens that occur in the training data only, not the "
                        "whole vocabulary: the lm_head's share of a step falls by V / V' (SmolLM2's chat data: "
                        "49,152 / ~9k); saved as the drafter's draft vocabulary, which it then drafts from")
    p.add_argument("--loss-slots", type=int, default=None,
                   help="train only the first N draft slots (default: all D): the deep ones weigh little "
                        "under the decay but cost as much in the lm_head")
    p.add_argument("--seconds", type=float, default=None,
                   help="train for this long instead of --steps: the cosine schedule follows the clock and "
                        "training stops when it runs out (the warm-up and the progress bar take their steps "
                        "from the pace of the first %d)" % PACE_STEPS)
    p.add_argument("--save-every", type=int, default=None,
                   help="also save the drafter to --out every N steps (a chunk cut short keeps its progress)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--from-target-layers", action="store_true",
                   help="start the draft layers as copies of the target's last --layers layers and the "
                        "final norm as the target's (q/k norms, fc and hidden_norm start fresh)")
    p.add_argument("--init", default=None,
                   help="continue training this drafter directory (its architecture replaces --layers, "
                        "--taps, --block-size, --intermediate-size)")
    return p.parse_args(argv)


def mask_token_id(args, target_dir: Path) -> int:
    if args.mask_token_id is not None:
        return args.mask_token_id
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(target_dir)
    ids = tok.convert_tokens_to_ids([args.mask_token])
    if not ids or ids[0] is None or ids[0] == tok.unk_token_id:
        raise SystemExit(f"error: the target's tokenizer has no token {args.mask_token!r}; pass --mask-token-id")
    return ids[0]


@torch.no_grad()
def distill(target, prompts: torch.Tensor, gen_len: int, console: Console) -> list[torch.Tensor]:
    """The target's greedy continuations of `prompts` [N, P] -> N sequences [P + gen_len]."""
    B = 64
    out = []
    with progress(console) as bar:
        task = bar.add_task("self-distill", total=len(prompts), info="")
        for i in range(0, len(prompts), B):
            chunk = prompts[i:i + B].tolist()
            engine = Engine(target, batch_size=min(B, len(chunk)), max_seq=prompts.shape[1] + gen_len + 8,
                            eos_ids=[], compile=False)
            gens, _ = engine.generate(chunk, gen_len)
            out += [p + g for p, g in zip(chunk, gens)]
            bar.advance(task, len(chunk))
    target.caches = torch.nn.ModuleList()
    return [torch.tensor(x, device=prompts.device) for x in out]


@torch.no_grad()
def target_features(target, seqs: list[torch.Tensor], taps: tuple[int, ...], console: Console | None = None,
                    tokens_per_forward: int = 4096, greedy_data: bool = False):
    """For each sequence [L_i]: tapped hidden states [L_i, n_taps*H] (bf16) and the target's greedy
    next token at every position [L_i]. Sequences of similar length share a forward (one prefill of
    several rows, up to tokens_per_forward tokens).

    greedy_data: the sequences are the target's own greedy text from the first trained position on
    (tools/distill.py), so the label at position t is the token at t + 1 (the last one is never read)
    and the forward stops at the last tapped layer: no later layers, no lm_head (a quarter of the
    work for SmolLM2-135M's 30 layers and 49,152 x 576 head)."""
    feats, labels = [None] * len(seqs), [None] * len(seqs)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    groups, group = [], []
    for i in order:
        if group and (len(group) + 1) * len(seqs[i]) > tokens_per_forward:
            groups.append(group)
            group = []
        group.append(i)
    groups.append(group)
    layers = target.model.layers
    if greedy_data:
        target.model.layers = layers[:max(taps) + 1]  # restored below
    try:
        with progress(console or Console(quiet=True)) as bar:
            task = bar.add_task("target features", total=len(seqs), info="")
            for group in groups:
                lens = [len(seqs[i]) for i in group]
                tokens = torch.cat([seqs[i] for i in group])  # [T]
                layout, _ = prefill_layout(list(range(len(group))), lens, tokens.device)
                no_logits = tokens.new_empty(0) if greedy_data else None
                logits, tapped = target(tokens, layout, logits_idx=no_logits, taps=taps)  # [T|0, V], [T, F]
                ys = ([torch.cat([seqs[i][1:], seqs[i][-1:]]) for i in group] if greedy_data
                      else logits.argmax(-1).split(lens))
                for i, f, y in zip(group, tapped.split(lens), ys):
                    feats[i], labels[i] = f.to(torch.bfloat16), y
                bar.advance(task, len(group))
    finally:
        target.model.layers = layers
    return feats, labels


def fingerprint(seqs: list[torch.Tensor]) -> str:
    """sha256 of the sequences' tokens and lengths: what a features cache was made from."""
    h = hashlib.sha256(torch.tensor([len(q) for q in seqs]).numpy().tobytes())
    for q in seqs:
        h.update(q.cpu().numpy().tobytes())
    return h.hexdigest()


def cached_features(args, target, seqs: list[torch.Tensor], taps: tuple[int, ...], console: Console,
                    sampled: list[bool] | None = None):
    """target_features of the training sequences, through --features-cache when given. A cache made
    from the first n of these sequences (same taps and --features-dtype) is extended by the rest, so a
    data file that grew since (tools/distill.py continues its file) costs only its new sequences.
    sampled: per sequence, whether its answer was sampled rather than greedy (tools/distill.py): its
    labels are the target's own greedy tokens after each position, not the sampled ones (greedy
    verification accepts only those)."""
    cache = Path(args.features_cache) if args.features_cache else None
    key = {"taps": list(taps), "features_dtype": args.features_dtype, "sampled_labels": "argmax"}
    feats, labels = [], []
    if cache is not None and cache.is_file():
        cached = torch.load(cache)
        n = len(cached["feats"])
        if ({k: cached.get(k) for k in key} != key or n > len(seqs)
                or cached.get("fingerprint") != fingerprint(seqs[:n])):
            raise SystemExit(f"error: {cache} holds features of other taps, dtype or data; delete it")
        feats, labels = cached["feats"], cached["labels"]
        console.print(f"{n} sequences' features from {cache}")
    if len(feats) < len(seqs):
        source = (target if args.features_dtype == "float32"
                  else load_target(Path(args.target), torch.bfloat16, args.device))
        new = range(len(feats), len(seqs))
        new_f, new_y = [None] * len(new), [None] * len(new)
        for greedy in (True, False):  # greedy data: labels are the next tokens, no lm_head needed
            part = [j for j, i in enumerate(new) if (bool(args.data) and not (sampled and sampled[i])) == greedy]
            if part:
                f, y = target_features(source, [seqs[new[j]] for j in part], taps, console, greedy_data=greedy)
                for j, fj, yj in zip(part, f, y):
                    new_f[j], new_y[j] = fj, yj
        feats, labels = feats + new_f, labels + new_y
        if cache is not None:
            write_atomically(cache, lambda tmp: torch.save(  # an interrupted save never leaves half a cache
                {**key, "fingerprint": fingerprint(seqs), "feats": feats, "labels": labels}, tmp))
    return feats, labels


def pad_batch(seqs, feats, labels, starts, idx):
    """Sequences idx of ragged lists -> padded tensors: seqs, labels [N, L]; feats [N, L, F];
    starts, lens [N]. Padding is never visible: anchors stay below each sequence's length."""
    lens = torch.tensor([len(seqs[i]) for i in idx])
    L = int(lens.max())

    def pad(xs):
        out = xs[idx[0]].new_zeros(len(idx), L, *xs[idx[0]].shape[1:])
        for j, i in enumerate(idx):
            out[j, : len(xs[i])] = xs[i]
        return out
    return pad(seqs), pad(feats), pad(labels), torch.tensor([starts[i] for i in idx]), lens


def block_forward(drafter: DFlashDrafter, target, feats, seqs, anchors):
    """Training forward of the drafter. feats [N, L, n_taps*H]; seqs [N, L]; anchors [N, A] ->
    hidden [N, A, Bs, H] of every block slot (slot 0 is the anchor)."""
    N, L = seqs.shape
    A, Bs = anchors.shape[1], drafter.block_size
    dev = seqs.device
    ctx = drafter.hidden_norm(drafter.fc(feats.to(drafter.fc.weight.dtype)))  # [N, L, H]
    pos_blk = anchors[..., None] + torch.arange(Bs, device=dev)  # [N, A, Bs]
    tok = torch.full((N, A, Bs), drafter.cfg.mask_token_id, device=dev)
    tok[..., 0] = seqs.gather(1, anchors)
    x = target.model.embed_tokens(tok).view(N, A * Bs, -1)  # [N, A*Bs, H]
    # Visibility [N, A*Bs, L + A*Bs]: context strictly before the block's anchor, and its own block.
    ctx_vis = torch.arange(L, device=dev) < anchors[..., None]  # [N, A, L]
    ctx_vis = ctx_vis[:, :, None, :].expand(N, A, Bs, L).reshape(N, A * Bs, L)
    blk_id = torch.arange(A, device=dev).repeat_interleave(Bs)  # [A*Bs]
    blk_vis = (blk_id[:, None] == blk_id[None, :]).expand(N, -1, -1)
    mask = torch.cat([ctx_vis, blk_vis], dim=2)[:, None]  # [N, 1, A*Bs, L + A*Bs]
    cos_c, sin_c = rope_cos_sin(drafter.inv_freq, torch.arange(L, device=dev), x.dtype)  # [L, Dh]
    cos_b, sin_b = rope_cos_sin(drafter.inv_freq, pos_blk.view(N, A * Bs), x.dtype)  # [N, A*Bs, Dh]
    for layer in drafter.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = attn.project_q(h.flatten(0, 1), cos_b.flatten(0, 1), sin_b.flatten(0, 1))
        kb, vb = attn.project_kv(h.flatten(0, 1), cos_b.flatten(0, 1), sin_b.flatten(0, 1))
        kc, vc = attn.project_kv(ctx.flatten(0, 1), cos_c.repeat(N, 1), sin_c.repeat(N, 1))
        heads = lambda t, n: t.view(N, n, *t.shape[1:]).transpose(1, 2)  # [N, h, n, Dh]
        k = torch.cat([heads(kc, L), heads(kb, A * Bs)], dim=2)
        v = torch.cat([heads(vc, L), heads(vb, A * Bs)], dim=2)
        o = F.scaled_dot_product_attention(heads(q, A * Bs), k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                           enable_gqa=True)
        x = x + attn.o_proj(o.transpose(1, 2).reshape(N, A * Bs, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.norm(x).view(N, A, Bs, -1)


class LinearCrossEntropy(torch.autograd.Function):
    """sum_m w[m] * CE(hidden[m] @ weight.T, y[m]) for a frozen weight [V, H], in row chunks: the
    [M, V] logits never exist at once, and each chunk's gradient (softmax - onehot) is taken while
    its logits are at hand, so backward is one saved [M, H] tensor. Also returns top-1 hits [M]."""

    @staticmethod
    def forward(ctx, hidden, weight, y, w, chunk: int = 512):
        grad = torch.empty_like(hidden)
        total = hidden.new_zeros((), dtype=torch.float32)
        hits = torch.empty(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        wt = weight.to(hidden.dtype)
        # Buffers reused chunk after chunk (fresh [m, V] allocations cost more than the math here).
        low = hidden.new_empty(min(chunk, hidden.shape[0]), wt.shape[0])  # [m, V] in the matmul dtype
        buf = low.float() if low.dtype != torch.float32 else low
        for i in range(0, hidden.shape[0], chunk):
            h, yi, wi = hidden[i:i + chunk], y[i:i + chunk], w[i:i + chunk]
            n = len(yi)
            logits = buf[:n].copy_(torch.mm(h, wt.T, out=low[:n]))  # [m, V] fp32
            top, arg = logits.max(dim=-1)  # [m]
            hits[i:i + chunk] = arg == yi
            z_y = logits.gather(1, yi[:, None])[:, 0] - top  # [m]
            p = logits.sub_(top[:, None]).exp_()  # in place: unnormalised softmax [m, V]
            norm = p.sum(-1)  # [m]
            total += (wi * (norm.log() - z_y)).sum()
            p.mul_((wi / norm)[:, None])  # w * softmax
            p[torch.arange(len(yi), device=p.device), yi] -= wi  # w * (softmax - onehot)
            grad[i:i + chunk] = torch.mm(low[:n].copy_(p), wt).to(hidden.dtype)
        ctx.save_for_backward(grad)
        return total, hits

    @staticmethod
    def backward(ctx, grad_total, _grad_hits):
        (grad,) = ctx.saved_tensors
        return grad * grad_total, None, None, None, None


def drafter_loss(drafter, target, head, seqs, feats, labels, starts, lens, args, gen: torch.Generator):
    """Decay-weighted cross-entropy of slots 1..D against the target's greedy tokens; also returns
    the top-1 agreement of slot 1. head [V', H]: the rows of the target's lm_head the softmax runs over
    (labels index them); seqs, labels [N, L]; feats [N, L, F]; starts, lens [N]: anchors are drawn in
    [starts, lens - 2] (slot 1 always has a label); slots past the sequence's end count 0."""
    N = seqs.shape[0]
    Bs = drafter.block_size
    dev = seqs.device
    span = (lens - 1 - starts).clamp_min(1)  # anchors per sequence to choose from
    anchors = starts[:, None] + (torch.rand(N, args.anchors, generator=gen) * span[:, None]).long()  # [N, A]
    anchors = anchors.to(dev)
    S = getattr(args, "loss_slots", None) or Bs - 1  # slots trained (the block still has Bs)
    hidden = block_forward(drafter, target, feats, seqs, anchors)[:, :, 1:S + 1]  # [N, A, S, H]
    # Slot k predicts the target's greedy token after position anchor + k - 1.
    idx = anchors[..., None] + torch.arange(S, device=dev)  # [N, A, S]
    valid = idx <= (lens.to(dev) - 2)[:, None, None]  # [N, A, D]: a label exists there
    y = labels.gather(1, idx.clamp(max=labels.shape[1] - 1).view(N, -1)).view_as(idx)
    w = torch.exp(-torch.arange(S, dtype=torch.float32, device=dev) / args.decay) * valid  # [N, A, S]
    where = hidden.device.type  # the lm_head matmul in the autocast dtype where autocast is on (cpu or cuda)
    dtype = torch.get_autocast_dtype(where) if torch.is_autocast_enabled(where) else hidden.dtype
    total, hits = LinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]).to(dtype),
                                           head, y.flatten(), w.flatten())
    loss = total / w.sum()
    acc1 = hits.view_as(y)[..., 0].float().mean()
    return loss, acc1


def progress(console):
    return Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                    console=console, transient=False)


def parse_taps(text: str | None, num_layers: int) -> list[int] | None:
    if not text:
        return None
    try:
        taps = [int(t) for t in text.split(",")]
    except ValueError:
        raise SystemExit(f"error: --taps must be comma-separated integers, got {text!r}") from None
    if not taps or any(not 0 <= t < num_layers for t in taps):
        raise SystemExit(f"error: --taps {text!r}: layer ids must be in [0, {num_layers - 1}]")
    return taps


def build_drafter(args, target, mask_id: int) -> DFlashDrafter:
    tcfg = target.cfg
    taps = parse_taps(args.taps, tcfg.num_layers) or default_target_layer_ids(tcfg.num_layers, args.layers)
    inter = args.intermediate_size or tcfg.intermediate_size or 3 * tcfg.hidden_size
    layer_cfg = parse_model_config({
        "model_type": "qwen3", "vocab_size": tcfg.vocab_size, "hidden_size": tcfg.hidden_size,
        "num_hidden_layers": args.layers, "num_attention_heads": tcfg.num_heads,
        "num_key_value_heads": tcfg.num_kv_heads, "head_dim": tcfg.head_dim, "intermediate_size": inter,
        "rms_norm_eps": tcfg.rms_norm_eps, "rope_theta": tcfg.rope_theta,
        "max_position_embeddings": tcfg.max_position_embeddings})
    cfg = DrafterConfig(layer_cfg, args.block_size, mask_id, taps, tcfg.num_layers)
    drafter = DFlashDrafter(cfg)
    for name, p in drafter.named_parameters():
        if "norm" in name:
            torch.nn.init.ones_(p)
        else:
            torch.nn.init.normal_(p, std=0.02)
    if args.from_target_layers:  # the target's last layers already map hidden states towards its lm_head
        if inter != tcfg.intermediate_size or tcfg.is_moe_layer(tcfg.num_layers - 1):
            raise SystemExit("error: --from-target-layers needs dense target layers of the draft's MLP width")
        for layer, src in zip(drafter.layers, target.model.layers[-args.layers:]):
            missing, unexpected = layer.load_state_dict(src.state_dict(), strict=False)
            assert not unexpected and all("_norm" in k for k in missing), (missing, unexpected)
        drafter.norm.load_state_dict(target.model.norm.state_dict())
    return drafter


def save_drafter(drafter: DFlashDrafter, out: Path, log: dict) -> None:
    c, d = drafter.cfg.layers, drafter.cfg
    out.mkdir(parents=True, exist_ok=True)
    state = {k: (v.detach().to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
             for k, v in drafter.state_dict().items()}  # draft_vocab stays token ids
    save_file(state, str(out / "model.safetensors"))
    config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": c.hidden_size,
              "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
              "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
              "intermediate_size": c.intermediate_size, "vocab_size": c.vocab_size,
              "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "hidden_act": "silu",
              "max_position_embeddings": c.max_position_embeddings, "attention_bias": False,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16", "block_size": d.block_size,
              "num_target_layers": d.num_target_layers,
              "dflash_config": {"mask_token_id": d.mask_token_id, "target_layer_ids": d.target_layer_ids}}
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")


def train_log(args, argv, drafter, seqs, starts, steps, t_start, t_train, first, ema) -> dict:
    """The recipe and figures saved with the drafter (model cards quote them)."""
    log = {"command": " ".join(["python", "tools/train_drafter.py", *(argv or sys.argv[1:])]),
           "wall_seconds": round(time.time() - t_start, 1), "train_seconds": round(time.time() - t_train, 1),
           "steps": steps, "sequences": len(seqs), "tokens": sum(map(len, seqs)),
           "trained_positions": sum(len(q) - st for q, st in zip(seqs, starts)),
           "first_loss": first, "final_loss_ema": ema,
           "parameters": sum(p.numel() for p in drafter.parameters()),
           "target": str(args.target), "seed": args.seed}
    if args.init:  # the run this one continues, so the log keeps the whole recipe
        prev = Path(args.init) / "train_log.json"
        log["continues"] = json.loads(prev.read_text()) if prev.is_file() else str(args.init)
    return log


def main(argv=None):
    args = parse_args(argv)
    console = Console()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    t_start = time.time()
    target_dir = Path(args.target)
    target = load_target(target_dir, torch.float32, args.device)
    if args.data:
        data = torch.load(args.data)
        seqs = [torch.tensor(x, device=args.device) for x in data["sequences"]]
        starts = list(data["starts"])
        sampled = list(data.get("sampled", [False] * len(seqs)))
        console.print(f"{len(seqs)} sequences from {args.data} ({sum(map(len, seqs))} tokens)")
    else:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(target_dir)
        windows = corpus.sequences("train", tok, args.prompt_len, args.corpus)  # [S, P]
        pick = torch.randperm(len(windows), generator=gen)[: args.sequences]
        console.print(f"self-distilling {len(pick)} sequences of {args.seq_len} tokens from {target_dir}")
        seqs = distill(target, windows[pick].to(args.device), args.seq_len - args.prompt_len, console)
        starts, sampled = [1] * len(seqs), [False] * len(seqs)
    keep = [i for i, (q, st) in enumerate(zip(seqs, starts)) if len(q) - st >= 2]  # an anchor and a label
    seqs, starts, sampled = [seqs[i] for i in keep], [starts[i] for i in keep], [sampled[i] for i in keep]
    if args.init:
        drafter = load_drafter(args.init, target, torch.float32, args.device).train().requires_grad_(True)
        args.block_size = drafter.block_size
    else:
        drafter = build_drafter(args, target, mask_token_id(args, target_dir)).to(args.device)
    feats, labels = cached_features(args, target, seqs, drafter.taps, console, sampled)
    head = target.lm_head.weight  # [V, H]
    if args.data_vocab:  # the softmax over V' tokens; labels become indices into them
        vocab = torch.unique(torch.cat([*seqs, *labels]))  # [V']
        index = torch.full((head.shape[0],), -1, dtype=torch.long, device=head.device)
        index[vocab] = torch.arange(len(vocab), device=head.device)
        head, labels = head[vocab], [index[y] for y in labels]
        console.print(f"softmax over the {len(vocab)} of {len(index)} tokens that occur in the data")
    drafter.draft_vocab = vocab if args.data_vocab else None  # saved with it: inference drafts from V' too
    t_train = time.time()
    opt = torch.optim.AdamW(drafter.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    warm = max(args.steps // 20, 1)
    ema = first = None
    with progress(console) as bar:
        task = bar.add_task("train drafter", total=args.steps, info="")
        step = 0
        while args.seconds or step < args.steps:  # with --seconds, until the clock runs out
            if args.seconds and step == PACE_STEPS:  # steps 1..PACE_STEPS timed (step 0 pays warm-up)
                pace = (time.time() - t_pace) / (PACE_STEPS - 1)
                args.steps = max(PACE_STEPS + 1, int((args.seconds - (time.time() - t_train)) / pace) + PACE_STEPS)
                warm = max(args.steps // 20, 1)
                bar.update(task, total=args.steps)
                console.log(f"{pace * 1e3:.0f} ms a step: ~{args.steps} steps in --seconds {args.seconds:g}")
            done = (time.time() - t_train) / args.seconds if args.seconds and step >= PACE_STEPS else step / args.steps
            if args.seconds and done >= 1.0:
                args.steps = step  # the clock ran out: this many steps were trained
                break
            lr = args.lr * min(1.0, (step + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(done, 1.0)))
            for g in opt.param_groups:
                g["lr"] = lr
            idx = torch.randint(0, len(seqs), (args.batch_size,), generator=gen).tolist()
            batch = pad_batch(seqs, feats, labels, starts, idx)
            with torch.autocast(torch.device(args.device).type, torch.bfloat16, enabled=args.bf16):
                loss, acc1 = drafter_loss(drafter, target, head, *batch, args, gen)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
            opt.step()
            first = loss.item() if first is None else first
            t_pace = time.time() if step == 0 else t_pace
            ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
            bar.update(task, advance=1, info=f"loss {ema:.3f} acc@1 {acc1.item():.2f}")
            if not console.is_terminal and (step + 1) % 50 == 0:  # a log line when not on a terminal
                console.log(f"step {step + 1}/{args.steps} loss {ema:.3f} acc@1 {acc1.item():.2f}")
            if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
                save_drafter(drafter, Path(args.out),
                             train_log(args, argv, drafter, seqs, starts, step + 1, t_start, t_train, first, ema))
            step += 1
    log = train_log(args, argv, drafter, seqs, starts, args.steps, t_start, t_train, first, ema)
    save_drafter(drafter, Path(args.out), log)
    console.print(f"saved {args.out} ({log['parameters'] / 1e6:.2f}M parameters, {log['wall_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
