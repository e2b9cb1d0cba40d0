"""Skip drafting: whether to draft at all at one batch size (docs/method.md, "Skipping drafting").

The paper's rule picks how much to verify once a block is drafted; at a large batch size even rho = 0
can lose, because the draft itself costs time. This controller decides apart from the rule, with an
explicit state:

  drafting   every step drafts. After each drafting step the tokens it committed per row are
             compared with what AR steps commit in the same time; the differences,
             weighted by the step's share of live rows, are summed with a decay (RUN_DECAY per
             drafting step: the sum remembers drafting steps, probes included, not AR steps). When the
             sum is negative (after `patience` drafting steps), drafting goes off.
  off        AR steps. A step probes once the AR steps since drafting went off have earned its price.
  probing    one drafting step; if it tips the sum above zero drafting is on again, else off again.

The sum never falls below -FLOOR: probes that keep losing pile up evidence, so one lucky probe does not
turn drafting back on (each false start costs several losing drafting steps), while a lasting change
(prompts the drafter suits) turns it on within a few probes.

A probe costs a drafting step instead of an AR step (priced at the dearest budget the rule may pick),
gains the drafts drafting usually gets accepted (a long running mean), and first writes the drafter's
context of every position committed while drafting was off (the catch-up, priced per position as the
last one measured it). Each AR step while off earns PROBE_BUDGET of its seconds; a probe runs once
those earnings pay its price at that step, and never sooner than probe_every steps. The catch-up
grows with every skipped step, so where it grows faster than the earnings a probe waits for rows
that have little to catch up (requests admitted since: their prompts, held at the prefill, and
nothing more).

Step seconds are the cost table's entries, as the loop's own steps refine them (CostTable.refine).
Where the table says no rho > 0 can beat an AR step even if every kept draft were accepted, the
controller never drafts (`possible` is False). Without a table row for this batch size it does not
draft either: it has nothing to compare with. The same test on the live rows: a step whose rows are
too near their ends to pay even if every draft they can still emit were accepted runs AR (a batch's
last steps), and such a drafting step (the profiler times some on whatever rows it finds) is not
counted: it says nothing about drafting at this batch size.
"""

from __future__ import annotations

from .dcut import budget

PROBE_BUDGET = 0.01  # the share of decode time probing may cost while drafting is off
RUN_DECAY = 0.98  # memory of the drafting-vs-AR sum: ~50 drafting steps (one step's acceptance is noisy)
FLOOR = 2.0  # the sum's lower bound, in tokens per row: a probe alone turns drafting on only above it
ACCEPTED_DECAY = 0.995  # probe pricing: accepted drafts per row over ~200 drafting steps


STATE = ("state", "margin", "drafting_steps", "skipped", "catchup_per_position", "accepted")  # what is saved


class SkipDrafting:
    def __init__(self, B: int, rhos: list[float], table, D: int = 15, patience: int = 4, probe_every: int = 16):
        self.B, self.rhos, self.D, self.table = B, rhos, D, table
        self.patience, self.probe_every = patience, probe_every
        self.rho_min = min(r for r in rhos if r > 0)
        self.state = "drafting" if self.possible else "off"
        self.margin = 0.0  # decayed sum of (committed - AR-equivalent) tokens per row
        self.drafting_steps = 0
        self.skipped = 0  # AR steps since drafting went off
        self.catchup_per_position = 0.0  # seconds the last catch-up of the drafter's context took a position
        self.accepted = [0.0, 0.0]  # long running [accepted drafts, live rows] of drafting steps

    @property
    def cost(self) -> dict[float, float]:
        """The table's seconds by rho at B, as refined so far."""
        return dict(zip(self.rhos, self.table.row(self.B, self.rhos)))

    @property
    def possible(self) -> bool:
        """Whether some rho > 0 would beat an AR step if every kept draft were accepted."""
        return self.pays(self.cost)

    def pays(self, cost: dict[float, float], n_live: int | None = None, usable: int | None = None) -> bool:
        """possible, at these seconds by rho, for n_live rows that can still emit `usable` drafts
        (default: every row of the batch size, a whole block each)."""
        n = self.B if n_live is None else n_live
        u = n * self.D if usable is None else usable
        return any((n + min(budget(r, self.B, self.D), u)) / cost[r] > n / cost[0.0] for r in self.rhos if r > 0)

    @property
    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in STATE}

    def load_state(self, saved: dict) -> None:
        """Continue from a saved state_dict (KeyError / ValueError / TypeError if it is not one). A
        bucket whose table now says drafting is impossible stays off."""
        if saved["state"] not in ("drafting", "off", "probing"):
            raise ValueError(f"unknown skip state {saved['state']!r}")
        self.state = saved["state"] if self.possible else "off"
        self.margin, self.catchup_per_position = float(saved["margin"]), float(saved["catchup_per_position"])
        self.drafting_steps, self.skipped = int(saved["drafting_steps"]), int(saved["skipped"])
        self.accepted = [float(x) for x in saved["accepted"]]
        if len(self.accepted) != 2:
            raise ValueError("skip state: accepted must be [drafts, rows]")

    def seconds(self, drafting: bool, rho: float = 0.0) -> float:
        """The table's seconds of an AR step, or of a drafting step that verified rho (rho = 0: the
        draft was paid, priced as the smallest rho > 0)."""
        return self.cost[(rho or self.rho_min) if drafting else 0.0]

    @property
    def usual_accepted(self) -> float:
        """Accepted drafts per live row of drafting steps that kept drafts, a long running mean (0
        before any)."""
        return self.accepted[0] / self.accepted[1] if self.accepted[1] > 0 else 0.0

    def probe_price(self, unsynced: int = 0, cost: dict[float, float] | None = None) -> float:
        """Seconds a probe loses to an AR step at most: its step at the dearest budget the rule may pick
        (a measured one: unmeasured entries are never picked) less what drafting usually commits, plus
        the catch-up of `unsynced` positions. cost: the table's row (self.cost), if already read."""
        cost = cost or self.cost
        dearest = max(c for r, c in cost.items() if r > 0 and c != float("inf"))
        return dearest - cost[0.0] * (1.0 + self.usual_accepted) + self.catchup_per_position * unsynced

    def probe_period(self, unsynced: int = 0, cost: dict[float, float] | None = None) -> int:
        """AR steps a probe waits for while `unsynced` positions would need catching up: its price
        over each AR step's PROBE_BUDGET of its seconds, at least probe_every."""
        cost = cost or self.cost
        if not self.pays(cost):
            return self.probe_every
        return max(self.probe_every, int(self.probe_price(unsynced, cost) / (PROBE_BUDGET * cost[0.0])) + 1)

    def gain_over_ar(self, rec) -> float:
        """Tokens per live row a drafting step committed beyond what AR steps commit in the same time:
        1 + accepted / n_live - its seconds / an AR step's, its seconds being the table's for its rho
        plus a draft it made afresh when its rows changed (drafting pays for that too). What the step
        realized, not what it was predicted to: the rule picks the rho whose prediction is highest, so
        the picked prediction runs high, most where drafting is near break-even (docs/method.md,
        "Skipping drafting")."""
        seconds = self.seconds(True, rec.rho) + rec.redraft
        return 1.0 + rec.accepted / max(rec.n_live, 1) - seconds / self.seconds(False)

    def draft_now(self, unsynced: int = 0, n_live: int | None = None, usable: int | None = None) -> bool:
        """Whether this step drafts; unsynced: the positions a draft would first catch up; n_live,
        usable: the live rows and the drafts they can still emit (a probe due waits for rows that can
        pay). Runs every step: it reads the table's row once."""
        cost = self.cost
        if not self.pays(cost):
            return False
        if self.state == "off":
            self.skipped += 1
            if self.skipped >= self.probe_period(unsynced, cost):
                self.state = "probing"
        return self.state != "off" and self.pays(cost, n_live, usable)

    def observe(self, rec) -> None:
        """Learn from one StepRecord of this batch size."""
        if rec.caught_up > 0:
            self.catchup_per_position = rec.catchup / rec.caught_up
        if not rec.drafted or rec.usable is not None and not self.pays(self.cost, rec.n_live, rec.usable):
            return  # rows that could not pay even at full acceptance say nothing about drafting here
        kept = rec.rho > 0
        if kept:
            self.accepted = [ACCEPTED_DECAY * self.accepted[0] + rec.accepted,
                             ACCEPTED_DECAY * self.accepted[1] + rec.n_live]
        # A step with few live rows (a batch's tail, where each keeps more of the budget) counts for
        # what it commits: its gain per row is weighted by its share of the batch's rows.
        self.margin = max(-FLOOR, RUN_DECAY * self.margin + self.gain_over_ar(rec) * rec.n_live / self.B)
        self.drafting_steps += 1
        if self.state == "drafting" and self.margin < 0 and self.drafting_steps >= self.patience:
            self.state = "off"
        elif self.state == "probing":
            self.state = "drafting" if self.margin > 0 else "off"
        if self.state == "off":
            self.skipped = 0
