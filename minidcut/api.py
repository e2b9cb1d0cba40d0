"""The public API: load a target and its drafter, build a policy, make an engine, generate.

    import minidcut
    minidcut.setup()                       # process-wide settings: threads, compile cache and limits
    target, drafter, device, dtype = minidcut.load_pair("models/llama-stdlib-4m", "models/llama-stdlib-4m-dflash")
    table, table_file = minidcut.load_table(target, drafter, "models/llama-stdlib-4m",
                                            "models/llama-stdlib-4m-dflash", compile=False, max_seq=256)
    policy = minidcut.build_policy("dcut", table=table)
    engine = minidcut.Engine(target, drafter, policy, batch_size=8, max_seq=256, compile=False)
    outputs, stats = engine.generate([[1, 2, 3]], 64)
    minidcut.save_table(policy, table_file)
"""

from __future__ import annotations

from pathlib import Path

import torch

from .cost_model import CostTable, CostTableError, fingerprint, table_path
from .layers import is_packed
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
    target.fuse()  # q/k/v and gate/up in one matmul each
    if drafter is not None:
        drafter.fuse()
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


def sampling_mode(temperature: float, top_p: float) -> str:
    """greedy, sampled or top-p: what a step's sampling costs depends on (a cost table's fingerprint)."""
    return "greedy" if temperature == 0 else "sampled" if top_p >= 1.0 else "top-p"


def run_fingerprint(target, drafter, target_dir, drafter_dir, compile: bool, max_seq: int,
                    sampling: str = "greedy") -> dict:
    """The cost-table fingerprint of a run of this pair as loaded (device, dtypes, packed weights)."""
    w, dw = target.model.embed_tokens.weight, drafter.norm.weight
    return fingerprint(w.device, target_dir, drafter_dir, w.dtype, compile, dw.dtype, is_packed(target, drafter),
                       max_seq, sampling)


def load_table(target, drafter, target_dir, drafter_dir, compile: bool, max_seq: int, sampling: str = "greedy",
               rhos=DEFAULT_GRID, path=None, log=None) -> tuple[CostTable, Path]:
    """The cost table of this run and its file (default: under compile_cache/cost_tables/, named by
    the run's fingerprint). Rows it lacks are measured by the run when it first reaches their bucket
    (profiler.measure_live); save_table writes it back with what the policy learned. A file that is
    corrupt, measured under another fingerprint or for another rho grid is not used: log(message) says
    so in one line, and a new table replaces it when the run ends."""
    rhos = parse_rhos(rhos)
    fp = run_fingerprint(target, drafter, target_dir, drafter_dir, compile, max_seq, sampling)
    path = Path(path) if path else table_path(fp, target_dir, drafter_dir)
    table = None
    if path.is_file():
        try:
            table = CostTable.load(path)
        except CostTableError as e:
            table, why = None, str(e)
        else:
            theirs = table.meta.get("fingerprint")
            why = ", ".join(f"{k} {theirs.get(k)} != {v}" for k, v in fp.items() if theirs.get(k) != v) \
                if isinstance(theirs, dict) else "no fingerprint"
            if theirs == fp and table.rhos != rhos:
                why = f"rho grid {table.rhos} != {rhos}"
            if why:
                table = None
        if table is None and log:
            log(f"cost table {path} not used ({why}): measuring a new one")
    table = table or CostTable([], rhos, [], {"fingerprint": fp, "target": str(target_dir),
                                              "drafter": str(drafter_dir)})
    return table, path


def save_table(policy: Policy, path) -> None:
    """Write the policy's cost table, with the rows the run measured and what it learned online, to
    `path` (atomically); nothing for a policy without a table."""
    if policy.table is not None:
        policy.table.state = policy.state
        policy.table.save(Path(path))


def build_policy(spec: str = "dcut", *, table: CostTable | None = None, rhos=DEFAULT_GRID,
                 gain: str | None = None, calibrate: bool = True, skip_drafting: bool = True, log=None) -> Policy:
    """A Policy from a spec string (parse_policy). dcut needs a cost table (load_table): it continues
    from the online state saved in it (log(message) says so in one line when that state is unusable).
    gain: 'committed' (anchors counted, the default) or 'accepted' (overrides the variant's)."""
    name, rho, variant = parse_policy(spec)
    if name == "ar":
        return Policy.ar()
    if name == "full":
        return Policy.full()
    if name == "static":
        return Policy.static(rho)
    grid = parse_rhos(rhos)
    if table is None:
        raise ValueError("the dcut policy needs a cost table (load_table)")
    kw = {"calibrate": calibrate, "skip_drafting": skip_drafting, **DCUT_VARIANTS[variant]}
    if gain is not None:
        if gain not in ("committed", "accepted"):
            raise ValueError(f"gain must be 'committed' or 'accepted', got {gain!r}")
        kw["count_anchors"] = gain == "committed"
    policy = Policy.dcut(table, grid, label=spec, **kw)
    if table.state:
        try:
            policy.load_state(table.state)
        except ValueError as e:
            if log:
                log(f"learned policy state not used: {e}")
    return policy


__all__ = ["load_pair", "load_tokenizer", "build_policy", "load_table", "save_table", "parse_policy", "parse_rhos",
           "resolve_device", "run_fingerprint", "sampling_mode", "CostTableError"]
