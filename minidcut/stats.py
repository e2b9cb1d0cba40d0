"""Counters of a generate() call, in the method's metric names (docs/method.md, "Metrics")."""

from __future__ import annotations

import collections
import math
import statistics
import time
from dataclasses import dataclass, field

import torch


class DecayedRatio:
    """A running ratio sum(decay^age * x) / sum(decay^age * y) of the samples (x, y) so far: a memory of
    about 1 / (1 - decay) samples. Its state is the two sums."""

    def __init__(self, decay: float, sums=(0.0, 0.0)):
        self.decay, self.sums = decay, [float(v) for v in sums]
        if len(self.sums) != 2:
            raise ValueError("a decayed ratio's state is two sums")

    def add(self, x: float, y: float) -> None:
        self.sums = [self.decay * self.sums[0] + x, self.decay * self.sums[1] + y]

    def ratio(self, default: float = 0.0) -> float:
        return self.sums[0] / self.sums[1] if self.sums[1] > 0 else default


class DecayedScores:
    """Scores weighted decay ** age: their mean, effective count n = (sum w)^2 / sum w^2, and the
    half-width of the mean's one-sided confidence bound (Student's t; infinite below two samples).
    Its state is [sum w, sum w x, sum w x^2, sum w^2]."""

    def __init__(self, decay: float, sums=(0.0, 0.0, 0.0, 0.0)):
        self.decay, self.sums = decay, [float(v) for v in sums]
        if len(self.sums) != 4:
            raise ValueError("decayed scores' state is [sum w, sum w x, sum w x^2, sum w^2]")

    def add(self, x: float) -> None:
        d, (w, wx, wxx, ww) = self.decay, self.sums
        self.sums = [d * w + 1.0, d * wx + x, d * wxx + x * x, d * d * ww + 1.0]

    @property
    def n(self) -> float:
        return self.sums[0] ** 2 / self.sums[3] if self.sums[3] > 0 else 0.0

    @property
    def mean(self) -> float:
        return self.sums[1] / self.sums[0] if self.sums[0] > 0 else 0.0

    def margin(self, confidence: float) -> float:
        n = self.n
        if n < 1.5:  # two samples weigh n = 1.9998
            return math.inf
        var = max(0.0, self.sums[2] / self.sums[0] - self.mean ** 2) * n / (n - 1)  # unbiased, reliability weights
        return t_quantile(confidence, n - 1) * math.sqrt(var / n)


def t_quantile(p: float, df: float) -> float:
    """Student's t quantile at probability p, df degrees of freedom: the Cornish-Fisher expansion around
    the normal quantile z to 1 / df^3 (at p = 0.9: within 0.1 % of the exact value for df >= 3, 0.3 %
    at df = 2, 4 % low at df = 1)."""
    z = statistics.NormalDist().inv_cdf(p)
    return (z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * df ** 3))


class Interval:
    """Seconds of the work launched between start() and stop(), read once the step's copy to the host
    has waited for it: host time on a CPU (eager calls run as they are called), CUDA events on a GPU
    (graph launches return at once; the events add no sync of their own)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks = None

    def start(self) -> None:
        self.marks = [torch.cuda.Event(enable_timing=True)] if self.cuda else [time.perf_counter()]
        if self.cuda:
            self.marks[0].record()

    def stop(self) -> None:
        if self.cuda:
            self.marks.append(torch.cuda.Event(enable_timing=True))
            self.marks[1].record()
        else:
            self.marks.append(time.perf_counter())

    @property
    def seconds(self) -> float:
        """0 if never started; on CUDA only after a sync past stop() (the step's copy to the host)."""
        if self.marks is None:
            return 0.0
        a, b = self.marks
        return a.elapsed_time(b) / 1000 if self.cuda else b - a


@dataclass
class RunSeconds:
    """A runner step's seconds by part (runner.Runner.step), on the host clock: each part ends when its
    result reached the host (the fresh draft's pick, the step's tokens), so on CUDA it holds the work."""

    catchup: float = 0.0  # the drafter's context of skipped positions, written before the draft
    draft: float = 0.0  # a fresh draft (0: the step verified the draft made ahead, or did not draft)
    verify: float = 0.0  # from the draft ready to the tokens on the host, the draft made ahead included
    ahead: float = 0.0  # that draft made ahead, for the next step
    redraft: float = 0.0  # the fresh draft, when the step also drafted ahead: two drafts in one step
    cold: bool = False  # a compiled graph ran for the first time: compiling, not a step's seconds
    end: float = 0.0  # time.perf_counter() when the step's tokens reached the host


class StepClock:
    """The seconds of one decode step, kept apart from the method (Engine.step): its start, what it spent
    measuring a cost row, and the runner's parts (RunSeconds). A step's record gets one draft and one
    verification (as a cost-table entry prices a step); the stats get every second, split into draft /
    verify / bookkeeping."""

    def __init__(self):
        self.start, self.measuring = time.perf_counter(), 0.0

    @staticmethod
    def step_seconds(ran: RunSeconds) -> float:
        """Seconds from the draft on, with one draft: a fresh draft that also drafted ahead ran two, and
        the fresh one (redraft) is the price of rows changing hands, not of this step's budget. 0 for a
        cold step (compiling: nothing measured)."""
        return 0.0 if ran.cold else ran.draft - ran.redraft + ran.verify + time.perf_counter() - ran.end

    def charge(self, stats: "Stats", ran: RunSeconds) -> None:
        """Every second of the step but measuring into stats.seconds (a cold step's all into compile):
        drafting holds the catch-up and the draft made ahead; bookkeeping the plan, staging and row
        moves before the draft and the commit and feedback after the verification."""
        total = time.perf_counter() - self.start - self.measuring
        if ran.cold:
            stats.seconds["compile"] += total
            return
        stats.seconds.update(draft=ran.catchup + ran.draft + ran.ahead, verify=ran.verify - ran.ahead,
                             bookkeeping=total - ran.catchup - ran.draft - ran.verify)


@dataclass
class Stats:
    """Running counters of a generate() call (docs/method.md, "Metrics")."""

    policy: str = ""
    batch_size: int = 0
    requests: int = 0
    depth: int = 15  # D, drafts per block of the run's drafter
    generated_tokens: int = 0
    finished: int = 0
    steps: int = 0
    request_steps: int = 0  # live requests summed over target forwards
    committed: int = 0  # tokens committed by decode steps (bonus included)
    drafted: int = 0  # draft positions of live requests, over drafting steps
    kept: int = 0  # drafts sent to verification
    predicted_raw: float = 0.0  # sum over drafting steps of the chosen rho's expected accepted drafts
    predicted: float = 0.0  # the same after calibration (what the policy decided on)
    realized: int = 0  # accepted drafts over the same steps
    drafting_request_steps: int = 0  # live requests summed over drafting steps
    rho_hist: collections.Counter = field(default_factory=collections.Counter)
    bucket_hist: collections.Counter = field(default_factory=collections.Counter)  # steps per batch bucket
    rho_by_bucket: collections.Counter = field(default_factory=collections.Counter)  # steps per (bucket, rho)
    drafting_hist: collections.Counter = field(default_factory=collections.Counter)  # per batch bucket
    seconds: collections.Counter = field(default_factory=collections.Counter)  # prefill/draft/verify/...
    unmeasured: dict = field(default_factory=dict)  # bucket -> steps its rows had left: its row not worth measuring
    trace: list | None = None  # per drafting step (prefix scores, keep_len, accepted) of live rows

    def add(self, rec, gain_scale: float, ran=None, rows=None) -> None:
        """Count one StepRecord (policy.py); with trace on, also keep the live rows' (`rows`) prefix
        scores, kept and accepted drafts of the step the runner ran (runner.Ran)."""
        self.steps += 1
        self.kept += rec.kept
        if self.trace is not None and ran is not None and ran.draft is not None:  # an extra copy to the host
            self.trace.append((ran.draft.log_s[rows].exp().cpu(), ran.kept[rows], ran.n_commit[rows] - 1))
        self.request_steps += rec.n_live
        self.committed += rec.accepted + rec.n_live
        self.rho_hist[rec.rho] += 1
        self.bucket_hist[rec.bucket] += 1
        self.rho_by_bucket[rec.bucket, rec.rho if rec.drafted else None] += 1
        if rec.drafted:
            self.drafting_hist[rec.bucket] += 1
            self.drafted += rec.n_live * self.depth
            self.predicted_raw += rec.predicted
            self.predicted += rec.predicted * gain_scale
            self.realized += rec.accepted
            self.drafting_request_steps += rec.n_live

    @property
    def decode_seconds(self) -> float:
        return sum(v for k, v in self.seconds.items() if k not in ("prefill", "compile", "profile"))

    @property
    def tau(self) -> float:
        return self.committed / max(self.request_steps, 1)

    @property
    def keep_ratio(self) -> float:
        return self.kept / max(self.drafted, 1)

    def as_dict(self) -> dict:
        total = self.decode_seconds + self.seconds["prefill"]
        return {"policy": self.policy, "batch_size": self.batch_size, "requests": self.requests,
                "generated_tokens": self.generated_tokens, "decode_seconds": self.decode_seconds,
                "tokens_per_second": self.generated_tokens / total if total else 0.0,
                "tau": self.tau, "keep_ratio": self.keep_ratio, "steps": self.steps,
                "rho_histogram": {f"{k:g}": v for k, v in sorted(self.rho_hist.items())},
                "bucket_histogram": {str(k): v for k, v in sorted(self.bucket_hist.items())},
                "predicted_accepted_raw": self.predicted_raw, "predicted_accepted": self.predicted,
                "realized_accepted": self.realized, "drafting_request_steps": self.drafting_request_steps,
                "drafting_histogram": {str(k): v for k, v in sorted(self.drafting_hist.items())},
                "profile_seconds": self.seconds["profile"], "seconds": dict(self.seconds),
                "unmeasured_buckets": {str(k): v for k, v in sorted(self.unmeasured.items())}}
