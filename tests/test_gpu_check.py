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

@pytest.mark.parametrize("tool", ["gpu_check.py", "first_hour.py"])
def test_the_tool_uses_only_public_names_of_minidcut(tool):
    """Nothing underscored imported from minidcut or read off its objects, and nothing reached through an
    engine's runner or a policy's table: the Engine and Policy methods say what the tool needs."""
    source = (ROOT / "tools" / tool).read_text()
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
])
def test_bad_arguments_are_one_line_errors_before_any_work(argv, message, capsys):
    assert gpu_check.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err and err.count("\n") == 1
