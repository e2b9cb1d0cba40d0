"""Verification policies: which budgets a step may verify, and D-cut's rule for choosing one.

  ar       no drafter, one token per step
  full     rho = 1: verify every drafted position (the DFlash baseline, fixed depth D)
  static   one fixed rho: the global top K = round(rho * B * D) drafts
  dcut     rho* = argmax gain(rho) / cost(B, rho) every step, from a cost table measured on this machine
           (docs/method.md, "Choosing rho"), with two online extensions that each can be switched off:
           calibration.py (the drafter's confidences and the table's seconds, corrected by what steps
           realize) and skipping.py (whether to draft at all at this batch size).

The engine reports every step to the policy as one StepRecord.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .calibration import Calibration
from .cost_model import CostTable
from .skipping import SkipDrafting

DEFAULT_GRID = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass
class StepRecord:
    """One decode step as the engine ran it."""

    batch_size: int  # the batch bucket B the step ran at
    n_live: int  # live requests in it
    drafted: bool  # a drafting step; False: an AR step (no draft)
    rho: float = 0.0  # the verified budget ratio (0: nothing kept)
    predicted: float = 0.0  # that budget's expected accepted drafts, uncalibrated (drafting steps)
    accepted: int = 0  # drafts accepted
    seconds: float = 0.0  # the step's measured seconds (0: not measured)
    catchup: float = 0.0  # seconds spent before it writing the drafter's context of skipped steps


class Policy:
    """The paper's rule: a rho grid, the table's costs at the batch size, and rho* = argmax gain / cost."""

    def __init__(self, name: str, rhos, table: CostTable | None = None, *, count_anchors: bool = True,
                 calibrate: bool = False, skip_drafting: bool = False, label: str | None = None, **skip_kw):
        if name not in ("ar", "full", "static", "dcut"):
            raise ValueError(f"unknown policy {name!r} (choose from ar, full, static, dcut)")
        self.name, self.rhos, self.table = name, sorted(float(r) for r in rhos), table
        if any(not 0.0 <= r <= 1.0 for r in self.rhos):
            raise ValueError(f"rho must be in [0, 1], got {self.rhos}")
        if name == "dcut" and table is None:
            raise ValueError("the dcut policy needs a cost table")
        self.count_anchors = count_anchors  # gain = expected committed tokens (anchors counted)
        self.depth = 15  # D of the drafter it runs with: the engine sets it
        self.label = label or (f"static:{self.rhos[0]:g}" if name == "static" else name)
        self.calibration = Calibration(enabled=calibrate)
        self.skipping = None  # SkipDrafting per batch size, when drafting may be skipped
        if skip_drafting and name == "dcut" and self.rhos[0] == 0.0 and len(self.rhos) > 1:
            self.skipping = {}
        self._skip_kw = skip_kw

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
    def dcut(cls, table: CostTable, rhos=DEFAULT_GRID, *, count_anchors=True, calibrate=True,
             skip_drafting=True, **kw):
        return cls("dcut", rhos, table, count_anchors=count_anchors, calibrate=calibrate,
                   skip_drafting=skip_drafting, **kw)

    @property
    def needs_drafter(self) -> bool:
        return self.name != "ar"

    def costs(self, B: int) -> list[float] | None:
        """cost(B, rho) for the grid, from the table's row for B (None if it has none); flat without a
        table (fixed policies have nothing to choose)."""
        if self.table is None:
            return [1.0] * len(self.rhos)
        return self.table.row(B, self.rhos)

    def cost_vector(self, B: int, device) -> torch.Tensor:
        """The draft graph's cost input [n_rho]. When drafting can be skipped, a drafting step has
        already paid for its draft: rho = 0 then costs what the smallest rho > 0 does."""
        costs = list(self.costs(B) or [1.0] * len(self.rhos))
        if self.skipping is not None:
            costs[0] = costs[1]
        return torch.tensor(costs, dtype=torch.float32, device=device)

    def choose(self, gain: torch.Tensor, n_live: torch.Tensor, gain_scale: torch.Tensor,
               cost: torch.Tensor) -> torch.Tensor:
        """rho* index (in the graph): argmax of expected committed tokens per second. gain [n_rho]:
        expected accepted drafts; calibrated by gain_scale; plus one anchor per live request."""
        committed = gain_scale * gain + (n_live if self.count_anchors else 0.0)
        return torch.argmax(committed / cost)

    def skip(self, B: int) -> SkipDrafting | None:
        """The skip-drafting controller of batch size B (learned per B), None if drafting is never skipped."""
        if self.skipping is None:
            return None
        if B not in self.skipping:
            self.skipping[B] = SkipDrafting(B, self.rhos, self.costs(B), self.calibration, self.depth,
                                            **self._skip_kw)
        return self.skipping[B]

    def draft_now(self, B: int) -> bool:
        """Whether the next step at batch size B drafts (never at a B without measured costs)."""
        skip = self.skip(B)
        return self.drafting_on(B) if skip is None else skip.draft_now()

    def drafting_on(self, B: int) -> bool:
        """Whether drafting is on at B (False while a skip controller keeps it off)."""
        skip = self.skip(B)
        return self.needs_drafter and self.costs(B) is not None if skip is None else skip.state == "drafting"

    def observe(self, rec) -> None:
        """Learn from one step: calibration, then the skip decision of its batch size."""
        costs = self.costs(rec.batch_size)
        if costs is not None:
            self.calibration.observe(rec, dict(zip(self.rhos, costs)))
        if self.skip(rec.batch_size) is not None:
            self.skipping[rec.batch_size].observe(rec)

    def reset(self) -> None:
        """Forget everything learned online."""
        self.calibration.reset()
        if self.skipping is not None:
            self.skipping.clear()
