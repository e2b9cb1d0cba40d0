"""Train a small target model from scratch on the corpus (tools/corpus.py), plain PyTorch on CPU.

The model is transformers' own LlamaForCausalLM (--arch llama) or Qwen3MoeForCausalLM (--arch qwen3_moe)
built from a config, so the output is a standard Hugging Face model directory: config.json,
model.safetensors (bfloat16), generation_config.json (eos 0), tokenizer files, and train_log.json (the
command line, wall time, parameter counts, held-out loss, loss curve). Training is fp32: AdamW, linear
warmup then cosine decay to 10% of --lr, gradient clipping at 1.0, batches of random windows of the
train split's token stream. OUT/checkpoint.pt (model, optimizer, step, RNG) is written every
--ckpt-every steps so that a killed run continues with --resume; it is deleted at the end.

    python -m tools.train_target --arch llama --out models/llama-stdlib-4m --steps 700
"""

import argparse
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

# Run as a script: import from the repo root, and never let tools/profile.py shadow the stdlib module.
if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch
import torch.nn.functional as F
import transformers
from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)
from transformers import (AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)

from minidcut.runtime import write_atomically
from tools.corpus import list_files, sequences, token_stream
from tools.train_tokenizer import train_tokenizer


def parse_args(argv=None):
    # Options alike in shape to train_drafter.py's (duplicates pairs them): two programs, kept apart.
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", choices=["llama", "qwen3_moe"], required=True)
    p.add_argument("--out", required=True, help="output model directory")
    p.add_argument("--corpus", help="directory of *.py/*.txt files (default: the stdlib)")
    p.add_argument("--tokenizer", help="load this tokenizer directory instead of training one")
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary of a newly trained tokenizer")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=50, help="linear warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--intermediate", type=int, default=768, help="dense MLP width")
    p.add_argument("--experts", type=int, default=8, help="qwen3_moe: experts per layer")
    p.add_argument("--top-k", type=int, default=2, help="qwen3_moe: experts per token")
    p.add_argument("--moe-intermediate", type=int, default=256, help="qwen3_moe: width of one expert")
    p.add_argument("--max-pos", type=int, default=1024, help="max_position_embeddings")
    p.add_argument("--eval-seqs", type=int, default=128, help="held-out sequences for the final loss")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--ckpt-every", type=int, default=100)
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    return p.parse_args(argv)


def build_model(args, vocab_size: int):
    """A freshly initialised transformers model of the requested architecture and size (fp32)."""
    common = dict(
        vocab_size=vocab_size, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
        intermediate_size=args.intermediate, max_position_embeddings=args.max_pos, rope_theta=10000.0,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=0, pad_token_id=None,
    )
    if args.arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**common))
    config = Qwen3MoeConfig(
        **common, num_experts=args.experts, num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.moe_intermediate, norm_topk_prob=True,
    )
    return Qwen3MoeForCausalLM(config)


def param_counts(model) -> dict:
    """Total, non-embedding (the tied embedding counted once, then excluded) and active per token."""
    total = sum(p.numel() for p in model.parameters())
    non_embedding = total - model.get_input_embeddings().weight.numel()
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    cfg = model.config
    idle = experts * (1 - cfg.num_experts_per_tok / cfg.num_local_experts) if experts else 0
    return {"params_total": total, "params_non_embedding": non_embedding,
            "params_active_non_embedding": int(non_embedding - idle)}


def lr_at(step: int, args) -> float:
    """Linear warmup to --lr, then cosine decay to 10% of it at the last step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def lm_loss(model, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(next-token cross-entropy, loss to optimise incl. the MoE load-balancing term) on x: [B, T]."""
    moe = isinstance(model, Qwen3MoeForCausalLM)
    out = model(input_ids=x, use_cache=False, **({"output_router_logits": True} if moe else {}))
    ce = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())  # logits [B, T, V]
    return ce, (ce + model.config.router_aux_loss_coef * out.aux_loss if moe else ce)


@torch.no_grad()
def heldout_loss(model, seqs: torch.Tensor, batch_size: int) -> float:
    """Mean next-token cross-entropy (nats/token) over seqs: [S, T]."""
    model.eval()
    losses = [lm_loss(model, seqs[i : i + batch_size])[0] for i in range(0, len(seqs), batch_size)]
    model.train()
    sizes = torch.tensor([len(seqs[i : i + batch_size]) for i in range(0, len(seqs), batch_size)])
    return float((torch.stack(losses) * sizes).sum() / sizes.sum())


def save_model_dir(model, tokenizer, out: Path, log: dict):
    """The standard HF directory: bf16 safetensors, config, generation config, tokenizer, train log."""
    model.generation_config = GenerationConfig(eos_token_id=0, pad_token_id=0)
    model.to(torch.bfloat16).save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    # transformers 4.x names of the same fields, so older readers load the directory too
    config |= {"torch_dtype": "bfloat16", "rope_theta": config["rope_parameters"]["rope_theta"]}
    if "num_local_experts" in config:
        config["num_experts"] = config["num_local_experts"]
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tokenizer.save_pretrained(out)
    (out / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")


def load_data(args):
    """(tokenizer, train token stream [N], evenly spaced held-out rows [S, T])."""
    if args.tokenizer:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        tokenizer = train_tokenizer(args.corpus, args.vocab)
    stream = token_stream("train", tokenizer, args.corpus)  # [N]
    rows = sequences("heldout", tokenizer, args.seq_len, args.corpus)  # [S_all, T]
    pick = torch.linspace(0, len(rows) - 1, min(args.eval_seqs, len(rows))).long()
    return tokenizer, stream, rows[pick]


def make_optimizer(model, args) -> torch.optim.AdamW:
    """AdamW, weight decay on matrices only (not on norms)."""
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))


def progress_bar(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("loss {task.fields[loss]:.3f}  {task.fields[tok_s]:.0f} tok/s"),
                    TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=console)


def main(argv=None):
    process_start = time.time()
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ["RAYON_RS_NUM_CPUS"] = str(args.threads)  # the tokenizers library's thread pool
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_path = out / "checkpoint.pt"
    console = Console(log_path=False)

    tokenizer, stream, eval_seqs = load_data(args)
    torch.manual_seed(args.seed)
    model = build_model(args, len(tokenizer))
    opt = make_optimizer(model, args)
    gen = torch.Generator().manual_seed(args.seed)  # draws the batches
    # run state carried by the checkpoint; times add up over resumed runs
    run = {"step": 0, "wall_s": 0.0, "train_s": 0.0, "curve": {}}
    if args.resume and ckpt_path.exists():
        ckpt = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        gen.set_state(ckpt["generator"])
        run = ckpt["run"]
    wall_before, train_before, first_step = run["wall_s"], run["train_s"], run["step"]

    tokens_per_step = args.batch_size * args.seq_len
    console.log(f"{len(stream):,} train tokens, {len(eval_seqs)} held-out rows, {param_counts(model)}, "
                f"from step {first_step}")
    losses, loop_start = [], time.time()
    with progress_bar(console) as progress:
        task = progress.add_task(args.arch, total=args.steps, completed=first_step, loss=float("nan"), tok_s=0)
        for step in range(first_step, args.steps):
            starts = torch.randint(0, len(stream) - args.seq_len, (args.batch_size,), generator=gen)  # [B]
            x = stream[starts[:, None] + torch.arange(args.seq_len)]  # [B, T]
            for group in opt.param_groups:
                group["lr"] = lr_at(step, args)
            ce, loss = lm_loss(model, x)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

            done = step + 1
            losses.append(ce.item())
            tok_s = (done - first_step) * tokens_per_step / (time.time() - loop_start)
            progress.update(task, completed=done, loss=losses[-1], tok_s=tok_s)
            if done % args.log_every == 0 or done in (1, args.steps):
                run["curve"][str(done)] = round(sum(losses) / len(losses), 4)  # mean since the last entry
                losses = []
                console.log(f"step {done}  loss {run['curve'][str(done)]:.4f}  lr {lr_at(step, args):.2e}  "
                            f"{tok_s:.0f} tok/s")
            run |= {"step": done, "wall_s": wall_before + time.time() - process_start,
                    "train_s": train_before + time.time() - loop_start}
            if done % args.ckpt_every == 0 and done < args.steps:
                state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "generator": gen.get_state(),
                         "run": run}
                write_atomically(ckpt_path, lambda tmp: torch.save(state, tmp))  # a kill never leaves half of one

    loss = heldout_loss(model, eval_seqs, args.batch_size)
    files = {split: len(list_files(split, args.corpus)) for split in ("train", "heldout")}
    log = {
        "command": "python -m tools.train_target " + shlex.join(sys.argv[1:] if argv is None else argv),
        "wall_time_s": round(wall_before + time.time() - process_start, 1),
        **param_counts(model),
        "heldout_loss": round(loss, 4),
        "heldout_tokens": eval_seqs.numel(),
        "train_tokens_seen": args.steps * tokens_per_step,
        "train_tokens_per_s": round((args.steps * tokens_per_step) / run["train_s"], 1),
        "corpus": args.corpus or f"Python {sys.version.split()[0]} stdlib",
        "corpus_files": files,
        "threads": args.threads,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "loss_curve": run["curve"],
    }
    save_model_dir(model, tokenizer, out, log)
    ckpt_path.unlink(missing_ok=True)
    console.print(f"held-out loss {loss:.4f} nats/token; wrote {out}")


if __name__ == "__main__":
    main()
