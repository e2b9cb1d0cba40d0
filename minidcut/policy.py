"""Verification policies: which budgets a step may verify, and D-cut's rule for choosing one.

  ar       no drafter, one token per step
  full     rho = 1: verify every drafted position (the DFlash baseline, fixed depth D)
  static   one fixed rho: the global top K = round(rho * B * D) drafts
  dcut     rho* = argmax gain(rho) / cost(b, rho) every step, from a cost table measured on this machine
           (docs/method.md, "Choosing rho"), with two online extensions that each can be switched off:
           calibration (the drafter's confidences corrected by what steps accept, calibration.py; the
           table's seconds refined by what steps take, CostTable.refine) and skipping.py (whether to
           draft at all at this bucket).

The engine asks the policy once per step what to run (plan -> StepPlan) and reports the step back as
one StepRecord (observe). What dcut learns online is its `state`, which the CLIs keep beside the cost
table so the next process starts from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .calibration import Calibration
from .cost_model import CostTable
from .skipping import SkipDrafting

DEFAULT_GRID = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass
class StepPlan:
    """What one step runs, as the policy decided it before the step."""

    draft: bool  # run the drafter (False: an AR step)
    cost: list[float]  # the draft graph's cost input [n_rho]: seconds per step at the bucket
    gain_scale: float  # calibrated / raw expected accepted drafts (calibration.py)
    ahead: bool = True  # a drafting step drafts the next block after verifying (not a probe: the step
    #                     after one likely runs AR, and its draft would be paid for nothing)
    usable: int | None = None  # drafts the live rows could still emit when planned (Batch.usable; None: not asked)

    @classmethod
    def neutral(cls, n_rho: int) -> "StepPlan":
        """A drafting plan whose costs and gain scale do not matter (flat, raw): for warm-ups and timed
        steps, whose work is the same whatever rho* they pick."""
        return cls(True, [1.0] * n_rho, 1.0)


@dataclass
class StepRecord:
    """One decode step as the engine ran it."""

    bucket: int  # the batch bucket b the step ran at
    n_live: int  # live requests in it
    drafted: bool  # a drafting step; False: an AR step (no draft)
    rho: float = 0.0  # the verified budget ratio (0: nothing kept)
    predicted: float = 0.0  # that budget's expected accepted drafts, uncalibrated (drafting steps)
    accepted: int = 0  # drafts accepted
    kept: int = 0  # drafts verified
    seconds: float = 0.0  # the step's measured seconds (0: not measured)
    catchup: float = 0.0  # seconds spent before it writing the drafter's context of skipped steps
    caught_up: int = 0  # positions that catch-up wrote
    redraft: float = 0.0  # seconds of a draft made afresh on top of the step's own (its rows changed)
    prompt_context: float = 0.0  # seconds prefills spent on the drafter's context of prompts since the last
    #                              drafting step (drafting's cost: an AR run writes no drafter context)
    usable: int | None = None  # drafts the live rows could still emit (Batch.usable; None: not known)
    admitted: int = 0  # requests admitted since the previous step (the first step: all its rows')
    timed: bool = False  # a profiler's timed step (profiler.measure_row): rows that do not advance, so its
    #                      repeats are one state, not independent samples: calibration learns from it, the
    #                      skip decision does not


class Policy:
    """The paper's rule: a rho grid, the table's costs at the bucket, and rho* = argmax gain / cost."""

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
        self._depth = 15  # D of the drafter it runs with: the engine sets it (Policy.depth)
        self.label = label or (f"static:{self.rhos[0]:g}" if name == "static" else name)
        self.calibration = Calibration(enabled=calibrate)
        self.can_skip = skip_drafting and name == "dcut" and self.rhos[0] == 0.0 and len(self.rhos) > 1
        self.skipping: dict[int, SkipDrafting] = {}  # per bucket, when drafting may be skipped
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
    def depth(self) -> int:
        """D, the drafts per block of the drafter the policy runs with; setting it (the engine does)
        reaches the skip controllers already made, restored ones included."""
        return self._depth

    @depth.setter
    def depth(self, D: int) -> None:
        self._depth = D
        for skip in self.skipping.values():
            skip.D = D

    @property
    def needs_drafter(self) -> bool:
        return self.name != "ar"

    def needs_row(self, bucket: int) -> bool:
        """Whether the table lacks the costs this policy needs to decide at `bucket` (the engine then
        measures them, profiler.measure_live)."""
        return self.table is not None and self.table.row(bucket, self.rhos) is None

    def costs(self, bucket: int) -> list[float] | None:
        """cost(b, rho) for the grid (inf: not measured because it cannot win, cost_model.py), None
        without a row at b; flat without a table (fixed policies have nothing to choose)."""
        if self.table is None:
            return [1.0] * len(self.rhos)
        return self.table.row(bucket, self.rhos)

    def skip(self, bucket: int) -> SkipDrafting | None:
        """The skip-drafting controller of a bucket (learned per bucket), None if drafting is never
        skipped or the bucket has no costs yet (a table's rows are only ever added: once made, a
        controller stays)."""
        if bucket in self.skipping:
            return self.skipping[bucket]
        if not self.can_skip or self.costs(bucket) is None:
            return None
        self.skipping[bucket] = SkipDrafting(bucket, self.rhos, self.table, self.depth, **self._skip_kw)
        return self.skipping[bucket]

    def drafting_off(self, bucket: int) -> bool:
        """Whether the bucket's skip controller has drafting off (or never drafts there): a prefill
        there leaves the drafter's context of its prompts to the next catch-up."""
        skip = self.skip(bucket)
        return skip is not None and (skip.state == "off" or not skip.possible)

    def plan(self, bucket: int, behind: int = 0, n_live: int | None = None, usable: int | None = None) -> StepPlan:
        """What the next step at `bucket` runs: whether it drafts (never without the bucket's costs),
        and the draft graph's inputs. behind: positions whose drafter context a draft would first
        write (Batch.n_behind); n_live, usable: the live rows and the drafts they can still emit
        (Batch.usable; default: the whole bucket, a block each). Called once per step: a skipped step
        counts toward the next probe."""
        costs = self.costs(bucket)
        skip = self.skip(bucket)
        draft = self.needs_drafter and costs is not None and (skip is None or skip.draft_now(behind, n_live, usable))
        cost = list(costs or [1.0] * len(self.rhos))
        if skip is not None:  # the draft is paid once drafting: rho = 0 then costs what the smallest rho does
            cost[0] = cost[1]
        return StepPlan(draft, cost, self.calibration.gain_scale, ahead=skip is None or skip.state == "drafting",
                        usable=usable)

    def committed(self, gain: torch.Tensor, n_live: torch.Tensor, gain_scale: torch.Tensor) -> torch.Tensor:
        """What a step is worth: expected accepted drafts gain [n_rho], calibrated by gain_scale, plus
        one anchor per live request (the accepted-only variant leaves the anchors out)."""
        return gain_scale * gain + (n_live if self.count_anchors else 0.0)

    def choose(self, gain: torch.Tensor, n_live: torch.Tensor, gain_scale: torch.Tensor,
               cost: torch.Tensor) -> torch.Tensor:
        """rho* index (in the graph): argmax of expected committed tokens per second, cost [n_rho]
        seconds per step at the bucket."""
        return torch.argmax(self.committed(gain, n_live, gain_scale) / cost)

    def observe(self, rec: StepRecord) -> None:
        """Learn from one step: calibration (the gain scale, and the table entry the step ran at), then
        the skip decision of its bucket. A drafting step that kept nothing refines no entry (it is
        neither an AR step nor a step at the smallest budget)."""
        self.calibration.observe(rec)
        if self.calibration.enabled and rec.seconds > 0 and self.costs(rec.bucket) is not None:
            if rec.drafted and rec.rho > 0 or not rec.drafted and 0.0 in self.rhos:
                self.table.refine(rec.bucket, rec.rho if rec.drafted else 0.0, rec.seconds)
        skip = self.skip(rec.bucket)
        if skip is not None:
            skip.observe(rec)

    @property
    def state(self) -> dict:
        """What this policy learned online, as JSON-able data (load_state takes it back)."""
        return {"calibration": self.calibration.state,
                "skipping": {str(b): s.state_dict for b, s in sorted(self.skipping.items())}}

    def load_state(self, state: dict) -> None:
        """Continue from a saved `state`; ValueError (one line) if it is not one."""
        try:
            self.calibration.load_state(state["calibration"])
            for b, s in state["skipping"].items():
                skip = self.skip(int(b))
                if skip is not None:
                    skip.load_state(s)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
            self.reset()
            raise ValueError(f"not a saved policy state ({type(e).__name__}: {e})") from None

    def reset(self) -> None:
        """Forget everything learned online."""
        self.calibration.reset()
        self.skipping.clear()

