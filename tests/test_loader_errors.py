"""Bad input gives a clear error: ConfigError for a directory or config.json minidcut cannot use,
CheckpointError for tensors that do not fit the config, ValueError from Engine.generate for prompts.
Every message names the offending thing."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from minidcut.config import SUPPORTED_MODEL_TYPES, SUPPORTED_ROPE_TYPES, ConfigError
from minidcut.engine import Engine
from minidcut.loader import CheckpointError, load_target, parse_dtype
from tiny import BASE, make_model

V = BASE["vocab_size"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_model(path, "llama")
    return path


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe")
    make_model(path, "qwen3_moe")
    return path


@pytest.fixture(scope="module")
def engine(llama):
    return Engine(load_target(llama), None, None, batch_size=2, max_seq=64, eos_ids=[], compile=False)


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


def edit_config(path, **changes):
    """Rewrite path/config.json with `changes` (a value of None deletes the key)."""
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


def edit_tensors(path, edit):
    """Rewrite path/model.safetensors with edit(tensors) applied to its dict of tensors."""
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


# ---- the directory and config.json ---------------------------------------------------------------

def test_missing_directory_is_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist") as e:
        load_target(tmp_path / "nowhere")
    assert str(tmp_path / "nowhere") in str(e.value)


def test_directory_without_config_json_says_so(tmp_path):
    with pytest.raises(ConfigError, match="config.json") as e:
        load_target(tmp_path)
    assert str(tmp_path) in str(e.value)


def test_config_json_that_is_not_json_is_named(llama, tmp_path):
    path = copy_model(llama, tmp_path / "m")
    (path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON") as e:
        load_target(path)
    assert str(path / "config.json") in str(e.value)


def test_config_without_model_type_says_model_type_is_missing(llama, tmp_path):
    path = copy_model(llama, tmp_path / "m")
    edit_config(path, model_type=None)
    with pytest.raises(ConfigError, match="no model_type"):
        load_target(path)


def test_unsupported_model_type_is_named_and_the_supported_ones_listed(llama, tmp_path):
    path = copy_model(llama, tmp_path / "m")
    edit_config(path, model_type="gpt2")
    with pytest.raises(ConfigError, match="'gpt2'") as e:
        load_target(path)
    assert all(t in str(e.value) for t in SUPPORTED_MODEL_TYPES)


def test_config_missing_a_required_field_names_the_field(llama, tmp_path):
    path = copy_model(llama, tmp_path / "m")
    edit_config(path, hidden_size=None)
    with pytest.raises(ConfigError, match="'hidden_size'"):
        load_target(path)


@pytest.mark.parametrize("form", ["rope_parameters", "rope_scaling"])
def test_unsupported_rope_type_is_named_and_the_supported_ones_listed(llama, tmp_path, form):
    path = copy_model(llama, tmp_path / "m")
    dynamic = {"rope_type": "dynamic", "factor": 4.0}
    if form == "rope_parameters":
        edit_config(path, rope_parameters={**dynamic, "rope_theta": 10000.0})
    else:
        edit_config(path, rope_parameters=None, rope_theta=10000.0, rope_scaling=dynamic)
    with pytest.raises(ConfigError, match="'dynamic'") as e:
        load_target(path)
    assert all(t in str(e.value) for t in SUPPORTED_ROPE_TYPES)


def test_unknown_dtype_name_is_named():
    assert parse_dtype("bf16") is torch.bfloat16
    with pytest.raises(ConfigError, match="'float8'"):
        parse_dtype("float8")


# ---- the tensors -----------------------------------------------------------------------------------

def test_directory_without_safetensors_says_so(llama, tmp_path):
    path = copy_model(llama, tmp_path / "m")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_target(path)


def test_truncated_safetensors_file_is_named(llama, tmp_path):
    path = copy_model(llama, tmp_path / "m")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as e:
        load_target(path)
    assert str(path / "model.safetensors") in str(e.value)


def test_missing_shard_of_a_sharded_checkpoint_is_named(llama, tmp_path):
    path = tmp_path / "m"
    shutil.copytree(llama, path)
    (path / "model.safetensors").unlink()
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(llama).save_pretrained(path, max_shard_size="40KB")
    shards = sorted(set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values()))
    assert len(shards) > 1
    (path / shards[-1]).unlink()
    with pytest.raises(CheckpointError, match=shards[-1]):
        load_target(path)


def test_tensor_of_the_wrong_shape_is_named_with_both_shapes(llama, tmp_path):
    path = copy_model(llama, tmp_path / "m")
    key = "model.layers.1.self_attn.k_proj.weight"  # [kv_heads * head_dim, hidden] = [32, 64]

    def shrink(t):
        t[key] = t[key][:24].clone()

    edit_tensors(path, shrink)
    with pytest.raises(CheckpointError, match=key) as e:
        load_target(path)
    assert "[24, 64]" in str(e.value) and "[32, 64]" in str(e.value)


def test_missing_tensor_is_named(llama, tmp_path):
    path = copy_model(llama, tmp_path / "m")
    key = "model.layers.2.mlp.down_proj.weight"
    edit_tensors(path, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match=f"missing tensor {key}"):
        load_target(path)


def test_unexpected_extra_tensor_is_named(llama, tmp_path):
    path = copy_model(llama, tmp_path / "m")
    key = "model.layers.0.mlp.extra_proj.weight"
    edit_tensors(path, lambda t: t.update({key: torch.zeros(4, 4)}))
    with pytest.raises(CheckpointError, match=f"unexpected tensor {key}"):
        load_target(path)


def test_incomplete_per_expert_tensors_name_the_expert_block(moe, tmp_path):
    path = copy_model(moe, tmp_path / "m")
    edit_tensors(path, lambda t: t.pop("model.layers.1.mlp.experts.5.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts"):
        load_target(path)


def test_untied_config_without_lm_head_names_lm_head(llama, tmp_path):
    path = copy_model(llama, tmp_path / "m")
    edit_config(path, tie_word_embeddings=False)  # the checkpoint has no lm_head.weight of its own
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        load_target(path)


# ---- prompts -----------------------------------------------------------------------------------------

def test_prompt_longer_than_the_context_is_named(engine):
    with pytest.raises(ValueError, match="prompt 1") as e:
        engine.generate([[1, 2, 3], [5] * 70], 4)
    assert "64" in str(e.value)


def test_prompt_that_fits_alone_but_not_with_its_new_tokens_is_refused(engine):
    with pytest.raises(ValueError, match="prompt 0"):
        engine.generate([[5] * 50], 20)


def test_empty_prompt_is_named(engine):
    with pytest.raises(ValueError, match="prompt 2 is empty"):
        engine.generate([[1], [2, 3], []], 4)


@pytest.mark.parametrize("bad", [V, -1])
def test_token_id_outside_the_vocabulary_is_refused(engine, bad):
    with pytest.raises(ValueError, match="prompt 1") as e:
        engine.generate([[1, 2], [3, bad, 4]], 4)
    assert "vocabulary" in str(e.value) and str(V) in str(e.value)


def test_errors_are_value_errors_and_a_refused_call_leaves_the_engine_usable(engine):
    assert issubclass(ConfigError, ValueError) and issubclass(CheckpointError, ValueError)
    with pytest.raises(ValueError):
        engine.generate([[]], 4)
    outputs, _ = engine.generate([[1, 2, 3]], 4)
    assert len(outputs[0]) == 4


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_loading_streams_each_tensor_to_its_device_and_dtype_as_it_is_read(tmp_path, monkeypatch, family):
    """Host memory holds about one checkpoint tensor at a time: each is cast (and moved) as soon as it
    is read, and a layer's per-expert tensors are dropped once fused. Checked by weak references to
    the tensors read: loading a float32 checkpoint as bfloat16, at most one read tensor is alive when the
    next is read. The model is the same as one loaded whole."""
    import weakref

    import minidcut.loader as loader
    from tiny import make_model

    make_model(tmp_path / "m", family)
    alive, most = [], [0]
    real = loader.safe_open

    class Watched:
        def __init__(self, *a, **k):
            self.f = real(*a, **k)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *a):
            return self.f.__exit__(*a)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, key):
            import gc
            gc.collect()
            most[0] = max(most[0], sum(r() is not None for r in alive))
            t = self.f.get_tensor(key)
            alive.append(weakref.ref(t))
            return t
    monkeypatch.setattr(loader, "safe_open", Watched)
    streamed = loader.load_target(tmp_path / "m", torch.bfloat16)
    monkeypatch.undo()
    assert len(alive) > 10 and most[0] <= 1
    whole = loader.load_target(tmp_path / "m", torch.bfloat16)
    for (k, a), (_, b) in zip(streamed.state_dict().items(), whole.state_dict().items()):
        assert torch.equal(a, b), k
