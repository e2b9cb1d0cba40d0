"""tools/eval_pair.py with a "domain" field on the prompts (the shipped demo pair, a few prompts): tau and
P(accepted >= 1) per domain in the JSON, pooled into the overall numbers; without the field the output
is as before (no "domains")."""

import json

from tools import eval_pair

CODE = ["def heappush(heap, item):\n", "class Formatter:\n", "import re\n"]
TEXT = ["# Read the configuration file and return a dict\n", "\"\"\"Helpers for dates.\"\"\"\n"]


def run(tmp_path, rows, name):
    prompts = tmp_path / f"{name}.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / f"{name}.json"
    assert eval_pair.main(["--prompts", str(prompts), "--max-new-tokens", "8", "--batch-size", "2",
                           "--threads", "1", "--output", str(out)]) == 0
    return json.loads(out.read_text())


def test_per_domain_tau_and_acceptance_pool_into_the_overall_numbers(tmp_path, capsys):
    rows = [{"prompt": p, "domain": "code"} for p in CODE] + [{"prompt": p, "domain": "comments"} for p in TEXT]
    res = run(tmp_path, rows[::2] + rows[1::2], "domains")  # domains interleaved in the file
    printed = capsys.readouterr().out
    assert "P(acc>=1)" in printed and "overall" in printed  # the table
    doms = res["domains"]
    assert set(doms) == {"code", "comments"}
    assert doms["code"]["prompts"] == 3 and doms["comments"]["prompts"] == 2 and res["prompts"] == 5
    assert res["request_steps"] == sum(d["request_steps"] for d in doms.values())
    assert min(d["tau"] for d in doms.values()) <= res["tau"] <= max(d["tau"] for d in doms.values())
    for d in (*doms.values(), res):
        assert d["tau"] >= 1.0 and 0.0 <= d["p_accept_depth"][0] <= 1.0
    steps_p1 = sum(d["p_accept_depth"][0] * d["request_steps"] for d in doms.values())
    assert abs(steps_p1 - res["p_accept_depth"][0] * res["request_steps"]) < 1e-6


def test_without_a_domain_field_there_is_no_per_domain_report(tmp_path, capsys):
    res = run(tmp_path, [{"prompt": p} for p in CODE], "plain")
    assert "domains" not in res and res["prompts"] == 3 and res["tau"] >= 1.0
    assert "P(acc>=1)" not in capsys.readouterr().out
