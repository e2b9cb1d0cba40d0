"""The corpus of minidcut's demo targets and drafters: the Python standard library sources.

Files: every `*.py` under the running interpreter's stdlib directory
(`sysconfig.get_paths()['stdlib']`) except paths with a component `test`, `tests`, `idlelib` or
`site-packages`, sorted. With a corpus directory (`--corpus DIR` in the tools): every `*.py` and
`*.txt` under DIR instead, sorted, nothing excluded.

Held-out split (fixed, by file): a file is held out iff int(sha256(relpath)[:8 hex digits]) % 100 < 3,
where relpath is its POSIX path relative to the corpus root (e.g. `unittest/loader.py`). About 3% of the
files; for CPython 3.11.7 that is 21 of 674 files (335 kB), among them `ast.py`, `locale.py`,
`importlib/abc.py`, `unittest/loader.py`. All other files are the train split.

Prompts: `python -m tools.corpus --prompts models/prompts_heldout.jsonl` writes the held-out prompt set,
function openings (the `def` through its docstring or first body line) from held-out files, so a model
continues a function it has never seen.
"""

import argparse
import hashlib
import json
import re
import sys
import sysconfig
import textwrap
from pathlib import Path

# Run as a script: import from the repo root, and never let tools/profile.py shadow the stdlib module.
if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402

SPLITS = ("train", "heldout")
EXCLUDED_DIRS = {"test", "tests", "idlelib", "site-packages"}
HELDOUT_PERCENT = 3
PROMPT_CHARS = (40, 200)  # min and max length of one prompt
MAX_PROMPTS = 200
DEF_LINE = re.compile(r"^\s*(async\s+)?def\s")


def is_heldout(relpath: str) -> bool:
    """The held-out rule above, on a POSIX path relative to the corpus root."""
    return int(hashlib.sha256(relpath.encode()).hexdigest()[:8], 16) % 100 < HELDOUT_PERCENT


def list_files(split: str, corpus_dir: str | Path | None = None) -> list[Path]:
    """The sorted files of one split ('train' or 'heldout') of the stdlib or of corpus_dir."""
    assert split in SPLITS, split
    if corpus_dir is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = [p for p in root.rglob("*.py") if not EXCLUDED_DIRS & set(p.relative_to(root).parts)]
    else:
        root = Path(corpus_dir)
        files = [p for p in root.rglob("*") if p.suffix in (".py", ".txt") and p.is_file()]
    return sorted(p for p in files if is_heldout(p.relative_to(root).as_posix()) == (split == "heldout"))


def read_texts(files: list[Path]) -> list[str]:
    return [p.read_text(encoding="utf-8") for p in files]


def token_stream(split: str, tokenizer, corpus_dir: str | Path | None = None) -> torch.Tensor:
    """All files of a split tokenized and concatenated, each followed by eos (<|endoftext|>): [N]."""
    docs = tokenizer(read_texts(list_files(split, corpus_dir)), add_special_tokens=False)["input_ids"]
    return torch.tensor([t for doc in docs for t in doc + [tokenizer.eos_token_id]], dtype=torch.long)


def sequences(split: str, tokenizer, seq_len: int, corpus_dir: str | Path | None = None) -> torch.Tensor:
    """A split's token stream cut into consecutive, non-overlapping rows of seq_len tokens: [S, seq_len]."""
    stream = token_stream(split, tokenizer, corpus_dir)  # [N]
    rows = len(stream) // seq_len
    return stream[: rows * seq_len].view(rows, seq_len)


def _signature_end(lines: list[str], i: int) -> int | None:
    """Index of the line that closes the signature of the def at line i, None for a one-line def."""
    depth = 0
    for j in range(i, len(lines)):
        depth += sum(lines[j].count(c) for c in "([{") - sum(lines[j].count(c) for c in ")]}")
        if depth <= 0:
            return j if lines[j].rstrip().endswith(":") and j + 1 < len(lines) else None
    return None


def _function_prompt(lines: list[str], i: int) -> str | None:
    """The def at line i through its whole docstring, else through its first body line, if either fits."""
    sig_end = _signature_end(lines, i)
    if sig_end is None:
        return None
    first = sig_end + 1
    ends = [first]
    body = lines[first].strip().lstrip("rR")
    quote = body[:3]
    if quote in ('"""', "'''") and body.count(quote) < 2:  # a docstring that goes on: try it whole first
        close = next((k for k in range(first + 1, len(lines)) if quote in lines[k]), None)
        ends = [close, first] if close is not None else ends
    for end in ends:
        text = textwrap.dedent("".join(lines[i : end + 1]))
        if PROMPT_CHARS[0] <= len(text) <= PROMPT_CHARS[1]:
            return text
    return None


def heldout_prompts(corpus_dir: str | Path | None = None, max_prompts: int = MAX_PROMPTS) -> list[str]:
    """Distinct function openings from the held-out files, evenly subsampled to at most max_prompts."""
    found = {}  # dict keeps first-seen order
    for text in read_texts(list_files("heldout", corpus_dir)):
        lines = text.splitlines(keepends=True)
        for i, line in enumerate(lines):
            if DEF_LINE.match(line) and (prompt := _function_prompt(lines, i)):
                found.setdefault(prompt, None)
    prompts = list(found)
    n = min(max_prompts, len(prompts))
    return [prompts[k * len(prompts) // n] for k in range(n)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", help="directory of *.py/*.txt files (default: the stdlib)")
    parser.add_argument("--prompts", help="write the held-out prompt set to this JSONL file")
    args = parser.parse_args()
    for split in SPLITS:
        files = list_files(split, args.corpus)
        print(f"{split}: {len(files)} files, {sum(p.stat().st_size for p in files) / 1e6:.2f} MB")
    if args.prompts:
        prompts = heldout_prompts(args.corpus)
        with open(args.prompts, "w") as f:
            f.writelines(json.dumps({"prompt": p}) + "\n" for p in prompts)
        print(f"wrote {len(prompts)} prompts to {args.prompts}")


if __name__ == "__main__":
    main()
