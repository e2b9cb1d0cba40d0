"""The first hour: what a new user's first run pays on a machine with a CUDA GPU, tools/gpu_check.py's
dense model (Qwen3-8B's shape, random weights) at full depth (--layers), in one JSON report.

    python tools/first_hour.py --out first_hour.json     # at most ~8 minutes

1. bandwidth    dst.copy_(src) of 1 GiB, the best of 5 rounds of 5 copies: 2 x bytes / seconds per copy.
2. first token  seconds from a process's start to its first token, in a child (--first-token-child) on an
                empty compile cache (cold), then in one on that cache (warm), each doing what a first
                `python -m minidcut.generate --batch-size 32` does: 32 random 64-token prompts, no cost
                table on file, dcut, Engine.warmup (of bucket 32 only: cli_graphs counts generate's), the
                first step measuring bucket 32's cost row. Per graph: its seconds to the next announced.
3. steps        an AR and a full-depth step (16 tokens a row) at B = 1, 16 in the engine's loop on
                128-token prompts: 2 untimed, 10 timed (the median), 3 sync-counted, 3 under
                torch.profiler (4. kernels: the 15 with the most time, all kernels' and the CPU side's
                time per step), each against its floor:
                  floor bytes (AR)   = W_target + KV(target)
                  floor bytes (full) = W_target + KV(target) + W_drafter + W_head + KV(drafter)
                W_target: every target weight but the embedding table; W_drafter: the drafter's own;
                W_head: the lm_head, read again by the draft; KV = 2 x layers x kv_heads x head_dim x
                bytes per element x B x S, S the positions attention reads (compiled: all; eager: the
                first step's span); floor seconds = floor bytes / bandwidth; ratio = floor / measured.
Planned seconds: bandwidth 5, cold 210, warm 90, steps 160, slack 15 (480), each part its plan's share of
the time left. A child is killed at its limit, keeping what it wrote; a step starts only if its graphs,
at the cold seconds per graph seen (none: 21 s per 8 layers, as on the H200), end before the deadline.

Exit status: 0 when every part ran (cut short for time is not failed), 1 otherwise, 2 for a usage error.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Run as a script: import from the repo root, and never let tools/profile.py shadow the stdlib module.
if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402
from torch.profiler import ProfilerActivity  # noqa: E402

from minidcut import CostTable, Engine, Policy, build_policy, cli, runtime  # noqa: E402
from minidcut.policy import DEFAULT_GRID  # noqa: E402
from tools import gpu_check  # noqa: E402

# The dense model, all its layers; steps: per (batch size, kind) untimed, timed,
# sync-counted and profiled steps, in that order.
FIRST_HOUR = {
    "real": dict(batch_sizes=[1, 16], layers=None, first_token_batch=32, first_token_prompt_len=64,
                 first_token_new_tokens=64, prompt_len=128, steps=dict(warm=2, timed=10, synced=3, profiled=3),
                 copy_bytes=2 ** 30, plan_s=dict(bandwidth=5, cold=210, warm=90, steps=160, slack=15)),
    "tiny": dict(batch_sizes=[1, 2], layers=None, first_token_batch=4, first_token_prompt_len=8,
                 first_token_new_tokens=8, prompt_len=8, steps=dict(warm=2, timed=5, synced=2, profiled=2),
                 copy_bytes=2 ** 24, plan_s=dict(bandwidth=5, cold=40, warm=40, steps=30, slack=5)),
}
TOP_KERNELS = 15
GRAPH_SECONDS_PER_LAYER = 21 / 8  # a cold graph's seconds per target layer where none was seen yet: ~21 s
#                                  a graph at 8 layers on the H200 runs (docs/bench, gpu_check_h200_*)
STEP_KINDS = {"ar": Policy.ar, "full": Policy.full}  # an AR step; a draft and every draft verified


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python tools/first_hour.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="first_hour.json", help="the JSON report (default: %(default)s)")
    p.add_argument("--batch-sizes", default=None, help="the steps' batch sizes, comma-separated (default: 1,16)")
    p.add_argument("--layers", default=None, help="target layers: a number, or 'full' (default: all 36)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="deadline of the whole run in seconds (default: the plan, 480)")
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: only with --tiny
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # this tool's CPU test: toy models, eager
    p.add_argument("--first-token-child", action="store_true", help=argparse.SUPPRESS)  # first_token_run's child
    p.add_argument("--started-at", type=float, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def check_args(args) -> dict:
    """The run's settings from the command line (gpu_check.checked_settings), the deadline the plan's."""
    s = gpu_check.checked_settings(args, "tools/first_hour.py", dict(
        FIRST_HOUR["tiny" if args.tiny else "real"], mode="first-hour", run_tests=False), "dense")
    if args.first_token_child and args.started_at is None:
        raise cli.UserError("--first-token-child is started by tools/first_hour.py itself, with --started-at")
    return dict(s, budget_s=args.budget_s or sum(s["plan_s"].values()))


# ---- the first token: child processes -------------------------------------------------------------

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


FIRST_TOKEN = dict.fromkeys(("compile_cache", "graphs_after_warmup", "cli_graphs", "compile_seconds", "first_step",
                             "measure_row_seconds", "first_token_seconds", "cost_row"))  # None: not reached


def first_token_child(s: dict, out, started_at: float) -> int:
    """The --first-token-child process of part 2 (the module docstring): a new user's first dcut run at
    B = first_token_batch, timed from started_at (the parent's clock when it started this process) to the
    first committed token. Writes its record to `out` after each phase and each graph announced, so a
    child killed at its limit leaves what it got."""
    B, new_tokens = s["first_token_batch"], s["first_token_new_tokens"]
    rec = dict(FIRST_TOKEN, batch_size=B, phases={}, graphs=[], compile_cache=os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
    t0 = None

    def phase(name: str, seconds: float | None = None) -> None:
        """The phase that ends now, with its seconds since the last one ended; the record so far written."""
        nonlocal t0
        rec["phases"][name] = seconds if seconds is not None else time.perf_counter() - t0
        gpu_check.write_report(rec, out)
        t0 = time.perf_counter()

    phase("start", time.time() - started_at)  # the interpreter, imports, arguments, runtime.setup
    tcfg = gpu_check.target_config("dense", s["layers"], s["tiny"])
    target, drafter = gpu_check.build_pair(tcfg, s)
    phase("build")
    prompts = gpu_check.random_prompts(B, s["first_token_prompt_len"], tcfg["vocab_size"])
    log = CompileLog(lambda: gpu_check.write_report(rec, out))
    rec["graphs"] = log.graphs
    policy = build_policy("dcut", table=CostTable([], list(DEFAULT_GRID), []))  # load_table's without a file
    engine = Engine(target, drafter, policy, batch_size=B, compile=s["compile"], on_compile=log, max_seq=cli.max_seq(
        prompts, new_tokens, drafter.block_size, tcfg["max_position_embeddings"], s["compile"]))
    rec["cli_graphs"] = len(engine.reachable(B))  # generate's warmup: every bucket up to B
    if engine.compile:
        engine.warmup(B, min_batch=B)
    log.close()
    runtime.freeze_heap()
    warm, rec["compile_seconds"] = engine.graph_use()[0], gpu_check.compile_seconds()
    phase("warmup")  # the engine (its caches) and Engine.warmup
    _, stats, steps = engine.start(prompts, new_tokens)
    first = next(steps)  # the prefill, the cost row of bucket B measured on the live rows, the step
    rec["first_token_seconds"] = time.time() - started_at
    phase("first_step")
    log.close()
    row = engine.policy.costs(B)
    rec.update(measure_row_seconds=stats.seconds["profile"], compile_seconds=gpu_check.compile_seconds(),
               graphs_after_warmup=engine.graph_use()[0] - warm,
               first_step={"bucket": first.bucket, "n_live": first.n_live, "drafted": first.drafted, "rho": first.rho},
               cost_row=[None if math.isinf(x) else x for x in row] if row is not None else None)
    gpu_check.write_report(rec, out)
    return 0


def first_token_run(s: dict, cache: Path, record_file: Path, limit_s: float) -> dict:
    """One child process of part 2 (first_token_child) with its compile cache under `cache` (empty for
    the cold run, the cold run's for the warm one), killed at limit_s: its record as it last wrote it and
    run_killable's figures."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"), TRITON_CACHE_DIR=str(cache / "triton"))
    cmd = [sys.executable, str(gpu_check.ROOT / "tools" / "first_hour.py"), "--first-token-child", "--out",
           str(record_file), "--device", s["device"]] + (["--tiny"] if s["tiny"] else []) \
        + (["--layers", str(s["layers"])] if s["layers"] is not None else [])
    ran = gpu_check.run_killable(cmd + ["--started-at", repr(time.time())], limit_s, env, tail=3000)
    written = json.loads(record_file.read_text()) if record_file.is_file() else {}
    return {**FIRST_TOKEN, "batch_size": s["first_token_batch"], "phases": {}, "graphs": [], **written, **ran}



# ---- bandwidth, steps against their floor, kernels ------------------------------------------------

def copy_bandwidth(device, nbytes: int, copies: int = 5, rounds: int = 5) -> dict:
    """Part 1: bytes read + written per second by dst.copy_(src) of nbytes each on the device, the best
    of `rounds` rounds of `copies` copies."""
    sync = (lambda: torch.cuda.synchronize(device)) if torch.device(device).type == "cuda" else (lambda: None)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)  # [nbytes]
    dst, runs = src.clone(), []  # allocated and touched before timing
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        for _ in range(copies):
            dst.copy_(src)
        sync()
        runs.append((time.perf_counter() - t0) / copies)
    del src, dst
    gpu_check.release_memory()
    return {"bytes": nbytes, "seconds_per_copy": min(runs), "seconds_runs": runs,
            "bytes_per_second": 2 * nbytes / min(runs)}


def step_floor(target, drafter, B: int, positions: int, bandwidth: float) -> dict:
    """The bytes a step at B rows must read at least (the module docstring's formulas: without a drafter
    an AR step's, with one a full-depth step's) and their seconds at `bandwidth` bytes/s; positions: the
    cache positions the step's attention reads."""
    def nbytes(tensors) -> int:
        return sum(x.numel() * x.element_size() for x in tensors)

    def kv(cfg, element_size: int) -> int:  # K and V of every layer, at B rows and `positions` positions
        return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * element_size * B * positions

    emb = target.model.embed_tokens.weight
    tied = emb.data_ptr() == target.lm_head.weight.data_ptr()
    parts = {"target_weights": nbytes(target.parameters()) - (0 if tied else nbytes([emb])),
             "target_kv": kv(target.cfg, emb.element_size())}
    if drafter is not None:
        parts.update(drafter_weights=nbytes(drafter.parameters()), drafter_head=nbytes([drafter.head]),
                     drafter_kv=kv(drafter.cfg.layers, drafter.norm.weight.element_size()))
    total = sum(parts.values())
    return {"bytes": parts, "total_bytes": total, "positions": positions, "seconds": total / bandwidth}


def profile_steps(step, n: int, device, top: int = TOP_KERNELS) -> dict:
    """torch.profiler (CPU activity, and CUDA's on a GPU) around n calls of step(), events grouped by
    name, per step: the `top` kernels by time (microseconds in all and per step, runs per step, share of
    the step's wall time), all kernels' time and share, and the CPU side's time (the self time of every
    CPU-side event). On a CPU the kernels are the ops (their self CPU time)."""
    on_device = torch.device(device).type == "cuda"
    with torch.profiler.profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * on_device) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        step_us = (time.perf_counter() - t0) * 1e6 / n
    us = (lambda e: e.self_device_time_total) if on_device else (lambda e: e.self_cpu_time_total)
    kind, events = DeviceType.CUDA if on_device else DeviceType.CPU, prof.key_averages()
    kernels = sorted(((e.key, us(e), e.count) for e in events
                      if e.device_type == kind and not e.is_user_annotation and us(e) > 0), key=lambda k: -k[1])
    total = sum(t for _, t, _ in kernels)
    return {"activity": "cuda" if on_device else "cpu", "steps": n, "step_us": step_us, "kernel_us_per_step": total / n,
            "kernel_share": total / n / step_us, "distinct_kernels": len(kernels),
            "cpu_us_per_step": sum(e.self_cpu_time_total for e in events if e.device_type == DeviceType.CPU) / n,
            "kernels": [{"name": name[:200], "us": t, "us_per_step": t / n, "count_per_step": count / n,
                         "share": t / n / step_us} for name, t, count in kernels[:top]]}


def step_record(engine, kind: str, B: int, prompts: list[list[int]], s: dict, max_new: int, bandwidth: float,
                compile_log: CompileLog) -> dict:
    """One batch size and kind of part 3: bucket B's graphs warmed up (compile_log: the engine's
    on_compile), then the engine's own loop (Engine.start) on these prompts, s['steps'] of each: untimed,
    timed one by one (the median), under count_syncs, under torch.profiler; and the floor of such a step.
    A step ends with its tokens copied to the host: its wall time covers its device work."""
    counts, seconds, records = s["steps"], [], []
    with gpu_check.timed({"batch_size": B, "kind": kind, "graphs": compile_log.graphs}, "warmup_") as rec:
        if engine.compile:
            engine.warmup(B, min_batch=B)
        compile_log.close()
    warm, steps = engine.graph_use()[0], engine.start(prompts, max_new)[2]

    def step():
        records.append(next(steps))

    for _ in range(counts["warm"]):
        step()
    for _ in range(counts["timed"]):
        t0 = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - t0)
    with gpu_check.count_syncs(engine.device) as syncs:
        for _ in range(counts["synced"]):
            step()
    try:
        profile = profile_steps(step, counts["profiled"], engine.device)
    except Exception as e:  # noqa: BLE001 (the profiler failing costs the kernels, not the timings)
        profile = {"error": gpu_check.error_record(e), "kernels": []}
    floor = step_floor(engine.target, engine.drafter, B, engine.positions_read(s["prompt_len"] + 1), bandwidth)
    return dict(rec, seconds_per_step=statistics.median(seconds), seconds_runs=seconds, profile=profile,
                syncs_per_step=len(syncs) / counts["synced"] if syncs is not None else None,
                steps=len(records), drafting_steps=sum(r.drafted for r in records),
                buckets=sorted({r.bucket for r in records}), live_rows=sorted({r.n_live for r in records}),
                graphs_after_warmup=engine.graph_use()[0] - warm, floor=floor,
                floor_ratio=floor["seconds"] / statistics.median(seconds))


def first_hour_steps(s: dict, bandwidth: float, deadline: float, log, graph_seconds: list[float],
                     saved=lambda records, info: None) -> tuple[list[dict], dict]:
    """Parts 3 and 4: an AR and a full-depth step at each batch size, each kind in an engine of its own
    (bucket B only), against its floor at `bandwidth` bytes/s. One starts only if its graphs end before
    the deadline at the mean of graph_seconds (cold seconds per graph seen so far, this part's added;
    none: GRAPH_SECONDS_PER_LAYER per target layer). saved(records, info) after each."""
    tcfg = gpu_check.target_config("dense", s["layers"], s["tiny"])
    target, drafter = gpu_check.build_pair(tcfg, s)
    max_new = drafter.block_size * sum(s["steps"].values()) + 1  # more than the steps can commit: rows stay live
    max_seq = s["prompt_len"] + max_new + drafter.block_size + 1
    prompts = gpu_check.random_prompts(max(s["batch_sizes"]), s["prompt_len"], tcfg["vocab_size"])
    seen, records, info = list(graph_seconds), [], {"max_seq": max_seq, "skipped": [], "errors": {}}
    for B, (kind, policy) in ((B, k) for B in s["batch_sizes"] for k in STEP_KINDS.items()):
        try:
            compile_log = CompileLog()
            engine = Engine(target, drafter, policy(), batch_size=B, max_seq=max_seq, eos_ids=[],
                            compile=s["compile"], on_compile=compile_log)
            per_graph = 0.0 if not engine.compile else statistics.mean(seen) if seen else \
                GRAPH_SECONDS_PER_LAYER * tcfg["num_hidden_layers"]
            if time.perf_counter() + per_graph * len(engine.reachable(B, B)) > deadline:
                info["skipped"].append(f"{kind} B={B}")
                continue
            log(f"steps: {kind} B={B}")
            records.append(step_record(engine, kind, B, prompts[:B], s, max_new, bandwidth, compile_log))
            seen += [g["seconds"] for g in records[-1]["graphs"]]
        except Exception as e:  # noqa: BLE001 (reported, the next one runs)
            info["errors"][f"{kind} B={B}"] = gpu_check.error_record(e)
        saved(records, info)
    return records, info


def run_first_hour(s: dict, deadline: float, log, saved=lambda out: None) -> dict:
    """The first hour's parts in order (the module docstring), each given its plan's share of the time
    left (the slack kept back); saved(the dict so far) after each part and each step measured."""
    plan, parts = s["plan_s"], ["bandwidth", "cold", "warm", "steps"]
    out = {"plan_seconds": plan, "bandwidth": None, "first_token": {"cold": None, "warm": None}, "steps": [],
           "steps_info": None, "error": None}

    def limit(part: str) -> float:
        rest = parts[parts.index(part):]
        return (deadline - time.perf_counter()) * plan[part] / (sum(plan[p] for p in rest) + plan["slack"])

    def on_steps(records, info):
        out.update(steps=records, steps_info=info)
        saved(out)

    try:
        out["bandwidth"] = copy_bandwidth(s["device"], s["copy_bytes"])
        saved(out)
        with tempfile.TemporaryDirectory(prefix="first_hour_") as d:
            for run in ("cold", "warm"):  # the warm run starts from the cache the cold one left
                log(f"first token at B={s['first_token_batch']}, {run} compile cache (at most {limit(run):.0f} s)")
                out["first_token"][run] = first_token_run(s, Path(d) / "cache", Path(d) / f"{run}.json", limit(run))
                saved(out)
        cold = [g["seconds"] for g in out["first_token"]["cold"]["graphs"] if g["seconds"] is not None]
        log(f"steps at B = {', '.join(map(str, s['batch_sizes']))} (at most {limit('steps'):.0f} s)")
        on_steps(*first_hour_steps(s, out["bandwidth"]["bytes_per_second"], time.perf_counter() + limit("steps"),
                                   log, cold, on_steps))
    except Exception as e:  # noqa: BLE001 (e.g. out of memory while building: the report still gets written)
        out["error"] = gpu_check.error_record(e)
    try:
        gpu_check.release_memory()
    except Exception as e:  # noqa: BLE001
        out["error"] = out["error"] or gpu_check.error_record(e)
    return out


# ---- the report -----------------------------------------------------------------------------------

def first_hour_lines(fh: dict) -> list[str]:
    """The summary's lines for the first hour: bandwidth, first tokens, steps against their floor."""
    lines, bw, info = gpu_check.errors("first hour", {"": fh["error"]}), fh["bandwidth"], fh["steps_info"] or {}
    if bw:
        lines.append(f"copy bandwidth {bw['bytes_per_second'] / 1e9:.1f} GB/s (copies of {bw['bytes'] >> 20} MiB)")
    for run, r in ((run, r) for run, r in fh["first_token"].items() if r is not None):
        done = [g["seconds"] for g in r["graphs"] if g["seconds"] is not None]
        ended = "killed at its limit" if r["timed_out"] else f"exit status {r['returncode']}"
        got = f"{r['first_token_seconds']:.1f} s" if r["first_token_seconds"] is not None else \
            f"none after {r['seconds']:.0f} s ({ended})"
        lines += [f"first token at B={r['batch_size']}, {run} compile cache: {got}",
                  "  " + ", ".join(f"{k} {v:.1f} s" for k, v in r["phases"].items())
                  + (f"; {len(done)} graphs, {statistics.mean(done):.1f} s each" if done else "; no graph compiled")
                  + f" (generate's warmup: {r['cli_graphs']} graphs)"]
    for rec in fh["steps"]:
        f, kernels, where = rec["floor"], rec["profile"]["kernels"], f"B={rec['batch_size']:<3} {rec['kind']:<4}"
        lines += gpu_check.errors(f"{where} profiler", {"": rec["profile"].get("error")})
        lines.append(f"  {where} {rec['seconds_per_step'] * 1e3:8.2f} ms/step, floor {f['seconds'] * 1e3:.2f} ms "
                     f"({f['total_bytes'] / 1e9:.2f} GB): {100 * rec['floor_ratio']:.0f}% of the limit"
                     + (f", host syncs/step {rec['syncs_per_step']:.2f}" if rec["syncs_per_step"] is not None else "")
                     + (f", top kernel {100 * kernels[0]['share']:.0f}%: {kernels[0]['name'][:60]}" if kernels else ""))
    lines += gpu_check.errors("steps ", info.get("errors", {}))
    return lines + ([f"  skipped for time: {', '.join(info['skipped'])}"] if info.get("skipped") else [])


def failed(fh: dict) -> bool:
    """Whether a part raised, a first-token child crashed or the profiler failed (a part cut short for
    time, a child killed at its limit, did not fail)."""
    crashed = [r for r in fh["first_token"].values() if r and r["returncode"] and not r["timed_out"]]
    profiler = [r for r in fh["steps"] if "error" in r["profile"]]
    return bool(fh["error"] or crashed or profiler or (fh["steps_info"] or {}).get("errors"))


def run(args, console: Console) -> int:
    s = check_args(args)
    start = time.perf_counter()
    runtime.setup()
    torch.manual_seed(0)
    if args.first_token_child:
        return first_token_child(s, args.out, args.started_at)
    env, wall = gpu_check.environment(s["device"]), {}

    def say(line: str) -> None:
        console.print(line, markup=False, highlight=False)

    def save(first_hour: dict):  # after every part, so a run killed from outside keeps what it finished
        wall["total"] = time.perf_counter() - start
        report = dict(gpu_check.assemble_report(s, env, None, {}, wall, args.argv), tool="tools/first_hour.py",
                      first_hour=first_hour)  # gpu_check's, no tests, no models
        return report, gpu_check.write_report(report, args.out)

    say(f"the first hour: dense, {s['layers'] or 'all'} layers (until {s['budget_s']:.0f} s from now)")
    first_hour = run_first_hour(s, start + s["budget_s"], lambda msg: say(f"  {msg}"), save)
    wall["first_hour"] = time.perf_counter() - start
    report, path = save(first_hour)
    lines = gpu_check.summary_lines(report)  # the machine, tests not run, wall seconds
    for line in lines[:1] + first_hour_lines(first_hour) + lines[-1:] + [f"wrote {path}"]:
        say(line)
    return 1 if failed(first_hour) else 0


def main(argv=None) -> int:
    return gpu_check.main(argv, parse_args, run)


if __name__ == "__main__":
    sys.exit(main())
