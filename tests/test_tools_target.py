"""tools/: corpus split, held-out prompts, tokenizer and target training, end to end on a tiny corpus.

The tools run as subprocesses (`python -m tools.<name>` from the repository root), as a user runs them.
"""

import json
import math
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
STDLIB = Path(sysconfig.get_paths()["stdlib"])
TRAIN_FILES = ["textwrap.py", "string.py", "shlex.py", "fnmatch.py", "heapq.py", "bisect.py"]
HELDOUT_FILES = ["venv/__init__.py", "unittest/loader.py"]  # held out by the sha256 rule of tools/corpus.py


def make_corpus(root: Path) -> Path:
    """A few stdlib files under their own relative paths, so the split rule applies as on the stdlib."""
    for rel in TRAIN_FILES + HELDOUT_FILES:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(STDLIB / rel, root / rel)
    return root


def run_tool(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_train_target_writes_a_loadable_bf16_hf_directory_and_lowers_the_loss(tmp_path):
    corpus, out = make_corpus(tmp_path / "corpus"), tmp_path / "model"
    run_tool("tools.train_target", "--arch", "llama", "--corpus", str(corpus), "--out", str(out),
             "--vocab", "512", "--steps", "30", "--hidden", "64", "--layers", "2", "--heads", "4",
             "--kv-heads", "2", "--head-dim", "16", "--intermediate", "128", "--seq-len", "64",
             "--batch-size", "4", "--log-every", "10", "--ckpt-every", "10", "--eval-seqs", "8")

    log = json.loads((out / "train_log.json").read_text())
    curve = list(log["loss_curve"].values())
    assert curve[-1] < curve[0] - 0.3
    assert log["corpus_files"] == {"train": len(TRAIN_FILES), "heldout": len(HELDOUT_FILES)}
    assert 0 < log["heldout_loss"] < math.log(512)
    assert log["command"].startswith("python -m tools.train_target --arch llama")
    assert not (out / "checkpoint.pt").exists()

    with safe_open(out / "model.safetensors", "pt") as f:
        assert "model.embed_tokens.weight" in f.keys() and "lm_head.weight" not in f.keys()  # tied
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 0

    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == 512 and tok.convert_ids_to_tokens([0, 1]) == ["<|endoftext|>", "<|mask|>"]
    source = (corpus / "venv/__init__.py").read_text()
    assert tok.decode(tok(source)["input_ids"]) == source

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16 and model.config.eos_token_id == 0
    ids = tok(source[:300], return_tensors="pt").input_ids  # [1, T]
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    assert loss < math.log(512)


def test_heldout_prompts_are_short_function_openings_from_heldout_files(tmp_path):
    corpus = make_corpus(tmp_path / "corpus")
    path = tmp_path / "prompts.jsonl"
    run_tool("tools.corpus", "--corpus", str(corpus), "--prompts", str(path))

    prompts = [json.loads(line)["prompt"] for line in path.read_text().splitlines()]
    heldout = "".join((corpus / rel).read_text() for rel in HELDOUT_FILES)
    assert len(prompts) >= 20
    for p in prompts:
        assert 40 <= len(p) <= 200 and p.startswith(("def ", "async def ")) and p.endswith("\n")
        assert p.splitlines()[0].strip() in heldout
