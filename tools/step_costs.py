"""Where a drafting step's time goes: the drafter's layers, its lm_head over the D block positions, the
softmax and the selector, and verification at every budget, next to an AR step; eager, per batch size,
medians of interleaved repeats. What tools/profile.py measures as one number per (B, rho), split up.

    python tools/step_costs.py --target models/smollm2-135m-instruct --drafter models/smollm2-135m-instruct-dflash \
        --batch-sizes 1,4,16 --drafter-dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

# Run as a script: import from the repo root, and never let tools/profile.py shadow the stdlib module.
if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from minidcut import cli, dcut, runtime  # noqa: E402
from minidcut.api import load_pair  # noqa: E402
from minidcut.batch import Request  # noqa: E402
from minidcut.engine import Engine  # noqa: E402
from minidcut.layers import linear  # noqa: E402
from minidcut.policy import DEFAULT_GRID, Policy  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--batch-sizes", default="1,4,16")
    p.add_argument("--context-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--dtype", default=None)
    p.add_argument("--drafter-dtype", default=None)
    p.add_argument("--threads", type=int, default=None)
    return p.parse_args(argv)


@torch.inference_mode()
def parts(engine: Engine, B: int, context_len: int) -> dict:
    """name -> a callable running that part of a step at batch size B (all rows at context_len)."""
    target, drafter = engine.target, engine.drafter
    prompts = torch.randint(0, target.cfg.vocab_size, (B, context_len), generator=torch.Generator().manual_seed(0))
    anchor = engine.runner.prefill(list(range(B)), [Request(i, p, 1) for i, p in enumerate(prompts.tolist())])
    pos = torch.full((B,), context_len)
    ids = torch.arange(B)
    D = engine.D
    h = torch.randn(B * D, target.cfg.hidden_size, dtype=drafter.fc.weight.dtype)
    logits = drafter(target, anchor, pos)
    conf = torch.softmax(logits.float(), -1).max(-1).values
    Ks = engine.runner.budgets(B)
    plan = engine.policy.plan(B)
    last = pos + D + 1  # every row may draft a whole block
    draft = engine.runner.draft(anchor, pos, last, [True] * B, plan)
    out = {"AR step (verify K=0)": lambda: engine.runner.graph("verify", B, 0, write=False)(anchor, pos, ids, None, None),
           "drafter forward": lambda: drafter(target, anchor, pos),
           "  of it: lm_head on B*D rows": lambda: linear(h, drafter.head),
           "softmax + max over V (or V')": lambda: torch.softmax(logits.float(), -1).max(-1),
           "selector (scores, keep_len, gains)": lambda: dcut.select(conf, torch.full((B,), D), Ks),
           "draft graph (all of the above + rho*)": lambda: engine.runner.draft(anchor, pos, last, [True] * B, plan)}
    for ri, (rho, K) in enumerate(zip(engine.policy.rhos, Ks)):
        if K:
            out[f"verify rho={rho:g} (T={B + K})"] = (lambda ri=ri, K=K: engine.runner.graph("verify", B, K)(
                anchor, pos, ids, draft.drafts, draft.keep_lens[ri]))
    return out


def run(args, console: Console) -> int:
    batch_sizes = cli.parse_batch_sizes(args.batch_sizes)
    runtime.setup(args.threads)
    target, drafter, device, dtype = load_pair(args.target, args.drafter, args.dtype, None, args.drafter_dtype)
    table = Table(title=f"step parts, ms (median of {args.repeats}; {dtype} target, {drafter.fc.weight.dtype} "
                        f"drafter, {torch.get_num_threads()} threads, eager, context {args.context_len})")
    table.add_column("part")
    for B in batch_sizes:
        table.add_column(f"B={B}", justify="right")
    results = {}
    for B in batch_sizes:
        engine = Engine(target, drafter, Policy("static", DEFAULT_GRID, label="parts"), batch_size=B,
                        max_seq=args.context_len + drafter.block_size + 8, compile=False)
        fns = parts(engine, B, args.context_len)
        times = {k: [] for k in fns}
        for _ in range(args.repeats + 1):  # interleaved; the first round warms up
            for k, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
        results[B] = {k: statistics.median(v[1:]) * 1e3 for k, v in times.items()}
    names = list(dict.fromkeys(k.split(" (T=")[0] for B in batch_sizes for k in results[B]))
    for name in names:
        cells = []
        for B in batch_sizes:
            hit = next((v for k, v in results[B].items() if k.split(" (T=")[0] == name), None)
            cells.append(f"{hit:.1f}" if hit is not None else "-")
        table.add_row(name, *cells)
    console.print(table)
    return 0


def main(argv=None) -> int:
    return cli.run_reporting_errors(run, parse_args(argv), Console())


if __name__ == "__main__":
    sys.exit(main())
