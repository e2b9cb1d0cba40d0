"""The docs cannot rot: every `file.py:function` reference and every citation of a docs/method.md section
resolves inside the repository, nothing cites a file outside it, and every example runs."""

import ast
import functools
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


CITE = re.compile(r'docs/method\.md, "([^"]+)"')
PATH = re.compile(r"(?<![\w./-])((?:minidcut|tools|tests|examples|docs|models)/[\w./-]*\w)")


def tracked_texts() -> dict[str, str]:
    """Every Python and markdown file of the repository (git's view), by path."""
    files = subprocess.run(["git", "ls-files", "*.py", "*.md"], cwd=ROOT, capture_output=True, text=True, timeout=60).stdout
    return {f: (ROOT / f).read_text() for f in files.split() if (ROOT / f).is_file()}


def headings(path: Path) -> set[str]:
    return {line.lstrip("#").strip() for line in path.read_text().splitlines() if line.startswith("#")}


@functools.cache
def markdown_names() -> set[str]:
    """File names of the repository's markdown files (git's view)."""
    files = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True, timeout=60).stdout
    return {Path(f).name for f in files.split()}


def broken_citations(text: str) -> list[str]:
    """Citations `docs/method.md, "Title"` whose title is not a heading of docs/method.md, and
    references to things outside the repository: a path that climbs out of it (../), a markdown file
    the repository does not have, a numbered section (of a document it does not carry)."""
    known = headings(ROOT / "docs" / "method.md")
    bad = [f'"{t}"' for t in CITE.findall(text) if t not in known]
    ours = markdown_names()
    bad += re.findall(r"(?<![\w.])\.\./[\w./-]+", text)
    bad += [m for m in re.findall(r"\b[\w-]+\.md\b", text) if m not in ours]
    bad += re.findall(r"[Ss]ection \d+", text)
    return bad


def ignored(path: str) -> bool:
    """Whether git ignores the path: made locally (a fetched model), never in a clone."""
    # a pattern with a trailing slash matches only directories, and an absent path is no directory
    # to git: ask for the path as a directory as well
    return any(subprocess.run(["git", "check-ignore", "-q", p], cwd=ROOT, timeout=60).returncode == 0
               for p in (path, path.rstrip("/") + "/"))


def missing_paths(text: str) -> list[str]:
    """Repository paths (minidcut/..., docs/..., ...) named in `text` that do not exist (a trailing
    wildcard, a placeholder in capitals or a run's output file aside)."""
    out = []
    for p in PATH.findall(text):
        p = p.rstrip(".")
        if "*" in p or re.search(r"[A-Z]{3,}", p) or p.startswith("docs/bench/") or ignored(p):
            continue
        if not (ROOT / p).exists():
            out.append(p)
    return out


def test_every_citation_and_path_in_code_and_docs_resolves_inside_the_repository():
    texts = tracked_texts()
    assert len(texts) > 30 and any(CITE.search(t) for t in texts.values())
    bad = {f: b for f, t in texts.items() if f != "tests/test_docs.py" and (b := broken_citations(t) + missing_paths(t))}
    assert bad == {}


def test_the_citation_check_fails_on_a_missing_section_a_missing_file_and_an_outside_file():
    assert broken_citations('see docs/method.md, "Choosing rho"') == []
    assert broken_citations('see docs/method.md, "Choosing the rho"') == ['"Choosing the rho"']
    assert broken_citations("as NOTES.md section 3 says") == ["NOTES.md", "section 3"]
    assert broken_citations("see ../outside/spec.md and docs/method.md") == ["../outside/spec.md", "spec.md"]
    assert missing_paths("see minidcut/engine.py and docs/nothing.md") == ["docs/nothing.md"]


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
    out = run_example("quickstart.py", "--target", target, "--drafter", drafter, "--max-new-tokens", 12)
    assert "tau" in out


def test_selector_by_hand_example_runs(pair):
    target, drafter, prompts = pair
    out = run_example("selector_by_hand.py", "--target", target, "--drafter", drafter, "--prompts", prompts,
                      "--batch-size", 3)
    assert "rho*" in out and "keep_len" in out


def test_policies_side_by_side_example_runs(pair):
    target, drafter, prompts = pair
    out = run_example("policies_side_by_side.py", "--target", target, "--drafter", drafter, "--prompts",
                      prompts, "--batch-sizes", "2", "--max-new-tokens", "8")
    assert "dcut" in out and "full" in out


def code_examples() -> dict[str, str]:
    """Every ```python block of the README and docs/, and every example in a module docstring of
    minidcut/ (an indented block that starts with `import minidcut`), by where it is."""
    out = {}
    for doc in ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))]:
        for i, block in enumerate(re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(), re.S)):
            out[f"{doc}#{i}"] = block
    for path in sorted((ROOT / "minidcut").glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
        for i, block in enumerate(re.findall(r"((?:\n    import minidcut\n)(?:    .*\n?)+)", "\n" + doc + "\n")):
            out[f"minidcut/{path.name}#{i}"] = "\n".join(line[4:] for line in block.strip("\n").splitlines())
    return out


def test_the_readme_and_the_docstrings_have_examples():
    assert {"README.md#0", "minidcut/api.py#0", "minidcut/runtime.py#0"} <= set(code_examples())


@pytest.mark.parametrize("where", sorted(code_examples()))
def test_every_code_example_in_the_readme_docs_and_docstrings_runs(where):
    r = subprocess.run([sys.executable, "-c", code_examples()[where]], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-3000:]
