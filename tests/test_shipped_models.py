"""The shipped demo models: they load in transformers and in minidcut with the same logits, their
drafters load, they fit the size budget, and the default command runs end to end."""

import json
from pathlib import Path

import pytest
import torch
import transformers

from minidcut import load_pair, load_tokenizer
from minidcut.generate import main as generate_main
from minidcut.model import prefill_layout

MODELS = Path(__file__).resolve().parent.parent / "models"
PAIRS = [("llama-stdlib-4m", "llama-stdlib-4m-dflash"), ("qwen3moe-stdlib-2m", "qwen3moe-stdlib-2m-dflash")]


@pytest.mark.parametrize("target,drafter", PAIRS)
def test_shipped_target_matches_transformers_logits_in_fp32(target, drafter):
    t, d, _, _ = load_pair(MODELS / target, MODELS / drafter, "float32", "cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(MODELS / target, dtype=torch.float32).eval()
    tok = load_tokenizer(MODELS / target)
    ids = torch.tensor(tok.encode("def read_lines(path):\n    with open(path) as f:\n"))
    layout, _ = prefill_layout([0], [len(ids)], "cpu")
    with torch.no_grad():
        ours, _ = t(ids, layout)
        ref = hf(ids[None]).logits[0]
    assert (ours - ref).abs().max().item() <= 1e-4
    assert d.block_size == 16


def test_shipped_models_are_bf16_and_under_50_mb():
    total = 0
    for target, drafter in PAIRS:
        for name in (target, drafter):
            cfg = json.loads((MODELS / name / "config.json").read_text())
            assert cfg.get("torch_dtype", cfg.get("dtype")) == "bfloat16"
            total += (MODELS / name / "model.safetensors").stat().st_size
    assert total < 50 * 2**20


def test_default_command_completes_code_with_the_shipped_pair(tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    assert generate_main(["--no-compile", "--max-new-tokens", "16", "--output", str(out), "--quiet",
                          "--policy", "full"]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 4 and all(len(r["output_ids"]) > 0 and r["text"] for r in rows)


@pytest.mark.parametrize("target,drafter", PAIRS)
def test_each_demo_pair_runs_the_readme_command_and_equals_ar(target, drafter, tmp_path, capsys):
    """The README's command for each demo pair (generate with --target and --drafter), eager,
    fewer tokens: every request the same tokens as AR decoding in the same process, drafts accepted."""
    stats = tmp_path / "stats.json"
    assert generate_main(["--target", str(MODELS / target), "--drafter", str(MODELS / drafter), "--no-compile",
                          "--max-new-tokens", "24", "--threads", "1", "--cost-table", str(tmp_path / "t.json"),
                          "--policy", "full", "--stats", str(stats)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--compare-ar: the same tokens as AR decoding in all 4 requests" in text
    assert json.loads(stats.read_text())["tau"] > 1.5


def test_the_tracked_tree_stays_small_enough_for_a_device_call():
    """A device call carries the working tree (64 MiB at most); the tracked files keep well under it, at
    most 48 MiB, so a call from a clean checkout has room for what it carries besides."""
    import subprocess

    root = MODELS.parent
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, timeout=60)
    if listed.returncode != 0:
        pytest.fail("not a git checkout: the tree's size cannot be checked")
    files = [root / f for f in listed.stdout.decode().split("\0") if f]
    total = sum(f.stat().st_size for f in files if f.is_file())
    assert total <= 48 * 2**20, f"tracked files hold {total / 2**20:.1f} MiB"
