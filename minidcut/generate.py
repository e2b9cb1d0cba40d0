"""python -m minidcut.generate: batched generation with a target, a DFlash drafter and a policy.

With no arguments it runs the shipped demo pair (models/) on a few built-in code prompts with the
adaptive `dcut` policy.
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

from .api import build_policy, load_pair, load_tokenizer
from .config import ConfigError
from .cost_model import CostTableError
from .engine import Engine
from .loader import CheckpointError

MODELS = Path(__file__).resolve().parent.parent / "models"
DEFAULT_TARGET = MODELS / "llama-stdlib-4m"
DEFAULT_DRAFTER = MODELS / "llama-stdlib-4m-dflash"
BUILTIN_PROMPTS = [
    "def is_prime(n):\n    \"\"\"Return True if n is a prime number.\"\"\"\n",
    "class Stack:\n    def __init__(self):\n",
    "import os\n\n\ndef list_python_files(root):\n",
    "def read_lines(path, encoding='utf-8'):\n",
]


class UserError(Exception):
    """A mistake in the command line or its inputs: printed as one line, exit status 2."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m minidcut.generate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", default=str(DEFAULT_TARGET), help="target model directory (HF layout)")
    p.add_argument("--drafter", default=None,
                   help="DFlash drafter directory (z-lab layout); default: the shipped demo drafter "
                        "when --target is the default; not used by --policy ar")
    p.add_argument("--policy", default="dcut", choices=["ar", "full", "static", "dcut"],
                   help="ar: no drafting; full: verify all D drafts; static: fixed --rho; dcut: rho "
                        "chosen per step from the cost table")
    p.add_argument("--rho", type=float, default=None, help="budget ratio for --policy static, in [0, 1]")
    p.add_argument("--rhos", default="0,0.25,0.5,0.75,1", help="rho grid of --policy dcut")
    p.add_argument("--gain", default="committed", choices=["committed", "accepted"],
                   help="dcut gain: expected committed tokens (anchors counted) or accepted drafts only "
                        "(the paper's reference code)")
    p.add_argument("--no-calibrate", action="store_true",
                   help="dcut: no online calibration (raw drafter confidences, the cost table as profiled)")
    p.add_argument("--no-skip-drafting", action="store_true", help="dcut: always draft")
    p.add_argument("--cost-table", default=None, help="cost table JSON (default: the one tools/profile.py "
                   "wrote for this device/target/drafter/dtype under compile_cache/cost_tables/)")
    p.add_argument("--batch-size", type=int, default=4, help="max concurrent requests B")
    p.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable)")
    p.add_argument("--prompts", default=None, help='JSONL file: {"prompt": "..."} or {"input_ids": [...]} per line')
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="always generate max-new-tokens")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")
    comp = p.add_mutually_exclusive_group()
    p.set_defaults(compile=None)
    comp.add_argument("--compile", dest="compile", action="store_true", default=argparse.SUPPRESS,
                      help="torch.compile the decode graphs (default, except the demo pair on a CPU)")
    comp.add_argument("--no-compile", dest="compile", action="store_false", default=argparse.SUPPRESS,
                      help="run eagerly. The default for the shipped demo pair on a CPU: compiling its graphs "
                           "takes ~30-90 s each on a 2-core machine, longer than the whole demo")
    p.add_argument("--output", default=None, help="write one JSON line per request, in input order")
    p.add_argument("--stats", default=None, help="write the run's statistics as JSON")
    p.add_argument("--quiet", action="store_true", help="no live view, no summary, no completions")
    return p.parse_args(argv)


def read_prompts(args, tokenizer) -> list[list[int]]:
    """Token ids of every prompt, from --prompt, --prompts or the built-in set."""
    items: list = []
    if args.prompts:
        path = Path(args.prompts)
        if not path.is_file():
            raise UserError(f"--prompts file {path} not found")
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{n}: not valid JSON ({e})") from None
            if isinstance(obj, dict) and isinstance(obj.get("input_ids"), list):
                items.append([int(t) for t in obj["input_ids"]])
            elif isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
                items.append(obj["prompt"])
            else:
                raise UserError(f'{path}:{n}: expected {{"prompt": "..."}} or {{"input_ids": [...]}}')
        if not items:
            raise UserError(f"--prompts file {path} has no prompts")
    items += args.prompt or []
    if not items:
        items = list(BUILTIN_PROMPTS)
    ids = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            if item == "":
                raise UserError(f"prompt {i} is empty")
            if tokenizer is None:
                raise UserError(f"{args.target} has no tokenizer: give prompts as input_ids in a --prompts file")
            item = tokenizer.encode(item, add_special_tokens=False)
        ids.append(item)
    return ids


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


def run(args, console: Console) -> int:
    if args.drafter is None and args.policy != "ar" and Path(args.target).resolve() == DEFAULT_TARGET.resolve():
        args.drafter = str(DEFAULT_DRAFTER)
    if args.policy != "ar" and args.drafter is None:
        raise UserError(f"--policy {args.policy} needs --drafter")
    if args.policy == "static" and args.rho is None:
        raise UserError("--policy static needs --rho")
    if args.rho is not None and not 0.0 <= args.rho <= 1.0:
        raise UserError(f"--rho must be in [0, 1], got {args.rho}")
    if args.batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {args.batch_size}")
    for flag, out in (("--output", args.output), ("--stats", args.stats)):
        if out and not Path(out).resolve().parent.is_dir():
            raise UserError(f"{flag} {out}: directory {Path(out).resolve().parent} does not exist")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise UserError("--temperature must be >= 0 and --top-p in (0, 1]")
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    if args.compile is None:
        demo = Path(args.target).resolve() == DEFAULT_TARGET.resolve()
        on_cpu = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cpu")
        args.compile = not (demo and on_cpu)
    target, drafter, device, dtype = load_pair(args.target, args.drafter if args.policy != "ar" else None,
                                               args.dtype, args.device)
    tokenizer = load_tokenizer(args.target)
    prompts = read_prompts(args, tokenizer)
    longest = max(len(p) for p in prompts)
    block = drafter.block_size if drafter else 1
    if longest + args.max_new_tokens + block > target.cfg.max_position_embeddings:
        raise UserError(f"prompt ({longest} tokens) + --max-new-tokens {args.max_new_tokens} exceed the "
                        f"target's context of {target.cfg.max_position_embeddings} positions")
    max_seq = longest + args.max_new_tokens + block + 1
    policy = build_policy(args.policy, args.rho, args.rhos, args.gain, not args.no_calibrate,
                          not args.no_skip_drafting, target, drafter, args.target, args.drafter,
                          args.batch_size, max_seq, args.cost_table, args.compile,
                          log=None if args.quiet else console.print)
    eos = [] if args.ignore_eos else None
    engine = Engine(target, drafter, policy, batch_size=args.batch_size, max_seq=max_seq,
                    temperature=args.temperature, top_p=args.top_p, eos_ids=eos, compile=args.compile)
    if not args.quiet:
        console.print(f"loaded in {time.perf_counter() - t0:.1f} s: {args.target}"
                      + (f" + {args.drafter}" if drafter else "") + f" ({dtype}, {device}); "
                      f"{len(prompts)} requests, policy {policy.label}, B = {args.batch_size}"
                      + ("; the first steps compile" if args.compile else "; eager (pass --compile to compile)"))
    if args.quiet:
        outputs, stats = engine.generate(prompts, args.max_new_tokens)
    else:
        def view(stats, rho):
            d = stats.as_dict()
            return (f"requests {stats.finished}/{stats.requests}  steps {stats.steps}  tokens {d['generated_tokens']}  tok/s {d['tokens_per_second']:.1f}  "
                    f"tau {d['tau']:.2f}  keep {d['keep_ratio']:.2f}  rho {rho:g}")
        with Live(console=console, refresh_per_second=4, transient=True) as live:
            outputs, stats = engine.generate(prompts, args.max_new_tokens,
                                             on_step=lambda s, rho: live.update(view(s, rho)))
    if args.output:
        with open(args.output, "w") as f:
            for i, out in enumerate(outputs):
                rec = {"index": i, "output_ids": out}
                if tokenizer is not None:
                    rec["text"] = tokenizer.decode(out)
                f.write(json.dumps(rec) + "\n")
    if args.stats:
        Path(args.stats).write_text(json.dumps(stats.as_dict(), indent=1) + "\n")
    if not args.quiet:
        if tokenizer is not None:
            for p, out in list(zip(prompts, outputs))[:4]:
                console.rule()
                console.print(tokenizer.decode(p) + tokenizer.decode(out), markup=False, highlight=False)
            console.rule()
        console.print(summary_table(stats))
    return 0


USER_ERRORS = (UserError, ConfigError, CheckpointError, CostTableError, ValueError)


def run_reporting_errors(run_fn, args, console: Console) -> int:
    """Run a CLI body; a user mistake becomes one `error:` line on stderr and exit status 2."""
    try:
        return run_fn(args, console)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def main(argv=None) -> int:
    args = parse_args(argv)
    return run_reporting_errors(run, args, Console(stderr=args.quiet))


if __name__ == "__main__":
    sys.exit(main())
