"""AR decoding throughput against the machine's limit and against transformers' own `generate`: same
weights, prompts, batch sizes, dtype and thread count.

At batch size 1 a decode step reads every weight once (and the KV cache), so its floor is
bytes read per step / memory bandwidth. The bandwidth is measured here two ways over a buffer much
larger than the caches, at the run's thread count: a sum (bytes read / seconds) and a STREAM-style
copy ((read + written bytes) / seconds); the limit takes the larger of the two (the stricter one).

    python tools/bench_ar.py --target models/smollm2-135m-instruct --batch-sizes 1,4 --threads 1
    python tools/bench_ar.py --batch-sizes 1,8,32   # a random ~20M-parameter Llama
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Run as a script: import from the repo root, and never let tools/profile.py shadow the stdlib module.
if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402
import transformers  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from minidcut import cli, runtime  # noqa: E402
from minidcut.engine import Engine  # noqa: E402
from minidcut.layers import PackedLinear  # noqa: E402
from minidcut.loader import load_target  # noqa: E402

CONFIG = dict(vocab_size=8192, hidden_size=512, num_hidden_layers=6, num_attention_heads=8,
              num_key_value_heads=4, intermediate_size=1536, max_position_embeddings=1024,
              tie_word_embeddings=True, eos_token_id=None, bos_token_id=None, pad_token_id=0)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None, help="model directory (default: a random Llama made here)")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per engine (the median is kept)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--compile", action="store_true", help="compile minidcut's decode graph")
    p.add_argument("--output", default=None, help="JSON results")
    return p.parse_args(argv)


def bandwidths(mbytes: int = 1024, repeats: int = 5) -> tuple[float, float]:
    """(read, copy) bytes per second over an fp32 buffer of `mbytes`, best of `repeats` each: a sum
    (bytes read) and a copy (bytes read + written)."""
    src = torch.ones(mbytes * 2 ** 20 // 4)
    dst = torch.empty_like(src)
    nbytes = src.numel() * 4
    src.sum(), dst.copy_(src)  # first touch of the pages, untimed
    return nbytes / timed(src.sum, repeats, min), 2 * nbytes / timed(lambda: dst.copy_(src), repeats, min)


def bytes_per_step(target, max_seq: int, batch: int) -> int:
    """Bytes an AR step reads: every weight matrix once (an embedding tied to the lm_head counts once:
    the head reads it whole, the lookup one row per token), norms, and each layer's static K/V cache
    rows over all max_seq positions (what a compiled step reads; an eager one reads its span,
    runner.Runner.span, fewer early in a run: for it an upper bound). Packed weights (layers.PackedLinear)
    count as what they hold."""
    weights = {}
    for m in target.modules():
        for t in [*m.parameters(recurse=False), *([m.weight] if isinstance(m, PackedLinear) else [])]:
            weights[id(t)] = t.numel() * t.element_size()
    if isinstance(target.lm_head, PackedLinear):  # the head reads its packed copy; the lookup one row
        weights.pop(id(target.model.embed_tokens.weight))
    c = target.cfg
    kv = 2 * c.num_layers * batch * c.num_kv_heads * max_seq * c.head_dim * target.model.norm.weight.element_size()
    return sum(weights.values()) + kv


def timed(fn, repeats: int, reduce=statistics.median) -> float:
    """Seconds of fn(): `reduce` (median by default) over `repeats` runs."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return reduce(times)


@torch.inference_mode()
def run(args, console: Console) -> int:
    batch_sizes = cli.parse_batch_sizes(args.batch_sizes)
    cli.check_positive(args, "prompt_len", "max_new_tokens", "repeats", "threads")
    runtime.setup(args.threads)
    if args.target:
        path = Path(args.target)
    else:
        torch.manual_seed(0)
        path = Path(tempfile.mkdtemp())
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).save_pretrained(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    target = load_target(path)
    if not args.compile:  # what api.load_pair does for an eager CPU run
        target.pack()
    n_params = sum(p.numel() for p in hf.parameters())
    read, copy = bandwidths()
    bandwidth = max(read, copy)
    console.log(f"read bandwidth {read / 1e9:.1f} GB/s, copy {copy / 1e9:.1f} GB/s "
                f"({torch.get_num_threads()} threads)")
    rows = []
    for B in batch_sizes:
        g = torch.Generator().manual_seed(B)
        ids = torch.randint(1, target.cfg.vocab_size, (B, args.prompt_len), generator=g)
        n_new, max_seq = args.max_new_tokens, args.prompt_len + args.max_new_tokens + 2
        engine = Engine(target, batch_size=B, max_seq=max_seq, eos_ids=[], compile=args.compile)
        engine.generate(ids.tolist(), n_new)  # warm-up (compiles the decode graph with --compile)
        ours_s = timed(lambda: engine.generate(ids.tolist(), n_new), args.repeats)
        ours, _ = engine.generate(ids.tolist(), n_new)
        mask = torch.ones_like(ids)
        hf.generate(ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
        hf_s = timed(lambda: hf.generate(ids, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new,
                                         do_sample=False, pad_token_id=0), args.repeats)
        ref = hf.generate(ids, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                          pad_token_id=0)
        step_bytes = bytes_per_step(target, max_seq, B)
        limit = bandwidth / step_bytes * B  # tokens/s if a step only had to read its bytes
        rows.append({"batch_size": B, "minidcut_tok_s": B * n_new / ours_s, "transformers_tok_s": B * n_new / hf_s,
                     "bytes_per_step": step_bytes, "bandwidth_limit_tok_s": limit,
                     "identical_tokens": ref[:, args.prompt_len:].tolist() == ours})
        console.log(rows[-1])
    table = Table(title=f"AR decode, {path.name} ({n_params / 1e6:.1f}M params), fp32, {torch.get_num_threads()} "
                        f"threads, {'compiled' if args.compile else 'eager'}, prompt {args.prompt_len}, "
                        f"{args.max_new_tokens} new tokens; bandwidth read {read / 1e9:.1f} / copy "
                        f"{copy / 1e9:.1f} GB/s")
    for c in ("B", "minidcut tok/s", "transformers tok/s", "ratio", "MB read/step", "limit tok/s",
              "of limit", "same tokens"):
        table.add_column(c, justify="right")
    for r in rows:
        table.add_row(str(r["batch_size"]), f"{r['minidcut_tok_s']:.1f}", f"{r['transformers_tok_s']:.1f}",
                      f"{r['minidcut_tok_s'] / r['transformers_tok_s']:.2f}x", f"{r['bytes_per_step'] / 1e6:.0f}",
                      f"{r['bandwidth_limit_tok_s']:.1f}", f"{r['minidcut_tok_s'] / r['bandwidth_limit_tok_s']:.0%}",
                      str(r["identical_tokens"]))
    console.print(table)
    if args.output:
        Path(args.output).write_text(json.dumps({"target": str(path), "params": n_params, "threads":
                                                 torch.get_num_threads(), "compiled": args.compile,
                                                 "read_bandwidth_bytes_per_s": read,
                                                 "copy_bandwidth_bytes_per_s": copy, "rows": rows},
                                                indent=1) + "\n")
    return 0


def main(argv=None) -> int:
    return cli.run_reporting_errors(run, parse_args(argv), Console())


if __name__ == "__main__":
    sys.exit(main())
