"""tools/gpu_check.py on the CPU: its pieces at tiny shapes (models built in memory from config dicts,
an eager cost table and bench, the report), the real shapes' configs without weights, the pytest part
(every CUDA test skipped here), and a one-line refusal with exit status 2 without a CUDA device."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys

import pytest
import torch
from rich.console import Console

from minidcut.config import load_drafter_config, parse_model_config
from minidcut.model import prefill_layout
from tools import gpu_check

ROOT = gpu_check.ROOT
TINY_ARGS = ["--device", "cpu", "--tiny", "--skip-tests"]


def tiny_settings(tmp_path, *extra) -> dict:
    return gpu_check.check_args(gpu_check.parse_args(TINY_ARGS + ["--out", str(tmp_path / "r.json"), *extra]))


# ---- configs and models ---------------------------------------------------------------------------

def test_real_shapes_parse_and_their_drafters_get_z_labs_default_taps(tmp_path):
    dense, moe = gpu_check.target_config("dense"), gpu_check.target_config("moe")
    d, m = parse_model_config(dense), parse_model_config(moe)
    assert (d.num_layers, d.hidden_size, d.num_heads, d.num_kv_heads, d.head_dim, d.intermediate_size,
            d.vocab_size) == (36, 4096, 32, 8, 128, 12288, 151936)
    assert (m.num_layers, m.hidden_size, m.num_kv_heads, m.num_experts, m.num_experts_per_tok,
            m.moe_intermediate_size) == (48, 2048, 4, 128, 8, 768)
    for target, taps in ((dense, [1, 9, 17, 25, 33]), (moe, [1, 12, 23, 34, 45])):
        cfg = gpu_check.drafter_config(target)
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        parsed = load_drafter_config(tmp_path)  # the loader's own parser, as for a z-lab checkpoint
        assert parsed.target_layer_ids == taps and parsed.block_size == 16 and parsed.mask_token_id == 151669
        assert parsed.layers.num_layers == 5 and parsed.layers.hidden_size == target["hidden_size"]
    cut = gpu_check.target_config("dense", 8)
    assert cut["num_hidden_layers"] == 8
    assert gpu_check.drafter_config(cut)["dflash_config"]["target_layer_ids"] == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="49 layers"):
        gpu_check.target_config("moe", 49)


@pytest.mark.parametrize("kind", ["dense", "moe"])
@torch.no_grad()
def test_tiny_models_are_built_in_memory_with_logits_of_unit_scale_and_the_targets_embedding(kind):
    """36 tiny layers: the init keeps activations O(1) at depth (logits ~ N(0, 1)); the drafter borrows
    the target's embedding and lm_head and drafts finite logits."""
    cfg = dict(gpu_check.target_config(kind, tiny=True), num_hidden_layers=36)
    target = gpu_check.build_target(cfg, torch.float32, "cpu")
    drafter = gpu_check.build_drafter(gpu_check.drafter_config(cfg), target, torch.float32, "cpu")
    assert drafter.taps == (1, 9, 17, 25, 33)
    assert drafter.embed.data_ptr() == target.model.embed_tokens.weight.data_ptr()
    assert drafter.head.data_ptr() == target.lm_head.weight.data_ptr()
    ids = torch.randint(0, cfg["vocab_size"], (24,))
    layout, _ = prefill_layout([0], [24], "cpu")
    logits, taps = target(ids, layout, taps=drafter.taps)
    assert torch.isfinite(logits).all() and 0.3 < logits.std().item() < 3.0
    target.setup_cache(1, 64)
    drafter.setup_cache(1, 64)
    drafter.add_context(taps, layout.row, layout.pos)
    draft_logits = drafter(target, ids[-1:], torch.tensor([24]))
    assert draft_logits.shape == (1, 15, cfg["vocab_size"]) and torch.isfinite(draft_logits).all()


# ---- profile, bench, report -----------------------------------------------------------------------

REPORT_KEYS = {"tool", "argv", "mode", "settings", "environment", "tests", "models", "wall_seconds", "notes"}
MODEL_KEYS = {"target_config", "drafter_config", "layers", "params", "build_seconds", "cost_table", "profile",
              "bench", "bench_info", "summary", "error"}
RECORD_KEYS = {"batch_size", "policy", "tokens_per_second", "tokens_per_second_runs", "speedup_vs_ar", "tau",
               "keep_ratio", "rho_histogram", "bucket_histogram", "seconds", "steps", "generated_tokens",
               "warmup_seconds", "compile_seconds", "new_graphs", "new_graphs_while_timed", "drafting_steps",
               "drafting_share", "graph_runs", "syncs_per_step", "seconds_runs", "drafting_steps_runs",
               # minidcut.bench.record's and add_speedups' (the tau errors: only where a step drafted)
               "predicted_accepted_raw", "predicted_accepted", "realized_accepted", "drafting_request_steps",
               "speedup_vs_ar_runs"}
TAU_ERRORS = {"tau_error_uncalibrated", "tau_error_calibrated"}


def test_one_tiny_model_profiles_and_benches_one_batch_size_eagerly_into_a_report_with_every_key(tmp_path):
    s = tiny_settings(tmp_path, "--batch-sizes", "2")
    assert s["compile"] is False and s["batch_sizes"] == [2]
    model = gpu_check.run_model("moe", s, deadline=float("inf"), log=lambda msg: None)
    assert set(model) == MODEL_KEYS and model["error"] is None and model["profile"]["error"] is None
    table = model["cost_table"]
    assert table["batch_sizes"] == [2] and table["rhos"] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert all(x > 0 for x in table["seconds"][0])
    assert {r["policy"] for r in model["bench"]} == set(gpu_check.POLICIES)
    for rec in model["bench"]:
        assert set(rec) - TAU_ERRORS == RECORD_KEYS and rec["generated_tokens"] == 2 * s["new_tokens"]
        assert (TAU_ERRORS <= set(rec)) == (rec["drafting_request_steps"] > 0)
    assert all(n > 0 for n in rec["graph_runs"]) and rec["syncs_per_step"] == [None] * len(rec["graph_runs"])  # no CUDA
    assert model["bench_info"]["errors"] == {} and set(model["summary"]["per_batch"]) == {2}

    env = gpu_check.environment("cpu")
    report = gpu_check.assemble_report(s, env, None, {"moe": model}, {"moe": 1.0, "total": 1.0}, ["--tiny"])
    path = gpu_check.write_report(report, tmp_path / "r.json")
    back = json.loads(path.read_text())
    assert set(back) == REPORT_KEYS and back["environment"]["torch"] == torch.__version__
    assert back["models"]["moe"]["cost_table"]["batch_sizes"] == [2]
    lines = gpu_check.summary_lines(report)
    assert any("B=2" in line and "dcut" in line for line in lines) and not gpu_check.failed(report)


def test_a_part_that_runs_out_of_time_keeps_what_it_measured_and_says_what_it_skipped(tmp_path):
    s = tiny_settings(tmp_path)
    model = gpu_check.run_model("dense", s, deadline=0.0, log=lambda msg: None)  # long past
    assert model["profile"]["skipped_batch_sizes"] == [1, 2] and model["cost_table"] is None
    assert model["bench"] == [] and model["bench_info"]["skipped_batch_sizes"] == [1, 2]


def test_without_a_cost_table_the_fixed_policies_are_still_benched(tmp_path, monkeypatch):
    """A profile that failed (as a capture error would make it) leaves AR, full and static timings."""
    def broken(*args, **kw):
        raise RuntimeError("Error: accessing tensor output of CUDAGraphs that has been overwritten")

    monkeypatch.setattr(gpu_check, "measure", broken)
    model = gpu_check.run_model("dense", tiny_settings(tmp_path, "--batch-sizes", "1"), float("inf"), lambda m: None)
    assert model["profile"]["error"]["type"] == "RuntimeError" and model["cost_table"] is None
    assert {r["policy"] for r in model["bench"]} == {"ar", "full", "static:0.5"}
    assert model["bench_info"]["dcut_without_table_row"] == [1]


def test_past_the_deadline_a_batch_size_starts_no_more_warm_passes_and_says_which_it_skipped(tmp_path, monkeypatch):
    s = tiny_settings(tmp_path, "--batch-sizes", "1,2")
    clock = iter(range(10 ** 6))
    monkeypatch.setattr(gpu_check.time, "perf_counter", lambda: float(next(clock)))  # each call is 1 s later
    model = gpu_check.run_model("dense", s, deadline=40.0, log=lambda msg: None)
    info = model["bench_info"]
    benched = {(r["batch_size"], r["policy"]) for r in model["bench"]}
    skipped = {(int(B), p) for B, specs in info["skipped_policies"].items() for p in specs}
    assert skipped and not benched & skipped and not info["errors"]


def test_a_part_that_fails_is_reported_and_the_other_parts_still_run(tmp_path, monkeypatch):
    s = tiny_settings(tmp_path, "--batch-sizes", "1")

    def out_of_memory(*args, **kw):
        raise RuntimeError("CUDA out of memory. Tried to allocate 58.00 GiB")

    monkeypatch.setattr(gpu_check, "build_target", out_of_memory)
    moe = gpu_check.run_model("moe", s, deadline=float("inf"), log=lambda msg: None)
    assert moe["error"]["type"] == "RuntimeError" and "out of memory" in moe["error"]["message"]
    monkeypatch.undo()
    dense = gpu_check.run_model("dense", s, deadline=float("inf"), log=lambda msg: None)
    assert dense["error"] is None and dense["bench"]
    report = gpu_check.assemble_report(s, gpu_check.environment("cpu"), None, {"dense": dense, "moe": moe},
                                       {"total": 1.0}, [])
    assert gpu_check.failed(report)
    assert any("moe" in line and "out of memory" in line for line in gpu_check.summary_lines(report))


def test_the_tool_runs_end_to_end_on_tiny_cpu_models_and_exits_0(tmp_path, capsys):
    out = tmp_path / "report.json"
    code = gpu_check.main(TINY_ARGS + ["--models", "dense", "--batch-sizes", "1", "--out", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert set(report) == REPORT_KEYS and report["tests"] is None and list(report["models"]) == ["dense"]
    assert {r["batch_size"] for r in report["models"]["dense"]["bench"]} == {1}
    assert "wrote" in capsys.readouterr().out


def test_a_run_killed_during_a_later_part_leaves_the_report_of_the_parts_before(tmp_path, monkeypatch):
    """The report is written after every part: a device command stopped at its time limit keeps them."""
    out = tmp_path / "report.json"
    real = gpu_check.run_model

    def killed_at_moe(kind, *args, **kw):
        if kind == "moe":
            raise KeyboardInterrupt
        return real(kind, *args, **kw)

    monkeypatch.setattr(gpu_check, "run_model", killed_at_moe)
    args = gpu_check.parse_args(TINY_ARGS + ["--batch-sizes", "1", "--out", str(out)])
    args.argv = []
    with pytest.raises(KeyboardInterrupt):
        gpu_check.run(args, Console())
    report = json.loads(out.read_text())
    assert list(report["models"]) == ["dense"] and report["models"]["dense"]["bench"]
    assert not list(tmp_path.glob("*.tmp"))  # no temporary file left beside it


# ---- the first hour -------------------------------------------------------------------------------

def test_the_first_hour_runs_on_tiny_cpu_models_into_a_report_whose_numbers_agree(tmp_path, capsys):
    """Both first-token children (eager here: nothing compiles) reach their first token on a fresh
    cache of their own; every step ran at its bucket with every row live, at or below the machine's
    limit; the kernel shares add up to at most the step."""
    out = tmp_path / "first_hour.json"
    assert gpu_check.main(TINY_ARGS + ["--first-hour", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report) == REPORT_KEYS | {"first_hour"} and report["mode"] == "first-hour"
    assert report["tests"] is None and report["models"] == {}
    s, fh = report["settings"], report["first_hour"]
    assert fh["error"] is None and fh["steps_info"]["errors"] == {} and fh["steps_info"]["skipped"] == []

    bw = fh["bandwidth"]
    assert bw["seconds_per_copy"] == min(bw["seconds_runs"]) > 0
    assert bw["bytes_per_second"] == pytest.approx(2 * bw["bytes"] / bw["seconds_per_copy"])

    cold, warm = fh["first_token"]["cold"], fh["first_token"]["warm"]
    for run in (cold, warm):
        assert run["returncode"] == 0 and not run["timed_out"], run["output_tail"]
        assert list(run["phases"]) == ["start", "build", "warmup", "first_step"]
        assert 0 < sum(run["phases"].values()) <= run["first_token_seconds"] + 1e-3
        assert run["first_token_seconds"] <= run["seconds"]
        B = run["batch_size"]
        assert B == s["first_token_batch"] and run["first_step"]["bucket"] == run["first_step"]["n_live"] == B
        assert run["measure_row_seconds"] > 0 and len(run["cost_row"]) == 5 and run["cost_row"][0] > 0
        assert run["cli_graphs"] >= len(run["cost_row"])
    assert cold["compile_cache"] == warm["compile_cache"] and "gpu_check_first_hour_" in cold["compile_cache"]

    counts = s["steps"]
    expected = {(B, kind) for B in s["batch_sizes"] for kind in ("ar", "full")}
    assert {(r["batch_size"], r["kind"]) for r in fh["steps"]} == expected
    for rec in fh["steps"]:
        B = rec["batch_size"]
        assert rec["buckets"] == [B] and rec["live_rows"] == [B] and rec["steps"] == sum(counts.values())
        assert rec["drafting_steps"] == (rec["steps"] if rec["kind"] == "full" else 0)
        assert rec["seconds_per_step"] == sorted(rec["seconds_runs"])[len(rec["seconds_runs"]) // 2]
        assert 0 < rec["floor"]["seconds"] <= rec["seconds_per_step"]
        assert rec["floor_ratio"] == pytest.approx(rec["floor"]["seconds"] / rec["seconds_per_step"])
        assert rec["floor"]["seconds"] == pytest.approx(rec["floor"]["total_bytes"] / bw["bytes_per_second"])
        assert rec["syncs_per_step"] is None  # no CUDA
        prof = rec["profile"]
        assert prof["activity"] == "cpu" and prof["steps"] == counts["profiled"]
        kernels = prof["kernels"]
        assert 0 < len(kernels) <= gpu_check.TOP_KERNELS and all(k["count_per_step"] > 0 for k in kernels)
        assert [k["us"] for k in kernels] == sorted((k["us"] for k in kernels), reverse=True)
        assert sum(k["share"] for k in kernels) <= prof["kernel_share"] + 1e-9 <= 1.0
    by = {(r["batch_size"], r["kind"]): r["floor"] for r in fh["steps"]}
    B1, B2 = s["batch_sizes"]
    assert by[B1, "ar"]["total_bytes"] < by[B1, "full"]["total_bytes"]
    assert by[B2, "ar"]["bytes"]["target_weights"] == by[B1, "ar"]["bytes"]["target_weights"]
    assert by[B2, "ar"]["bytes"]["target_kv"] * B1 == by[B1, "ar"]["bytes"]["target_kv"] * B2  # same positions
    printed = capsys.readouterr().out
    assert "compile cache" in printed and "ms/step" in printed


@torch.no_grad()
def test_a_steps_floor_is_its_weights_once_and_the_cache_rows_and_positions_it_reads():
    """Checked against what the models hold: the parameters (the embedding table left out, the lm_head
    counted again for the draft) and caches allocated at exactly B rows and S positions."""
    cfg = gpu_check.target_config("dense", tiny=True)
    target = gpu_check.build_target(cfg, torch.float32, "cpu")
    drafter = gpu_check.build_drafter(gpu_check.drafter_config(cfg), target, torch.float32, "cpu")
    B, S, bandwidth = 3, 40, 1e9
    target.setup_cache(B, S)
    drafter.setup_cache(B, S)
    ar = gpu_check.step_floor(target, None, B, S, bandwidth)
    full = gpu_check.step_floor(target, drafter, B, S, bandwidth)
    named = dict(target.named_parameters())
    assert ar["bytes"]["target_weights"] == sum(p.nbytes for n, p in named.items() if n != "model.embed_tokens.weight")
    assert ar["bytes"]["target_kv"] == sum(c.k.nbytes + c.v.nbytes for c in target.caches)
    assert full["bytes"]["drafter_kv"] == sum(c.k.nbytes + c.v.nbytes for c in drafter.caches)
    assert full["bytes"]["drafter_head"] == named["lm_head.weight"].nbytes
    assert full["bytes"]["drafter_weights"] == sum(p.nbytes for p in drafter.parameters())
    assert set(ar["bytes"]) == {"target_weights", "target_kv"}
    assert full["total_bytes"] == sum(full["bytes"].values()) and full["seconds"] == full["total_bytes"] / bandwidth


def test_a_cpu_profile_lists_the_ops_with_their_runs_per_step_and_shares_of_the_step():
    a = torch.randn(96, 96)

    def step():  # 3 matmuls and one add a step
        x = a
        for _ in range(3):
            x = x @ a
        return x + 1

    table = gpu_check.profile_steps(step, 4, "cpu")
    assert table["activity"] == "cpu" and table["steps"] == 4
    kernels = {k["name"]: k for k in table["kernels"]}
    assert kernels["aten::mm"]["count_per_step"] == 3 and kernels["aten::add"]["count_per_step"] == 1
    assert kernels["aten::mm"]["us"] == pytest.approx(4 * kernels["aten::mm"]["us_per_step"])
    assert 0 < sum(k["share"] for k in table["kernels"]) <= table["kernel_share"] + 1e-9 <= 1.0
    assert table["cpu_us_per_step"] == pytest.approx(table["kernel_us_per_step"])  # a CPU's kernels are its ops


def test_the_compile_log_gives_each_graph_the_seconds_until_the_next_one_starts(monkeypatch):
    clock = iter([10.0, 13.0, 13.5, 20.5])  # started, closed, started, closed
    monkeypatch.setattr(gpu_check.time, "perf_counter", lambda: next(clock))
    changes = []
    log = gpu_check.CompileLog(lambda: changes.append(len(log.graphs)))
    log("compiling verify graph b=32 K=0")
    log("compiling draft graph b=32")
    assert log.graphs == [{"graph": "compiling verify graph b=32 K=0", "seconds": 3.0},
                          {"graph": "compiling draft graph b=32", "seconds": None}]  # still compiling
    log.close()
    assert log.graphs[-1]["seconds"] == 7.0 and changes == [1, 2]


def test_a_first_hour_out_of_time_kills_its_children_and_skips_its_steps_but_reports_them(tmp_path):
    s = tiny_settings(tmp_path, "--first-hour")
    fh = gpu_check.run_first_hour(s, deadline=gpu_check.time.perf_counter(), log=lambda msg: None)
    assert fh["error"] is None and fh["bandwidth"]["bytes_per_second"] > 0
    for run in fh["first_token"].values():
        assert run["timed_out"] and run["first_token_seconds"] is None and run["returncode"] != 0
    assert fh["steps"] == [] and len(fh["steps_info"]["skipped"]) == 2 * len(s["batch_sizes"])
    report = gpu_check.assemble_report(s, gpu_check.environment("cpu"), None, {}, {"total": 1.0}, [], fh)
    lines = gpu_check.summary_lines(report)
    assert sum("killed at its limit" in line for line in lines) == 2
    assert any("skipped for time" in line for line in lines)
    assert not gpu_check.failed(report)  # cut short for time, not broken
    fh["first_token"]["cold"].update(timed_out=False, returncode=1)  # a child that crashed
    assert gpu_check.failed(report)


def test_a_compiled_steps_part_with_no_graph_seen_budgets_on_the_prior_not_on_zero(tmp_path, monkeypatch):
    """The cold child finished no graph: the steps part must still price each graph (the prior per layer),
    so a step whose graphs cannot compile before the deadline is skipped, not started."""
    s = dict(tiny_settings(tmp_path, "--first-hour"), compile=True)
    started = []
    monkeypatch.setattr(gpu_check, "step_record", lambda *a, **k: started.append(a[1:3]) or {"graphs": []})
    prior = gpu_check.GRAPH_SECONDS_PER_LAYER * gpu_check.target_config("dense", s["layers"], True)["num_hidden_layers"]
    deadline = gpu_check.time.perf_counter() + prior * 0.9  # not even one graph fits
    records, info = gpu_check.first_hour_steps(s, 1e9, deadline, lambda msg: None, graph_seconds=[])
    assert started == [] and records == [] and len(info["skipped"]) == 2 * len(s["batch_sizes"])
    # with a graph seen at 0.01 s, the same deadline lets every step start
    records, info = gpu_check.first_hour_steps(s, 1e9, deadline, lambda msg: None, graph_seconds=[0.01])
    assert len(started) == 2 * len(s["batch_sizes"]) and info["skipped"] == []


# ---- the pytest part ------------------------------------------------------------------------------

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="1" failures="1"
skipped="1" tests="5"><testcase classname="tests.test_cuda" name="test_a"/><testcase classname="tests.test_cuda"
name="test_b"><failure message="assert 1 == 2">...</failure></testcase><testcase classname="tests.test_cuda"
name="test_c"><error message="RuntimeError: boom">...</error></testcase><testcase classname="tests.test_moe"
name="test_d"><skipped message="needs a CUDA device"/></testcase><testcase classname="tests.test_moe"
name="test_e"/></testsuite></testsuites>"""


def test_junit_counts_and_failures_are_read(tmp_path):
    (tmp_path / "j.xml").write_text(JUNIT)
    r = gpu_check.parse_junit(tmp_path / "j.xml")
    assert (r["passed"], r["failed"], r["errors"], r["skipped"], r["total"]) == (2, 1, 1, 1, 5)
    assert [(f["test"], f["kind"]) for f in r["failures"]] == [("tests.test_cuda::test_b", "failure"),
                                                             ("tests.test_cuda::test_c", "error")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="here the CUDA tests would run, not skip")
def test_the_pytest_part_collects_every_cuda_test_and_skips_them_without_a_gpu():
    r = gpu_check.run_cuda_tests(timeout_s=120)
    assert r["returncode"] == 0 and not r["timed_out"]
    assert r["total"] >= 15 and r["skipped"] == r["total"] and r["failed"] == r["errors"] == 0


# ---- public names only ----------------------------------------------------------------------------

def test_the_tool_uses_only_public_names_of_minidcut():
    """Nothing underscored imported from minidcut or read off its objects, and nothing reached through an
    engine's runner or a policy's table: the Engine and Policy methods say what the tool needs."""
    source = (ROOT / "tools" / "gpu_check.py").read_text()
    names = [a.name for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ImportFrom)
             and (node.module or "").startswith("minidcut") for a in node.names]
    assert "Engine" in names and not [n for n in names if n.startswith("_")]
    assert not re.findall(r"\.runner\b|policy\.table\b|\b(?:engine|policy|target|drafter|table|stats)\._\w", source)


# ---- refusals -------------------------------------------------------------------------------------

def test_without_cuda_main_exits_2_with_one_error_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--out", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no CUDA device") and err.count("\n") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="refuses only without a CUDA device")
def test_the_script_refuses_with_one_line_and_exit_status_2_on_this_cpu(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--out", str(tmp_path / "r.json")],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("error: no CUDA device") and r.stderr.count("\n") == 1
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("argv,message", [
    (["--device", "cpu"], "only for --tiny"),
    (["--device", "cpu", "--tiny", "--models", "dense,gpt"], "--models"),
    (["--device", "cpu", "--tiny", "--batch-sizes", "0"], "--batch-sizes"),
    (["--device", "cpu", "--tiny", "--layers", "4"], "--layers"),
    (["--device", "cpu", "--tiny", "--budget-s", "-1"], "--budget-s"),
    (["--device", "cpu", "--tiny", "--out", "/proc/nowhere/r.json"], "--out"),
    (["--device", "cpu", "--tiny", "--first-hour", "--quick"], "--first-hour"),
    (["--device", "cpu", "--tiny", "--first-token-child", "--started-at", "0"], "--first-token-child"),
])
def test_bad_arguments_are_one_line_errors_before_any_work(argv, message, capsys):
    assert gpu_check.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err and err.count("\n") == 1
