"""The public API: load a target and its drafter, build a policy, make an engine, generate.

    from minidcut import load_pair, build_policy, Engine
    target, drafter, device, dtype = load_pair("models/llama-stdlib-4m", "models/llama-stdlib-4m-dflash")
    policy = build_policy("dcut", target=target, drafter=drafter, batch_size=8, max_seq=256)
    outputs, stats = Engine(target, drafter, policy, batch_size=8, max_seq=256).generate(prompt_ids, 64)
"""

from __future__ import annotations

from pathlib import Path

import torch

from .cost_model import CostTable, table_path
from .loader import load_drafter, load_target, parse_dtype
from .policy import DEFAULT_GRID, Policy


def resolve_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return dev


def load_pair(target_dir, drafter_dir=None, dtype: str | None = None, device: str | None = None):
    """(target, drafter or None, device, dtype). Default dtype: bfloat16 on CUDA, float32 on CPU."""
    dev = resolve_device(device)
    dt = parse_dtype(dtype) if dtype else (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    target = load_target(target_dir, dt, dev)
    drafter = load_drafter(drafter_dir, target, dt, dev) if drafter_dir else None
    return target, drafter, dev, dt


def load_tokenizer(model_dir):
    """The model directory's tokenizer, or None when it has none."""
    if not any((Path(model_dir) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


def parse_batch_sizes(text: str) -> list[int]:
    """'1,4,16' -> [1, 4, 16] (sorted, unique); ValueError (a one-line message) for anything else."""
    try:
        values = sorted({int(b) for b in text.split(",") if b.strip()})
    except ValueError:
        raise ValueError(f"--batch-sizes {text!r}: expected comma-separated integers") from None
    if not values or values[0] < 1:
        raise ValueError(f"--batch-sizes must be >= 1, got {text!r}")
    return values


def parse_rhos(rhos) -> list[float]:
    try:
        values = sorted({float(r) for r in (rhos.split(",") if isinstance(rhos, str) else rhos)})
    except ValueError:
        raise ValueError(f"rho grid {rhos!r} is not a comma-separated list of numbers") from None
    if not values or any(not 0.0 <= r <= 1.0 for r in values):
        raise ValueError(f"rho grid values must be in [0, 1], got {rhos!r}")
    return values


def build_policy(name: str, rho: float | None = None, rhos=DEFAULT_GRID, gain: str = "committed",
                 calibrate: bool = True, skip_drafting: bool = True, target=None, drafter=None,
                 target_dir=None, drafter_dir=None, batch_size: int = 8, max_seq: int = 256,
                 cost_table: str | None = None, compile: bool = True, log=None) -> Policy:
    """A Policy by name. For dcut the cost table comes from `cost_table`, else from the table
    tools/profile.py wrote for this (device, target, drafter, dtype); when there is none, a quick
    profile at this batch size is measured now (with a warning) and saved for the next run."""
    if name == "ar":
        return Policy.ar()
    if name == "full":
        return Policy.full()
    if name == "static":
        if rho is None:
            raise ValueError("the static policy needs rho")
        return Policy.static(rho)
    if name != "dcut":
        raise ValueError(f"unknown policy {name!r} (choose from ar, full, static, dcut)")
    grid = parse_rhos(rhos)
    w = target.lm_head.weight
    path = Path(cost_table) if cost_table else (
        table_path(w.device, target_dir, drafter_dir, w.dtype) if target_dir and drafter_dir else None)
    if path is not None and path.is_file():
        table = CostTable.load(path)
    elif cost_table:
        table = CostTable.load(path)  # raises: the named table does not exist
    else:
        from .profiler import profile
        if log:
            log("[yellow]warning:[/] no cost table for this device/target/drafter/dtype"
                + (f" ({path})" if path else "") + f"; measuring a quick one at B = {batch_size} "
                "(run tools/profile.py for a full table)")
        ctx = max(8, max_seq // 2)
        table = profile(target, drafter, [batch_size], grid, ctx, repeats=3, warmup=1, compile=compile,
                        meta={"quick": True, "target": str(target_dir), "drafter": str(drafter_dir)})
        if path is not None:
            table.save(path)
    return Policy.dcut(table, grid, count_anchors=gain == "committed", calibrate=calibrate,
                       skip_drafting=skip_drafting)
