"""Host-side state of a batch: the requests, which cache row holds which, and the batch buckets a step
can run at (docs/method.md, "Batch buckets")."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch


@dataclass
class Request:
    index: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)

    @classmethod
    def checked(cls, prompts: list[list[int]], max_new_tokens: int | list[int], vocab: int, block: int,
                max_seq: int) -> list["Request"]:
        """The requests of a generate() call (max_new_tokens: one for all, or one per prompt), or
        ValueError (one line) for one an engine cannot serve: an empty prompt, a token outside
        [0, vocab), or prompt + new tokens + a draft block > max_seq."""
        lengths = per_prompt(max_new_tokens, len(prompts))
        for i, (p, max_new_tokens) in enumerate(zip(prompts, lengths)):
            if max_new_tokens < 1:
                raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
            bad = next(((j, t) for j, t in enumerate(p) if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"prompt {i}: token id {bad[1]} at position {bad[0]} is outside the "
                                 f"vocabulary [0, {vocab})")
            if len(p) + max_new_tokens + block > max_seq:
                raise ValueError(f"prompt {i}: {len(p)} prompt tokens + {max_new_tokens} new tokens + "
                                 f"{block} for a draft block exceed the engine's {max_seq} positions")
        return [cls(i, list(p), n) for i, (p, n) in enumerate(zip(prompts, lengths))]

    @property
    def anchor_pos(self) -> int:
        """Position of the last committed token (the anchor of the next block)."""
        return len(self.prompt) + len(self.output) - 1

    @property
    def last_pos(self) -> int:
        """Position of the last token it may commit (its prompt and max_new_tokens)."""
        return len(self.prompt) + self.max_new_tokens - 1

    @property
    def limit(self) -> int:
        """Drafts it can still use: its remaining tokens minus the bonus (the draft graph computes the
        same from the device's anchor position and last position)."""
        return self.last_pos - self.anchor_pos - 1


@dataclass
class Ahead:
    """The next step's draft, made by a step right after its verification (runner.Runner.verify): valid
    for the step after it while no row changed hands (the batch's version) and the bucket is the same."""

    version: int
    bucket: int
    draft: object  # graphs.Draft


@dataclass
class Batch:
    """Host-side state of the cache rows: which request each row holds, and per row the anchor (last
    committed token) and its position on the device. Live rows are kept in the lowest rows.

    Per row, the request on the host owns its tokens, and so its position, the drafts it can still use
    and how far its drafter context is written. The device tensors here hold what the graphs read (the
    anchor, its position, its last position, the sampling key): written by the prefill and, for the
    anchor and its position, by the verification that commits the same tokens; moved with their rows,
    never read back. The drafts a row may still emit are derived from them, on either side, never
    kept. Which rows are live the host sends with each draft's inputs (live_mask)."""

    requests: list[Request | None]
    anchor: torch.Tensor  # [rows]
    anchor_pos: torch.Tensor  # [rows]
    last: torch.Tensor  # [rows] the position of the last token each row's request may commit
    request_ids: torch.Tensor  # [rows] the sampling key of each row's request
    written: list[int]  # per row: positions below this have the drafter's context K/V written
    version: int = 0  # bumped whenever a row changes hands (placed, freed, moved)
    ahead: Ahead | None = None  # the next step's draft, made by this step
    prompt_context: float = 0.0  # seconds prefills spent on the drafter's context of prompts, not yet
    #                              charged to a drafting step (Engine.record)
    admitted: int = 0  # requests admitted since the last step's record (Engine.record)

    @classmethod
    def empty(cls, rows: int, device) -> "Batch":
        z = functools.partial(torch.zeros, rows, dtype=torch.long, device=device)
        return cls([None] * rows, z(), z(), z(), z(), [0] * rows)

    @property
    def live(self) -> list[int]:
        return [i for i, r in enumerate(self.requests) if r is not None]

    def place(self, rows: list[int], requests: list[Request], written: bool = True) -> None:
        """Requests enter rows after their prefill, which wrote the rows' device state (the first token
        as the anchor, right after the prompt) and the drafter's context of the prompt (written) or only
        held its taps (not written: the prompt is caught up like skipped steps)."""
        for row, r in zip(rows, requests):
            self.requests[row], self.written[row] = r, len(r.prompt) if written else 0
        self.version += 1

    def free(self, row: int) -> None:
        """The row's request finished."""
        self.requests[row] = None
        self.version += 1

    @property
    def reach(self) -> int:
        """One past the furthest live row's anchor position (what an eager step's attention span
        follows, runner.Runner.span)."""
        return max(r.anchor_pos for r in self.requests if r is not None) + 1

    def take_ahead(self, bucket: int, use: bool = True):
        """The draft the previous step made for this one, if no row changed hands since and the bucket
        is the same (else None); it is used once, and dropped by a step that does not draft (use False:
        None), since the positions it was drafted for move on."""
        ahead, self.ahead = self.ahead, None
        valid = use and ahead is not None and (ahead.version, ahead.bucket) == (self.version, bucket)
        return ahead.draft if valid else None

    def live_mask(self, b: int) -> list[bool]:
        """Whether each of rows [0, b) holds a request."""
        return [r is not None for r in self.requests[:b]]

    def usable(self, D: int) -> int:
        """Drafts the live rows can still emit: each row's limit, at most a block of D."""
        return sum(min(D, r.limit) for r in self.requests if r is not None)

    @property
    def steps_left(self) -> int:
        """The most tokens a live row may still emit: at most this many steps are left (fewer if rows
        accept drafts or stop early)."""
        return max((r.limit + 1 for r in self.requests if r is not None), default=0)

    @property
    def n_behind(self) -> int:
        """Committed positions of the live rows whose drafter context K/V is not written (behind)."""
        return sum(r.anchor_pos - self.written[i] for i, r in enumerate(self.requests) if r is not None)

    def behind(self) -> list[int]:
        """[rows + positions] of committed tokens whose drafter context is not written, now marked as
        written (the caller catches them up; empty if none)."""
        rows, pos = [], []
        for i in self.live:
            end = self.requests[i].anchor_pos
            rows += [i] * (end - self.written[i])
            pos += range(self.written[i], end)
            self.written[i] = end
        return rows + pos

    def move(self, src: list[int], dst: list[int]) -> None:
        """Requests of rows src move to rows dst, on the host (the engine copies their device state)."""
        for i, j in zip(src, dst):
            self.requests[j], self.requests[i], self.written[j] = self.requests[i], None, self.written[i]
        self.version += 1


def per_prompt(max_new_tokens: int | list[int], n: int) -> list[int]:
    """max_new_tokens for each of n prompts: one value for all, or a list of n (ValueError otherwise)."""
    if isinstance(max_new_tokens, int):
        return [max_new_tokens] * n
    if len(max_new_tokens) != n:
        raise ValueError(f"{len(max_new_tokens)} max_new_tokens for {n} prompts")
    return [int(x) for x in max_new_tokens]


def batch_buckets(max_batch: int) -> list[int]:
    """Batch sizes a step may run at: powers of two below max_batch, and max_batch."""
    return sorted({2 ** i for i in range(max_batch.bit_length()) if 2 ** i < max_batch} | {max_batch})
