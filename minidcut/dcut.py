"""The D-cut selector (docs/method.md, "One D-cut step"): pure, vectorized tensor functions, traced into the
compiled draft graph. Nothing here syncs with the host.

  c[i, k]      confidence of request i's draft at depth k (k = 1..D)
  s[i, k]      = prod_{j<=k} c[i, j]: the prefix score, kept in log space
  K(rho)       = round(rho * B * D) drafts verified in total; T(rho) = B + K(rho) tokens
  keep_len[i]  = how many of request i's positions are among the global top K
  gain(rho)    = sum of the top-K scores (+ B anchors when gain counts committed tokens)
  rho*         = argmax gain(rho) / cost(B, rho)
"""

from __future__ import annotations

import torch


def budget(rho: float, B: int, D: int) -> int:
    """K(rho): drafts verified in total for B requests drafting D tokens each."""
    return int(round(rho * B * D))


def prefix_scores(conf: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """log s [B, D] from confidences conf [B, D]. Depths beyond limit[i] (request i may emit at most
    limit[i] more drafts; 0 for an empty slot) score -inf so no budget is spent on them."""
    log_s = torch.cumsum(torch.log(conf.float().clamp_min(1e-30)), dim=1)  # [B, D], non-increasing
    depth = torch.arange(1, conf.shape[1] + 1, device=conf.device)
    return log_s.masked_fill(depth > limit[:, None], float("-inf"))


def keep_lens(log_s: torch.Tensor, Ks: list[int]) -> torch.Tensor:
    """keep_len [n_rho, B] for every budget in Ks, from one global ranking of the B*D scores.

    keep_len[i] COUNTS request i's positions inside the global top K; it never reads which
    positions they are. Because s is non-increasing along depth, a request's positions in any top-K
    set are a prefix up to ties, and under ties (equal scores, e.g. confidence exactly 1.0) a count
    of them is still a valid prefix length of the same total score. So sum(keep_len) == K exactly."""
    B, D = log_s.shape
    order = torch.argsort(log_s.flatten(), descending=True, stable=True)  # [B*D]
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(B * D, device=log_s.device))
    K = torch.tensor(Ks, device=log_s.device)  # [n_rho]
    inside = rank.view(1, B, D) < K.view(-1, 1, 1)  # [n_rho, B, D]
    return inside.sum(dim=2)  # [n_rho, B]


def gains(log_s: torch.Tensor, Ks: list[int], n_live: torch.Tensor | None) -> torch.Tensor:
    """Expected accepted drafts of each budget: sum of the top-K(rho) scores [n_rho].
    Given n_live (the number of live requests), add one anchor per live request: expected committed
    tokens per step, which is what throughput counts and what makes rho = 0 (an AR step) comparable."""
    top = torch.sort(log_s.flatten().exp(), descending=True).values  # [B*D]
    csum = torch.cat([top.new_zeros(1), torch.cumsum(top, 0)])  # [B*D + 1]; csum[K] = top-K sum
    g = csum[torch.tensor(Ks, device=log_s.device)]
    return g if n_live is None else g + n_live


def choose_rho(gain: torch.Tensor, cost: torch.Tensor) -> torch.Tensor:
    """rho* index: argmax gain / cost (cost [n_rho], seconds per step at this batch size)."""
    return torch.argmax(gain / cost)
