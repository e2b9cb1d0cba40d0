"""Every crossing between host and device during a run, counted on a CPU, where both are the same
memory. A tensor is on the host when it was made without naming a
device (torch.tensor, arange, ...), is the staging buffer's host side, came from a copy to the host,
or from ops on host tensors only; every other tensor is on the device. Counted:

d2h   a device tensor turned into Python values (item, tolist, int(), float(), bool(), an index,
      numpy) or copied to the host (.cpu(), .to("cpu"), a host tensor's copy_ from it)
h2d   a host tensor or a Python list used by an op on device tensors (an index, an operand, copy_
      into a device tensor), or torch.tensor(..., device=...)

Use: `with Crossings(host=[staging.host]) as c: ...`; c.d2h and c.h2d are Counters by where."""

from __future__ import annotations

import collections
import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

T = torch.Tensor
TO_PYTHON = {T.item, T.tolist, T.__int__, T.__float__, T.__bool__, T.__index__, T.numpy, T.__array__}
HOST_DATA = {torch.tensor, torch.as_tensor, torch.from_numpy}
MARK = "_crossings_host"


def on_host(t) -> bool:
    return getattr(t, MARK, False)


def mark(tree) -> None:
    for t in tree_flatten(tree)[0]:
        if isinstance(t, torch.Tensor):
            setattr(t, MARK, True)


def where() -> str:
    """The innermost frame of minidcut's that made the call."""
    frames = [f for f in traceback.extract_stack() if "/minidcut/" in f.filename]
    return f"{frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno}" if frames else "?"


class Crossings(TorchFunctionMode):
    def __init__(self, host=()):
        super().__init__()
        self.d2h, self.h2d = collections.Counter(), collections.Counter()
        mark(list(host))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = tree_flatten((args, kwargs))[0]
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        host = [on_host(t) for t in tensors]
        if func in TO_PYTHON:
            if not host[0]:
                self.d2h[where()] += 1
            return func(*args, **kwargs)
        if func in (T.cpu, T.to) and (func is T.cpu or "cpu" in map(str, flat[1:])):
            if not host[0]:
                self.d2h[where()] += 1
            out = func(*args, **kwargs).clone()  # a copy, as it is on a GPU
            mark(out)
            return out
        out = func(*args, **kwargs)
        if not tensors:  # made from Python values: on the host unless a device is named
            if "device" not in kwargs:
                mark(out)
            elif func in HOST_DATA:
                self.h2d[where()] += 1
            return out
        if func is T.copy_ and tensors and host[0] != host[1]:
            (self.d2h if host[0] else self.h2d)[where()] += 1
            return out
        index = args[1] if func in (T.__getitem__, T.__setitem__) else None
        lists = any(isinstance(i, list) for i in (index if isinstance(index, tuple) else [index]))
        if tensors and all(host):
            mark(out)
        elif any(host) or lists:  # a host tensor (or list) meets device tensors
            self.h2d[where()] += 1
        return out
