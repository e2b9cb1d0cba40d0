"""The two decode graphs of a step, and their cache of compiled callables (docs/method.md, "One D-cut step").

draft   (one per bucket b) drafter block -> confidences -> dcut.select (prefix scores, keep_len and
        gain of every rho) -> rho* = Policy.choose; [rho*, its gain] is what comes to the host
verify  (one per (bucket b, budget K, write)) pack anchor + kept prefix of every row into T = b + K
        tokens -> target forward -> the target's (keyed) choice at every position -> accept -> commit
        [b, block], and the drafter's context of the verified tokens (write: its K/V; else only the
        target's taps are held for a later catch-up)

Compiled (torch.compile(mode="reduce-overhead"), fullgraph, static shapes): one graph per key, made on
first use and announced by on_compile(message). Eager: the same functions, called as they are.

The draft graph's host inputs are one vector whose layout lives here alone (DraftInputs).
"""

from __future__ import annotations

import collections
import functools
import hashlib
import json
import time
from dataclasses import dataclass

import torch

from .dcut import budget, select
from .model import causal_layout
from .policy import StepPlan
from .runtime import COMPILE_CACHE, write_atomically
from .sampling import accept, sample, sample_keys

REPLAYED = 3  # runs after which a compiled graph is compiled, recorded (reduce-overhead) and replayed


class DraftInputs:
    """The draft graph's host inputs, one vector [b + 1 + n_rho]: which rows are live [b] (1 or 0),
    gain_scale, cost [n_rho] (the plan's seconds per rho). What each row may still draft is not among
    them: the graph derives it from the row's anchor position and its last position (Batch.last)."""

    @staticmethod
    def size(b: int, n_rho: int) -> int:
        return b + 1 + n_rho

    @staticmethod
    def pack(live: list[bool], plan: StepPlan) -> list[float]:
        return [float(x) for x in live] + [plan.gain_scale] + list(plan.cost)

    @staticmethod
    def unpack(inputs: torch.Tensor, b: int):
        """-> live [b] (0/1), gain_scale, cost [n_rho]."""
        return inputs[:b], inputs[b], inputs[b + 1 :]


def longest_row(block: int, K: int) -> int:
    """Tokens of the longest row a verification with K kept drafts packs: its anchor and at most
    min(D, K) drafts (D = block - 1)."""
    return min(block, K + 1)


@dataclass
class Draft:
    """What the draft graph decided, on the device, and the chosen rho index (host)."""

    drafts: torch.Tensor  # [b, D]
    keep_lens: torch.Tensor  # [n_rho, b]
    gain: torch.Tensor  # [n_rho] expected accepted drafts (uncalibrated)
    log_s: torch.Tensor  # [b, D] log prefix scores
    rho_index: int
    predicted: float  # gain[rho_index], on the host

    @classmethod
    def from_graph(cls, out, pick: torch.Tensor) -> "Draft":
        """From the draft graph's outputs and its pick on the host. Copies: a CUDA graph's outputs are
        overwritten when it replays."""
        return cls(*(t.clone() for t in out[:4]), rho_index=int(pick[0]), predicted=float(pick[1]))


class Graphs:
    """The draft and verify functions of one engine's models and settings, compiled or not, by key."""

    def __init__(self, target, drafter, policy, block: int, max_seq: int, temperature: float, top_p: float,
                 seed: int, compile: bool, on_compile=None):
        self.target, self.drafter, self.policy = target, drafter, policy
        self.block, self.D, self.max_seq = block, block - 1, max_seq
        self.temperature, self.top_p, self.seed = temperature, top_p, seed
        self.taps = drafter.taps if drafter is not None else ()
        self.compile, self.on_compile = compile, on_compile  # on_compile(message) before a graph compiles
        self.graphs: dict[tuple, callable] = {}
        self.calls: collections.Counter = collections.Counter()  # runs of each graph (warmup checks)
        self.cold_calls = 0  # runs of compiled graphs not yet warm (counted)
        self.compile_seconds: dict[tuple, float] = {}  # each compiled graph's first run (its compiling), by key
        self.budget_tensors: dict[int, torch.Tensor] = {}  # budget_tensor's, by bucket
        self.record = COMPILE_CACHE / "graph_seconds.json"  # seconds a graph took to compile here, by machine and models

    def signature(self) -> str:
        """What a graph's compile time depends on: the device, the models' configs and dtypes, the cache size."""
        dev = self.target.lm_head.weight.device
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        parts = [name, repr(self.target.cfg), str(self.target.lm_head.weight.dtype), str(self.max_seq)]
        if self.drafter is not None:
            parts += [repr(self.drafter.cfg), str(self.drafter.fc.weight.dtype)]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]

    def seconds_per_graph(self) -> float | None:
        """The seconds a graph took to compile the last time these models compiled here (None: never)."""
        try:
            return float(json.loads(self.record.read_text())[self.signature()])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def remember(self, seconds_per_graph: float) -> None:
        try:
            saved = json.loads(self.record.read_text()) if self.record.is_file() else {}
        except (OSError, ValueError):
            saved = {}
        saved = saved if isinstance(saved, dict) else {}
        saved[self.signature()] = round(seconds_per_graph, 2)
        write_atomically(self.record, lambda tmp: tmp.write_text(json.dumps(saved, indent=1) + "\n"))

    def budgets(self, b: int) -> list[int]:
        """K(rho) for every rho of the policy's grid at bucket b."""
        return [budget(r, b, self.D) for r in self.policy.rhos] if self.drafter is not None else [0]

    def budget_tensor(self, b: int, device) -> torch.Tensor:
        """budgets(b) on the device, made once per bucket: an eager draft then copies nothing in (two
        host-to-device copies a draft on a GPU otherwise)."""
        if b not in self.budget_tensors:
            self.budget_tensors[b] = torch.tensor(self.budgets(b), device=device)
        return self.budget_tensors[b]

    def get(self, kind: str, b: int, K: int = 0, write: bool = True, note: str = ""):
        """The callable of a draft graph (kind 'draft') or of a verify graph with K kept drafts, at
        bucket b (write: whether it writes the drafter's context K/V or only holds the target's taps).
        Compiled ones are made on first use, announced by on_compile("compiling ... b=4 K=15" + note)."""
        key = (kind, b, K, write)
        if key not in self.graphs:
            fn = self.draft if kind == "draft" else functools.partial(self.verify, K=K, write=write)
            if self.compile:
                if self.on_compile is not None:
                    self.on_compile(f"compiling {self.name(key)}{note}")
                fn = torch.compile(fn, mode="reduce-overhead", fullgraph=True, dynamic=False)
            self.graphs[key] = self.counted(key, fn)
        return self.graphs[key]

    @staticmethod
    def name(key: tuple) -> str:
        """'draft graph b=4', 'verify graph b=4 K=15', 'verify graph b=4 K=0 no-draft' (a step that does not
        draft: only the target's taps held): a graph key (kind, b, K, write), as said to users."""
        kind, b, K, write = key
        return f"{kind} graph b={b}" + (f" K={K}" if kind == "verify" else "") + ("" if write else " no-draft")

    def counted(self, key: tuple, fn):
        """fn, counting its runs in self.calls[key], and in self.cold_calls a compiled graph's first
        REPLAYED runs (compiling, recording its CUDA graph, its first replay: no step's time); the
        seconds of a compiled graph's first run (its compiling) go to self.compile_seconds[key]. The
        optional span is always passed (None if not given): a compiled graph called with another number
        of arguments would compile again."""
        n = 5 if key[0] == "draft" else 6

        def run(*args):
            if self.compile and self.calls[key] < REPLAYED:
                self.cold_calls += 1
            self.calls[key] += 1
            if not self.compile or key in self.compile_seconds:
                return fn(*args, *[None] * (n - len(args)))
            t0 = time.perf_counter()
            out = fn(*args, *[None] * (n - len(args)))
            self.compile_seconds[key] = time.perf_counter() - t0
            return out
        return run

    def draft(self, anchor, anchor_pos, last, inputs, span=None):
        """Draft one block per row and run the D-cut selector for every rho of the grid.
        anchor, anchor_pos, last [b] (last: the position of the last token each row may commit);
        inputs [b + 1 + n_rho] (DraftInputs); span: cache positions read (None: all) -> drafts [b, D],
        keep_len [n_rho, b], expected accepted drafts [n_rho], log prefix scores [b, D], [rho index, its
        expected accepted drafts] [2]."""
        b = anchor.shape[0]
        live, gain_scale, cost = DraftInputs.unpack(inputs, b)
        n_live = live.sum()
        limit = (last - anchor_pos - 1).clamp(min=0) * live.long()  # [b] drafts each row may still emit
        logits = self.drafter(self.target, anchor, anchor_pos, span)  # [b, D, V]
        # The greedy drafts and their softmax probabilities [b, D]: one fused softmax pass, then max.
        conf, idx = torch.softmax(logits.float(), dim=-1).max(dim=-1)
        # Compiled, the budgets are constants of the graph; eager, a tensor made once per bucket.
        sel = select(conf, limit, self.budgets(b) if self.compile else self.budget_tensor(b, conf.device))
        rho = self.policy.choose(sel.gains, n_live, gain_scale, cost).view(1)
        pick = torch.cat([rho.to(sel.gains.dtype), sel.gains.gather(0, rho)])  # [2]: one copy to the host
        return self.drafter.tokens(idx), sel.keep_lens, sel.gains, sel.log_s, pick

    def verify(self, anchor, anchor_pos, request_ids, drafts, keep_len, span=None, K: int = 0, write: bool = True):
        """Pack, verify, accept (docs/method.md, "Verification"). anchor, anchor_pos, request_ids [b];
        drafts [b, D]; keep_len [b] with sum <= K; span: cache positions attention reads (None: all) ->
        commit [b, block] (accepted drafts then the bonus), n_commit [b], the new anchor and anchor_pos [b]."""
        b, dev = anchor.shape[0], anchor.device
        Q = longest_row(self.block, K)
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
            self.drafter.add_context(taps, row, pos, write=write)
        # Empty rows keep stepping too; the clamp keeps their positions inside the cache (a live
        # row never reaches it: Request.checked makes sure prompt + max_new_tokens + block <= max_seq).
        new_pos = (anchor_pos + accepted + 1).clamp(max=self.max_seq - self.block - 1)
        return commit, accepted + 1, bonus[:, 0], new_pos
