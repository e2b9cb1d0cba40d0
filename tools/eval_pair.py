"""Evaluate a target + drafter pair on held-out prompts at full depth (greedy): tau, the per-depth
acceptance curve P(accepted >= k), and whether the drafter's confidences carry signal (Spearman
correlation between a request-step's expected accepted length sum_k s[i, k] and what it realized).
When the prompts carry a "domain" field (tools/prompt_sources.py), each domain is reported too.

    python tools/eval_pair.py --target models/llama-stdlib-4m --drafter models/llama-stdlib-4m-dflash
    python tools/eval_pair.py --target models/smollm2-135m-instruct --drafter models/smollm2-135m-instruct-dflash \
        --prompts models/prompts_mix_heldout.jsonl --chat --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# Run as a script: import from the repo root, and never let tools/profile.py shadow the stdlib module.
if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from minidcut import Engine, Policy, cli, load_pair, load_tokenizer, runtime  # noqa: E402

MODELS = Path(__file__).resolve().parent.parent / "models"


def ranks(x: np.ndarray) -> np.ndarray:
    """Ranks with ties averaged (for Spearman's rho)."""
    order = np.argsort(x, kind="stable")
    r = np.empty(len(x))
    r[order] = np.arange(len(x))
    for v in np.unique(x):
        m = x == v
        r[m] = r[m].mean()
    return r


def spearman(a, b) -> float:
    ra, rb = ranks(np.asarray(a, float)), ranks(np.asarray(b, float))
    return float(np.corrcoef(ra, rb)[0, 1])


def summarize(committed: int, request_steps: int, s: np.ndarray, acc: np.ndarray, block_size: int,
              n_prompts: int, max_new_tokens: int) -> dict:
    """The metrics of one run (or of several runs pooled): s [request-steps, D] prefix scores, acc
    [request-steps] accepted drafts."""
    D = s.shape[1]
    return {"tau": committed / max(request_steps, 1), "request_steps": int(len(acc)), "block_size": block_size,
            "p_accept_depth": [float((acc >= k).mean()) for k in range(1, D + 1)],
            "mean_accepted_drafts": float(acc.mean()),
            "mean_expected_accepted": float(s.sum(1).mean()),
            "spearman_prefix_score_vs_accepted": spearman(s.sum(1), acc),
            "prompts": n_prompts, "max_new_tokens": max_new_tokens}


def evaluate(target, drafter, prompts, batch_size: int, max_new_tokens: int, compile: bool,
             domains: list[str] | None = None) -> dict:
    """The metrics over all prompts; with `domains` (one per prompt) also per domain, under "domains":
    each domain is generated on its own, and the overall numbers pool the domains' request-steps."""
    groups = {None: list(range(len(prompts)))} if domains is None else {}
    for i, d in enumerate(domains or []):
        groups.setdefault(d, []).append(i)
    max_seq = max(map(len, prompts)) + max_new_tokens + drafter.block_size + 1
    engine = Engine(target, drafter, Policy.full(), batch_size=batch_size, max_seq=max_seq, compile=compile)
    runs = {}
    for d, idx in groups.items():
        _, stats = engine.generate([prompts[i] for i in idx], max_new_tokens, trace=True)
        s = torch.cat([t[0] for t in stats.trace]).numpy()  # [request-steps, D] prefix scores
        acc = torch.cat([t[2] for t in stats.trace]).numpy()  # [request-steps] accepted drafts
        runs[d] = (stats.committed, stats.request_steps, s, acc, len(idx))
    pooled = [sum(r[0] for r in runs.values()), sum(r[1] for r in runs.values()),
              np.concatenate([r[2] for r in runs.values()]), np.concatenate([r[3] for r in runs.values()])]
    res = summarize(*pooled, drafter.block_size, len(prompts), max_new_tokens)
    if domains is not None:
        res["domains"] = {d: summarize(c, n, s, acc, drafter.block_size, k, max_new_tokens)
                          for d, (c, n, s, acc, k) in runs.items()}
    return res


def prompt_domains(path: str, names: list[str]) -> list[str] | None:
    """Each prompt's "domain" field (found by its "file:line" name, cli.read_prompts), "none" where a line
    has none; None when no line has one."""
    lines = cli.prompt_file_lines(path)  # numbered as cli.read_prompts numbers them
    out = []
    for name in names:
        d = json.loads(lines[int(name.rsplit(":", 1)[1]) - 1]).get("domain")
        out.append(d if isinstance(d, str) else "none")
    return out if any(d != "none" for d in out) else None


def domain_table(res: dict) -> Table:
    t = Table("domain", "prompts", "request-steps", "tau", "P(acc>=1)", "Spearman")
    for name, r in [*sorted(res["domains"].items()), ("overall", res)]:
        t.add_row(name, str(r["prompts"]), str(r["request_steps"]), f"{r['tau']:.3f}",
                  f"{r['p_accept_depth'][0]:.3f}", f"{r['spearman_prefix_score_vs_accepted']:.2f}")
    return t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=str(MODELS / "llama-stdlib-4m"))
    p.add_argument("--drafter", default=str(MODELS / "llama-stdlib-4m-dflash"))
    p.add_argument("--prompts", default=str(MODELS / "prompts_heldout.jsonl"))
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    cli.add_chat_arg(p)
    p.add_argument("--drafter-dtype", default=None, help="the drafter's dtype (default: the target's)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when there is one)")
    p.add_argument("--dtype", default=None, help="the target's dtype (default: bfloat16 on CUDA, float32 on a CPU)")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--output", default=None, help="JSON results")
    args = p.parse_args(argv)
    runtime.setup(args.threads)
    target, drafter, _, _ = load_pair(args.target, args.drafter, args.dtype, args.device,
                                     drafter_dtype=args.drafter_dtype)
    tok = load_tokenizer(args.target)
    prompts, names = cli.read_prompts(args.prompts, None, tok, cli.parse_chat(args.chat), args.target)
    domains = prompt_domains(args.prompts, names)
    res = evaluate(target, drafter, prompts, args.batch_size, args.max_new_tokens, args.compile, domains)
    res["chat"], res["drafter_dtype"] = args.chat, str(drafter.fc.weight.dtype)
    console = Console()
    console.print_json(json.dumps(res))
    if domains is not None:
        console.print(domain_table(res))
    if args.output:
        Path(args.output).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
