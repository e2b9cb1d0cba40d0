"""Measure `python -m minidcut.generate` as users run it: one process per run, from a cold start.

For each batch size B: the first n prompts of a prompt file (n = 2B, at least 8), and --sequences
sequences, each with a cost-table file of its own that starts empty (as in a fresh checkout). A sequence
is ar, dcut, dcut, ar, ar, dcut, ... (--runs pairs, the order alternating so a machine that drifts
during the sequence favours neither), each a new process. dcut's first run measures the cost rows it
reaches and learns from nothing; the later ones start from what the earlier ones saved. Ratios are
paired: each dcut run over the AR run of its pair. Reported per B: AR tok/s (median of its runs), the
median paired ratio of the first runs (one per sequence) and of the later runs, their ranges, and
wall times (process start to exit; the first run's includes the seconds it spent measuring its cost
rows). Writes JSON.

    python tools/oneshot.py --batch-sizes 1,4,16,32,64 --output docs/bench/oneshot_demo.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __name__ == "__main__":  # run as a script: import from the repo root
    sys.path[0] = str(ROOT)

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from minidcut import cli  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_pair_args(p, "generate")
    p.add_argument("--batch-sizes", default="1,4,16,32,64", help="comma-separated (default: %(default)s)")
    p.add_argument("--num-prompts", type=int, default=None, help="prompts per run (default: max(2B, 8))")
    p.add_argument("--max-new-tokens", type=int, default=64, help="per request (default: %(default)s)")
    p.add_argument("--runs", type=int, default=3, help="runs of each policy per sequence (default: %(default)s)")
    p.add_argument("--sequences", type=int, default=2,
                   help="sequences per batch size, each from an empty cost table (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="passed to generate (default: generate's own)")
    p.add_argument("--output", default=None, help="JSON with every run")
    return p.parse_args(argv)


def one_run(args, policy: str, prompts: Path, table: Path, B: int, work: Path) -> dict:
    stats = work / f"stats_{policy}.json"
    cmd = [sys.executable, "-m", "minidcut.generate", "--target", args.target, "--drafter", args.drafter,
           "--policy", policy, "--prompts", str(prompts), "--batch-size", str(B), "--max-new-tokens",
           str(args.max_new_tokens), "--cost-table", str(table), "--stats", str(stats), "--quiet"]
    cmd += ([] if args.chat is None else ["--chat"] + [args.chat] * bool(args.chat)) + (["--threads", str(args.threads)] if args.threads else [])
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise cli.UserError(f"{policy} at B = {B} failed: {done.stderr.strip().splitlines()[-1:]}")
    s = json.loads(stats.read_text())
    return {"policy": policy, "wall_seconds": wall, "tokens_per_second": s["tokens_per_second"], "tau": s["tau"],
            "profile_seconds": s["profile_seconds"], "rho_histogram": s["rho_histogram"], "steps": s["steps"],
            "drafting_histogram": s["drafting_histogram"]}


def run(args, console: Console) -> int:
    batch_sizes = cli.parse_batch_sizes(args.batch_sizes)
    cli.check_positive(args, "runs", "sequences", "max_new_tokens", "num_prompts")
    cli.check_writable(args.output, "--output")
    lines = [x for x in Path(args.prompts).read_text().splitlines() if x.strip()]
    out = {"target": args.target, "drafter": args.drafter, "prompts": args.prompts, "chat": args.chat,
           "max_new_tokens": args.max_new_tokens, "per_batch": {}}
    t = Table(title="python -m minidcut.generate, one process per run (dcut / AR tok/s; wall s)")
    for c in ("B", "AR tok/s", "dcut 1st / AR", "dcut later / AR", "AR wall s", "1st wall / AR", "of it measuring s"):
        t.add_column(c, justify="right")
    span = lambda xs: f"{statistics.median(xs):.2f}x ({min(xs):.2f}-{max(xs):.2f})" if xs else "-"  # noqa: E731
    for B in batch_sizes:
        n = args.num_prompts or max(2 * B, 8)
        sequences = []
        for seq in range(args.sequences):
            with tempfile.TemporaryDirectory() as tmp:
                work = Path(tmp)
                prompts = work / "prompts.jsonl"
                prompts.write_text("\n".join((lines * (n // len(lines) + 1))[:n]) + "\n")
                runs = []
                for i in range(args.runs):  # ar, dcut, then dcut, ar, ...: a steady drift hits both alike
                    for policy in ("ar", "dcut") if (i + seq) % 2 == 0 else ("dcut", "ar"):
                        runs.append(one_run(args, policy, prompts, work / "table.json", B, work))
                        console.log(f"B={B} sequence {seq + 1} {policy} run {i + 1}: "
                                    f"{runs[-1]['tokens_per_second']:.1f} tok/s, {runs[-1]['wall_seconds']:.1f} s")
            sequences.append(runs)
        pairs = [list(zip([r for r in runs if r["policy"] == "ar"], [r for r in runs if r["policy"] == "dcut"]))
                 for runs in sequences]  # [sequence][i] = (ar run, dcut run)
        ratio = lambda a, d: d["tokens_per_second"] / a["tokens_per_second"]  # noqa: E731
        first = [ratio(*p[0]) for p in pairs]
        later = [ratio(*x) for p in pairs for x in p[1:]]
        first_wall = [p[0][1]["wall_seconds"] / p[0][0]["wall_seconds"] for p in pairs]
        ar = [a for p in pairs for a, _ in p]
        ar_tps = statistics.median(r["tokens_per_second"] for r in ar)
        ar_wall = statistics.median(r["wall_seconds"] for r in ar)
        measuring = [p[0][1]["profile_seconds"] for p in pairs]
        out["per_batch"][str(B)] = {
            "prompts": n, "ar_tokens_per_second": ar_tps, "ar_wall_seconds": ar_wall,
            "dcut_first_vs_ar": statistics.median(first), "first_range": [min(first), max(first)],
            "dcut_later_vs_ar": statistics.median(later) if later else None,
            "later_range": [min(later), max(later)] if later else None,
            "dcut_first_wall_vs_ar": statistics.median(first_wall), "first_wall_range": [min(first_wall), max(first_wall)],
            "first_measuring_seconds": measuring, "sequences": sequences}
        t.add_row(str(B), f"{ar_tps:.1f}", span(first), span(later), f"{ar_wall:.1f}", span(first_wall),
                  "/".join(f"{m:.1f}" for m in measuring))
    console.print(t)
    if args.output:
        Path(args.output).write_text(json.dumps(out, indent=1) + "\n")
        console.print(f"wrote {args.output}")
    return 0


def main(argv=None) -> int:
    return cli.run_reporting_errors(run, parse_args(argv), Console())


if __name__ == "__main__":
    sys.exit(main())
