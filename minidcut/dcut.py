"""The D-cut selector (docs/method.md, "One D-cut step"): pure, vectorized tensor functions, traced into the
compiled draft graph. Nothing here syncs with the host.

  c[i, k]      confidence of request i's draft at depth k (k = 1..D)
  s[i, k]      = prod_{j<=k} c[i, j]: the prefix score, kept in log space
  K(rho)       = round(rho * B * D) drafts verified at most; T(rho) = B + K(rho) tokens
  keep_len[i]  = how many of request i's positions are among the global top K
  gain(rho)    = sum of the top-K scores: expected accepted drafts
  rho*         = argmax gain(rho) / cost(B, rho), chosen by the policy (policy.Policy.choose)

`select` is the one entry point: scores, one global sort, keep_len and gain of every budget from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def budget(rho: float, B: int, D: int) -> int:
    """K(rho): drafts verified at most for B requests drafting D tokens each."""
    return int(round(rho * B * D))


def most_committed(K: int, n_live: int, usable: int) -> int:
    """Tokens a step verifying at most K drafts commits at best: every kept draft accepted (no more than
    the rows can still emit, `usable`) and each live row's anchor. What decides whether drafting can win
    at all (skipping.py) and where the profiler stops measuring larger budgets (profiler.py)."""
    return n_live + min(K, usable)


def prefix_scores(conf: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """log s [B, D] from confidences conf [B, D]. Depths beyond limit[i] (request i may emit at most
    limit[i] more drafts; 0 for an empty row) score -inf: they can never be emitted, so they are
    never kept."""
    log_s = torch.cumsum(torch.log(conf.float().clamp_min(1e-30)), dim=1)  # [B, D], non-increasing
    depth = torch.arange(1, conf.shape[1] + 1, device=conf.device)
    return log_s.masked_fill(depth > limit[:, None], float("-inf"))


def ranking(log_s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The global ranking of the B*D scores: (scores sorted descending [B*D], rank of each position
    [B, D]). Ties keep their flat order (stable), so the ranking is deterministic."""
    B, D = log_s.shape
    top, order = torch.sort(log_s.flatten(), descending=True, stable=True)  # [B*D]
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(B * D, device=log_s.device))
    return top, rank.view(B, D)


def keep_lens(log_s: torch.Tensor, Ks: list[int] | torch.Tensor, rank: torch.Tensor | None = None) -> torch.Tensor:
    """keep_len [n_rho, B] for every budget in Ks: how many of request i's finite-scored positions
    are among the global top K (rank: ranking(log_s)[1], when the caller has it).

    keep_len[i] COUNTS request i's positions inside the top K; it never reads which positions they
    are. Because s is non-increasing along depth, a request's positions in any top-K set are a prefix
    up to ties, and under ties (equal scores, e.g. confidence exactly 1.0) a count of them is still a
    valid prefix length of the same total score. A -inf score is never counted, so
    sum(keep_len) = min(K, number of finite scores): the verify graph pads the rest."""
    if rank is None:
        rank = ranking(log_s)[1]
    K = torch.as_tensor(Ks, device=log_s.device)  # [n_rho] (a tensor on the device already: no copy)
    inside = (rank[None] < K.view(-1, 1, 1)) & torch.isfinite(log_s)[None]  # [n_rho, B, D]
    return inside.sum(dim=2)  # [n_rho, B]


def gains(top: torch.Tensor, Ks: list[int] | torch.Tensor) -> torch.Tensor:
    """Expected accepted drafts of each budget [n_rho]: the sum of the top-K(rho) scores, from the
    sorted log scores top [B*D] (ranking(log_s)[0]; exp(-inf) = 0 adds nothing)."""
    csum = torch.cat([top.new_zeros(1), torch.cumsum(top.exp(), 0)])  # [B*D + 1]; csum[K] = top-K sum
    return csum[torch.as_tensor(Ks, device=top.device)]


@dataclass
class Selection:
    """What the selector decided for every budget of the grid."""

    log_s: torch.Tensor  # [B, D] log prefix scores
    keep_lens: torch.Tensor  # [n_rho, B]
    gains: torch.Tensor  # [n_rho] expected accepted drafts


def select(conf: torch.Tensor, limit: torch.Tensor, Ks: list[int] | torch.Tensor) -> Selection:
    """Steps 2-4 of a D-cut step for every budget K in Ks, from one global sort: conf [B, D] (the
    drafter's probability of each draft), limit [B] (drafts each request can still emit). Ks as a
    tensor on conf's device costs no host-to-device copy (an eager step on a GPU)."""
    log_s = prefix_scores(conf, limit)  # [B, D]
    top, rank = ranking(log_s)
    return Selection(log_s, keep_lens(log_s, Ks, rank), gains(top, Ks))
