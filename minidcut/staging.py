"""Host -> device inputs in one copy. Everything a step (or a prefill) builds on the host, such as the
draft graph's live rows and costs, the rows a compaction moves, the positions a catch-up writes, or a
prompt's tokens and layout, is written into one host buffer and sent together: a single copy, non_blocking
from pinned memory on CUDA.

put() returns a handle (Staged); after send(), its `.device` is the values' view on the device. The
buffer is float32. Integers below 2^24 (token ids, positions, rows, request indices) are exact; the
receiver casts them back with .long(). Its first `fixed` slots hold the draft graph's inputs at a place
that never moves (the compiled draft graph reads them there): a draft made ahead (runner.Runner.verify)
edits them on the device, and a copy that carries no new draft inputs leaves them alone. On CUDA the copy runs after the host has moved on, so the next put()
first waits for it to finish reading the buffer (usually long done: each step ends with a copy back).
"""

from __future__ import annotations

import numpy as np
import torch


class Staged:
    """Values put() for the next send(): `device` is their view on the device once sent."""

    def __init__(self, start: int, size: int):
        self.start, self.size, self.device = start, size, None


class Staging:
    def __init__(self, fixed: int, device: torch.device, extra: int = 1024):
        self.fixed, self.device = fixed, torch.device(device)
        self.host = self.dev = self.copying = None
        self.reserve(fixed + extra)
        self.clear()

    def reserve(self, size: int) -> None:
        """Room for `size` slots (at least doubling); a larger buffer keeps what is staged on the host
        and the draft inputs on the device."""
        if self.host is not None and size <= self.host.numel():
            return
        if self.host is not None:
            size = max(size, 2 * self.host.numel())
        host = torch.zeros(size, pin_memory=self.device.type == "cuda")
        dev = torch.zeros(size, device=self.device)
        if self.dev is not None:
            host[: self.host.numel()] = self.host
            dev[: self.fixed] = self.dev[: self.fixed]
        self.host, self.dev = host, dev

    def clear(self) -> None:
        self.lo, self.end, self.pending = self.fixed, self.fixed, []

    def put(self, values, fixed: bool = False) -> Staged:
        """Stage `values` (a sequence of numbers, or a 1-d host tensor); the handle's `.device` holds
        them on the device after send(). fixed: the draft inputs, at the buffer's start."""
        if self.copying is not None:  # the last copy may still be reading the host buffer
            self.copying.synchronize()
            self.copying = None
        values = np.asarray(values, dtype=np.float32)
        n = values.size
        if fixed:
            if n > self.fixed:
                raise ValueError(f"{n} draft inputs do not fit the {self.fixed} fixed slots")
            start, self.lo = 0, 0
        else:
            start = self.end
            self.end += n
            self.reserve(self.end)
        self.host.numpy()[start : start + n] = values
        staged = Staged(start, n)
        self.pending.append(staged)
        return staged

    def send(self) -> None:
        """One copy of everything staged since the last send; each handle's `.device` is set."""
        for staged in self.pending:
            staged.device = self.dev[staged.start : staged.start + staged.size]
        if self.end > self.lo:
            self.dev[self.lo : self.end].copy_(self.host[self.lo : self.end], non_blocking=True)
            if self.device.type == "cuda":
                self.copying = torch.cuda.Event()
                self.copying.record()
        self.clear()

    def fixed_inputs(self, n: int) -> torch.Tensor:
        """The draft inputs on the device [n] (as the latest draft left them)."""
        return self.dev[:n]
