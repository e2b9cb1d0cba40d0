"""safetensors -> modules. The model is built on the meta device and the checkpoint tensors are
assigned into it, so a checkpoint is never held twice in memory. Tensors are streamed: each goes to
its device and dtype as it is read, so host memory holds about one tensor at a time, not the
checkpoint (a 30B MoE's ~60 GB never sit in host memory on their way to a GPU).

Handles a single `model.safetensors` or shards listed in `model.safetensors.index.json`, tied
embeddings, and both MoE expert layouts (per-expert `experts.E.{gate,up,down}_proj.weight`, or fused
`experts.gate_up_proj` / `experts.down_proj` in either orientation).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from .config import ConfigError, load_drafter_config, load_model_config, model_dir, read_json
from .drafter import DFlashDrafter, check_pair
from .layers import rope_inv_freq
from .model import Transformer

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


class CheckpointError(ValueError):
    """A checkpoint whose tensors do not fit the model; the message names the tensor."""


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype {name!r} (choose from {', '.join(DTYPES)})")
    return DTYPES[name]


def read_safetensors(path: Path, device="cpu", dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """All tensors of a model directory (single file or sharded), by key, each moved to `device` (and
    floating ones cast to `dtype`) as soon as it is read."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(read_json(index)["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"{path} has no model.safetensors or model.safetensors.index.json")
    tensors = {}
    for name in files:
        try:
            with safe_open(str(path / name), framework="pt", device="cpu") as f:
                for key in f.keys():
                    t = f.get_tensor(key)
                    cast = dtype if dtype is not None and t.is_floating_point() else t.dtype
                    tensors[key] = t.to(device=device, dtype=cast)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read {path / name}: {e}") from None
    return tensors


_PER_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert keys -> fused [E, 2I, H] gate_up_proj and [E, H, I] down_proj (gate rows first), in
    place: a layer's per-expert tensors are dropped once fused, so the copy costs one layer's experts."""
    groups: dict[str, dict[str, dict[int, str]]] = {}
    for key in tensors:
        m = _PER_EXPERT.match(key)
        if m:
            groups.setdefault(m[1], {}).setdefault(m[3], {})[int(m[2])] = key
    for prefix, parts in groups.items():
        n = len(parts.get("down_proj", {}))
        if any(sorted(parts.get(p, {})) != list(range(n)) for p in ("gate_proj", "up_proj", "down_proj")):
            raise CheckpointError(f"{prefix}: per-expert tensors are incomplete")
        take = lambda part, e: tensors.pop(parts[part][e])  # noqa: E731
        tensors[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([take("gate_proj", e), take("up_proj", e)]) for e in range(n)])
        tensors[f"{prefix}.down_proj"] = torch.stack([take("down_proj", e) for e in range(n)])
    return tensors


def _orient_experts(tensors, key: str, expected) -> torch.Tensor:
    """Fused expert tensors come as [E, out, in] (transformers) or [E, in, out]. Decide once per
    expert block from the pair: one of gate_up_proj [E, 2I, H] and down_proj [E, H, I] is never
    square, so the pair always tells, even when 2I == H makes gate_up_proj square."""
    block = key.rsplit(".", 1)[0]
    gu, down = tensors[f"{block}.gate_up_proj"], tensors[f"{block}.down_proj"]
    E, H, I = expected[f"{block}.down_proj"]
    transposed = tuple(down.shape) == (E, I, H) if I != H else tuple(gu.shape) == (E, H, 2 * I)
    return tensors[key].transpose(1, 2) if transposed else tensors[key]


def load_into(model: nn.Module, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device,
              where: str, tied: tuple[str, str] | None = None) -> None:
    """Assign `tensors` to the meta-device `model`'s parameters, checking names and shapes.
    `tied` = (lm_head key, embedding key) fills the head from the embedding when it is absent."""
    expected = {k: v.shape for k, v in model.state_dict().items()}
    # Rotary frequencies are recomputed from the config; old checkpoints still carry them.
    tensors = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}
    if tied and tied[0] in expected and tied[0] not in tensors and tied[1] in tensors:
        tensors[tied[0]] = tensors[tied[1]]
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing:
        raise CheckpointError(f"{where}: missing tensor {missing[0]} (expected shape "
                              f"{list(expected[missing[0]])})" + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    if unexpected:
        raise CheckpointError(f"{where}: unexpected tensor {unexpected[0]} (shape {list(tensors[unexpected[0]].shape)})"
                              + (f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else ""))
    state = {}
    for key, shape in expected.items():
        t = tensors[key]
        if key.endswith("experts.gate_up_proj") or key.endswith("experts.down_proj"):
            t = _orient_experts(tensors, key, expected)
        if t.shape != shape:
            raise CheckpointError(f"{where}: tensor {key} has shape {list(t.shape)}, "
                                  f"the config implies {list(shape)}")
        state[key] = t.to(device=device, dtype=dtype).contiguous()
    model.load_state_dict(state, assign=True)


def load_target(path: str | Path, dtype: torch.dtype = torch.float32, device="cpu") -> Transformer:
    """A target model directory -> Transformer in eval mode, weights in `dtype` on `device`."""
    p = model_dir(path)
    cfg = load_model_config(p)
    with torch.device("meta"):
        model = Transformer(cfg)
    load_into(model, fuse_experts(read_safetensors(p, device, dtype)), dtype, device, str(p),
              tied=("lm_head.weight", "model.embed_tokens.weight") if cfg.tie_word_embeddings else None)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device)
    return model.eval().requires_grad_(False)


def load_drafter(path: str | Path, target: Transformer, dtype: torch.dtype = torch.float32,
                 device="cpu") -> DFlashDrafter:
    """A DFlash drafter directory (z-lab layout) -> DFlashDrafter in `dtype` (which may differ from the
    target's), checked against its target and borrowing its embedding and lm_head."""
    p = model_dir(path)
    cfg = load_drafter_config(p)
    check_pair(cfg, target.cfg, str(p))
    with torch.device("meta"):
        drafter = DFlashDrafter(cfg)
    tensors = read_safetensors(p, device, dtype)
    vocab = tensors.pop("draft_vocab", None)
    load_into(drafter, tensors, dtype, device, str(p))
    if vocab is not None:
        if vocab.dim() != 1 or vocab.is_floating_point() or not len(vocab) or not (
                0 <= int(vocab.min()) and int(vocab.max()) < target.cfg.vocab_size):
            raise CheckpointError(f"{p}: draft_vocab must be token ids of the target's vocabulary "
                                  f"[0, {target.cfg.vocab_size}), got a {vocab.dtype} tensor of shape {list(vocab.shape)}")
        drafter.draft_vocab = vocab.to(device=device, dtype=torch.long)
    drafter.inv_freq = rope_inv_freq(cfg.layers.head_dim, cfg.layers.rope_theta,
                                     cfg.layers.rope_scaling).to(device)
    drafter.borrow(target)
    return drafter.eval().requires_grad_(False)
