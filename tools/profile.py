"""Build a whole cost table: median seconds of one complete speculative step (draft + select + verify +
accept; rho = 0 is an AR step without drafting) for every (batch size, rho), on this machine, for one
(target, drafter, dtype, threads, compiled or eager, cache positions). Drafting steps' medians are made
nondecreasing in rho (a dip is noise; the raw medians stay in the metadata). Written under
compile_cache/cost_tables/, where a greedy dcut run with the same settings finds it (its fingerprint).
Cache positions: a compiled table serves every run of its size class (cost_model.size_class: 256, 512,
1024, ...; generate and bench size a compiled run's cache to the class of its longest prompt + new
tokens + a block), an eager one every run whose positions round up to the same multiple of 64.
Runs need no such table: they measure the rows they reach (profiler.measure_live); this one measures
every row and rho, with more repeats.

    python tools/profile.py --target models/llama-stdlib-4m --drafter models/llama-stdlib-4m-dflash
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# Run as a script: import from the repo root, and never let tools/profile.py shadow the stdlib module.
if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from rich.console import Console  # noqa: E402
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: E402
from rich.table import Table  # noqa: E402

from minidcut import cli, runtime  # noqa: E402
from minidcut.api import load_pair, parse_rhos, run_fingerprint  # noqa: E402
from minidcut.cost_model import CostTable, seq_class, size_class, table_path  # noqa: E402
from minidcut.engine import Engine  # noqa: E402
from minidcut.policy import Policy  # noqa: E402
from minidcut.profiler import measure  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="target model directory (HF layout)")
    p.add_argument("--drafter", required=True, help="DFlash drafter directory")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32,64",
                   help="comma-separated batch sizes to profile (default: %(default)s)")
    p.add_argument("--rhos", default="0,0.25,0.5,0.75,1", help="rho grid, 0 an AR step (default: %(default)s)")
    p.add_argument("--max-seq", type=int, default=None,
                   help="cache positions of the runs the table is for, rounded up to their class (compiled: "
                        "256, 512, 1024, ...; eager: a multiple of 64); default: the class that holds "
                        "--context-len and a draft block")
    p.add_argument("--context-len", type=int, default=128,
                   help="context tokens per request while timing, below --max-seq (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=10, help="timed steps per cell, median kept (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per cell first (default: %(default)s)")
    cli.add_runtime_args(p)
    p.add_argument("--out", default=None, help="output JSON (default: the table the dcut policy looks for)")
    return p.parse_args(argv)


def print_table(console: Console, table) -> None:
    fp = table.meta.get("fingerprint", {})
    t = Table(title=f"cost table: ms per step ({fp.get('device')}, {fp.get('dtype')}, "
                    f"{'compiled' if fp.get('compiled') else 'eager'}, context {table.meta.get('context_len')})")
    t.add_column("B", justify="right")
    for r in table.rhos:
        t.add_column(f"rho={r:g}", justify="right")
    t.add_column("full / AR", justify="right")
    for B, row in zip(table.batch_sizes, table.seconds):
        t.add_row(str(B), *[f"{s * 1e3:.2f}" for s in row], f"{row[-1] / row[0]:.2f}x")
    console.print(t)


def cache_positions(context_len: int, max_seq: int | None, compile: bool) -> int:
    """The table's cache positions: --max-seq (default: the context, a draft block and the bonus)
    rounded up to its class (compiled: cost_model.size_class; eager: a multiple of 64); UserError if
    the context leaves no room for a draft block."""
    need = context_len + 33
    positions = size_class(max_seq or need) if compile else seq_class(max_seq or need)
    if need > positions:
        raise cli.UserError(f"--context-len {context_len} leaves no room for a draft block in --max-seq {positions}")
    return positions


def run(args, console: Console) -> int:
    batch_sizes = cli.parse_batch_sizes(args.batch_sizes)
    cli.check_positive(args, "context_len", "repeats", "max_seq")
    cli.check_runtime_args(args)
    if args.warmup < 0:
        raise cli.UserError(f"--warmup must be >= 0, got {args.warmup}")
    rhos = parse_rhos(args.rhos)
    args.max_seq = cache_positions(args.context_len, args.max_seq, args.compile)
    cli.check_writable(args.out, "--out")
    runtime.setup(args.threads)
    target, drafter, device, dtype = load_pair(args.target, args.drafter, args.dtype, args.device, args.drafter_dtype,
                                                   pack=not args.compile)
    fp = run_fingerprint(target, drafter, args.target, args.drafter, args.compile, args.max_seq)
    out = Path(args.out) if args.out else table_path(fp, args.target, args.drafter)
    # One engine at the largest batch size: its caches and graphs serve every row, as in a run.
    engine = Engine(target, drafter, Policy("static", rhos, label="profile"), batch_size=max(batch_sizes),
                    max_seq=args.max_seq, compile=args.compile)
    table = CostTable([], rhos, [], {"target": str(args.target), "drafter": str(args.drafter), "fingerprint": fp})
    t0 = time.time()
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("profiling", total=len(batch_sizes) * len(rhos) * (args.warmup + args.repeats))
        measure(table, engine, batch_sizes, args.context_len, args.repeats, args.warmup,
                on_step=lambda B, rho: bar.update(task, advance=1, description=f"profiling B={B} rho={rho:g}"))
    table.meta["wall_seconds"] = round(time.time() - t0, 1)
    table.save(out)
    print_table(console, table)
    console.print(f"wrote {out} in {table.meta['wall_seconds']:.0f} s")
    return 0


def main(argv=None) -> int:
    return cli.run_reporting_errors(run, parse_args(argv), Console())


if __name__ == "__main__":
    sys.exit(main())
