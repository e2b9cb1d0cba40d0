"""tools/first_hour.py on the CPU: the whole run at tiny shapes (both first-token children, the steps
against their floor, the report), its pieces (a step's floor, the profile of a step, the compile log),
a run out of time and its refusals."""

from __future__ import annotations

import json

import pytest
import torch

from test_gpu_check import REPORT_KEYS
from tools import first_hour, gpu_check

TINY_ARGS = ["--device", "cpu", "--tiny"]


def tiny_settings(tmp_path, *extra) -> dict:
    return first_hour.check_args(first_hour.parse_args(TINY_ARGS + ["--out", str(tmp_path / "r.json"), *extra]))


def test_the_first_hour_runs_on_tiny_cpu_models_into_a_report_whose_numbers_agree(tmp_path, capsys):
    """Both first-token children (eager here: nothing compiles) reach their first token on a fresh
    cache of their own; every step ran at its bucket with every row live, at or below the machine's
    limit; the kernel shares add up to at most the step."""
    out = tmp_path / "first_hour.json"
    assert first_hour.main(TINY_ARGS + ["--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report) == REPORT_KEYS | {"first_hour"} and report["mode"] == "first-hour"
    assert report["tool"] == "tools/first_hour.py"
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
    assert cold["compile_cache"] == warm["compile_cache"] and "first_hour_" in cold["compile_cache"]

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
        assert 0 < len(kernels) <= first_hour.TOP_KERNELS and all(k["count_per_step"] > 0 for k in kernels)
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
    ar = first_hour.step_floor(target, None, B, S, bandwidth)
    full = first_hour.step_floor(target, drafter, B, S, bandwidth)
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

    table = first_hour.profile_steps(step, 4, "cpu")
    assert table["activity"] == "cpu" and table["steps"] == 4
    kernels = {k["name"]: k for k in table["kernels"]}
    assert kernels["aten::mm"]["count_per_step"] == 3 and kernels["aten::add"]["count_per_step"] == 1
    assert kernels["aten::mm"]["us"] == pytest.approx(4 * kernels["aten::mm"]["us_per_step"])
    assert 0 < sum(k["share"] for k in table["kernels"]) <= table["kernel_share"] + 1e-9 <= 1.0
    assert table["cpu_us_per_step"] == pytest.approx(table["kernel_us_per_step"])  # a CPU's kernels are its ops


def test_the_compile_log_gives_each_graph_the_seconds_until_the_next_one_starts(monkeypatch):
    clock = iter([10.0, 13.0, 13.5, 20.5])  # started, closed, started, closed
    monkeypatch.setattr(first_hour.time, "perf_counter", lambda: next(clock))
    changes = []
    log = first_hour.CompileLog(lambda: changes.append(len(log.graphs)))
    log("compiling verify graph b=32 K=0")
    log("compiling draft graph b=32")
    assert log.graphs == [{"graph": "compiling verify graph b=32 K=0", "seconds": 3.0},
                          {"graph": "compiling draft graph b=32", "seconds": None}]  # still compiling
    log.close()
    assert log.graphs[-1]["seconds"] == 7.0 and changes == [1, 2]


def test_a_first_hour_out_of_time_kills_its_children_and_skips_its_steps_but_reports_them(tmp_path):
    s = tiny_settings(tmp_path)
    fh = first_hour.run_first_hour(s, deadline=first_hour.time.perf_counter(), log=lambda msg: None)
    assert fh["error"] is None and fh["bandwidth"]["bytes_per_second"] > 0
    for run in fh["first_token"].values():
        assert run["timed_out"] and run["first_token_seconds"] is None and run["returncode"] != 0
    assert fh["steps"] == [] and len(fh["steps_info"]["skipped"]) == 2 * len(s["batch_sizes"])
    lines = first_hour.first_hour_lines(fh)
    assert sum("killed at its limit" in line for line in lines) == 2
    assert any("skipped for time" in line for line in lines)
    assert not first_hour.failed(fh)  # cut short for time, not broken
    fh["first_token"]["cold"].update(timed_out=False, returncode=1)  # a child that crashed
    assert first_hour.failed(fh)


def test_a_compiled_steps_part_with_no_graph_seen_budgets_on_the_prior_not_on_zero(tmp_path, monkeypatch):
    """The cold child finished no graph: the steps part must still price each graph (the prior per layer),
    so a step whose graphs cannot compile before the deadline is skipped, not started."""
    s = dict(tiny_settings(tmp_path), compile=True)
    started = []
    monkeypatch.setattr(first_hour, "step_record", lambda *a, **k: started.append(a[1:3]) or {"graphs": []})
    layers = gpu_check.target_config("dense", s["layers"], True)["num_hidden_layers"]
    prior = first_hour.GRAPH_SECONDS_PER_LAYER * layers
    deadline = first_hour.time.perf_counter() + prior * 0.9  # not even one graph fits
    records, info = first_hour.first_hour_steps(s, 1e9, deadline, lambda msg: None, graph_seconds=[])
    assert started == [] and records == [] and len(info["skipped"]) == 2 * len(s["batch_sizes"])
    # with a graph seen at 0.01 s, the same deadline lets every step start
    records, info = first_hour.first_hour_steps(s, 1e9, deadline, lambda msg: None, graph_seconds=[0.01])
    assert len(started) == 2 * len(s["batch_sizes"]) and info["skipped"] == []


def test_a_first_token_child_needs_its_start_time_and_the_first_hour_is_a_run_of_its_own(monkeypatch, capsys, tmp_path):
    """Refusals, each one line with exit status 2 before any work: the child's flag without the parent's
    clock, --layers with --tiny, no CUDA device; gpu_check has no --first-hour, this tool no --quick."""
    for argv, message in [(TINY_ARGS + ["--first-token-child"], "--first-token-child"),
                          (TINY_ARGS + ["--layers", "4"], "--layers")]:
        assert first_hour.main(argv + ["--out", str(tmp_path / "r.json")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error:") and message in err and err.count("\n") == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert first_hour.main(["--out", str(tmp_path / "r.json")]) == 2
    assert capsys.readouterr().err.startswith("error: no CUDA device: tools/first_hour.py needs a GPU")
    for module, flag in ((gpu_check, "--first-hour"), (first_hour, "--quick")):
        with pytest.raises(SystemExit):
            module.parse_args([flag])
