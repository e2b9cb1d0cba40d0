"""Every child process the suite starts has a time limit: a hung child fails its test instead of
running CI to its own limit."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
WAITS = ("subprocess.run", "subprocess.check_output", "subprocess.check_call", ".communicate", ".wait")


def test_every_subprocess_call_of_the_suite_has_a_timeout():
    missing = []
    for path in sorted(TESTS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith(WAITS):
                if not any(k.arg == "timeout" for k in node.keywords):
                    missing.append(f"{path.name}:{node.lineno} {ast.unparse(node.func)}")
    assert missing == []
