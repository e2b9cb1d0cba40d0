"""The D-cut selector on real numbers: draft one batch with the demo drafter, then show the [B, D]
confidences, the prefix scores, what each rho keeps, gain / cost per rho and rho*, and what the target
then accepted (docs/method.md, "One D-cut step", run by hand in eager mode).

    python examples/selector_by_hand.py [--target DIR --drafter DIR] [--batch-size 6]
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from minidcut import Engine, Policy, load_pair, load_table, load_tokenizer  # noqa: E402
from minidcut import dcut  # noqa: E402
from minidcut.cost_model import CostTable  # noqa: E402
from minidcut.batch import Request  # noqa: E402

MODELS = Path(__file__).resolve().parent.parent / "models"
p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--target", default=str(MODELS / "llama-stdlib-4m"))
p.add_argument("--drafter", default=str(MODELS / "llama-stdlib-4m-dflash"))
p.add_argument("--prompts", default=str(MODELS / "prompts_heldout.jsonl"))
p.add_argument("--batch-size", type=int, default=6)
args = p.parse_args()
console = Console()

target, drafter, device, dtype = load_pair(args.target, args.drafter)
tok = load_tokenizer(args.target)
lines = [json.loads(x) for x in Path(args.prompts).read_text().splitlines() if x.strip()][: args.batch_size]
prompts = [x["input_ids"] if "input_ids" in x else tok.encode(x["prompt"], add_special_tokens=False) for x in lines]
B, D = len(prompts), drafter.block_size - 1
RHOS = [0.0, 0.25, 0.5, 0.75, 1.0]
max_seq = -(-(max(map(len, prompts)) + 2 * drafter.block_size) // 64) * 64
table, path = load_table(target, drafter, args.target, args.drafter, False, max_seq)  # what a run measured
if table.row(B, RHOS) is None:
    console.print(f"[yellow]no measured cost row for B = {B} at {path}: using an illustrative one[/]")
    table = CostTable([B], RHOS, [[1.0, 1.6, 2.2, 2.8, 3.4]], {"note": "illustrative, not measured"})
engine = Engine(target, drafter, Policy.dcut(table, RHOS), batch_size=B, max_seq=max_seq, eos_ids=[], compile=False)

with torch.inference_mode():
    # Prefill: every prompt into its row; the first generated token becomes the anchor.
    anchor = engine.runner.prefill(list(range(B)), [Request(i, pr, 1) for i, pr in enumerate(prompts)])
    anchor_pos = torch.tensor([len(pr) for pr in prompts], device=device)
    # Step 1: draft one block per row; c[i, k] = the drafter's probability of its own draft.
    logits = drafter(target, anchor, anchor_pos).float()  # [B, D, V] (V': a drafter's draft vocabulary)
    top, idx = logits.max(-1)
    drafts = drafter.tokens(idx)  # token ids
    conf = torch.exp(top - torch.logsumexp(logits, -1))  # [B, D]
    # Steps 2-5: prefix scores, global top-K per rho, keep_len, gain, cost, rho*.
    Ks = [dcut.budget(r, B, D) for r in RHOS]
    sel = dcut.select(conf, torch.full((B,), D, device=device), Ks)  # one global ranking for every rho
    log_s, keep = sel.log_s, sel.keep_lens  # [B, D], [n_rho, B]
    gain = engine.policy.committed(sel.gains, torch.tensor(float(B)), torch.tensor(1.0))  # expected committed tokens
    cost = torch.tensor(table.row(B, RHOS))
    best = int(engine.policy.choose(sel.gains, torch.tensor(float(B)), torch.tensor(1.0), cost))

t = Table(title="c[i, k] in %: drafter confidence of each draft (row = request, column = depth k)")
t.add_column("i")
for k in range(1, D + 1):
    t.add_column(str(k), justify="right")
for i in range(B):
    t.add_row(str(i), *[f"{100 * c:.0f}" for c in conf[i].tolist()])
console.print(t)
shown = best if Ks[best] else RHOS.index(0.5)  # at rho* = 0 nothing is kept: show rho = 0.5 instead
t = Table(title=f"s[i, k] = prod_{{j<=k}} c[i, j] in %; [bold green]green[/] = kept at rho = {RHOS[shown]:g}")
t.add_column("i")
for k in range(1, D + 1):
    t.add_column(str(k), justify="right")
for i in range(B):
    kl = int(keep[shown, i])
    t.add_row(str(i), *[f"[bold green]{100 * s:.0f}[/]" if k < kl else f"{100 * s:.0f}"
                        for k, s in enumerate(log_s[i].exp().tolist())])
console.print(t)
t = Table(title="every rho: K = round(rho * B * D), keep_len per request, gain / cost")
for c in ("rho", "K", "T = B + K", "keep_len", "gain (E committed)", "cost ms", "gain / cost", ""):
    t.add_column(c, justify="right")
for r, rho in enumerate(RHOS):
    t.add_row(f"{rho:g}", str(Ks[r]), str(B + Ks[r]), str(keep[r].tolist()), f"{gain[r]:.2f}",
              f"{cost[r] * 1e3:.2f}", f"{gain[r] / cost[r]:.1f}", "<- rho*" if r == best else "")
console.print(t)

# Steps 6-7: pack anchor + kept prefixes into T tokens, verify with the target, accept.
with torch.inference_mode():
    request_ids = torch.arange(B, device=device)  # the sampling keys (unused when greedy)
    commit, n_commit, _, _ = engine.runner.graph("verify", B, Ks[shown])(anchor, anchor_pos, request_ids, drafts, keep[shown])
t = Table(title=f"verification at rho = {RHOS[shown]:g}" + (" (rho*)" if shown == best else " (rho* = 0 would verify "
          "anchors only)") + ": accepted drafts (+1 bonus) per request")
for c in ("i", "keep_len", "accepted", "committed text"):
    t.add_column(c)
for i in range(B):
    n = int(n_commit[i])
    t.add_row(str(i), str(int(keep[shown, i])), str(n - 1), repr(tok.decode(commit[i, :n].tolist())))
console.print(t)
