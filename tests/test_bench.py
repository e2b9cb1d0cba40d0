"""python -m minidcut.bench on a tiny pair (eager, two batch sizes): it runs every policy, writes JSON
with the figures the README quotes, and its summary finds the crossover of full drafting and AR."""

from __future__ import annotations

import json

import pytest

import torch

from minidcut import bench
from minidcut.cost_model import CostTable, fingerprint
from tiny import make_drafter, make_model

GRID = [0.0, 0.25, 0.5, 0.75, 1.0]


def test_bench_runs_every_policy_and_writes_json(tmp_path, capsys):
    hf = make_model(tmp_path / "target", "llama")
    make_drafter(tmp_path / "drafter", hf.config)
    fp = fingerprint("cpu", tmp_path / "target", tmp_path / "drafter", torch.float32, False, packed=True,
                     max_seq=64)  # what the bench runs with: 4 prompt + 12 new + 16 block + 1, rounded up
    CostTable([1, 2], GRID, [[1.0, 1.5, 1.6, 1.7, 1.8], [1.2, 2.0, 2.2, 2.4, 2.6]],
              {"fingerprint": fp}).save(tmp_path / "t.json")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": [3 + i, 5, 7, 9]}) + "\n" for i in range(4)))
    out = tmp_path / "bench.json"
    code = bench.main(["--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"),
                       "--batch-sizes", "1,2", "--policies", "ar,full,static:0.5,dcut,dcut:paper",
                       "--prompts", str(prompts), "--num-prompts", "3", "--max-new-tokens", "12",
                       "--repeats", "1", "--cost-table", str(tmp_path / "t.json"), "--no-compile",
                       "--threads", "1", "--output", str(out)])
    assert code == 0
    res = json.loads(out.read_text())
    recs = {(r["batch_size"], r["policy"]): r for r in res["records"]}
    assert set(recs) == {(B, p) for B in (1, 2) for p in ("ar", "full", "static:0.5", "dcut", "dcut:paper")}
    for r in recs.values():
        assert r["generated_tokens"] == 3 * 12 and r["tokens_per_second"] > 0
    assert recs[(1, "ar")]["speedup_vs_ar"] == 1.0 and recs[(1, "ar")]["tau"] == 1.0
    full = recs[(2, "full")]  # 12 new tokens: never D = 15 drafts a request can use, so never all kept
    assert set(full["rho_histogram"]) == {"1"} and 0.2 < full["keep_ratio"] < 0.8
    assert 0 < recs[(2, "dcut")]["select_fraction_of_step"] < 1
    assert set(res["summary"]["per_batch"]) == {"1", "2"}
    for B in ("1", "2"):  # the given table was used (its entries refined by the steps run), not remeasured
        assert res["cost_tables"][B]["batch_sizes"] == [1, 2] and not recs[(int(B), "dcut")]["seconds"].get("profile")
    assert "adaptive vs the best fixed policy" in capsys.readouterr().out


def rec(B, policy, tps):
    return {"batch_size": B, "policy": policy, "tokens_per_second": tps}


def test_summary_finds_the_crossover_and_compares_dcut_with_both_sides():
    records = [rec(1, "ar", 100), rec(1, "full", 150), rec(1, "dcut", 160),
               rec(4, "ar", 300), rec(4, "full", 290), rec(4, "dcut", 340),
               rec(16, "ar", 800), rec(16, "full", 300), rec(16, "dcut", 790)]
    s = bench.summarize(records)
    assert s["crossover"]["batch_size"] == 4 and s["crossover"]["between"] == [1, 4]
    assert s["crossover"]["dcut_vs_both"] == pytest.approx(340 / 300)
    assert s["per_batch"][16]["best_fixed"] == "ar"
    assert s["per_batch"][16]["dcut_vs_best_fixed"] == pytest.approx(790 / 800)
    assert s["per_batch"][1]["dcut_vs_full"] == pytest.approx(160 / 150)
    no_cross = [r for r in records if r["policy"] != "full"] + [rec(B, "full", 10) for B in (1, 4, 16)]
    assert bench.summarize(no_cross)["crossover"] is None


@pytest.mark.parametrize("argv,message", [
    (["--batch-sizes", "a"], "--batch-sizes"), (["--batch-sizes", "0"], "--batch-sizes must be >= 1"),
    (["--policies", "foo"], "unknown policy"), (["--policies", "dcut:x"], "unknown dcut variant"),
    (["--repeats", "0"], "--repeats must be >= 1"), (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--device", "tpu"], "tpu"), (["--output", "/proc/self/b.json"], "--output"),
])
def test_bad_arguments_are_one_line_errors_before_any_work(argv, message, capsys):
    assert bench.main(argv + ["--no-compile"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err and "Traceback" not in err


def test_plot_without_matplotlib_is_a_one_line_error_before_any_work(tmp_path, capsys, monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kw):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kw)
    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert bench.main(["--plot", str(tmp_path / "p.png"), "--no-compile"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "matplotlib" in err and err.count("\n") == 1


def test_lockstep_passes_take_one_step_of_each_engine_in_turn():
    """bench.together: every unfinished engine steps once a round, the order rotating; an engine that
    finishes drops out and the others go on."""
    order = []

    class Fake:
        def __init__(self, name, n):
            self.name, self.n = name, n

        def start(self, ids, max_new_tokens):
            def steps():
                for i in range(self.n):
                    order.append(self.name)
                    yield i
            return [], f"stats of {self.name}", steps()

    done = bench.together({"a": Fake("a", 3), "b": Fake("b", 5)}, [[1]], 4)
    assert done == [("a", "stats of a"), ("b", "stats of b")]
    assert order == ["a", "b", "b", "a", "a", "b", "b", "b"]


def test_interleaved_passes_rotate_the_order_of_the_policies(tmp_path, monkeypatch):
    """Without --lockstep the timed passes run policy after policy, the order rotating from pass to
    pass, so each policy follows each other one alike (the first steps after another policy's pass
    run slow on a CPU). The warm-up passes run other prompts than the timed passes start with."""
    hf = make_model(tmp_path / "target", "llama")
    make_drafter(tmp_path / "drafter", hf.config)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": [3 + i, 5, 7, 9]}) + "\n" for i in range(4)))
    order, firsts = [], []
    real_generate = bench.Engine.generate

    def generate(self, prompts, max_new_tokens, *a, **kw):
        order.append(self.policy.label)
        firsts.append(prompts[0][0])
        return real_generate(self, prompts, max_new_tokens, *a, **kw)
    monkeypatch.setattr(bench.Engine, "generate", generate)
    assert bench.main(["--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"),
                       "--batch-sizes", "2", "--policies", "ar,full,static:0.5", "--prompts", str(prompts),
                       "--max-new-tokens", "4", "--repeats", "3", "--no-compile", "--threads", "1",
                       "--output", str(tmp_path / "b.json")]) == 0
    assert order[3:] == ["ar", "full", "static:0.5", "full", "static:0.5", "ar", "static:0.5", "ar", "full"]
    # the warm-up passes run the last B = 2 prompts (16 made of the 4 repeated: the 15th starts with
    # 3 + 2), the timed passes start with the first (3): dcut's first two requests are not one prompt
    assert firsts[:3] == [5] * 3 and firsts[3:] == [3] * 9


def test_lockstep_bench_runs_each_policy_on_its_own_models(tmp_path, monkeypatch):
    """--lockstep: one copy of the models per policy, every pass's ratio to AR's pass in the JSON."""
    hf = make_model(tmp_path / "target", "llama")
    make_drafter(tmp_path / "drafter", hf.config)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": [3 + i, 5, 7, 9]}) + "\n" for i in range(4)))
    targets = []
    real_engine = bench.Engine

    def engine(target, *a, **kw):
        targets.append(target)
        return real_engine(target, *a, **kw)
    monkeypatch.setattr(bench, "Engine", engine)
    out = tmp_path / "bench.json"
    assert bench.main(["--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"),
                       "--batch-sizes", "2", "--policies", "ar,full,dcut", "--prompts", str(prompts),
                       "--max-new-tokens", "8", "--repeats", "2", "--lockstep", "--cost-table",
                       str(tmp_path / "t.json"), "--no-compile", "--threads", "1", "--output", str(out)]) == 0
    assert len(targets) == 3 and len({id(t) for t in targets}) == 3
    res = json.loads(out.read_text())
    assert res["lockstep"] is True
    for r in res["records"]:
        assert r["generated_tokens"] == 16 * 8 and len(r["speedup_vs_ar_runs"]) == 2
        ar_runs = res["records"][0]["tokens_per_second_runs"]
        assert r["speedup_vs_ar_runs"][1] == pytest.approx(r["tokens_per_second_runs"][1] / ar_runs[1])
