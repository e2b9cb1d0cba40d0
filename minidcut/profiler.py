"""Measure complete speculative steps (draft + select + verify + accept) per (batch size, rho): the
numbers a cost table holds. Used by tools/profile.py and by api.cost_table, which measures the batch
sizes a run needs that its table lacks."""

from __future__ import annotations

import statistics
import time
from datetime import datetime, timezone

import torch

from .cost_model import CostTable
from .batch import Request
from .engine import Engine
from .policy import Policy


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def time_steps(engine: Engine, B: int, context_len: int, repeats: int = 10, warmup: int = 2,
               on_step=None) -> list[list[float]]:
    """Seconds of one step at batch size B for every rho of engine.policy.rhos, all B rows live at
    `context_len` tokens of random context: [n_rho][repeats]. rho = 0 is an AR step (no drafting).
    Positions do not advance, so every repeat sees the same context length. The rhos take turns (one
    step each, round after round), so a machine that slows down for a while slows every rho alike, not
    the one being timed then. on_step(rho) after every step, warm-up included."""
    dev, V = engine.device, engine.target.cfg.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, V, (B, context_len), generator=gen).tolist()
    anchor = engine.prefill(list(range(B)), [Request(i, p, 1) for i, p in enumerate(prompts)])
    anchor_pos = torch.full((B,), context_len, dtype=torch.long, device=dev)
    ids = torch.arange(B, device=dev)
    rhos, Ks = engine.policy.rhos, engine.budgets(B)

    def step(ri: int) -> float:
        _sync(dev)
        t0 = time.perf_counter()
        if Ks[ri] == 0:  # a step that skips drafting
            commit = engine.graph("verify", B, 0, kv=False)(anchor, anchor_pos, ids, None, None)[0]
        else:
            draft = engine.draft(anchor, anchor_pos, [engine.D] * B, B)  # syncs on rho*, as a real step
            commit = engine.graph("verify", B, Ks[ri])(anchor, anchor_pos, ids, draft.drafts, draft.keep_lens[ri])[0]
        commit.cpu()
        if on_step is not None:
            on_step(rhos[ri])
        return time.perf_counter() - t0

    for ri in range(len(rhos)):  # warm-up (and compilation) first, rho by rho
        for _ in range(warmup):
            step(ri)
    out = [[] for _ in rhos]
    for _ in range(repeats):
        for ri in range(len(rhos)):
            out[ri].append(step(ri))
    return out


def nondecreasing(xs: list[float]) -> list[float]:
    """The closest nondecreasing sequence (least squares: pool adjacent violators). Verifying more
    tokens never costs less, so a dip in measured medians is noise; it is averaged with its neighbours."""
    blocks: list[list[float]] = []  # [sum, count] per pooled block
    for x in xs:
        blocks.append([x, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, n = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += n
    return [s / n for s, n in blocks for _ in range(n)]


def measure(table: CostTable, target, drafter, batch_sizes: list[int], context_len: int, repeats: int = 10,
            warmup: int = 2, compile: bool = True, on_step=None) -> None:
    """Measure the rows of `batch_sizes` into `table` (for its rhos): median step seconds per rho, made
    nondecreasing in rho over the drafting steps (rho > 0; the raw medians and the spread go to the
    table's metadata). on_step(B, rho) after every step."""
    rhos = table.rhos
    policy = Policy("static", rhos, label="profile")  # every budget of the grid, no online state
    engine = Engine(target, drafter, policy, batch_size=max(batch_sizes), max_seq=context_len + drafter.block_size + 8,
                    compile=compile)
    n_ar = sum(r == 0.0 for r in rhos)  # the AR step (rho = 0) is another kind of step: left as is
    raw, spread = table.meta.setdefault("raw_seconds", {}), table.meta.setdefault("relative_spread", {})
    for B in batch_sizes:
        times = time_steps(engine, B, context_len, repeats, warmup,
                           on_step=(lambda rho, B=B: on_step(B, rho)) if on_step else None)
        medians = [statistics.median(t) for t in times]
        table.add_row(B, medians[:n_ar] + nondecreasing(medians[n_ar:]))
        raw[str(B)] = medians
        spread[str(B)] = [(max(t) - min(t)) / statistics.median(t) for t in times]
    table.meta.update(context_len=context_len, repeats=repeats,
                      date=datetime.now(timezone.utc).isoformat(timespec="seconds"))


def profile(target, drafter, batch_sizes: list[int], rhos: list[float], context_len: int, repeats: int = 10,
            warmup: int = 2, compile: bool = True, on_step=None, meta=None) -> CostTable:
    """A new cost table measured on this machine for every (batch size, rho)."""
    table = CostTable([], list(rhos), [], dict(meta or {}))
    measure(table, target, drafter, batch_sizes, context_len, repeats, warmup, compile, on_step)
    return table
