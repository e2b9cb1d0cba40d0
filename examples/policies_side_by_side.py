"""A small benchmark: ar, full and dcut side by side at two batch sizes on held-out prompts, two
interleaved passes each (python -m minidcut.bench is the full version; under a minute on a 2-core CPU).

    python examples/policies_side_by_side.py [--target DIR --drafter DIR] [--batch-sizes 1,8] [--compile]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from minidcut import bench  # noqa: E402

MODELS = Path(__file__).resolve().parent.parent / "models"

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--target", default=str(MODELS / "llama-stdlib-4m"))
p.add_argument("--drafter", default=str(MODELS / "llama-stdlib-4m-dflash"))
p.add_argument("--prompts", default=str(MODELS / "prompts_heldout.jsonl"))
p.add_argument("--batch-sizes", default="1,8")
p.add_argument("--max-new-tokens", default="24")
p.add_argument("--compile", action="store_true", help="torch.compile (default: only on CUDA)")
args = p.parse_args()

print(f"ar, full and dcut at B = {args.batch_sizes}: {args.max_new_tokens} new tokens per prompt, 2 passes each; "
      "dcut's cost table is measured first where it is missing", flush=True)
argv = ["--target", args.target, "--drafter", args.drafter, "--prompts", args.prompts,
        "--batch-sizes", args.batch_sizes, "--policies", "ar,full,dcut", "--repeats", "2",
        "--max-new-tokens", args.max_new_tokens] + (["--compile"] if args.compile else [])
sys.exit(bench.main(argv))
