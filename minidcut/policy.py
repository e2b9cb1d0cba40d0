"""Verification policies: which rho grid a step may use, and (for dcut) how rho* is chosen.

  ar       no drafter, one token per step
  full     rho = 1: verify every drafted position (the DFlash baseline, fixed depth D)
  static   one fixed rho: global top-K with K = round(rho * B * D)
  dcut     rho* = argmax gain(rho) / cost(B, rho) per step, from a measured cost table (PAPER.md s.3),
           plus two additions, each can be switched off:
           - skip drafting: whether to draft at all is decided apart from how much to verify. In a
             drafting step the draft is already paid for, so rho = 0 is priced as a drafting step
             (cost of the smallest rho > 0) and the selector picks among the budgets; after the step,
             its predicted committed tokens (calibrated) are compared with what AR steps would commit
             in the same time, n_live * cost(B, rho) / cost(B, 0). The differences (per row of the
             batch: a step with few live rows weighs what it commits) are summed with
             a decay of RUN_DECAY per step (every step: evidence grows stale while drafting is off).
             When the sum says drafting loses (and the first `patience` drafting steps have run),
             stop drafting (it costs time at high B) and re-probe periodically: at most every
             `probe_every` steps, and rarely enough that probes cost <= PROBE_BUDGET of the time net
             of the drafts they usually get accepted (a long running mean: one hard stretch of requests
             must not keep drafting off for long where it usually pays), counting the catch-up of the
             drafter's context that a probe needs first. While drafting is off, new requests' prompts
             only store the drafter's features (the catch-up writes their K/V if a probe comes before
             they finish). A probe turns drafting back on only if it brings the sum above zero.
             And when the cost table says that even a drafter whose every kept draft is accepted cannot
             beat an AR step at this batch size, never draft at all (can_beat_ar);
           - calibration: the drafter's confidences are not probabilities of acceptance; a running
             ratio realized / predicted accepted drafts rescales the gain before rho* is chosen. The
             table's costs are not what the serving loop pays either (host work, a busier machine):
             running ratios measured / table step seconds, one for drafting steps and one for AR steps,
             rescale the costs that decide whether drafting pays.
           Both are online state, kept across generate() calls like a serving loop keeps it: a new
           call starts from what earlier calls learned. The skip state is per batch size (configure()
           with another B restarts it); calibration belongs to the drafter and stays. reset() forgets all.
"""

from __future__ import annotations

import torch

from .cost_model import CostTable

DEFAULT_GRID = (0.0, 0.25, 0.5, 0.75, 1.0)
PROBE_BUDGET = 0.01  # the share of decode time re-probing may cost while drafting is off (measured:
# at B = 64 here a probe every pass cost 5-6%, with the catch-up and the rows it leaves out of step)
ACCEPTED_DECAY = 0.995  # probe pricing: accepted drafts per row over ~200 drafting steps (what drafting
# usually gets; simulated on traced B = 1 steps where drafting pays 1.15x, a 20-step memory plus doubling
# the period after every failed probe reached 0.91x the best fixed policy, this 0.98x)
DECAY = 0.95  # running ratios: ~20-step memory, follows shifts and smooths single steps
RUN_DECAY = 0.98  # does drafting pay: ~50 steps of memory (one step's acceptance is noisy)


class Policy:
    def __init__(self, name: str, rhos, table: CostTable | None = None, count_anchors: bool = True,
                 calibrate: bool = True, skip_drafting: bool = True, patience: int = 4, probe_every: int = 16):
        if name not in ("ar", "full", "static", "dcut"):
            raise ValueError(f"unknown policy {name!r} (choose from ar, full, static, dcut)")
        rhos = sorted(float(r) for r in rhos)
        if any(not 0.0 <= r <= 1.0 for r in rhos):
            raise ValueError(f"rho must be in [0, 1], got {rhos}")
        if name == "dcut" and table is None:
            raise ValueError("the dcut policy needs a cost table")
        self.name, self.rhos, self.table = name, rhos, table
        self.count_anchors = count_anchors
        self.calibrate, self.skip_drafting = calibrate, skip_drafting and name == "dcut" and 0.0 in rhos
        self.patience, self.probe_every = patience, probe_every
        self.label_override: str | None = None  # e.g. "dcut:paper" in the benchmark
        self.drafting_possible, self._period = self.needs_drafter, probe_every
        self._configured: tuple[int, int] | None = None
        self._cost: dict[float, float] = {}  # the table's cost(B, rho) at the configured B (per call)
        # A drafting step that keeps nothing (rho = 0) still paid for its draft: it is priced as this one.
        self._rho_min = min((r for r in rhos if r > 0), default=0.0)
        self.reset()

    @classmethod
    def ar(cls):
        return cls("ar", [0.0])

    @classmethod
    def full(cls):
        return cls("full", [1.0])

    @classmethod
    def static(cls, rho: float):
        return cls("static", [rho])

    @classmethod
    def dcut(cls, table: CostTable, rhos=DEFAULT_GRID, **kw):
        return cls("dcut", rhos, table, **kw)

    @property
    def needs_drafter(self) -> bool:
        return self.name != "ar"

    @property
    def label(self) -> str:
        if self.label_override:
            return self.label_override
        return f"static:{self.rhos[0]:g}" if self.name == "static" else self.name

    def reset(self) -> None:
        """Forget everything learned online: calibration and the skip-drafting state."""
        self.gain_scale = 1.0  # calibration: realized / predicted accepted drafts (running)
        self._pred = self._real = 0.0
        self._reset_skip()

    def _reset_skip(self) -> None:
        self._margin = 0.0  # running sum of (predicted committed - AR-equivalent) tokens per row
        self._drafting_steps = 0  # drafting steps so far (none is judged before `patience` of them)
        self._skipped = -1  # steps since drafting was switched off; -1 while drafting is on
        self._seconds = {True: [0.0, 0.0], False: [0.0, 0.0]}  # drafting? -> running [measured, table]
        self._catchup = 0.0  # seconds the last probe spent catching the drafter's context K/V up
        self._accepted = [0.0, 0.0]  # long running [accepted drafts, live rows] of drafting steps, K > 0

    def cost_scale(self, drafting: bool) -> float:
        """Measured / table seconds of recent drafting (or AR) steps at this batch size; 1 (the table)
        before any was measured. Not borrowed from the other kind: a loop that is slow only while
        drafting would then never be caught; a wrong guess here is corrected by the next probe."""
        measured, table = self._seconds[drafting]
        return measured / table if table > 0 else 1.0

    def _table_seconds(self, drafting: bool, rho: float) -> float:
        """The table's seconds for a step at the configured B: an AR step, or a drafting step that chose
        rho (rho = 0 priced as the smallest rho > 0)."""
        return self._cost[(rho or self._rho_min) if drafting else 0.0]

    def _observe_seconds(self, drafting: bool, rho: float, seconds: float) -> None:
        if not self._cost or seconds <= 0:
            return
        table = self._table_seconds(drafting, rho)
        ratio = min(max(seconds / table, 1 / 3), 3.0)  # one outlier step (a GC pause) moves it little
        run = self._seconds[drafting]
        run[0], run[1] = DECAY * run[0] + ratio * table, DECAY * run[1] + table

    def cost_vector(self, B: int, device) -> torch.Tensor:
        """cost(B, rho) of a drafting step for the grid [n_rho]; flat for fixed policies (a single rho:
        nothing to choose). With skip drafting, rho = 0 in a drafting step still pays for the draft: it
        costs what the smallest rho > 0 does (so it wins only when no draft can be kept)."""
        costs = self.table.costs(B, self.rhos) if self.table else [1.0] * len(self.rhos)
        if self.skip_drafting and len(self.rhos) > 1:
            costs[0] = costs[1]  # rhos are sorted and 0 is in the grid (skip_drafting requires it)
        return torch.tensor(costs, dtype=torch.float32, device=device)

    def step_value(self, predicted: float, n_live: int, rho: float) -> tuple[float, float]:
        """A drafting step that chose rho, per live row and on calibrated numbers: (predicted committed
        tokens, 1 + gain_scale * predicted accepted drafts / n_live; the tokens AR steps would commit
        in the same time, cost(B, rho) * cost_scale(drafting) / (cost(B, 0) * cost_scale(AR))).
        rho = 0 in a drafting step: nothing kept, the draft paid (the smallest rho > 0's cost).
        Needs a table and configure()."""
        if rho == 0.0:
            predicted = 0.0
        draft = self._table_seconds(True, rho) * self.cost_scale(True)
        ar = self._table_seconds(False, 0.0) * self.cost_scale(False)
        return 1.0 + self.gain_scale * predicted / max(n_live, 1), draft / ar

    def can_beat_ar(self, B: int, D: int) -> bool:
        """Whether any rho > 0 could out-run an AR step at batch size B even if every kept draft were
        accepted: max (B + K(rho)) / cost(B, rho) > B / cost(B, 0). Always True without a table or
        without rho = 0 in the grid (nothing to compare with)."""
        if self.table is None or 0.0 not in self.rhos:
            return True
        ar = B / self.table.cost(B, 0.0)
        return any((B + round(r * B * D)) / self.table.cost(B, r) > ar for r in self.rhos if r > 0)

    def probe_period(self, B: int) -> int:
        """Steps between probes while drafting is off, so that probes cost <= PROBE_BUDGET of the AR
        steps' time. A probe is a drafting step: it takes cost(B, rho) instead of cost(B, 0), but it
        also commits the drafts it gets accepted (what drafting steps usually get: `accepted` per row,
        a long running mean), which AR steps would have taken (1 + accepted) steps for; and before it,
        the drafter's context K/V of the skipped steps is caught up (measured at the last probe: it
        grows with the period, so where it costs more than PROBE_BUDGET of the skipped steps, each
        probe makes the next one rarer). Costs are calibrated (cost_scale)."""
        if self.table is None or 0.0 not in self.rhos or len(self.rhos) < 2:
            return self.probe_every
        ar = self.table.cost(B, 0.0) * self.cost_scale(False)
        draft = self.table.cost(B, self._rho_min) * self.cost_scale(True)
        accepted = self._accepted[0] / self._accepted[1] if self._accepted[1] > 0 else 0.0
        loss = draft - ar * (1.0 + accepted) + self._catchup  # seconds a probe loses against AR steps
        return max(self.probe_every, int(loss / (PROBE_BUDGET * ar)) + 1)

    def configure(self, B: int, D: int) -> None:
        """Called by the engine with its batch size and draft depth."""
        if self._configured != (B, D):  # whether drafting pays depends on B: learn it again
            self._configured = (B, D)
            self._reset_skip()
        self._cost = dict(zip(self.rhos, self.table.costs(B, self.rhos))) if self.table else {}
        self.drafting_possible = self.needs_drafter and (not self.skip_drafting or self.can_beat_ar(B, D))
        self._period = self.probe_period(B)

    @property
    def drafting_on(self) -> bool:
        """Whether drafting is on now (False while it is switched off, probes aside)."""
        return self.drafting_possible and self._skipped < 0

    def draft_now(self) -> bool:
        """False while drafting is switched off; every probe period one probe drafts again."""
        if self.drafting_on or not self.drafting_possible:
            return self.drafting_on
        self._skipped += 1
        return self._skipped >= self._period

    def observe(self, predicted: float | None, realized: int, K: int, n_live: int = 1, rho: float = 0.0,
                seconds: float = 0.0, catchup: float = 0.0) -> None:
        """After a step: predicted (uncalibrated expected accepted drafts of the chosen rho, None if the
        step did not draft), realized accepted drafts, the chosen budget K and rho, live requests, the
        step's measured seconds (0: not measured), and the seconds spent before it catching the
        drafter's context up after skipped steps (a probe's; 0 otherwise)."""
        if catchup > 0:
            self._catchup = catchup
        if self.calibrate:
            self._observe_seconds(predicted is not None, rho, seconds)
        self._margin *= RUN_DECAY
        if predicted is None:
            return
        if K > 0:
            run = self._accepted
            run[0], run[1] = ACCEPTED_DECAY * run[0] + realized, ACCEPTED_DECAY * run[1] + n_live
        if self.calibrate and K > 0:
            self._pred = DECAY * self._pred + predicted
            self._real = DECAY * self._real + realized
            if self._pred > 1.0:
                self.gain_scale = min(max(self._real / self._pred, 0.05), 20.0)
        if self.skip_drafting and self._cost:
            self._observe_skip(predicted if K > 0 else 0.0, n_live, rho if K > 0 else 0.0)

    def _observe_skip(self, predicted: float, n_live: int, rho: float) -> None:
        """Switch drafting off when recent drafting steps lose to AR steps on balance; back on when a
        probe tips the balance."""
        value, ar_equiv = self.step_value(predicted, n_live, rho)
        # Tokens gained over AR steps in this step's time, per row of the batch: a step with few live
        # rows (the end of a batch: each keeps more of the budget) counts for what it commits.
        self._margin += (value - ar_equiv) * n_live / self._configured[0]
        self._drafting_steps += 1
        if self._skipped < 0:  # drafting is on
            if self._margin < 0 and self._drafting_steps >= self.patience:
                self._skipped = 0  # switch drafting off
        elif self._margin > 0:  # a probe that tips the balance: drafting back on
            self._skipped = -1
        else:  # keep drafting off until the next probe
            self._skipped = 0
        if self._skipped == 0:  # priced on what was just learned
            self._period = self.probe_period(self._configured[0])
