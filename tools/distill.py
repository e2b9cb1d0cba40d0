"""Self-distilled training data for a drafter: the target's own text.

At inference the drafter continues the target's text, so that is the text it learns from. Two sources:

corpus   windows of the Python standard library (tools/corpus.py) continued greedily by the target
chat     prompts from a JSONL file (or .jsonl.gz) put under the target's chat template and answered by
         the target until its EOS or --max-new-tokens: greedily, or for a share of them
         (--sampled-share) sampled at --temperature, so the drafter also sees the target's distribution
         and not only its argmax path

A data file holds the token sequences (prompt + continuation) and, per sequence, the first position
a drafter is trained to draft from (`starts`: the first generated token in chat mode), whether it
was sampled (`sampled`) and the target's dtype that wrote it (`dtypes`). Chat data is written in resumable chunks: run the command again and it continues
where the file stops.

    python tools/chat_prompts.py --train /tmp/chat_train.jsonl
    python tools/distill.py --target models/smollm2-135m-instruct --prompts /tmp/chat_train.jsonl \
        --chat --max-new-tokens 256 --out /tmp/smollm2_chat.pt
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # run as a script: import from the repo root, not tools/
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402
from rich.console import Console  # noqa: E402

from minidcut import Engine, cli, load_pair, load_tokenizer  # noqa: E402
from minidcut.runtime import write_atomically  # noqa: E402

CHUNK = 1024  # prompts per generate() call between saves (a chunk's last rows drain alone: long chunks)


def matmul_peak(dtype: torch.dtype, n: int = 2048, seconds: float = 2.0) -> float:
    """GFLOP/s of an n^3 matmul in `dtype` on this machine's threads (its compute ceiling, roughly)."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b
    t0, runs = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        a @ b
        runs += 1
    return 2 * n ** 3 * runs / (time.perf_counter() - t0) / 1e9


def flop_per_token(cfg) -> float:
    """FLOP of one decoded token of a dense target (its ModelConfig): 2 per weight it multiplies (the
    attention and MLP projections of every layer, the lm_head); attention over the context is left out,
    so a share of the peak computed from it is a lower bound."""
    H, A, KV = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = H * A * 2 + H * KV * 2 + 3 * H * cfg.intermediate_size
    return 2.0 * (cfg.num_layers * per_layer + H * cfg.vocab_size)


def sampled_at(i: int, share: float) -> bool:
    """Whether prompt i is answered by sampling: every round(1 / share)-th prompt (none at share 0)."""
    return share > 0 and i % max(1, round(1 / share)) == 0


@torch.inference_mode()
def generate_chat(target, prompts: list[list[int]], max_new_tokens: int, batch_size: int, out: Path,
                  meta: dict, console: Console, temperature: float = 0.0, share: float = 0.0,
                  seconds: float | None = None) -> dict:
    """Answers to `prompts` (token ids), greedy or (sampled_at) sampled at `temperature` with the seed of
    its chunk, appended to the data file `out` chunk by chunk (max(CHUNK, batch_size) prompts), until
    every prompt is answered or a chunk ends past `seconds`."""
    data = torch.load(out) if out.is_file() else {"sequences": [], "starts": [], "sampled": [], "meta": meta}
    for key in ("prompts", "temperature", "sampled_share"):
        if data["meta"].get(key, 0.0 if key != "prompts" else None) != meta.get(key):
            raise SystemExit(f"error: {out} was made with {key} {data['meta'].get(key)}, not {meta.get(key)}")
    data.setdefault("sampled", [False] * len(data["sequences"]))
    data.setdefault("dtypes", [data["meta"].get("dtype", "torch.float32")] * len(data["sequences"]))
    done = len(data["sequences"])
    max_seq = max(map(len, prompts)) + max_new_tokens + 2
    t0 = time.time()
    size = max(CHUNK, batch_size)
    for i in range(done, len(prompts), size):
        if seconds is not None and time.time() - t0 > seconds:
            console.log(f"stopping at {len(data['sequences'])}/{len(prompts)}: past --seconds {seconds:.0f}")
            break
        chunk = list(range(i, min(i + size, len(prompts))))
        outs, generated = {}, 0
        for sampled in (False, True):  # one engine per sampling mode; the seed differs per chunk
            # shortest prompts first: a prefill pads its prompts to the longest, so rows admitted
            # together should be of similar length
            part = sorted((j for j in chunk if sampled_at(j, share) == sampled), key=lambda j: len(prompts[j]))
            if part:
                engine = Engine(target, None, batch_size=batch_size, max_seq=max_seq, compile=False,
                                temperature=temperature if sampled else 0.0, seed=i)
                answers, stats = engine.generate([prompts[j] for j in part], max_new_tokens)
                outs.update(zip(part, answers))
                generated += stats.generated_tokens
        data["sequences"] += [prompts[j] + outs[j] for j in chunk]
        data["starts"] += [len(prompts[j]) for j in chunk]
        data["sampled"] += [sampled_at(j, share) for j in chunk]
        data["dtypes"] += [meta["dtype"]] * len(chunk)
        write_atomically(out, lambda tmp: torch.save(data, tmp))
        n = len(data["sequences"])
        rate = sum(map(len, data["sequences"][done:])) / (time.time() - t0)
        console.log(f"{n}/{len(prompts)} answered ({generated} tokens in this chunk, "
                    f"{rate:.0f} tokens/s overall)")
    return data


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="target model directory (HF layout)")
    p.add_argument("--prompts", required=True, help='JSONL of {"prompt": "..."} (or {"messages": [...]}) lines')
    cli.add_chat_arg(p)
    p.add_argument("--max-prompt-tokens", type=int, default=384, help="skip longer prompts")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--limit", type=int, default=None, help="use the first N prompts")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8, help="of the sampled answers (default: %(default)s)")
    p.add_argument("--sampled-share", type=float, default=0.0,
                   help="share of the prompts answered by sampling instead of greedily (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when there is one)")
    p.add_argument("--dtype", default=None, help="the target's dtype (default: bfloat16 on CUDA, float32 on a CPU)")
    p.add_argument("--seconds", type=float, default=None,
                   help="stop after the chunk that ends past this many seconds (run again to go on)")
    p.add_argument("--out", required=True, help="data file (.pt); an existing one is continued")
    args = p.parse_args(argv)
    if not 0 <= args.sampled_share <= 1 or args.temperature <= 0:
        raise SystemExit("error: --sampled-share must be in [0, 1] and --temperature > 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console()
    tok = load_tokenizer(args.target)
    every, _ = cli.read_prompts(args.prompts, None, tok, cli.parse_chat(args.chat), args.target)
    ids = [x for x in every[: args.limit] if len(x) <= args.max_prompt_tokens]
    console.log(f"{len(ids)} prompts of {len(every[: args.limit])} fit --max-prompt-tokens {args.max_prompt_tokens}")
    # on a CPU the linear layers are packed for oneDNN (layers.PackedLinear): eager decoding ~2x faster there
    target, _, _, dtype = load_pair(args.target, None, args.dtype, args.device)
    share = args.sampled_share
    meta = {"target": str(args.target), "prompts": str(args.prompts), "chat": args.chat,
            "max_new_tokens": args.max_new_tokens, "max_prompt_tokens": args.max_prompt_tokens,
            "temperature": args.temperature if share else 0.0, "sampled_share": share, "dtype": str(dtype)}
    peak = matmul_peak(dtype)  # this machine's ceiling in the run's dtype, on the run's threads
    console.log(f"a 2048^3 {str(dtype).replace('torch.', '')} matmul runs {peak:.0f} GFLOP/s on "
                f"{torch.get_num_threads()} threads here")
    before = len(torch.load(args.out)["sequences"]) if Path(args.out).is_file() else 0  # sequences from earlier runs
    t0 = time.perf_counter()
    data = generate_chat(target, ids, args.max_new_tokens, args.batch_size, Path(args.out), meta, console,
                         args.temperature, share, args.seconds)
    seconds = time.perf_counter() - t0
    lens = [len(s) - st for s, st in zip(data["sequences"], data["starts"])]
    new = sum(lens[before:])
    rate = new / seconds
    console.log(f"{args.out}: {len(lens)} sequences, {sum(lens)} generated tokens (mean {sum(lens) / len(lens):.0f}); "
                f"this run {new} in {seconds:.0f} s: {rate:.0f} tokens/s, {rate / torch.get_num_threads():.0f} per "
                f"thread-second, {rate * flop_per_token(target.cfg) / 1e9 / peak:.0%} of the matmul peak (weights' "
                f"FLOP only: prompts, attention and sampling come on top)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
