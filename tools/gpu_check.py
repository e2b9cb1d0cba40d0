"""One command for a machine with a CUDA GPU: the CUDA tests, then compiled cost tables and a
side-by-side bench on random-weight models of real shapes, in one JSON report.

    python tools/gpu_check.py --out gpu_report.json     # at most ~30 minutes (B = 1, 16, 64)
    python tools/gpu_check.py --quick                   # at most ~13 minutes (B = 16)
    python tools/gpu_check.py --first-hour --out first_hour.json   # at most ~8 minutes (see "The first hour")

1. tests   `python -m pytest -q -m cuda` in a subprocess (tests/test_cuda.py and test_moe.py's CUDA
           test): pass / fail / skip counts and the failures.
2. models  built in memory on the GPU, bf16, random weights (no checkpoint files):
             dense  Qwen3-8B's shape: hidden 4096, 32 / 8 heads x 128, MLP 12288, vocab 151936, 36 layers
             moe    Qwen3-30B-A3B's shape: hidden 2048, 32 / 4 heads x 128, 128 experts top-8 x 768,
                    vocab 151936, 48 layers
           each with a z-lab-shaped DFlash drafter: 5 Qwen3 layers of the target's attention shape
           (MLP 12288 for dense as Qwen3-8B-DFlash-b16, 6144 for moe: the 30B-A3B config's dense
           width), block 16, mask 151669, taps by z-lab's default formula. The targets are cut to
           --layers layers (default 8, the fewest with 5 distinct taps): each (batch bucket, K) compiles
           its own graph, ~6 per batch size (AR, the draft, a verify graph per K), and a deeper model
           compiles each one slower. The drafters keep all 5 layers.
3. per model: a compiled cost table (minidcut.profiler) at each batch size, then ar, full, static:0.5
           and dcut side by side at each batch size on random prompts, interleaved as minidcut.bench.
4. one JSON report (device, versions, tests, cost tables, tokens/s per policy and batch size, graph
           runs and graphs first used while timed, host syncs per step as CUDA's sync debug mode counts
           them, compile and wall seconds per part) and a short summary on stdout.

Random weights: activations stay O(1) (normal weights with std 1 / sqrt(fan-in), residual branches
scaled down by sqrt(2 L), unit norms), logits are ~N(0, 1) over 151936 tokens, so the drafter's
confidences and its acceptance are near zero. The timings, the cost tables and whether dcut stops
drafting where drafting does not pay are what this measures, not speedups of a real pair.

Time: one deadline for the whole run (--budget-s). Planned seconds, full: tests 240, dense 750, moe 750,
slack 20 (1760); --quick: 240, 250, 250, 20 (760). A model's cost table gets 60 % of its share, the bench
the rest. The pytest subprocess is killed at its limit; a model part stops at the first step past its
time (a graph being compiled then finishes first), keeps what it measured and reports what it skipped.
The report is written after every part, so a run killed from outside keeps the parts it finished.
The plans come from one H200 run (torch 2.11, docs/bench/README.md): the tests took 195 s, and one
batch size of the dense model's cost table 138 s, 128 s of it compiling its 6 graphs (~5-40 s each).

The first hour (--first-hour; nothing else runs): what a new user's first run pays, on the dense model at
Qwen3-8B's full shape (36 layers; --layers cuts it), bf16, random weights, in one JSON report:
1. bandwidth    dst.copy_(src) of 1 GiB on the device, the best of 5 rounds of 5 copies:
                bandwidth = 2 x bytes / seconds per copy (read + written): the machine's limit below.
2. first token  seconds from a process's start to its first committed token, in two child processes
                (--first-token-child): cold, on an empty compile cache (TORCHINDUCTOR_CACHE_DIR and
                TRITON_CACHE_DIR in a temporary directory), then warm, a second process on that cache.
                Each does what a new user's first `python -m minidcut.generate --batch-size 32` does with
                32 prompts (64 random tokens, 64 new): no cost table on file for this fingerprint, so
                load_table gives an empty table; build_policy("dcut"); an Engine with the default
                settings (compiled on CUDA); Engine.warmup; freeze_heap; then the first step: the prefill,
                the cost row of bucket 32 measured on the live rows (profiler.measure_row), the step. One
                difference: generate warms every bucket up to 32 (for the drain), here bucket 32 only;
                `cli_graphs` counts the graphs generate would compile, and seconds per graph times the
                difference is what it pays on top. Per graph: from Graphs.get announcing it (on_compile)
                to the next announcement: compiling, recording its CUDA graph and warmup's 3 runs.
3. steps        an AR step and a full-depth step (draft + verify D + 1 = 16 tokens per row) at B = 1 and
                16 (--batch-sizes), in the engine's own loop (Engine.start) on B random 128-token prompts:
                2 untimed steps, 10 timed one by one (the median), 3 under CUDA's sync debug mode (host
                syncs per step), 3 under torch.profiler (kernels). Each against its floor, the bytes a
                step must read at least:
                  floor bytes (AR)   = W_target + KV(target)
                  floor bytes (full) = W_target + KV(target) + W_drafter + W_head + KV(drafter)
                  W_target   every target weight but the embedding table (a step gathers B rows of it)
                  W_drafter  the drafter's own weights (fc, its layers, norms)
                  W_head     the target's lm_head, which the draft reads again (its logits over the block)
                  KV(model)  2 x layers x kv_heads x head_dim x bytes per element x B x S, S the cache
                             positions attention reads: all of them compiled (static shapes); eager,
                             the first step's span (a lower bound: later spans are longer)
                  floor seconds = floor bytes / bandwidth;  ratio = floor seconds / measured seconds
                             (1: the step runs at the machine's copy bandwidth)
4. kernels      torch.profiler (CPU and CUDA activity) around those 3 steps, grouped by kernel name: the
                15 with the most time (microseconds, runs per step, share of the step's wall time), all
                kernels' time and the CPU side's time per step (the self time of every CPU-side event:
                ops, CUDA runtime calls, the waits in them). On a CPU (--tiny) the profiler sees no
                device: the table lists the ops by self CPU time.
Planned seconds: bandwidth 5, cold 210, warm 90, steps 160, slack 15 (480). A guess: no 36-layer graph has
been compiled on a GPU yet (8 layers took ~20 s a graph on an H200, ~7 graphs a bucket here). Each part
gets its plan's share of the time left (one that ends early leaves its time to the next); a child is
killed at its limit and keeps what it wrote (the graphs it finished); a step starts only if its graphs,
at the cold seconds per graph seen so far, end before the deadline.

Exit status: 0 when every test passed and every part ran, 1 otherwise, 2 for a usage error (no CUDA
device, bad arguments). A part cut short for time is reported, not counted as failed.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
import xml.etree.ElementTree as ET
from pathlib import Path

# Run as a script: import from the repo root, and never let tools/profile.py shadow the stdlib module.
if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402
from rich.console import Console  # noqa: E402

from minidcut import cli, runtime  # noqa: E402
from minidcut.api import build_policy  # noqa: E402
from minidcut.bench import summarize  # noqa: E402
from minidcut.config import default_target_layer_ids, load_drafter_config, parse_model_config  # noqa: E402
from minidcut.cost_model import CostTable  # noqa: E402
from minidcut.drafter import DFlashDrafter, check_pair  # noqa: E402
from minidcut.engine import Engine  # noqa: E402
from minidcut.layers import rope_inv_freq  # noqa: E402
from minidcut.model import Transformer  # noqa: E402
from minidcut.policy import DEFAULT_GRID, Policy  # noqa: E402
from minidcut.profiler import measure  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MASK_TOKEN_ID = 151669  # z-lab's Qwen3 drafters
DRAFT_LAYERS, BLOCK_SIZE = 5, 16
POLICIES = ("ar", "full", "static:0.5", "dcut")

DENSE = dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, num_hidden_layers=36,
             num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=12288,
             rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960, tie_word_embeddings=False)
MOE = dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, num_hidden_layers=48,
           num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
           moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
           rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960, tie_word_embeddings=False)
# --tiny (the CPU self-test): the same families at toy size; 8 layers, so z-lab's taps are distinct.
TINY = {"dense": dict(DENSE, vocab_size=512, hidden_size=64, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, intermediate_size=128),
        "moe": dict(MOE, vocab_size=512, hidden_size=64, num_hidden_layers=8, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
                    num_experts=8, num_experts_per_tok=2)}
REAL = {"dense": DENSE, "moe": MOE}

# Per mode: what runs and the planned seconds of each part (the deadline is --budget-s, the sum).
MODES = {
    "full": dict(batch_sizes=[1, 16, 64], layers=8, context_len=128, prompt_len=64, new_tokens=64,
                 profile_repeats=10, profile_warmup=2, bench_repeats=2, tests_s=240, models_s=1500),
    "quick": dict(batch_sizes=[16], layers=8, context_len=64, prompt_len=32, new_tokens=32,
                  profile_repeats=5, profile_warmup=1, bench_repeats=1, tests_s=240, models_s=500),
    "tiny": dict(batch_sizes=[1, 2], layers=None, context_len=16, prompt_len=8, new_tokens=8,
                 profile_repeats=2, profile_warmup=1, bench_repeats=1, tests_s=120, models_s=120),
}


# --first-hour (the module docstring, "The first hour"): the dense model only; layers None: all of them.
# steps: per (batch size, kind) untimed, timed, sync-counted and profiled steps, in that order.
FIRST_HOUR = {
    "real": dict(batch_sizes=[1, 16], layers=None, first_token_batch=32, first_token_prompt_len=64,
                 first_token_new_tokens=64, prompt_len=128, steps=dict(warm=2, timed=10, synced=3, profiled=3),
                 copy_bytes=2 ** 30, plan_s=dict(bandwidth=5, cold=210, warm=90, steps=160, slack=15)),
    "tiny": dict(batch_sizes=[1, 2], layers=None, first_token_batch=4, first_token_prompt_len=8,
                 first_token_new_tokens=8, prompt_len=8, steps=dict(warm=2, timed=5, synced=2, profiled=2),
                 copy_bytes=2 ** 24, plan_s=dict(bandwidth=5, cold=40, warm=40, steps=30, slack=5)),
}
TOP_KERNELS = 15


class OutOfTime(Exception):
    """The deadline of a part passed."""


# ---- arguments ------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python tools/gpu_check.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="gpu_report.json", help="the JSON report (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="batch size 16 only, shorter runs (at most ~13 minutes)")
    p.add_argument("--batch-sizes", default=None, help="comma-separated (default: 1,16,64; --quick: 16)")
    p.add_argument("--layers", default=None,
                   help="target layers: a number, or 'full' for 36 (dense) and 48 (moe) (default: 8)")
    p.add_argument("--models", default="dense,moe", help="comma-separated: dense, moe (default: %(default)s)")
    p.add_argument("--skip-tests", action="store_true", help="do not run pytest -m cuda")
    p.add_argument("--first-hour", action="store_true",
                   help="only this: the dense model at full depth, seconds to the first token at B = 32 with an "
                        "empty and a warm compile cache, AR and full-depth steps at B = 1, 16 against the copy "
                        "bandwidth, their kernels and host syncs (at most ~8 minutes)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="deadline of the whole run in seconds (default: the mode's plan, 1760 / 760)")
    # For the CPU test of this tool only: tiny models, eager, on the CPU.
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    # The child process of --first-hour's part 2 (first_token_run): its record goes to --out.
    p.add_argument("--first-token-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--started-at", type=float, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def check_args(args) -> dict:
    """The run's settings from the command line; a cli.UserError (one line, exit status 2) for a
    machine without CUDA or a bad argument, before any work."""
    if args.tiny and args.device != "cpu":
        raise cli.UserError("--tiny is the CPU self-test of this tool: use it with --device cpu")
    if args.device == "cpu" and not args.tiny:
        raise cli.UserError("tools/gpu_check.py checks a CUDA GPU; --device cpu is only for --tiny")
    if args.device != "cpu":
        if not torch.cuda.is_available():
            raise cli.UserError(f"no CUDA device: tools/gpu_check.py needs a GPU (torch {torch.__version__}, "
                                f"CUDA build {torch.version.cuda or 'none'})")
        try:
            device = torch.device(args.device)
        except RuntimeError:
            raise cli.UserError(f"unknown device {args.device!r}") from None
        if device.type != "cuda":
            raise cli.UserError(f"--device {args.device}: a CUDA device is needed")
    if args.first_hour and args.quick:
        raise cli.UserError("--first-hour is a run of its own: leave out --quick")
    if args.first_token_child and (not args.first_hour or args.started_at is None):
        raise cli.UserError("--first-token-child is started by --first-hour, with --started-at")
    if args.first_hour:
        mode, base = "first-hour", FIRST_HOUR["tiny" if args.tiny else "real"]
    else:
        mode = "tiny" if args.tiny else "quick" if args.quick else "full"
        base = MODES[mode]
    s = dict(base, mode=mode, tiny=args.tiny, device=args.device, compile=not args.tiny,
             dtype="float32" if args.tiny else "bfloat16")
    if args.batch_sizes:
        s["batch_sizes"] = cli.parse_batch_sizes(args.batch_sizes)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not models or any(m not in REAL for m in models):
        raise cli.UserError(f"--models {args.models!r}: choose from {', '.join(REAL)}")
    s["models"] = ["dense"] if args.first_hour else models
    if args.layers is not None:
        if args.tiny:
            raise cli.UserError("--layers does not apply to --tiny")
        if args.layers != "full" and not (args.layers.isdigit() and int(args.layers) >= 1):
            raise cli.UserError(f"--layers must be a positive number or 'full', got {args.layers!r}")
        s["layers"] = None if args.layers == "full" else int(args.layers)
        depth = min(REAL[m]["num_hidden_layers"] for m in s["models"])
        if s["layers"] is not None and s["layers"] > depth:
            raise cli.UserError(f"--layers {s['layers']}: the models have {depth} layers or fewer")
    if args.budget_s is not None and args.budget_s <= 0:
        raise cli.UserError(f"--budget-s must be > 0, got {args.budget_s}")
    s["run_tests"] = not args.skip_tests and not args.first_hour
    if args.first_hour:
        s["budget_s"] = args.budget_s or sum(s["plan_s"].values())
    else:
        s["budget_s"] = args.budget_s or (s["tests_s"] * s["run_tests"] + s["models_s"] * len(models) / 2 + 20)
    cli.check_writable(args.out, "--out")
    return s


# ---- models ---------------------------------------------------------------------------------------

def target_config(kind: str, layers: int | None = None, tiny: bool = False) -> dict:
    """The config.json dict of a `kind` ('dense' / 'moe') target, cut to `layers` layers (None: all)."""
    cfg = dict((TINY if tiny else REAL)[kind])
    if layers is not None:
        if not 1 <= layers <= cfg["num_hidden_layers"]:
            raise ValueError(f"{kind}: {layers} layers requested, the model has {cfg['num_hidden_layers']}")
        cfg["num_hidden_layers"] = layers
    return cfg


def drafter_config(target: dict, layers: int = DRAFT_LAYERS, block_size: int = BLOCK_SIZE,
                   mask_token_id: int | None = None) -> dict:
    """A z-lab-layout DFlash drafter config for `target` (a config.json dict): Qwen3 layers with the
    target's hidden size, heads and MLP width (a MoE target's dense `intermediate_size`), plus
    block_size, num_target_layers and dflash_config with z-lab's default taps. The mask token: z-lab's
    151669, or the last id of a smaller (tiny) vocabulary."""
    L = target["num_hidden_layers"]
    if mask_token_id is None:
        mask_token_id = MASK_TOKEN_ID if target["vocab_size"] > MASK_TOKEN_ID else target["vocab_size"] - 1
    keys = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "rms_norm_eps", "rope_theta", "max_position_embeddings")
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", **{k: target[k] for k in keys},
            "num_hidden_layers": layers, "tie_word_embeddings": False, "block_size": block_size,
            "num_target_layers": L,
            "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": default_target_layer_ids(L, layers)}}


@torch.no_grad()
def init_weights(module: torch.nn.Module, n_layers: int, seed: int) -> None:
    """Random weights in place that keep activations O(1): norms 1, the embedding N(0, 1), every other
    matrix N(0, 1 / fan-in), the residual branches' output projections also divided by sqrt(2 n_layers)
    (so n_layers of them add O(1) to the residual stream)."""
    gen = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    for name, p in module.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        elif p.dim() == 1:
            p.zero_()
        elif name.endswith("embed_tokens.weight"):
            p.normal_(0.0, 1.0, generator=gen)
        else:
            std = p.shape[-1] ** -0.5  # [out, in] and experts' [E, out, in]
            if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                std /= (2 * n_layers) ** 0.5
            p.normal_(0.0, std, generator=gen)


def materialize(module: torch.nn.Module, dtype: torch.dtype, device) -> torch.nn.Module:
    """A module built on the meta device -> uninitialized storage in `dtype` on `device`."""
    return module.to(dtype).to_empty(device=device)


def build_target(cfg: dict, dtype: torch.dtype, device, seed: int = 0) -> Transformer:
    """A Transformer of config dict `cfg` with random weights (init_weights), on `device`, in eval mode."""
    mc = parse_model_config(cfg)
    with torch.device("meta"):
        model = Transformer(mc)
    model = materialize(model, dtype, device)
    init_weights(model, mc.num_layers, seed)
    model.inv_freq = rope_inv_freq(mc.head_dim, mc.rope_theta, mc.rope_scaling).to(device)  # fp32, as loaded
    return model.eval().requires_grad_(False)


def build_drafter(cfg: dict, target: Transformer, dtype: torch.dtype, device, seed: int = 1) -> DFlashDrafter:
    """A DFlashDrafter of z-lab config dict `cfg` (read by the loader's own parser, from a temporary
    config.json) with random weights, checked against `target` and borrowing its embedding and lm_head."""
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(cfg))
        dc = load_drafter_config(d)
        check_pair(dc, target.cfg, "the drafter config")
    with torch.device("meta"):
        drafter = DFlashDrafter(dc)
    drafter = materialize(drafter, dtype, device)
    init_weights(drafter, dc.layers.num_layers, seed)
    drafter.inv_freq = rope_inv_freq(dc.layers.head_dim, dc.layers.rope_theta, dc.layers.rope_scaling).to(device)
    drafter.borrow(target)
    return drafter.eval().requires_grad_(False)


def n_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """n prompts of `length` random token ids (below Qwen3's special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, min(vocab, 151643), (n, length), generator=g).tolist()


# ---- timing ---------------------------------------------------------------------------------------

def compile_seconds() -> float:
    """Seconds dynamo (and the backend it calls) has spent compiling in this process so far."""
    from torch._dynamo.utils import compilation_time_metrics
    return sum(compilation_time_metrics.get("_compile.compile_inner", []))


def error_record(e: BaseException) -> dict:
    lines = str(e).strip().splitlines()
    return {"type": type(e).__name__, "message": lines[0][:500] if lines else "",
            "traceback": traceback.format_exc()[-3000:]}


def profile_table(target, drafter, batch_sizes: list[int], s: dict, deadline: float, log) -> tuple[CostTable, dict]:
    """The cost table (profiler.measure: every rho of the default grid, compiled per s['compile']) for
    as many of batch_sizes as the deadline allows; returns it and what happened."""
    table = CostTable([], list(DEFAULT_GRID), [], {"context_len": s["context_len"], "repeats": s["profile_repeats"],
                                                  "warmup": s["profile_warmup"], "compiled": s["compile"],
                                                  "dtype": s["dtype"]})
    info = {"skipped_batch_sizes": [], "error": None}
    t0, c0 = time.perf_counter(), compile_seconds()
    started = set()

    def on_step(B, rho):
        if B not in started:
            started.add(B)
            log(f"profiling B={B}")
        if time.perf_counter() > deadline:
            raise OutOfTime(f"profile at B={B}")

    try:  # one engine for all batch sizes (the bench's cache shape); rows measured before a timeout stay
        engine = Engine(target, drafter, Policy("static", DEFAULT_GRID, label="profile"), batch_size=max(batch_sizes),
                        max_seq=s["context_len"] + drafter.block_size + 8, compile=s["compile"])
        measure(table, engine, batch_sizes, s["context_len"], s["profile_repeats"], s["profile_warmup"],
                on_step=on_step)
    except OutOfTime:
        info["skipped_batch_sizes"] = [B for B in batch_sizes if B not in table.batch_sizes]
    except Exception as e:  # noqa: BLE001 (reported, the run goes on)
        info["error"] = error_record(e)
    info.update(seconds=time.perf_counter() - t0, compile_seconds=compile_seconds() - c0)
    return table, info


def bench_records(B: int, spec: str, runs: list[dict], warm: dict) -> dict:
    """One record per (batch size, policy) with minidcut.bench's keys: the median pass and every pass
    (tokens/s, graph runs, host syncs, seconds by part and drafting steps of each)."""
    mid = sorted(runs, key=lambda r: r["tokens_per_second"])[len(runs) // 2]
    rec = {"batch_size": B, "policy": spec, **warm,
           "tokens_per_second": statistics.median(r["tokens_per_second"] for r in runs),
           "tokens_per_second_runs": [r["tokens_per_second"] for r in runs],
           "new_graphs_while_timed": sum(r["new_graphs"] for r in runs),
           "graph_runs": [r["graph_runs"] for r in runs], "syncs_per_step": [r["syncs_per_step"] for r in runs],
           "seconds_runs": [r["seconds"] for r in runs], "drafting_steps_runs": [r["drafting_steps"] for r in runs]}
    for k in ("tau", "keep_ratio", "rho_histogram", "bucket_histogram", "seconds", "steps", "generated_tokens",
              "drafting_steps"):
        rec[k] = mid[k]
    rec["drafting_share"] = mid["drafting_steps"] / max(mid["steps"], 1)
    return rec


def bench(target, drafter, table: CostTable, batch_sizes: list[int], s: dict, deadline: float,
          log, on_batch=lambda records: None) -> tuple[list, dict]:
    """ar, full, static:0.5 and dcut side by side at each batch size (one wave of B random prompts, the
    policies interleaved, a first untimed pass compiling and recording), as the deadline allows; dcut
    only where the cost table has a row. The engines have the profiler's cache shape (batch_size
    max(batch_sizes), the same max_seq), so they share the cache tensors and can reuse its graphs.
    on_batch(records so far) after each batch size."""
    max_seq = s["context_len"] + drafter.block_size + 8  # what profiler.measure gives its engine
    B_max = max(s["batch_sizes"])  # the profiler engine's rows
    prompts = random_prompts(max(batch_sizes), s["prompt_len"], target.cfg.vocab_size)
    engines, errors = {}, {}
    for spec in POLICIES:
        try:
            policy = build_policy(spec, table=table)  # dcut: the grid of the profiled table
            engines[spec] = Engine(target, drafter if policy.needs_drafter else None, policy, batch_size=B_max,
                                   max_seq=max_seq, eos_ids=[], compile=s["compile"])
        except Exception as e:  # noqa: BLE001 (e.g. dcut without a single table row)
            errors[spec] = error_record(e)
    records, info = [], {"skipped_batch_sizes": [], "skipped_policies": {}, "errors": errors,
                         "dcut_without_table_row": []}
    t_start, c_start = time.perf_counter(), compile_seconds()
    last = 0.0
    for B in batch_sizes:
        if time.perf_counter() + 1.5 * last > deadline:
            info["skipped_batch_sizes"] = [b for b in batch_sizes if b >= B]
            break
        t0 = time.perf_counter()
        log(f"bench B={B}")
        if B not in table.batch_sizes:
            info["dcut_without_table_row"].append(B)
        specs = [p for p in POLICIES if p in engines and p not in errors and (p != "dcut" or B in table.batch_sizes)]
        done = {r["policy"]: r for r in bench_batch_size({p: engines[p] for p in specs}, B, prompts[:B], s, errors,
                                                         deadline)}
        missing = [p for p in specs if p not in errors and p not in done]
        if missing:  # past the deadline before their warm pass
            info["skipped_policies"][B] = missing
        ar = done["ar"]["tokens_per_second"] if "ar" in done else None
        for r in done.values():
            r["speedup_vs_ar"] = r["tokens_per_second"] / ar if ar else None
        records += done.values()
        last = time.perf_counter() - t0
        on_batch(records)
    info.update(seconds=time.perf_counter() - t_start, compile_seconds=compile_seconds() - c_start)
    return records, info


@contextlib.contextmanager
def count_syncs(device):
    """The host syncs CUDA reports while the block runs (torch.cuda.set_sync_debug_mode("warn"): one
    warning per synchronizing call), as a list of messages; None on a CPU, which has none to report."""
    if torch.device(device).type != "cuda":
        yield None
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        out = []
        try:
            yield out
        finally:
            torch.cuda.set_sync_debug_mode(0)
            out += [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]


def bench_batch_size(engines: dict, B: int, prompts: list[list[int]], s: dict, errors: dict,
                     deadline: float = float("inf")) -> list[dict]:
    """Every engine at batch size B: Engine.warmup of bucket B's graphs (a probe's too) and a warm pass
    (compile and record its graphs), then bench_repeats timed passes, the policies taking turns.
    new_graphs: graph keys used for the first time (a timed pass that needed one measured a compile).
    A policy that fails is recorded in errors[spec] and left out. Past the deadline no engine starts its
    warm pass and no round after the first timed one starts."""
    warm, runs = {}, {}

    def one_pass(spec):
        """One generate(): its stats, the graph runs it made and the host syncs CUDA saw per step."""
        engine, drafted = engines[spec], []
        graphs, runs = len(engine.runner.graphs.graphs), sum(engine.runner.graphs.calls.values())
        with count_syncs(engine.device) as syncs:
            _, stats = engine.generate(prompts, s["new_tokens"], on_step=lambda st, rec: drafted.append(rec.drafted))
        return dict(stats.as_dict(), drafting_steps=sum(drafted), new_graphs=len(engine.runner.graphs.graphs) - graphs,
                    graph_runs=sum(engine.runner.graphs.calls.values()) - runs,
                    syncs_per_step=len(syncs) / max(stats.steps, 1) if syncs is not None else None)

    for spec in engines:
        if time.perf_counter() > deadline:
            break
        t0, c0 = time.perf_counter(), compile_seconds()
        try:
            engines[spec].warmup(B, min_batch=B)
            first = one_pass(spec)
        except Exception as e:  # noqa: BLE001
            errors[spec] = dict(error_record(e), batch_size=B)
            continue
        warm[spec] = {"warmup_seconds": time.perf_counter() - t0, "compile_seconds": compile_seconds() - c0,
                      "new_graphs": first["new_graphs"]}
        runs[spec] = []
    for i in range(s["bench_repeats"]):
        if i and time.perf_counter() > deadline:
            break
        for spec in list(runs):
            try:
                runs[spec].append(one_pass(spec))
            except Exception as e:  # noqa: BLE001
                errors[spec] = dict(error_record(e), batch_size=B)
                del runs[spec]
    return [bench_records(B, spec, r, warm[spec]) for spec, r in runs.items() if r]


def run_model(kind: str, s: dict, deadline: float, log, saved=lambda out: None) -> dict:
    """Build one target and drafter, profile its cost table, bench the policies: every step's seconds,
    and the error of a step that failed, in one dict (a failure never stops the run). saved(the dict so
    far) after the cost table and after each batch size's bench."""
    tiny = s["mode"] == "tiny"
    tcfg = target_config(kind, None if tiny else s["layers"], tiny)
    out = {"target_config": tcfg, "drafter_config": drafter_config(tcfg),
           "layers": {"used": tcfg["num_hidden_layers"], "of": (TINY if tiny else REAL)[kind]["num_hidden_layers"]},
           "params": None, "build_seconds": None, "cost_table": None, "profile": None, "bench": [],
           "bench_info": None, "summary": None, "error": None}
    try:
        measure_model(out, s, deadline, log, saved)
    except Exception as e:  # noqa: BLE001 (e.g. out of memory while building)
        out["error"] = error_record(e)
    try:
        release_memory()
    except Exception as e:  # noqa: BLE001 (a broken CUDA context: the report still gets written)
        out["error"] = out["error"] or error_record(e)
    return out


def measure_model(out: dict, s: dict, deadline: float, log, saved) -> None:
    """run_model's work on `out`: build, then the cost table (60 % of the time left), then the bench."""
    device, dtype = torch.device(s["device"]), getattr(torch, s["dtype"])
    t0 = time.perf_counter()
    target = build_target(out["target_config"], dtype, device)
    drafter = build_drafter(out["drafter_config"], target, dtype, device)
    out["params"] = {"target": n_params(target), "drafter": n_params(drafter), "taps": list(drafter.taps)}
    out["build_seconds"] = time.perf_counter() - t0
    budget = deadline - time.perf_counter()
    table, out["profile"] = profile_table(target, drafter, s["batch_sizes"], s, time.perf_counter() + 0.6 * budget, log)
    out["cost_table"] = table.to_json() if table.batch_sizes else None
    saved(out)

    def on_batch(records):
        out["bench"] = records
        saved(out)

    out["bench"], out["bench_info"] = bench(target, drafter, table, s["batch_sizes"], s, deadline, log, on_batch)
    out["summary"] = summarize(out["bench"])


def release_memory() -> None:
    """Drop compiled graphs (and their CUDA graph pools) and free cached GPU memory."""
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- tests ----------------------------------------------------------------------------------------

def pytest_command(junit: Path) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", f"--junitxml={junit}",
            "tests/test_cuda.py", "tests/test_moe.py"]


def parse_junit(path: Path) -> dict:
    """Counts and failures from pytest's JUnit XML."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = []
    for case in root.iter("testcase"):
        for bad in list(case.findall("failure")) + list(case.findall("error")):
            failed.append({"test": f"{case.get('classname')}::{case.get('name')}", "kind": bad.tag,
                           "message": (bad.get("message") or "").strip()[:500]})
    return {"passed": n["tests"] - n["failures"] - n["errors"] - n["skipped"], "failed": n["failures"],
            "errors": n["errors"], "skipped": n["skipped"], "total": n["tests"], "failures": failed}


def run_killable(cmd: list[str], timeout_s: float, env: dict | None = None) -> tuple[str, int, bool]:
    """Run cmd from the repo root in its own process group, killed whole at timeout_s:
    (its output, stdout and stderr together; its return code; whether it was killed)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)
    try:
        output, _ = proc.communicate(timeout=max(timeout_s, 0.1))
        return output, proc.returncode, False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return output, proc.returncode, True


def run_cuda_tests(timeout_s: float) -> dict:
    """`pytest -m cuda` on tests/test_cuda.py and tests/test_moe.py in a subprocess (its own process
    group, killed whole on timeout): counts, failures, seconds and the tail of its output."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        junit = Path(d) / "junit.xml"
        cmd = pytest_command(junit)
        output, returncode, timed_out = run_killable(cmd, max(timeout_s, 1))
        result = parse_junit(junit) if junit.is_file() else {"passed": 0, "failed": 0, "errors": 0, "skipped": 0,
                                                              "total": 0, "failures": []}
    result.update(command="python " + " ".join(cmd[1:]), returncode=returncode, timed_out=timed_out,
                  seconds=time.perf_counter() - t0, output_tail=output[-4000:])
    return result


# ---- the report -----------------------------------------------------------------------------------

def environment(device) -> dict:
    """Device, versions and the machine, for the report."""
    def version(pkg):
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return None

    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "transformers": version("transformers"), "triton": version("triton"), "platform": platform.platform(),
           "cpu_count": os.cpu_count(), "threads": torch.get_num_threads()}
    device = torch.device(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device=props.name, capability=list(torch.cuda.get_device_capability(device)),
                   memory_gib=round(props.total_memory / 2 ** 30, 1), device_count=torch.cuda.device_count())
    else:
        env.update(device=f"cpu ({platform.processor() or platform.machine()})")
    return env


NOTES = [
    "Random weights: near-zero acceptance by construction; the timings, the cost tables and where dcut "
    "stops drafting are the point, not speedups of a real pair.",
    "Targets are cut to the layer count in models.*.layers (of the real model's); drafters keep 5 layers, "
    "so drafting weighs more against verification than it would at full depth.",
]


def assemble_report(settings: dict, env: dict, tests: dict | None, models: dict, wall: dict, argv: list[str]) -> dict:
    """The JSON report: settings, environment, the test summary, per model its cost table, bench records
    and summary, and wall seconds per part."""
    return {"tool": "tools/gpu_check.py", "argv": argv, "mode": settings["mode"], "settings": settings,
            "environment": env, "tests": tests, "models": models, "wall_seconds": wall, "notes": NOTES}


def summary_lines(report: dict) -> list[str]:
    """A few lines for the terminal: tests, and per model the cost table's rho = 0 / 1 step times and
    tokens/s per policy and batch size."""
    env, lines = report["environment"], []
    lines.append(f"{env['device']} | torch {env['torch']} | CUDA {env['cuda']} | mode {report['mode']}")
    t = report["tests"]
    if t is None:
        lines.append("tests: not run")
    else:
        lines.append(f"tests: {t['passed']} passed, {t['failed']} failed, {t['errors']} errors, {t['skipped']} skipped"
                     + (" (timed out)" if t["timed_out"] else "") + f" in {t['seconds']:.0f} s")
        lines += [f"  {f['kind']}: {f['test']}: {f['message'][:160]}" for f in t["failures"]]
    for kind, m in report["models"].items():
        lines.append(f"{kind}: {m['layers']['used']} of {m['layers']['of']} layers"
                     + (f", error {m['error']['type']}: {m['error']['message'][:160]}" if m["error"] else ""))
        table = m.get("cost_table")
        if table:
            for B, row in zip(table["batch_sizes"], table["seconds"]):
                lines.append(f"  cost B={B}: AR {row[0] * 1e3:.2f} ms, rho=1 {row[-1] * 1e3:.2f} ms")
        prof = m.get("profile") or {}
        if prof.get("error"):
            lines.append(f"  profile error {prof['error']['type']}: {prof['error']['message'][:160]}")
        for rec in m.get("bench", []):
            syncs = [x for x in rec.get("syncs_per_step", []) if x is not None]
            lines.append(f"  B={rec['batch_size']:<3} {rec['policy']:<11} {rec['tokens_per_second']:9.1f} tok/s  "
                         f"x AR {rec['speedup_vs_ar'] or 0:.2f}  drafting {100 * rec['drafting_share']:.0f}% of steps"
                         + (f"  host syncs/step {max(syncs):.2f}" if syncs else "")
                         + f"  new graphs while timed {rec['new_graphs_while_timed']}")
        info = m.get("bench_info") or {}
        for spec, err in info.get("errors", {}).items():
            lines.append(f"  bench {spec} error {err['type']}: {err['message'][:160]}")
        skipped = sorted(set(prof.get("skipped_batch_sizes", []) + info.get("skipped_batch_sizes", [])))
        if skipped:
            lines.append(f"  skipped for time: B = {', '.join(map(str, skipped))}")
        for B, specs in info.get("skipped_policies", {}).items():
            lines.append(f"  skipped for time at B={B}: {', '.join(specs)}")
    lines.append("wall: " + ", ".join(f"{k} {v:.0f} s" for k, v in report["wall_seconds"].items()))
    return lines


def write_report(report: dict, path) -> Path:
    """Write atomically (a temporary file renamed over `path`): a run killed mid-write keeps the last
    complete report."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def failed(report: dict) -> bool:
    """Whether a test failed or a part of the run raised."""
    t = report["tests"]
    if t is not None and (t["failed"] or t["errors"] or t["timed_out"] or t["returncode"] not in (0, 5)):
        return True
    for m in report["models"].values():
        if m["error"] or (m.get("profile") or {}).get("error") or (m.get("bench_info") or {}).get("errors"):
            return True
    return False


def run(args, console: Console) -> int:
    s = check_args(args)
    start = time.perf_counter()
    deadline = start + s["budget_s"]
    runtime.setup()
    torch.manual_seed(0)
    env = environment(s["device"])
    wall, tests, models = {}, None, {}

    def save():  # after every part, so a run killed from outside keeps what it finished
        wall["total"] = time.perf_counter() - start
        report = assemble_report(s, env, tests, models, wall, args.argv)
        return report, write_report(report, args.out)

    def save_model(kind, out):  # what a model part has measured so far
        models[kind] = out
        save()

    if s["run_tests"]:
        console.print(f"running python {' '.join(pytest_command(Path('junit.xml'))[1:])}")
        tests = run_cuda_tests(min(s["tests_s"], deadline - time.perf_counter()))
        wall["tests"] = tests["seconds"]
        save()
    for i, kind in enumerate(s["models"]):
        t0 = time.perf_counter()
        share = (deadline - t0) / (len(s["models"]) - i)  # what is left, split between the models left
        console.print(f"{kind}: building, profiling, benching (until {share:.0f} s from now)")
        out = run_model(kind, s, t0 + share, lambda msg, kind=kind: console.print(f"  {kind}: {msg}"),
                        lambda out, kind=kind: save_model(kind, out))
        wall[kind] = time.perf_counter() - t0
        save_model(kind, out)
    report, path = save()
    for line in summary_lines(report):
        console.print(line, markup=False, highlight=False)
    console.print(f"wrote {path}")
    return 1 if failed(report) else 0


def main(argv=None) -> int:
    args = parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return cli.run_reporting_errors(run, args, Console())


if __name__ == "__main__":
    sys.exit(main())
