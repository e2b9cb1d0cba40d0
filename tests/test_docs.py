"""The docs cannot rot: every `file.py:function` reference resolves, and every example runs."""

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tiny import make_tokenized_pair

ROOT = Path(__file__).resolve().parent.parent
REF = re.compile(r"`?((?:[\w./-]+/)?[\w-]+\.py):([A-Za-z_][\w.]*)")


def definitions(path: Path) -> set[str]:
    """Qualified names defined in a Python file: functions, classes, methods (Class.method)."""
    names = set()

    def walk(node, prefix=""):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(prefix + child.name)
                walk(child, prefix + child.name + ".")
    walk(ast.parse(path.read_text()))
    return names


def unresolved(doc: str) -> list[str]:
    """References in `doc` (markdown text) whose file or definition does not exist."""
    bad = []
    for file, name in REF.findall(doc):
        path = ROOT / file
        if not path.is_file() or name not in definitions(path):
            bad.append(f"{file}:{name}")
    return bad


@pytest.mark.parametrize("doc", ["docs/walkthrough.md", "README.md"])
def test_every_code_reference_in_the_docs_resolves(doc):
    text = (ROOT / doc).read_text()
    assert REF.findall(text) or doc == "README.md"
    assert unresolved(text) == []


def test_reference_check_fails_on_a_renamed_function():
    text = (ROOT / "docs/walkthrough.md").read_text()
    assert "minidcut/dcut.py:keep_lens" in text
    renamed = text.replace("minidcut/dcut.py:keep_lens", "minidcut/dcut.py:keep_lengths")
    assert unresolved(renamed) == ["minidcut/dcut.py:keep_lengths"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("docs_pair")
    target, drafter = make_tokenized_pair(root)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in
                               ["def heappush(heap, item):\n", "class Formatter:\n", "import re\n"]))
    return target, drafter, prompts


def run_example(name, *args):
    r = subprocess.run([sys.executable, str(ROOT / "examples" / name), *map(str, args)],
                       capture_output=True, text=True, timeout=600, env={"OMP_NUM_THREADS": "1",
                                                                         "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_quickstart_example_runs(pair):
    target, drafter, _ = pair
    out = run_example("quickstart.py", "--target", target, "--drafter", drafter, "--no-compile",
                      "--max-new-tokens", 12)
    assert "tau" in out


def test_selector_by_hand_example_runs(pair):
    target, drafter, prompts = pair
    out = run_example("selector_by_hand.py", "--target", target, "--drafter", drafter, "--prompts", prompts,
                      "--batch-size", 3)
    assert "rho*" in out and "keep_len" in out


def test_policies_side_by_side_example_runs(pair):
    target, drafter, prompts = pair
    out = run_example("policies_side_by_side.py", "--target", target, "--drafter", drafter, "--prompts",
                      prompts, "--batch-sizes", "2", "--max-new-tokens", "8", "--no-compile")
    assert "dcut" in out and "full" in out
