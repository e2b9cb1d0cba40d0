"""The engine: continuous batching over up to batch_size cache rows, one speculative step at a time.

    step:  admit -> bucket -> plan -> draft + select + rho* -> verify + accept -> commit -> observe

admit     waiting requests take free rows (one prefill); the step runs at the smallest batch bucket b
          that holds the live rows (rows are compacted when the bucket can shrink)
plan      the policy says whether this step drafts and with which costs and gain scale (Policy.plan).
          The first step at a bucket whose cost row is missing measures it on the live rows first
          (profiler.measure_row; outputs untouched)
draft     usually the draft the previous step made ahead (Batch.take_ahead); a fresh one when a row
          changed hands or the bucket changed: drafter block -> confidences -> dcut.select (prefix
          scores, keep_len and gain of every rho) -> rho* = Policy.choose, its pick sent to the host
verify    the verify graph of (b, K(rho*)): anchor + kept prefix of every row, packed into T = b + K
          tokens -> target forward -> accept -> commit; then, unless the step is a probe, the next
          step's block is drafted with this step's plan (runner.py, "The draft made ahead")
commit    each request gets its committed tokens; finished requests free their rows
observe   one StepRecord to the policy (calibration, the cost table's entry, skip drafting)

The device side (caches, graphs, prefill, row moves, catch-up, spans, the one copy each way) is the
runner's (runner.py), which returns its seconds by part with the step (stats.RunSeconds);
stats.StepClock frames them. `ar` runs the verify graph with K = 0 (one token per row) and never drafts.
docs/walkthrough.md follows one step through this file.
"""

from __future__ import annotations

import collections
import time

import torch

from . import profiler
from .batch import Batch, Request, batch_buckets
from .graphs import REPLAYED
from .layers import is_packed
from .model import Transformer
from .policy import Policy, StepPlan, StepRecord
from .runner import Ran, Runner
from .stats import StepClock, Stats


class Engine:
    """Batched generation with one target, an optional DFlash drafter and a policy (policy.py)."""

    def __init__(self, target: Transformer, drafter=None, policy: Policy | None = None, batch_size: int = 8,
                 max_seq: int = 512, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                 eos_ids=None, compile: bool = True, on_compile=None):
        self.target, self.policy = target, policy or Policy.ar()
        if self.policy.needs_drafter and drafter is None:
            raise ValueError(f"policy {self.policy.label!r} needs a drafter")
        self.drafter = drafter if self.policy.needs_drafter else None
        if compile and is_packed(target, self.drafter):
            raise ValueError("weights packed for eager CPU matmuls cannot be compiled: load with pack=False")
        self.batch_size, self.max_seq, self.buckets = batch_size, max_seq, batch_buckets(batch_size)
        self.eos = set(target.cfg.eos_token_ids if eos_ids is None else eos_ids)
        self.compile = compile
        # on_compile(message) before a graph compiles
        self.runner = Runner(target, self.drafter, self.policy, batch_size, max_seq, temperature, top_p, seed,
                             compile, on_compile)
        self.block, self.device = self.runner.block, self.runner.device
        self.D = self.block - 1  # drafts per block
        self.policy.depth = self.D
        self.on_measure = None  # on_measure(bucket, rho) while a missing cost row is measured

    # ---- the decode loop -------------------------------------------------------------------------

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int | list[int], on_finish=None, on_step=None,
                 trace: bool = False):
        """Generate for every prompt (max_new_tokens: one for all, or one per prompt) with at most
        batch_size at a time; returns (outputs in input order, Stats). on_finish(index, output) as each request finishes; on_step(stats, record) after each
        step; trace: keep per drafting step the live rows' prefix scores, keep_len and accepted drafts
        in stats.trace (an extra host copy per step: for evaluation, not for speed)."""
        requests, stats, steps = self.start(prompts, max_new_tokens, on_finish, trace)
        for rec in steps:
            if on_step is not None:
                on_step(stats, rec)
        return [r.output for r in requests], stats

    def start(self, prompts: list[list[int]], max_new_tokens: int | list[int], on_finish=None, trace: bool = False):
        """generate() one step per next(), for a caller that interleaves engines step by step (bench
        --lockstep): (requests, Stats, steps), steps yielding each step's StepRecord; every request's
        output is complete once it is exhausted. Bad prompts raise here, before any step."""
        requests = Request.checked(prompts, max_new_tokens, self.target.cfg.vocab_size, self.block, self.max_seq)
        stats = Stats(policy=self.policy.label, batch_size=self.batch_size, requests=len(requests), depth=self.D,
                      trace=[] if trace else None)
        return requests, stats, self.steps(requests, stats, on_finish)

    @torch.inference_mode()
    def steps(self, requests: list[Request], stats: Stats, on_finish=None):
        """The decode loop of start(): yields each step's StepRecord."""
        pending = collections.deque(requests)
        batch = Batch.empty(self.batch_size, self.device)
        while pending or batch.live:
            rec = self.step(batch, pending, stats, on_finish)
            if rec is not None:
                yield rec

    def step(self, batch: Batch, pending, stats: Stats, on_finish=None) -> StepRecord | None:
        """One decode step over the live rows (docs/method.md, "One D-cut step"); None if none is live."""
        self.admit(batch, pending, stats, on_finish)  # waiting requests take free rows
        if not batch.live:
            return None
        clock = StepClock()
        moved = self.compact(batch) if not pending else []  # a draining batch moves down a bucket
        b = self.bucket_for(batch.live[-1] + 1)
        moved = self.measure_missing_row(batch, b, moved, stats, clock)  # a first step at b without costs
        plan = self.plan(batch, b)  # draft or not; the costs and gain scale rho* is chosen with
        ran = self.runner.step(batch, b, plan, moved)  # draft (or the one made ahead), verify
        rows = batch.live
        self.commit(batch, ran, stats, on_finish)  # tokens to requests (finished ones leave), the next draft
        rec = self.record(rows, b, plan, ran, clock, batch)
        self.observe(rec, ran, rows, stats, clock)  # calibration, the table's entry, skip drafting; stats
        return rec

    # ---- the steps of a step ---------------------------------------------------------------------

    def admit(self, batch: Batch, pending, stats: Stats, on_finish=None) -> None:
        """Continuous batching: waiting requests take the lowest free rows (one prefill for all)."""
        free = [i for i, r in enumerate(batch.requests) if r is None][: len(pending)]
        if free:
            t0 = time.perf_counter()
            new = [pending.popleft() for _ in free]
            batch.admitted += len(new)
            # Where drafting is off the drafter's context of the prompts waits, like skipped steps'.
            write = not self.policy.drafting_off(self.bucket_for(max(batch.live + free) + 1))
            first = self.runner.prefill(free, new, batch, write).tolist()
            batch.prompt_context += self.runner.prompt_context.seconds if write else 0.0
            for row, tok in zip(free, first):
                self.emit(batch, row, [tok], stats, on_finish)
            stats.seconds["prefill"] += time.perf_counter() - t0

    def measure_missing_row(self, batch: Batch, b: int, moved: list[int], stats: Stats, clock: StepClock) -> list[int]:
        """A first step at bucket b without the policy's cost row measures it on the live rows
        (profiler.measure_row: outputs untouched), unless the batch's last rows have fewer steps left
        than that takes: they run AR steps at b for the rest of the run (decided once). Rows a
        compaction moved are moved first; returns the moves still to send."""
        if self.drafter is None or b in stats.unmeasured or not self.policy.needs_row(b):
            return moved
        if not profiler.worth_measuring(self.policy.table, self.policy.rhos, b, batch.steps_left):
            stats.unmeasured[b] = batch.steps_left
            return moved
        if moved:  # the measured steps run on the rows in place
            self.runner.send(batch, b, None, moved)
        t0 = time.perf_counter()
        row, samples, timed = profiler.measure_row(self, batch, b)
        self.policy.table.add_row(b, row, samples)
        for rec in timed:  # what the timed drafting steps would have accepted
            self.policy.observe(rec)
        clock.measuring = time.perf_counter() - t0
        stats.seconds["profile"] += clock.measuring
        return []

    def plan(self, batch: Batch, b: int) -> StepPlan:
        """The policy's plan for a step at bucket b over the batch's live rows (an AR step without a drafter)."""
        if self.drafter is None:
            return StepPlan(False, [], 1.0)
        usable = batch.usable(self.D) if self.policy.can_skip else None  # only a skip controller reads it
        return self.policy.plan(b, batch.n_behind, len(batch.live), usable)

    def record(self, rows: list[int], b: int, plan: StepPlan, ran: Ran, clock: StepClock, batch: Batch) -> StepRecord:
        """The step as it ran over the live rows `rows`, for the policy and the stats. A drafting step
        takes the seconds prefills spent on the drafter's context of prompts since the last one."""
        prompt_context, batch.prompt_context = (batch.prompt_context, 0.0) if plan.draft else (0.0, batch.prompt_context)
        admitted, batch.admitted = batch.admitted, 0
        return StepRecord(bucket=b, n_live=len(rows), drafted=plan.draft,
                          rho=self.policy.rhos[ran.draft.rho_index] if ran.K else 0.0,
                          predicted=ran.draft.predicted if plan.draft else 0.0,
                          accepted=int(ran.n_commit[rows].sum()) - len(rows), kept=int(ran.kept[rows].sum()),
                          seconds=clock.step_seconds(ran.seconds), catchup=ran.seconds.catchup,
                          caught_up=ran.caught_up, redraft=ran.seconds.redraft, usable=plan.usable,
                          prompt_context=prompt_context, admitted=admitted)

    def observe(self, rec: StepRecord, ran: Ran, rows: list[int], stats: Stats, clock: StepClock) -> None:
        """The step to the stats (with the gain scale its draft was chosen under) and to the policy, and
        its seconds to the stats by part."""
        stats.add(rec, self.policy.calibration.gain_scale, ran, rows)
        self.policy.observe(rec)
        clock.charge(stats, ran.seconds)

    def commit(self, batch: Batch, ran: Ran, stats: Stats, on_finish) -> None:
        """Hand each live row its committed tokens [n_commit[i]] (accepted drafts and the bonus), and the
        batch the next step's draft, if the step made one ahead."""
        for i in batch.live:
            n = int(ran.n_commit[i])
            if ran.draft is not None:  # the drafter's context K/V is now written up to the new anchor
                batch.written[i] = batch.requests[i].anchor_pos + n
            self.emit(batch, i, ran.commit[i, :n].tolist(), stats, on_finish)
        batch.ahead = ran.ahead

    def emit(self, batch: Batch, row: int, tokens: list[int], stats: Stats, on_finish) -> None:
        """Append tokens to a row's request up to EOS or max_new_tokens (a block can end mid-way: the
        rest is dropped); a finished request frees its row."""
        r = batch.requests[row]
        stop = next((j + 1 for j, t in enumerate(tokens) if t in self.eos), len(tokens))
        n = min(stop, r.max_new_tokens - len(r.output))
        r.output += tokens[:n]
        stats.generated_tokens += n
        if r.output[-1] in self.eos or len(r.output) == r.max_new_tokens:
            batch.free(row)
            stats.finished += 1
            if on_finish is not None:
                on_finish(r.index, r.output)

    # ---- batch buckets ---------------------------------------------------------------------------

    def bucket_for(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def compact(self, batch: Batch) -> list[int]:
        """With nothing waiting: live rows past the smallest bucket that holds them move into free rows
        below it, so the tail of a batch runs at a smaller bucket. Moves the requests on the host and
        returns [src rows + dst rows] for the runner to move on the device (empty: nothing moves)."""
        live = batch.live
        b = self.bucket_for(len(live))
        if live[-1] < b:
            return []
        src = [i for i in live if i >= b]
        dst = [i for i in range(b) if batch.requests[i] is None][: len(src)]
        batch.move(src, dst)
        return src + dst

    # ---- compiling ahead -------------------------------------------------------------------------

    def reachable(self, max_batch: int | None = None, min_batch: int = 1) -> list[tuple]:
        """Keys (kind, b, K, write) of every graph this engine's policy can reach at buckets in
        [min_batch, max_batch] (at a bucket without a cost row yet: every graph it could reach once the
        row is measured)."""
        keys = []
        for b in (x for x in self.buckets if min_batch <= x <= (max_batch or self.batch_size)):
            if self.drafter is None:
                keys.append(("verify", b, 0, True))
                continue
            budgets = self.runner.graphs.budgets(b)
            costs, skip = self.policy.costs(b), self.policy.skip(b)
            Ks = [K for K, c in zip(budgets, costs or budgets) if c != float("inf")]
            if self.policy.can_skip or costs is None:
                keys.append(("verify", b, 0, False))  # steps that do not draft
            if skip is None or skip.possible:
                keys += [("draft", b, 0, True)] + [("verify", b, K, True) for K in Ks]  # K = 0: rho* = 0
        return keys

    def compile_plan(self, max_batch: int | None = None, min_batch: int = 1) -> tuple[int, float | None]:
        """(graphs reachable at buckets in [min_batch, max_batch] not compiled yet (0 eager), the seconds a
        graph took the last time these models compiled here (None: never))."""
        graphs = self.runner.graphs
        new = sum(k not in graphs.graphs for k in self.reachable(max_batch, min_batch)) if self.compile else 0
        return new, graphs.seconds_per_graph()

    def compiled(self) -> list[tuple[str, float]]:
        """Each graph this engine compiled, in order, with the seconds of its first run (its compiling)."""
        return [(self.runner.graphs.name(k), s) for k, s in self.runner.graphs.compile_seconds.items()]

    def graph_use(self) -> tuple[int, int]:
        """(graphs made so far, their runs summed), compiled or eager: two readings around a pass say
        how many graph runs it made and whether it used a graph for the first time (tools/gpu_check.py)."""
        return len(self.runner.graphs.graphs), sum(self.runner.graphs.calls.values())

    def positions_read(self, reach: int) -> int:
        """Cache positions a step's attention reads when its furthest token sits at position reach - 1:
        all max_seq of them compiled (static shapes), eager the span rounded up (runner.Runner.span)."""
        return self.runner.span(reach) or self.max_seq

    @torch.inference_mode()
    def warmup(self, max_batch: int | None = None, calls: int = REPLAYED, min_batch: int = 1) -> float:
        """Run every graph reachable at buckets in [min_batch, max_batch] (default: all) `calls` times on
        empty rows, so that a compiled one is compiled, recorded as a CUDA graph and replayed before any
        step is timed (reduce-overhead records on its second run), and the catch-up once (its eager
        kernels load on first use); returns the seconds it took."""
        t0 = time.perf_counter()
        keys = self.reachable(max_batch, min_batch)
        graphs = self.runner.graphs
        new, s = self.compile_plan(max_batch, min_batch)
        if new and graphs.on_compile is not None:  # what the user waits for, before the first compile
            graphs.on_compile(f"{new} graphs to compile before the first step: " + (
                f"~{new * s / 60:.1f} min at the {s:.0f} s a graph of the last compile of these models here (an "
                f"empty compile cache takes longer, a warm one less)" if s else
                "no earlier compile of these models here; the first graph tells"))
        drafts = {}
        for i, (kind, b, K, write) in enumerate(keys, 1):
            done = time.perf_counter() - t0  # what the graphs so far took: the rest, roughly, at that pace
            eta = f", ~{done / (i - 1) * (len(keys) - i + 1) / 60:.0f} min left" if i > 1 else ""
            fn = self.runner.graphs.get(kind, b, K, write, note=f" ({i} of {len(keys)}{eta})")
            for _ in range(calls):
                z = [torch.zeros(b, dtype=torch.long, device=self.device) for _ in range(3)]  # fresh: never aliased
                if kind == "draft":
                    drafts[b] = self.runner.draft(z[0], z[1], z[2], [False] * b, StepPlan.neutral(len(self.policy.rhos)))
                elif K == 0:
                    fn(*z, None, None)
                else:
                    ri = self.runner.graphs.budgets(b).index(K)
                    fn(*z, drafts[b].drafts, drafts[b].keep_lens[ri].clone())
        if any(not write for *_, write in keys):  # steps that skip drafting: the catch-up after them (eager)
            self.drafter.catch_up(*torch.zeros(2, 1, dtype=torch.long, device=self.device))
        if new:
            graphs.remember((time.perf_counter() - t0) / new)
        return time.perf_counter() - t0
