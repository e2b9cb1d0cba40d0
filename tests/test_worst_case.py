"""tools/worst_case.py's summary: the spread of dcut over runs, against each run's best fixed policy and
against one reference fixed after all runs."""

import pytest

from tools.worst_case import summarize


def run(i, tps):
    best = max((k for k in tps if k != "dcut"), key=tps.get)
    return {"run": i, "batch_size": 1, "best_fixed": best, "dcut_vs_best_fixed": tps["dcut"] / tps[best],
            "dcut_vs_ar": tps["dcut"] / tps["ar"], "dcut_ar_step_share": 0.0, "tokens_per_second": tps,
            "passes_vs_ar": {k: [v / tps["ar"]] for k, v in tps.items()}}  # one pass each


def test_the_overall_reference_is_the_fixed_policy_best_across_runs_not_the_noisiest_in_each():
    """Two drafting policies, equally fast but noisy: each run's best is whichever was lucky, so dcut,
    running as fast as either on average, trails each run's best by the noise. The overall reference is
    the one with the higher median speedup over AR, and dcut is compared with it in the same run."""
    runs = [run(1, {"ar": 100, "a": 150, "b": 135, "dcut": 140}),
            run(2, {"ar": 100, "a": 130, "b": 150, "dcut": 140}),
            run(3, {"ar": 100, "a": 145, "b": 140, "dcut": 140})]
    s = summarize(runs, [1])["1"]
    assert s["best_fixed"] == {"a": 2, "b": 1} and s["best_fixed_overall"] == "a"  # medians 1.45 vs 1.40
    assert s["dcut_vs_best_fixed"]["median"] == pytest.approx(140 / 150)  # two runs of three trail the lucky one
    overall = sorted([140 / 150, 140 / 130, 140 / 145])  # dcut / a, run by run
    assert s["dcut_vs_best_fixed_overall"]["median"] == pytest.approx(overall[1])
    assert s["dcut_vs_best_fixed_overall"]["min"] == pytest.approx(overall[0])
    assert s["dcut_vs_best_fixed_overall"]["p10"] == pytest.approx(overall[0] + 0.2 * (overall[1] - overall[0]))
    assert s["dcut_vs_ar"]["median"] == pytest.approx(1.4) and s["dcut_vs_ar_where_ar_is_best"]["min"] is None


def test_paired_figures_take_each_round_s_passes_together():
    """A machine that drifts: round 2 runs every policy at half speed. Over medians of passes the drift
    moves the figures with whichever policy's median lands in the slow round; paired, dcut / X is the
    median over rounds of dcut's pass over X's pass of the same round, and the drift cancels."""
    r = run(1, {"ar": 100, "a": 150, "b": 120, "dcut": 140})
    r["passes_vs_ar"] = {"ar": [1.0, 1.0, 1.0], "a": [1.5, 1.5, 1.4], "b": [1.2, 1.3, 1.2], "dcut": [1.4, 1.5, 1.5]}
    s = summarize([r], [1])["1"]["paired"]
    assert s["best_fixed"] == {"a": 1} and s["best_fixed_overall"] == "a"
    assert s["dcut_vs_best_fixed"]["median"] == pytest.approx(1.0)  # 1.4 / 1.5, 1.5 / 1.5, 1.5 / 1.4
    assert s["dcut_vs_ar"]["median"] == pytest.approx(1.5)
    assert s["dcut_vs_ar_where_ar_is_best"]["median"] is None


def test_summarize_joins_files_and_keeps_the_batch_sizes_asked(tmp_path):
    """--summarize over two files (runs of one code from two sessions): their runs together, summarized
    as one; --batch-sizes keeps only those; one file alone is rewritten in place with every run."""
    import json

    from tools.worst_case import main

    at_4 = {**run(1, {"ar": 100, "a": 150, "dcut": 140}), "batch_size": 4}
    a = {"command": "first", "args": {"runs": 2}, "runs": [run(1, {"ar": 100, "a": 90, "dcut": 95}), at_4]}
    b = {"command": ["second", "third"], "args": [{"runs": 1}, {"runs": 1}],
         "runs": [run(1, {"ar": 100, "a": 80, "dcut": 99}), run(2, {"ar": 100, "a": 95, "dcut": 70})]}
    pa, pb, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "joined.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    assert main(["--summarize", str(pa), str(pb), "--batch-sizes", "1", "--output", str(out)]) == 0
    joined = json.loads(out.read_text())
    assert joined["command"] == ["first", "second", "third"] and len(joined["args"]) == 3
    assert [r["batch_size"] for r in joined["runs"]] == [1, 1, 1] and list(joined["summary"]) == ["1"]
    s = joined["summary"]["1"]
    assert s["runs"] == 3
    assert s["dcut_vs_ar"]["min"] == pytest.approx(0.70) and s["dcut_vs_ar"]["median"] == pytest.approx(0.95)
    assert main(["--summarize", str(pa)]) == 0  # in place, every batch size
    assert sorted(json.loads(pa.read_text())["summary"]) == ["1", "4"]
    assert main(["--summarize", str(pa), "--batch-sizes", "16", "--output", str(out)]) == 2  # nothing there: one line
