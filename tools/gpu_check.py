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
Parts 1, 3 and 4 run in this process, part 3's model built once the children have ended (its graphs
compile into compile_cache/inductor, as runtime.setup sets it). Graphs compiled: 7 per first-token child
(bucket 32: the AR step, the draft, a verify graph per K), 1 per AR step and 2 per full-depth step.
Planned seconds: bandwidth 5, cold 210, warm 90, steps 160, slack 15 (480). No 36-layer graph has been
compiled on a GPU yet; 8 layers took ~21 s a graph on an H200, so at full depth (~95 s a graph if it
grows with the layers) the cold child may finish only two or three of its seven graphs in 210 s: it
reports those, and the steps part then budgets on them (on that 95 s if it finished none). Each part
gets its plan's share of the time left (one that ends early leaves its time to the next); a child is killed at its limit and keeps
what it wrote (the graphs it finished); a step starts only if its graphs, at the cold seconds per graph
seen so far, end before the deadline.

Exit status: 0 when every test passed and every part ran, 1 otherwise, 2 for a usage error (no CUDA
device, bad arguments). A part cut short for time is reported, not counted as failed.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import json
import math
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
from torch.autograd import DeviceType  # noqa: E402
from torch.profiler import ProfilerActivity  # noqa: E402

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
    p.add_argument("--batch-sizes", default=None,
                   help="comma-separated (default: 1,16,64; --quick: 16; --first-hour: 1,16)")
    p.add_argument("--layers", default=None,
                   help="target layers: a number, or 'full' for 36 (dense) and 48 (moe) "
                        "(default: 8; --first-hour: all)")
    p.add_argument("--models", default="dense,moe", help="comma-separated: dense, moe (default: %(default)s)")
    p.add_argument("--skip-tests", action="store_true", help="do not run pytest -m cuda")
    p.add_argument("--first-hour", action="store_true",
                   help="only this: the dense model at full depth, seconds to the first token at B = 32 with an "
                        "empty and a warm compile cache, AR and full-depth steps at B = 1, 16 against the copy "
                        "bandwidth, their kernels and host syncs (at most ~8 minutes)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="deadline of the whole run in seconds (default: the mode's plan, 1760 / 760 / 480)")
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
    model.fuse()  # as api.load_pair loads a target
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
    drafter.fuse()
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
    """Every engine at batch size B: Engine.warmup of bucket B's graphs (a try of drafting's too) and a warm pass
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


# ---- the first hour -------------------------------------------------------------------------------

class CompileLog:
    """An engine's on_compile: the graphs it compiled, each with its seconds from Graphs.get announcing
    it (its first call then compiles it) to the next announcement or close(): compiling, recording its
    CUDA graph and warmup's runs of it. on_change() after each announcement."""

    def __init__(self, on_change=lambda: None):
        self.graphs: list[dict] = []  # {"graph": message, "seconds": None while it is the latest}
        self.on_change, self.started = on_change, None

    def __call__(self, message: str) -> None:
        self.close()
        self.graphs.append({"graph": message, "seconds": None})
        self.started = time.perf_counter()
        self.on_change()

    def close(self) -> None:
        """The latest graph is done."""
        if self.started is not None:
            self.graphs[-1]["seconds"] = time.perf_counter() - self.started
            self.started = None


def synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device, nbytes: int, copies: int = 5, rounds: int = 5) -> dict:
    """Part 1: bytes read + written per second by dst.copy_(src) of nbytes on the device, the best of
    `rounds` rounds of `copies` copies."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # allocated and touched before timing
    runs = []
    for _ in range(rounds):
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(copies):
            dst.copy_(src)
        synchronize(device)
        runs.append((time.perf_counter() - t0) / copies)
    del src, dst
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return {"bytes": nbytes, "seconds_per_copy": min(runs), "seconds_runs": runs,
            "bytes_per_second": 2 * nbytes / min(runs)}


def first_token_record(B: int) -> dict:
    """What a first-token child reports (None: not reached)."""
    return {"batch_size": B, "compile_cache": None, "phases": {}, "graphs": [], "graphs_after_warmup": None,
            "cli_graphs": None, "compile_seconds": None, "measure_row_seconds": None, "first_token_seconds": None,
            "first_step": None, "cost_row": None}


def first_token_child(s: dict, out, started_at: float) -> int:
    """The --first-token-child process of part 2: a new user's first dcut run at B = first_token_batch
    (the module docstring says what it does, and what it leaves out), timed from started_at (the parent's
    clock when it started this process) to the first committed token. Writes its record to `out` after
    each phase and each graph announced, so a child killed at its limit leaves what it got."""
    B, device, dtype = s["first_token_batch"], torch.device(s["device"]), getattr(torch, s["dtype"])
    rec = dict(first_token_record(B), compile_cache=os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
    phases = rec["phases"]  # seconds of each phase, in order

    def save():
        write_report(rec, out)

    phases["start"] = time.time() - started_at  # the interpreter, imports, arguments, runtime.setup
    save()
    t0 = time.perf_counter()
    tcfg = target_config("dense", s["layers"], s["tiny"])
    target = build_target(tcfg, dtype, device)
    drafter = build_drafter(drafter_config(tcfg), target, dtype, device)
    phases["build"] = time.perf_counter() - t0
    save()
    t0 = time.perf_counter()
    prompts = random_prompts(B, s["first_token_prompt_len"], tcfg["vocab_size"])
    new_tokens = s["first_token_new_tokens"]
    max_seq = cli.max_seq(prompts, new_tokens, drafter.block_size, tcfg["max_position_embeddings"], s["compile"])
    table = CostTable([], list(DEFAULT_GRID), [])  # load_table's table when none is on file for the fingerprint
    log = CompileLog(save)
    rec["graphs"] = log.graphs
    engine = Engine(target, drafter, build_policy("dcut", table=table), batch_size=B, max_seq=max_seq,
                    compile=s["compile"], on_compile=log)
    rec["cli_graphs"] = len(engine.reachable(B))  # generate's warmup: every bucket up to B
    if engine.compile:
        engine.warmup(B, min_batch=B)
    log.close()
    runtime.freeze_heap()
    warm = len(engine.runner.graphs.graphs)
    phases["warmup"] = time.perf_counter() - t0  # the engine (its caches) and Engine.warmup
    rec["compile_seconds"] = compile_seconds()
    save()
    t0 = time.perf_counter()
    _, stats, steps = engine.start(prompts, new_tokens)
    first = next(steps)  # the prefill, the cost row of bucket B measured on the live rows, the step
    rec["first_token_seconds"] = time.time() - started_at
    log.close()
    phases["first_step"] = time.perf_counter() - t0
    rec.update(measure_row_seconds=stats.seconds["profile"], compile_seconds=compile_seconds(),
               graphs_after_warmup=len(engine.runner.graphs.graphs) - warm,
               first_step={"bucket": first.bucket, "n_live": first.n_live, "drafted": first.drafted, "rho": first.rho})
    row = engine.policy.table.row(B, engine.policy.rhos)
    rec["cost_row"] = [None if math.isinf(x) else x for x in row] if row is not None else None
    save()
    return 0


def first_token_run(s: dict, cache: Path, record: Path, limit_s: float) -> dict:
    """One child process of part 2 (first_token_child) with its compile cache under `cache`
    (TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR: empty for the cold run, the cold run's for the warm
    one), killed at limit_s: its record as it last wrote it, its return code, whether it was killed, wall
    seconds and the tail of its output."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"), TRITON_CACHE_DIR=str(cache / "triton"))
    cmd = [sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--first-hour", "--first-token-child",
           "--out", str(record), "--device", s["device"]] + (["--tiny"] if s["tiny"] else []) \
        + (["--layers", str(s["layers"])] if s["layers"] is not None else [])
    t0 = time.perf_counter()
    output, returncode, timed_out = run_killable(cmd + ["--started-at", repr(time.time())], limit_s, env)
    rec = first_token_record(s["first_token_batch"])
    if record.is_file():
        rec.update(json.loads(record.read_text()))
    return dict(rec, returncode=returncode, timed_out=timed_out, seconds=time.perf_counter() - t0,
                output_tail=output[-3000:])


def step_floor(target, drafter, B: int, positions: int, bandwidth: float) -> dict:
    """The bytes a step at B rows must read at least (the module docstring's formulas: without a
    drafter an AR step's, with one a full-depth step's), and their seconds at `bandwidth` bytes/s.
    positions: the cache positions the step's attention reads."""
    def nbytes(tensors) -> int:
        return sum(x.numel() * x.element_size() for x in tensors)

    def kv(cfg, element_size: int) -> int:  # K and V of every layer, per row and position
        return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * element_size

    emb = target.model.embed_tokens.weight
    tied = emb.data_ptr() == target.lm_head.weight.data_ptr()
    parts = {"target_weights": nbytes(target.parameters()) - (0 if tied else nbytes([emb])),
             "target_kv": kv(target.cfg, emb.element_size()) * B * positions}
    if drafter is not None:
        parts["drafter_weights"] = nbytes(drafter.parameters())
        parts["drafter_head"] = nbytes([drafter.head])
        parts["drafter_kv"] = kv(drafter.cfg.layers, drafter.norm.weight.element_size()) * B * positions
    total = sum(parts.values())
    return {"bytes": parts, "total_bytes": total, "positions": positions, "seconds": total / bandwidth}


def kernel_table(events, n_steps: int, wall_s: float, on_device: bool, top: int = TOP_KERNELS) -> dict:
    """Profiler events grouped by name (key_averages) -> per step: the `top` kernels by time (total
    microseconds, per step, runs per step, share of the step's wall time), all kernels' time and share,
    and the CPU side's time (the self time of every CPU-side event) with its 5 largest. On a CPU the
    kernels are the ops (their self CPU time): the profiler has no device activity there."""
    kind = DeviceType.CUDA if on_device else DeviceType.CPU

    def kernel_us(e) -> float:
        return e.self_device_time_total if on_device else e.self_cpu_time_total

    kernels = sorted(((e.key, kernel_us(e), e.count) for e in events
                      if e.device_type == kind and not e.is_user_annotation and kernel_us(e) > 0), key=lambda k: -k[1])
    cpu = sorted(((e.key, e.self_cpu_time_total) for e in events if e.device_type == DeviceType.CPU),
                 key=lambda c: -c[1])
    step_us = wall_s * 1e6 / n_steps
    total = sum(us for _, us, _ in kernels)
    return {"activity": "cuda" if on_device else "cpu", "steps": n_steps, "step_us": step_us,
            "kernel_us_per_step": total / n_steps, "kernel_share": total / n_steps / step_us,
            "distinct_kernels": len(kernels), "cpu_us_per_step": sum(us for _, us in cpu) / n_steps,
            "kernels": [{"name": name[:200], "us": us, "us_per_step": us / n_steps, "count_per_step": count / n_steps,
                         "share": us / n_steps / step_us} for name, us, count in kernels[:top]],
            "cpu_top": [{"name": name[:200], "us_per_step": us / n_steps} for name, us in cpu[:5]]}


def profile_steps(step, n: int, device) -> dict:
    """torch.profiler (CPU activity, and CUDA's on a GPU) around n calls of step(): kernel_table of them."""
    on_device = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    with torch.profiler.profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        wall = time.perf_counter() - t0
    return kernel_table(prof.key_averages(), n, wall, on_device)


def measure_steps(engine, prompts: list[list[int]], counts: dict, max_new: int) -> dict:
    """Steps of the engine's own loop (Engine.start) on these prompts: counts['warm'] untimed (the
    prefill and first steps), counts['timed'] timed one by one (their median), counts['synced'] under
    count_syncs, counts['profiled'] under torch.profiler. A step ends with its tokens copied to the host,
    so its wall time covers its device work."""
    _, _, steps = engine.start(prompts, max_new)
    records, seconds = [], []

    def step():
        records.append(next(steps))

    for _ in range(counts["warm"]):
        step()
    for _ in range(counts["timed"]):
        t0 = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - t0)
    with count_syncs(engine.device) as syncs:
        for _ in range(counts["synced"]):
            step()
    try:
        profile = profile_steps(step, counts["profiled"], engine.device)
    except Exception as e:  # noqa: BLE001 (the profiler failing costs the kernels, not the timings)
        profile = {"error": error_record(e), "kernels": []}
    return {"seconds_per_step": statistics.median(seconds), "seconds_runs": seconds,
            "syncs_per_step": len(syncs) / counts["synced"] if syncs is not None else None,
            "steps": len(records), "drafting_steps": sum(r.drafted for r in records),
            "buckets": sorted({r.bucket for r in records}), "live_rows": sorted({r.n_live for r in records}),
            "profile": profile}


GRAPH_SECONDS_PER_LAYER = 21 / 8  # a cold graph's seconds per target layer where none was seen yet: ~21 s
#                                  a graph at 8 layers on the H200 runs (docs/bench, gpu_check_h200_*)
STEP_KINDS = {"ar": Policy.ar, "full": Policy.full}  # an AR step; a draft and every draft verified (16 tokens a row)


def step_record(engine, kind: str, B: int, prompts: list[list[int]], s: dict, max_new: int, bandwidth: float,
                compile_log: CompileLog) -> dict:
    """One batch size and kind of part 3: bucket B's graphs warmed up (compile_log: the engine's
    on_compile), measure_steps, and the floor of such a step."""
    t0, c0 = time.perf_counter(), compile_seconds()
    if engine.compile:
        engine.warmup(B, min_batch=B)
    compile_log.close()
    rec = {"batch_size": B, "kind": kind, "warmup_seconds": time.perf_counter() - t0,
           "compile_seconds": compile_seconds() - c0, "graphs": compile_log.graphs}
    warm = len(engine.runner.graphs.graphs)
    rec.update(measure_steps(engine, prompts, s["steps"], max_new))
    rec["graphs_after_warmup"] = len(engine.runner.graphs.graphs) - warm
    positions = engine.runner.span(s["prompt_len"] + 1) or engine.max_seq  # None when compiled: every position
    rec["floor"] = step_floor(engine.target, engine.drafter, B, positions, bandwidth)
    rec["floor_ratio"] = rec["floor"]["seconds"] / rec["seconds_per_step"]
    return rec


def first_hour_steps(s: dict, bandwidth: float, deadline: float, log, graph_seconds: list[float],
                     saved=lambda records, info: None) -> tuple[list[dict], dict]:
    """Parts 3 and 4: an AR step and a full-depth step at each batch size, each kind in an engine of its
    own (bucket B only, warmed up first), against its floor at `bandwidth` bytes/s. One starts only if
    its graphs end before the deadline at the mean of graph_seconds (cold seconds per graph seen so far,
    this part's own added; none seen yet: GRAPH_SECONDS_PER_LAYER per target layer). saved(records, info)
    after each."""
    device, dtype = torch.device(s["device"]), getattr(torch, s["dtype"])
    tcfg = target_config("dense", s["layers"], s["tiny"])
    target = build_target(tcfg, dtype, device)
    drafter = build_drafter(drafter_config(tcfg), target, dtype, device)
    max_new = drafter.block_size * sum(s["steps"].values()) + 1  # more than the steps can commit: rows stay live
    max_seq = s["prompt_len"] + max_new + drafter.block_size + 1
    prompts = random_prompts(max(s["batch_sizes"]), s["prompt_len"], tcfg["vocab_size"])
    seen, records, info = list(graph_seconds), [], {"max_seq": max_seq, "skipped": [], "errors": {}}
    for B in s["batch_sizes"]:
        for kind, policy in STEP_KINDS.items():
            name = f"{kind} B={B}"
            try:
                compile_log = CompileLog()
                engine = Engine(target, drafter, policy(), batch_size=B, max_seq=max_seq, eos_ids=[],
                                compile=s["compile"], on_compile=compile_log)
                per_graph = (statistics.mean(seen) if seen else GRAPH_SECONDS_PER_LAYER * tcfg["num_hidden_layers"]) \
                    if engine.compile else 0.0  # none seen (the cold child finished no graph): the prior
                if time.perf_counter() + per_graph * len(engine.reachable(B, B)) > deadline:
                    info["skipped"].append(name)
                    continue
                log(f"steps: {name}")
                records.append(step_record(engine, kind, B, prompts[:B], s, max_new, bandwidth, compile_log))
                seen += [g["seconds"] for g in records[-1]["graphs"]]
            except Exception as e:  # noqa: BLE001 (reported, the next one runs)
                info["errors"][name] = error_record(e)
            saved(records, info)
    return records, info


FIRST_HOUR_PARTS = ("bandwidth", "cold", "warm", "steps")


def run_first_hour(s: dict, deadline: float, log, saved=lambda out: None) -> dict:
    """The first hour's parts in order (the module docstring), each given its plan's share of the time
    left (the slack kept back); saved(the dict so far) after each part and each step measured."""
    plan = s["plan_s"]
    out = {"plan_seconds": plan, "bandwidth": None, "first_token": {"cold": None, "warm": None}, "steps": [],
           "steps_info": None, "error": None}

    def limit(part: str) -> float:
        rest = FIRST_HOUR_PARTS[FIRST_HOUR_PARTS.index(part):]
        return (deadline - time.perf_counter()) * plan[part] / (sum(plan[p] for p in rest) + plan["slack"])

    def on_steps(records, info):
        out["steps"], out["steps_info"] = records, info
        saved(out)

    try:
        out["bandwidth"] = copy_bandwidth(s["device"], s["copy_bytes"])
        saved(out)
        with tempfile.TemporaryDirectory(prefix="gpu_check_first_hour_") as d:
            for run in ("cold", "warm"):  # the warm run starts from the cache the cold one left
                log(f"first token at B={s['first_token_batch']}, {run} compile cache (at most {limit(run):.0f} s)")
                out["first_token"][run] = first_token_run(s, Path(d) / "cache", Path(d) / f"{run}.json", limit(run))
                saved(out)
        cold = [g["seconds"] for g in out["first_token"]["cold"]["graphs"] if g["seconds"] is not None]
        log(f"steps at B = {', '.join(map(str, s['batch_sizes']))} (at most {limit('steps'):.0f} s)")
        out["steps"], out["steps_info"] = first_hour_steps(s, out["bandwidth"]["bytes_per_second"],
                                                           time.perf_counter() + limit("steps"), log, cold, on_steps)
    except Exception as e:  # noqa: BLE001 (e.g. out of memory while building: the report still gets written)
        out["error"] = error_record(e)
    try:
        release_memory()
    except Exception as e:  # noqa: BLE001
        out["error"] = out["error"] or error_record(e)
    return out


def first_hour_lines(fh: dict) -> list[str]:
    """The summary's lines for the first hour."""
    lines = []
    if fh["error"]:
        lines.append(f"first hour error {fh['error']['type']}: {fh['error']['message'][:160]}")
    bw = fh["bandwidth"]
    if bw:
        lines.append(f"copy bandwidth {bw['bytes_per_second'] / 1e9:.1f} GB/s "
                     f"(copies of {bw['bytes'] / 2 ** 20:.0f} MiB)")
    for run, r in fh["first_token"].items():
        if r is None:
            continue
        done = [g["seconds"] for g in r["graphs"] if g["seconds"] is not None]
        graphs = f"{len(done)} graphs, {statistics.mean(done):.1f} s each" if done else "no graph compiled"
        ended = "killed at its limit" if r["timed_out"] else f"exit status {r['returncode']}"
        got = f"{r['first_token_seconds']:.1f} s" if r["first_token_seconds"] is not None else \
            f"none after {r['seconds']:.0f} s ({ended})"
        phases = ", ".join(f"{k} {v:.1f} s" for k, v in r["phases"].items())
        lines.append(f"first token at B={r['batch_size']}, {run} compile cache: {got}")
        lines.append(f"  {phases}; {graphs} (generate's warmup: {r['cli_graphs']} graphs)")
    for rec in fh["steps"]:
        f, kernels = rec["floor"], rec["profile"]["kernels"]
        if "error" in rec["profile"]:
            e = rec["profile"]["error"]
            lines.append(f"  B={rec['batch_size']} {rec['kind']} profiler error {e['type']}: {e['message'][:120]}")
        lines.append(f"  B={rec['batch_size']:<3} {rec['kind']:<4} {rec['seconds_per_step'] * 1e3:8.2f} ms/step, floor "
                     f"{f['seconds'] * 1e3:.2f} ms ({f['total_bytes'] / 1e9:.2f} GB): "
                     f"{100 * rec['floor_ratio']:.0f}% of the limit"
                     + (f", host syncs/step {rec['syncs_per_step']:.2f}" if rec["syncs_per_step"] is not None else "")
                     + (f", top kernel {100 * kernels[0]['share']:.0f}%: {kernels[0]['name'][:60]}" if kernels else ""))
    info = fh["steps_info"] or {}
    lines += [f"  steps {name} error {e['type']}: {e['message'][:160]}" for name, e in info.get("errors", {}).items()]
    if info.get("skipped"):
        lines.append(f"  skipped for time: {', '.join(info['skipped'])}")
    return lines


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


def assemble_report(settings: dict, env: dict, tests: dict | None, models: dict, wall: dict, argv: list[str],
                    first_hour: dict | None = None) -> dict:
    """The JSON report: settings, environment, the test summary, per model its cost table, bench records
    and summary, and wall seconds per part; with --first-hour, that part's results under first_hour."""
    report = {"tool": "tools/gpu_check.py", "argv": argv, "mode": settings["mode"], "settings": settings,
              "environment": env, "tests": tests, "models": models, "wall_seconds": wall, "notes": NOTES}
    if first_hour is not None:
        report["first_hour"] = first_hour
    return report


def summary_lines(report: dict) -> list[str]:
    """A few lines for the terminal: tests, and per model the cost table's rho = 0 / 1 step times and
    tokens/s per policy and batch size."""
    env, lines = report["environment"], []
    lines.append(f"{env['device']} | torch {env['torch']} | CUDA {env['cuda']} | mode {report['mode']}")
    t = report["tests"]
    if "first_hour" in report:
        lines += first_hour_lines(report["first_hour"])
    elif t is None:
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
    fh = report.get("first_hour")
    if fh is not None:
        crashed = [r for r in fh["first_token"].values() if r is not None and r["returncode"] and not r["timed_out"]]
        profiler = [r for r in fh["steps"] if "error" in r["profile"]]
        return bool(fh["error"] or crashed or profiler or (fh["steps_info"] or {}).get("errors"))
    return False


def run(args, console: Console) -> int:
    s = check_args(args)
    start = time.perf_counter()
    deadline = start + s["budget_s"]
    runtime.setup()
    torch.manual_seed(0)
    if args.first_token_child:
        return first_token_child(s, args.out, args.started_at)
    env = environment(s["device"])
    wall, tests, models, first_hour = {}, None, {}, None

    def save():  # after every part, so a run killed from outside keeps what it finished
        wall["total"] = time.perf_counter() - start
        report = assemble_report(s, env, tests, models, wall, args.argv, first_hour)
        return report, write_report(report, args.out)

    def save_model(kind, out):  # what a model part has measured so far
        models[kind] = out
        save()

    def save_first_hour(out):  # what the first hour has measured so far
        nonlocal first_hour
        first_hour = out
        save()

    if s["mode"] == "first-hour":  # a run of its own: no tests, no models part
        console.print(f"the first hour: dense, {s['layers'] or 'all'} layers (until {s['budget_s']:.0f} s from now)")
        save_first_hour(run_first_hour(s, deadline, lambda msg: console.print(f"  {msg}"), save_first_hour))
        wall["first_hour"] = time.perf_counter() - start
    if s["run_tests"]:
        console.print(f"running python {' '.join(pytest_command(Path('junit.xml'))[1:])}")
        tests = run_cuda_tests(min(s["tests_s"], deadline - time.perf_counter()))
        wall["tests"] = tests["seconds"]
        save()
    for i, kind in enumerate(s["models"] if s["mode"] != "first-hour" else []):
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
