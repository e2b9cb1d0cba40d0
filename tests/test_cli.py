"""The CLI `python -m minidcut.generate` on a tiny target with its own tokenizer and a tiny drafter:
what it writes (--output JSONL, --stats JSON), where it reads prompts from (--prompt, --prompts JSONL
with text and token ids), and how it refuses bad input: one line on stderr that starts with "error:",
exit status 2, no traceback.

Runs main(argv) in-process (fast); one test runs the module as a user does, in a subprocess.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from minidcut import generate
from minidcut.cli import max_seq
from minidcut.cost_model import CostTable, fingerprint
from minidcut.engine import Engine
from minidcut.loader import load_target
from minidcut.policy import Policy
from tiny import hf_config, make_drafter, make_model

ROOT = Path(__file__).resolve().parents[1]
CORPUS = {
    "a.py": "def add(a, b):\n    return a + b\n\n\nclass Stack:\n    def __init__(self):\n        self.items = []\n",
    "b.py": "import os\n\n\ndef list_files(root):\n    return sorted(os.listdir(root))\n" * 3,
    "c.txt": "the quick brown fox jumps over the lazy dog\n" * 5,
    "d.py": "for i in range(10):\n    print(i, i * i)\n" * 4,
}
GRID = [0.0, 0.25, 0.5, 0.75, 1.0]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Directories: target (tiny llama + its BPE tokenizer), drafter, a cost table, and two drafters
    that do not fit the target (hidden size, vocabulary)."""
    from tools.train_tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("cli")
    corpus = root / "corpus"
    corpus.mkdir()
    for name, text in CORPUS.items():
        (corpus / name).write_text(text)
    tok = train_tokenizer(corpus, vocab_size=300)
    target = root / "target"
    hf = make_model(target, "llama", vocab_size=len(tok))
    tok.save_pretrained(target)
    mask = tok.convert_tokens_to_ids("<|mask|>")
    make_drafter(root / "drafter", hf.config, mask_token_id=mask)
    make_model(root / "target_notok", "llama", vocab_size=len(tok))  # no tokenizer files
    make_drafter(root / "drafter_h32", hf_config("llama", vocab_size=len(tok), hidden_size=32),
                 mask_token_id=mask)
    make_drafter(root / "drafter_v", hf_config("llama", vocab_size=len(tok) + 7), mask_token_id=mask)
    fp = fingerprint("cpu", target, root / "drafter", torch.float32, False, packed=True)  # what `base` runs with
    table = CostTable([1, 2, 4], GRID, [[1.0 + 0.01 * r * b for r in GRID] for b in (1, 2, 4)],
                      {"fingerprint": fp})
    table.save(root / "table.json")
    return {"root": root, "target": target, "drafter": root / "drafter", "table": root / "table.json",
            "target_notok": root / "target_notok", "drafter_h32": root / "drafter_h32", "drafter_v": root / "drafter_v", "tok": tok,
            "vocab": len(tok)}


def cli(capsys, *argv) -> tuple[int, str, str]:
    """main(argv) in-process -> (exit status, stdout, stderr)."""
    try:
        code = generate.main([str(a) for a in argv])
    except SystemExit as e:  # argparse
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def base(models, *extra) -> list:
    return ["--target", models["target"], "--no-compile", "--quiet", "--threads", "1", *extra]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


TEXTS = ["def add(a, b):\n", "class Stack:\n", "import os\n"]


def test_an_eager_cache_is_sized_to_16_positions_and_a_compiled_one_to_its_size_class():
    """Prompt 40 + 128 new tokens + a block of 16 + 1 = 185 positions: 192 eager (attention over a span
    of a longer cache costs more), 256 compiled (a size class: runs of other lengths share its graphs
    and table); 201 of them: 208 eager, 256 compiled; 300: 304 and 512; never past the target's
    positions. Per-prompt lengths count each prompt's own."""
    prompts = [[1] * 40, [2] * 7]
    assert max_seq(prompts, 128, 16, compile=False) == 192 and max_seq(prompts, 128, 16) == 256
    assert max_seq(prompts, 144, 16, compile=False) == 208 and max_seq(prompts, 144, 16) == 256
    assert max_seq(prompts, 243, 16, compile=False) == 304 and max_seq(prompts, 243, 16) == 512
    assert max_seq(prompts, 144, 16, positions=250) == 201 == max_seq(prompts, 144, 16, 201, False)
    assert max_seq(prompts, [128, 200], 16, compile=False) == 224  # the second: 7 + 200 + 17


def test_output_jsonl_has_index_ids_and_text_in_input_order(models, capsys, tmp_path):
    out = tmp_path / "out.jsonl"
    args = [a for t in TEXTS for a in ("--prompt", t)]
    code, _, err = cli(capsys, *base(models, "--drafter", models["drafter"], "--policy", "static",
                                     "--rho", "0.5", "--batch-size", "2", "--max-new-tokens", "9",
                                     "--output", out, *args))
    assert code == 0, err
    recs = read_jsonl(out)
    assert [r["index"] for r in recs] == [0, 1, 2]
    tok = models["tok"]
    assert all(len(r["output_ids"]) == 9 for r in recs)
    assert all(r["text"] == tok.decode(r["output_ids"]) for r in recs)
    # In input order, and lossless: each record is AR decoding of ITS prompt.
    target = load_target(models["target"])
    prompts = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    ar, _ = Engine(target, None, Policy.ar(), batch_size=1, max_seq=64, compile=False).generate(prompts, 9)
    assert [r["output_ids"] for r in recs] == ar


def test_stats_json_reports_the_run(models, capsys, tmp_path):
    out, stats = tmp_path / "out.jsonl", tmp_path / "stats.json"
    code, _, err = cli(capsys, *base(models, "--drafter", models["drafter"], "--policy", "dcut",
                                     "--cost-table", models["table"], "--batch-size", "2",
                                     "--max-new-tokens", "12", "--output", out, "--stats", stats,
                                     *[a for t in TEXTS for a in ("--prompt", t)]))
    assert code == 0, err
    s = json.loads(stats.read_text())
    for key in ("policy", "batch_size", "requests", "generated_tokens", "decode_seconds",
                "tokens_per_second", "tau", "keep_ratio", "rho_histogram", "steps"):
        assert key in s, key
    assert s["policy"] == "dcut" and s["batch_size"] == 2 and s["requests"] == 3
    assert s["generated_tokens"] == sum(len(r["output_ids"]) for r in read_jsonl(out)) == 36
    assert s["decode_seconds"] > 0 and s["tokens_per_second"] > 0
    assert s["tau"] >= 1 and 0 <= s["keep_ratio"] <= 1
    assert sum(s["rho_histogram"].values()) == s["steps"] > 0
    assert {float(k) for k in s["rho_histogram"]} <= set(GRID)


def test_prompts_file_mixes_text_and_token_ids(models, capsys, tmp_path):
    ids = [5, 17, 42, 99, 3]
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": TEXTS[0]}) + "\n\n" + json.dumps({"input_ids": ids}) + "\n"
                    + json.dumps({"prompt": TEXTS[2]}) + "\n")
    out, stats = tmp_path / "out.jsonl", tmp_path / "stats.json"
    code, _, err = cli(capsys, *base(models, "--policy", "ar", "--prompts", path, "--batch-size", "2",
                                     "--max-new-tokens", "6", "--output", out, "--stats", stats))
    assert code == 0, err
    recs = read_jsonl(out)
    tok = models["tok"]
    prompts = [tok.encode(TEXTS[0], add_special_tokens=False), ids, tok.encode(TEXTS[2], add_special_tokens=False)]
    target = load_target(models["target"])
    ar, _ = Engine(target, None, Policy.ar(), batch_size=1, max_seq=64, compile=False).generate(prompts, 6)
    assert [r["index"] for r in recs] == [0, 1, 2]
    assert [r["output_ids"] for r in recs] == ar
    s = json.loads(stats.read_text())
    assert s["policy"] == "ar" and s["requests"] == 3 and s["tau"] == 1.0


def test_every_policy_writes_the_same_tokens(models, capsys, tmp_path):
    """Through the CLI too, the policies differ in speed only (greedy)."""
    runs = {}
    for name, extra in {"ar": [], "full": [], "static": ["--rho", "0.25"],
                        "dcut": ["--cost-table", models["table"]]}.items():
        out = tmp_path / f"{name}.jsonl"
        drafter = [] if name == "ar" else ["--drafter", models["drafter"]]
        code, _, err = cli(capsys, *base(models, *drafter, "--policy", name, *extra, "--batch-size", "2",
                                         "--max-new-tokens", "10", "--output", out,
                                         *[a for t in TEXTS for a in ("--prompt", t)]))
        assert code == 0, err
        runs[name] = [r["output_ids"] for r in read_jsonl(out)]
    assert runs["full"] == runs["static"] == runs["dcut"] == runs["ar"]


def test_without_quiet_prints_completions_and_a_summary_table(models, capsys):
    code, out, err = cli(capsys, "--target", models["target"], "--no-compile", "--policy", "ar",
                         "--prompt", TEXTS[0], "--max-new-tokens", "4")
    assert code == 0, err
    assert "minidcut.generate" in out and "tau" in out and TEXTS[0].strip() in out


def assert_one_line_error(code, err, *needles):
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])


def bad_jsonl(tmp_path, text: str) -> Path:
    p = tmp_path / "bad.jsonl"
    p.write_text(text)
    return p


def bytes_file(tmp_path, data: bytes) -> Path:
    p = tmp_path / "bad.jsonl"
    p.write_bytes(data)
    return p


# name -> (argv given the fixture and tmp_path, words the message must contain)
BAD_INPUT = {
    "missing_target_dir": (lambda m, t: ["--target", t / "nope", "--policy", "ar", "--no-compile",
                                         "--quiet", "--prompt", "x"], ["nope"]),
    "rho_above_1": (lambda m, t: base(m, "--drafter", m["drafter"], "--policy", "static", "--rho", "1.5",
                                      "--prompt", "x"), ["--rho", "1.5"]),
    "rho_below_0": (lambda m, t: base(m, "--drafter", m["drafter"], "--policy", "static", "--rho", "-0.1",
                                      "--prompt", "x"), ["--rho"]),
    "static_without_rho": (lambda m, t: base(m, "--drafter", m["drafter"], "--policy", "static",
                                             "--prompt", "x"), ["--rho"]),
    "drafting_policy_without_drafter": (lambda m, t: base(m, "--policy", "full", "--prompt", "x"),
                                        ["--drafter"]),
    "empty_prompt": (lambda m, t: base(m, "--policy", "ar", "--prompt", ""), ["empty"]),
    "empty_input_ids": (lambda m, t: base(m, "--policy", "ar", "--prompts",
                                          bad_jsonl(t, '{"input_ids": []}\n')), ["empty"]),
    "prompt_plus_new_tokens_beyond_context": (lambda m, t: base(m, "--policy", "ar", "--prompt", "x",
                                                                "--max-new-tokens", "600"), ["512"]),
    "drafter_hidden_size_mismatch": (lambda m, t: base(m, "--drafter", m["drafter_h32"], "--policy", "full",
                                                       "--prompt", "x"), ["hidden_size"]),
    "drafter_vocab_mismatch": (lambda m, t: base(m, "--drafter", m["drafter_v"], "--policy", "full",
                                                 "--prompt", "x"), ["vocab"]),
    "malformed_jsonl_line": (lambda m, t: base(m, "--policy", "ar", "--prompts",
                                               bad_jsonl(t, '{"prompt": "ok"}\n{"prompt": \n')), [":2:"]),
    "jsonl_line_without_prompt": (lambda m, t: base(m, "--policy", "ar", "--prompts",
                                                    bad_jsonl(t, '{"text": "x"}\n')), [":1:"]),
    "missing_prompts_file": (lambda m, t: base(m, "--policy", "ar", "--prompts", t / "none.jsonl"),
                             ["none.jsonl"]),
    "token_id_outside_vocab": (lambda m, t: base(m, "--policy", "ar", "--prompts",
                                                 bad_jsonl(t, '{"input_ids": [1, 100000]}\n')), ["100000"]),
    "batch_size_0": (lambda m, t: base(m, "--policy", "ar", "--prompt", "x", "--batch-size", "0"),
                     ["--batch-size"]),
    "negative_temperature": (lambda m, t: base(m, "--policy", "ar", "--prompt", "x", "--temperature", "-1"),
                             ["--temperature"]),
    "max_new_tokens_0": (lambda m, t: base(m, "--policy", "ar", "--prompt", "x", "--max-new-tokens", "0"),
                         ["--max-new-tokens"]),
    "max_new_tokens_negative": (lambda m, t: base(m, "--policy", "ar", "--prompt", "x", "--max-new-tokens", "-1"),
                                ["--max-new-tokens"]),
    "threads_0": (lambda m, t: base(m, "--policy", "ar", "--prompt", "x", "--threads", "0"), ["--threads"]),
    "device_tpu": (lambda m, t: base(m, "--policy", "ar", "--prompt", "x", "--device", "tpu"), ["tpu"]),
    "device_mps": (lambda m, t: base(m, "--policy", "ar", "--prompt", "x", "--device", "mps"), ["mps"]),
    "device_meta": (lambda m, t: base(m, "--policy", "ar", "--prompt", "x", "--device", "meta"), ["meta"]),
    # The target is the first thing a run needs: a missing one is named before a missing drafter.
    "missing_target_before_missing_drafter": (lambda m, t: ["--target", t / "nope", "--policy", "dcut",
                                                            "--prompt", "x"], ["--target", "nope"]),
    "rho_under_dcut": (lambda m, t: base(m, "--drafter", m["drafter"], "--policy", "dcut", "--rho", "0.5",
                                         "--prompt", "x"), ["--rho", "static"]),
    "non_utf8_prompts_file": (lambda m, t: base(m, "--policy", "ar", "--prompts",
                                                bytes_file(t, b'{"prompt": "a"}\n{"prompt": "\xff\xfe"}\n')),
                              ["bad.jsonl:2", "UTF-8"]),
    "token_id_outside_vocab_names_the_line": (lambda m, t: base(m, "--policy", "ar", "--prompts",
                                                                bad_jsonl(t, '{"prompt": "a"}\n{"input_ids": [1, -3]}\n')),
                                              ["bad.jsonl:2", "-3"]),
    "too_long_prompt_mentions_the_draft_block": (lambda m, t: base(m, "--drafter", m["drafter"], "--policy", "full",
                                                                   "--prompt", "x", "--max-new-tokens", "500"),
                                                 ["draft block", "512"]),
    "chat_without_chat_template": (lambda m, t: base(m, "--policy", "ar", "--prompt", "x", "--chat"),
                                   ["--chat", "chat template"]),
    "output_is_a_directory": (lambda m, t: base(m, "--policy", "ar", "--prompt", "x", "--output", t),
                              ["--output", "directory"]),
    "output_cannot_be_written": (lambda m, t: base(m, "--policy", "ar", "--prompt", "x", "--output",
                                                   "/proc/self/out.jsonl"), ["--output", "cannot be written"]),
    "messages_line_without_chat": (lambda m, t: base(m, "--policy", "ar", "--prompts",
                                                     bad_jsonl(t, '{"messages": [{"role": "user", "content": "hi"}]}\n')),
                                   [":1", "--chat"]),
    "unknown_dtype": (lambda m, t: base(m, "--policy", "ar", "--prompt", "x", "--dtype", "float64"),
                      ["float64"]),
    "rho_grid_outside_0_1": (lambda m, t: base(m, "--drafter", m["drafter"], "--policy", "dcut", "--prompt", "x",
                                               "--rhos", "0,2", "--cost-table", m["table"]), ["0,2"]),
    "missing_drafter_dir": (lambda m, t: base(m, "--drafter", t / "nodrafter", "--policy", "full",
                                              "--prompt", "x"), ["nodrafter"]),
    "text_prompt_without_tokenizer": (lambda m, t: ["--target", m["target_notok"], "--no-compile", "--quiet",
                                                    "--policy", "ar", "--prompt", "x"], ["tokenizer"]),
    # An empty prompt file is a mistake; falling back to the built-in demo prompts hides it.
    "prompts_file_without_prompts": (lambda m, t: base(m, "--policy", "ar", "--max-new-tokens", "2",
                                                       "--prompts", bad_jsonl(t, "\n\n")), ["bad.jsonl"]),
    # Found out before the run, not by a traceback after it.
    "output_in_missing_directory": (lambda m, t: base(m, "--policy", "ar", "--prompt", "x", "--max-new-tokens", "2",
                                                      "--output", t / "nodir" / "out.jsonl"), ["nodir"]),
    "stats_in_missing_directory": (lambda m, t: base(m, "--policy", "ar", "--prompt", "x", "--max-new-tokens", "2",
                                                     "--stats", t / "nodir" / "stats.json"), ["nodir"]),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_error_line_and_exit_2(models, capsys, tmp_path, case):
    argv, needles = BAD_INPUT[case]
    code, out, err = cli(capsys, *argv(models, tmp_path))
    assert_one_line_error(code, err, *needles)
    assert out == ""


def test_unknown_policy_is_a_usage_error(models, capsys):
    code, _, err = cli(capsys, *base(models, "--policy", "eagle", "--prompt", "x"))
    assert code == 2
    assert "invalid choice" in err and "eagle" in err and "Traceback" not in err


def test_module_entry_point_exits_2_with_one_error_line(models):
    """`python -m minidcut.generate` as a user runs it: the status of main() is the process's."""
    done = subprocess.run([sys.executable, "-m", "minidcut.generate", *map(str, base(
        models, "--drafter", models["drafter"], "--policy", "static", "--rho", "2", "--prompt", "x"))],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert_one_line_error(done.returncode, done.stderr, "--rho")


def test_a_corrupt_cost_table_is_ignored_with_one_line_and_replaced(models, capsys, tmp_path):
    table = tmp_path / "table.json"
    table.write_text('{"batch_sizes": [1]}')
    code, out, err = cli(capsys, *base(models, "--drafter", models["drafter"], "--policy", "dcut", "--prompt", "x",
                                       "--max-new-tokens", "4", "--cost-table", table, "--batch-size", "2"))
    assert code == 0, err
    assert "corrupt" in out + err and len([x for x in (out + err).splitlines() if "not used" in x]) == 1
    assert CostTable.load(table).batch_sizes == [1]


def test_a_named_cost_table_that_does_not_exist_is_measured_and_saved_there(models, capsys, tmp_path):
    table = tmp_path / "new_table.json"
    code, _, err = cli(capsys, *base(models, "--drafter", models["drafter"], "--policy", "dcut", "--prompt", "x",
                                     "--max-new-tokens", "4", "--cost-table", table, "--batch-size", "2"))
    assert code == 0, err
    assert CostTable.load(table).batch_sizes == [1]  # one request: only the 1-row bucket is needed


def test_a_write_error_mid_run_is_one_line(models, capsys):
    code, _, err = cli(capsys, *base(models, "--policy", "ar", "--prompt", "x", "--max-new-tokens", "2",
                                     "--output", "/dev/full"))
    assert_one_line_error(code, err, "--output", "/dev/full")


def test_chat_prompts_go_under_the_chat_template(models, capsys, tmp_path):
    """--chat: a text prompt becomes a user message, a messages line is used as it is; both then
    generate what AR generates from the templated ids."""
    target = tmp_path / "chat_target"
    shutil.copytree(models["target"], target)
    tok = models["tok"]
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
    tok.save_pretrained(target)
    prompts = tmp_path / "chat.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add"}) + "\n" + json.dumps(
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "class"}]}) + "\n")
    out = tmp_path / "out.jsonl"
    code, _, err = cli(capsys, "--target", target, "--no-compile", "--quiet", "--threads", "1", "--policy", "ar",
                       "--chat", "--prompts", prompts, "--max-new-tokens", "5", "--output", out)
    assert code == 0, err
    ids = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in (
        [{"role": "user", "content": "def add"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "class"}])]
    assert ids[0] == "<user>def add\n<assistant>"
    expect = [tok.encode(t, add_special_tokens=False) for t in ids]
    ar, _ = Engine(load_target(target), None, Policy.ar(), batch_size=1, max_seq=64,
                   compile=False).generate(expect, 5)
    assert [r["output_ids"] for r in read_jsonl(out)] == ar


def test_ctrl_c_keeps_finished_requests_and_says_so_in_one_line(models, tmp_path):
    """Requests are written as they finish; SIGINT stops the run with exit status 130 and one line
    that counts what is on disk."""
    prompts = tmp_path / "many.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def f{i}(x):\n"}) + "\n" for i in range(400)))
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "minidcut.generate", *map(str, base(
        models, "--policy", "ar", "--prompts", prompts, "--batch-size", "1", "--max-new-tokens", "40",
        "--output", out))], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # a suite run in the background
    #     (`pytest &`) starts with SIGINT ignored, and a child that inherits that never sees Ctrl-C
    deadline = time.monotonic() + 300  # a child that never writes fails the test, not the CI run
    while proc.poll() is None and (not out.is_file() or len(out.read_text().splitlines()) < 3):
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("no three requests on disk after 300 s")
        time.sleep(0.2)  # until three requests are on disk, however long the machine takes
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    lines = read_jsonl(out)
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == [f"interrupted: {len(lines)} of 400 requests written to {out}"]
    assert 3 <= len(lines) < 400 and [r["index"] for r in lines] == list(range(len(lines)))


def test_prompts_files_may_be_gzipped_and_a_messages_line_keeps_its_conversation(models, tmp_path):
    import gzip

    from minidcut import cli as cli_mod
    tok = models["tok"]
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
    lines = [{"prompt": "def add"}, {"prompt": "class", "messages": [{"role": "user", "content": "a"},
                                                                      {"role": "assistant", "content": "b"},
                                                                      {"role": "user", "content": "class"}]}]
    path = tmp_path / "p.jsonl.gz"
    path.write_bytes(gzip.compress("".join(json.dumps(x) + "\n" for x in lines).encode()))
    ids, names = cli_mod.read_prompts(str(path), None, tok, chat=True)
    assert names == [f"{path}:1", f"{path}:2"]
    assert tok.decode(ids[1]) == "<user>a\n<assistant>b\n<user>class\n<assistant>"  # the follow-up, in context
    (tmp_path / "bad.gz").write_bytes(b"not gzip")
    with pytest.raises(cli_mod.UserError, match="not a gzip file"):
        cli_mod.read_prompts(str(tmp_path / "bad.gz"), None, tok)


def test_a_dcut_run_says_what_it_did_and_why_and_compares_with_ar_on_request(models, capsys, tmp_path):
    code, out, err = cli(capsys, "--target", models["target"], "--drafter", models["drafter"], "--no-compile",
                         "--threads", "1", "--prompt", "def add", "--prompt", "class", "--max-new-tokens", "24",
                         "--batch-size", "2", "--cost-table", tmp_path / "t.json", "--compare-ar")
    assert code == 0, err
    text = " ".join((out + err).split())  # rich wraps long lines
    assert "rho per step: " in text and "cost table at bucket 2 (" in text and "AR steps" in text
    assert "measured missing cost-table rows in " in text and str(tmp_path / "t.json") in text
    assert re.search(r"AR in this process: [\d.]+ tok/s; dcut is [\d.]+x AR", text)
    assert "--compare-ar: the same tokens as AR decoding in all 2 requests" in text


def test_compare_ar_says_where_outputs_first_differ_and_what_that_means_at_the_dtype():
    from minidcut.generate import compare_outputs
    names = ["--prompt 1", "--prompt 2"]
    assert "the same tokens" in compare_outputs([[1, 2], [3]], [[1, 2], [3]], torch.float32, names)
    said = compare_outputs([[1, 2, 5], [3]], [[1, 2, 4], [3]], torch.bfloat16, names)
    assert "1 of 2 requests differ" in said and "--prompt 1, generated token 2: 5 here, 4 from AR" in said
    assert "bfloat16" in said and "near-ties" in said and "bug" not in said
    assert "this is a bug" in compare_outputs([[1]], [[2]], torch.float32, names[:1])
    assert "token 1: end here, 7 from AR" in compare_outputs([[1]], [[1, 7]], torch.bfloat16, names[:1])


def test_chat_takes_the_templates_arguments_with_thinking_off_by_default(models):
    """Qwen3's template thinks unless enable_thinking is false, and z-lab's drafters were trained without
    thinking: --chat turns it off unless asked; --chat KEY=VALUE passes any argument; a malformed value
    is one line of error."""
    from minidcut import cli as cli_mod
    tok = models["tok"]
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
                         "{% if enable_thinking is not defined or enable_thinking %}<think>{% endif %}{{ tag or '' }}")
    text = lambda chat: tok.decode(cli_mod.read_prompts(None, ["hi"], tok, cli_mod.parse_chat(chat))[0][0])  # noqa: E731
    assert text("") == "<user>hi<assistant>"
    assert text("enable_thinking=true") == "<user>hi<assistant><think>"
    assert text('enable_thinking=false, tag="x"') == "<user>hi<assistant>x"
    assert text("tag=plain") == "<user>hi<assistant>plain"
    assert cli_mod.parse_chat(None) is None
    for bad in ("enable_thinking", "=1", "a b=1"):
        with pytest.raises(cli_mod.UserError, match="expected KEY=VALUE"):
            cli_mod.parse_chat(bad)


def test_a_compiled_run_says_how_many_graphs_come_first_and_lists_each_it_compiled(models, capsys, tmp_path,
                                                                                  monkeypatch, eager_backend):
    """--compile (dynamo with the eager backend: the same graphs, keys and announcements, without
    inductor's minutes): before the first step one line says how many graphs compile now (the first
    bucket's) and how many more at most; four requests of equal length never leave bucket 4, so the
    smaller buckets' graphs are never compiled; the summary and --stats list each graph with its seconds."""
    monkeypatch.setattr("minidcut.graphs.COMPILE_CACHE", tmp_path)  # its seconds-per-graph record
    torch._dynamo.reset()
    stats = tmp_path / "stats.json"
    code, out, err = cli(capsys, "--target", models["target"], "--drafter", models["drafter"], "--compile",
                         "--policy", "full", "--threads", "1", "--batch-size", "4", "--max-new-tokens", "6",
                         "--ignore-eos", "--stats", stats, *sum((["--prompt", t] for t in TEXTS + ["x = 1\n"]), []))
    torch._dynamo.reset()
    assert code == 0, err
    text = " ".join(out.split())
    assert "compiling 2 graphs before the first step (no earlier compile of these models here" in text
    assert "up to 4 more, each when the run first reaches its bucket" in text
    listed = json.loads(stats.read_text())["compiled_graphs"]
    assert sorted(listed) == ["draft graph b=4", "verify graph b=4 K=60"] and all(s > 0 for s in listed.values())
    assert re.search(r"compiled 2 graphs in \d+ s: draft graph b=4 [\d.]+ s, verify graph b=4 K=60 [\d.]+ s", text)
