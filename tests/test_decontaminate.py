"""tools/decontaminate.py: a prompt file that shares a 13-word run with a test set is refused (whatever
the case, punctuation or file format), one that shares only 12 words passes, and a self-distilled .pt
file is checked through its tokenizer."""

import gzip
import json
from pathlib import Path

import pytest
import torch

from minidcut import load_tokenizer
from tools import decontaminate

ROOT = Path(__file__).resolve().parent.parent
TEST_TEXT = ("Natalia sold clips to forty eight of her friends in April and then she sold half as many "
             "clips in May")  # 21 words


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run(capsys, *argv):
    """(exit status, the one line printed)."""
    try:
        status = decontaminate.main([str(a) for a in argv])
        return status, capsys.readouterr().out.strip()
    except SystemExit as e:
        return 1, str(e.code)


@pytest.fixture
def test_set(tmp_path):
    return write_jsonl(tmp_path / "gsm_test.jsonl", [{"question": "What is 2 + 2?", "answer": "4"},
                                                     {"question": TEST_TEXT, "answer": "72"}])


def test_a_shared_13_word_run_is_refused_naming_the_line_and_the_test_set(tmp_path, test_set, capsys):
    words = TEST_TEXT.split()
    leaked = "Please solve: " + " ".join(words[3:16]).upper().replace(" ", ",  ") + "!"  # 13 words, reformatted
    data = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "Write a poem about the sea."},
                                                  {"prompt": "Hi", "messages": [{"role": "user", "content": leaked}]}])
    status, line = run(capsys, data, "--test", test_set)
    assert status == 1 and "\n" not in line
    assert f"{data}:2 shares a 13-word run with {test_set}:2" in line and "1 of 2 lines" in line


def test_twelve_shared_words_pass_and_numbers_alone_do_not_count(tmp_path, test_set, capsys):
    words = TEST_TEXT.split()
    data = write_jsonl(tmp_path / "train.jsonl", [{"prompt": " ".join(words[:12]) + " bananas and more words here"},
                                                  {"prompt": " ".join(str(i) for i in range(1, 20))}])
    numbers = write_jsonl(tmp_path / "numbers.jsonl", [{"text": " ".join(str(i) for i in range(1, 20))}])
    status, line = run(capsys, data, "--test", test_set, "--test", numbers)
    assert status == 0 and line.startswith("clean: 2 lines")
    assert run(capsys, data, "--test", test_set, "--n", "12")[0] == 1  # the same 12 words with --n 12


def test_json_and_gzip_test_sets_and_gzip_data(tmp_path, capsys):
    (tmp_path / "eval.json").write_text(json.dumps([{"instruction": "short"}, {"instruction": TEST_TEXT}]))
    gz = tmp_path / "eval.jsonl.gz"
    gz.write_bytes(gzip.compress((json.dumps({"prompt": TEST_TEXT}) + "\n").encode()))
    data = tmp_path / "train.jsonl.gz"
    data.write_bytes(gzip.compress((json.dumps({"prompt": "x"}) + "\n" + json.dumps({"prompt": TEST_TEXT})).encode()))
    status, line = run(capsys, data, "--test", tmp_path / "eval.json")
    assert status == 1 and f"{data}:2" in line and "eval.json:item 2" in line
    status, line = run(capsys, data, "--test", gz)
    assert status == 1 and f"{gz}:1" in line
    missing = tmp_path / "missing.jsonl"
    assert run(capsys, missing, "--test", gz) == (1, f"error: {missing} not found")


def test_a_distilled_data_file_is_decoded_and_checked(tmp_path, test_set, capsys):
    target = ROOT / "models" / "llama-stdlib-4m"
    tok = load_tokenizer(target)
    prompt, answer = tok.encode("Explain this.\n"), tok.encode(TEST_TEXT)
    data = tmp_path / "distill.pt"
    torch.save({"sequences": [prompt + answer], "starts": [len(prompt)], "meta": {"target": str(target)}}, data)
    assert run(capsys, data, "--test", test_set)[0] == 0  # the prompt part is clean
    status, line = run(capsys, data, "--test", test_set, "--answers")
    assert status == 1 and f"{data}:sequence 1" in line
