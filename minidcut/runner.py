"""The runner: everything of a step that touches the device. It owns the caches, the decode graphs
(graphs.py), the prefill, row moves, the catch-up of the drafter's context, attention spans, and the
step's one copy each way (staging.py). The engine (engine.py) decides; the runner carries it out.

Host <-> device per step: at most one copy to the device (Runner.send: a drafting step's draft inputs,
the rows a compaction moves, the positions a catch-up writes), and one to the host in the steady state
(Runner.verify: the committed tokens, with the pick of the draft made ahead). A fresh draft syncs once
more, on its pick. An admission's prefill is one copy each way of its own.

The draft made ahead. A drafting step that is not a probe drafts the next step's block right after its
verification (Runner.verify, ahead=True). It reuses this step's draft inputs on the device (the live
rows, its plan's gain scale and costs) at the anchors the verification just moved on, so each row's
limit is what the row has left after its commit: the next step's rho* is
chosen with this step's calibration and costs (one step of lag), and its pick crosses to the host with
this step's tokens. It is kept as batch.ahead and used by the next step unless a row changed hands or
the bucket changed (Batch.take_ahead).

Attention span: a compiled graph's attention reads every cache position (static shapes); an eager step
reads only the positions up to the live rows' furthest token, rounded up to SPAN_STEP (Runner.span), so
on a CPU a run pays mostly for its context, not for the cache it allocated (a longer cache still slows
the same span's attention somewhat: cli.max_seq sizes eager caches tightly).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from .batch import Ahead, Batch, Request
from .graphs import Draft, DraftInputs, Graphs, longest_row
from .model import prefill_layout
from .policy import StepPlan
from .sampling import sample, sample_keys
from .staging import Staging
from .stats import Interval, RunSeconds

SPAN_STEP = 16  # eager steps read the cache in multiples of this many positions (Runner.span)


@dataclasses.dataclass
class Sent:
    """What a step sent to the device in its one copy (None: nothing of that kind)."""

    draft_inputs: torch.Tensor | None = None  # DraftInputs [b + 1 + n_rho]
    caught_up: int = 0  # positions whose drafter context the catch-up wrote
    catchup_seconds: float = 0.0


@dataclasses.dataclass
class Ran:
    """One step as the runner ran it (Runner.step), on the host."""

    commit: torch.Tensor  # [b, block] each row's committed tokens: accepted drafts, then the bonus
    n_commit: torch.Tensor  # [b] tokens each row committed
    kept: torch.Tensor  # [b] drafts each row verified
    draft: Draft | None  # the draft verified (None: a step that did not draft)
    K: int  # the verify graph's budget (0: nothing kept)
    ahead: Ahead | None  # the next step's draft, made after verifying (None: not made)
    caught_up: int  # positions whose drafter context the step's catch-up wrote first
    seconds: RunSeconds


class Runner:
    def __init__(self, target, drafter, policy, batch_size: int, max_seq: int, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, compile: bool = True, on_compile=None):
        self.target, self.drafter, self.max_seq, self.compile = target, drafter, max_seq, compile
        self.block = drafter.block_size if drafter is not None else 1
        self.device = target.model.embed_tokens.weight.device
        self.graphs = Graphs(target, drafter, policy, self.block, max_seq, temperature, top_p, seed, compile,
                             on_compile)
        self.temperature, self.top_p, self.seed = temperature, top_p, seed
        # The caches are allocated once, here, at the run's rows and positions; everything that steps
        # this engine (the profiler too) uses them, so the compiled graphs never see another tensor.
        target.setup_cache(batch_size, max_seq)
        if drafter is not None:
            drafter.setup_cache(batch_size, max_seq)
        self.n_draft_inputs = DraftInputs.size(batch_size, len(policy.rhos))
        self.staging = Staging(self.n_draft_inputs, self.device)  # the draft inputs at a fixed place
        self.prompt_context = Interval(self.device)  # the drafter's work in the last prefill

    # ---- attention spans -------------------------------------------------------------------------

    def span(self, reach: int) -> int | None:
        """Cache positions a step's attention reads when its furthest token sits at position reach - 1.
        Eager: those, rounded up to a multiple of SPAN_STEP. Compiled: None, all of them (one static
        shape per graph)."""
        return None if self.compile else min(self.max_seq, -(-reach // SPAN_STEP) * SPAN_STEP)

    def draft_span(self, reach: int) -> int | None:
        """The span of a draft from anchors before `reach`: its block lies past each anchor."""
        return self.span(reach + self.block)

    def verify_span(self, reach: int, K: int) -> int | None:
        """The span of a verification with K kept drafts at most, anchors before `reach`: each row
        verifies its anchor and at most min(D, K) drafts after it."""
        return self.span(reach + longest_row(self.block, K) - 1)

    # ---- the step's copy to the device -----------------------------------------------------------

    def send(self, batch: Batch, b: int, plan: StepPlan | None, moved: list[int]) -> Sent:
        """The step's host inputs in one copy: the draft inputs of its plan (for a fresh draft or for the
        one it drafts ahead; plan None: the step does not draft), the rows a compaction moved, and the
        positions whose drafter context was skipped (they are caught up before a draft). Applies the
        moves and the catch-up."""
        inputs = self.staging.put(DraftInputs.pack(batch.live_mask(b), plan), fixed=True) \
            if plan is not None else None
        rows = self.staging.put(moved) if moved else None
        behind = batch.behind() if plan is not None else []
        positions = self.staging.put(behind) if behind else None
        self.staging.send()
        if rows is not None:
            self.move_rows(batch, rows.device)
        sent = Sent(inputs.device if inputs is not None else None)
        if positions is not None:
            sent.caught_up, sent.catchup_seconds = len(behind) // 2, self.catch_up(positions.device)
        return sent

    def move_rows(self, batch: Batch, sent: torch.Tensor) -> None:
        """Copy the device state of moved rows: sent [src rows + dst rows] (Engine.compact) on the device.
        The rows' anchors, last positions and target and drafter cache rows (K/V and held taps) go from
        src to dst."""
        s, d = sent.long().chunk(2)
        caches = list(self.target.caches) + (list(self.drafter.caches) if self.drafter is not None else [])
        for c in caches:
            c.k[d], c.v[d] = c.k[s], c.v[s]
        if self.drafter is not None:
            self.drafter.held_taps[d] = self.drafter.held_taps[s]
        for t in (batch.anchor, batch.anchor_pos, batch.last, batch.request_ids):
            t[d] = t[s]

    def catch_up(self, sent: torch.Tensor) -> float:
        """Write the drafter's context K/V of positions committed while it was not written, from the held
        taps: sent [rows + positions] (Batch.behind) on the device. Returns its seconds."""
        t0 = time.perf_counter()
        self.drafter.catch_up(*sent.long().chunk(2))
        return time.perf_counter() - t0

    def catch_up_batch(self, batch: Batch) -> float:
        """catch_up for every live row of the batch, in a copy of its own (the profiler, before it times
        drafting steps). Returns its seconds."""
        behind = batch.behind()
        if not behind:
            return 0.0
        staged = self.staging.put(behind)
        self.staging.send()
        return self.catch_up(staged.device)

    # ---- the step ---------------------------------------------------------------------------------

    def step(self, batch: Batch, b: int, plan: StepPlan, moved: list[int]) -> Ran:
        """One decode step over the batch's rows [0, b): its one copy in (the plan's draft inputs, the rows
        a compaction `moved`, the positions to catch up), the draft the previous step made ahead if still
        valid or a fresh one (its pick copied to the host), verification of rho*'s budget, and the next
        step's block drafted ahead where the plan says so. The Ran holds its seconds by part."""
        cold, reach = self.graphs.cold_calls, batch.reach
        draft = batch.take_ahead(b, use=plan.draft)  # drafted by the previous step, if still valid
        sent = self.send(batch, b, plan if plan.draft else None, moved)
        t0 = time.perf_counter()
        fresh = plan.draft and draft is None
        if fresh:  # rows changed hands: draft + select + rho* now
            draft = self.run_draft(batch.anchor[:b], batch.anchor_pos[:b], batch.last[:b], sent.draft_inputs,
                                   self.draft_span(reach))
        K = self.graphs.budgets(b)[draft.rho_index] if draft is not None else 0
        t1 = time.perf_counter()
        (commit, n_commit, kept), made, ahead = self.verify(batch, b, draft, K, reach, ahead=plan.draft and plan.ahead)
        end = time.perf_counter()
        cold = self.graphs.cold_calls > cold  # compiled on first use: not a step's seconds
        seconds = RunSeconds(sent.catchup_seconds, t1 - t0, end - t1, ahead,
                             redraft=t1 - t0 if fresh and plan.ahead and not cold else 0.0, cold=cold, end=end)
        return Ran(commit, n_commit, kept, draft, K, made, sent.caught_up, seconds)

    # ---- steps that advance nothing (the profiler) -----------------------------------------------

    def budgets(self, b: int) -> list[int]:
        """K(rho) for every rho of the policy's grid at bucket b."""
        return self.graphs.budgets(b)

    def graph(self, kind: str, b: int, K: int = 0, write: bool = True):
        """The graph of one part of a step ("draft" or "verify" at bucket b with K kept drafts; write: a
        verification that writes the drafter's context), for a tool that times it alone."""
        return self.graphs.get(kind, b, K, write)

    def runs(self, b: int, K: int) -> int:
        """How often the graphs of a step at bucket b verifying K drafts (its draft graph too if K > 0)
        have run: the fewest of them (compiled ones replay from the REPLAYED-th run)."""
        keys = [("verify", b, K, K > 0)] + ([("draft", b, 0, True)] if K else [])
        return min(self.graphs.calls[k] for k in keys)

    def dry_step(self, anchor: torch.Tensor, anchor_pos: torch.Tensor, last: torch.Tensor, ids: torch.Tensor,
                 live: list[bool], ri: int, reach: int) -> tuple[Draft | None, torch.Tensor]:
        """A step at the grid's rho index ri on rows [0, b) (anchor, anchor_pos, last, ids [b]; live [b])
        that advances nothing: a fresh draft (none if K(rho) = 0) and the verification of its budget, its tokens copied
        to the host as a step's are. What it writes into the caches lies at or past each row's anchor,
        which the next real step writes again. Returns the draft and each row's committed tokens [b]."""
        b = anchor.shape[0]
        K = self.budgets(b)[ri]
        span, draft = self.verify_span(reach, K), None
        if K == 0:
            commit, n_commit = self.graphs.get("verify", b, 0, write=False)(anchor, anchor_pos, ids, None, None, span)[:2]
        else:
            plan = StepPlan.neutral(len(self.graphs.policy.rhos))
            draft = self.draft(anchor, anchor_pos, last, live, plan, self.draft_span(reach))  # syncs on rho*
            commit, n_commit = self.graphs.get("verify", b, K)(anchor, anchor_pos, ids, draft.drafts, draft.keep_lens[ri],
                                                               span)[:2]
        return draft, torch.cat([commit, n_commit[:, None]], dim=1).cpu()[:, -1]

    # ---- draft and verify ------------------------------------------------------------------------

    def draft(self, anchor: torch.Tensor, anchor_pos: torch.Tensor, last: torch.Tensor, live: list[bool],
              plan: StepPlan, span: int | None = None) -> Draft:
        """A fresh draft at bucket b = len(anchor) with its own copy of the inputs (the profiler, warmup):
        last [b]: the position of the last token each row may commit; live [b]: which rows hold a
        request. Syncs once: rho* picks the verify graph."""
        staged = self.staging.put(DraftInputs.pack(live, plan), fixed=True)
        self.staging.send()
        return self.run_draft(anchor, anchor_pos, last, staged.device, span)

    def run_draft(self, anchor: torch.Tensor, anchor_pos: torch.Tensor, last: torch.Tensor, inputs: torch.Tensor,
                  span: int | None = None) -> Draft:
        """The draft graph on inputs already on the device (DraftInputs); syncs on the pick."""
        out = self.graphs.get("draft", anchor.shape[0])(anchor, anchor_pos, last, inputs, span)
        return Draft.from_graph(out, out[4].cpu())  # [rho index, its gain]: the host sync of this draft

    def verify(self, batch: Batch, b: int, draft: Draft | None, K: int, reach: int, ahead: bool):
        """Run the verify graph of bucket b with K kept drafts at most (an AR step without a draft; anchors
        before `reach`) and move the rows' anchors on; ahead: then draft the next step's block (the module
        docstring). Returns, on the host, (commit [b, block], n_commit [b], kept [b]), the draft made
        ahead (Ahead, or None) and its seconds (0 without one: drafting's, not verification's)."""
        keep_len = draft.keep_lens[draft.rho_index] if draft is not None else None
        # A step that drafted writes the drafter's context K/V (the next one will likely draft too);
        # a step that did not only holds the target's taps (caught up before the next draft).
        fn = self.graphs.get("verify", b, K, write=draft is not None or self.drafter is None)
        commit, n_commit, anchor, anchor_pos = fn(batch.anchor[:b], batch.anchor_pos[:b], batch.request_ids[:b],
                                                  draft.drafts if draft else None, keep_len, self.verify_span(reach, K))
        batch.anchor[:b], batch.anchor_pos[:b] = anchor, anchor_pos
        kept = keep_len if K else torch.zeros_like(n_commit)
        host = torch.cat([commit, n_commit[:, None], kept[:, None]], dim=1)  # [b, block + 2]
        drafting = Interval(self.device)
        if ahead:  # the next draft: this step's inputs, from the anchors it just moved on
            drafting.start()
            inputs = self.staging.fixed_inputs(DraftInputs.size(b, len(self.graphs.policy.rhos)))
            advance = longest_row(self.block, K)  # an anchor moves on at most this far
            out = self.graphs.get("draft", b)(batch.anchor[:b], batch.anchor_pos[:b], batch.last[:b], inputs,
                                              self.draft_span(reach + advance))
            host = torch.cat([host.double().flatten(), out[4].double()])  # token ids < 2^53: exact
            drafting.stop()
        host = host.cpu()  # the step's one copy to the host
        made = Ahead(batch.version, b, Draft.from_graph(out, host[-2:])) if ahead else None
        host = host[:-2].long().view(b, -1) if ahead else host
        return (host[:, :-2], host[:, -2], host[:, -1]), made, drafting.seconds

    # ---- admission -------------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, rows: list[int], requests: list[Request], batch: Batch | None = None,
                write: bool = True) -> torch.Tensor:
        """Run the prompts of `requests` into cache `rows` (eager, one padded batch), with the drafter's
        context for them (write=False: only their taps held, for a later catch-up); returns the first
        generated token of each [n]. Its host inputs go over in one copy. With a batch: the requests take
        the rows there, each first token as its anchor. `prompt_context` times the drafter's part (its
        seconds are read after the first tokens reach the host)."""
        lengths = [len(r.prompt) for r in requests]
        layout, last = prefill_layout(rows, lengths)
        parts = [self.staging.put(part) for part in (
            layout.row, layout.pos, layout.slot, last, [t for r in requests for t in r.prompt], rows, lengths,
            [r.index for r in requests], [r.last_pos for r in requests])]
        self.staging.send()
        row, pos, slot, last, tokens, idx, lengths, ids, last_pos = (p.device.long() for p in parts)
        layout = dataclasses.replace(layout, row=row, pos=pos, slot=slot)
        logits, taps = self.target(tokens, layout, logits_idx=last, taps=self.graphs.taps)
        self.prompt_context = Interval(self.device)  # read once the first tokens reached the host
        if self.drafter is not None:
            self.prompt_context.start()
            self.drafter.add_context(taps, layout.row, layout.pos, write=write)
            self.prompt_context.stop()
        first = sample(logits, self.temperature, self.top_p, sample_keys(self.seed, ids, lengths))
        if batch is not None:
            batch.anchor[idx], batch.anchor_pos[idx], batch.request_ids[idx] = first, lengths, ids
            batch.last[idx] = last_pos
            batch.place(rows, requests, written=write)
        return first
