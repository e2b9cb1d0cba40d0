"""The engine: continuous batching over up to batch_size cache rows, one speculative step at a time.

    step:  admit -> plan -> (catch up) -> draft + select -> verify + accept -> commit -> feedback

admit     waiting requests take free rows (prefill); the step runs at the smallest batch bucket b that
          holds the live rows (rows are compacted when the bucket can shrink)
plan      the policy says whether this step drafts and with which costs (policy.Policy.plan). The
          first step at a bucket whose cost row is missing measures it on the live rows first
          (profiler.measure_live; outputs untouched)
catch up  after steps that skipped drafting, write the drafter's missing context K/V
draft     draft graph (one per bucket): drafter block -> confidences -> dcut.select (prefix scores,
          keep_len and gain of every rho) -> rho* = Policy.choose; rho* and its gain come to the host
          in one copy and pick the verify graph
verify    verify graph (one per (bucket, K(rho*))): pack anchor + kept prefix of every row into
          T = b + K tokens -> target forward -> the target's (keyed) choice at every position ->
          accept -> commit [b, block] and the drafter's context for the committed tokens
commit    hand each request its committed tokens, stop finished requests
feedback  one StepRecord to the policy (calibration, skip drafting)

Host <-> device per step: at most one copy to the device, and one to the host in the steady state. A
drafting step sends its plan's draft inputs (limits, gain scale, costs) before it verifies; a step that
drafted (a probe aside: the step after it likely runs AR) drafts the next step's block right after its
verification with them (each row's limit less what it committed, on the device), so the next step's
pick (rho index and its gain, chosen with this step's calibration and costs: one step of lag) crosses
with this step's tokens; the next step uses that draft unless a row changed hands or the bucket
changed. Everything a step sends (its draft inputs, the rows a compaction moves, the positions a
catch-up writes) goes in one copy (staging.py); a fresh draft then syncs once more, on its pick. An
admission's prefill is one copy each way of its own. `ar` runs the verify graph with K = 0 (one token
per row) and never drafts.

Attention span: a compiled graph's attention reads every cache position (static shapes); an eager
step reads only the positions up to the live rows' furthest token, rounded up to SPAN_STEP
(Engine.span), so on a CPU a run pays mostly for its context, not for the cache it allocated (a
longer cache still slows the same span's attention somewhat: cli.max_seq sizes eager caches tightly).
docs/walkthrough.md follows one step through this file.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from dataclasses import dataclass

import torch

from . import profiler
from .batch import Batch, Request, batch_buckets
from .dcut import budget, select
from .layers import is_packed
from .model import Transformer, causal_layout, prefill_layout
from .policy import Policy, StepPlan, StepRecord
from .sampling import accept, sample, sample_keys
from .staging import Staging
from .stats import Interval, Stats


SPAN_STEP = 16  # eager steps read the cache in multiples of this many positions (Engine.span)


@dataclass
class Draft:
    """What the draft graph decided, on the device, and the chosen rho index (host)."""

    drafts: torch.Tensor  # [b, D]
    keep_lens: torch.Tensor  # [n_rho, b]
    gain: torch.Tensor  # [n_rho] expected accepted drafts (uncalibrated)
    log_s: torch.Tensor  # [b, D] log prefix scores
    rho_index: int
    predicted: float  # gain[rho_index], on the host


class Engine:
    """Batched generation with one target, an optional DFlash drafter and a policy (policy.py)."""

    def __init__(self, target: Transformer, drafter=None, policy: Policy | None = None, batch_size: int = 8,
                 max_seq: int = 512, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                 eos_ids=None, compile: bool = True, on_compile=None):
        self.target, self.policy = target, policy or Policy.ar()
        if self.policy.needs_drafter and drafter is None:
            raise ValueError(f"policy {self.policy.label!r} needs a drafter")
        self.drafter = drafter if self.policy.needs_drafter else None
        self.batch_size, self.max_seq, self.buckets = batch_size, max_seq, batch_buckets(batch_size)
        self.temperature, self.top_p, self.seed = temperature, top_p, seed
        self.eos = set(target.cfg.eos_token_ids if eos_ids is None else eos_ids)
        self.block = self.drafter.block_size if self.drafter is not None else 1
        self.D = self.block - 1
        self.policy.depth = self.D
        self.device = target.model.embed_tokens.weight.device
        if compile and is_packed(target, self.drafter):
            raise ValueError("weights packed for eager CPU matmuls cannot be compiled: load with pack=False")
        self.taps = self.drafter.taps if self.drafter is not None else ()
        # The caches are allocated once, here, at the run's rows and positions; everything that steps
        # this engine (the profiler too) uses them, so the compiled graphs never see another tensor.
        target.setup_cache(batch_size, max_seq)
        if self.drafter is not None:
            self.drafter.setup_cache(batch_size, max_seq)
        # Host inputs go over in one copy per step; the draft graph's (limit [b], n_live, gain_scale,
        # cost [n_rho]) have a fixed place at the front.
        self.staging = Staging(batch_size + 2 + len(self.policy.rhos), self.device)
        self.compile, self.on_compile = compile, on_compile  # on_compile(message) before a graph compiles
        self.on_measure = None  # on_measure(bucket, rho) while a missing cost row is measured
        self.graphs: dict[tuple, callable] = {}
        self.calls: collections.Counter = collections.Counter()  # runs of each graph (warmup checks)

    def span(self, reach: int) -> int | None:
        """Cache positions a step's attention reads when its furthest token sits at position reach - 1.
        Eager: those, rounded up to a multiple of SPAN_STEP (attention's time grows with the positions
        read, so a run pays mostly for its context, not for its cache). Compiled: None, all of them
        (one static shape per graph)."""
        return None if self.compile else min(self.max_seq, -(-reach // SPAN_STEP) * SPAN_STEP)

    def draft_span(self, reach: int) -> int | None:
        """The span of a draft from anchors before `reach`: its block lies past each anchor."""
        return self.span(reach + self.block)

    def verify_span(self, reach: int, K: int) -> int | None:
        """The span of a verification with K kept drafts at most, anchors before `reach`: each row
        verifies its anchor and at most min(D, K) drafts after it."""
        return self.span(reach + min(self.block, K + 1) - 1)

    def budgets(self, b: int) -> list[int]:
        """K(rho) for every rho of the policy's grid at bucket b."""
        return [budget(r, b, self.D) for r in self.policy.rhos] if self.drafter is not None else [0]

    # ---- one step ----------------------------------------------------------------------------

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, on_finish=None, on_step=None,
                 trace: bool = False):
        """Generate for every prompt with at most batch_size at a time; returns (outputs in input order,
        Stats). on_finish(index, output) as each request finishes; on_step(stats, record) after each
        step; trace: keep per drafting step the live rows' prefix scores, keep_len and accepted drafts
        in stats.trace (an extra host copy per step: for evaluation, not for speed)."""
        requests, stats, steps = self.start(prompts, max_new_tokens, on_finish, trace)
        for rec in steps:
            if on_step is not None:
                on_step(stats, rec)
        return [r.output for r in requests], stats

    def start(self, prompts: list[list[int]], max_new_tokens: int, on_finish=None, trace: bool = False):
        """generate() one step per next(), for a caller that interleaves engines step by step (bench
        --lockstep): (requests, Stats, steps), steps yielding each step's StepRecord; every request's
        output is complete once it is exhausted. Bad prompts raise here, before any step."""
        requests = Request.checked(prompts, max_new_tokens, self.target.cfg.vocab_size, self.block, self.max_seq)
        stats = Stats(policy=self.policy.label, batch_size=self.batch_size, requests=len(requests),
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
        """One decode step over the live rows; None if no row is live after admission."""
        self.admit(batch, pending, stats, on_finish)
        if not batch.live:
            return None
        tp, measuring = time.perf_counter(), 0.0
        moved = self.compact(batch) if not pending else []  # [src rows + dst rows], on the host so far
        b = self.bucket_for(batch.live[-1] + 1)
        rows = batch.live
        if self.drafter is not None and b not in stats.unmeasured and self.policy.needs_row(b):
            left = batch.steps_left
            if profiler.worth_measuring(self.policy.table, self.policy.rhos, b, left):
                if moved:  # first: the measured steps run on the rows in place
                    self.staging.put(moved)
                    self.move_rows(batch, *self.staging.send())
                    moved = []
                measuring = profiler.measure_row(self, batch, b)
                stats.seconds["profile"] += measuring
            else:  # a batch's last rows: AR steps at b for the rest of the run (decided once)
                stats.unmeasured[b] = left
        usable = batch.usable(self.D) if self.policy.can_skip else None  # only a skip controller reads it
        plan = self.policy.plan(b, batch.n_unsynced, len(rows), usable) if self.drafter is not None else None
        drafting = plan is not None and plan.draft
        draft = batch.take_ahead(b)  # the previous step's, if nothing changed since; dropped if unused
        draft = draft if drafting else None
        # The step's host inputs go over in one copy: a fresh draft's inputs, the rows to move, the
        # positions whose drafter context was skipped (they need catching up before a draft).
        unsynced = batch.unsynced() if drafting else []
        fresh = drafting and draft is None
        if drafting:  # this plan's inputs: of the fresh draft, or of the one this step drafts ahead
            self.stage_draft(batch.limits(b), len(rows), plan)
        for part in (moved, unsynced):
            if part:
                self.staging.put(part)
        sent = collections.deque(self.staging.send())
        inputs = sent.popleft() if drafting else None
        if moved:
            self.move_rows(batch, sent.popleft())
        catchup = self.write_context(sent.popleft()) if unsynced else 0.0
        t0 = time.perf_counter()
        reach = batch.reach
        if fresh:
            draft = self.run_draft(batch.anchor[:b], batch.anchor_pos[:b], inputs, self.draft_span(reach))
        K = self.budgets(b)[draft.rho_index] if drafting else 0
        t1 = time.perf_counter()
        ahead = drafting and plan.ahead  # a draft exists whenever this holds
        commit, n_commit, kept, drafted_ahead = self.verify(batch, b, draft, K, reach, ahead=ahead)
        t2 = time.perf_counter()
        self.commit(batch, commit, n_commit, draft, stats, on_finish)
        # The step's seconds hold one draft, as a cost-table entry does: a fresh draft that also drafted
        # ahead ran two, and the first is the price of rows changing (redraft), not of this rho.
        redraft = t1 - t0 if fresh and ahead else 0.0
        rec = StepRecord(bucket=b, n_live=len(rows), drafted=drafting,
                         rho=self.policy.rhos[draft.rho_index] if K else 0.0,
                         predicted=draft.predicted if drafting else 0.0,
                         accepted=int(n_commit[rows].sum()) - len(rows), seconds=time.perf_counter() - t0 - redraft,
                         catchup=catchup, caught_up=len(unsynced) // 2, redraft=redraft, usable=usable)
        stats.add(rec, int(kept[rows].sum()), self.D, self.policy.calibration.gain_scale)
        if stats.trace is not None and drafting:  # for evaluation: scores, kept and accepted drafts
            stats.trace.append((draft.log_s[rows].exp().cpu(), kept[rows], n_commit[rows] - 1))
        self.policy.observe(rec)
        # Every second of the step outside prefill and measuring counts: bookkeeping holds the plan, the
        # staging and row moves before the draft, and the commit and feedback after the verification.
        before = t0 - tp - measuring - catchup
        stats.seconds.update(draft=t1 - t0 + catchup + drafted_ahead, verify=t2 - t1 - drafted_ahead,
                             bookkeeping=before + time.perf_counter() - t2)
        return rec

    def admit(self, batch: Batch, pending, stats: Stats, on_finish=None) -> None:
        """Continuous batching: waiting requests take the lowest free rows (one prefill for all)."""
        free = [i for i, r in enumerate(batch.requests) if r is None][: len(pending)]
        if free:
            t0 = time.perf_counter()
            new = [pending.popleft() for _ in free]
            # Where drafting is off the drafter's context of the prompts waits, like skipped steps'.
            context = not self.policy.drafting_off(self.bucket_for(max(batch.live + free) + 1))
            first = self.prefill(free, new, batch, context).tolist()
            for row, tok in zip(free, first):
                self.emit(batch, row, [tok], stats, on_finish)
            stats.seconds["prefill"] += time.perf_counter() - t0

    def catch_up(self, batch: Batch) -> float:
        """Before drafting after skipped steps: write the drafter's context K/V of the positions
        committed meanwhile, from the held taps (one copy of their places). Returns its seconds."""
        unsynced = batch.unsynced()
        if not unsynced:
            return 0.0
        self.staging.put(unsynced)
        return self.write_context(self.staging.send()[0])

    def write_context(self, sent: torch.Tensor) -> float:
        """catch_up's work: sent [rows + positions] (Batch.unsynced) on the device. Returns its seconds."""
        t0 = time.perf_counter()
        self.drafter.sync_context(*sent.long().chunk(2))
        return time.perf_counter() - t0

    def draft(self, anchor: torch.Tensor, anchor_pos: torch.Tensor, limit: list[int], n_live: int,
              plan: StepPlan, span: int | None = None) -> Draft:
        """Run the draft graph of bucket b = len(anchor): anchor, anchor_pos [b]; limit: drafts each row
        can still use (0 for an empty row); span (Engine.span; default: the whole cache). Its other
        inputs go over in one copy; syncs once: rho* picks the verify graph."""
        self.stage_draft(limit, n_live, plan)
        return self.run_draft(anchor, anchor_pos, self.staging.send()[0], span)

    def stage_draft(self, limit: list[int], n_live: int, plan: StepPlan) -> None:
        """Stage the draft graph's inputs: limit [b], n_live, gain_scale, cost [n_rho]."""
        self.staging.put(limit + [n_live, plan.gain_scale] + list(plan.cost), fixed=True)

    def run_draft(self, anchor: torch.Tensor, anchor_pos: torch.Tensor, inputs: torch.Tensor,
                  span: int | None = None) -> Draft:
        """draft() with its inputs [b + 2 + n_rho] already on the device."""
        out = self.graph("draft", anchor.shape[0])(anchor, anchor_pos, inputs, span)
        return self.drafted(out, out[4].cpu())  # [rho index, its gain]: the host sync of this draft

    @staticmethod
    def drafted(out, pick: torch.Tensor) -> Draft:
        """A Draft from the draft graph's outputs and its pick on the host. Copies: a CUDA graph's
        outputs are overwritten when it replays."""
        return Draft(*(t.clone() for t in out[:4]), rho_index=int(pick[0]), predicted=float(pick[1]))

    def verify(self, batch: Batch, b: int, draft: Draft | None, K: int, reach: int, ahead: bool):
        """Run the verify graph of bucket b with K kept drafts at most (an AR step without a draft) and
        move the rows' anchors on. ahead (a drafting step that is not a probe, StepPlan.ahead): then
        draft the next step's block already (batch.ahead), so that its pick crosses to the host with this
        step's tokens, in one copy. reach: one past the live rows' furthest anchor. Returns, on the
        host: commit [b, block], n_commit [b], kept [b], and the seconds of the draft made ahead (0
        without one: drafting's, not verification's)."""
        Q = min(self.block, K + 1)  # the longest row verified
        keep_len = draft.keep_lens[draft.rho_index] if draft is not None else None
        # A step that drafted writes the drafter's context K/V (the next one will likely draft too);
        # a step that did not only holds the target's taps (see catch_up).
        fn = self.graph("verify", b, K, kv=draft is not None or self.drafter is None)
        commit, n_commit, anchor, anchor_pos = fn(batch.anchor[:b], batch.anchor_pos[:b], batch.request_ids[:b],
                                                  draft.drafts if draft else None, keep_len, self.verify_span(reach, K))
        batch.anchor[:b], batch.anchor_pos[:b] = anchor, anchor_pos
        kept = keep_len if K else torch.zeros_like(n_commit)
        host = torch.cat([commit, n_commit[:, None], kept[:, None]], dim=1)  # [b, block + 2]
        drafting = Interval(self.device)
        if ahead:  # the next draft: this step's inputs (its plan), each row's limit less what it commits
            drafting.start()
            inputs = self.staging.fixed_inputs(b + 2 + len(self.policy.rhos))
            inputs[:b] = (inputs[:b] - n_commit).clamp(min=0)  # in place, on the device
            out = self.graph("draft", b)(batch.anchor[:b], batch.anchor_pos[:b], inputs,
                                         self.draft_span(reach + Q))  # anchors moved <= Q on
            host = torch.cat([host.double().flatten(), out[4].double()])  # token ids < 2^53: exact
            drafting.stop()
        host = host.cpu()  # the step's one copy to the host
        if ahead:
            batch.ahead = (batch.version, b, self.drafted(out, host[-2:]))
            host = host[:-2].long().view(b, -1)
        return host[:, :-2], host[:, -2], host[:, -1], drafting.seconds

    def commit(self, batch: Batch, commit, n_commit, draft: Draft | None, stats: Stats, on_finish) -> None:
        """Hand each live row its committed tokens [n_commit[i]] (accepted drafts and the bonus)."""
        for i in batch.live:
            n = int(n_commit[i])
            if draft is not None:  # the drafter's context K/V is now written up to the new anchor
                batch.synced[i] = batch.requests[i].anchor_pos + n
            self.emit(batch, i, commit[i, :n].tolist(), stats, on_finish)

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

    # ---- batch buckets -------------------------------------------------------------------------

    def bucket_for(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def compact(self, batch: Batch) -> list[int]:
        """With nothing waiting: live rows past the smallest bucket that holds them move into free rows
        below it, so the tail of a batch runs at a smaller bucket. Moves the requests on the host and
        returns [src rows + dst rows] for move_rows (empty: nothing moves)."""
        live = batch.live
        b = self.bucket_for(len(live))
        if live[-1] < b:
            return []
        src = [i for i in live if i >= b]
        dst = [i for i in range(b) if batch.requests[i] is None][: len(src)]
        batch.move(src, dst)
        return src + dst

    def move_rows(self, batch: Batch, sent: torch.Tensor) -> None:
        """Copy the device state of moved rows: sent [src rows + dst rows] (compact) on the device. The
        rows' anchors and target and drafter cache rows (K/V and held taps) go from src to dst."""
        s, d = sent.long().chunk(2)
        caches = list(self.target.caches) + (list(self.drafter.caches) if self.drafter is not None else [])
        for c in caches:
            c.k[d], c.v[d] = c.k[s], c.v[s]
        if self.drafter is not None:
            self.drafter.held_taps[d] = self.drafter.held_taps[s]
        for t in (batch.anchor, batch.anchor_pos, batch.request_ids):
            t[d] = t[s]

    # ---- compiled graphs -----------------------------------------------------------------------

    def graph(self, kind: str, b: int, K: int = 0, kv: bool = True, note: str = ""):
        """The callable of a draft graph (kind 'draft') or of a verify graph with K kept drafts, at
        bucket b (kv: whether it writes the drafter's context K/V or only holds the target's taps).
        Compiled ones are made on first use, announced by on_compile("compiling ... b=4 K=15" + note)."""
        key = (kind, b, K, kv)
        if key not in self.graphs:
            fn = self._draft if kind == "draft" else functools.partial(self._verify, K=K, kv=kv)
            if self.compile:
                if self.on_compile is not None:
                    self.on_compile(f"compiling {kind} graph b={b}" + (f" K={K}" if kind == "verify" else "") + note)
                fn = torch.compile(fn, mode="reduce-overhead", fullgraph=True, dynamic=False)
            self.graphs[key] = self.counted(key, fn)
        return self.graphs[key]

    def counted(self, key: tuple, fn):
        """fn, counting its runs in self.calls[key]. The optional span is always passed (None if not
        given): a compiled graph called with another number of arguments would compile again."""
        n = 4 if key[0] == "draft" else 6
        return lambda *args: (self.calls.update([key]), fn(*args, *[None] * (n - len(args))))[1]

    def _draft(self, anchor, anchor_pos, inputs, span=None):
        """Draft one block per row and run the D-cut selector for every rho of the grid.
        anchor, anchor_pos [b]; inputs [b + 2 + n_rho]: limit [b], n_live, gain_scale, cost [n_rho];
        span: cache positions read (Engine.span; None: all) -> drafts [b, D], keep_len [n_rho, b],
        expected accepted drafts [n_rho], log prefix scores [b, D], [rho index, its expected accepted
        drafts] [2]."""
        b = anchor.shape[0]
        limit, n_live, gain_scale, cost = inputs[:b].long(), inputs[b], inputs[b + 1], inputs[b + 2 :]
        logits = self.drafter(self.target, anchor, anchor_pos, span)  # [b, D, V]
        # The greedy drafts and their softmax probabilities [b, D]: one fused softmax pass, then max.
        conf, idx = torch.softmax(logits.float(), dim=-1).max(dim=-1)
        sel = select(conf, limit, self.budgets(b))
        rho = self.policy.choose(sel.gains, n_live, gain_scale, cost)
        rho = rho.view(1)
        pick = torch.cat([rho.to(sel.gains.dtype), sel.gains.gather(0, rho)])  # [2]: one copy to the host
        return self.drafter.tokens(idx), sel.keep_lens, sel.gains, sel.log_s, pick

    def _verify(self, anchor, anchor_pos, request_ids, drafts, keep_len, span=None, K: int = 0, kv: bool = True):
        """Pack, verify, accept (docs/method.md, "Verification"). anchor, anchor_pos, request_ids [b];
        drafts [b, D]; keep_len [b] with sum <= K; span: cache positions attention reads (Engine.span;
        None: all) -> commit [b, block] (accepted drafts then the bonus), n_commit [b], the new anchor
        and anchor_pos [b]."""
        b, dev = anchor.shape[0], anchor.device
        Q = min(self.block, K + 1)  # the longest row: anchor + at most min(D, K) drafts
        T = b + K
        if span is not None:  # empty rows too stay inside it (a live row always is): a window never
            anchor_pos = anchor_pos.clamp(max=span - Q)  # hides every key from a token
        if K == 0:  # an AR step: one token per row
            src = torch.arange(b, device=dev)  # [T]
            tokens = anchor
        else:
            grid = torch.cat([anchor[:, None], drafts[:, : Q - 1]], dim=1)  # [b, Q]
            valid = (torch.arange(Q, device=dev) <= keep_len[:, None]).flatten()  # [b*Q]: anchor + kept prefix
            # Dense packing: the valid cells first, in order, then the others; the first T are verified.
            # sum(keep_len) < K when fewer drafts can be emitted than K (dcut.keep_lens): the cells after
            # the valid ones pad the step like rejected drafts (their K/V lies past the row's kept
            # prefix, where nothing reads it, and acceptance stops at keep_len).
            n_valid = valid.sum()
            dest = torch.where(valid, valid.cumsum(0) - 1, n_valid + (~valid).cumsum(0) - 1)  # [b*Q], a permutation
            src = torch.empty_like(dest).scatter_(0, dest, torch.arange(b * Q, device=dev))[:T]  # [T] grid cell of each
            tokens = grid.flatten()[src]  # [T]
        row, col = src // Q, src % Q
        pos = anchor_pos[row] + col  # [T]
        layout = causal_layout(row, pos, col, b, Q, span or self.max_seq)
        logits, taps = self.target(tokens, layout, taps=self.taps)  # [T, V], [T, n_taps*H]
        # The target's token after each packed one, drawn with the key of (request, position): the
        # same draw AR decoding makes there, so accepted drafts are exactly AR's tokens.
        keys = sample_keys(self.seed, request_ids[row], pos + 1)  # [T]
        choice = sample(logits, self.temperature, self.top_p, keys)  # [T]
        choice_grid = torch.full((b * Q,), -1, dtype=torch.long, device=dev).index_copy(0, src, choice)
        choice_grid = choice_grid.view(b, Q)  # [b, Q]; -1 (never a token) where nothing was verified
        commit = torch.zeros(b, self.block, dtype=torch.long, device=dev)
        if K == 0:
            accepted = torch.zeros(b, dtype=torch.long, device=dev)
        else:
            accepted = accept(drafts[:, : Q - 1], keep_len, choice_grid)  # [b]
            commit[:, : Q - 1] = drafts[:, : Q - 1]
        bonus = choice_grid.gather(1, accepted[:, None])  # [b, 1]
        commit.scatter_(1, accepted[:, None], bonus)
        if self.drafter is not None:
            self.drafter.add_context(taps, row, pos, kv=kv)
        # Empty rows keep stepping too; the clamp keeps their positions inside the cache (a live
        # row never reaches it: Request.checked makes sure prompt + max_new_tokens + block <= max_seq).
        new_pos = (anchor_pos + accepted + 1).clamp(max=self.max_seq - self.block - 1)
        return commit, accepted + 1, bonus[:, 0], new_pos

    @torch.inference_mode()
    def prefill(self, rows: list[int], requests: list[Request], batch: Batch | None = None,
                context: bool = True) -> torch.Tensor:
        """Run the prompts of `requests` into cache `rows` (eager, one padded batch), with the drafter's
        context for them (context=False: only their taps held, for a later catch-up); returns the first
        generated token of each [n]. Its host inputs go over in one copy. With a batch: the requests
        take the rows there, each first token as its anchor."""
        lengths = [len(r.prompt) for r in requests]
        layout, last = prefill_layout(rows, lengths)
        for part in (layout.row, layout.pos, layout.slot, last, [t for r in requests for t in r.prompt],
                     rows, lengths, [r.index for r in requests]):
            self.staging.put(part)
        row, pos, slot, last, tokens, idx, lengths, ids = (t.long() for t in self.staging.send())
        layout = dataclasses.replace(layout, row=row, pos=pos, slot=slot)
        logits, taps = self.target(tokens, layout, logits_idx=last, taps=self.taps)
        if self.drafter is not None:
            self.drafter.add_context(taps, layout.row, layout.pos, kv=context)
        first = sample(logits, self.temperature, self.top_p, sample_keys(self.seed, ids, lengths))
        if batch is not None:
            batch.anchor[idx], batch.anchor_pos[idx], batch.request_ids[idx] = first, lengths, ids
            batch.place(rows, requests, synced=context)
        return first

    def reachable(self, max_batch: int | None = None, min_batch: int = 1) -> list[tuple]:
        """Keys (kind, b, K, kv) of every graph this engine's policy can reach at buckets in [min_batch,
        max_batch] (at a bucket without a cost row yet: every graph it could reach once the row is
        measured)."""
        keys = []
        for b in (x for x in self.buckets if min_batch <= x <= (max_batch or self.batch_size)):
            if self.drafter is None:
                keys.append(("verify", b, 0, True))
                continue
            costs, skip = self.policy.costs(b), self.policy.skip(b)
            Ks = [K for K, c in zip(self.budgets(b), costs or self.budgets(b)) if c != float("inf")]
            if self.policy.can_skip or costs is None:
                keys.append(("verify", b, 0, False))  # steps that do not draft
            if skip is None or skip.possible:
                keys += [("draft", b, 0, True)] + [("verify", b, K, True) for K in Ks]  # K = 0: rho* = 0
        return keys

    @torch.inference_mode()
    def warmup(self, max_batch: int | None = None, calls: int = 3, min_batch: int = 1) -> float:
        """Run every graph reachable at buckets in [min_batch, max_batch] (default: all) `calls` times on
        empty rows, so that a compiled one is compiled, recorded as a CUDA graph and replayed before any
        step is timed (reduce-overhead records on its second run), and the catch-up once (its eager
        kernels load on first use); returns the seconds it took."""
        t0 = time.perf_counter()
        keys = self.reachable(max_batch, min_batch)
        drafts = {}
        for i, (kind, b, K, kv) in enumerate(keys, 1):
            fn = self.graph(kind, b, K, kv, note=f" ({i} of {len(keys)})")
            for _ in range(calls):
                z = [torch.zeros(b, dtype=torch.long, device=self.device) for _ in range(3)]  # fresh: never aliased
                if kind == "draft":
                    plan = StepPlan(True, [1.0] * len(self.policy.rhos), 1.0)
                    drafts[b] = self.draft(z[0], z[1], [0] * b, 0, plan)
                elif K == 0:
                    fn(*z, None, None)
                else:
                    ri = self.budgets(b).index(K)
                    fn(*z, drafts[b].drafts, drafts[b].keep_lens[ri].clone())
        if any(not kv for *_, kv in keys):  # steps that skip drafting: the catch-up after them (eager)
            self.drafter.sync_context(*torch.zeros(2, 1, dtype=torch.long, device=self.device))
        return time.perf_counter() - t0
