"""Counters of a generate() call, in the method's metric names (docs/method.md, "Metrics")."""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

import torch


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


class StepClock:
    """The seconds of one decode step, kept apart from the method (Engine.step): marks where drafting and
    verification begin and end, and what the step spent on measuring a cost row, on the catch-up and on
    the draft it made ahead. A step's record gets one draft and one verification (as a cost-table entry
    prices a step); the stats get every second, split into draft / verify / bookkeeping."""

    def __init__(self):
        self.marks = {"start": time.perf_counter()}
        self.measuring = self.catchup = self.ahead = self.redraft = 0.0
        self.cold = False  # the step ran a compiled graph that was not warm yet: its seconds are compiling
        self.redrafted = False  # a fresh draft that also drafted ahead: two drafts in the step

    def mark(self, phase: str, catchup: float | None = None) -> None:
        """phase 'draft' (the step's inputs sent, with the catch-up's seconds), 'verify' (its draft
        ready), 'commit' (verified)."""
        self.marks[phase] = time.perf_counter()
        if catchup is not None:
            self.catchup = catchup

    def step_seconds(self) -> float:
        """Seconds from the draft on, with one draft: a fresh draft that also drafted ahead ran two, and
        the fresh one (redraft) is the price of rows changing hands, not of this step's budget."""
        if self.cold:  # compiling, not a step's or a redraft's time: nothing measured
            self.redraft = 0.0
            return 0.0
        self.redraft = self.marks["verify"] - self.marks["draft"] if self.redrafted else 0.0
        return time.perf_counter() - self.marks["draft"] - self.redraft

    def charge(self, stats: "Stats") -> None:
        """Every second of the step but prefill and measuring into stats.seconds (a cold step's all
        into compile): drafting holds the
        catch-up and the draft made ahead; bookkeeping the plan, staging and row moves before the draft
        and the commit and feedback after the verification."""
        m = self.marks
        if self.cold:  # a graph compiled or recorded in this step: compile time, not decoding
            stats.seconds["compile"] += time.perf_counter() - m["start"] - self.measuring
            return
        before = m["draft"] - m["start"] - self.measuring - self.catchup
        stats.seconds.update(draft=m["verify"] - m["draft"] + self.catchup + self.ahead,
                             verify=m["commit"] - m["verify"] - self.ahead,
                             bookkeeping=before + time.perf_counter() - m["commit"])


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
