"""tools/gpu_drafter.py end to end on the CPU at toy scale: the demo target travels as GGUF parts, every
stage runs through the same code as on a device, and a second run resumes instead of starting over."""

import hashlib
import json
import shutil
import tarfile

import numpy as np
import pytest
from safetensors.torch import load_file as load_torch

gguf = pytest.importorskip("gguf")

from minidcut import load_drafter, load_target  # noqa: E402
from tools import gpu_drafter, target_parts  # noqa: E402

DEMO = target_parts.ROOT / "models" / "llama-stdlib-4m"
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|endoftext|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def load_file(path):
    return {k: v.float().numpy() for k, v in load_torch(str(path)).items()}


NAMES = {v: k for k, v in target_parts.LLAMA_NAMES.items()}


def demo_as_gguf(path, hf_dir):
    """The demo target written as llama.cpp writes a llama GGUF (F32, q/k rows in its order), and its small
    files with a chat template and the source.json tools/get_smollm2.py would write."""
    cfg = json.loads((DEMO / "config.json").read_text())
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    tensors = load_file(DEMO / "model.safetensors")
    for name, x in tensors.items():
        x = x.astype(np.float32)
        if name == "model.embed_tokens.weight":
            key = "token_embd.weight"
        elif name == "model.norm.weight":
            key = "output_norm.weight"
        else:
            layer, rest = name.split(".")[2], name.split(".", 3)[3].removesuffix(".weight")
            key = f"blk.{layer}.{NAMES[rest]}.weight"
            if rest in ("self_attn.q_proj", "self_attn.k_proj"):  # llama.cpp's permute
                n = heads if rest.endswith("q_proj") else kv
                x = x.reshape(n, 2, x.shape[0] // n // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)
        w.add_tensor(key, np.ascontiguousarray(x))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    hf_dir.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy2(DEMO / f, hf_dir / f)
    (hf_dir / "chat_template.jinja").write_text(TEMPLATE)
    sha = {k: hashlib.sha256(v.astype(np.float32).tobytes()).hexdigest() for k, v in tensors.items()}
    (hf_dir / "source.json").write_text(json.dumps({"tensors_sha256": sha}))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu_drafter")
    demo_as_gguf(tmp / "t.gguf", tmp / "hf")
    stage = tmp / "stage"
    stage.mkdir()
    for d in target_parts.pack(tmp / "t.gguf", tmp / "hf", tmp / "parts", part_bytes=4 << 20):
        for f in d.iterdir():
            shutil.copy2(f, stage / f.name)
    heldout = tmp / "heldout.jsonl"
    heldout.write_text("".join((target_parts.ROOT / "models" / "prompts_mix_heldout.jsonl")
                               .read_text().splitlines(keepends=True)[::40]))
    argv = ["--stage", str(stage), "--out", str(tmp / "out"), "--work", str(tmp / "work"), "--device", "cpu",
            "--mix-limit", "20", "--heldout", str(heldout), "--magpie-seconds", "1", "--magpie-batch", "4",
            "--magpie-max-new-tokens", "12", "--answer-seconds", "1", "--batch-size", "8", "--max-new-tokens",
            "12", "--layers", "1,2", "--train-seconds", "3", "--train-batch", "4", "--mask-token", "<|mask|>",
            "--no-bf16", "--eval-new-tokens", "8"]
    assert gpu_drafter.main(argv) == 0
    return tmp, argv


def test_every_stage_runs_and_the_result_comes_back_in_parts(run):
    tmp, _ = run
    work = tmp / "work"
    for stage in gpu_drafter.STAGES:
        assert json.loads((work / f"{stage}.json").read_text())["seconds"] >= 0
    prompts = json.loads((work / "prompts.json").read_text())
    assert prompts["mix"] == 20 and prompts["prompts"] == 20 + prompts["magpie"] - prompts["dropped"]
    answers = json.loads((work / "answers.json").read_text())
    assert answers["answers"] >= 8 and answers["generated_tokens"] > 0
    parts = sorted((tmp / "out").glob("drafter.tar.*"))
    assert parts and all(p.stat().st_size <= gpu_drafter.TAR_PART for p in parts)
    (tmp / "joined.tar").write_bytes(b"".join(p.read_bytes() for p in parts))
    with tarfile.open(tmp / "joined.tar") as tar:
        tar.extractall(tmp / "drafter", filter="data")
    got = {f.name for f in (tmp / "drafter").iterdir()}
    assert {"model.safetensors", "config.json", "README.md", "DATA.md", "eval_mix_heldout.json",
            "pipeline.json", "answers.npz", "train_log.json"} <= got
    target = load_target(work / "target")
    drafter = load_drafter(tmp / "drafter", target)
    best = json.loads((work / "eval.json").read_text())["best"]
    assert len(drafter.layers) == int(best)
    card = (tmp / "drafter" / "README.md").read_text()
    assert "tau by domain" in card and "answers" in card and "python tools/train_drafter.py" in card
    assert "| gpteacher-" in (tmp / "drafter" / "DATA.md").read_text() or "| gsm8k" in (tmp / "drafter" / "DATA.md").read_text()
    saved = np.load(tmp / "drafter" / "answers.npz")
    assert len(saved["lengths"]) == answers["answers"] and saved["tokens"].size == answers["tokens"]


def test_the_target_on_the_other_side_is_the_demo_target_bit_for_bit(run):
    tmp, _ = run
    a, b = load_file(tmp / "work" / "target" / "model.safetensors"), load_file(DEMO / "model.safetensors")
    assert set(a) == set(b) and all(np.array_equal(a[k], b[k].astype(np.float32)) for k in a)


def test_a_second_run_skips_the_done_stages(run, capsys):
    tmp, argv = run
    before = {f.name: f.stat().st_mtime_ns for f in (tmp / "work").glob("*.json")}
    assert gpu_drafter.main(argv) == 0
    assert "stages to run: none" in capsys.readouterr().out
    assert before == {f.name: f.stat().st_mtime_ns for f in (tmp / "work").glob("*.json")}


def test_prompts_take_turns_by_domain_and_spread_the_targets_own():
    mix = [{"domain": d, "source": "m", "i": i} for d in ("math", "code") for i in range(4)]
    own = [{"domain": "math", "source": "magpie", "i": i} for i in range(2)]
    out = gpu_drafter.take_turns(mix, own)
    assert [x["domain"] for x in out[:4]] == ["code", "math", "code", "math"]
    math = [x["source"] for x in out if x["domain"] == "math"]
    assert math == ["m", "magpie", "m", "m", "magpie", "m"]
