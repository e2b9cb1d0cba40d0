"""Measure complete speculative steps (draft + select + verify + accept; rho = 0 an AR step without
drafting) per (bucket, rho): the numbers a cost table holds (cost_model.py). Every timed step runs on the
engine of the run, so it reads the same caches at the same positions through the same graphs.

measure_row   a run's first step at a bucket whose row is missing (Engine.step), if worth_measuring:
              measure_live, then the row goes into the table and the policy learns from the timed
              drafting steps.
measure_live  each rho timed on the live rows
              themselves. Positions do not advance and nothing is emitted: what a timed step writes
              into the caches lies at or past each row's anchor, which the next real step writes again
              before anything reads it, so the output is unchanged. Rhos go up from the smallest; the
              row stops where a larger budget could not beat the best rate measured so far even if
              it accepted every draft it can keep, since costs only grow with rho. The rest stay
              unmeasured (inf: never chosen). Not this step's confidences: one step's are a noisy
              guess (a first step after the prompt is often unsure), and a rho left out is never
              chosen. The AR step (rho = 0) is timed first, for that bound, and again last, for its
              entry, after AR_RUN untimed AR steps: AR steps that follow other work run slow (on a
              CPU the demo's first timed AR steps at B = 4 took 7.7, 5.3, 5.1 ms, and 5.6, 5.3, 5.0 right
              after the drafting cells, where AR steps in a run of them take 4.1-4.3), and while
              drafting is on no loop step refines the AR entry: one timed out of a run would make
              every drafting step look up to a quarter cheaper against AR than it is (skipping.py
              compares them).
measure       tools/profile.py: whole rows on random context, the rhos taking turns.
"""

from __future__ import annotations

import math
import statistics
import time
from datetime import datetime, timezone

import torch

from .batch import Request
from .cost_model import CostTable
from .dcut import most_committed
from .graphs import REPLAYED
from .policy import StepPlan, StepRecord

LIVE_SAMPLES, LIVE_SECONDS = 3, 0.2  # measure_live times a cell up to 3 times while that stays under 0.2 s
AR_RUN = 5  # untimed AR steps before the AR entry is timed: a run of them, as when drafting is off


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


def timed_step(engine, anchor, anchor_pos, last, ids, live: list[bool], ri: int, reach: int):
    """Seconds of one step at the grid's rho index ri on rows [0, b) that advances nothing
    (runner.Runner.dry_step), its Draft (None for K = 0) and its committed tokens per row n_commit [b];
    reach: one past the furthest live anchor (the attention span follows it)."""
    if anchor.device.type == "cuda":
        torch.cuda.synchronize(anchor.device)
    t0 = time.perf_counter()
    draft, n_commit = engine.runner.dry_step(anchor, anchor_pos, last, ids, live, ri, reach)
    return time.perf_counter() - t0, draft, n_commit


@torch.inference_mode()
def measure_live(engine, anchor, anchor_pos, last, ids, live: list[int], reach: int, repeats: int = 1,
                 on_step=None) -> tuple[list[float], list[int], list[tuple[float, float, int]]]:
    """The cost row [n_rho] of bucket b = len(anchor) measured on these live rows (module docstring):
    per rho one untimed step unless its graphs already replay, then the median of `repeats` timed steps,
    or of up to LIVE_SAMPLES while they take less than LIVE_SECONDS (cheap steps are noisy). Also
    the timed steps behind each entry, and what each drafting rho's step would have done, (rho,
    expected accepted drafts, accepted drafts)
    over the live rows (their indices): real acceptance the policy can learn from. reach: one past
    the furthest live anchor. on_step(b, rho) after every step."""
    b, rhos, policy, n_live = anchor.shape[0], engine.policy.rhos, engine.policy, len(live)
    mask = [i in live for i in range(b)]
    Ks = engine.runner.budgets(b)
    seen, samples = [], [0] * len(rhos)

    def cell(ri: int, run: int = 0) -> float:
        runs = engine.runner.runs(b, Ks[ri])  # compiled: run until it replays; eager: once, to allocate
        warm = max(run, REPLAYED - runs if engine.compile else int(runs == 0))
        for _ in range(warm):
            timed_step(engine, anchor, anchor_pos, last, ids, mask, ri, reach)
        steps = []
        while len(steps) < repeats or (len(steps) < LIVE_SAMPLES and sum(s[0] for s in steps) < LIVE_SECONDS):
            steps.append(timed_step(engine, anchor, anchor_pos, last, ids, mask, ri, reach))
        _, draft, n_commit = steps[-1]
        if draft is not None:
            seen.append((rhos[ri], float(draft.gain[ri]), int(n_commit[live].sum()) - len(live)))
        if on_step is not None:
            on_step(b, rhos[ri])
        samples[ri] = len(steps)
        return statistics.median(s[0] for s in steps)

    row = [math.inf] * len(rhos)
    drafting = [ri for ri, K in enumerate(Ks) if K > 0]
    for ri in (ri for ri, K in enumerate(Ks) if K == 0):
        row[ri] = cell(ri)
    if not drafting:
        return row, samples, seen
    gain = engine.runner.draft(anchor, anchor_pos, last, mask, StepPlan.neutral(len(rhos)),
                               engine.runner.draft_span(reach)).gain.tolist()
    scale = torch.tensor(policy.calibration.gain_scale)
    rate = [float(policy.committed(torch.tensor(g), torch.tensor(float(n_live)), scale)) for g in gain]
    best = max((rate[ri] / row[ri] for ri in range(len(rhos)) if Ks[ri] == 0), default=0.0)
    # Drafts a step at this bucket could keep with these live rows: the row serves every later step at
    # the bucket, so not these rows' remaining tokens (near their end a row can emit few drafts).
    ceiling = most_committed(max(Ks), n_live, n_live * engine.D)  # in tokens: above the objective's bound
    for ri in drafting:
        row[ri] = cell(ri)
        best = max(best, rate[ri] / row[ri])
        if ceiling / row[ri] <= best and ri != drafting[-1]:
            break  # no larger budget can win: it costs at least row[ri] and commits at most the ceiling
    for ri in (ri for ri, K in enumerate(Ks) if K == 0):  # again, in a run: the entry nothing refines while drafting is on
        row[ri] = cell(ri, run=AR_RUN)
    measured = [ri for ri in drafting if not math.isinf(row[ri])]
    for ri, x in zip(measured, nondecreasing([row[ri] for ri in measured])):
        row[ri] = x
    return row, samples, seen


def worth_measuring(table: CostTable, rhos: list[float], b: int, steps_left: int) -> bool:
    """Whether measuring bucket b's row can pay for itself in this run. measure_live times each rho
    about 1 + LIVE_SAMPLES times (an untimed run, then up to LIVE_SAMPLES), so it takes about that many
    times the row's seconds summed; the live rows have at most steps_left AR steps left. If measuring
    takes longer than those, no speedup can win it back (a batch's tail: its last rows). Both are
    priced at the nearest larger bucket the table has, which overestimates each; without one (a
    run's first bucket) or an AR entry (rho = 0 not in the grid), measure."""
    larger = [B for B in table.batch_sizes if B > b]
    if not larger or 0.0 not in rhos:
        return True
    row = table.row(min(larger), rhos)
    measuring = (1 + LIVE_SAMPLES) * sum(c for c in row if not math.isinf(c))
    return steps_left * row[rhos.index(0.0)] > measuring


def measure_row(engine, batch, b: int) -> tuple[list[float], list[int], list[StepRecord]]:
    """The engine's policy's missing cost row at bucket b [n_rho], measured on the batch's live rows
    (their outputs and positions are left as they were), the timed steps behind each entry, and what
    the timed drafting steps would have accepted, as records for the policy to learn from (no seconds:
    they are not the loop's; marked timed: the skip decision waits for the loop's own steps)."""
    engine.runner.catch_up_batch(batch)  # drafting steps need the drafter's whole context
    rows = batch.live
    row, samples, seen = measure_live(engine, batch.anchor[:b], batch.anchor_pos[:b], batch.last[:b],
                                      batch.request_ids[:b], rows, batch.reach, on_step=engine.on_measure)
    usable = batch.usable(engine.D)
    return row, samples, [StepRecord(bucket=b, n_live=len(rows), drafted=True, rho=rho, predicted=predicted,
                                     accepted=accepted, usable=usable, timed=True) for rho, predicted, accepted in seen]


@torch.inference_mode()
def time_steps(engine, B: int, context_len: int, repeats: int = 10, warmup: int = 2,
               on_step=None) -> list[list[float]]:
    """Seconds of one step at bucket B for every rho of engine.policy.rhos, all B rows live at
    `context_len` tokens of random context: [n_rho][repeats]. The rhos take turns (one step each,
    round after round), so a machine that slows down for a while slows every rho alike, not the one
    being timed then. on_step(rho) after every step, warm-up included."""
    dev, V, D = engine.device, engine.target.cfg.vocab_size, engine.D
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, V, (B, context_len), generator=gen).tolist()
    anchor = engine.runner.prefill(list(range(B)), [Request(i, p, 1) for i, p in enumerate(prompts)])
    anchor_pos = torch.full((B,), context_len, dtype=torch.long, device=dev)
    last = anchor_pos + D + 1  # every row may draft a whole block
    ids = torch.arange(B, device=dev)
    rhos = engine.policy.rhos

    def step(ri: int) -> float:
        seconds = timed_step(engine, anchor, anchor_pos, last, ids, [True] * B, ri, context_len + 1)[0]
        if on_step is not None:
            on_step(rhos[ri])
        return seconds

    for ri in range(len(rhos)):  # warm-up (and compilation) first, rho by rho
        for _ in range(warmup):
            step(ri)
    out = [[] for _ in rhos]
    for _ in range(repeats):
        for ri in range(len(rhos)):
            out[ri].append(step(ri))
    return out


def measure(table: CostTable, engine, batch_sizes: list[int], context_len: int, repeats: int = 10,
            warmup: int = 2, on_step=None) -> None:
    """Measure the rows of `batch_sizes` into `table` with `engine` (its policy's grid must be the
    table's): median step seconds per rho, made nondecreasing in rho over the drafting steps (rho > 0;
    the raw medians and the spread go to the table's metadata). on_step(B, rho) after every step."""
    n_ar = sum(r == 0.0 for r in table.rhos)  # the AR step (rho = 0) is another kind of step: left as is
    raw, spread = table.meta.setdefault("raw_seconds", {}), table.meta.setdefault("relative_spread", {})
    for B in batch_sizes:
        times = time_steps(engine, B, context_len, repeats, warmup,
                           on_step=(lambda rho, B=B: on_step(B, rho)) if on_step else None)
        medians = [statistics.median(t) for t in times]
        table.add_row(B, medians[:n_ar] + nondecreasing(medians[n_ar:]), repeats)
        raw[str(B)] = medians
        spread[str(B)] = [(max(t) - min(t)) / statistics.median(t) for t in times]
    table.meta.update(context_len=context_len, repeats=repeats,
                      date=datetime.now(timezone.utc).isoformat(timespec="seconds"))
