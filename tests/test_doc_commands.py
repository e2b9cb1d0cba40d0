"""Every command the README and examples/ document runs as written: each `python ...` line (with its
continuation lines) is parsed by the program's own argument parser, shell variables filled as the doc
sets them; what needs no weights beyond the shipped ones is checked further (the profile's cache size
against its context) or run (the default command, on the demo pair)."""

from __future__ import annotations

import importlib
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "examples").glob("*.md"))]
FILLED = {"$T": "Qwen/Qwen3-8B", "$D": "z-lab/Qwen3-8B-DFlash-b16", " ID ": " 1 "}  # as the docs set them


def documented_commands() -> list[tuple[str, list[str]]]:
    """(doc:line, argv) of every indented `python ...` command line of the docs, continuations joined."""
    out = []
    for doc in DOCS:
        lines = (ROOT / doc).read_text().splitlines()
        i = 0
        while i < len(lines):
            line, where = lines[i], f"{doc}:{i + 1}"
            if line.startswith("    python "):
                text = line.strip()
                while text.endswith("\\"):
                    i += 1
                    text = text[:-1] + " " + lines[i].strip()
                text = text.split("  #")[0]  # a trailing comment
                for k, v in FILLED.items():
                    text = text.replace(k, v)
                out.append((where, shlex.split(text)[1:]))
            i += 1
    return out


def parser_of(argv: list[str]):
    """(program name, its parse function, its arguments) for `python -m minidcut.<name> ...` or `python
    tools/<name>.py ...`."""
    if argv[:2] == ["-m", "minidcut.generate"] or argv[:2] == ["-m", "minidcut.bench"]:
        module = importlib.import_module(argv[1])
        return argv[1], module.parse_args, argv[2:]
    if argv[:2] == ["-m", "pytest"]:
        return "pytest", None, argv[2:]
    if argv[0].startswith("tools/") and argv[0].endswith(".py"):
        sys.path.insert(0, str(ROOT))
        try:
            module = importlib.import_module("tools." + Path(argv[0]).stem)
        finally:
            sys.path.remove(str(ROOT))
        return argv[0], getattr(module, "parse_args", None), argv[1:]
    raise AssertionError(f"no parser known for {argv}")


COMMANDS = documented_commands()


def test_the_docs_document_the_main_commands():
    programs = {parser_of(argv)[0] for _, argv in COMMANDS}
    assert {"minidcut.generate", "minidcut.bench", "tools/profile.py", "tools/get_smollm2.py"} <= programs


@pytest.mark.parametrize("where, argv", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_every_documented_command_parses_as_written(where, argv):
    name, parse, args = parser_of(argv)
    if name == "pytest":
        return
    if parse is None:  # tools/get_smollm2.py: its parser lives in main(); --help exits 0 after parsing the rest
        module = importlib.import_module("tools." + Path(name).stem)
        with pytest.raises(SystemExit) as e:
            module.main([*args, "--help"])
        assert e.value.code == 0, where
        return
    parsed = parse(args)
    if name == "tools/profile.py":  # its cache size against its context, as run() settles them
        from tools.profile import cache_positions
        compiled = parsed.compile is not False and parsed.device == "cuda"
        assert cache_positions(parsed.context_len, parsed.max_seq, compiled) >= parsed.context_len + 33, where


def install_extras(doc: str) -> list[set[str]]:
    """The extras of each indented `pip install ... -e ".[a,b]"` line of a doc."""
    lines = [x.strip() for x in (ROOT / doc).read_text().splitlines() if x.startswith("    pip install ")]
    return [set(m.group(1).split(",")) if (m := re.search(r'-e "?\.\[([\w,-]+)\]', x)) else set() for x in lines]


@pytest.mark.parametrize("doc", DOCS)
def test_every_install_line_names_extras_the_project_has_and_those_its_commands_need(doc):
    """An install line as written installs what the doc's commands then use: its extras exist in
    pyproject.toml, and a doc whose bench command plots installs the plot extra (matplotlib)."""
    import tomllib

    have = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    extras = install_extras(doc)
    assert all(e <= have for e in extras), (doc, extras, have)
    plots = any("--plot" in argv for where, argv in COMMANDS if where.startswith(doc + ":"))
    if plots:
        assert any("plot" in e for e in extras), f"{doc} runs the bench with --plot but installs no plot extra"


def test_the_default_command_shows_dcut_deciding_per_bucket_and_its_speedup_over_ar(tmp_path, capsys):
    """`python -m minidcut.generate` as the README gives it (its cost table in a temporary file): the batch
    drains from bucket 4 down, the summary says per bucket how many steps drafted and with which
    rho, and the same process measures AR on the same prompts, with the same tokens. Whether a bucket
    drafts depends on the machine's costs (docs/bench/README.md has runs), so it is not asserted."""
    from minidcut.generate import main
    argv = next(argv for where, argv in COMMANDS if where.startswith("README.md") and argv == ["-m", "minidcut.generate"])
    assert main([*argv[2:], "--cost-table", str(tmp_path / "t.json"), "--threads", "1"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    buckets = [int(b) for b in re.findall(r"bucket (\d+): \d+ steps, \d+ drafting", text)]
    assert buckets[0] == 4 and min(buckets) < 4  # it drains (which smaller buckets it passes through
    #                                              depends on how many tokens its steps commit)
    assert "rho per step: " in text  # which rho each step chose (whether it drafts is the machine's call)
    assert re.search(r"AR in this process: [\d.]+ tok/s; dcut is [\d.]+x AR", text)
    assert "the same tokens as AR decoding in all 4 requests" in text
