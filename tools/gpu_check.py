"""One command for a machine with a CUDA GPU: the CUDA tests, then compiled cost tables and a
side-by-side bench on random-weight models of real shapes, in one JSON report.

    python tools/gpu_check.py --out gpu_report.json     # at most ~30 minutes (B = 1, 16, 64)
    python tools/gpu_check.py --quick                   # at most ~13 minutes (B = 16)

1. tests   `python -m pytest -q -m cuda tests/test_cuda.py tests/test_moe.py`, in a subprocess.
2. models  in memory, bf16, random weights: dense of Qwen3-8B's shape, moe of Qwen3-30B-A3B's (DENSE, MOE),
           each with a z-lab-shaped DFlash drafter (5 Qwen3 layers, block 16, mask 151669, default taps),
           targets cut to --layers (default 8, the fewest with 5 distinct taps: each (batch bucket, K)
           compiles a graph of its own, ~6 a batch size, slower the deeper the model).
3. per model: a compiled cost table (profiler.measure) at each batch size, then ar, full, static:0.5
           and dcut side by side on random prompts, passes ordered and recorded as minidcut.bench's,
           with graph runs, graphs first used while timed and host syncs per step (CUDA's sync debug mode).
Random weights keep activations O(1): logits ~N(0, 1) over 151936 tokens, acceptance near zero. This
measures timings, cost tables and whether dcut stops drafting where it does not pay.

Time: one deadline (--budget-s). Planned seconds: tests 240, dense 750, moe 750, slack 20 (1760; --quick:
240, 250, 250, 20); a cost table gets 60 % of its model's share. From an H200 run (docs/bench/README.md):
the tests took 195 s, one batch size of the dense cost table 138 s. pytest is killed at its limit; a
model part stops at the first step past its time and reports what it skipped; the report is written
after every part, so a run killed from outside keeps the parts it finished.

The first hour (seconds to the first token, steps against the copy bandwidth's floor) is tools/first_hour.py.

Exit status: 0 when every test passed and every part ran (cut short for time is not failed), 1
otherwise, 2 for a usage error (no CUDA device, bad arguments).
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

from minidcut import CostTable, Engine, Policy, build_policy, cli, runtime  # noqa: E402
from minidcut.api import resolve_device  # noqa: E402
from minidcut.bench import add_speedups, median_pass, pass_order, record, summarize  # noqa: E402
from minidcut.config import ModelConfig, default_target_layer_ids, load_drafter_config, parse_model_config  # noqa: E402
from minidcut.drafter import DFlashDrafter, check_pair  # noqa: E402
from minidcut.layers import rope_inv_freq  # noqa: E402
from minidcut.model import Transformer  # noqa: E402
from minidcut.policy import DEFAULT_GRID  # noqa: E402
from minidcut.profiler import measure  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
POLICIES = ("ar", "full", "static:0.5", "dcut")
DENSE = dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, num_hidden_layers=36,
             num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=12288,
             rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960, tie_word_embeddings=False)
MOE = dict(DENSE, model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48, num_key_value_heads=4,
           intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
           norm_topk_prob=True)  # intermediate_size: the dense width its drafter's MLP takes
REAL = {"dense": DENSE, "moe": MOE}
TOY = dict(vocab_size=512, hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
           head_dim=16, intermediate_size=128)  # --tiny, the CPU self-test: 8 layers, so z-lab's taps are distinct
TINY = {"dense": dict(DENSE, **TOY), "moe": dict(MOE, **TOY, moe_intermediate_size=32, num_experts=8,
                                                  num_experts_per_tok=2)}
# Per mode: what runs and the planned seconds of each part (the deadline is --budget-s, the sum).
MODES = {
    "full": dict(batch_sizes=[1, 16, 64], layers=8, context_len=128, prompt_len=64, new_tokens=64,
                 profile_repeats=10, profile_warmup=2, bench_repeats=2, tests_s=240, models_s=1500),
    "quick": dict(batch_sizes=[16], layers=8, context_len=64, prompt_len=32, new_tokens=32,
                  profile_repeats=5, profile_warmup=1, bench_repeats=1, tests_s=240, models_s=500),
    "tiny": dict(batch_sizes=[1, 2], layers=None, context_len=16, prompt_len=8, new_tokens=8,
                 profile_repeats=2, profile_warmup=1, bench_repeats=1, tests_s=120, models_s=120),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python tools/gpu_check.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="gpu_report.json", help="the JSON report (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="batch size 16 only, shorter runs (at most ~13 minutes)")
    p.add_argument("--batch-sizes", default=None,
                   help="comma-separated (default: 1,16,64; --quick: 16)")
    p.add_argument("--layers", default=None, help="target layers: a number, or 'full' for 36 (dense) and 48 "
                   "(moe) (default: 8)")
    p.add_argument("--models", default="dense,moe", help="comma-separated: dense, moe (default: %(default)s)")
    p.add_argument("--skip-tests", action="store_true", help="do not run pytest -m cuda")
    p.add_argument("--budget-s", type=float, default=None,
                   help="deadline of the whole run in seconds (default: the mode's plan, 1760 / 760)")
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: only with --tiny
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # this tool's CPU test: toy models, eager
    return p.parse_args(argv)


def checked_settings(args, tool: str, plan: dict, models: str) -> dict:
    """A mode's `plan` with the run's device, dtype, models (comma-separated) and the command line's batch
    sizes and layers; one line (exit status 2) for a machine without CUDA or a bad argument (--budget-s
    and --out too), before any work. `tool` names the script."""
    if args.tiny != (args.device == "cpu"):
        raise cli.UserError("--tiny is the CPU self-test of this tool: use it with --device cpu" if args.tiny
                            else f"{tool} checks a CUDA GPU; --device cpu is only for --tiny")
    if not args.tiny and not torch.cuda.is_available():
        raise cli.UserError(f"no CUDA device: {tool} needs a GPU (torch {torch.__version__}, "
                            f"CUDA build {torch.version.cuda or 'none'})")
    resolve_device(args.device)  # a ValueError (one line) for one that is neither cpu nor cuda[:N]
    s = dict(plan, tiny=args.tiny, device=args.device, compile=not args.tiny,
             dtype="float32" if args.tiny else "bfloat16", models=[m.strip() for m in models.split(",") if m.strip()])
    if args.batch_sizes:
        s["batch_sizes"] = cli.parse_batch_sizes(args.batch_sizes)
    if not s["models"] or any(m not in REAL for m in s["models"]):
        raise cli.UserError(f"--models {models!r}: choose from {', '.join(REAL)}")
    if args.layers is not None:
        if args.tiny or not (args.layers == "full" or args.layers.isdigit() and int(args.layers) >= 1):
            raise cli.UserError("--layers does not apply to --tiny" if args.tiny else
                                f"--layers must be a positive number or 'full', got {args.layers!r}")
        s["layers"], depth = None if args.layers == "full" else int(args.layers), min(
            REAL[m]["num_hidden_layers"] for m in s["models"])
        if (s["layers"] or 0) > depth:
            raise cli.UserError(f"--layers {s['layers']}: the models have {depth} layers or fewer")
    if args.budget_s is not None and args.budget_s <= 0:
        raise cli.UserError(f"--budget-s must be > 0, got {args.budget_s}")
    cli.check_writable(args.out, "--out")
    return s


def check_args(args) -> dict:
    """The run's settings from the command line (checked_settings), the deadline the mode's plan's."""
    mode = "tiny" if args.tiny else "quick" if args.quick else "full"
    s = checked_settings(args, "tools/gpu_check.py", dict(MODES[mode], mode=mode, run_tests=not args.skip_tests),
                         args.models)
    return dict(s, budget_s=args.budget_s or s["tests_s"] * s["run_tests"] + s["models_s"] * len(s["models"]) / 2 + 20)


# ---- models ---------------------------------------------------------------------------------------

def target_config(kind: str, layers: int | None = None, tiny: bool = False) -> dict:
    """The config.json dict of a `kind` ('dense' / 'moe') target, cut to `layers` layers (None: all)."""
    cfg = (TINY if tiny else REAL)[kind]
    if layers is not None and not 1 <= layers <= cfg["num_hidden_layers"]:
        raise ValueError(f"{kind}: {layers} layers requested, the model has {cfg['num_hidden_layers']}")
    return dict(cfg, num_hidden_layers=layers or cfg["num_hidden_layers"])


def drafter_config(target: dict, layers: int = 5, block_size: int = 16) -> dict:
    """A z-lab-layout DFlash drafter config for `target` (a config.json dict): Qwen3 layers of the target's
    hidden size, heads and dense MLP width, z-lab's default taps and mask token 151669 (a tiny
    vocabulary's last id)."""
    L = target["num_hidden_layers"]
    keys = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "rms_norm_eps", "rope_theta", "max_position_embeddings")
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", **{k: target[k] for k in keys},
            "num_hidden_layers": layers, "tie_word_embeddings": False, "block_size": block_size,
            "num_target_layers": L, "dflash_config": {"mask_token_id": min(151669, target["vocab_size"] - 1),
                                                      "target_layer_ids": default_target_layer_ids(L, layers)}}


@torch.no_grad()
def random_weights(make, layers: ModelConfig, dtype: torch.dtype, device, seed: int):
    """make() (a model of `layers`) built on the meta device, then in `dtype` on `device` with random
    weights that keep activations O(1): norms 1, biases 0, the embedding N(0, 1), every other matrix
    N(0, 1 / fan-in), the residual branches' output projections N(0, 1 / (2 L fan-in)) (L of them add
    O(1)); its rope frequencies in fp32, as loaded; fused, as api.load_pair's; in eval mode."""
    with torch.device("meta"):
        module = make()
    module = module.to(dtype).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in module.named_parameters():
        if "norm" in name or p.dim() == 1:
            p.fill_(1.0 if "norm" in name else 0.0)
        else:  # [out, in] and experts' [E, out, in]: fan-in p.shape[-1]
            residual = name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj"))
            fan_in = p.shape[-1] * (2 * layers.num_layers if residual else 1)
            p.normal_(0.0, 1.0 if name.endswith("embed_tokens.weight") else fan_in ** -0.5, generator=gen)
    module.inv_freq = rope_inv_freq(layers.head_dim, layers.rope_theta, layers.rope_scaling).to(device)
    module.fuse()
    return module.eval().requires_grad_(False)


def build_target(cfg: dict, dtype: torch.dtype, device, seed: int = 0) -> Transformer:
    """A Transformer of config dict `cfg` with random weights (random_weights) on `device`."""
    mc = parse_model_config(cfg)
    return random_weights(lambda: Transformer(mc), mc, dtype, device, seed)


def build_drafter(cfg: dict, target: Transformer, dtype: torch.dtype, device, seed: int = 1) -> DFlashDrafter:
    """A DFlashDrafter of z-lab config dict `cfg` (read by the loader's parser, from a temporary
    config.json) with random weights, checked against `target`, borrowing its embedding and lm_head."""
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(cfg))
        dc = load_drafter_config(d)
    check_pair(dc, target.cfg, "the drafter config")
    drafter = random_weights(lambda: DFlashDrafter(dc), dc.layers, dtype, device, seed)
    drafter.borrow(target)
    return drafter


def build_pair(tcfg: dict, s: dict) -> tuple[Transformer, DFlashDrafter]:
    """The target of config dict `tcfg` and its drafter (drafter_config), in the run's dtype and device."""
    device, dtype = torch.device(s["device"]), getattr(torch, s["dtype"])
    target = build_target(tcfg, dtype, device)
    return target, build_drafter(drafter_config(tcfg), target, dtype, device)


def random_prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    """n prompts of `length` random token ids (below Qwen3's special tokens)."""
    return torch.randint(0, min(vocab, 151643), (n, length), generator=torch.Generator().manual_seed(0)).tolist()


# ---- measuring ------------------------------------------------------------------------------------

def compile_seconds() -> float:
    """Seconds dynamo (and the backend it calls) has spent compiling in this process so far."""
    from torch._dynamo.utils import compilation_time_metrics
    return sum(compilation_time_metrics.get("_compile.compile_inner", []))


@contextlib.contextmanager
def timed(out: dict, prefix: str = ""):
    """The block's wall seconds and its compile seconds, into out[prefix + 'seconds'] and out['compile_seconds']."""
    t0, c0 = time.perf_counter(), compile_seconds()
    try:
        yield out
    finally:
        out.update({prefix + "seconds": time.perf_counter() - t0, "compile_seconds": compile_seconds() - c0})


def error_record(e: BaseException) -> dict:
    lines = str(e).strip().splitlines()
    return {"type": type(e).__name__, "message": lines[0][:500] if lines else "",
            "traceback": traceback.format_exc()[-3000:]}


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


def release_memory() -> None:
    """Drop compiled graphs (and their CUDA graph pools) and free cached GPU memory."""
    torch.compiler.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def profile_table(target, drafter, s: dict, deadline: float, log) -> tuple[CostTable, dict]:
    """The cost table (profiler.measure: every rho of the default grid) at as many of the batch sizes as
    the deadline allows, in one engine of the bench's cache shape; returns it and what happened."""
    meta = {"context_len": s["context_len"], "repeats": s["profile_repeats"], "warmup": s["profile_warmup"],
            "compiled": s["compile"], "dtype": s["dtype"]}
    table, started = CostTable([], list(DEFAULT_GRID), [], meta), set()
    info = {"skipped_batch_sizes": [], "error": None}

    def on_step(B, rho):  # after every step
        if B not in started:
            started.add(B)
            log(f"profiling B={B}")
        if time.perf_counter() > deadline:
            raise TimeoutError(f"profile at B={B}")  # caught below, never another TimeoutError's

    with timed(info):
        try:
            engine = Engine(target, drafter, Policy("static", DEFAULT_GRID, label="profile"), compile=s["compile"],
                            batch_size=max(s["batch_sizes"]), max_seq=s["context_len"] + drafter.block_size + 8)
            measure(table, engine, s["batch_sizes"], s["context_len"], s["profile_repeats"], s["profile_warmup"],
                    on_step=on_step)
        except TimeoutError:  # the rows measured before it stay
            info["skipped_batch_sizes"] = [B for B in s["batch_sizes"] if B not in table.batch_sizes]
        except Exception as e:  # noqa: BLE001 (reported, the run goes on)
            info["error"] = error_record(e)
    return table, info


def one_pass(engine: Engine, prompts: list[list[int]], new_tokens: int) -> dict:
    """One generate(): its Stats.as_dict(), drafting steps, graphs first used, graph runs and the host
    syncs CUDA saw per step (None on a CPU)."""
    graphs, runs = engine.graph_use()
    with count_syncs(engine.device) as syncs:
        _, stats = engine.generate(prompts, new_tokens)
    now = engine.graph_use()
    return dict(stats.as_dict(), drafting_steps=sum(stats.drafting_hist.values()), new_graphs=now[0] - graphs,
                graph_runs=now[1] - runs, syncs_per_step=None if syncs is None else len(syncs) / max(stats.steps, 1))


def pass_record(B: int, spec: str, runs: list[dict], warm: dict) -> dict:
    """bench.record of the timed passes plus the warm-up's seconds, compile seconds and graphs, graphs
    first used while timed, each pass's graph runs, host syncs per step, seconds by part and drafting
    steps, and the median pass's drafting steps and their share of its steps."""
    mid = median_pass(runs)
    each = {k: [r[k] for r in runs] for k in ("seconds", "drafting_steps", "graph_runs", "syncs_per_step", "new_graphs")}
    return dict(record(B, spec, runs, warm["warmup_seconds"]), **warm, seconds_runs=each["seconds"],
                drafting_steps_runs=each["drafting_steps"], graph_runs=each["graph_runs"],
                syncs_per_step=each["syncs_per_step"], new_graphs_while_timed=sum(each["new_graphs"]),
                drafting_steps=mid["drafting_steps"], drafting_share=mid["drafting_steps"] / max(mid["steps"], 1))


def bench_batch_size(engines: dict, B: int, prompts: list[list[int]], s: dict, errors: dict,
                     deadline: float = math.inf) -> list[dict]:
    """Every engine at batch size B: Engine.warmup of bucket B's graphs (a probe's too) and a warm pass,
    then bench_repeats timed passes in minidcut.bench's order (pass_record each). A policy that fails goes
    to errors[spec]. Past the deadline no engine starts its warm-up, no round after the first one starts."""
    warm, runs = {}, {}
    for spec, engine in engines.items():
        if time.perf_counter() > deadline:
            break
        try:
            with timed(warm.setdefault(spec, {}), "warmup_"):
                engine.warmup(B, min_batch=B)
                warm[spec]["new_graphs"] = one_pass(engine, prompts, s["new_tokens"])["new_graphs"]
            runs[spec] = []
        except Exception as e:  # noqa: BLE001
            errors[spec] = dict(error_record(e), batch_size=B)
    for rep in range(s["bench_repeats"]):
        if rep and time.perf_counter() > deadline:
            break
        for spec in pass_order(list(runs), rep):
            try:
                runs[spec].append(one_pass(engines[spec], prompts, s["new_tokens"]))
            except Exception as e:  # noqa: BLE001
                errors[spec] = dict(error_record(e), batch_size=B)
                del runs[spec]
    return [pass_record(B, spec, r, warm[spec]) for spec, r in runs.items() if r]


def bench_policies(target, drafter, table: CostTable, s: dict, deadline: float, log, on_batch) -> tuple[list, dict]:
    """ar, full, static:0.5 and dcut side by side at each batch size (B random prompts) while 1.5 times
    the last batch size's seconds fit before the deadline; dcut only where the cost table has a row. The
    engines have the profiler's cache shape: they share its cache tensors and can reuse its graphs.
    on_batch(records so far) after each batch size."""
    prompts = random_prompts(max(s["batch_sizes"]), s["prompt_len"], target.cfg.vocab_size)
    engines, errors = {}, {}
    for spec in POLICIES:
        try:
            policy = build_policy(spec, table=table)  # dcut: the grid of the profiled table
            engines[spec] = Engine(target, drafter if policy.needs_drafter else None, policy, eos_ids=[],
                                   batch_size=max(s["batch_sizes"]), compile=s["compile"],
                                   max_seq=s["context_len"] + drafter.block_size + 8)  # profile_table's
        except Exception as e:  # noqa: BLE001
            errors[spec] = error_record(e)
    records, last = [], 0.0
    info = {"skipped_batch_sizes": [], "skipped_policies": {}, "errors": errors, "dcut_without_table_row": []}
    with timed(info):
        for B in s["batch_sizes"]:
            if time.perf_counter() + 1.5 * last > deadline:
                info["skipped_batch_sizes"] = [b for b in s["batch_sizes"] if b >= B]
                break
            t0 = time.perf_counter()
            log(f"bench B={B}")
            if B not in table.batch_sizes:
                info["dcut_without_table_row"].append(B)
            specs = [p for p in engines if p not in errors and (p != "dcut" or B in table.batch_sizes)]
            done = bench_batch_size({p: engines[p] for p in specs}, B, prompts[:B], s, errors, deadline)
            if missing := [p for p in specs if p not in errors and p not in {r["policy"] for r in done}]:
                info["skipped_policies"][B] = missing  # past the deadline before their warm pass
            add_speedups(done)
            records += done
            last = time.perf_counter() - t0
            on_batch(records)
    return records, info


def run_model(kind: str, s: dict, deadline: float, log, saved=lambda out: None) -> dict:
    """One model part: build it, profile the cost table (60 % of the time left), bench the policies; what
    it measured, and the error of a step that failed, in one dict (a failure never stops the run).
    saved(the dict so far) after the cost table and after each batch size."""
    tcfg, depth = target_config(kind, s["layers"], s["tiny"]), target_config(kind, tiny=s["tiny"])["num_hidden_layers"]
    out = {"target_config": tcfg, "drafter_config": drafter_config(tcfg),
           "layers": {"used": tcfg["num_hidden_layers"], "of": depth},
           "params": None, "build_seconds": None, "cost_table": None, "profile": None, "bench": [],
           "bench_info": None, "summary": None, "error": None}
    try:
        with timed({}) as built:
            target, drafter = build_pair(tcfg, s)
        out["params"] = {"target": sum(p.numel() for p in target.parameters()), "taps": list(drafter.taps),
                         "drafter": sum(p.numel() for p in drafter.parameters())}
        out["build_seconds"], now = built["seconds"], time.perf_counter()
        table, out["profile"] = profile_table(target, drafter, s, now + 0.6 * (deadline - now), log)
        out["cost_table"] = table.to_json() if table.batch_sizes else None
        saved(out)
        out["bench"], out["bench_info"] = bench_policies(target, drafter, table, s, deadline, log,
                                                         lambda records: saved(dict(out, bench=records)))
        out["summary"] = summarize(out["bench"])
    except Exception as e:  # noqa: BLE001 (e.g. out of memory while building)
        out["error"] = error_record(e)
    try:
        release_memory()
    except Exception as e:  # noqa: BLE001 (a broken CUDA context: the report still gets written)
        out["error"] = out["error"] or error_record(e)
    return out


# ---- the tests, in a child process ----------------------------------------------------------------

def run_killable(cmd: list[str], timeout_s: float, env: dict | None = None, tail: int = 4000) -> dict:
    """Run cmd from the repo root in its own process group, killed whole at timeout_s: its return code,
    whether it was killed, its wall seconds and the tail of its output (stdout and stderr together)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)
    try:
        output, timed_out = proc.communicate(timeout=max(timeout_s, 0.1))[0], False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, timed_out = proc.communicate()[0], True
    return {"returncode": proc.returncode, "timed_out": timed_out, "seconds": time.perf_counter() - t0,
            "output_tail": output[-tail:]}


def parse_junit(path: Path) -> dict:
    """Counts and failures from pytest's JUnit XML."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = [{"test": f"{case.get('classname')}::{case.get('name')}", "kind": bad.tag,
               "message": (bad.get("message") or "").strip()[:500]}
              for case in root.iter("testcase") for bad in [*case.findall("failure"), *case.findall("error")]]
    return {"passed": n["tests"] - n["failures"] - n["errors"] - n["skipped"], "failed": n["failures"],
            "errors": n["errors"], "skipped": n["skipped"], "total": n["tests"], "failures": failed}


def run_cuda_tests(timeout_s: float, log=lambda msg: None) -> dict:
    """`pytest -m cuda` on tests/test_cuda.py and tests/test_moe.py (run_killable): counts, failures,
    the command, seconds and the tail of its output."""
    with tempfile.TemporaryDirectory() as d:
        junit = Path(d) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", f"--junitxml={junit}",
               "tests/test_cuda.py", "tests/test_moe.py"]
        log(f"running python {' '.join(cmd[1:])}")
        ran = run_killable(cmd, max(timeout_s, 1))
        counts = parse_junit(junit) if junit.is_file() else \
            dict.fromkeys(("passed", "failed", "errors", "skipped", "total"), 0) | {"failures": []}
    return dict(counts, command="python " + " ".join(cmd[1:]), **ran)


# ---- the report -----------------------------------------------------------------------------------

def environment(device) -> dict:
    """Device, versions and the machine, for the report."""
    def version(pkg):
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return None

    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "transformers": version("transformers"), "triton": version("triton"),
           "platform": platform.platform(), "cpu_count": os.cpu_count(), "threads": torch.get_num_threads()}
    if torch.device(device).type != "cuda":
        return dict(env, device=f"cpu ({platform.processor() or platform.machine()})")
    props = torch.cuda.get_device_properties(device)
    return dict(env, device=props.name, capability=list(torch.cuda.get_device_capability(device)),
                memory_gib=round(props.total_memory / 2 ** 30, 1), device_count=torch.cuda.device_count())


NOTES = ["Random weights: near-zero acceptance by construction; the timings, the cost tables and where dcut "
         "stops drafting are the point, not speedups of a real pair.",
         "Targets are cut to the layer count in models.*.layers (of the real model's); drafters keep 5 layers, "
         "so drafting weighs more against verification than it would at full depth."]


def assemble_report(settings: dict, env: dict, tests: dict | None, models: dict, wall: dict, argv: list[str]) -> dict:
    """The JSON report: settings, environment, the test summary, per model its cost table, bench records
    and summary, and wall seconds per part."""
    return {"tool": "tools/gpu_check.py", "argv": argv, "mode": settings["mode"], "settings": settings,
            "environment": env, "tests": tests, "models": models, "wall_seconds": wall, "notes": NOTES}


def errors(what: str, found: dict) -> list[str]:
    """One summary line per error record in `found` (by name: what it was doing)."""
    return [f"  {what}{name} error {e['type']}: {e['message'][:160]}" for name, e in found.items() if e]


def model_lines(kind: str, m: dict) -> list[str]:
    """The summary's lines for one model: its cost table's AR and rho = 1 step times, tokens/s per policy
    and batch size, errors and what was skipped for time."""
    table, prof, info = m["cost_table"], m["profile"] or {}, m["bench_info"] or {}
    lines = [f"{kind}: {m['layers']['used']} of {m['layers']['of']} layers"] + errors(kind, {"": m["error"]})
    lines += [f"  cost B={B}: AR {row[0] * 1e3:.2f} ms, rho=1 {row[-1] * 1e3:.2f} ms"
              for B, row in zip(table["batch_sizes"], table["seconds"])] if table else []
    lines += errors("profile", {"": prof.get("error")})
    for rec in m["bench"]:
        syncs = [x for x in rec["syncs_per_step"] if x is not None]
        lines.append(f"  B={rec['batch_size']:<3} {rec['policy']:<11} {rec['tokens_per_second']:9.1f} tok/s  "
                     f"x AR {rec['speedup_vs_ar'] or 0:.2f}  drafting {100 * rec['drafting_share']:.0f}% of steps"
                     + (f"  host syncs/step {max(syncs):.2f}" if syncs else "")
                     + f"  new graphs while timed {rec['new_graphs_while_timed']}")
    lines += errors("bench ", info.get("errors", {}))
    if skipped := sorted(set(prof.get("skipped_batch_sizes", []) + info.get("skipped_batch_sizes", []))):
        lines.append(f"  skipped for time: B = {', '.join(map(str, skipped))}")
    return lines + [f"  skipped for time at B={B}: {', '.join(p)}" for B, p in info.get("skipped_policies", {}).items()]


def summary_lines(report: dict) -> list[str]:
    """A few lines for the terminal: the machine, the tests, each model, wall seconds."""
    env, t = report["environment"], report["tests"]
    lines = [f"{env['device']} | torch {env['torch']} | CUDA {env['cuda']} | mode {report['mode']}"]
    if t is None:
        lines.append("tests: not run")
    else:
        lines.append(f"tests: {t['passed']} passed, {t['failed']} failed, {t['errors']} errors, {t['skipped']} skipped"
                     + (" (timed out)" if t["timed_out"] else "") + f" in {t['seconds']:.0f} s")
        lines += [f"  {f['kind']}: {f['test']}: {f['message'][:160]}" for f in t["failures"]]
    for kind, m in report["models"].items():
        lines += model_lines(kind, m)
    return lines + ["wall: " + ", ".join(f"{k} {v:.0f} s" for k, v in report["wall_seconds"].items())]


def write_report(report: dict, path) -> Path:
    """Write atomically (runtime.write_atomically): a run killed mid-write keeps the last complete report."""
    return runtime.write_atomically(path, lambda tmp: tmp.write_text(json.dumps(report, indent=1) + "\n"))


def failed(report: dict) -> bool:
    """Whether a test failed or a part of the run raised (a part cut short for time did not fail)."""
    t = report["tests"]
    if t is not None and (t["failed"] or t["errors"] or t["timed_out"] or t["returncode"] not in (0, 5)):
        return True
    return any(m["error"] or (m["profile"] or {}).get("error") or (m["bench_info"] or {}).get("errors")
               for m in report["models"].values())


def run(args, console: Console) -> int:
    s = check_args(args)
    start = time.perf_counter()
    deadline = start + s["budget_s"]
    runtime.setup()
    torch.manual_seed(0)
    env, wall, parts = environment(s["device"]), {}, {"tests": None, "models": {}}

    def say(line: str) -> None:
        console.print(line, markup=False, highlight=False)

    def save(**done):  # after every part, so a run killed from outside keeps what it finished
        parts.update(done)
        wall["total"] = time.perf_counter() - start
        report = assemble_report(s, env, parts["tests"], parts["models"], wall, args.argv)
        return report, write_report(report, args.out)

    if s["run_tests"]:
        save(tests=run_cuda_tests(min(s["tests_s"], deadline - time.perf_counter()), say))
        wall["tests"] = parts["tests"]["seconds"]
    for i, kind in enumerate(s["models"]):
        t0 = time.perf_counter()
        share = (deadline - t0) / (len(s["models"]) - i)  # what is left, split between the models left
        say(f"{kind}: building, profiling, benching (until {share:.0f} s from now)")
        parts["models"][kind] = run_model(kind, s, t0 + share, lambda msg, kind=kind: say(f"  {kind}: {msg}"),
                                          lambda out, kind=kind: save(models=dict(parts["models"], **{kind: out})))
        wall[kind] = time.perf_counter() - t0
        save()
    report, path = save()
    for line in summary_lines(report) + [f"wrote {path}"]:
        say(line)
    return 1 if failed(report) else 0


def main(argv=None, parse=parse_args, body=run) -> int:
    """This tool's entry point, and tools/first_hour.py's with its parse_args and run."""
    args = parse(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return cli.run_reporting_errors(body, args, Console())


if __name__ == "__main__":
    sys.exit(main())
