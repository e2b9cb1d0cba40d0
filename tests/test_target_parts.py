"""tools/target_parts.py: our GGUF reader against gguf-py and transformers, and parts that survive the trip."""

import hashlib
import json

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor  # noqa: E402

from tools import target_parts  # noqa: E402

Q = gguf.GGMLQuantizationType
HEADS, KV_HEADS, H = 4, 2, 32


def tiny_llama_gguf(path, rng):
    """A two-layer llama GGUF with every tensor type the reader knows; returns {gguf name: fp32 as gguf-py
    dequantizes it}."""
    shapes = {"token_embd.weight": ((50, H), Q.Q8_0), "output_norm.weight": ((H,), Q.F32)}
    for i in range(2):
        shapes |= {f"blk.{i}.attn_norm.weight": ((H,), Q.F32), f"blk.{i}.ffn_norm.weight": ((H,), Q.F32),
                   f"blk.{i}.attn_q.weight": ((H, H), Q.Q4_1), f"blk.{i}.attn_k.weight": ((16, H), Q.Q4_1),
                   f"blk.{i}.attn_v.weight": ((16, H), Q.F16), f"blk.{i}.attn_output.weight": ((H, H), Q.BF16),
                   f"blk.{i}.ffn_gate.weight": ((64, H), Q.Q4_1), f"blk.{i}.ffn_up.weight": ((64, H), Q.Q8_0),
                   f"blk.{i}.ffn_down.weight": ((H, 64), Q.Q4_1)}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(50)])  # arrays of strings parse too
    expected = {}
    for name, (shape, kind) in shapes.items():
        x = rng.standard_normal(shape).astype(np.float32)
        raw = x if kind == Q.F32 else gguf.quants.quantize(x, kind)
        w.add_tensor(name, raw, raw_dtype=None if kind == Q.F32 else kind)
        expected[name] = gguf.quants.dequantize(raw, kind).astype(np.float32).reshape(shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def test_the_reader_dequantizes_every_type_as_gguf_py_does(tmp_path):
    expected = tiny_llama_gguf(tmp_path / "t.gguf", np.random.default_rng(0))
    meta, tensors = target_parts.read_gguf(tmp_path / "t.gguf")
    assert meta["llama.attention.head_count"] == HEADS and len(meta["tokenizer.ggml.tokens"]) == 50
    assert set(tensors) == set(expected)
    for name, x in expected.items():
        assert tensors[name].shape == x.shape and np.array_equal(tensors[name], x), name


def test_hf_names_and_the_qk_row_order_match_transformers(tmp_path):
    expected = tiny_llama_gguf(tmp_path / "t.gguf", np.random.default_rng(1))
    meta, tensors = target_parts.read_gguf(tmp_path / "t.gguf")
    hf = target_parts.hf_tensors(meta, tensors)
    proc = LlamaTensorProcessor({"num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS})
    assert np.array_equal(hf["model.layers.1.self_attn.q_proj.weight"],
                          proc.process(expected["blk.1.attn_q.weight"], "blk.1.attn_q.weight").weights)
    assert np.array_equal(hf["model.layers.0.self_attn.k_proj.weight"],
                          proc.process(expected["blk.0.attn_k.weight"], "blk.0.attn_k.weight").weights)
    assert np.array_equal(hf["model.layers.0.mlp.down_proj.weight"], expected["blk.0.ffn_down.weight"])
    assert np.array_equal(hf["model.embed_tokens.weight"], expected["token_embd.weight"])
    assert len(hf) == len(expected)


def write_hf_files(hf_dir, expected, meta):
    """The small files tools/get_smollm2.py writes, with source.json's sha256 from transformers' path."""
    hf_dir.mkdir()
    proc = LlamaTensorProcessor({"num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS})
    names = target_parts.hf_tensors(meta, {k: v for k, v in expected.items()})  # names only
    by_gguf = dict(zip(expected, names))
    sha = {by_gguf[k]: hashlib.sha256(np.ascontiguousarray(proc.process(v, k).weights).tobytes()).hexdigest()
           for k, v in expected.items()}
    (hf_dir / "source.json").write_text(json.dumps({"tensors_sha256": sha}))
    (hf_dir / "config.json").write_text("{}")
    (hf_dir / "tokenizer.json").write_text("{}")


def test_parts_join_on_the_other_side_into_the_same_weights(tmp_path):
    expected = tiny_llama_gguf(tmp_path / "t.gguf", np.random.default_rng(2))
    meta, _ = target_parts.read_gguf(tmp_path / "t.gguf")
    write_hf_files(tmp_path / "hf", expected, meta)
    size = (tmp_path / "t.gguf").stat().st_size
    dirs = target_parts.pack(tmp_path / "t.gguf", tmp_path / "hf", tmp_path / "parts", part_bytes=size // 3 + 4096)
    assert len(dirs) >= 3 and all(sum(f.stat().st_size for f in d.iterdir()) <= size // 3 + 4096 for d in dirs)
    stage = tmp_path / "stage"
    stage.mkdir()
    for d in dirs[:-1]:
        for f in d.iterdir():
            (stage / f.name).write_bytes(f.read_bytes())
    with pytest.raises(target_parts.PartsError, match="lacks target.gguf"):  # the last call never came
        target_parts.unpack(stage, tmp_path / "out")
    last = next(dirs[-1].iterdir())
    (stage / last.name).write_bytes(last.read_bytes()[:-1] + b"\x00")
    with pytest.raises(target_parts.PartsError, match="sha256"):
        target_parts.unpack(stage, tmp_path / "out")
    (stage / last.name).write_bytes(last.read_bytes())
    rec = target_parts.unpack(stage, tmp_path / "out")
    assert rec["tensors"] == len(expected)
    assert {f.name for f in (tmp_path / "out").iterdir()} == {"model.safetensors", "config.json",
                                                              "tokenizer.json", "source.json"}


def test_a_tensor_that_differs_from_source_json_is_refused(tmp_path):
    expected = tiny_llama_gguf(tmp_path / "t.gguf", np.random.default_rng(3))
    meta, _ = target_parts.read_gguf(tmp_path / "t.gguf")
    write_hf_files(tmp_path / "hf", expected, meta)
    src = json.loads((tmp_path / "hf" / "source.json").read_text())
    src["tensors_sha256"]["model.norm.weight"] = "0" * 64
    (tmp_path / "hf" / "source.json").write_text(json.dumps(src))
    (d,) = target_parts.pack(tmp_path / "t.gguf", tmp_path / "hf", tmp_path / "parts", part_bytes=1 << 20)
    with pytest.raises(target_parts.PartsError, match="1 tensors differ"):
        target_parts.unpack(d, tmp_path / "out")
    assert not (tmp_path / "out").exists()
