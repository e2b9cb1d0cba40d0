"""python -m minidcut.generate: batched generation with a target, a DFlash drafter and a policy.

With no arguments it runs the shipped demo pair (models/) on four built-in code prompts with the
adaptive `dcut` policy, then the same prompts with AR decoding for the speedup. The prompts ask for
48, 96, 160 and 256 new tokens (BUILTIN_LENGTHS), so the batch drains as they finish: four requests
at bucket 4, then three, then (usually) two at bucket 2 and the last alone at bucket 1, and D-cut
decides at each bucket (whether drafting pays there, and rho per step). Results are written as requests finish;
Ctrl-C keeps every finished request.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.live import Live
from rich.table import Table

from . import cli, runtime
from .api import build_policy, load_pair, load_table, load_tokenizer, parse_rhos, sampling_mode, save_table
from .engine import Engine
from .explain import explain

BUILTIN_PROMPTS = [
    "def is_prime(n):\n    \"\"\"Return True if n is a prime number.\"\"\"\n",
    "class Stack:\n    def __init__(self):\n",
    "import os\n\n\ndef list_python_files(root):\n",
    "def read_lines(path, encoding='utf-8'):\n",
]
BUILTIN_LENGTHS = [48, 96, 160, 256]  # new tokens of each built-in prompt: the batch drains from bucket 4 down
DEFAULT_MAX_NEW_TOKENS = 64


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m minidcut.generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=str(cli.DEFAULT_TARGET),
                   help="target model directory (HF layout; default: the shipped demo target)")
    p.add_argument("--drafter", default=None,
                   help="DFlash drafter directory (z-lab layout); default: the shipped demo drafter "
                        "when --target is the default; not used by --policy ar")
    p.add_argument("--policy", default="dcut", choices=["ar", "full", "static", "dcut"],
                   help="ar: no drafting; full: verify all D drafts; static: fixed --rho; dcut: rho "
                        "chosen per step from the cost table (default: %(default)s)")
    p.add_argument("--rho", type=float, default=None, help="budget ratio of --policy static, in [0, 1]")
    p.add_argument("--rhos", default="0,0.25,0.5,0.75,1", help="rho grid of --policy dcut (default: %(default)s)")
    p.add_argument("--gain", default="committed", choices=["committed", "accepted"],
                   help="dcut gain: expected committed tokens (anchors counted) or accepted drafts only "
                        "(the paper's reference code); default: %(default)s")
    p.add_argument("--no-calibrate", action="store_true",
                   help="dcut: no online calibration (raw drafter confidences, the cost table as profiled)")
    p.add_argument("--no-skip-drafting", action="store_true", help="dcut: always draft")
    p.add_argument("--cost-table", default=None,
                   help="cost table JSON (default: the table of this run's fingerprint under "
                        "compile_cache/cost_tables/): rows it lacks are measured when the run reaches their "
                        "bucket, and it is saved at the end with what dcut learned, for the next run")
    p.add_argument("--batch-size", type=int, default=4,
                   help="max concurrent requests B; each step runs at the smallest power-of-two bucket "
                        "(or B) that holds the live requests (default: %(default)s)")
    p.add_argument("--prompt", action="append", default=None,
                   help="a prompt (repeatable; without --prompt and --prompts: four built-in code prompts)")
    p.add_argument("--prompts", default=None,
                   help='JSONL file: {"prompt": "..."}, {"input_ids": [...]} or {"messages": [...]} per line')
    cli.add_chat_arg(p)
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"per request (default: {DEFAULT_MAX_NEW_TOKENS}; the built-in prompts ask for "
                        f"{', '.join(map(str, BUILTIN_LENGTHS))})")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="sampling seed: request i's token at position p is drawn with the key (seed, i, p), "
                        "so every policy and batch size samples the same text (default: %(default)s)")
    p.add_argument("--ignore-eos", action="store_true", help="always generate max-new-tokens")
    cli.add_runtime_args(p)
    p.add_argument("--output", default=None,
                   help="JSONL, one line per request with its index, written as requests finish and "
                        "sorted into input order at the end")
    p.add_argument("--stats", default=None, help="write the run's statistics as JSON")
    p.add_argument("--warmup", choices=["all", "first"], default="first",
                   help="compiled runs: compile the graphs of the first batch bucket before the first step and "
                        "the others when the run first reaches them, their first steps counted as compiling, "
                        "not decoding (first: a run that never drains to the smaller buckets never compiles "
                        "them), or every bucket's before the first step (all) (default: %(default)s)")
    p.add_argument("--compare-ar", action=argparse.BooleanOptionalAction, default=None,
                   help="after the run, generate the same prompts with plain AR decoding in this process, print "
                        "the speedup and whether the tokens are the same (where they first differ if not: in "
                        "float32 they must not; in bfloat16 near-ties may flip). Default: on for the built-in "
                        "prompts, off otherwise")
    p.add_argument("--quiet", action="store_true", help="no status, no live view, no summary, no completions")
    return p.parse_args(argv)


def check_args(args) -> None:
    """Every check that needs no model: one-line errors before anything loads."""
    cli.check_positive(args, "batch_size", "max_new_tokens")
    cli.check_runtime_args(args)
    if not Path(args.target).is_dir():
        raise cli.UserError(f"--target {args.target}: no such directory")
    if args.drafter is None and args.policy != "ar" and Path(args.target).resolve() == cli.DEFAULT_TARGET.resolve():
        args.drafter = str(cli.DEFAULT_DRAFTER)
    if args.policy != "ar" and args.drafter is None:
        raise cli.UserError(f"--policy {args.policy} needs --drafter")
    if args.policy == "static" and args.rho is None:
        raise cli.UserError("--policy static needs --rho")
    if args.rho is not None and args.policy != "static":
        raise cli.UserError(f"--rho is the budget of --policy static; --policy {args.policy} does not use it")
    if args.rho is not None and not 0.0 <= args.rho <= 1.0:
        raise cli.UserError(f"--rho must be in [0, 1], got {args.rho}")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise cli.UserError("--temperature must be >= 0 and --top-p in (0, 1]")
    parse_rhos(args.rhos)
    cli.check_writable(args.output, "--output")
    cli.check_writable(args.stats, "--stats")


def summary_table(stats) -> Table:
    d = stats.as_dict()
    t = Table(title="minidcut.generate")
    for col in ("policy", "B", "requests", "tokens", "decode s", "tok/s", "tau", "keep ratio", "rho histogram"):
        t.add_column(col, justify="right")
    hist = " ".join(f"{k}:{v}" for k, v in d["rho_histogram"].items())
    t.add_row(d["policy"], str(d["batch_size"]), str(d["requests"]), str(d["generated_tokens"]),
              f"{d['decode_seconds']:.2f}", f"{d['tokens_per_second']:.1f}", f"{d['tau']:.2f}",
              f"{d['keep_ratio']:.2f}", hist)
    return t


class ResultWriter:
    """--output lines as requests finish (each with its index); sorted into input order by close()."""

    def __init__(self, path: str | None, tokenizer):
        self.path, self.tokenizer, self.done = path, tokenizer, {}
        self.file = open(path, "w") if path else None

    def __call__(self, index: int, output: list[int]) -> None:
        rec = {"index": index, "output_ids": output}
        if self.tokenizer is not None:
            rec["text"] = self.tokenizer.decode(output)
        self.done[index] = rec
        if self.file is not None:
            try:
                self.file.write(json.dumps(rec) + "\n")
                self.file.flush()
            except OSError as e:
                raise cli.UserError(f"writing --output {self.path}: {e.strerror or e} "
                                    f"({len(self.done) - 1} requests were written)") from None

    def close(self, complete: bool) -> None:
        if self.file is None:
            return
        self.file.close()
        if complete:  # the whole run finished: rewrite in input order (atomically)
            runtime.write_atomically(self.path, lambda tmp: tmp.write_text(
                "".join(json.dumps(self.done[i]) + "\n" for i in sorted(self.done))))


def run(args, console: Console) -> int:
    check_args(args)
    drafter_dir = args.drafter if args.policy != "ar" else None
    vocab, positions, block = cli.model_limits(args.target, drafter_dir)
    tokenizer = load_tokenizer(args.target)
    prompts, names = cli.read_prompts(args.prompts, args.prompt, tokenizer, cli.parse_chat(args.chat), args.target,
                                      default=BUILTIN_PROMPTS)
    builtin = not args.prompts and not args.prompt
    if args.max_new_tokens is None:
        args.max_new_tokens = BUILTIN_LENGTHS if builtin else DEFAULT_MAX_NEW_TOKENS
    if args.compare_ar is None:
        args.compare_ar = builtin
    cli.check_prompts(prompts, args.max_new_tokens, vocab, positions, block, names)
    runtime.setup(args.threads)
    max_seq = cli.max_seq(prompts, args.max_new_tokens, block, positions, args.compile)
    def log(message: str) -> None:  # a cost table or saved state that is not used: one line, even with --quiet
        console.print(message, soft_wrap=True, highlight=False, markup=False)
    t0 = time.perf_counter()
    with cli.status(console, f"loading {args.target}", args.quiet) as status:
        target, drafter, device, dtype = load_pair(args.target, drafter_dir, args.dtype, args.device,
                                                   args.drafter_dtype, pack=not args.compile)
        table, table_file = None, None
        if args.policy == "dcut":
            table, table_file = load_table(target, drafter, args.target, drafter_dir, args.compile, max_seq,
                                           sampling_mode(args.temperature, args.top_p), args.rhos,
                                           args.cost_table, log)
        policy = build_policy(f"static:{args.rho}" if args.policy == "static" else args.policy, table=table,
                              rhos=args.rhos, gain=args.gain, calibrate=not args.no_calibrate,
                              skip_drafting=not args.no_skip_drafting, log=log)
        say = Sink(status.update)  # a graph compiled on the way speaks on the live progress line instead
        engine = make_engine(args, target, drafter, policy, max_seq, say)
        compile_seconds = warm_up(engine, args, len(prompts), log if not args.quiet else None)
        runtime.freeze_heap()
    if not args.quiet:
        console.print(f"ready in {time.perf_counter() - t0:.1f} s: {args.target}"
                      + (f" + {drafter_dir}" if drafter else "") + f" ({dtype}, {device}, "
                      f"{'compiled' if args.compile else 'eager'}); {len(prompts)} requests, policy "
                      f"{policy.label}, B = {args.batch_size}")
    writer = ResultWriter(args.output, tokenizer)
    try:
        outputs, stats = decode(engine, prompts, args, console, writer, say)
    except KeyboardInterrupt:
        writer.close(complete=False)
        where = f" written to {args.output}" if args.output else " finished"
        print(f"interrupted: {len(writer.done)} of {len(prompts)} requests{where}", file=sys.stderr)
        return 130
    finally:  # what the policy measured and learned, kept for the next run (Ctrl-C included)
        if table_file is not None:
            save_table(policy, table_file)
    writer.close(complete=True)
    ar_stats = None
    if args.compare_ar:
        ar_engine = make_engine(args, target, None, build_policy("ar"), max_seq, None)
        with cli.status(console, "the same prompts with AR decoding, for --compare-ar", args.quiet):
            warm_up(ar_engine, args, len(prompts))  # its graphs compiled before it is timed, like the run's
            ar_outputs, ar_stats = ar_engine.generate(prompts, args.max_new_tokens)
    if args.stats:
        compiled = compile_seconds + stats.seconds["compile"]  # before the first step, and on the way (--warmup first)
        Path(args.stats).write_text(json.dumps({**stats.as_dict(), "compile_seconds": compiled,
                                                "compiled_graphs": dict(engine.compiled()),
                                                "threads": torch.get_num_threads(),
                                                **({"ar": ar_stats.as_dict()} if ar_stats else {})}, indent=1) + "\n")
    if not args.quiet:
        if tokenizer is not None:
            for p, out in list(zip(prompts, outputs))[:4]:
                console.rule()
                console.print(tokenizer.decode(p) + tokenizer.decode(out), markup=False, highlight=False)
            console.rule()
        console.print(summary_table(stats))
        if engine.compiled():
            console.print(compiled_line(engine.compiled()), highlight=False)
        for line in explain(stats, policy, table_file):
            console.print(line, highlight=False)
        if ar_stats is not None:
            console.print(f"AR in this process: {ar_stats.as_dict()['tokens_per_second']:.1f} tok/s; {policy.label} is "
                          f"{stats.as_dict()['tokens_per_second'] / ar_stats.as_dict()['tokens_per_second']:.2f}x AR",
                          highlight=False)
            console.print(compare_outputs(outputs, ar_outputs, dtype, names), highlight=False, markup=False)
    return 0


def compare_outputs(ours: list[list[int]], ar: list[list[int]], dtype: torch.dtype, names: list[str]) -> str:
    """What --compare-ar found: identical tokens, or the first request and position where they differ,
    with what that means at this dtype."""
    diff = [(i, next((j for j, (a, b) in enumerate(zip(o, r)) if a != b), min(len(o), len(r))))
            for i, (o, r) in enumerate(zip(ours, ar)) if o != r]
    if not diff:
        return f"--compare-ar: the same tokens as AR decoding in all {len(ours)} requests"
    i, j = diff[0]
    at = (f"{names[i]}, generated token {j}: {ours[i][j] if j < len(ours[i]) else 'end'} here, "
          f"{ar[i][j] if j < len(ar[i]) else 'end'} from AR")
    said = f"--compare-ar: {len(diff)} of {len(ours)} requests differ from AR decoding; the first at {at}."
    if dtype == torch.float32:
        return said + " In float32 the outputs must be identical: this is a bug, please report it."
    return (said + f" In {str(dtype).replace('torch.', '')} a verification of several tokens rounds differently "
            "from an AR step of one, so near-ties can flip and the texts part from there; exactness holds "
            "in float32 (--dtype float32).")


class Sink:
    """An on_compile callback whose receiver changes: the loading status line, then the live progress."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, message: str) -> None:
        self.fn(message)


def warm_up(engine: Engine, args, n_prompts: int, log=None) -> float:
    """--warmup before the first step of a compiled run: the first bucket's graphs, or every bucket's;
    log(line) first says how many graphs now, how many later at most, and roughly how long."""
    if not args.compile:
        return 0.0
    top = engine.bucket_for(min(args.batch_size, n_prompts))
    low = top if args.warmup == "first" else 1
    now, per_graph = engine.compile_plan(top, low)
    later, _ = engine.compile_plan(top)
    if log is not None and now:
        rest = f"; up to {later - now} more, each when the run first reaches its bucket" if later > now else ""
        pace = (f"~{now * per_graph:.0f} s at {per_graph:.1f} s a graph, as these models compiled here last time"
                if per_graph else "no earlier compile of these models here: the first graph tells how long")
        log(f"compiling {now} graphs before the first step ({pace}){rest}")
    return engine.warmup(top, min_batch=low)


def compiled_line(graphs: list[tuple[str, float]]) -> str:
    """'compiled 7 graphs in 91 s: draft graph b=8 12.1 s, ...' (each graph's first run)."""
    return (f"compiled {len(graphs)} graphs in {sum(s for _, s in graphs):.0f} s: "
            + ", ".join(f"{name} {s:.1f} s" for name, s in graphs))


def make_engine(args, target, drafter, policy, max_seq: int, on_compile) -> Engine:
    return Engine(target, drafter, policy, batch_size=args.batch_size, max_seq=max_seq,
                  temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                  eos_ids=[] if args.ignore_eos else None, compile=args.compile, on_compile=on_compile)


def decode(engine: Engine, prompts, args, console: Console, writer, say: Sink):
    """engine.generate with a live progress line (and the cost-table rows being measured, or a graph
    compiled on the way, on it)."""
    if args.quiet:
        return engine.generate(prompts, args.max_new_tokens, on_finish=writer)
    with Live(console=console, refresh_per_second=4, transient=True) as live:
        say.fn = live.update
        engine.on_measure = lambda b, rho: live.update(f"measuring the cost table's row for bucket {b}: rho {rho:g} done")
        return engine.generate(prompts, args.max_new_tokens, on_finish=writer,
                               on_step=lambda s, rec: live.update(progress_line(s, rec)))


def progress_line(stats, rec) -> str:
    d = stats.as_dict()
    return (f"requests {stats.finished}/{stats.requests}  steps {stats.steps}  tokens {d['generated_tokens']}  "
            f"tok/s {d['tokens_per_second']:.1f}  tau {d['tau']:.2f}  keep {d['keep_ratio']:.2f}  "
            f"bucket {rec.bucket}  rho {rec.rho:g}")


def main(argv=None) -> int:
    args = parse_args(argv)
    return cli.run_reporting_errors(run, args, Console(stderr=args.quiet))


if __name__ == "__main__":
    sys.exit(main())
