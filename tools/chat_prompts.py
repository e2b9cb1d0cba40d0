"""Chat prompts for the real pair (SmolLM2-135M-Instruct and its drafter), written from local sources.

Two sets from disjoint sources, so the held-out set measures a drafter on prompts of a kind it never saw:

train     instructions and coding tasks built from the Python standard library's code and docstrings
          (the train split of tools/corpus.py): write a function from its docstring, explain a function,
          write a docstring, summarise a module's documentation, write tests, and so on. Two rounds:
          every definition once under a random template, then once more under another template.
heldout   (a) the Python language reference shipped with the interpreter (`pydoc_data.topics`, one
          explanation request and one summary request per topic), and (b) hand-written general
          instructions and classic programming exercises (HANDWRITTEN below). Nothing in it comes from
          the stdlib's code or docstrings.

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

HANDWRITTEN = [
    "Give me three tips for staying focused while studying.",
    "Write a short poem about the ocean at night.",
    "What is the difference between weather and climate?",
    "Explain photosynthesis to a ten-year-old.",
    "Write a polite email asking my manager for a day off next Friday.",
    "What are the main causes of inflation?",
    "Summarize the plot of a typical hero's journey story.",
    "List five healthy breakfast ideas.",
    "How do vaccines train the immune system?",
    "Write a haiku about autumn leaves.",
    "What should I pack for a three-day hiking trip?",
    "Explain why the sky is blue.",
    "Give me a recipe for a simple tomato soup.",
    "What is the Pythagorean theorem? Give an example.",
    "Describe the water cycle in a few sentences.",
    "Suggest a name for a bakery and explain your choice.",
    "How can I improve my public speaking skills?",
    "Write a short story opening about a lighthouse keeper.",
    "What are the benefits of regular exercise?",
    "Explain what a black hole is.",
    "Translate 'Good morning, how are you?' into French and Spanish.",
    "Write a limerick about a cat who loves to code.",
    "What is the capital of Australia, and why is it not Sydney?",
    "Give me a plan for learning to play the guitar in three months.",
    "Explain the difference between a virus and a bacterium.",
    "What is machine learning, in plain words?",
    "How does a bicycle stay upright while moving?",
    "Write a thank-you note to a teacher.",
    "What are good habits for saving money?",
    "Explain how a rainbow forms.",
    "Write a function in Python that checks whether a string is a palindrome.",
    "Write a Python program that prints the first 20 Fibonacci numbers.",
    "Implement binary search in Python and explain how it works.",
    "Write a Python function that counts the vowels in a sentence.",
    "How do I reverse a linked list? Show code in Python.",
    "Write a Python function that returns the factorial of n, both recursively and iteratively.",
    "Write a Python script that reads a CSV file and prints the average of one column.",
    "Explain the difference between a list and a tuple in Python.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Implement a stack class in Python with push, pop and peek.",
    "Write a Python function that finds the most common word in a text.",
    "How do I remove duplicates from a list in Python while keeping the order?",
    "Write a Python function that converts Celsius to Fahrenheit.",
    "Explain what recursion is, with a simple example in Python.",
    "Write a Python function to check whether a number is prime.",
    "Write FizzBuzz in Python.",
    "Write a Python class for a bank account with deposit and withdraw methods.",
    "How do I sort a list of dictionaries by a key in Python?",
    "Write a Python function that flattens a nested list.",
    "Explain Big-O notation with examples.",
    "Write a SQL query that returns the ten most recent orders from an orders table.",
    "Write a JavaScript function that debounces another function.",
    "Explain the difference between HTTP GET and POST requests.",
    "Write a bash command that counts the lines in all .txt files in a folder.",
    "What is a hash table and why are lookups fast?",
    "Write a Python generator that yields prime numbers forever.",
    "How do I read a JSON file in Python and print one field?",
    "Write a Python function that computes the greatest common divisor of two numbers.",
    "Explain what an API is to a non-programmer.",
    "Write a Python function that checks whether two strings are anagrams.",
]

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
