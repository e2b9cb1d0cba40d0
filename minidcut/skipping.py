"""Skip drafting: whether to draft at all at one batch size (docs/method.md, "Skipping drafting").

The paper's rule picks how much to verify once a block is drafted; at a large batch size even rho = 0
can lose, because the draft itself costs time. One SkipDrafting per batch size, in one of three states:

  drafting   every step drafts, and is a sample of its gain over AR steps (gain_over_ar; what drafting
             paid around it, lump_over_ar, kept apart). Off when the samples' upper confidence bound,
             net of the lumps, is below zero (losing), on at least two requests' samples (spread).
  off        AR steps; a probe runs once they have earned its price (probe_period, probe_price).
  probing    one drafting step: its sample joins the evidence; drafting is on again once the mean gain
             is above zero, or when the probes alone say with confidence that drafting wins.

Never drafts without a table row, or where no budget could win even at full acceptance (pays).
"""

from __future__ import annotations

import math
import statistics

from .dcut import budget, most_committed
from .stats import DecayedRatio

CONFIDENCE = 0.90  # drafting goes off when its mean gain over AR is below zero at this one-sided confidence
RUN_DECAY = 0.98  # the evidence's memory: weights fall by 2 % a drafting step (~50 steps, probes included)
PROBE_SHARE = 0.02  # probing spends at most this share of the time drafting could save at best, (1 - 1 / room)
ACCEPTED_DECAY = 0.995  # probe pricing: accepted drafts per row over ~200 drafting steps

MAX_BACKOFF = 6  # the probe period doubles at most this often (64x)
STATE = ("state", "evidence", "drafting_steps", "skipped", "catchup_per_position", "accepted",
         "failed_probes", "lumps", "requests", "latest", "probes", "probe_lumps")  # what is saved
EVIDENCE = ("evidence", "lumps", "probes", "probe_lumps")  # saved as their sums


def t_quantile(p: float, df: float) -> float:
    """Student's t quantile at probability p with df degrees of freedom: the Cornish-Fisher expansion
    around the normal quantile z to 1 / df^3 (at p = 0.9: within 0.1 % of the exact value for df >= 3,
    0.3 % at df = 2, 4 % low at df = 1)."""
    z = statistics.NormalDist().inv_cdf(p)
    return (z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * df ** 3))


class Evidence:
    """Exponentially weighted samples (weight RUN_DECAY ** age): their mean, its standard error and the
    effective number of samples. As data: [sum w, sum w x, sum w x^2, sum w^2]."""

    def __init__(self, sums=(0.0, 0.0, 0.0, 0.0)):
        self.sums = [float(x) for x in sums]
        if len(self.sums) != 4:
            raise ValueError("evidence must be [sum w, sum w x, sum w x^2, sum w^2]")

    def add(self, x: float) -> None:
        w, wx, wxx, ww = (s * d for s, d in zip(self.sums, (RUN_DECAY, RUN_DECAY, RUN_DECAY, RUN_DECAY ** 2)))
        self.sums = [w + 1.0, wx + x, wxx + x * x, ww + 1.0]

    @property
    def n(self) -> float:
        """Effective number of samples, (sum w)^2 / sum w^2 (at most (1 + RUN_DECAY) / (1 - RUN_DECAY))."""
        w, _, _, ww = self.sums
        return w * w / ww if ww > 0 else 0.0

    @property
    def mean(self) -> float:
        w, wx, _, _ = self.sums
        return wx / w if w > 0 else 0.0

    def margin(self, confidence: float = CONFIDENCE) -> float:
        """Half-width of the one-sided confidence bound of the mean (inf with one sample: no spread to
        go by)."""
        w, wx, wxx, ww = self.sums
        n = self.n
        if n < 1.5:  # two samples weigh n = 1.9998 (their weights differ by RUN_DECAY)
            return float("inf")
        var = max(0.0, wxx / w - self.mean ** 2) * n / (n - 1)  # unbiased for reliability weights
        return t_quantile(confidence, n - 1) * math.sqrt(var / n)

    def upper(self, confidence: float = CONFIDENCE) -> float:
        """One-sided upper confidence bound of the mean."""
        return self.mean + self.margin(confidence)

    def lower(self, confidence: float = CONFIDENCE) -> float:
        """One-sided lower confidence bound of the mean."""
        return self.mean - self.margin(confidence)


class SkipDrafting:
    def __init__(self, B: int, rhos: list[float], table, D: int = 15, patience: int = 4, probe_every: int = 16):
        self.B, self.rhos, self.D, self.table = B, rhos, D, table
        self.patience, self.probe_every = patience, probe_every
        self.rho_min = min(r for r in rhos if r > 0)
        self.state = "drafting" if self.possible else "off"
        self.evidence = Evidence()  # drafting steps' gain over AR, tokens per row
        self.drafting_steps = 0
        self.skipped = 0  # AR steps since drafting went off
        self.catchup_per_position = 0.0  # seconds the last catch-up of the drafter's context took a position
        self.accepted = DecayedRatio(ACCEPTED_DECAY)  # accepted drafts / live rows of drafting steps
        self.failed_probes = 0  # losing probes since drafting was last on (backoff)
        self.lumps = Evidence()  # what drafting alone paid around each drafting step, tokens per row
        self.requests = 0  # requests the samples came from (live rows of the first, then admissions)
        self.latest = 0  # samples since the last admission (at B = 1: of the latest request)
        self.probes, self.probe_lumps = Evidence(), Evidence()  # the probes' samples and lumps since drafting went off

    @property
    def cost(self) -> dict[float, float]:
        """The table's seconds by rho at B, as refined so far."""
        return dict(zip(self.rhos, self.table.row(self.B, self.rhos)))

    @property
    def possible(self) -> bool:
        """Whether some rho > 0 would beat an AR step if every kept draft were accepted."""
        return self.pays(self.cost)

    def room(self, cost: dict[float, float], n_live: int | None = None, usable: int | None = None) -> float:
        """Tokens per second of the best budget at full acceptance over an AR step's, for n_live rows
        that can still emit `usable` drafts (default: every row of the batch size, a whole block each)."""
        n = self.B if n_live is None else n_live
        u = n * self.D if usable is None else usable
        best = max(most_committed(budget(r, self.B, self.D), n, u) / cost[r] for r in self.rhos if r > 0)
        return best / (n / cost[0.0])

    def pays(self, cost: dict[float, float], n_live: int | None = None, usable: int | None = None) -> bool:
        """possible, at these seconds by rho, for these rows (room's arguments)."""
        return self.room(cost, n_live, usable) > 1.0

    @property
    def state_dict(self) -> dict:
        return {k: getattr(self, k).sums if k in EVIDENCE + ("accepted",) else getattr(self, k) for k in STATE}

    def load_state(self, saved: dict) -> None:
        """Continue from a saved state_dict (KeyError / ValueError / TypeError if it is not one). A
        bucket whose table now says drafting is impossible stays off."""
        if saved["state"] not in ("drafting", "off", "probing"):
            raise ValueError(f"unknown skip state {saved['state']!r}")
        evidence, accepted = Evidence(saved["evidence"]), DecayedRatio(ACCEPTED_DECAY, saved["accepted"])
        self.state = saved["state"] if self.possible else "off"
        self.evidence, self.accepted = evidence, accepted
        self.catchup_per_position = float(saved["catchup_per_position"])
        self.drafting_steps, self.skipped = int(saved["drafting_steps"]), int(saved["skipped"])
        self.failed_probes = int(saved["failed_probes"])
        for k in ("lumps", "probes", "probe_lumps"):  # states saved before them: none yet
            setattr(self, k, Evidence(saved.get(k, Evidence().sums)))
        self.requests = int(saved.get("requests", 2))  # states saved before it decided with more
        self.latest = int(saved.get("latest", self.patience))

    def seconds(self, drafting: bool, rho: float = 0.0) -> float:
        """The table's seconds of an AR step, or of a drafting step that verified rho (rho = 0: the
        draft was paid, priced as the smallest rho > 0)."""
        return self.cost[(rho or self.rho_min) if drafting else 0.0]

    @property
    def usual_accepted(self) -> float:
        """Accepted drafts per live row of drafting steps that kept drafts, a long running mean (0
        before any)."""
        return self.accepted.ratio()

    @property
    def spread(self) -> bool:
        """Whether the samples came from at least two requests, and at B = 1 (a sample: one request's
        block) the latest of them gave `patience` samples itself."""
        return self.requests >= 2 and (self.B > 1 or self.latest >= self.patience)

    @property
    def gain(self) -> float:
        """The evidence's mean gain over AR steps net of the lumps, tokens per row a drafting step."""
        return self.evidence.mean - self.lumps.mean

    @property
    def losing(self) -> bool:
        """Whether the evidence says, with CONFIDENCE, that drafting steps commit fewer tokens than AR
        steps in the same time, counting what drafting paid around them (the lumps' mean over the same
        steps)."""
        return self.evidence.upper() - self.lumps.mean < 0.0

    def probe_price(self, behind: int = 0, cost: dict[float, float] | None = None) -> float:
        """Seconds a probe loses to an AR step at most: its step at the dearest budget the rule may pick
        (a measured one: unmeasured entries are never picked) less what drafting usually commits, plus
        the catch-up of `behind` positions. cost: the table's row (self.cost), if already read."""
        cost = cost or self.cost
        dearest = max(c for r, c in cost.items() if r > 0 and c != float("inf"))
        return dearest - cost[0.0] * (1.0 + self.usual_accepted) + self.catchup_per_position * behind

    @property
    def backoff(self) -> int:
        """How many times the probe period doubles: once per losing probe since drafting was last on
        (at most MAX_BACKOFF times), none once a probe turns drafting on."""
        return min(self.failed_probes, MAX_BACKOFF)

    def probe_period(self, behind: int = 0, cost: dict[float, float] | None = None) -> int:
        """AR steps a probe waits for while `behind` positions would need catching up: its price over
        what each AR step earns toward it, PROBE_SHARE of the (1 - 1 / room) of an AR step's seconds that
        drafting could save at best, at least probe_every; doubled `backoff` times."""
        cost = cost or self.cost
        room = self.room(cost)
        if room <= 1.0:
            return self.probe_every << self.backoff
        earned = PROBE_SHARE * (1.0 - 1.0 / room) * cost[0.0]
        return max(self.probe_every, int(self.probe_price(behind, cost) / earned) + 1) << self.backoff

    def gain_over_ar(self, rec) -> float:
        """Tokens per live row a drafting step committed beyond what AR steps commit in the same time:
        1 + accepted / n_live - its seconds / an AR step's, its seconds being the table's for its rho.
        What the step realized, not what it was predicted to: the rule picks the rho whose prediction
        is highest, so the picked prediction runs high, most where drafting is near break-even (at
        B = 16 on the demo pair calibrated predictions ran 3-18 % high). What drafting paid around the
        step is kept apart (lump_over_ar)."""
        return 1.0 + rec.accepted / max(rec.n_live, 1) - self.seconds(True, rec.rho) / self.seconds(False)

    def lump_over_ar(self, rec) -> float:
        """Tokens per live row AR steps would commit in the seconds drafting alone paid around a
        drafting step: a draft made afresh when its rows changed, the drafter's context of prompts
        admitted since the last drafting step, and the catch-up of the drafter's context (a probe's own
        is left to the probe budget)."""
        lump = rec.redraft + rec.prompt_context + (rec.catchup if self.state != "probing" else 0.0)
        return lump / self.seconds(False)

    def draft_now(self, behind: int = 0, n_live: int | None = None, usable: int | None = None) -> bool:
        """Whether this step drafts; behind: the positions a draft would first catch up; n_live,
        usable: the live rows and the drafts they can still emit (a probe due waits for rows that can
        pay). Runs every step: it reads the table's row once."""
        cost = self.cost
        if not self.pays(cost):
            return False
        if self.state == "off":
            self.skipped += 1  # the period is at least probe_every << backoff: priced only from there
            if self.skipped >= self.probe_every << self.backoff and self.skipped >= self.probe_period(behind, cost):
                self.state = "probing"
        return self.state != "off" and self.pays(cost, n_live, usable)

    def observe(self, rec) -> None:
        """Learn from one StepRecord of this batch size."""
        if rec.caught_up > 0:
            self.catchup_per_position = rec.catchup / rec.caught_up
        if not rec.drafted or rec.timed or rec.usable is not None and not self.pays(self.cost, rec.n_live, rec.usable):
            return  # rows that could not pay even at full acceptance say nothing about drafting here, and
            #         the profiler's timed steps repeat one state of rows that do not advance
        self.requests = max(self.requests + rec.admitted, rec.n_live)  # the requests the samples came from
        self.latest = 1 if rec.admitted else self.latest + 1
        if rec.rho > 0:
            self.accepted.add(rec.accepted, rec.n_live)
        # A step with few live rows (a batch's tail, where each keeps more of the budget) counts for
        # what it commits: its gain per row is weighted by its share of the batch's rows.
        x, lump = self.gain_over_ar(rec) * rec.n_live / self.B, self.lump_over_ar(rec) * rec.n_live / self.B
        self.evidence.add(x)
        self.lumps.add(lump)
        self.drafting_steps += 1
        if self.state == "drafting" and self.drafting_steps >= self.patience and self.spread and self.losing:
            self.state = "off"
            self.probes, self.probe_lumps = Evidence(), Evidence()
        elif self.state == "probing":
            self.probes.add(x)
            self.probe_lumps.add(lump)
            if self.probes.lower() - self.probe_lumps.mean > 0.0:  # the workload changed: the probes
                self.evidence, self.lumps = Evidence(self.probes.sums), Evidence(self.probe_lumps.sums)
            self.state = "drafting" if self.gain > 0.0 else "off"
            won = x > 0.0  # the probe's own step beat AR steps in its seconds
            self.failed_probes = 0 if self.state == "drafting" else self.failed_probes + (not won)
        if self.state == "off":
            self.skipped = 0
