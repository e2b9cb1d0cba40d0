"""The engine: continuous batching over B cache rows, one speculative step at a time.

A step (PAPER.md section 3, steps 1-7):
  draft graph   drafter fills a block per row -> confidences [B, D] -> prefix scores -> keep_len [n_rho, B]
                and gain [n_rho] for every rho in the grid -> rho* = argmax gain / cost   (one graph per B)
  host          rho*.item(): the one host sync of the step; it picks the verify graph
  verify graph  pack anchor + kept prefix of every row into T = B + K(rho*) tokens -> target forward ->
                accept -> commit accepted drafts + bonus -> write the drafter's context K/V  (one graph
                per (B, K(rho*)); while drafting is switched off, an AR variant only stores the
                drafter's context features, and the next drafting step catches its K/V up)
  host          copy the committed tokens [B, block] once, stop finished requests, admit new ones.
`ar` runs the verify graph with K = 0 (one token per row) and never drafts.
"""

from __future__ import annotations

import collections
import functools
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import dcut
from .model import Transformer, causal_layout, prefill_layout
from .sampling import accept, sample

COMPILE_CACHE = Path(__file__).resolve().parent.parent / "compile_cache"


def use_compile_cache(path: Path = COMPILE_CACHE) -> None:
    """Keep inductor's compiled kernels and graphs under compile_cache/ so a second run starts fast.
    A cache dir the user chose is kept; torch's own default (which importing torch._dynamo writes into
    the environment) is not a choice."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path / "inductor")


@dataclass
class Request:
    index: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    done: bool = False


@dataclass
class Stats:
    """Running counters of a generate() call (PAPER.md section 5 names)."""

    policy: str = ""
    batch_size: int = 0
    requests: int = 0
    generated_tokens: int = 0
    finished: int = 0
    steps: int = 0
    request_steps: int = 0  # live requests summed over target forwards
    committed: int = 0  # tokens committed by decode steps (bonus included)
    drafted: int = 0  # draft positions of live requests, over drafting steps
    kept: int = 0  # drafts sent to verification
    predicted_raw: float = 0.0  # sum over drafting steps of the chosen rho's expected accepted drafts
    predicted: float = 0.0  # the same after calibration (what the policy decided on)
    realized: int = 0  # accepted drafts over the same steps
    drafting_request_steps: int = 0  # live requests summed over drafting steps
    rho_hist: collections.Counter = field(default_factory=collections.Counter)
    seconds: collections.Counter = field(default_factory=collections.Counter)  # draft/verify/bookkeeping/prefill

    @property
    def decode_seconds(self) -> float:
        return sum(v for k, v in self.seconds.items() if k != "prefill")

    @property
    def tau(self) -> float:
        return self.committed / max(self.request_steps, 1)

    @property
    def keep_ratio(self) -> float:
        return self.kept / max(self.drafted, 1)

    def as_dict(self) -> dict:
        total = self.decode_seconds + self.seconds["prefill"]
        return {"policy": self.policy, "batch_size": self.batch_size, "requests": self.requests,
                "generated_tokens": self.generated_tokens, "decode_seconds": self.decode_seconds,
                "tokens_per_second": self.generated_tokens / total if total else 0.0,
                "tau": self.tau, "keep_ratio": self.keep_ratio, "steps": self.steps,
                "rho_histogram": {f"{k:g}": v for k, v in sorted(self.rho_hist.items())},
                "predicted_accepted_raw": self.predicted_raw, "predicted_accepted": self.predicted,
                "realized_accepted": self.realized, "drafting_request_steps": self.drafting_request_steps,
                "seconds": dict(self.seconds)}


class Engine:
    """Batched generation with one target, an optional DFlash drafter and a policy (policy.py)."""

    def __init__(self, target: Transformer, drafter=None, policy=None, batch_size: int = 8,
                 max_seq: int = 512, temperature: float = 0.0, top_p: float = 1.0,
                 eos_ids=None, compile: bool = True):
        from .policy import Policy
        self.target, self.drafter = target, drafter
        self.policy = policy or Policy.ar()
        if self.policy.needs_drafter and drafter is None:
            raise ValueError(f"policy {self.policy.name!r} needs a drafter")
        self.B, self.temperature, self.top_p = batch_size, temperature, top_p
        self.eos = set(target.cfg.eos_token_ids if eos_ids is None else eos_ids)
        self.block = drafter.block_size if drafter is not None else 1
        self.D = self.block - 1
        self.max_seq = max_seq
        self.Ks = [dcut.budget(r, batch_size, self.D) for r in self.policy.rhos] if drafter else [0]
        self.device = target.lm_head.weight.device
        target.setup_cache(batch_size, max_seq)
        if drafter is not None:
            drafter.setup_cache(batch_size, max_seq)
        self.policy.configure(batch_size, self.D)
        if drafter is not None and self.policy.skip_drafting and not self.policy.drafting_possible:
            drafter = self.drafter = None  # the cost table rules drafting out at this B: plain AR graphs
        self.taps = drafter.taps if drafter is not None else ()
        self.compile = compile
        self.graphs: dict[tuple, callable] = {}
        if compile:
            use_compile_cache()
            # One graph per (B, K): more cache entries than dynamo's default of 8 per function, and
            # never a silent fall back to eager when they run out.
            cfg = torch._dynamo.config  # the limits count per function, over the whole process
            cfg.recompile_limit = max(cfg.recompile_limit, 64) + len(self.Ks) + 2
            cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 256) + len(self.Ks) + 2
            torch._dynamo.config.fail_on_recompile_limit_hit = True

    # ---- compiled step functions -------------------------------------------------------------

    def graph(self, kind: str, K: int = 0, kv: bool = True):
        """The callable for a draft graph (kind 'draft') or a verify graph with K kept drafts (kv:
        whether it writes the drafter's context K/V, or only stores its features)."""
        key = (kind, self.B, K, kv)
        if key not in self.graphs:
            fn = self._draft if kind == "draft" else functools.partial(self._verify, K=K, kv=kv)
            if self.compile:
                fn = torch.compile(fn, mode="reduce-overhead", fullgraph=True, dynamic=False)
            self.graphs[key] = fn
        return self.graphs[key]

    def _draft(self, anchor, anchor_pos, limit, cost, n_live, scale):
        """Draft one block per row and run the D-cut selector for every rho of the policy's grid.
        anchor, anchor_pos, limit [B]; cost [n_rho]; n_live, scale [] (calibration of the gain) ->
        drafts [B, D], keep_len [n_rho, B], rho index [], expected accepted drafts [n_rho],
        log prefix scores [B, D]."""
        logits = self.drafter(self.target, anchor, anchor_pos)  # [B, D, V]
        # The greedy drafts and their softmax probabilities [B, D]: one fused softmax pass, then max.
        conf, drafts = torch.softmax(logits.float(), dim=-1).max(dim=-1)
        log_s = dcut.prefix_scores(conf, limit)  # [B, D]
        keep_len = dcut.keep_lens(log_s, self.Ks)  # [n_rho, B]
        gain = dcut.gains(log_s, self.Ks, None)  # [n_rho] expected accepted drafts, uncalibrated
        total = scale * gain + (n_live if self.policy.count_anchors else 0)
        return drafts, keep_len, dcut.choose_rho(total, cost), gain, log_s

    def _verify(self, anchor, anchor_pos, drafts, keep_len, K: int, kv: bool = True):
        """Pack, verify, accept (PAPER.md section 3 step 6-7 and section 4).
        anchor, anchor_pos [B]; drafts [B, D]; keep_len [B] with sum K ->
        commit [B, block] (accepted drafts then the bonus), n_commit [B], new anchor, new anchor_pos."""
        B, dev = anchor.shape[0], anchor.device
        Q = min(self.block, K + 1)  # the longest row: anchor + at most min(D, K) drafts
        T = B + K
        if K == 0:  # an AR step: one token per row
            src = torch.arange(B, device=dev)  # [T]
            tokens = anchor
        else:
            grid = torch.cat([anchor[:, None], drafts[:, : Q - 1]], dim=1)  # [B, Q]
            valid = torch.arange(Q, device=dev) <= keep_len[:, None]  # [B, Q]: anchor + kept prefix
            # Dense packing: cell (i, j) goes to packed index (#valid cells before it); the others
            # go to a dump slot T that is cut off. Exactly T cells are valid since sum(keep_len) = K.
            dest = torch.where(valid.flatten(), valid.flatten().cumsum(0) - 1, T)  # [B*Q]
            src = torch.zeros(T + 1, dtype=torch.long, device=dev).scatter_(
                0, dest, torch.arange(B * Q, device=dev))[:T]  # [T] grid cell of each packed token
            tokens = grid.flatten()[src]  # [T]
        row, col = src // Q, src % Q
        pos = anchor_pos[row] + col  # [T]
        layout = causal_layout(row, pos, col, B, Q, self.max_seq)
        logits, taps = self.target(tokens, layout, taps=self.taps)  # [T, V], [T, n_taps*H]
        choice = sample(logits, self.temperature, self.top_p)  # [T] the target's token after each
        choice_grid = torch.full((B * Q,), -1, dtype=torch.long, device=dev).index_copy(0, src, choice)
        choice_grid = choice_grid.view(B, Q)  # [B, Q]; -1 (never a token) where nothing was verified
        commit = torch.zeros(B, self.block, dtype=torch.long, device=dev)
        if K == 0:
            accepted = torch.zeros(B, dtype=torch.long, device=dev)
        else:
            accepted = accept(drafts[:, : Q - 1], keep_len, choice_grid)  # [B]
            commit[:, : Q - 1] = drafts[:, : Q - 1]
        bonus = choice_grid.gather(1, accepted[:, None])  # [B, 1]
        commit.scatter_(1, accepted[:, None], bonus)
        if self.drafter is not None:
            self.drafter.add_context(taps, row, pos, kv=kv)
        # Empty rows keep stepping too; the clamp keeps their positions inside the cache (a live
        # row never reaches it: generate() checks prompt + max_new_tokens + block <= max_seq).
        new_pos = (anchor_pos + accepted + 1).clamp(max=self.max_seq - self.block - 1)
        return commit, accepted + 1, bonus[:, 0], new_pos

    @torch.inference_mode()
    def warmup(self) -> None:
        """Run (and so compile) every graph this engine's policy can reach, on empty rows."""
        B, dev = self.B, self.device

        def zeros():  # a fresh tensor per argument: aliased inputs would be guarded on and recompile
            return torch.zeros(B, dtype=torch.long, device=dev)
        if self.drafter is None or 0 in self.Ks:  # AR steps; with a drafter: drafting chose rho = 0
            self.graph("verify", 0)(zeros(), zeros(), None, None)
        if self.drafter is not None and (self.policy.skip_drafting or not self.policy.needs_drafter):
            self.graph("verify", 0, kv=False)(zeros(), zeros(), None, None)  # steps that do not draft
        if self.drafter is None or not self.policy.needs_drafter:
            return
        drafts, keep_lens = self.graph("draft")(zeros(), zeros(), zeros(), self.policy.cost_vector(B, dev),
                                                torch.tensor(0.0, device=dev), torch.tensor(1.0, device=dev))[:2]
        for ri, K in enumerate(self.Ks):
            if K:
                self.graph("verify", K)(zeros(), zeros(), drafts, keep_lens[ri].clone())

    # ---- host side ---------------------------------------------------------------------------

    def _prefill(self, slots: list[int], reqs: list[Request], kv: bool = True) -> torch.Tensor:
        """Run the prompts of `reqs` into cache rows `slots` (eager, one padded batch); returns the
        first generated token of each [n]. kv: also write the drafter's context K/V (else only its
        features)."""
        layout, last = prefill_layout(slots, [len(r.prompt) for r in reqs], self.device)
        tokens = torch.tensor([t for r in reqs for t in r.prompt], device=self.device)
        logits, taps = self.target(tokens, layout, logits_idx=last, taps=self.taps)
        if self.drafter is not None:
            self.drafter.add_context(taps, layout.row, layout.pos, kv=kv)
        return sample(logits, self.temperature, self.top_p)

    def _sync_drafter(self, slots: list, synced: list[int]) -> None:
        """Before drafting: write the drafter's context K/V of positions committed while drafting
        was off (from the stored features; eager, only after skipped steps)."""
        rows, pos = [], []
        for i, r in enumerate(slots):
            if r is not None:
                anchor_pos = len(r.prompt) + len(r.output) - 1  # the anchor's position
                rows += [i] * (anchor_pos - synced[i])
                pos += range(synced[i], anchor_pos)
                synced[i] = anchor_pos
        if pos:
            self.drafter.sync_context(torch.tensor(rows, device=self.device), torch.tensor(pos, device=self.device))

    def _emit(self, req: Request, tokens) -> None:
        """Append tokens to a request until EOS or max_new_tokens (a block can end mid-way: trim)."""
        for t in tokens:
            req.output.append(int(t))
            if int(t) in self.eos or len(req.output) >= req.max_new_tokens:
                req.done = True
                return

    def validate(self, prompts: list[list[int]], max_new_tokens: int) -> None:
        V = self.target.cfg.vocab_size
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
            bad = next(((j, t) for j, t in enumerate(p) if not 0 <= t < V), None)
            if bad is not None:
                raise ValueError(f"prompt {i}: token id {bad[1]} at position {bad[0]} is outside the "
                                 f"vocabulary [0, {V})")
            if len(p) + max_new_tokens + self.block > self.max_seq:
                raise ValueError(f"prompt {i}: {len(p)} prompt tokens + {max_new_tokens} new tokens "
                                 f"(+ {self.block} block) exceed the context of {self.max_seq}")

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, on_step=None, trace=None):
        """Generate for every prompt with at most B at a time; returns (outputs in input order, Stats).
        on_step(stats, current_rho) is called after every step (for a live view). A `trace` list gets,
        for every drafting step, (prefix scores s [n_live, D], keep_len [n_live], accepted [n_live]) of
        the live requests (an extra host copy per step: for evaluation, not for speed)."""
        self.validate(prompts, max_new_tokens)
        reqs = [Request(i, list(p), max_new_tokens) for i, p in enumerate(prompts)]
        pending = collections.deque(reqs)
        stats = Stats(policy=self.policy.label, batch_size=self.B, requests=len(reqs))
        slots: list[Request | None] = [None] * self.B
        synced = [0] * self.B  # per row: positions below this have the drafter's context K/V
        stale = False  # whether a step since the last drafting step skipped the drafter's K/V
        dev, B = self.device, self.B
        anchor = torch.zeros(B, dtype=torch.long, device=dev)
        anchor_pos = torch.zeros(B, dtype=torch.long, device=dev)
        self.policy.configure(B, self.D)  # a no-op unless another engine reconfigured a shared policy
        costs = self.policy.cost_vector(B, dev)  # [n_rho], fixed for this call
        while pending or any(slots):
            t0 = time.perf_counter()
            free = [i for i in range(B) if slots[i] is None][: len(pending)]
            if free:  # continuous batching: admit waiting requests into free rows
                new = [pending.popleft() for _ in free]
                # While drafting is off, the prefill only stores the drafter's features: the next
                # probe catches their K/V up, and a request that ends before it never needs them.
                kv = self.drafter is not None and self.policy.drafting_on
                first = self._prefill(free, new, kv=kv).tolist()
                stale = stale or not kv
                for i, r, tok in zip(free, new, first):
                    synced[i] = len(r.prompt) if kv else 0  # positions with the drafter's context K/V
                    self._emit(r, [tok])
                    stats.generated_tokens += 1
                    stats.finished += r.done
                    slots[i] = None if r.done else r
                idx = torch.tensor(free, device=dev)
                anchor[idx] = torch.tensor(first, device=dev)
                anchor_pos[idx] = torch.tensor([len(r.prompt) for r in new], device=dev)
                stats.seconds["prefill"] += time.perf_counter() - t0
                if not any(slots):
                    continue
            live = [s is not None for s in slots]
            n_live = sum(live)
            # Drafts a request can still use: its remaining tokens minus the bonus; 0 for empty rows.
            limit = [r.max_new_tokens - len(r.output) - 1 if r else 0 for r in slots]
            t0 = time.perf_counter()
            K, rho = 0, 0.0
            t_step, catchup = t0, 0.0
            drafting = self.drafter is not None and self.policy.draft_now()
            if drafting:
                if stale:  # the catch-up is a cost of the skipped steps (of the probe that ends them)
                    self._sync_drafter(slots, synced)
                    catchup = time.perf_counter() - t0
                t_step = time.perf_counter()  # this step's own seconds start here
                drafts, keep_lens, rho_idx, gain, log_s = self.graph("draft")(
                    anchor, anchor_pos, torch.tensor(limit, device=dev), costs,
                    torch.tensor(float(n_live), device=dev), torch.tensor(self.policy.gain_scale, device=dev))
                ri = int(rho_idx.item())  # the one host sync: it picks the verify graph
                K, rho, keep_len = self.Ks[ri], self.policy.rhos[ri], keep_lens[ri]
                t1 = time.perf_counter()
                stats.seconds["draft"] += t1 - t0
                t0 = t1
            else:
                drafts = keep_len = None
            # A step that drafted writes the drafter's context K/V (the next one will likely draft
            # too); a step that did not only stores the features (see drafter.sync_context).
            verify = self.graph("verify", K, kv=drafting or self.drafter is None)
            stale = not drafting  # a drafting step leaves every row synced up to its new anchor
            commit, n_commit, anchor, anchor_pos = verify(anchor, anchor_pos, drafts, keep_len)
            kept = keep_len if K else torch.zeros_like(n_commit)
            host = torch.cat([commit, n_commit[:, None], kept[:, None]], dim=1).cpu()  # [B, block + 2]
            anchor, anchor_pos = anchor.clone(), anchor_pos.clone()  # outlive the graph's output buffers
            t1 = time.perf_counter()
            stats.seconds["verify"] += t1 - t0
            # Bookkeeping: commit tokens, finish requests.
            if trace is not None and drafts is not None:
                rows = [i for i in range(B) if live[i]]
                trace.append((log_s[rows].exp().cpu(), host[rows, -1].clone(), host[rows, -2] - 1))
            accepted_live = 0
            for i, r in enumerate(slots):
                if r is None:
                    continue
                n = int(host[i, -2])
                stats.kept += int(host[i, -1])
                accepted_live += n - 1
                before = len(r.output)
                self._emit(r, host[i, :n].tolist())
                if drafting:  # context K/V now written up to the new anchor
                    synced[i] = len(r.prompt) + before + n - 1
                stats.generated_tokens += len(r.output) - before
                if r.done:
                    stats.finished += 1
                    slots[i] = None
            stats.steps += 1
            stats.request_steps += n_live
            stats.committed += accepted_live + n_live
            stats.rho_hist[rho] += 1
            if drafts is not None:
                stats.drafted += n_live * self.D
                predicted = float(gain[ri])
                stats.predicted_raw += predicted
                stats.predicted += predicted * self.policy.gain_scale
                stats.realized += accepted_live
                stats.drafting_request_steps += n_live
            t2 = time.perf_counter()
            stats.seconds["bookkeeping"] += t2 - t1
            if drafts is not None:
                self.policy.observe(predicted, accepted_live, K, n_live, rho, seconds=t2 - t_step,
                                    catchup=catchup)
            else:
                self.policy.observe(None, 0, 0, seconds=t2 - t_step)
            if on_step is not None:
                on_step(stats, rho)
        return [r.output for r in reqs], stats
