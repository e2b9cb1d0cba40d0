"""The shape the code keeps (what a reader meets first): the engine's step reads as the method in about
15 lines, no class grows past 200 lines of code, only the engine and the runner reach the graphs and
the policy's cost table through an engine, and tools/ stays no larger than the package."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "minidcut"


def code_lines(src: str, node: ast.AST) -> int:
    """Lines of `node` that are code: not blank, not a comment, not a docstring."""
    lines = src.splitlines()
    docs = set()
    for n in ast.walk(node):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and ast.get_docstring(n):
            docs |= set(range(n.body[0].lineno, n.body[0].end_lineno + 1))
    return sum(1 for i in range(node.lineno, node.end_lineno + 1)
               if i not in docs and lines[i - 1].strip() and not lines[i - 1].strip().startswith("#"))


def classes():
    for path in sorted(PACKAGE.glob("*.py")):
        src = path.read_text()
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.ClassDef):
                yield path.name, node, src


def test_code_lines_counts_code_only():
    src = 'class A:\n    """doc\n    more"""\n\n    # note\n    def f(self):\n        """d"""\n        return 1\n'
    assert code_lines(src, ast.parse(src).body[0]) == 3


def test_the_engines_step_is_about_15_lines_and_no_class_is_over_200():
    sizes = {f"{name}:{node.name}": code_lines(src, node) for name, node, src in classes()}
    assert max(sizes.values()) <= 200, sorted(sizes.items(), key=lambda kv: -kv[1])[:3]
    engine = next((node, src) for name, node, src in classes() if node.name == "Engine")
    step = next(n for n in engine[0].body if isinstance(n, ast.FunctionDef) and n.name == "step")
    assert code_lines(engine[1], step) <= 16  # the def line and ~15 of body


def test_only_the_engine_and_the_runner_reach_the_graphs_and_the_cost_table_of_an_engine():
    reach = re.compile(r"\.runner\.graphs\b|\bengine\.policy\.table\b|\.runner\.[a-z]+\.|\.runner\._")
    found = [f"{p.relative_to(ROOT)}:{i}" for d in ("minidcut", "tools", "examples") for p in sorted((ROOT / d).rglob("*.py"))
             if p.name not in ("engine.py", "runner.py") or d != "minidcut"
             for i, line in enumerate(p.read_text().splitlines(), 1) if reach.search(line)]
    assert not found


def test_tools_are_no_larger_than_the_package():
    def lines(d):
        return sum(len(p.read_text().splitlines()) for p in (ROOT / d).rglob("*.py"))
    assert lines("tools") <= lines("minidcut")


def test_every_tool_run_as_a_script_imports_from_the_repo_root():
    """A tool run as a script (python tools/NAME.py) puts tools/ first on sys.path, where
    tools/profile.py shadows the stdlib's profile module (torch._dynamo imports cProfile): every script
    replaces that entry first."""
    fix = "sys.path[0] = str("  # the repo root, named one way or another
    scripts = [p for p in sorted((ROOT / "tools").glob("*.py")) if 'if __name__ == "__main__"' in p.read_text()]
    assert len(scripts) > 10 and [p.name for p in scripts if fix not in p.read_text()] == []
