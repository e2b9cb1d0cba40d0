"""tools/magpie.py: the prefix is the chat template up to the user's words, and the sampling loop keeps
questions of the steered domain that pass the filters, appends them with their seed and continues from
the file's last seed (the sampler is replaced by a canned one here; the demo target stands in)."""

import json
from pathlib import Path

import pytest

from minidcut import load_tokenizer
from tools import magpie

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ("{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\nDefault"
            "<|im_end|>\n{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CANNED = {0: ["Write a Python function that returns the sum of a list of numbers.",
              "Too short.",
              "Write a poem about the sea and the sky at night, please, with rhymes."],
          1: ["Write a Python function that returns the sum of a list of numbers!",
              "Write a Python function that reverses a string in place without copying it."],
          2: ["Explain how a JavaScript closure captures the variables around it, with code.",
              "Write a Python class for a bank account with deposit and withdraw methods."]}


@pytest.fixture
def target(tmp_path):
    """The demo target with a chat template."""
    demo = ROOT / "models" / "llama-stdlib-4m"
    out = tmp_path / "target"
    out.mkdir()
    for f in demo.iterdir():
        (out / f.name).symlink_to(f)
    (out / "tokenizer_config.json").unlink()
    cfg = json.loads((demo / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    return out


def test_the_prefix_ends_where_the_user_message_begins(target):
    tok = load_tokenizer(target)
    assert tok.decode(magpie.user_prefix(tok, None)) == "<|im_start|>system\nDefault<|im_end|>\n<|im_start|>user\n"
    assert tok.decode(magpie.user_prefix(tok, "Code.")).endswith("system\nCode.<|im_end|>\n<|im_start|>user\n")


def test_filters():
    assert magpie.acceptable("How do I sort a list of numbers in Python?")
    assert not magpie.acceptable("Sort this list.")  # under 8 words
    assert not magpie.acceptable("Как отсортировать список чисел в Python, быстро и просто?")  # no ASCII


def test_the_loop_keeps_its_domain_appends_and_resumes(target, tmp_path, monkeypatch):
    seeds = []

    def fake(target_model, tok, prefix, n, args, seed):
        seeds.append(seed)
        return CANNED[seed]
    monkeypatch.setattr(magpie, "sample_chunk", fake)
    against = tmp_path / "heldout.jsonl"
    against.write_text(json.dumps({"prompt": CANNED[2][1], "domain": "code"}) + "\n")
    out = tmp_path / "magpie.jsonl"
    common = ["--target", str(target), "--out", str(out), "--domain", "code", "--against", str(against)]
    assert magpie.main(common + ["--count", "2"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    # seed 0: the poem is not code, "Too short." too short; seed 1: a near repeat of seed 0's question
    assert [(r["prompt"], r["seed"], r["domain"]) for r in rows] == [(CANNED[0][0], 0, "code"),
                                                                     (CANNED[1][1], 1, "code")]
    assert magpie.main(common + ["--count", "3"]) == 0  # continues at seed 2; its second question is held out
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert seeds == [0, 1, 2] and len(rows) == 3 and rows[-1] == {
        "prompt": CANNED[2][0], "source": "magpie", "domain": "code", "seed": 2}
