"""Generate with the Python API: load the shipped demo pair, build the adaptive dcut policy, generate.

    python examples/quickstart.py [--target DIR --drafter DIR] [--compile]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import minidcut  # noqa: E402

MODELS = Path(__file__).resolve().parent.parent / "models"

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--target", default=str(MODELS / "llama-stdlib-4m"))
p.add_argument("--drafter", default=str(MODELS / "llama-stdlib-4m-dflash"))
p.add_argument("--max-new-tokens", type=int, default=48)
p.add_argument("--compile", action="store_true", help="torch.compile (default: only on CUDA)")
args = p.parse_args()

minidcut.setup()  # threads, compile cache, compile limits: once per process
target, drafter, device, dtype = minidcut.load_pair(args.target, args.drafter)
compile = args.compile or minidcut.default_compile(device)
tok = minidcut.load_tokenizer(args.target)
texts = ["def is_prime(n):\n", "class Stack:\n    def push(self, item):\n"]
prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
max_seq = max(map(len, prompts)) + args.max_new_tokens + drafter.block_size + 1
print(f"loaded {args.target} + {args.drafter} ({dtype}, {device}, {'compiled' if compile else 'eager'})")
# The dcut policy's cost table: rows it lacks are measured when the run first reaches their batch bucket.
table, table_file = minidcut.load_table(target, drafter, args.target, args.drafter, compile, max_seq, log=print)
policy = minidcut.build_policy("dcut", table=table, log=print)
engine = minidcut.Engine(target, drafter, policy, batch_size=2, max_seq=max_seq, compile=compile,
                         on_compile=print)
print(f"generating {args.max_new_tokens} tokens for {len(prompts)} prompts ...", flush=True)
outputs, stats = engine.generate(prompts, args.max_new_tokens)
minidcut.save_table(policy, table_file)  # measured rows and what the policy learned, for the next run
for text, out in zip(texts, outputs):
    print("-" * 60)
    print(text + tok.decode(out))
print("-" * 60)
print(f"tau {stats.tau:.2f}  keep ratio {stats.keep_ratio:.2f}  rho histogram {dict(stats.rho_hist)}")
