"""In-graph sampling and the acceptance rule (PAPER.md section 4). Pure tensor functions.

No torch.multinomial and no .item(): a sample is argmax(p / E) with E ~ Exp(1) (the exponential-race
form of sampling from p), which compiles into the graph without a host sync.
"""

from __future__ import annotations

import torch


def sample(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """logits [N, V] -> tokens [N]. temperature 0 is greedy; top_p < 1 keeps the smallest set of
    tokens whose probability mass reaches top_p. temperature / top_p are fixed per compiled graph."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # [N, V]
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p  # the top token is always kept
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p * keep)
    race = torch.empty_like(probs).exponential_(1)
    return (probs / race).argmax(-1)


def accept(drafts: torch.Tensor, keep_len: torch.Tensor, target_tok: torch.Tensor) -> torch.Tensor:
    """Accepted draft count per request [B].

    drafts [B, D]; keep_len [B] (only the first keep_len drafts were verified);
    target_tok [B, D + 1]: the target's choice (argmax or its own sample) after the anchor and after
    each verified draft. Draft k is accepted while it equals the target's choice at the previous
    position; for a greedy drafter this is exact rejection sampling, so the output is the target's."""
    D = drafts.shape[1]
    depth = torch.arange(D, device=drafts.device)
    match = (drafts == target_tok[:, :D]) & (depth < keep_len[:, None])  # [B, D]
    return match.int().cumprod(dim=1).sum(dim=1)
