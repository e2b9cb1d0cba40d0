"""Training and held-out prompt files for a chat drafter, from permissively licensed public prompt sets.

Every source file is pinned by its git blob id (SOURCES) and read from a local copy: `--mirror DIR` holds
bare git mirrors as DIR/owner+name/repo (the layout of a mirror directory; a blob is read from the
source's repository or from one that holds the same blob, `copies`), `--raw DIR` the files themselves as
DIR/owner/name/path (checked against the blob id). The prompts (never the answers) are written as JSONL
lines {"prompt", "source", "domain"} (domain: chat, writing, code, math or reasoning), follow-up turns of
a conversation with "messages" as well. Exact duplicates (same lowercase words) and near duplicates
(tools/dedup.py) are dropped, held-out prompts first, so no training prompt repeats a held-out one, and
with `--exclude TEST` every prompt that shares a 13-word run with a test set (tools/decontaminate.py).

Per domain, the held-out prompts come from sources the training prompts never draw from (the split of
each source is in SOURCES; the prompts written for this repository, tools/handwritten_prompts.jsonl, are
held out too). The training file takes the domains in turn (each shuffled), so
its first N prompts are balanced across domains (tools/distill.py --limit N), until chat, the smallest,
runs out.

    python tools/prompt_sources.py --mirror /work/.mirror --train models/prompts_mix_train.jsonl.gz \
        --heldout models/prompts_mix_heldout.jsonl --exclude /tmp/testsets/alpaca_eval.json ...

models/smollm2-135m-instruct-dflash/DATA.md lists the sources, their licences and the counts.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import hashlib
import json
import random
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

if __name__ == "__main__":  # run as a script: import from the repo root, not tools/
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from tools import chat_prompts, decontaminate  # noqa: E402
from tools.dedup import NearDup, words  # noqa: E402

DOMAINS = ("chat", "writing", "code", "math", "reasoning")
# Cues for sources that mix domains, tried in this order (a Python task that mentions a sum is code).
CUES = [
    ("code", r"\b(python|javascript|typescript|java|c\+\+|c#|rust|golang|sql|html|css|bash|regex|function|"
             r"code|coding|program|programming|script|algorithm|compile|debug|json|linux|git|api)\b|```"),
    ("math", r"\b(calculate|compute|solve|equation|integral|derivative|probability|percent|percentage|"
             r"average|ratio|theorem|arithmetic|math|maths|mathematics)\b|\d+\s*[-+*/^x]\s*\d+"),
    ("reasoning", r"\b(riddle|puzzle|logic|logical|logically|deduce|infer|reasoning|analogy|paradox|"
                  r"argument|fallacy|true or false)\b"),
    ("writing", r"\b(write|rewrite|compose|poem|story|essay|letter|email|haiku|limerick|lyrics|song|blog|"
                r"tweet|slogan|headline|paraphrase|summarize|summarise|translate|article|speech|pretend|"
                r"imagine|roleplay|role-play)\b"),
]


def guess_domain(text: str, domains=DOMAINS) -> str:
    low = text.lower()
    return next((d for d, cue in CUES if d in domains and re.search(cue, low)), "chat")


def item(prompt: str, domain: str, messages: list[dict] | None = None) -> dict:
    out = {"prompt": prompt.strip(), "domain": domain}
    if messages:
        out["messages"] = messages
    return out


def with_input(instruction: str, inp: str) -> str:
    """An instruction and its optional input (the alpaca layout) as one user message."""
    return instruction.strip() + ("\n\n" + inp.strip() if inp and inp.strip() else "")


def jsonl(raw: bytes) -> list:
    return [json.loads(line) for line in raw.decode("utf-8").split("\n") if line.strip()]


# ---- readers: raw file bytes -> prompt items ----------------------------------------------------


def read_gsm8k(raw):
    return [item(x["question"], "math") for x in jsonl(raw)]  # never the answer


def read_aqua(raw):
    return [item(x["question"] + "\n\nOptions: " + ", ".join(x["options"]), "math") for x in jsonl(raw)]


def read_strategyqa(raw):
    return [item(x["question"], "reasoning") for x in json.loads(raw)]


def read_gpteacher(domain: str):
    def read(raw):
        return [item(with_input(x["instruction"], x["input"]), domain) for x in json.loads(raw)]
    return read


TOOL_DOMAIN = {"python": "code", "shell": "code", "wolfram": "math", "wikipedia": "chat"}


def read_toolformer(raw):
    """The task of every single-tool example whose tool needs no live data, without the tool's header."""
    out = []
    for x in json.loads(raw):
        lines = x["instruction"].strip().split("\n")
        tool = lines[1].removeprefix("toolformer access: ").strip() if len(lines) > 4 else ""
        if tool in TOOL_DOMAIN:
            out.append(item(with_input(lines[-1], x["input"]), TOOL_DOMAIN[tool]))
    return out


def read_self_instruct_seeds(raw):
    out = []
    for x in jsonl(raw):
        text = with_input(x["instruction"], x["instances"][0]["input"])
        out.append(item(text, guess_domain(text)))
    return out


def read_oasst_lottery(raw):
    return [item(t, guess_domain(t)) for t in jsonl(raw)]


def read_oasst_trees(raw):
    """Every human-written English prompt of the message trees: the first turns, and each follow-up
    with the conversation before it (the assistant turns there are the trees' replies, context only)."""
    out = []

    def ok(m):
        return m.get("lang") == "en" and not m.get("deleted") and m.get("review_result") and not m.get("synthetic")

    def walk(m, path):
        if not ok(m):
            return
        path = path + [{"role": "user" if m["role"] == "prompter" else "assistant", "content": m["text"]}]
        if m["role"] == "prompter":  # a follow-up's domain: that of the user's turns together
            asked = " ".join(x["content"] for x in path if x["role"] == "user")
            out.append(item(m["text"], guess_domain(asked), path if len(path) > 1 else None))
        for r in m.get("replies", []):
            walk(r, path)

    for tree in jsonl(raw):
        walk(tree["prompt"], [])
    return out


MBPP_TEST_IDS = range(11, 511)  # the benchmark's test split (its README); 1-10 and 511+ are train/validation


def read_mbpp_heldout(raw):
    return [item(f"{x['text']}\nYour code should pass this test: {x['test_list'][0]}", "code")
            for x in jsonl(raw) if x["task_id"] not in MBPP_TEST_IDS]


def read_svamp(raw):
    out = []
    for x in json.loads(raw):
        body, q = x["Body"].strip(), x["Question"].strip()
        # Bodies that end mid-sentence ("If she still needs 5 more cups") run into the question.
        text = f"{body} {q}" if body.endswith((".", "!", "?")) else f"{body}, {q[0].lower()}{q[1:]}"
        out.append(item(text, "math"))
    return out


# ---- sources ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    name: str
    repo: str
    path: str
    blob: str  # git blob id of the file read
    license: str
    split: str  # train | heldout
    read: Callable[[bytes], list[dict]]
    sample: int | None = None  # held-out: this many, drawn with the seed before dedup
    copies: tuple[str, ...] = ()  # other repositories holding the same blob


OA = "model/model_eval/manual/data/"
SOURCES = [  # a table: one row per file, alike by design
    # training: human-written chat first (dedup keeps the first of duplicates)
    Source("oasst-lottery", "LAION-AI/Open-Assistant", OA + "prompt_lottery_en_250_text.jsonl",
           "af992dd76724d37966f5c2439671294b0c632e2c", "Apache-2.0", "train", read_oasst_lottery),
    Source("oasst-trees", "LAION-AI/Open-Assistant", OA + "en_100_tree.jsonl",
           "7bbdb57f24f3a2dc6ebc5616df319bf09006b801", "Apache-2.0", "train", read_oasst_trees),
    Source("self-instruct-seeds", "yizhongw/self-instruct", "data/seed_tasks.jsonl",
           "c97d40d76abd45cd7456f2d0d58459bb4df3cad5", "Apache-2.0", "train", read_self_instruct_seeds),
    Source("gsm8k-train", "openai/grade-school-math", "grade_school_math/data/train.jsonl",
           "7d97154b91aef28d01c3301741c81ce90039a4b1", "MIT", "train", read_gsm8k),
    Source("aqua-dev", "deepmind/AQuA", "dev.json",
           "cfed85490f72da6bb4d108e040c510d3e0b22d2a", "Apache-2.0", "train", read_aqua),
    Source("strategyqa-train", "eladsegal/strategyqa", "data/strategyqa/train.json",
           "df79706e10671bebebb87a610fdd434576c27a18", "MIT", "train", read_strategyqa),
    Source("strategyqa-dev", "eladsegal/strategyqa", "data/strategyqa/dev.json",
           "32932a11f4d7033bb700cacf5826d85607ba868c", "MIT", "train", read_strategyqa),
    Source("gpteacher-codegen", "teknium1/GPTeacher", "Codegen/codegen-instruct.json",
           "83c30caecc5bb9899cd2cc501842b6c2672f8626", "MIT", "train", read_gpteacher("code")),
    Source("gpteacher-roleplay", "teknium1/GPTeacher", "Roleplay/roleplay-simple-deduped-roleplay-instruct.json",
           "20a44bd7553e4874384db7ae3d9a86d785818a90", "MIT", "train", read_gpteacher("writing")),
    Source("gpteacher-toolformer", "teknium1/GPTeacher", "Toolformer/toolformer-dedupe-only-dataset.json",
           "6f41cc8f24eaa404ed0f909841ff9769fef81158", "MIT", "train", read_toolformer),
    # held out: code, math (and chat, writing, reasoning: hand-written, below)
    Source("mbpp-train-split", "google-research/google-research", "mbpp/mbpp.jsonl",
           "a7e2e271cd7d54491cbbe9078f0cf759558111b0", "CC-BY-4.0 (data), Apache-2.0 (repository)", "heldout",
           read_mbpp_heldout, sample=40, copies=("FormulaMonks/llm-benchmarker-suite",)),
    Source("svamp", "arkilpatel/SVAMP", "SVAMP.json",
           "aad093525105c6331581d7082250b9c22578271e", "MIT", "heldout", read_svamp, sample=50),
]


PROGRAMMING_FROM = 30  # chat_prompts.HANDWRITTEN: 30 general instructions, then programming exercises


def handwritten() -> list[dict]:
    """The held-out prompts written in this repository (tools/handwritten_prompts.jsonl: those of the chat
    set, whose programming exercises are code and the others' domain is guessed, then one group a domain)."""
    general = [d for d in DOMAINS if d != "code"]
    out = [dict(item(p, "code" if i >= PROGRAMMING_FROM else guess_domain(p, general)),
                source="handwritten-chat-prompts") for i, p in enumerate(chat_prompts.HANDWRITTEN)]
    for domain in ("chat", "writing", "reasoning"):
        out += [dict(item(p, domain), source="handwritten") for p in chat_prompts.handwritten(domain)]
    return out


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def load(src: Source, mirror: Path | None, raw: Path | None) -> bytes:
    """The source file's bytes, from a raw copy (checked against its blob id) or a bare git mirror."""
    if raw is not None:
        path = raw / src.repo / src.path
        if not path.is_file():
            raise SystemExit(f"error: {src.name}: {path} not found")
        data = path.read_bytes()
        if git_blob_id(data) != src.blob:
            raise SystemExit(f"error: {src.name}: {path} is blob {git_blob_id(data)}, not the pinned {src.blob}")
        return data
    tried = []
    for repo in (src.repo, *src.copies):
        git_dir = mirror / repo.replace("/", "+") / "repo"
        tried.append(str(git_dir))
        if git_dir.is_dir():
            r = subprocess.run(["git", "--git-dir", str(git_dir), "cat-file", "blob", src.blob], capture_output=True)
            if r.returncode == 0:
                return r.stdout
    raise SystemExit(f"error: {src.name}: blob {src.blob} ({src.repo}:{src.path}) is in none of {', '.join(tried)}")


def contaminated(items: list[dict], test_index: dict, n: int = 13) -> set[int]:
    """Indices of the items that share an n-word run with a test set (tools/decontaminate.py)."""
    units = [(str(i), "\n".join(decontaminate.strings(x.get("messages") or x["prompt"]))) for i, x in enumerate(items)]
    return {int(where) for where, _, _ in decontaminate.check(units, test_index, n)}


def build(mirror: Path | None, raw: Path | None, tests: list[Path], seed: int = 0, log=print):
    """(train items, held-out items, per-source counts)."""
    rng = random.Random(seed)
    per_source = {}
    loaded = {"train": [], "heldout": []}
    for src in SOURCES:
        items = [dict(x, source=src.name) for x in src.read(load(src, mirror, raw))]
        per_source[src.name] = {"raw": len(items)}
        loaded[src.split].append((src, items))
    hand = handwritten()
    per_source["handwritten"] = {"raw": sum(x["source"] == "handwritten" for x in hand)}
    per_source["handwritten-chat-prompts"] = {"raw": len(hand) - per_source["handwritten"]["raw"]}
    test_index = decontaminate.index(tests, 13) if tests else {}
    dedup, conversations = NearDup(), set()
    out = {"train": [], "heldout": []}
    n_heldout = 0  # texts kept by the dedup filter before the first training prompt
    for split in ("heldout", "train"):  # held-out first: a training prompt that repeats one is dropped
        groups = loaded[split] + ([(None, hand)] if split == "heldout" else [])
        for src, items in groups:
            if src is not None and src.sample is not None and len(items) > src.sample:
                items = rng.sample(items, src.sample)  # before dedup: the held-out set is a plain sample
            bad = contaminated(items, test_index) if test_index else set()
            kept = []
            for i, x in enumerate(items):
                name = x["source"]
                c = per_source[name]
                if i in bad:
                    c["test_overlap"] = c.get("test_overlap", 0) + 1
                    continue
                if "messages" in x:  # a follow-up: its conversation must be new (no near test: a short
                    # follow-up to a long question would look like the question alone)
                    conv = " ".join(words(" ".join(m["content"] for m in x["messages"])))
                    what, j = ("exact", -1) if conv in conversations else ("kept", -1)
                    conversations.add(conv)
                else:
                    what, j = dedup.add(x["prompt"])
                if what != "kept":
                    what = "repeats_heldout" if split == "train" and 0 <= j < n_heldout else what
                    c[what] = c.get(what, 0) + 1
                    continue
                kept.append(x)
            for x in kept:
                per_source[x["source"]][split] = per_source[x["source"]].get(split, 0) + 1
            out[split] += kept
        n_heldout = len(dedup.kept)
    out["train"] = interleave(out["train"], rng)
    for name, c in per_source.items():
        log(f"{name}: " + ", ".join(f"{k} {v}" for k, v in c.items()))
    return out["train"], out["heldout"], per_source


def interleave(items: list[dict], rng: random.Random) -> list[dict]:
    """Shuffled within each domain, then one prompt of each domain in turn (a domain that runs out
    drops out): the first N prompts of the file are as balanced across domains as they can be."""
    by_domain = [[x for x in items if x["domain"] == d] for d in DOMAINS]
    for group in by_domain:
        rng.shuffle(group)
    longest = max(map(len, by_domain), default=0)
    return [g[i] for i in range(longest) for g in by_domain if i < len(g)]


def write(items: list[dict], path: Path) -> None:
    keys = ("prompt", "source", "domain", "messages")
    # ASCII JSON: a raw U+2028 inside a string would end the line for str.splitlines() readers
    text = "".join(json.dumps({k: x[k] for k in keys if k in x}) + "\n" for x in items)
    if path.suffix == ".gz":
        # mtime 0: the same prompts give the same bytes
        path.write_bytes(gzip.compress(text.encode("utf-8"), mtime=0))
    else:
        path.write_text(text, encoding="utf-8")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--mirror", help="directory of bare git mirrors, DIR/owner+name/repo")
    where.add_argument("--raw", help="directory of the source files, DIR/owner/name/path")
    p.add_argument("--train", help="write the training prompts here (.jsonl or .jsonl.gz)")
    p.add_argument("--heldout", help="write the held-out prompts here (.jsonl or .jsonl.gz)")
    p.add_argument("--exclude", action="append", default=[],
                   help="a test set (tools/decontaminate.py formats): drop prompts sharing a 13-word run with it")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for t in args.exclude:
        if not Path(t).is_file():
            raise SystemExit(f"error: test set {t} not found")
    train, heldout, _ = build(Path(args.mirror) if args.mirror else None, Path(args.raw) if args.raw else None,
                              [Path(t) for t in args.exclude], args.seed)
    for name, items in (("train", train), ("heldout", heldout)):
        by_domain = collections.Counter(x["domain"] for x in items)
        print(f"{name}: {len(items)} prompts (" + ", ".join(f"{d} {by_domain[d]}" for d in DOMAINS) + ")"
              + (f" -> {getattr(args, name)}" if getattr(args, name) else ""))
        if getattr(args, name):
            write(items, Path(getattr(args, name)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
