"""A small benchmark: ar, full and dcut side by side at two batch sizes on held-out prompts
(python -m minidcut.bench is the full version).

    python examples/policies_side_by_side.py [--target DIR --drafter DIR] [--batch-sizes 2,8] [--no-compile]
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
p.add_argument("--batch-sizes", default="2,8")
p.add_argument("--max-new-tokens", default="32")
p.add_argument("--no-compile", action="store_true")
args = p.parse_args()

argv = ["--target", args.target, "--drafter", args.drafter, "--prompts", args.prompts,
        "--batch-sizes", args.batch_sizes, "--policies", "ar,full,dcut", "--repeats", "1",
        "--max-new-tokens", args.max_new_tokens] + (["--no-compile"] if args.no_compile else [])
sys.exit(bench.main(argv))
