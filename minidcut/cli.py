"""What the command-line programs (generate, bench, tools/) share: reading prompts, checking arguments
and inputs before any model loads, the error type and its one-line report, and status lines.
Library modules never print; this one and the programs that use it do."""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import sys
from pathlib import Path

from rich.console import Console

from . import runtime
from .batch import per_prompt
from .config import ConfigError, load_drafter_config, load_model_config
from .cost_model import CostTableError, size_class
from .loader import CheckpointError
from .runner import SPAN_STEP

MODELS = Path(__file__).resolve().parent.parent / "models"
DEFAULT_TARGET = MODELS / "llama-stdlib-4m"
DEFAULT_DRAFTER = MODELS / "llama-stdlib-4m-dflash"


class UserError(Exception):
    """A mistake in the command line or its inputs: printed as one line, exit status 2."""


USER_ERRORS = (UserError, ConfigError, CheckpointError, CostTableError, ValueError)


def add_runtime_args(p: argparse.ArgumentParser) -> None:
    """--dtype, --drafter-dtype, --device, --threads, --compile / --no-compile: shared by every program."""
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--drafter-dtype", default=None,
                   help="the drafter's dtype (default: --dtype); the output stays the target's either way. "
                        "bfloat16 pays only on a CPU with bf16 instructions (AVX-512 BF16, AMX): on an "
                        "AVX2-only CPU it drafted 3x slower than float32")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")
    p.add_argument("--threads", type=int, default=None,
                   help=f"CPU threads (default: all cores but one, here {runtime.default_threads()})")
    comp = p.add_mutually_exclusive_group()
    p.set_defaults(compile=None)
    comp.add_argument("--compile", dest="compile", action="store_true", default=argparse.SUPPRESS,
                      help="torch.compile the decode graphs (the default on CUDA)")
    comp.add_argument("--no-compile", dest="compile", action="store_false", default=argparse.SUPPRESS,
                      help="run eagerly (the default on a CPU: compiling takes ~30-90 s per graph there)")


def check_runtime_args(args) -> None:
    """Check the runtime flags and settle --compile's default for the device (before any model loads)."""
    from .api import resolve_device
    check_positive(args, "threads")
    device = resolve_device(args.device)
    if args.compile is None:
        args.compile = runtime.default_compile(device)


def run_reporting_errors(run_fn, args, console: Console) -> int:
    """Run a CLI body; a user mistake becomes one `error:` line on stderr and exit status 2; Ctrl-C
    one `interrupted` line and exit status 130. Every program's main() is this call and little else
    (`duplicates` pairs their last lines as boilerplate: kept, they are the entry points)."""
    try:
        return run_fn(args, console)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def check_positive(args, *names: str) -> None:
    """--name must be >= 1 for every name given (None: not set, allowed)."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def parse_batch_sizes(text: str, flag: str = "--batch-sizes") -> list[int]:
    """'1,4,16' -> [1, 4, 16] (sorted, unique); UserError for anything else."""
    try:
        values = sorted({int(b) for b in text.split(",") if b.strip()})
    except ValueError:
        raise UserError(f"{flag} {text!r}: expected comma-separated integers") from None
    if not values or values[0] < 1:
        raise UserError(f"{flag} must be >= 1, got {text!r}")
    return values


def check_writable(path: str | None, flag: str) -> None:
    """An output file that cannot be written is an error now, before any work (opened for appending,
    so an existing file is left as it is; one this check creates is removed again)."""
    if not path:
        return
    p = Path(path)
    if p.is_dir():
        raise UserError(f"{flag} {path} is a directory")
    if not p.parent.is_dir():
        raise UserError(f"{flag} {path}: directory {p.parent} does not exist")
    existed = p.exists()
    try:
        with open(p, "a"):
            pass
    except OSError as e:
        raise UserError(f"{flag} {path} cannot be written ({e.strerror or e})") from None
    if not existed:
        p.unlink()


def model_limits(target_dir, drafter_dir=None) -> tuple[int, int, int]:
    """(vocab size, max positions, draft block size or 1) from the config files, before any weights load."""
    cfg = load_model_config(target_dir)
    block = load_drafter_config(drafter_dir).block_size if drafter_dir else 1
    return cfg.vocab_size, cfg.max_position_embeddings, block


def max_seq(prompts: list[list[int]], max_new_tokens: int | list[int], block: int, positions: int | None = None,
            compile: bool = True) -> int:
    """Cache positions of a run: the longest prompt, its new tokens and one draft block, rounded up
    (within the target's `positions`). Compiled: to a size class (cost_model.size_class: 256, 512, 1024,
    ...), so that runs of other prompt files and token counts share graphs and cost tables (a compiled
    step reads every position, so a table is keyed by them) and tools/profile.py --max-seq N serves every
    run of that class. Eager: to a multiple of SPAN_STEP (16) only; an eager step reads its span, yet
    attention over the same span of a longer cache takes longer (7% with 256 positions against 192 on a
    CPU, docs/bench/README.md); eager runs of similar lengths share a table (cost_model.seq_class)."""
    need = max(len(p) + n for p, n in zip(prompts, per_prompt(max_new_tokens, len(prompts)))) + block + 1
    rounded = size_class(need) if compile else -(-need // SPAN_STEP) * SPAN_STEP
    return rounded if positions is None or rounded <= positions else need


def check_prompts(prompts: list[list[int]], max_new_tokens: int | list[int], vocab: int, positions: int, block: int,
                  names: list[str]) -> None:
    """Token ids inside the vocabulary, and every prompt + its new tokens + a draft block inside the
    target's context; names[i] says where prompt i came from."""
    for ids, name, max_new_tokens in zip(prompts, names, per_prompt(max_new_tokens, len(prompts))):
        if not ids:
            raise UserError(f"{name}: the prompt is empty")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise UserError(f"{name}: token id {bad} is outside the vocabulary [0, {vocab})")
        if len(ids) + max_new_tokens + block > positions:
            raise UserError(f"{name}: {len(ids)} prompt tokens + --max-new-tokens {max_new_tokens} + "
                            f"{block} for a draft block exceed the target's {positions} positions")


CHAT_DEFAULTS = {"enable_thinking": False}  # z-lab's Qwen3 drafters were trained on answers without thinking
CHAT_HELP = ("put each prompt under the tokenizer's chat template, with the template's arguments KEY=VALUE[,...] "
             "(VALUE as JSON: true, 3, \"x\"; else a string). Default: enable_thinking=false, so Qwen3 answers "
             "without a thinking trace, as DFlash drafters are trained; templates that do not use an argument "
             "ignore it. `--chat enable_thinking=true` lets Qwen3 think")


def add_pair_args(p, program: str) -> None:
    """--target, --drafter, --prompts and --chat of a tool that runs `program` (bench or generate) on a
    pair and passes them on (tools/oneshot.py, tools/worst_case.py)."""
    p.add_argument("--target", default=str(DEFAULT_TARGET), help="target directory (default: the demo target)")
    p.add_argument("--drafter", default=str(DEFAULT_DRAFTER), help="drafter directory (default: the demo drafter)")
    p.add_argument("--prompts", default=str(MODELS / "prompts_heldout.jsonl"),
                   help=f"JSONL prompt file, as {program}'s --prompts (default: the held-out code prompts)")
    p.add_argument("--chat", nargs="?", const="", default=None, metavar="KEY=VALUE,...",
                   help=f"pass --chat (and its template arguments) to {program}")


def add_chat_arg(p) -> None:
    """--chat [KEY=VALUE,...]: the chat template and its arguments (parse_chat gives them as a dict)."""
    p.add_argument("--chat", nargs="?", const="", default=None, metavar="KEY=VALUE,...", help=CHAT_HELP)


def parse_chat(value: str | None) -> dict | None:
    """--chat's value -> the template's arguments (CHAT_DEFAULTS, then the given ones), None without
    --chat; UserError (one line) for a malformed one."""
    if value is None:
        return None
    args = dict(CHAT_DEFAULTS)
    for part in (x.strip() for x in value.split(",")):
        if not part:
            continue
        key, eq, raw = part.partition("=")
        if not eq or not key.strip().isidentifier():
            raise UserError(f"--chat {value!r}: expected KEY=VALUE[,KEY=VALUE...], e.g. enable_thinking=false")
        try:
            args[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            args[key.strip()] = raw
    return args


def chat_ids(tokenizer, messages: list[dict], template_args: dict | None = None) -> list[int]:
    """Messages under the tokenizer's chat template (with template_args, parse_chat), ready for the
    assistant's answer."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **(template_args or {}))
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def prompt_file_lines(path) -> list[str]:
    """The lines of a prompts file (JSONL, or JSONL.gz when the name ends in .gz), numbered from 1 as
    read_prompts names them; UserError if it is missing or not UTF-8."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"prompts file {p} not found")
    raw = p.read_bytes()
    if p.suffix == ".gz":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise UserError(f"{p}: not a gzip file ({e})") from None
    try:
        return raw.decode("utf-8").split("\n")  # not splitlines(): U+2028 inside a JSON string is no line end
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise UserError(f"{p}:{line}: not UTF-8 text") from None


def read_prompts(path: str | None, texts: list[str] | None, tokenizer, chat: bool | dict | None = None,
                 model: str = "the target", default: list[str] | None = None) -> tuple[list[list[int]], list[str]]:
    """Token ids of every prompt, and where each came from ("file:line" or "--prompt N"), from a JSONL
    file (lines {"prompt": "..."}, {"input_ids": [...]} or {"messages": [...]}; .gz read as gzip) and
    --prompt texts; `default` when there are none. chat: text prompts go under the tokenizer's chat
    template, with these template arguments (parse_chat; True: CHAT_DEFAULTS)."""
    template_args = dict(CHAT_DEFAULTS) if chat is True else chat or None
    items: list[tuple[object, str]] = []
    if path:
        p = Path(path)
        for n, line in enumerate(prompt_file_lines(p), 1):
            if line.strip():
                items.append((parse_prompt_line(line, f"{p}:{n}"), f"{p}:{n}"))
        if not items:
            raise UserError(f"prompts file {p} has no prompts")
    items += [(t, f"--prompt {i + 1}") for i, t in enumerate(texts or [])]
    if not items:
        items = [(t, f"built-in prompt {i + 1}") for i, t in enumerate(default or [])]
    if chat and tokenizer is not None and not getattr(tokenizer, "chat_template", None):
        raise UserError(f"--chat: {model}'s tokenizer has no chat template")
    ids = []
    for item, name in items:
        if isinstance(item, list) and item and isinstance(item[0], dict):  # messages
            if tokenizer is None or not chat:
                raise UserError(f"{name}: a messages line needs --chat and a tokenizer")
            ids.append(chat_ids(tokenizer, item, template_args))
        elif isinstance(item, str):
            if item == "":
                raise UserError(f"{name}: the prompt is empty")
            if tokenizer is None:
                raise UserError(f"{model} has no tokenizer: give prompts as input_ids in a --prompts file")
            ids.append(chat_ids(tokenizer, [{"role": "user", "content": item}], template_args) if chat
                       else tokenizer.encode(item, add_special_tokens=False))
        else:
            ids.append(item)
    return ids, [name for _, name in items]


def parse_prompt_line(line: str, where: str):
    """One JSONL line -> a text, a list of token ids, or a list of chat messages (preferred over a
    "prompt" on the same line: a follow-up keeps its conversation)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not valid JSON ({e})") from None
    if isinstance(obj, dict) and isinstance(obj.get("input_ids"), list) and \
            all(isinstance(t, int) for t in obj["input_ids"]):
        return obj["input_ids"]
    if isinstance(obj, dict) and isinstance(obj.get("messages"), list) and obj["messages"] and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in obj["messages"]):
        return obj["messages"]
    if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
        return obj["prompt"]
    raise UserError(f'{where}: expected {{"prompt": "..."}}, {{"input_ids": [...]}} or '
                    f'{{"messages": [{{"role": ..., "content": ...}}, ...]}}')


class _Silent:
    def update(self, *args, **kw) -> None:
        pass


def status(console: Console, message: str, quiet: bool = False):
    """A rich status line (spinner + message; .update(text) changes it), or a silent one."""
    return contextlib.nullcontext(_Silent()) if quiet else console.status(message, spinner="dots")
