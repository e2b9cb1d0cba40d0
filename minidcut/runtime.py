"""Process-wide settings, made once by the entry points (or by a user of the API) before any engine:
the thread count, where inductor keeps compiled kernels, and dynamo's recompile limits.

    import minidcut
    minidcut.setup(threads=1)
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import torch

COMPILE_CACHE = Path(__file__).resolve().parent.parent / "compile_cache"
GRAPH_LIMIT = 1024  # compiled graphs per function: one per (batch bucket, K); far above what a run reaches


def write_atomically(path, write) -> Path:
    """Write `path` through write(tmp), a file beside it, then rename that over `path`: a process stopped
    half-way leaves the earlier file whole (the temporary name carries the process id: two writers
    never share one)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    write(tmp)
    os.replace(tmp, path)
    return path


def default_threads() -> int:
    """Intra-op threads on a CPU: all cores but one, at least one (measured in the README: a thread
    pool that spans every core collapses when another process holds one of them)."""
    return max(1, (os.cpu_count() or 1) - 1)


def default_compile(device) -> bool:
    """torch.compile the decode graphs by default on CUDA; run eagerly on a CPU, where inductor takes
    30-90 s per graph on a small machine (the CLIs and the API share this default)."""
    return torch.device(device).type == "cuda"


def freeze_heap() -> None:
    """Before decoding: collect once, then hide every object the process has so far (torch, the
    tokenizer, the models' Python objects: ~200k) from Python's garbage collector. Otherwise each full
    collection walks them all: measured 114 ms on a 2-core CPU, several times a run, a pause landing
    inside a decode step of ~15 ms and slowing whichever policy allocates more per step."""
    gc.collect()
    gc.freeze()


def setup(threads: int | None = None, compile_cache: Path = COMPILE_CACHE) -> None:
    """Set the thread count (default: default_threads()), keep inductor's kernels under compile_cache/
    (unless the user chose TORCHINDUCTOR_CACHE_DIR), allow one graph per (bucket, K) and never fall back
    to eager silently when a limit is hit."""
    torch.set_num_threads(threads or default_threads())
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(compile_cache / "inductor")
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, GRAPH_LIMIT)
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, GRAPH_LIMIT)
    cfg.fail_on_recompile_limit_hit = True
