"""Online calibration of D-cut's gain (docs/method.md, "Calibration").

The drafter's confidences are not probabilities of acceptance. gain_scale = realized / predicted
accepted drafts over recent drafting steps rescales the gain before rho* is chosen: a running ratio with
a memory of about 1 / (1 - DECAY) = 20 steps. (The other input, the cost table's seconds, is refined by
the steps themselves: cost_model.CostTable.refine.) The state belongs to the drafter, not to a batch
size: it is kept across generate() calls until reset(), and across processes with the cost table.
"""

from __future__ import annotations

from .stats import DecayedRatio

DECAY = 0.95  # ~20 steps of memory: follows shifts, smooths single steps


class Calibration:
    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.reset()

    def reset(self) -> None:
        self.gain_scale = 1.0
        self.accepted = DecayedRatio(DECAY)  # realized / predicted accepted drafts

    @property
    def state(self) -> dict:
        realized, predicted = self.accepted.sums
        return {"gain_scale": self.gain_scale, "accepted": {"predicted": predicted, "realized": realized}}

    def load_state(self, state: dict) -> None:
        """Continue from a saved state (ValueError / KeyError / TypeError if it is not one)."""
        gain_scale = float(state["gain_scale"])
        accepted = DecayedRatio(DECAY, [state["accepted"][k] for k in ("realized", "predicted")])
        if not 0 < gain_scale < float("inf"):
            raise ValueError("calibration state out of range")
        if self.enabled:  # switched off: raw confidences, whatever was learned before
            self.gain_scale, self.accepted = gain_scale, accepted

    def observe(self, rec) -> None:
        """Learn from one StepRecord: a drafting step that kept drafts compares them with what it accepted."""
        if not self.enabled or not (rec.drafted and rec.rho > 0):
            return
        self.accepted.add(rec.accepted, rec.predicted)
        if self.accepted.sums[1] > 1.0:
            self.gain_scale = min(max(self.accepted.ratio(), 0.05), 20.0)
