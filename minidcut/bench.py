"""python -m minidcut.bench: every policy side by side, per batch size, in one process.

For each batch size the policies run over the same prompts, interleaved, the order rotating from pass to
pass (A B C, B C A, C A B: each policy follows each other one alike; on a CPU the steps after another
policy's pass run slow while caches refill), warm: a first untimed pass compiles (its time is reported
separately). With --lockstep each policy runs on
its own copy of the models and the passes run together, one step of each policy in turn: a machine whose
speed drifts from second to second (a shared VM) then slows every policy alike. Reported per (B, policy):
tokens/s, speedup over AR, tau, keep ratio, rho histogram, step-time split, and for dcut the predicted
vs realized accepted drafts before and after calibration. Also the best fixed policy per batch size
(the oracle in hindsight) and the selector's own cost. Writes JSON and a PNG plot.

Policies: ar, full, static:R, dcut (default: committed-token gain, calibration, skip drafting),
dcut:accepted (the paper's gain: anchors left out), dcut:paper (accepted gain, no calibration, no
skipping: the paper's plain variant), dcut:nocal, dcut:noskip.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from . import cli, dcut, runtime
from .api import build_policy, load_pair, load_table, load_tokenizer, parse_policy, save_table
from .engine import Engine
from .policy import Policy

DEFAULT_PROMPTS = cli.MODELS / "prompts_heldout.jsonl"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m minidcut.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=str(cli.DEFAULT_TARGET), help="target model directory (default: the demo's)")
    p.add_argument("--drafter", default=str(cli.DEFAULT_DRAFTER), help="DFlash drafter directory (default: the demo's)")
    p.add_argument("--batch-sizes", default="1,4,16,32,64", help="comma-separated batch sizes B (default: %(default)s)")
    p.add_argument("--policies", default="ar,full,static:0.25,static:0.5,static:0.75,dcut",
                   help="comma-separated: ar, full, static:R, dcut, dcut:accepted, dcut:paper, dcut:nocal, "
                        "dcut:noskip (default: %(default)s)")
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS),
                   help='JSONL of {"prompt": ...}, {"input_ids": [...]} or {"messages": [...]} lines '
                        "(default: models/prompts_heldout.jsonl)")
    cli.add_chat_arg(p)
    p.add_argument("--num-prompts", type=int, default=None, help="prompts per run (default: max(2B, 16))")
    p.add_argument("--max-new-tokens", type=int, default=64,
                   help="tokens generated per prompt, EOS ignored (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=2,
                   help="timed passes per policy, interleaved; the median is kept (default: %(default)s)")
    p.add_argument("--lockstep", action="store_true",
                   help="each policy on its own copy of the models, the passes taking steps in turn, so a machine "
                        "whose speed drifts slows every policy alike (needs the models' memory once per policy)")
    p.add_argument("--cost-table", default=None, help="default: the table of each batch size's fingerprint "
                   "under compile_cache/cost_tables/ (rows it lacks are measured in the warm-up pass)")
    cli.add_runtime_args(p)
    p.add_argument("--output", default=None, help="JSON with every figure")
    p.add_argument("--plot", default=None, help="PNG: speedup over AR vs batch size (needs matplotlib)")
    return p.parse_args(argv)


@torch.inference_mode()
def selector_seconds(policy: Policy, B: int, D: int, device, compile: bool, reps: int = 50) -> float:
    """Time of the selector alone at [B, D]: dcut.select (prefix scores, keep_len and gain for every
    rho) and rho* (policy.choose)."""
    Ks = [dcut.budget(r, B, D) for r in policy.rhos]

    def step(conf, limit, cost):
        sel = dcut.select(conf, limit, Ks)
        return sel.keep_lens, policy.choose(sel.gains, torch.tensor(float(B)), torch.tensor(1.0), cost)
    fn = torch.compile(step, fullgraph=True, dynamic=False) if compile else step
    conf = torch.rand(B, D, device=device)
    limit = torch.full((B,), D, device=device)
    cost = torch.ones(len(policy.rhos), device=device)
    for _ in range(3):
        fn(conf, limit, cost)[1].item()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn(conf, limit, cost)[1].item()
    return (time.perf_counter() - t0) / reps


def bench_batch(B, specs, models, prompts, args, console) -> tuple[list[dict], dict | None]:
    """Every policy at batch size B over the same prompts, passes interleaved (--lockstep: taken
    together, step by step). models: {spec: (target, drafter)}. dcut policies share one cost table (its
    missing rows are measured in their warm-up pass); returns the records and it."""
    target, drafter = models[specs[0]]
    n = args.num_prompts or max(2 * B, 16)
    ids = (prompts * (n // len(prompts) + 1))[:n]
    max_seq = cli.max_seq(ids, args.max_new_tokens, drafter.block_size, target.cfg.max_position_embeddings,
                          args.compile)
    table, table_file = None, None
    if any(s.startswith("dcut") for s in specs):
        table, table_file = load_table(target, drafter, args.target, args.drafter, args.compile, max_seq,
                                       path=args.cost_table, log=console.print)
    engines, rows = {}, {}
    for spec in specs:
        policy = build_policy(spec, table=table, log=console.print)
        t, d = models[spec]
        engines[spec] = Engine(t, d if policy.needs_drafter else None, policy, batch_size=B,
                               max_seq=max_seq, eos_ids=[], compile=args.compile)
        t0 = time.perf_counter()  # warm-up: compiles every graph this policy can reach, measures missing rows
        engines[spec].warmup()
        # on the last B prompts, not the first ones the timed passes start with: dcut's skip controller
        # learns in the warm-up too, and would see one prompt twice as its first two requests
        engines[spec].generate(ids[-B:], min(args.max_new_tokens, 2 * drafter.block_size))
        rows[spec] = {"warmup_seconds": time.perf_counter() - t0, "runs": []}
    for rep in range(args.repeats):
        passes = together(engines, ids, args.max_new_tokens) if args.lockstep else (
            (spec, engines[spec].generate(ids, args.max_new_tokens)[1]) for spec in pass_order(specs, rep))
        for spec, stats in passes:
            rows[spec]["runs"].append(stats.as_dict())
            console.log(f"B={B} {spec:>12} pass {rep + 1}: {rows[spec]['runs'][-1]['tokens_per_second']:.1f} tok/s")
    out = [record(B, spec, rows[spec]["runs"], rows[spec]["warmup_seconds"]) for spec in specs]
    add_speedups(out)
    dcut_specs = [s for s in specs if s.startswith("dcut")]
    if dcut_specs:
        save_table(engines[dcut_specs[0]].policy, table_file)
        sel = selector_seconds(engines[dcut_specs[0]].policy, B, drafter.block_size - 1, drafter.fc.weight.device,
                               args.compile)
        for r in out:
            if r["policy"].startswith("dcut"):
                step = sum(r["seconds"].get(k, 0) for k in ("draft", "verify", "bookkeeping")) / max(r["steps"], 1)
                r["select_seconds"] = sel
                r["select_fraction_of_step"] = sel / step if step else None
    return out, table.to_json() if table is not None else None


def pass_order(specs: list[str], rep: int) -> list[str]:
    """The policies' order in timed pass `rep`, rotated by one a pass (A B C, B C A, C A B): each policy
    follows each other one alike."""
    return specs[rep % len(specs):] + specs[: rep % len(specs)]


def median_pass(runs: list[dict]) -> dict:
    """Of passes (Stats.as_dict each), the one of median tokens/s (the upper one of an even count)."""
    return sorted(runs, key=lambda r: r["tokens_per_second"])[len(runs) // 2]


def record(B: int, spec: str, runs: list[dict], warmup_seconds: float) -> dict:
    """The record of one policy at batch size B from its timed passes (Stats.as_dict each): tokens/s of
    each pass and their median, the rest from the median pass, and the error per drafting request step
    of the accepted drafts the policy predicted, before and after calibration."""
    mid = median_pass(runs)
    rec = {"batch_size": B, "policy": spec, "warmup_seconds": warmup_seconds,
           "tokens_per_second": statistics.median(r["tokens_per_second"] for r in runs),
           "tokens_per_second_runs": [r["tokens_per_second"] for r in runs], **{
               k: mid[k] for k in ("tau", "keep_ratio", "rho_histogram", "bucket_histogram", "seconds", "steps",
                                   "generated_tokens", "predicted_accepted_raw", "predicted_accepted",
                                   "realized_accepted", "drafting_request_steps")}}
    if rec["drafting_request_steps"]:
        n_rs = rec["drafting_request_steps"]
        rec["tau_error_uncalibrated"] = abs(rec["predicted_accepted_raw"] - rec["realized_accepted"]) / n_rs
        rec["tau_error_calibrated"] = abs(rec["predicted_accepted"] - rec["realized_accepted"]) / n_rs
    return rec


def add_speedups(records: list[dict]) -> None:
    """speedup_vs_ar of each record of one batch size (None without an AR record), and pass by pass:
    each pass over AR's pass of the same round."""
    ar = next((r for r in records if r["policy"] == "ar"), None)
    for r in records:
        r["speedup_vs_ar"] = r["tokens_per_second"] / ar["tokens_per_second"] if ar else None
        r["speedup_vs_ar_runs"] = [x / y for x, y in zip(r["tokens_per_second_runs"], ar["tokens_per_second_runs"])] \
            if ar else None


def together(engines: dict[str, Engine], ids, max_new_tokens: int) -> list[tuple[str, object]]:
    """One pass of every engine over the same prompts, taken step by step: each round steps every
    unfinished engine once, the order rotating from round to round. Returns [(spec, Stats)]."""
    runs = {spec: e.start(ids, max_new_tokens)[1:] for spec, e in engines.items()}  # spec: (stats, steps)
    going, k = list(runs), 0
    while going:
        for spec in going[k % len(going):] + going[: k % len(going)]:
            if next(runs[spec][1], None) is None:
                going.remove(spec)
        k += 1
    return [(spec, stats) for spec, (stats, _) in runs.items()]


def print_tables(console: Console, records: list[dict]) -> None:
    t = Table(title="minidcut.bench: side by side, per batch size")
    for c in ("B", "policy", "tok/s", "x AR", "tau", "keep", "rho histogram", "draft/verify/book %", "compile s"):
        t.add_column(c, justify="right")
    for r in records:
        s = r["seconds"]
        tot = sum(s.get(k, 0) for k in ("draft", "verify", "bookkeeping")) or 1
        split = "/".join(f"{100 * s.get(k, 0) / tot:.0f}" for k in ("draft", "verify", "bookkeeping"))
        hist = " ".join(f"{k}:{v}" for k, v in r["rho_histogram"].items())
        t.add_row(str(r["batch_size"]), r["policy"], f"{r['tokens_per_second']:.1f}",
                  f"{r['speedup_vs_ar']:.2f}" if r["speedup_vs_ar"] else "-", f"{r['tau']:.2f}",
                  f"{r['keep_ratio']:.2f}", hist, split, f"{r['warmup_seconds']:.0f}")
    console.print(t)
    best = Table(title="adaptive vs the best fixed policy in hindsight (oracle)")
    for c in ("B", "best fixed", "its tok/s", "policy", "tok/s", "vs best", "vs ar", "vs full",
              "tau err raw", "tau err cal", "select % of step"):
        best.add_column(c, justify="right")
    for B in sorted({r["batch_size"] for r in records}):
        rs = [r for r in records if r["batch_size"] == B]
        fixed = [r for r in rs if not r["policy"].startswith("dcut")]
        if not fixed:
            continue
        b = max(fixed, key=lambda r: r["tokens_per_second"])
        get = {r["policy"]: r["tokens_per_second"] for r in rs}
        for r in rs:
            if r["policy"].startswith("dcut"):
                best.add_row(str(B), b["policy"], f"{b['tokens_per_second']:.1f}", r["policy"],
                             f"{r['tokens_per_second']:.1f}", f"{r['tokens_per_second'] / b['tokens_per_second']:.2f}",
                             f"{r['tokens_per_second'] / get['ar']:.2f}" if "ar" in get else "-",
                             f"{r['tokens_per_second'] / get['full']:.2f}" if "full" in get else "-",
                             f"{r.get('tau_error_uncalibrated', 0):.2f}", f"{r.get('tau_error_calibrated', 0):.2f}",
                             f"{100 * (r.get('select_fraction_of_step') or 0):.1f}")
    console.print(best)


def summarize(records: list[dict]) -> dict:
    """The adaptive policy against the fixed ones, per batch size, and at the crossover: the batch size
    where full drafting and AR trade places (the measured B whose full/AR ratio is closest to 1
    among the two around the first sign change; None when one of them wins everywhere)."""
    out = {"per_batch": {}, "crossover": None}
    by_b = {B: {r["policy"]: r for r in records if r["batch_size"] == B} for B in sorted({r["batch_size"] for r in records})}
    for B, rs in by_b.items():
        fixed = {k: r["tokens_per_second"] for k, r in rs.items() if not k.startswith("dcut")}
        if "dcut" not in rs or not fixed:
            continue
        d = rs["dcut"]["tokens_per_second"]
        best = max(fixed, key=fixed.get)
        out["per_batch"][B] = {"best_fixed": best, "dcut_vs_best_fixed": d / fixed[best],
                               **{f"dcut_vs_{k}": d / fixed[k] for k in ("ar", "full") if k in fixed}}
    ratios = [(B, rs["full"]["tokens_per_second"] / rs["ar"]["tokens_per_second"])
              for B, rs in by_b.items() if "full" in rs and "ar" in rs]
    for (b0, r0), (b1, r1) in zip(ratios, ratios[1:]):
        if (r0 - 1) * (r1 - 1) <= 0:
            B = b0 if abs(r0 - 1) <= abs(r1 - 1) else b1
            at = out["per_batch"].get(B)
            out["crossover"] = {"batch_size": B, "between": [b0, b1], "full_vs_ar": dict(ratios)[B],
                                "dcut_vs_both": min(at["dcut_vs_ar"], at["dcut_vs_full"]) if at else None}
            break
    return out


def plot(records: list[dict], path: str, console: Console) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for spec in dict.fromkeys(r["policy"] for r in records):
        rs = [r for r in records if r["policy"] == spec and r["speedup_vs_ar"]]
        ax.plot([r["batch_size"] for r in rs], [r["speedup_vs_ar"] for r in rs], marker="o", label=spec)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size B (concurrent requests)")
    ax.set_ylabel("throughput / AR throughput")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    console.print(f"wrote {path}")


def check_args(args) -> tuple[list[str], list[int]]:
    """Policies and batch sizes from the command line; bad values are a one-line error before any work."""
    specs = [s.strip() for s in args.policies.split(",") if s.strip()]
    if not specs:
        raise cli.UserError("--policies: need at least one policy")
    for spec in specs:
        parse_policy(spec)
    batch_sizes = cli.parse_batch_sizes(args.batch_sizes)
    cli.check_positive(args, "max_new_tokens", "repeats", "num_prompts")
    cli.check_runtime_args(args)
    cli.check_writable(args.output, "--output")
    cli.check_writable(args.plot, "--plot")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise cli.UserError('--plot needs matplotlib: pip install -e ".[plot]"') from None
    return specs, batch_sizes


def run(args, console: Console) -> int:
    specs, batch_sizes = check_args(args)
    runtime.setup(args.threads)
    load = lambda: load_pair(args.target, args.drafter, args.dtype, args.device, args.drafter_dtype,  # noqa: E731
                             pack=not args.compile)
    target, drafter, device, dtype = load()
    models = {spec: (target, drafter) if i == 0 or not args.lockstep else load()[:2] for i, spec in enumerate(specs)}
    tokenizer = load_tokenizer(args.target)
    prompts, _ = cli.read_prompts(args.prompts, None, tokenizer, cli.parse_chat(args.chat), args.target)
    runtime.freeze_heap()
    records, tables = [], {}
    for B in batch_sizes:
        recs, tables[str(B)] = bench_batch(B, specs, models, prompts, args, console)
        records += recs
    print_tables(console, records)
    summary = summarize(records)
    cross = summary["crossover"]
    if cross is None:
        console.print("crossover: none in the measured batch sizes (full drafting and AR do not trade places)")
    else:
        both = cross["dcut_vs_both"]
        console.print(f"crossover: full vs AR = {cross['full_vs_ar']:.2f} at B = {cross['batch_size']}"
                      + (f"; dcut vs the better of the two: {both:.2f}x" if both else ""))
    result = {"target": args.target, "drafter": args.drafter, "device": str(device), "dtype": str(dtype),
              "drafter_dtype": str(drafter.fc.weight.dtype),
              "threads": torch.get_num_threads(), "torch": torch.__version__, "max_new_tokens": args.max_new_tokens,
              "compiled": args.compile, "lockstep": args.lockstep, "cost_tables": tables,
              "summary": summary, "records": records}
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
        console.print(f"wrote {args.output}")
    if args.plot:
        plot(records, args.plot, console)
    return 0


def main(argv=None) -> int:
    return cli.run_reporting_errors(run, parse_args(argv), Console())


if __name__ == "__main__":
    sys.exit(main())
