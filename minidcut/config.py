"""config.json -> ModelConfig / DrafterConfig.

Reads the Hugging Face config of a target (llama, qwen2, qwen3, qwen2_moe, qwen3_moe) or of a DFlash
drafter (a Qwen3 config plus block_size and dflash_config). Both rope forms are accepted:
transformers-5 `rope_parameters` and legacy `rope_theta` + `rope_scaling`.

Every field that changes the math is either implemented as transformers 5 implements it for that
model_type, or refused with a ConfigError naming it; none is ignored. The fields checked:

  implemented   head_dim, attention_bias (llama, qwen3, qwen3_moe: q/k/v/o biases; qwen2 always has
                q/k/v biases and no o bias; qwen2_moe: q/k/v biases iff qkv_bias), mlp_bias (llama),
                rope_theta, rope type default / linear / llama3 / yarn (factor, beta_fast, beta_slow,
                original_max_position_embeddings, truncate, attention_factor, mscale, mscale_all_dim),
                use_sliding_window / sliding_window / max_window_layers / layer_types (qwen families;
                llama has no sliding window), tie_word_embeddings, rms_norm_eps, the MoE fields
                (num_experts, num_experts_per_tok, moe_intermediate_size, shared_expert_intermediate_size,
                norm_topk_prob, decoder_sparse_step, mlp_only_layers); for a drafter also is_causal and
                dflash_config block_size / mask_token_id / target_layer_ids.
  refused       REFUSED below (hidden_act other than silu, partial rotary, logit softcapping, a
                non-causal target, quantized checkpoints), rope types outside SUPPORTED_ROPE_TYPES,
                rope_parameters per layer type, any other dflash_config field (DFlash2's selector and
                convolutions, output_multiplier, input_embedding_scale, ...).
  harmless      pretraining_tp (transformers 5 no longer reads it), attention_dropout, use_cache,
                initializer_range, router_aux_loss_coef, output_router_logits, token ids, dtype; and
                what transformers itself ignores for the model_type (mlp_bias outside llama,
                attention_bias in qwen2 / qwen2_moe, sliding fields in llama, layer_types in qwen3_moe).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
SLIDING, FULL = "sliding_attention", "full_attention"

# field -> the values minidcut implements (absent means the first one); any other value is refused.
REFUSED = {
    "hidden_act": ("silu", "swish"),
    "partial_rotary_factor": (1.0,),
    "attn_logit_softcapping": (None,),
    "final_logit_softcapping": (None,),
    "is_causal": (True,),  # targets only: transformers makes a non-causal config's mask bidirectional
    "quantization_config": (None,),
}
DFLASH_FIELDS = ("block_size", "mask_token_id", "target_layer_ids", "num_target_layers")


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
    rope_scaling: dict | None  # None or {"rope_type": "linear"|"llama3"|"yarn", ...}, lengths resolved
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # biases on q_proj, k_proj, v_proj
    qk_norm: bool  # Qwen3 family: RMSNorm on each q/k head before RoPE
    o_proj_bias: bool = False
    mlp_bias: bool = False  # biases on gate_proj, up_proj, down_proj (llama)
    # Sliding-window attention: layer i reads only the last `sliding_window` positions if it is in
    # sliding_layers (sliding_window None: no layer has a window).
    sliding_window: int | None = None
    sliding_layers: list[int] = field(default_factory=list)
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

    def window(self, i: int) -> int | None:
        """The sliding window of layer i, None for full attention."""
        return self.sliding_window if i in self.sliding_layers else None


@dataclass
class DrafterConfig:
    """A DFlash drafter: Qwen3-style layers with no embedding and no lm_head of its own."""

    layers: ModelConfig  # Qwen3 layer shapes, norms and rope of the draft layers
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int
    causal_layers: list[int] = field(default_factory=list)  # draft layers whose block attention is causal


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


def _rope(cfg: dict, max_pos: int) -> tuple[float, dict | None]:
    """(rope_theta, scaling or None) from either the transformers-5 or the legacy form, with the
    lengths transformers fills in resolved: original_max_position_embeddings (a top-level field wins,
    then the rope dict's, then max_position_embeddings) and a YaRN factor left null."""
    params = cfg.get("rope_parameters")
    if params is None:
        theta = cfg.get("rope_theta", 10000.0)
        scaling = dict(cfg["rope_scaling"]) if cfg.get("rope_scaling") else None
    else:
        params = dict(params)
        if any(isinstance(v, dict) for v in params.values()):
            raise ConfigError("rope_parameters per layer type is not supported")
        theta = params.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = params
    if scaling is None:
        return float(theta), None
    kind = scaling.pop("rope_type", scaling.pop("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"rope_type {kind!r} is not supported (supported: "
                          f"{', '.join(SUPPORTED_ROPE_TYPES)})")
    if scaling.get("partial_rotary_factor") not in (None, 1.0):
        raise ConfigError(f"partial_rotary_factor {scaling['partial_rotary_factor']!r} is not supported "
                          "(minidcut rotates the whole head)")
    if kind == "default":
        return float(theta), None
    if kind in ("llama3", "yarn"):
        old = cfg.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = old or max_pos
    if kind == "yarn" and scaling.get("factor") is None:
        scaling["factor"] = max_pos / scaling["original_max_position_embeddings"]
    return float(theta), {**scaling, "rope_type": kind}


def _sliding(cfg: dict, mt: str, n_layers: int) -> tuple[int | None, list[int]]:
    """(sliding_window, ids of the sliding layers) as transformers 5 derives them for `mt`: qwen2 and
    qwen3 slide from layer max_window_layers on, qwen2_moe on the even layers below it, qwen3_moe on
    every layer, all only with use_sliding_window; an explicit layer_types list wins (not in qwen3_moe,
    which has none). Llama has no sliding window."""
    if mt == "llama":
        return None, []
    use = bool(cfg.get("use_sliding_window", False))
    window = cfg.get("sliding_window", 4096) if use else None
    if mt == "qwen3_moe":
        return window, list(range(n_layers)) if window else []
    types = cfg.get("layer_types")
    if types is None:
        first = cfg.get("max_window_layers", 28)
        if mt == "qwen2_moe":
            types = [SLIDING if use and i % 2 == 0 and i < first else FULL for i in range(n_layers)]
        else:
            types = [SLIDING if window and i >= first else FULL for i in range(n_layers)]
    if len(types) != n_layers or any(t not in (SLIDING, FULL) for t in types):
        raise ConfigError(f"layer_types {types!r} is not one of {SLIDING!r} / {FULL!r} per layer "
                          f"({n_layers} layers)")
    return window or None, [i for i, t in enumerate(types) if t == SLIDING]


def _check_fields(cfg: dict, skip: tuple[str, ...] = ()) -> None:
    """ConfigError for the first REFUSED field with a value minidcut does not implement."""
    for name, ok in REFUSED.items():
        value = cfg.get(name)
        if name not in skip and value is not None and value not in ok:
            shown = "{...}" if isinstance(value, dict) else repr(value)
            raise ConfigError(f"{name} {shown} is not supported (minidcut implements {name} {ok[0]!r})")


def _eos_ids(path: Path | None, cfg: dict) -> list[int]:
    ids = cfg.get("eos_token_id")
    if path is not None and (path / "generation_config.json").is_file():
        gen = read_json(path / "generation_config.json")
        ids = gen.get("eos_token_id", ids)
    if ids is None:
        return []
    return [int(i) for i in (ids if isinstance(ids, list) else [ids])]


def parse_model_config(cfg: dict, path: Path | None = None, drafter: bool = False) -> ModelConfig:
    """Turn a config.json dict into a ModelConfig, with clear errors for what is unsupported.
    drafter=True: a DFlash drafter's layers (is_causal and sliding layers without a window are the
    drafter's business, see load_drafter_config)."""
    where = f" in {path / 'config.json'}" if path else ""
    mt = cfg.get("model_type")
    if mt is None:
        raise ConfigError(f"config has no model_type{where} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"model_type {mt!r}{where} is not supported "
                          f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    try:
        _check_fields(cfg, skip=("is_causal",) if drafter else ())
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        max_pos = cfg.get("max_position_embeddings", 4096)
        theta, scaling = _rope(cfg, max_pos)
        window, sliding = _sliding(cfg, mt, cfg["num_hidden_layers"])
        if sliding and window is None and not drafter:
            raise ConfigError("layer_types has sliding_attention layers but use_sliding_window is "
                              "false or sliding_window is null")
        moe = mt.endswith("_moe")
        # Attention biases: qwen2 always has q/k/v (never o), qwen2_moe says so in qkv_bias, the
        # others put attention_bias on q, k, v and o alike.
        qkv_bias = {"qwen2": True, "qwen2_moe": bool(cfg.get("qkv_bias", True))}.get(
            mt, bool(cfg.get("attention_bias", False)))
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
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            qk_norm=mt in ("qwen3", "qwen3_moe"),
            o_proj_bias=qkv_bias and mt not in ("qwen2", "qwen2_moe"),
            mlp_bias=mt == "llama" and bool(cfg.get("mlp_bias", False)),
            sliding_window=window,
            sliding_layers=sliding,
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
    except ConfigError as e:
        raise ConfigError(f"{e}{where}") from None


def load_model_config(path: str | Path) -> ModelConfig:
    p = model_dir(path)
    return parse_model_config(read_json(p / "config.json"), p)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default taps (docs/method.md, "DFlash drafting"): [L // 2] for one draft layer, else
    round(1 + i * (L - 4) / (n - 1))."""
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
    unknown = [k for k in dcfg if k not in DFLASH_FIELDS]
    if unknown:
        raise ConfigError(f"dflash_config.{unknown[0]} in {p / 'config.json'} is not supported "
                          f"(minidcut implements dflash_config {', '.join(DFLASH_FIELDS)})")
    layers = parse_model_config({**cfg, "model_type": "qwen3"}, p, drafter=True)
    n_target = dcfg.get("num_target_layers", cfg.get("num_target_layers"))
    mask = dcfg.get("mask_token_id", cfg.get("mask_token_id"))
    if mask is None:
        raise ConfigError(f"{p / 'config.json'} lacks dflash_config.mask_token_id")
    taps = dcfg.get("target_layer_ids", cfg.get("target_layer_ids"))
    if taps is None:
        if n_target is None:
            raise ConfigError(f"{p / 'config.json'} has neither dflash_config.target_layer_ids "
                              "nor num_target_layers")
        taps = default_target_layer_ids(n_target, layers.num_layers)
    # As z-lab's drafter: is_causal applies to every draft layer; unset, the sliding layers are causal.
    causal = cfg.get("is_causal")
    if causal is None:
        causal_layers = layers.sliding_layers
    else:
        causal_layers = list(range(layers.num_layers)) if causal else []
    return DrafterConfig(layers=layers, block_size=int(dcfg.get("block_size", cfg.get("block_size", 16))),
                         mask_token_id=int(mask), target_layer_ids=[int(t) for t in taps],
                         num_target_layers=int(n_target) if n_target is not None else -1,
                         causal_layers=list(causal_layers))
