"""dcut's worst runs, not only its median: `python -m minidcut.bench` repeated from empty cost tables.

For each of --runs rounds and each batch size B, one bench process over every policy at B alone, with a
cost-table file of its own that starts empty (as in a fresh checkout: dcut measures its rows and learns
from nothing). Each run gives dcut / the best fixed policy of that run and dcut / AR (bench's summary:
medians of its interleaved passes). Reported per B: the distribution over runs (minimum, 10th
percentile, median; linear interpolation between order statistics, as numpy.percentile), which fixed
policy was best, and how often dcut's drafting was off for most of its steps.

A run's best fixed policy is the fastest of the fixed ones in that run: the maximum of several noisy
medians, which runs high by itself when policies are close (at B = 1 on the demo pair four drafting
policies are within a few percent of each other). So each run is also put against one reference fixed
after all runs: the fixed policy whose median speedup over AR across the runs is highest (the depth a
user would pick knowing the machine), dcut / that policy's tokens per second in the same run.

Both come two ways. As bench states them: a policy's median tokens per second over its passes, over
another's. And paired: the median over rounds of dcut's pass over the other policy's pass of the same
round (bench interleaves the passes, so a round's passes run minutes apart at most, while the machine's
speed drifts by 20 % and more between rounds on a shared 2-core host: AR's own passes in one process
ran 569-764 tokens a second). The paired figure cancels what drift the passes of a round share. The
JSON is rewritten after every run, so a stopped measurement keeps what it has; --summarize sums up
files again, and joins several (runs of one code measured in parts).

    python tools/worst_case.py --runs 10 --batch-sizes 1,4,16,64 --output docs/bench/worst_case_demo.json
    python tools/worst_case.py --runs 10 --target models/smollm2-135m-instruct \
        --drafter models/smollm2-135m-instruct-dflash --chat --prompts models/prompts_mix_heldout.jsonl \
        --output docs/bench/worst_case_smollm2.json
    python tools/worst_case.py --summarize first.json second.json --output both.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if __name__ == "__main__":  # run as a script: import from the repo root
    sys.path[0] = str(ROOT)

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from minidcut import cli  # noqa: E402

PASSED = ("target", "drafter", "prompts", "policies", "max_new_tokens", "num_prompts", "repeats", "threads")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=10, help="runs per batch size, each from an empty table (default: %(default)s)")
    p.add_argument("--batch-sizes", default=None, help="comma-separated (default: 1,4,16,64; with --summarize: all)")
    cli.add_pair_args(p, "bench")
    p.add_argument("--policies", default="ar,full,static:0.25,static:0.5,static:0.75,dcut",
                   help="bench's --policies; must hold dcut and ar (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="per request (default: %(default)s)")
    p.add_argument("--num-prompts", type=int, default=None, help="prompts per run (default: bench's, max(2B, 16))")
    p.add_argument("--repeats", type=int, default=2, help="bench's timed passes per policy (default: %(default)s)")
    p.add_argument("--lockstep", action="store_true", help="pass --lockstep to bench")
    p.add_argument("--threads", type=int, default=None, help="passed to bench (default: bench's own)")
    p.add_argument("--output", default=None, help="JSON with every run (rewritten after each)")
    p.add_argument("--summarize", nargs="+", default=None, metavar="JSON",
                   help="run nothing: summarize the runs of earlier --output files again (those at --batch-sizes): one "
                        "file is rewritten in place, or written to --output; several are joined, their runs "
                        "together, and written to --output if given")
    return p.parse_args(argv)


def spread(xs: list[float]) -> dict:
    """Minimum, 10th percentile and median of xs (empty: None each)."""
    if not xs:
        return {"min": None, "p10": None, "median": None}
    return {"min": float(min(xs)), "p10": float(np.percentile(xs, 10)), "median": float(np.median(xs))}


def one_run(args, B: int, work: Path) -> dict:
    """One bench process at batch size B from an empty table; what its summary says of dcut."""
    table, out = work / "table.json", work / "bench.json"
    table.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "minidcut.bench", "--batch-sizes", str(B), "--cost-table", str(table),
           "--output", str(out)]
    for name in PASSED:
        value = getattr(args, name)
        if value is not None:
            cmd += [f"--{name.replace('_', '-')}", str(value)]
    cmd += ([] if args.chat is None else ["--chat"] + [args.chat] * bool(args.chat)) + ["--lockstep"] * args.lockstep
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise cli.UserError(f"bench at B = {B} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    result = json.loads(out.read_text())
    at = result["summary"]["per_batch"][str(B)]
    dcut = next(r for r in result["records"] if r["policy"] == "dcut")
    steps = sum(dcut["rho_histogram"].values()) or 1
    return {"batch_size": B, "seconds": time.perf_counter() - t0, "best_fixed": at["best_fixed"],
            "dcut_vs_best_fixed": at["dcut_vs_best_fixed"], "dcut_vs_ar": at.get("dcut_vs_ar"),
            "dcut_tokens_per_second": dcut["tokens_per_second"], "dcut_tau": dcut["tau"],
            "dcut_rho_histogram": dcut["rho_histogram"], "dcut_ar_step_share": dcut["rho_histogram"].get("0", 0) / steps,
            "passes_vs_ar": {r["policy"]: r["speedup_vs_ar_runs"] for r in result["records"]},
            "tokens_per_second": {r["policy"]: r["tokens_per_second"] for r in result["records"]}}


def paired(r: dict, policy: str) -> float:
    """The median over rounds of dcut's pass over `policy`'s pass of the same round (passes_vs_ar holds
    each pass over AR's of its round)."""
    return float(np.median([d / x for d, x in zip(r["passes_vs_ar"]["dcut"], r["passes_vs_ar"][policy])]))


def paired_summary(rs: list[dict]) -> dict:
    """summarize's figures on paired passes: each run's best fixed policy the one with the highest median
    pass over AR's, the overall one the highest median of those over the runs."""
    fixed = [k for k in rs[0]["passes_vs_ar"] if k != "dcut"]
    speedup = [{k: float(np.median(r["passes_vs_ar"][k])) for k in fixed} for r in rs]
    best = [max(fixed, key=s.get) for s in speedup]
    overall = max(fixed, key=lambda k: np.median([s[k] for s in speedup]))
    return {"best_fixed": {k: best.count(k) for k in sorted(set(best))},
            "dcut_vs_best_fixed": spread([paired(r, b) for r, b in zip(rs, best)]),
            "best_fixed_overall": overall, "dcut_vs_best_fixed_overall": spread([paired(r, overall) for r in rs]),
            "dcut_vs_ar": spread([paired(r, "ar") for r in rs]),
            "dcut_vs_ar_where_ar_is_best": spread([paired(r, "ar") for r, b in zip(rs, best) if b == "ar"])}


def summarize(runs: list[dict], batch_sizes: list[int]) -> dict:
    out = {}
    for B in batch_sizes:
        rs = [r for r in runs if r["batch_size"] == B]
        if not rs:
            continue
        best = {}
        for r in rs:
            best[r["best_fixed"]] = best.get(r["best_fixed"], 0) + 1
        ar_best = [r for r in rs if r["best_fixed"] == "ar"]
        tps = [r["tokens_per_second"] for r in rs]
        fixed = [k for k in tps[0] if k != "dcut"]
        overall = max(fixed, key=lambda k: np.median([t[k] / t["ar"] for t in tps]))  # after all runs
        out[str(B)] = {"runs": len(rs), "dcut_vs_best_fixed": spread([r["dcut_vs_best_fixed"] for r in rs]),
                       "best_fixed_overall": overall,
                       "dcut_vs_best_fixed_overall": spread([t["dcut"] / t[overall] for t in tps]),
                       "dcut_vs_ar": spread([r["dcut_vs_ar"] for r in rs if r["dcut_vs_ar"] is not None]),
                       "dcut_vs_ar_where_ar_is_best": spread([r["dcut_vs_ar"] for r in ar_best]),
                       "best_fixed": best,
                       "runs_mostly_ar_steps": sum(r["dcut_ar_step_share"] > 0.5 for r in rs),
                       "paired": paired_summary(rs)}
    return out


def table(summary: dict, paired: bool = False) -> Table:
    t = Table(title="dcut over runs from empty tables: min / 10th pct / median"
              + (", paired passes" if paired else ", medians of passes"))
    for c in ("B", "runs", "dcut / best fixed of each run", "dcut / best fixed overall", "dcut / AR",
              "best fixed (runs)", "runs mostly AR steps"):
        t.add_column(c, justify="right")
    fmt = lambda s: "/".join("-" if s[k] is None else f"{s[k]:.3f}" for k in ("min", "p10", "median"))  # noqa: E731
    for B, s in summary.items():
        s = {**s, **s["paired"]} if paired else s
        t.add_row(B, str(s["runs"]), fmt(s["dcut_vs_best_fixed"]),
                  f"{fmt(s['dcut_vs_best_fixed_overall'])} ({s['best_fixed_overall']})", fmt(s["dcut_vs_ar"]),
                  ", ".join(f"{k} {v}" for k, v in sorted(s["best_fixed"].items())), str(s["runs_mostly_ar_steps"]))
    return t


def resummarize(paths: list[str], output: str | None, batch_sizes: list[int] | None, console: Console) -> int:
    """--summarize: the summary of earlier files' runs at batch_sizes (None: all), as this version
    computes it. One file is rewritten in place (or written to output); several are joined (their
    commands, arguments and runs in order) and written to output."""
    records = []
    for path in paths:
        try:
            record = json.loads(Path(path).read_text())
            record["runs"][0]["batch_size"]  # a worst_case output: runs, each at a batch size
        except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
            raise cli.UserError(f"--summarize {path}: not a worst_case output ({type(e).__name__}: {e})") from None
        records.append(record)
    if len(records) == 1:
        record, output = records[0], output or paths[0]
    else:
        listed = lambda r, k: r[k] if isinstance(r[k], list) else [r[k]]  # noqa: E731 (joined files: lists)
        record = {k: [x for r in records for x in listed(r, k)] for k in ("command", "args", "runs")}
    record["runs"] = runs = [r for r in record["runs"] if batch_sizes is None or r["batch_size"] in batch_sizes]
    if not runs:
        raise cli.UserError(f"--summarize: no runs at batch sizes {batch_sizes}")
    record["summary"] = summarize(runs, sorted({r["batch_size"] for r in runs}))
    if output:
        Path(output).write_text(json.dumps(record, indent=1) + "\n")
    console.print(table(record["summary"]))
    console.print(table(record["summary"], paired=True))
    return 0


def run(args, console: Console) -> int:
    cli.check_writable(args.output, "--output")
    if args.summarize:
        return resummarize(args.summarize, args.output, args.batch_sizes and cli.parse_batch_sizes(args.batch_sizes),
                           console)
    batch_sizes = cli.parse_batch_sizes(args.batch_sizes or "1,4,16,64")
    cli.check_positive(args, "runs", "max_new_tokens", "num_prompts", "repeats", "threads")
    policies = [p.strip() for p in args.policies.split(",")]
    if "dcut" not in policies or "ar" not in policies:
        raise cli.UserError("--policies must hold dcut and ar")
    record = {"command": " ".join(["python", "tools/worst_case.py"] + sys.argv[1:]), "args": vars(args), "runs": []}
    total, t0 = args.runs * len(batch_sizes), time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            for B in batch_sizes:  # the batch sizes take turns, so a machine that drifts hits each alike
                r = one_run(args, B, Path(tmp))
                record["runs"].append({"run": i + 1, **r})
                record["summary"] = summarize(record["runs"], batch_sizes)
                if args.output:
                    Path(args.output).write_text(json.dumps(record, indent=1) + "\n")
                done = len(record["runs"])
                eta = (time.perf_counter() - t0) / done * (total - done)
                console.log(f"run {i + 1} B={B}: dcut {r['dcut_vs_best_fixed']:.3f}x best fixed ({r['best_fixed']}), "
                            f"{r['dcut_vs_ar']:.3f}x AR, {r['seconds']:.0f} s; {done}/{total}, ~{eta / 60:.0f} min left")
    console.print(table(record["summary"]))
    console.print(table(record["summary"], paired=True))
    if args.output:
        console.print(f"wrote {args.output}")
    return 0


def main(argv=None) -> int:
    console = Console()
    console.width = max(console.width, 140)  # the tables hold three min / p10 / median columns
    return cli.run_reporting_errors(run, parse_args(argv), console)


if __name__ == "__main__":
    sys.exit(main())
