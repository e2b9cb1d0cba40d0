"""The public API: load a target and its drafter, build a policy, make an engine, generate.

    import minidcut
    minidcut.setup()                       # process-wide settings: threads, compile cache and limits
    target, drafter, device, dtype = minidcut.load_pair("models/llama-stdlib-4m", "models/llama-stdlib-4m-dflash")
    policy = minidcut.build_policy("dcut", target=target, drafter=drafter, batch_size=8, max_seq=256)
    engine = minidcut.Engine(target, drafter, policy, batch_size=8, max_seq=256, compile=False)
    outputs, stats = engine.generate(prompt_ids, 64)
"""

from __future__ import annotations

from pathlib import Path

import torch

from .batch import batch_buckets
from .cost_model import CostTable, CostTableError, fingerprint, table_path
from .layers import PackedLinear
from .loader import load_drafter, load_target, parse_dtype
from .policy import DEFAULT_GRID, Policy

DCUT_VARIANTS = {"": {}, "accepted": {"count_anchors": False}, "nocal": {"calibrate": False},
                 "noskip": {"skip_drafting": False},
                 "paper": {"count_anchors": False, "calibrate": False, "skip_drafting": False}}


def resolve_device(device: str | None) -> torch.device:
    """cpu or cuda[:N] (default: cuda when available); ValueError for anything else."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"unknown device {device!r} (choose cpu, cuda or cuda:N)") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} is not supported (choose cpu, cuda or cuda:N)")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return dev


def load_pair(target_dir, drafter_dir=None, dtype: str | None = None, device: str | None = None,
              drafter_dtype: str | None = None, pack: bool | None = None):
    """(target, drafter or None, device, dtype). Default dtype: bfloat16 on CUDA, float32 on CPU; the
    drafter's default: the target's (a bfloat16 drafter next to an fp32 target pays only on a CPU with
    bf16 instructions; the output is the target's either way). pack (default: on a CPU):
    linear layers packed for oneDNN (layers.PackedLinear), for engines that run eagerly; pass
    pack=False to compile on a CPU."""
    dev = resolve_device(device)
    dt = parse_dtype(dtype) if dtype else (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    target = load_target(target_dir, dt, dev)
    ddt = parse_dtype(drafter_dtype) if drafter_dtype else dt
    drafter = load_drafter(drafter_dir, target, ddt, dev) if drafter_dir else None
    if pack if pack is not None else dev.type == "cpu":
        target.pack()
        if drafter is not None:
            drafter.pack()
    return target, drafter, dev, dt


def load_tokenizer(model_dir):
    """The model directory's tokenizer, or None when it has none."""
    if not any((Path(model_dir) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


def parse_rhos(rhos) -> list[float]:
    """'0,0.25,1' or numbers -> a sorted rho grid in [0, 1]; ValueError otherwise."""
    try:
        values = sorted({float(r) for r in (rhos.split(",") if isinstance(rhos, str) else rhos)})
    except ValueError:
        raise ValueError(f"rho grid {rhos!r} is not a comma-separated list of numbers") from None
    if not values or any(not 0.0 <= r <= 1.0 for r in values):
        raise ValueError(f"rho grid values must be in [0, 1], got {rhos!r}")
    return values


def parse_policy(spec: str) -> tuple[str, float | None, str]:
    """'ar' | 'full' | 'static:R' | 'dcut' | 'dcut:VARIANT' -> (name, rho, variant); ValueError otherwise."""
    name, _, arg = spec.strip().partition(":")
    if name in ("ar", "full") and not arg:
        return name, None, ""
    if name == "static":
        try:
            rho = float(arg)
        except ValueError:
            raise ValueError(f"policy {spec!r}: static needs a rho, e.g. static:0.5") from None
        if not 0.0 <= rho <= 1.0:
            raise ValueError(f"policy {spec!r}: rho must be in [0, 1]")
        return name, rho, ""
    if name == "dcut":
        if arg not in DCUT_VARIANTS:
            raise ValueError(f"policy {spec!r}: unknown dcut variant (choose from "
                             f"{', '.join(v for v in DCUT_VARIANTS if v)})")
        return name, None, arg
    raise ValueError(f"unknown policy {spec!r} (choose from ar, full, static:R, dcut, dcut:VARIANT)")


def cost_table(target, drafter, target_dir, drafter_dir, batch_sizes: list[int], rhos=DEFAULT_GRID,
               path=None, compile: bool = True, context_len: int = 128, log=None, on_step=None) -> CostTable:
    """The cost table for this (device, threads, dtype, compile, target, drafter), with a row for every
    batch size in batch_sizes: loaded from `path` (default: its file under compile_cache/cost_tables/),
    and the missing rows measured now (profiler.measure) and saved. A table measured under another
    fingerprint or rho grid is not used: log(message) says so, and a new one is measured."""
    w, dw = target.model.embed_tokens.weight, drafter.norm.weight
    rhos = list(rhos)
    path = Path(path) if path else table_path(w.device, target_dir, drafter_dir, w.dtype, dw.dtype)
    packed = any(isinstance(m, PackedLinear) for m in target.modules())
    fp = fingerprint(w.device, target_dir, drafter_dir, w.dtype, compile, dw.dtype, packed)
    table = None
    if path.is_file():
        table = CostTable.load(path)
        theirs = table.meta.get("fingerprint")
        if theirs != fp or table.rhos != rhos:
            diff = ", ".join(f"{k} {theirs.get(k)} != {v}" for k, v in fp.items() if theirs.get(k) != v) \
                if isinstance(theirs, dict) else "no fingerprint"
            if log:
                log(f"cost table {path} does not fit this run ({diff or 'another rho grid'}): measuring a new one")
            table = None
    table = table or CostTable([], rhos, [], {"fingerprint": fp, "target": str(target_dir),
                                              "drafter": str(drafter_dir)})
    missing = [B for B in batch_sizes if table.row(B, rhos) is None]
    if missing:
        from .profiler import measure
        if log:
            log(f"measuring step costs at B = {', '.join(map(str, missing))} for the cost table {path}")
        measure(table, target, drafter, missing, context_len, compile=compile, on_step=on_step)
        table.save(path)
    return table


def build_policy(spec: str = "dcut", *, target=None, drafter=None, target_dir=None, drafter_dir=None,
                 batch_size: int = 8, num_requests: int | None = None, rhos=DEFAULT_GRID,
                 gain: str | None = None, calibrate: bool = True, skip_drafting: bool = True,
                 cost_table_path=None, table: CostTable | None = None, compile: bool = True,
                 context_len: int = 128, log=None, on_step=None) -> Policy:
    """A Policy from a spec string (parse_policy). dcut needs a cost table with a row for every batch
    bucket a run of `num_requests` (default: batch_size) requests at most batch_size at a time reaches:
    cost_table() loads it and measures what is missing. gain: 'committed' (anchors counted, the
    default) or 'accepted' (overrides the variant's). A given `table` is used as it is."""
    name, rho, variant = parse_policy(spec)
    if name == "ar":
        return Policy.ar()
    if name == "full":
        return Policy.full()
    if name == "static":
        return Policy.static(rho)
    grid = parse_rhos(rhos)
    if table is None:
        if target is None or drafter is None or target_dir is None or drafter_dir is None:
            raise ValueError("the dcut policy needs target, drafter, target_dir and drafter_dir for its cost table")
        buckets = batch_buckets(batch_size)
        holds = next(b for b in buckets if b >= min(num_requests or batch_size, batch_size))
        need = [b for b in buckets if b <= holds]  # a run's batch shrinks through the smaller buckets
        table = cost_table(target, drafter, target_dir, drafter_dir, need, grid, cost_table_path, compile,
                           context_len, log, on_step)
    kw = {"calibrate": calibrate, "skip_drafting": skip_drafting, **DCUT_VARIANTS[variant]}
    if gain is not None:
        if gain not in ("committed", "accepted"):
            raise ValueError(f"gain must be 'committed' or 'accepted', got {gain!r}")
        kw["count_anchors"] = gain == "committed"
    return Policy.dcut(table, grid, label=spec, **kw)


__all__ = ["load_pair", "load_tokenizer", "build_policy", "cost_table", "parse_policy", "parse_rhos",
           "resolve_device", "CostTableError"]
