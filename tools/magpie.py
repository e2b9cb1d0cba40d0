"""Magpie-style prompts: the target writes the user's questions itself.

The target's chat template is rendered up to the start of a user turn (a system message, then the user
header, e.g. "<|im_start|>user\\n" for SmolLM2) and the target samples what follows (temperature 1.0,
top-p 0.95 by default) until its end of turn: questions of the kind its own chat training taught it to
expect, which is the text its drafter will see. A system message steers the domain (DOMAIN_SYSTEM;
`chat` keeps the template's own default), loosely for a small model: every question is labelled with the
domain its words suggest (tools/prompt_sources.py:guess_domain), and a steered run keeps only questions
of its domain. Kept: finished questions of 8-200 words, mostly ASCII, that are no near duplicate
(tools/dedup.py) of a prompt already in the output file or in an `--against` file.

    python tools/magpie.py --target models/smollm2-135m-instruct --domain code --count 500 \\
        --against models/prompts_mix_heldout.jsonl --out /work/scratch/magpie.jsonl

Lines {"prompt", "source": "magpie", "domain", "seed"} are appended after every chunk of --batch-size
samples; run the command again to continue (the next chunk's seed follows the file's last). `--count`
is the number of lines of --domain the file should end with (an unsteered `chat` run also keeps the
questions it writes in other domains).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # run as a script: import from the repo root, not tools/
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402
from rich.console import Console  # noqa: E402

from minidcut import Engine, load_pair, load_tokenizer, runtime  # noqa: E402
from tools.dedup import NearDup  # noqa: E402
from tools.prompt_sources import guess_domain  # noqa: E402

DOMAIN_SYSTEM = {
    "chat": None,  # the chat template's default system message
    "writing": "You are a helpful assistant. Users ask you to write stories, poems, letters, emails and other texts.",
    "code": "You are a helpful assistant. Users ask you programming questions and coding tasks.",
    "math": "You are a helpful assistant. Users ask you math word problems and calculations.",
    "reasoning": "You are a helpful assistant. Users ask you logic puzzles and questions that need careful reasoning.",
}
MARK = "\x00MAGPIE\x00"  # stands for the user's words while the template is rendered
GIVE_UP = 20  # chunks in a row that keep nothing: the settings cannot work


def user_prefix(tok, system: str | None) -> list[int]:
    """Token ids of the chat template up to where the user's first message begins."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": MARK}]
    text = tok.apply_chat_template(messages, tokenize=False)
    if MARK not in text:
        raise SystemExit("error: the tokenizer's chat template does not show the user's message")
    return tok.encode(text[: text.index(MARK)], add_special_tokens=False)


def acceptable(text: str) -> bool:
    """8-200 words, at least 95% ASCII, and letters among them."""
    n = len(text.split())
    return 8 <= n <= 200 and sum(c.isascii() for c in text) >= 0.95 * len(text) and any(c.isalpha() for c in text)


def read_existing(out: Path, domain: str, dedup: NearDup) -> tuple[int, int]:
    """Adds the file's prompts to `dedup`; returns (lines of this domain, the next seed)."""
    kept, seed = 0, 0
    if out.is_file():
        for n, line in enumerate(out.read_text(encoding="utf-8").split("\n"), 1):
            if line.strip():
                try:
                    x = json.loads(line)
                    dedup.add(x["prompt"])
                    seed = max(seed, x["seed"] + 1)
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise SystemExit(f'error: {out}:{n}: not a magpie line {{"prompt", "seed", ...}}')
                kept += x.get("domain") == domain
    return kept, seed


@torch.inference_mode()
def sample_chunk(target, tok, prefix: list[int], n: int, args, seed: int) -> list[str]:
    """n sampled user turns; those that did not end within --max-new-tokens are dropped."""
    engine = Engine(target, None, batch_size=n, max_seq=len(prefix) + args.max_new_tokens + 2,
                    temperature=args.temperature, top_p=args.top_p, seed=seed, compile=False)
    outs, _ = engine.generate([prefix] * n, args.max_new_tokens)
    return [tok.decode(o, skip_special_tokens=True).strip() for o in outs if o and o[-1] in engine.eos]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="target model directory (HF layout, with a chat template)")
    p.add_argument("--out", required=True, help="JSONL file; an existing one is continued")
    p.add_argument("--domain", choices=sorted(DOMAIN_SYSTEM), default="chat")
    p.add_argument("--count", type=int, required=True, help="kept lines of this domain to end with")
    p.add_argument("--against", action="append", default=[], help="prompt files (JSONL) not to repeat")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--max-new-tokens", type=int, default=256, help="a longer question is dropped")
    p.add_argument("--batch-size", type=int, default=32, help="samples per chunk")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when there is one)")
    p.add_argument("--dtype", default=None, help="the target's dtype (default: bfloat16 on CUDA, float32 on a CPU)")
    p.add_argument("--seconds", type=float, default=None,
                   help="stop after the chunk that ends past this many seconds, with fewer than --count if so")
    args = p.parse_args(argv)
    runtime.setup(args.threads)
    console = Console()
    tok = load_tokenizer(args.target)
    if tok is None or not getattr(tok, "chat_template", None):
        raise SystemExit(f"error: {args.target} has no tokenizer with a chat template")
    dedup = NearDup()
    for path in args.against:
        if not Path(path).is_file():
            raise SystemExit(f"error: {path} not found")
        for line in Path(path).read_text(encoding="utf-8").split("\n"):
            if line.strip():
                dedup.add(json.loads(line).get("prompt", ""))
    out = Path(args.out)
    kept, seed = read_existing(out, args.domain, dedup)
    prefix = user_prefix(tok, DOMAIN_SYSTEM[args.domain])
    target, _, _, _ = load_pair(args.target, None, args.dtype, args.device)  # packed on a CPU, as in distill.py
    idle, t0 = 0, time.time()
    while kept < args.count:
        if args.seconds is not None and time.time() - t0 > args.seconds:
            console.log(f"stopping with {kept}/{args.count} {args.domain} prompts: past --seconds {args.seconds:.0f}")
            break
        texts = sample_chunk(target, tok, prefix, args.batch_size, args, seed)
        labelled = [(t, guess_domain(t)) for t in texts if acceptable(t)]
        new = [(t, d) for t, d in labelled if args.domain in ("chat", d) and dedup.add(t)[0] == "kept"]
        with out.open("a", encoding="utf-8") as f:
            f.writelines(json.dumps({"prompt": t, "source": "magpie", "domain": d, "seed": seed}) + "\n"
                         for t, d in new)
        kept += sum(d == args.domain for _, d in new)
        console.log(f"seed {seed}: {len(new)} kept of {args.batch_size} ({len(texts)} finished); "
                    f"{kept}/{args.count} {args.domain} prompts in {out}")
        seed += 1
        idle = 0 if new else idle + 1
        if idle == GIVE_UP:
            raise SystemExit(f"error: {GIVE_UP} chunks in a row kept no prompt: check --temperature, "
                             f"--max-new-tokens and the filters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
