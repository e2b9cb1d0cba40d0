"""config.json -> ModelConfig / DrafterConfig.

Reads the Hugging Face config of a target (llama, qwen2, qwen3, qwen2_moe, qwen3_moe) or of a DFlash
drafter (a Qwen3 config plus block_size and dflash_config, PAPER.md section 2). Both rope forms are
accepted: transformers-5 `rope_parameters` and legacy `rope_theta` + `rope_scaling`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class ConfigError(ValueError):
    """A model directory or config.json that minidcut cannot use; the message says why."""


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None or {"rope_type": "linear"|"llama3", ...}
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool  # Qwen3 family: RMSNorm on each q/k head before RoPE
    # MoE (qwen2_moe / qwen3_moe); num_experts == 0 means dense everywhere.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE shared expert with a sigmoid gate
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    eos_token_ids: list[int] = field(default_factory=list)

    def is_moe_layer(self, i: int) -> bool:
        """HF rule: layer i is MoE iff not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0."""
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)


@dataclass
class DrafterConfig:
    """A DFlash drafter: Qwen3-style layers with no embedding and no lm_head of its own."""

    layers: ModelConfig  # Qwen3 layer shapes, norms and rope of the draft layers
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} not found") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None


def model_dir(path: str | Path) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(f"model directory {p} does not exist")
    if not (p / "config.json").is_file():
        raise ConfigError(f"{p} has no config.json (expected a Hugging Face model directory)")
    return p


def _rope(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, scaling or None) from either the transformers-5 or the legacy form."""
    params = cfg.get("rope_parameters")
    if params is None:
        theta = cfg.get("rope_theta", 10000.0)
        scaling = dict(cfg["rope_scaling"]) if cfg.get("rope_scaling") else None
    else:
        params = dict(params)
        theta = params.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = params
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(f"rope_type {kind!r} is not supported (supported: "
                              f"{', '.join(SUPPORTED_ROPE_TYPES)})")
        scaling.pop("type", None)  # the legacy spelling of rope_type
        scaling = None if kind == "default" else {**scaling, "rope_type": kind}
    return float(theta), scaling


def _eos_ids(path: Path | None, cfg: dict) -> list[int]:
    ids = cfg.get("eos_token_id")
    if path is not None and (path / "generation_config.json").is_file():
        gen = read_json(path / "generation_config.json")
        ids = gen.get("eos_token_id", ids)
    if ids is None:
        return []
    return [int(i) for i in (ids if isinstance(ids, list) else [ids])]


def parse_model_config(cfg: dict, path: Path | None = None) -> ModelConfig:
    """Turn a config.json dict into a ModelConfig, with clear errors for what is unsupported."""
    where = f" in {path / 'config.json'}" if path else ""
    mt = cfg.get("model_type")
    if mt is None:
        raise ConfigError(f"config has no model_type{where} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"model_type {mt!r}{where} is not supported "
                          f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    try:
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        theta, scaling = _rope(cfg)
        moe = mt.endswith("_moe")
        return ModelConfig(
            model_type=mt,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            intermediate_size=cfg.get("intermediate_size", 0),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # qwen2 always has q/k/v biases; llama and qwen3 say so in attention_bias.
            attention_bias=mt in ("qwen2", "qwen2_moe") or bool(cfg.get("attention_bias", False)),
            qk_norm=mt in ("qwen3", "qwen3_moe"),
            num_experts=(cfg.get("num_experts") or cfg.get("num_local_experts") or 0) if moe else 0,
            num_experts_per_tok=cfg.get("num_experts_per_tok", 0) if moe else 0,
            moe_intermediate_size=cfg.get("moe_intermediate_size", 0) if moe else 0,
            shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0) or 0
            if mt == "qwen2_moe" else 0,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            decoder_sparse_step=cfg.get("decoder_sparse_step", 1) or 1,
            mlp_only_layers=list(cfg.get("mlp_only_layers") or []),
            eos_token_ids=_eos_ids(path, cfg),
        )
    except KeyError as e:
        raise ConfigError(f"config{where} lacks required field {e.args[0]!r}") from None


def load_model_config(path: str | Path) -> ModelConfig:
    p = model_dir(path)
    return parse_model_config(read_json(p / "config.json"), p)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """PAPER.md section 2: [L // 2] for one draft layer, else round(1 + i * (L - 4) / (n - 1))."""
    L, n = num_target_layers, num_draft_layers
    if n == 1:
        return [L // 2]
    return [round(1 + i * (L - 4) / (n - 1)) for i in range(n)]


def load_drafter_config(path: str | Path) -> DrafterConfig:
    p = model_dir(path)
    cfg = read_json(p / "config.json")
    dcfg = cfg.get("dflash_config") or {}
    if "block_size" not in cfg and not dcfg:
        raise ConfigError(f"{p / 'config.json'} is not a DFlash drafter config "
                          "(no block_size / dflash_config)")
    layers = parse_model_config({**cfg, "model_type": "qwen3"}, None)
    n_target = cfg.get("num_target_layers")
    mask = dcfg.get("mask_token_id", cfg.get("mask_token_id"))
    if mask is None:
        raise ConfigError(f"{p / 'config.json'} lacks dflash_config.mask_token_id")
    taps = dcfg.get("target_layer_ids", cfg.get("target_layer_ids"))
    if taps is None:
        if n_target is None:
            raise ConfigError(f"{p / 'config.json'} has neither dflash_config.target_layer_ids "
                              "nor num_target_layers")
        taps = default_target_layer_ids(n_target, layers.num_layers)
    return DrafterConfig(layers=layers, block_size=int(dcfg.get("block_size", cfg.get("block_size", 16))),
                         mask_token_id=int(mask), target_layer_ids=[int(t) for t in taps],
                         num_target_layers=int(n_target) if n_target is not None else -1)
