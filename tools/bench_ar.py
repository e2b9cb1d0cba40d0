"""AR decoding throughput: minidcut's compiled decode step vs transformers' own `generate`, on the same
random ~20M-parameter Llama, prompts, batch sizes and thread count.

    python tools/bench_ar.py --batch-sizes 1,8,32 --threads 1
"""

from __future__ import annotations

import argparse
import json
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

from minidcut.engine import Engine  # noqa: E402
from minidcut.loader import load_target  # noqa: E402

CONFIG = dict(vocab_size=8192, hidden_size=512, num_hidden_layers=6, num_attention_heads=8,
              num_key_value_heads=4, intermediate_size=1536, max_position_embeddings=1024,
              tie_word_embeddings=True, eos_token_id=None, bos_token_id=None, pad_token_id=0)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--output", default=None, help="JSON results")
    return p.parse_args(argv)


@torch.inference_mode()
def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console()
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
    n_params = sum(p.numel() for p in hf.parameters())
    tmp = Path(tempfile.mkdtemp())
    hf.save_pretrained(tmp)
    target = load_target(tmp)
    rows = []
    for B in [int(b) for b in args.batch_sizes.split(",")]:
        ids = torch.randint(1, CONFIG["vocab_size"], (B, args.prompt_len))
        n_new = args.max_new_tokens
        engine = Engine(target, batch_size=B, max_seq=args.prompt_len + n_new + 2, eos_ids=[], compile=True)
        t0 = time.perf_counter()
        engine.generate(ids.tolist(), n_new)  # warm-up: compiles this batch size's decode graph
        compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        ours, stats = engine.generate(ids.tolist(), n_new)
        ours_s = time.perf_counter() - t0
        hf.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)  # warm-up
        t0 = time.perf_counter()
        ref = hf.generate(ids, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False)
        hf_s = time.perf_counter() - t0
        same = ref[:, args.prompt_len:].tolist() == ours
        rows.append({"batch_size": B, "minidcut_tok_s": B * n_new / ours_s, "transformers_tok_s": B * n_new / hf_s,
                     "compile_seconds": compile_s, "identical_tokens": same})
        console.log(rows[-1])
    table = Table(title=f"AR decode, random Llama {n_params / 1e6:.1f}M params, fp32, "
                        f"{torch.get_num_threads()} threads, prompt {args.prompt_len}, {args.max_new_tokens} new tokens")
    for c in ("B", "minidcut tok/s", "transformers tok/s", "ratio", "same tokens", "compile s"):
        table.add_column(c, justify="right")
    for r in rows:
        table.add_row(str(r["batch_size"]), f"{r['minidcut_tok_s']:.0f}", f"{r['transformers_tok_s']:.0f}",
                      f"{r['minidcut_tok_s'] / r['transformers_tok_s']:.2f}x", str(r["identical_tokens"]),
                      f"{r['compile_seconds']:.0f}")
    console.print(table)
    if args.output:
        Path(args.output).write_text(json.dumps({"params": n_params, "threads": torch.get_num_threads(),
                                                 "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
