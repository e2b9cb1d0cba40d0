"""Chat prompts for the real pair (SmolLM2-135M-Instruct and its drafter), written from local sources.

Two sets from disjoint sources, so the held-out set measures a drafter on prompts of a kind it never saw:

train     instructions and coding tasks built from the Python standard library's code and docstrings
          (the train split of tools/corpus.py): write a function from its docstring, explain a function,
          write a docstring, summarise a module's documentation, write tests, and so on. Two rounds:
          every definition once under a random template, then once more under another template.
heldout   (a) the Python language reference shipped with the interpreter (`pydoc_data.topics`, one
          explanation request and one summary request per topic), and (b) hand-written general
          instructions and classic programming exercises (tools/handwritten_prompts.jsonl). Nothing in
          it comes from the stdlib's code or docstrings.

    python tools/chat_prompts.py --train /tmp/chat_train.jsonl --heldout models/prompts_chat_heldout.jsonl

Each line is {"prompt": "..."}: a user message, put under the chat template by `--chat`.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import re
import sys
import textwrap
from pathlib import Path

# Run as a script: import from the repo root, and never let tools/profile.py shadow the stdlib module.
if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from tools import corpus  # noqa: E402

HANDWRITTEN_FILE = Path(__file__).with_name("handwritten_prompts.jsonl")


def handwritten(group: str) -> list[str]:
    """Prompts written for this repository (tools/handwritten_prompts.jsonl), in file order, of one group:
    'instructions' (30 general instructions, then programming exercises: held-out part of this file's
    chat set) or a domain of the mixed held-out set of tools/prompt_sources.py ('chat', 'writing',
    'reasoning'). No public prompt set and no benchmark is their origin; nothing here is trained on."""
    records = (json.loads(line) for line in HANDWRITTEN_FILE.read_text().splitlines())
    return [r["prompt"] for r in records if r["group"] == group]


HANDWRITTEN = handwritten("instructions")

FUNCTION_TASKS = [
    "Write a Python function `{name}{args}` that does the following: {summary}",
    "Explain what the following Python function does.\n\n```python\n{code}\n```",
    "Write a docstring for this Python function.\n\n```python\n{code_nodoc}\n```",
    "Write unit tests with pytest for this function.\n\n```python\n{code}\n```",
    "Rewrite this function so that it is easier to read, and explain your changes.\n\n```python\n{code}\n```",
    "{summary} How would you do this in Python? Show the code.",
    "Is there a bug in this Python function? Explain.\n\n```python\n{code}\n```",
    "Add type hints to this Python function.\n\n```python\n{code_nodoc}\n```",
]
CLASS_TASKS = [
    "Write a Python class `{name}`. Its purpose: {summary}",
    "Explain the purpose of this Python class from its definition.\n\n```python\n{code}\n```",
]
MODULE_TASKS = [
    "The Python module `{name}` is documented as follows:\n\n{doc}\n\nSummarize what it is for in a few sentences.",
    "What is the Python standard library module `{name}` used for? Give a short example.",
]
TOPIC_TASKS = [
    "Explain {title} in Python, with a short example.",
    "Summarize this part of the Python language reference in plain words:\n\n{text}",
]
MAX_CODE_LINES = 30


def first_sentence(doc: str) -> str | None:
    """The docstring's first sentence, if it reads like one (10-200 characters)."""
    para = " ".join(doc.strip().split("\n\n")[0].split())
    m = re.match(r"(.+?[.!?])(\s|$)", para)
    text = m.group(1) if m else para
    return text if 10 <= len(text) <= 200 and text[0].isalpha() else None


def _without_docstring(source: str, node) -> str:
    body0 = node.body[0]
    lines = source.splitlines()
    keep = lines[: body0.lineno - 1 - node.lineno + 1] + lines[body0.end_lineno - node.lineno + 1:]
    return "\n".join(keep) if len(keep) > 1 else source


def stdlib_tasks(rng: random.Random, rng2: random.Random) -> tuple[list[str], list[str]]:
    """Two tasks per definition (and module) of the train split, from two different templates.

    The first task's template is drawn by `rng`, the second's by `rng2` among the other templates, so the
    first list is the same whether or not the second is wanted (data files made from it stay valid).
    """
    first, second = [], []

    def add(templates: list[str], **fields) -> None:
        t = rng.choice(templates)
        first.append(t.format(**fields))
        i = templates.index(t)
        second.append(templates[(i + 1 + rng2.randrange(len(templates) - 1)) % len(templates)].format(**fields))

    for path in corpus.list_files("train"):
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        mod_doc = ast.get_docstring(tree)
        name = path.stem if path.stem != "__init__" else path.parent.name
        if mod_doc and 40 <= len(mod_doc.split("\n\n")[0]) <= 800:
            add(MODULE_TASKS, name=name, doc=mod_doc.split("\n\n")[0].strip())
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            summary = first_sentence(doc) if doc else None
            source = ast.get_source_segment(text, node, padded=True)  # first line indented like the rest
            if summary is None or source is None or len(source.splitlines()) > MAX_CODE_LINES:
                continue
            code = textwrap.dedent(source)
            if isinstance(node, ast.ClassDef):
                add(CLASS_TASKS, name=node.name, summary=summary, code=code)
                continue
            args = "(" + ast.unparse(node.args) + ")"
            add(FUNCTION_TASKS, name=node.name, args=args, summary=summary, code=code,
                code_nodoc=textwrap.dedent(_without_docstring(source, node)))
    return first, second


def reference_tasks() -> list[str]:
    """Two requests per topic of the shipped Python language reference."""
    import pydoc_data.topics as topics
    out = []
    for key, text in sorted(topics.topics.items()):
        title = text.strip().splitlines()[0].strip().replace('"', "`")
        title = "the" + title[3:] if title.startswith("The ") else title
        paras = [p for p in text.split("\n\n")[1:] if len(p.split()) > 15 and "::=" not in p]
        out.append(TOPIC_TASKS[0].format(title=title if len(title) < 60 else key))
        if paras:
            out.append(TOPIC_TASKS[1].format(text=" ".join(paras[0].split())[:700]))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train", help="write the training prompts here (JSONL)")
    p.add_argument("--heldout", help="write the held-out prompts here (JSONL)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rng, rng2 = random.Random(args.seed), random.Random(args.seed + 1)
    first, second = stdlib_tasks(rng, rng2)
    rng.shuffle(first)
    rng2.shuffle(second)
    # The second round goes after the first, so a data file distilled from the first N prompts stays valid.
    sets = {"train": first + second, "heldout": reference_tasks() + HANDWRITTEN}
    for name, prompts in sets.items():
        path = getattr(args, name)
        print(f"{name}: {len(prompts)} prompts" + (f" -> {path}" if path else ""))
        if path:
            with open(path, "w") as f:
                f.writelines(json.dumps({"prompt": q}) + "\n" for q in prompts)


if __name__ == "__main__":
    main()
