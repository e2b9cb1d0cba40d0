"""Measure complete speculative steps (draft + select + verify + accept) per (batch size, rho):
the numbers a cost table holds. Used by tools/profile.py, by the engine's quick start-up profile when
no table exists, and by the benchmark."""

from __future__ import annotations

import statistics
import time
from datetime import datetime, timezone

import torch

from .cost_model import CostTable, device_name
from .engine import Engine, Request
from .policy import Policy


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def time_steps(engine: Engine, context_len: int, repeats: int = 5, warmup: int = 2, on_step=None) -> list[list[float]]:
    """Seconds of one step for every rho of engine.policy.rhos, all B rows live at `context_len`
    tokens of random context: [n_rho][repeats]. rho = 0 is an AR step (no drafting). Positions do
    not advance, so every repeat sees the same context length. The rhos take turns (one step each,
    round after round), so a machine that slows down for a while slows every rho alike, not the
    one being timed then. on_step(rho) after every step, warm-up included."""
    B, dev, V = engine.B, engine.device, engine.target.cfg.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, V, (B, context_len), generator=gen).tolist()
    first = engine._prefill(list(range(B)), [Request(i, p, 1) for i, p in enumerate(prompts)])
    anchor = first.clone()
    anchor_pos = torch.full((B,), context_len, dtype=torch.long, device=dev)
    limit = torch.full((B,), engine.D, dtype=torch.long, device=dev)
    policy = engine.policy
    args = (policy.cost_vector(B, dev), torch.tensor(float(B), device=dev), torch.tensor(1.0, device=dev))

    def step(ri: int, K: int) -> float:
        _sync(dev)
        t0 = time.perf_counter()
        if K == 0:
            commit = engine.graph("verify", 0, kv=False)(anchor, anchor_pos, None, None)[0]  # a step that skips drafting
        else:
            drafts, keep_lens, rho_idx = engine.graph("draft")(anchor, anchor_pos, limit, *args)[:3]
            rho_idx.item()  # the real step's host sync
            commit = engine.graph("verify", K)(anchor, anchor_pos, drafts, keep_lens[ri])[0]
        commit.cpu()
        if on_step is not None:
            on_step(policy.rhos[ri])
        return time.perf_counter() - t0

    for ri, K in enumerate(engine.Ks):  # warm-up (and compilation) first, rho by rho
        for _ in range(warmup):
            step(ri, K)
    out = [[] for _ in engine.Ks]
    for _ in range(repeats):
        for ri, K in enumerate(engine.Ks):
            out[ri].append(step(ri, K))
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


def profile(target, drafter, batch_sizes: list[int], rhos: list[float], context_len: int,
            repeats: int = 5, warmup: int = 2, compile: bool = True, on_step=None, meta=None) -> CostTable:
    """A cost table measured on this machine: median step seconds for every (batch size, rho), made
    nondecreasing in rho over the drafting steps (rho > 0; the raw medians are kept in the metadata).
    on_step(B, rho) after every step."""
    rows, raw, spread = [], [], []
    max_seq = context_len + drafter.block_size + 8
    grid_policy = Policy("static", rhos) if len(rhos) > 1 else Policy.static(rhos[0])
    n_ar = sum(r == 0.0 for r in rhos)  # the AR step (rho = 0) is another kind of step: left as is
    for B in batch_sizes:
        engine = Engine(target, drafter, grid_policy, batch_size=B, max_seq=max_seq, compile=compile)
        times = time_steps(engine, context_len, repeats, warmup,
                           on_step=(lambda rho, B=B: on_step(B, rho)) if on_step else None)
        raw.append([statistics.median(t) for t in times])
        rows.append(raw[-1][:n_ar] + nondecreasing(raw[-1][n_ar:]))
        spread.append([(max(t) - min(t)) / statistics.median(t) for t in times])
    w = target.lm_head.weight
    info = {"device": device_name(w.device), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "dtype": str(w.dtype).replace("torch.", ""), "context_len": context_len, "repeats": repeats,
            "compiled": compile, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "raw_seconds": raw, "relative_spread": spread, **(meta or {})}
    return CostTable(list(batch_sizes), list(rhos), rows, info)
