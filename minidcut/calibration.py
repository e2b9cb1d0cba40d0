"""Online calibration of D-cut's two inputs (docs/method.md, "Calibration").

gain   The drafter's confidences are not probabilities of acceptance. gain_scale = realized / predicted
       accepted drafts over recent drafting steps rescales the gain before rho* is chosen.
cost   The table's seconds are not what the serving loop pays (host work, a busier machine).
       cost_scale(kind) = measured / table seconds over recent steps of that kind (drafting steps, AR
       steps) rescales the costs that decide whether drafting pays.

Both are running ratios with a memory of about 1 / (1 - DECAY) = 20 steps. The state belongs to the
drafter and the machine, not to a batch size: it is kept across generate() calls until reset().
"""

from __future__ import annotations

DECAY = 0.95  # ~20 steps of memory: follows shifts, smooths single steps
CLAMP = 3.0  # one step counts at most this many times (or 1 / this) the table's seconds


class Calibration:
    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.reset()

    def reset(self) -> None:
        self.gain_scale = 1.0
        self._accepted = {"predicted": 0.0, "realized": 0.0}
        self._seconds = {True: [0.0, 0.0], False: [0.0, 0.0]}  # drafting? -> running [measured, table]

    @property
    def state(self) -> dict:
        return {"gain_scale": self.gain_scale, "accepted": dict(self._accepted),
                "seconds": {"drafting": list(self._seconds[True]), "ar": list(self._seconds[False])}}

    def load_state(self, state: dict) -> None:
        """Continue from a saved state (ValueError / KeyError / TypeError if it is not one)."""
        gain_scale = float(state["gain_scale"])
        accepted = {k: float(state["accepted"][k]) for k in ("predicted", "realized")}
        seconds = {True: [float(x) for x in state["seconds"]["drafting"]],
                   False: [float(x) for x in state["seconds"]["ar"]]}
        if not 0 < gain_scale < float("inf") or any(len(v) != 2 for v in seconds.values()):
            raise ValueError("calibration state out of range")
        self.gain_scale, self._accepted, self._seconds = gain_scale, accepted, seconds

    def cost_scale(self, drafting: bool) -> float:
        """Measured / table seconds of recent steps of this kind; 1 before any was measured. Never
        borrowed from the other kind: a loop that is slow only while drafting would go unnoticed."""
        measured, table = self._seconds[drafting]
        return measured / table if table > 0 else 1.0

    def observe(self, rec, costs: dict[float, float]) -> None:
        """Learn from one StepRecord; costs: the table's seconds by rho at the step's batch size."""
        if not self.enabled:
            return
        if rec.seconds > 0:
            smallest = min((r for r in costs if r > 0), default=0.0)  # a draft that kept nothing paid this
            table = costs[(rec.rho or smallest) if rec.drafted else 0.0]
            ratio = min(max(rec.seconds / table, 1 / CLAMP), CLAMP)
            run = self._seconds[rec.drafted]
            run[0], run[1] = DECAY * run[0] + ratio * table, DECAY * run[1] + table
        if rec.drafted and rec.rho > 0:
            acc = self._accepted
            acc["predicted"] = DECAY * acc["predicted"] + rec.predicted
            acc["realized"] = DECAY * acc["realized"] + rec.accepted
            if acc["predicted"] > 1.0:
                self.gain_scale = min(max(acc["realized"] / acc["predicted"], 0.05), 20.0)
