"""Refuse a prompt or training-data file that shares a long run of words with a benchmark's test set.

    python tools/decontaminate.py models/prompts_mix_train.jsonl.gz --test /tmp/testsets/mt_bench.jsonl \
        --test /tmp/testsets/HumanEval.jsonl.gz ...

DATA is a prompts file (.jsonl or .jsonl.gz: every string of a line, so a prompt and the contents of its
messages) or a self-distilled data file (.pt, tools/distill.py: token ids, decoded with the target's
tokenizer, `--tokenizer`, default the directory the file records; the prompt part of each sequence, and
the target's answers too with `--answers`). A TEST file is .jsonl, .json or either gzipped; every string
in it, at any depth, is test text. Texts are compared as lowercase words without punctuation
(tools/dedup.py:words): DATA fails when one of its lines holds a run of --n (13) words, not all numbers,
that a test text holds too. Exit status 0 with one line `clean: ...`, or 1 with one line naming the first
offending line, the test file and line it matches, and how many lines of DATA match in all. The test sets
are not part of this repository: models/smollm2-135m-instruct-dflash/DATA.md says where they come from.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: import from the repo root, not tools/
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from tools.dedup import words  # noqa: E402


def strings(obj):
    """Every string inside a JSON value."""
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from strings(v)


def read_text(path: Path) -> str:
    if not path.is_file():
        raise SystemExit(f"error: {path} not found")
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        return raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SystemExit(f"error: {path}: not UTF-8 text{' (or not gzip)' if path.suffix == '.gz' else ''}: {e}")


def json_units(path: Path) -> list[tuple[str, str]]:
    """(where, text) per line of a .jsonl file, or per item of a .json list (per key of a .json object)."""
    text = read_text(path)
    name = path.name.removesuffix(".gz")
    if name.endswith(".json"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise SystemExit(f"error: {path}: not valid JSON ({e})")
        items = enumerate(obj, 1) if isinstance(obj, list) else obj.items() if isinstance(obj, dict) else [(1, obj)]
        return [(f"{path}:item {k}", "\n".join(strings(v))) for k, v in items]
    if not name.endswith(".jsonl"):
        raise SystemExit(f"error: {path}: expected .jsonl, .json, .jsonl.gz or .json.gz")
    out = []
    for n, line in enumerate(text.split("\n"), 1):  # not splitlines(): JSON strings may hold U+2028
        if line.strip():
            try:
                out.append((f"{path}:{n}", "\n".join(strings(json.loads(line)))))
            except json.JSONDecodeError as e:
                raise SystemExit(f"error: {path}:{n}: not valid JSON ({e})")
    return out


def distilled_units(path: Path, tokenizer_dir: str | None, answers: bool) -> list[tuple[str, str]]:
    """(where, text) per sequence of a tools/distill.py data file, decoded with the target's tokenizer."""
    import torch

    from minidcut import load_tokenizer
    data = torch.load(path)
    tok_dir = tokenizer_dir or data.get("meta", {}).get("target")
    tok = load_tokenizer(tok_dir) if tok_dir and Path(tok_dir).is_dir() else None
    if tok is None:
        raise SystemExit(f"error: {path} holds token ids: give --tokenizer DIR (the target's; {tok_dir} has none)")
    return [(f"{path}:sequence {i}", tok.decode(seq if answers else seq[:start], skip_special_tokens=True))
            for i, (seq, start) in enumerate(zip(data["sequences"], data["starts"]), 1)]


def ngrams(ws: list[str], n: int):
    """The word n-grams that hold a letter: a run of numbers alone ("1 2 3 ... 13") proves nothing."""
    grams = (" ".join(ws[i:i + n]) for i in range(len(ws) - n + 1))
    return (g for g in grams if not g.replace(" ", "").isdigit())


def index(tests: list[Path], n: int) -> dict[int, str]:
    """Every n-gram of the test sets (by hash) -> where it first occurs."""
    out: dict[int, str] = {}
    for t in tests:
        for where, text in json_units(t):
            for g in ngrams(words(text), n):
                out.setdefault(hash(g), where)
    return out


def check(units: list[tuple[str, str]], test_index: dict[int, str], n: int) -> list[tuple[str, str, str]]:
    """The offending units: (where, the test's where, the shared n-gram), each unit once."""
    bad = []
    for where, text in units:
        for g in ngrams(words(text), n):
            if hash(g) in test_index:
                bad.append((where, test_index[hash(g)], g))
                break
    return bad


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data", help="prompts file (.jsonl, .jsonl.gz) or self-distilled data file (.pt)")
    p.add_argument("--test", action="append", required=True, help="a test set (.jsonl, .json, gzipped too); repeatable")
    p.add_argument("--n", type=int, default=13, help="words in a run that may not be shared")
    p.add_argument("--tokenizer", default=None, help=".pt data: the target's directory (default: the one it records)")
    p.add_argument("--answers", action="store_true", help=".pt data: check the target's answers too")
    args = p.parse_args(argv)
    if args.n < 1:
        raise SystemExit("error: --n must be at least 1")
    data = Path(args.data)
    if data.suffix == ".pt":
        if not data.is_file():
            raise SystemExit(f"error: {data} not found")
        units = distilled_units(data, args.tokenizer, args.answers)
    else:
        units = json_units(data)
    test_index = index([Path(t) for t in args.test], args.n)
    bad = check(units, test_index, args.n)
    if bad:
        where, test, gram = bad[0]
        raise SystemExit(f'error: {where} shares a {args.n}-word run with {test}: "{gram}" '
                         f"({len(bad)} of {len(units)} lines of {data} share one)")
    print(f"clean: {len(units)} lines of {data} share no {args.n}-word run with {len(args.test)} test files "
          f"({len(test_index)} distinct {args.n}-grams)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
