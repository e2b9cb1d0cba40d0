"""Skip drafting: whether to draft at all at one batch size (docs/method.md, "Skipping drafting").

D-cut picks how much of a drafted block to verify; at a large batch even rho = 0 loses to an AR step,
because the draft itself costs time. So each batch size plays two arms, drafting and AR:

1. Never draft without the table's row at the batch size, where that row says no rho > 0 could beat an
   AR step even if every kept draft were accepted, or on a step whose rows are too near their ends to.
2. Score each arm by what its own steps delivered: committed tokens per row over the seconds they took,
   drafting's including what it paid around its steps (a draft made afresh, the drafter's context of
   admitted prompts), weighted by DECAY per step at the batch size, so an arm left alone is judged by
   its latest steps; AR's score starts from the table's AR entry, drafting's from nothing.
3. Play the better arm (drafting first), and switch only after two steps of the played arm, when the
   other's score is ahead by MARGIN.
4. Every `wait` steps try the other arm for a step: a try that scores above the played arm is tried
   again at the next step, one below doubles the wait (up to MAX_WAIT), and a switch resets it.

Not counted: steps that compiled a graph (no seconds), the profiler's timed steps (rows that do not
advance) and drafting steps whose rows could not pay at full acceptance. The catch-up of the drafter's
context that a try of drafting pays first is the price of the AR steps before it, not of drafting.
"""

from __future__ import annotations

from .dcut import budget

DECAY = 0.9  # a score's memory: the weights fall by 10 % a step at the batch size (~10 steps)
MARGIN = 0.05  # switch only when the other arm's score is ahead by 5 %
FIRST_WAIT, MAX_WAIT = 8, 256  # steps between tries of the other arm: the first wait, and the most
SAVED = ("scores", "drafting", "played", "since", "wait")  # the state a cost table keeps


class SkipDrafting:
    def __init__(self, B: int, rhos: list[float], table, D: int = 15):
        self.B, self.rhos, self.D, self.table = B, rhos, D, table
        self.scores = {True: [0.0, 0.0], False: [1.0, self.cost[0.0]]}  # drafting?: [tokens per row, seconds]
        self.drafting = self.possible  # the arm played
        self.played = 0  # steps of the played arm since it was picked
        self.since, self.wait = 0, FIRST_WAIT  # steps since the last try, and before the next
        self.trying = False  # this step tries the other arm

    @property
    def cost(self) -> dict[float, float]:
        """The table's seconds by rho at B, as refined so far."""
        return dict(zip(self.rhos, self.table.row(self.B, self.rhos)))

    @property
    def possible(self) -> bool:
        """Whether some rho > 0 would beat an AR step if every kept draft were accepted."""
        return self.pays(self.cost)

    def pays(self, cost: dict[float, float], n_live: int | None = None, usable: int | None = None) -> bool:
        """Whether the best budget at full acceptance commits more per second than an AR step, for
        n_live rows that can still emit `usable` drafts (default: the whole batch size, a block each)."""
        n = self.B if n_live is None else n_live
        u = n * self.D if usable is None else usable
        return max((n + min(budget(r, self.B, self.D), u)) / cost[r] for r in self.rhos if r > 0) > n / cost[0.0]

    def score(self, drafting: bool) -> float | None:
        """An arm's committed tokens per row per second (None before its first step)."""
        tokens, seconds = self.scores[drafting]
        return tokens / seconds if seconds > 0 else None

    def draft_now(self, n_live: int | None = None, usable: int | None = None) -> bool:
        """Whether this step drafts (n_live, usable: the live rows and the drafts they can still emit).
        Called once per step."""
        cost = self.cost
        if not self.pays(cost):
            return False
        self.since += 1
        self.trying = self.since >= self.wait
        return self.drafting != self.trying and self.pays(cost, n_live, usable)

    @property
    def next_drafts(self) -> bool:
        """Whether the next step will likely draft (a drafting step then drafts its block ahead)."""
        return self.drafting and self.since + 1 < self.wait

    def observe(self, rec) -> None:
        """Learn from one StepRecord of this batch size."""
        tried, self.trying = self.trying and rec.drafted != self.drafting, False
        if rec.seconds <= 0 or rec.timed or rec.drafted and not self.pays(self.cost, rec.n_live, rec.usable):
            return
        tokens = 1.0 + rec.accepted / max(rec.n_live, 1)
        seconds = rec.seconds + (rec.redraft + rec.prompt_context if rec.drafted else 0.0)
        for arm in self.scores.values():
            arm[:] = [DECAY * arm[0], DECAY * arm[1]]
        self.scores[rec.drafted][0] += tokens
        self.scores[rec.drafted][1] += seconds
        if tried:  # a try that wins is tried again at the next step; one that loses doubles the wait
            won = tokens / seconds > (self.score(self.drafting) or 0.0)
            self.since = self.wait if won else 0
            self.wait = self.wait if won else min(2 * self.wait, MAX_WAIT)
        self.played += rec.drafted == self.drafting
        mine, other = self.score(self.drafting), self.score(not self.drafting)
        if self.played >= 2 and other is not None and other > mine * (1 + MARGIN):
            self.drafting, self.played, self.since, self.wait = not self.drafting, 0, 0, FIRST_WAIT

    @property
    def state_dict(self) -> dict:
        return {k: [self.scores[True], self.scores[False]] if k == "scores" else getattr(self, k) for k in SAVED}

    def load_state(self, saved: dict) -> None:
        """Continue from a saved state_dict (KeyError / ValueError / TypeError if it is not one). A
        batch size whose table now says drafting cannot pay stays off."""
        drafting, ar = ([float(x) for x in arm] for arm in saved["scores"])
        if len(drafting) != 2 or len(ar) != 2:
            raise ValueError("skip state: scores must be [tokens, seconds] per arm")
        self.scores = {True: drafting, False: ar}
        self.drafting = bool(saved["drafting"]) and self.possible
        self.played, self.since, self.wait = int(saved["played"]), int(saved["since"]), int(saved["wait"])
