"""Skip drafting: whether to draft at all at one batch size (docs/method.md, "Skipping drafting").

1. Drafting never runs without the batch size's cost row, where no budget could beat an AR step even
   if every kept draft were accepted, or on rows too near their ends to (such steps teach nothing).
2. Each drafting step is scored by the tokens per row it committed beyond what AR steps commit in its
   table seconds, weighted by its share of the batch's rows; older scores weigh 2 % less with each new
   one. What drafting alone paid around a step (a draft made afresh, the drafter's context of admitted
   prompts) is charged at its mean over the same steps: it moves the mean, not the doubt.
3. Drafting goes off when the scores net of that say it loses at 90 % confidence (at least four scores,
   from at least two requests); from then on probes keep a fresh score, and drafting is on again once
   that says it wins at 90 % confidence.
4. While off, a probe (one drafting step) runs once the AR steps since have earned its price: each
   earns 2 % of the time drafting could save at best, and a probe costs its dearest budget's step
   less what drafting steps usually commit (a ~200-step mean), plus the catch-up it writes.
5. A losing probe doubles the wait, at most 64x.
"""

from __future__ import annotations

import math

from .dcut import budget, most_committed
from .stats import DecayedRatio, DecayedScores

CONFIDENCE, DECAY, PROBE_SHARE, MAX_BACKOFF, USUAL = 0.90, 0.98, 0.02, 6, 0.995  # rules 3, 2, 4, 5, 4
STATE = ("state", "scores", "lumps", "accepted", "drafting_steps", "skipped", "catchup_per_position",
         "failed_probes", "requests")
SUMS = ("scores", "lumps", "accepted")  # saved as their sums


class SkipDrafting:
    def __init__(self, B: int, rhos: list[float], table, D: int = 15, patience: int = 4, probe_every: int = 16):
        self.B, self.rhos, self.D, self.table = B, rhos, D, table
        self.patience, self.probe_every = patience, probe_every  # rule 3's four; the shortest wait
        self.state = "drafting" if self.possible else "off"
        self.scores, self.lumps = DecayedScores(DECAY), DecayedScores(DECAY)  # rule 2, in tokens per row
        self.drafting_steps, self.requests = 0, 0
        self.skipped, self.failed_probes = 0, 0  # AR steps since the last drafting step; losing probes
        self.catchup_per_position = 0.0  # seconds the last catch-up took a position
        self.accepted = DecayedRatio(USUAL)  # accepted drafts per live row of drafting steps, usually

    @property
    def cost(self) -> dict[float, float]:
        """The table's seconds by rho at B, as the run's steps refine them."""
        return dict(zip(self.rhos, self.table.row(self.B, self.rhos)))

    @property
    def possible(self) -> bool:
        """Whether some rho > 0 would beat an AR step at full acceptance (rule 1)."""
        return self.room(self.cost) > 1.0

    def room(self, cost: dict, n_live: int | None = None, usable: int | None = None) -> float:
        """The best budget's tokens per second at full acceptance over an AR step's, for n_live rows that
        can still emit `usable` drafts (default: a whole block for every row of B)."""
        n = self.B if n_live is None else n_live
        u = n * self.D if usable is None else usable
        best = max(most_committed(budget(r, self.B, self.D), n, u) / cost[r] for r in self.rhos if r > 0)
        return best * cost[0.0] / max(n, 1)

    def probe_period(self, behind: int = 0, cost: dict | None = None) -> int:
        """AR steps a probe waits for while `behind` positions would need catching up (rules 4 and 5)."""
        cost = cost or self.cost
        dearest = max(c for r, c in cost.items() if r > 0 and c != math.inf)
        price = dearest - cost[0.0] * (1.0 + self.accepted.ratio())
        earned = PROBE_SHARE * (1.0 - 1.0 / self.room(cost)) * cost[0.0]
        steps = (price + self.catchup_per_position * behind) / earned + 1 if earned > 0 else 0
        return max(self.probe_every, int(steps)) << min(self.failed_probes, MAX_BACKOFF)

    def score(self, rec) -> tuple[float, float]:
        """Rule 2 for one drafting step: its score and its lump (rho = 0: the draft was paid, priced as the
        smallest rho > 0)."""
        ar, share = self.cost[0.0], rec.n_live / self.B
        seconds = self.cost[rec.rho or min(r for r in self.rhos if r > 0)]
        return (1.0 + rec.accepted / max(rec.n_live, 1) - seconds / ar) * share, (rec.redraft + rec.prompt_context) / ar * share

    def draft_now(self, behind: int = 0, n_live: int | None = None, usable: int | None = None) -> bool:
        """Whether this step drafts. behind: the positions a draft would first catch up; n_live, usable:
        the live rows and the drafts they can still emit. Called once a step."""
        cost = self.cost
        if not self.room(cost) > 1.0:
            return False
        self.skipped += self.state == "off"
        due = self.state == "drafting" or self.skipped >= self.probe_period(behind, cost)
        return due and self.room(cost, n_live, usable) > 1.0

    def observe(self, rec) -> None:
        """Learn from one StepRecord of this batch size."""
        if rec.caught_up > 0:
            self.catchup_per_position = rec.catchup / rec.caught_up
        if not rec.drafted or rec.timed or rec.usable is not None and self.room(self.cost, rec.n_live, rec.usable) <= 1.0:
            return  # rule 1; the profiler's timed steps repeat one state of rows that do not advance
        self.requests = max(self.requests + rec.admitted, rec.n_live)
        x, lump = self.score(rec)
        self.scores.add(x)
        self.lumps.add(lump)
        if rec.rho > 0:  # a step that kept drafts
            self.accepted.add(rec.accepted, rec.n_live)
        self.drafting_steps += 1
        gain, sure = self.scores.mean - self.lumps.mean, self.scores.margin(CONFIDENCE)
        if self.state == "drafting" and self.drafting_steps >= self.patience and self.requests >= 2 \
                and gain + sure < 0:
            self.state, self.scores, self.lumps, self.skipped = "off", DecayedScores(DECAY), DecayedScores(DECAY), 0
        elif self.state == "off":
            self.skipped, self.failed_probes = 0, self.failed_probes + (x < 0)  # x: the probe's own step
            if gain - sure > 0:
                self.state, self.failed_probes = "drafting", 0

    @property
    def state_dict(self) -> dict:
        return {k: getattr(self, k).sums if k in SUMS else getattr(self, k) for k in STATE}

    def load_state(self, saved: dict) -> None:
        """Continue from a saved state_dict (KeyError / ValueError / TypeError if not one). A state saved
        by the earlier rule (its "evidence", "probing") loads as drafting or off, with fresh scores."""
        if saved["state"] not in ("drafting", "off", "probing"):
            raise ValueError(f"unknown skip state {saved['state']!r}")
        self.state = "drafting" if saved["state"] == "drafting" and self.possible else "off"
        self.scores = DecayedScores(DECAY, saved.get("scores", (0.0,) * 4))
        self.lumps = DecayedScores(DECAY, saved.get("lumps", (0.0,) * 4) if "scores" in saved else (0.0,) * 4)
        self.accepted = DecayedRatio(USUAL, saved["accepted"])
        self.drafting_steps, self.skipped = int(saved["drafting_steps"]), int(saved["skipped"])
        self.catchup_per_position = float(saved["catchup_per_position"])
        self.failed_probes, self.requests = int(saved["failed_probes"]), int(saved.get("requests", 2))
