"""Self-distilled training data for a drafter: the target's own greedy text.

At inference the drafter continues the target's text, so that is the text it learns from. Two sources:

corpus   windows of the Python standard library (tools/corpus.py) continued greedily by the target
chat     prompts from a JSONL file put under the target's chat template and answered greedily by the
         target until its EOS or --max-new-tokens

A data file holds the token sequences (prompt + continuation) and, per sequence, the first position
a drafter is trained to draft from (`starts`: the first generated token in chat mode). Chat data is
written in resumable chunks: run the command again and it continues where the file stops.

    python tools/chat_prompts.py --train /tmp/chat_train.jsonl
    python tools/distill.py --target models/smollm2-135m-instruct --prompts /tmp/chat_train.jsonl \
        --chat --max-new-tokens 256 --out /tmp/smollm2_chat.pt
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # run as a script: import from the repo root, not tools/
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402
from rich.console import Console  # noqa: E402

from minidcut import Engine, cli, load_target, load_tokenizer  # noqa: E402

CHUNK = 256  # prompts per generate() call between saves


def save(data: dict, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(data, tmp)
    os.replace(tmp, path)  # a crash never leaves half a file


@torch.inference_mode()
def generate_chat(target, prompts: list[list[int]], max_new_tokens: int, batch_size: int, out: Path,
                  meta: dict, console: Console) -> dict:
    """Greedy answers to `prompts` (token ids), appended to the data file `out` chunk by chunk."""
    data = torch.load(out) if out.is_file() else {"sequences": [], "starts": [], "meta": meta}
    if data["meta"].get("prompts") != meta.get("prompts"):
        raise SystemExit(f"error: {out} was made from {data['meta'].get('prompts')}, not {meta.get('prompts')}")
    done = len(data["sequences"])
    max_seq = max(map(len, prompts)) + max_new_tokens + 2
    engine = Engine(target, None, batch_size=batch_size, max_seq=max_seq, compile=False)
    t0 = time.time()
    for i in range(done, len(prompts), CHUNK):
        chunk = prompts[i:i + CHUNK]
        outs, stats = engine.generate(chunk, max_new_tokens)
        data["sequences"] += [p + o for p, o in zip(chunk, outs)]
        data["starts"] += [len(p) for p in chunk]
        save(data, out)
        n = len(data["sequences"])
        rate = sum(map(len, data["sequences"][done:])) / (time.time() - t0)
        console.log(f"{n}/{len(prompts)} answered ({stats.generated_tokens} tokens in this chunk, "
                    f"{rate:.0f} tokens/s overall)")
    return data


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="target model directory (HF layout)")
    p.add_argument("--prompts", required=True, help='JSONL of {"prompt": "..."} (or {"messages": [...]}) lines')
    p.add_argument("--chat", action="store_true", help="put each prompt under the chat template")
    p.add_argument("--max-prompt-tokens", type=int, default=384, help="skip longer prompts")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--limit", type=int, default=None, help="use the first N prompts")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", required=True, help="data file (.pt); an existing one is continued")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console()
    tok = load_tokenizer(args.target)
    every, _ = cli.read_prompts(args.prompts, None, tok, args.chat, args.target)
    ids = [x for x in every[: args.limit] if len(x) <= args.max_prompt_tokens]
    console.log(f"{len(ids)} prompts of {len(every[: args.limit])} fit --max-prompt-tokens {args.max_prompt_tokens}")
    target = load_target(args.target)
    if target.model.embed_tokens.weight.device.type == "cpu":
        target.pack()  # eager decoding: linear layers packed for oneDNN (layers.PackedLinear), ~2x faster here
    meta = {"target": str(args.target), "prompts": str(args.prompts), "chat": args.chat,
            "max_new_tokens": args.max_new_tokens, "max_prompt_tokens": args.max_prompt_tokens}
    data = generate_chat(target, ids, args.max_new_tokens, args.batch_size, Path(args.out), meta, console)
    lens = [len(s) - st for s, st in zip(data["sequences"], data["starts"])]
    console.log(f"{args.out}: {len(lens)} sequences, {sum(lens)} generated tokens (mean {sum(lens) / len(lens):.0f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
