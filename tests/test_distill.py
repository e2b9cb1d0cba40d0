"""tools/distill.py: the target's own answers, greedy or (a share of them) sampled, written in resumable
chunks; a file made with other settings is refused instead of mixed."""

from __future__ import annotations

import json

import pytest
import torch

from minidcut import Engine, load_target
from tiny import make_tokenized_pair
from tools import distill


def test_greedy_and_sampled_answers_resume_and_refuse_other_settings(tmp_path, monkeypatch):
    target_dir, _ = make_tokenized_pair(tmp_path)
    prompts = [[5 + i, 9, 13, 17] for i in range(6)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in prompts))
    out = tmp_path / "data.pt"
    monkeypatch.setattr(distill, "CHUNK", 4)  # two chunks: the second resumes the file
    argv = ["--target", str(target_dir), "--prompts", str(tmp_path / "p.jsonl"), "--max-new-tokens", "6",
            "--batch-size", "4", "--sampled-share", "0.5", "--temperature", "1.0", "--out", str(out)]
    assert distill.main([*argv, "--limit", "4"]) == 0
    assert distill.main(argv) == 0
    data = torch.load(out)
    assert data["sampled"] == [True, False] * 3 and data["starts"] == [4] * 6
    greedy, _ = Engine(load_target(target_dir), None, batch_size=4, max_seq=32, eos_ids=None,
                       compile=False).generate(prompts, 6)
    for p, seq, sampled, ref in zip(prompts, data["sequences"], data["sampled"], greedy):
        assert seq[:4] == p
        if not sampled:
            assert seq[4:] == ref  # the greedy answers are the target's argmax path
    assert any(seq[4:] != ref for seq, s, ref in zip(data["sequences"], data["sampled"], greedy) if s)
    with pytest.raises(SystemExit, match="sampled_share"):
        distill.main([*argv[:-6], "--sampled-share", "0.25", "--temperature", "1.0", "--out", str(out)])
