"""tools/prompt_sources.py and tools/dedup.py on tiny sources they make: held-out prompts win over training
duplicates (exact and near), test-set overlaps are dropped, files are read by pinned blob id from a raw
copy or a git mirror, and the readers keep prompts only (MBPP's test split and answers left out)."""

import gzip
import json
import random
import subprocess

import pytest

from tools import prompt_sources as ps
from tools.dedup import NearDup


def test_near_dup_keeps_the_first_and_catches_exact_and_near_repeats():
    d = NearDup()
    assert d.add("Write a poem about the sea at night, with rhymes.") == ("kept", 0)
    assert d.add("write a POEM about the sea at night -- with rhymes") == ("exact", 0)
    assert d.add("Please write a poem about the sea at night, with rhymes.")[0] == "near"
    assert d.add("Explain how a bicycle stays upright while it moves.") == ("kept", 1)


def test_domains_are_guessed_in_order():
    assert ps.guess_domain("Write a Python function that sums a list.") == "code"
    assert ps.guess_domain("Write a poem about autumn.") == "writing"
    assert ps.guess_domain("Calculate the area of a circle of radius 3.") == "math"
    assert ps.guess_domain("Why is the sky blue?") == "chat"
    assert ps.guess_domain("Write a limerick about code.", [d for d in ps.DOMAINS if d != "code"]) == "writing"


def test_readers_keep_prompts_only():
    mbpp = "\n".join(json.dumps({"task_id": i, "text": f"Write a function number {i}.",
                                 "test_list": [f"assert f({i})"]}) for i in (1, 11, 510, 511)).encode()
    assert [x["prompt"].split("\n")[0] for x in ps.read_mbpp_heldout(mbpp)] == \
        ["Write a function number 1.", "Write a function number 511."]  # 11-510: the test split
    gsm = json.dumps({"question": "Q?", "answer": "A secret answer #### 4"}).encode()
    assert ps.read_gsm8k(gsm) == [{"prompt": "Q?", "domain": "math"}]
    svamp = json.dumps([{"Body": "Each pack costs 76 dollars", "Question": "How much for two packs?"}]).encode()
    assert ps.read_svamp(svamp)[0]["prompt"] == "Each pack costs 76 dollars, how much for two packs?"
    head = "toolformer: enabled\ntoolformer access: "
    tool = [{"instruction": head + "python\nA shell.\npython(x)\nAdd 2 and 3.", "input": ""},
            {"instruction": head + "weather\nAPI.\nweather(q)\nRain in Oslo?", "input": ""}]
    assert ps.read_toolformer(json.dumps(tool).encode()) == [{"prompt": "Add 2 and 3.", "domain": "code"}]


def msg(role, text, replies=(), **kw):
    return {"role": role, "text": text, "lang": "en", "review_result": True, "replies": list(replies), **kw}


QUESTION = "How do the tides of the oceans work, and why do they differ so much between the coasts of the world?"
TREE = {"prompt": msg("prompter", QUESTION, [
    msg("assistant", "The moon pulls the water.", [msg("prompter", "Why two a day?"),
                                                  msg("prompter", "Made up.", synthetic=True)]),
    msg("assistant", "The sun and the moon pull the water.", [msg("prompter", "Why two a day?")])])}


def test_trees_give_first_turns_and_follow_ups_with_their_context():
    items = ps.read_oasst_trees((json.dumps(TREE) + "\n").encode())
    assert [x["prompt"] for x in items] == [QUESTION, "Why two a day?", "Why two a day?"]
    assert "messages" not in items[0]
    assert [m["role"] for m in items[1]["messages"]] == ["user", "assistant", "user"]


@pytest.fixture
def sources(tmp_path, monkeypatch):
    """Two tiny sources, one held out, one for training, as raw files and as a bare git mirror."""
    train_rows = [{"question": "How many legs do three spiders have in total together?"},
                  # an exact (same words) and a near repeat of the held-out prompt
                  {"question": "write a HAIKU about the moon rising over a quiet lake in the mountains at night"},
                  {"question": "Please write a haiku about the moon rising over a quiet lake in the mountains at "
                               "night."},
                  {"question": "Natalia sold clips to forty eight of her friends in April and then she sold half"},
                  {"question": "What is the capital of Peru, and what is it known for?"}]
    held = [{"question": "Write a haiku about the moon rising over a quiet lake in the mountains at night."}]
    files = {"o/train/t.jsonl": "\n".join(map(json.dumps, train_rows)).encode(),
             "o/held/h.jsonl": json.dumps(held[0]).encode()}
    raw = tmp_path / "raw"
    for path, data in files.items():
        (raw / path).parent.mkdir(parents=True, exist_ok=True)
        (raw / path).write_bytes(data)
    mirror = tmp_path / "mirror"
    for repo in ("o+train", "o+held"):
        subprocess.run(["git", "init", "-q", "--bare", str(mirror / repo / "repo")], check=True, timeout=60)
    for path in files:
        git_dir = mirror / ("o+" + path.split("/")[1]) / "repo"
        subprocess.run(["git", "--git-dir", str(git_dir), "hash-object", "-w", str(raw / path)], check=True,
                       capture_output=True, timeout=60)
    read = ps.read_gsm8k
    monkeypatch.setattr(ps, "SOURCES", [
        ps.Source("tiny-train", "o/train", "t.jsonl", ps.git_blob_id(files["o/train/t.jsonl"]), "MIT", "train", read),
        ps.Source("tiny-held", "o/held", "h.jsonl", ps.git_blob_id(files["o/held/h.jsonl"]), "MIT", "heldout", read)])
    monkeypatch.setattr(ps, "handwritten", lambda: [dict(ps.item("Why do cats purr?", "chat"), source="handwritten")])
    return raw, mirror


def test_held_out_wins_duplicates_and_test_overlaps_are_dropped(sources, tmp_path, capsys):
    raw, mirror = sources
    test = tmp_path / "gsm_test.jsonl"
    test.write_text(json.dumps({"question": "Natalia sold clips to forty eight of her friends in April and then "
                                            "she sold half as many clips in May"}) + "\n")
    train, heldout = tmp_path / "train.jsonl.gz", tmp_path / "heldout.jsonl"
    assert ps.main(["--raw", str(raw), "--train", str(train), "--heldout", str(heldout), "--exclude", str(test)]) == 0
    log = capsys.readouterr().out
    assert "tiny-train: raw 5, repeats_heldout 2, test_overlap 1, train 2" in log
    rows = [json.loads(line) for line in gzip.decompress(train.read_bytes()).decode().splitlines()]
    assert sorted(r["prompt"] for r in rows) == ["How many legs do three spiders have in total together?",
                                                 "What is the capital of Peru, and what is it known for?"]
    assert all(set(r) == {"prompt", "source", "domain"} for r in rows)
    held = [json.loads(line) for line in heldout.read_text().splitlines()]
    assert [(r["source"], r["domain"]) for r in held] == [("tiny-held", "math"), ("handwritten", "chat")]
    # the same from the git mirror, byte for byte
    train2 = tmp_path / "train2.jsonl.gz"
    ps.main(["--mirror", str(mirror), "--train", str(train2), "--exclude", str(test)])
    assert train2.read_bytes() == train.read_bytes()


def test_a_raw_file_that_is_not_the_pinned_blob_is_refused(sources):
    raw, _ = sources
    (raw / "o/train/t.jsonl").write_bytes(b'{"question": "changed"}\n')
    with pytest.raises(SystemExit, match=r"tiny-train: .*t\.jsonl is blob [0-9a-f]{40}, not the pinned"):
        ps.main(["--raw", str(raw)])


def test_interleave_balances_the_first_prompts():
    items = [{"domain": "math"}] * 6 + [{"domain": "chat"}] * 2 + [{"domain": "code"}] * 2
    order = [x["domain"] for x in ps.interleave(items, random.Random(0))]
    assert order[:6] == ["chat", "code", "math"] * 2 and order[6:] == ["math"] * 4


def test_a_short_follow_up_to_a_long_question_is_kept(tmp_path, monkeypatch):
    data = (json.dumps(TREE) + "\n").encode()
    (tmp_path / "o/t").mkdir(parents=True)
    (tmp_path / "o/t/tree.jsonl").write_bytes(data)
    monkeypatch.setattr(ps, "SOURCES", [ps.Source("tree", "o/t", "tree.jsonl", ps.git_blob_id(data), "MIT", "train",
                                                  ps.read_oasst_trees)])
    monkeypatch.setattr(ps, "handwritten", lambda: [])
    train, _, counts = ps.build(None, tmp_path, [], log=lambda line: None)
    assert len(train) == 3 and counts["tree"] == {"raw": 3, "train": 3}  # two contexts: two prompts
