"""In-graph sampling and the acceptance rule (docs/method.md, "Verification"). Pure tensor functions.

No torch.multinomial and no .item(): a sample is argmax(p / E) with E ~ Exp(1) (the exponential-race
form of sampling from p), which compiles into the graph without a host sync.

Keyed draws. The noise E for the token at position p of request r is a function of (seed, r, p) alone
(a counter-based hash, no generator state): AR decoding and every speculative policy draw the same
noise for the same token, whatever the batch, bucket or timing, so with the same seed they sample the
same text (up to float differences between differently packed forwards).
"""

from __future__ import annotations

import torch


def _i32(x: int) -> int:
    """A 32-bit constant as the int32 with the same bits."""
    return x - (1 << 32) if x >= 1 << 31 else x


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash with good avalanche (xorshift-multiply, "lowbias32") on int32 tensors:
    the bits are read as unsigned; products wrap mod 2^32 and `>>` is made logical by a mask."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _i32(0x7FEB352D)
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * _i32(0x846CA68B)
    return x ^ ((x >> 16) & 0xFFFF)


def sample_keys(seed: int, request: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The key of the draw for the token at position pos of request `request` [N] -> int32 [N]."""
    seeded = mix32(torch.full(request.shape, _i32(seed & 0xFFFFFFFF), dtype=torch.int32, device=request.device))
    return mix32(mix32(seeded ^ request.to(torch.int32)) ^ pos.to(torch.int32))


def exponential_noise(keys: torch.Tensor, V: int) -> torch.Tensor:
    """E ~ Exp(1) [N, V] (float32), a function of the keys [N] only. Its integer temporaries are int32
    [N, V], half what int64 would hold over a whole vocabulary."""
    token = mix32(torch.arange(V, dtype=torch.int32, device=keys.device) + _i32(0x9E3779B9))  # [V]
    h = mix32(keys[:, None] ^ token)  # [N, V] int32
    u = (((h >> 8) & 0xFFFFFF).float() + 0.5) / 2.0 ** 24  # uniform in (0, 1), 24 bits
    return -torch.log(u)


def sample(logits: torch.Tensor, temperature: float, top_p: float, keys: torch.Tensor) -> torch.Tensor:
    """logits [N, V] -> tokens [N]. temperature 0 is greedy; top_p < 1 keeps the smallest set of
    tokens whose probability mass reaches top_p; keys [N] (sample_keys) fix the random draw.
    temperature / top_p are fixed per compiled graph."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # [N, V]
    if top_p < 1.0:
        probs = probs * (probs >= nucleus_floor(probs, top_p))
    return (probs / exponential_noise(keys, probs.shape[-1])).argmax(-1)


def nucleus_floor(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The smallest probability in each row's top-p nucleus [N, 1]: token i is in it iff the tokens
    more probable than i hold less than top_p of the mass (the most probable token always is); equal
    probabilities are kept or dropped together. probs [N, V] float32.

    No sort (whose int64 indices alone would be 8 bytes a logit). The mass above t, sum(p[p > t]),
    falls as t grows, and the floor is the smallest t where it is below top_p; that t is a
    probability, and positive float32 values order like their bits read as int32. So a bisection over
    those bits, 31 masked sums, finds it exactly."""
    lo = torch.zeros(probs.shape[0], 1, dtype=torch.int32, device=probs.device)  # mass above 0.0: all of it
    hi = probs.amax(dim=-1, keepdim=True).view(torch.int32)  # mass above the top probability: none
    zero = probs.new_zeros(())
    for _ in range(31):  # hi - lo < 2^31 halves to 1: hi is then the floor's bits
        mid = lo + (hi - lo) // 2
        below = torch.where(probs > mid.view(torch.float32), probs, zero).sum(-1, keepdim=True) < top_p  # [N, 1]
        hi, lo = torch.where(below, mid, hi), torch.where(below, lo, mid)
    return hi.view(torch.float32)


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
