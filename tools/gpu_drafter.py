"""Train SmolLM2-135M-Instruct's DFlash drafter on a lent GPU: one command, in stages that resume.

Stages (each writes WORK/<stage>.json when it is done; run the command again and done stages are skipped):

  target   join the GGUF parts the device calls carried and dequantize them (tools/target_parts.py), or
           take --target as it is
  prompts  the permissive mix (models/prompts_mix_train.jsonl.gz) and prompts the target writes itself
           (tools/magpie.py, one run per domain, --magpie-seconds in all); prompts that share a 13-word run
           with a held-out set (models/prompts_mix_heldout.jsonl, prompts_chat_heldout.jsonl,
           prompts_heldout.jsonl) or a --test file are dropped, and
           tools/decontaminate.py checks the file written. Domains take turns, so a budget that answers
           only the first prompts still answers every domain
  answers  the target's own answers (tools/distill.py: minidcut's Engine, AR, --batch-size rows, greedy and
           a 25 % share sampled at 0.8), for --answer-seconds; the first chunk measures the pace
  train    one drafter per --layers entry (tools/train_drafter.py: bf16 autocast on CUDA, draft layers
           started from the target's last layers, softmax over the data's tokens), --train-seconds shared
  eval     tau by domain on models/prompts_mix_heldout.jsonl (tools/eval_pair.py: fp32 target as users run
           it, bf16 drafter, greedy, 128 new tokens, full depth) for every variant; the best overall is kept
  card     README.md (data, tokens, seconds per stage, commands), DATA.md (sources, licences, counts), the
           logs and the answers (token ids), tarred and split into OUT/drafter.tar.NN of at most 15 MiB
           (a device call brings back 8 files of at most 16 MiB)

The answers are generated eagerly: on a GPU a step of this 30-layer model is bound by kernel launches,
so batch rows are nearly free, while compiling a graph per bucket costs 5-40 s each (docs/bench,
gpu_check_h200_*), minutes of the 15 a device lends.

On a lent device (the budget: 15 minutes in all; the defaults below fit one job call of ~6 minutes,
which leaves time for one more on the same warm machine):

    python tools/get_smollm2.py                  # here, once
    python tools/target_parts.py pack            # here: .device/target/part_00 .. part_NN, and the calls
    # device calls 1..N-1, each within 30 s of the last one's end (carry [".device/target/part_0k"]):
    mkdir -p /root/stage && cp .device/target/part_0k/* /root/stage/
    # the last call (carry [".device/target/part_NN"], timeout_s 560):
    mkdir -p /root/stage && cp .device/target/part_NN/* /root/stage/ && PYTHONUNBUFFERED=1 \\
        python3 tools/gpu_drafter.py --stage /root/stage --out $OUT 2>&1 | tee $OUT/pipeline.log
    # here, from the call's files_at folder:
    cat FILES_AT/drafter.tar.* | tar -x -C models/smollm2-135m-instruct-dflash

If a call fails after the target is joined, the same last command continues on a warm machine (its
WORK folder, /root/gpu_drafter, keeps what the done stages made).

On a CPU, at toy scale, the suite runs the same stages on the demo target (tests/test_gpu_drafter.py).
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import shutil
import sys
import tarfile
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __name__ == "__main__":  # run as a script: import from the repo root, and never shadow the stdlib's profile
    sys.path[0] = str(ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from tools import decontaminate, distill, eval_pair, magpie, target_parts, train_drafter  # noqa: E402
from tools.magpie import DOMAIN_SYSTEM  # noqa: E402
from tools.prompt_sources import SOURCES  # noqa: E402

MODELS = ROOT / "models"
HELDOUT = [MODELS / "prompts_mix_heldout.jsonl", MODELS / "prompts_chat_heldout.jsonl", MODELS / "prompts_heldout.jsonl"]
STAGES = ("target", "prompts", "answers", "train", "eval", "card")
TAR_PART = 15 << 20
MAX_PARTS = 7  # and the log: 8 files come back


class Pipeline:
    def __init__(self, args):
        self.args, self.work = args, Path(args.work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.target = str(self.work / "target") if args.stage else args.target

    def done(self, stage: str) -> dict | None:
        f = self.work / f"{stage}.json"
        return json.loads(f.read_text()) if f.is_file() else None

    def record(self, stage: str, rec: dict) -> None:
        (self.work / f"{stage}.json").write_text(json.dumps(rec, indent=1) + "\n")

    def run(self, name: str, tool, argv: list[str]) -> list[str]:
        """tool.main(argv) in this process; its errors become ours. Returns the command line, for the card."""
        command = ["python", f"tools/{name}.py", *argv]
        print("$ " + " ".join(command), flush=True)
        code = tool.main(argv)
        if code:
            raise SystemExit(f"error: tools/{name}.py exited with {code}")
        return command

    def budgets(self) -> dict[str, float]:
        a = self.args
        return {"target": 20, "prompts": a.magpie_seconds + 10, "answers": a.answer_seconds + 15,
                "train": a.train_seconds + 30 * len(a.layers), "eval": 30 * len(a.layers), "card": 5}

    # ---- stages -------------------------------------------------------------------------------------

    def stage_target(self) -> dict:
        if not self.args.stage:
            return {"target": self.target}
        rec = target_parts.unpack(Path(self.args.stage), Path(self.target))
        return {"target": self.target, **rec}

    def stage_prompts(self) -> dict:
        a, w = self.args, self.work
        mix = [json.loads(x) for x in gzip.open(a.mix, "rt", encoding="utf-8") if x.strip()][: a.mix_limit]
        commands, own = [], []
        if a.magpie_seconds > 0:
            out = w / "magpie.jsonl"
            per = a.magpie_seconds / len(DOMAIN_SYSTEM)
            for domain in DOMAIN_SYSTEM:
                commands.append(self.run("magpie", magpie, [
                    "--target", self.target, "--out", str(out), "--domain", domain, "--count", str(a.magpie_count),
                    "--seconds", str(per), "--batch-size", str(a.magpie_batch), "--max-new-tokens",
                    str(a.magpie_max_new_tokens), "--device", self.device,
                    *[x for f in HELDOUT for x in ("--against", str(f))]]))
            if out.is_file():
                own = [json.loads(x) for x in out.read_text(encoding="utf-8").split("\n") if x.strip()]
        tests = list(dict.fromkeys([*HELDOUT, Path(a.heldout), *map(Path, a.test)]))
        index = decontaminate.index(tests, 13)
        units = [(str(i), "\n".join(decontaminate.strings(x))) for i, x in enumerate(mix + own)]
        bad = {int(where) for where, _, _ in decontaminate.check(units, index, 13)}
        kept = [x for i, x in enumerate(mix + own) if i not in bad]
        ordered = take_turns([x for x in kept if x["source"] != "magpie"], [x for x in kept if x["source"] == "magpie"])
        path = w / "prompts.jsonl"
        path.write_text("".join(json.dumps({"prompt": x["prompt"], "source": x["source"], "domain": x["domain"],
                                            **({"messages": x["messages"]} if "messages" in x else {})}) + "\n"
                                for x in ordered), encoding="utf-8")
        commands.append(self.run("decontaminate", decontaminate,
                                 [str(path), *[x for t in tests for x in ("--test", str(t))]]))
        return {"prompts": len(ordered), "mix": len(mix), "magpie": len(own), "dropped": len(bad),
                "by_source": dict(Counter(x["source"] for x in ordered)),
                "by_domain": dict(Counter(x["domain"] for x in ordered)), "commands": commands}

    def stage_answers(self) -> dict:
        a, w = self.args, self.work
        cmd = self.run("distill", distill, [
            "--target", self.target, "--prompts", str(w / "prompts.jsonl"), "--chat", "--max-new-tokens",
            str(a.max_new_tokens), "--batch-size", str(a.batch_size), "--sampled-share", "0.25",
            "--device", self.device, "--seconds", str(a.answer_seconds), "--out", str(w / "answers.pt")])
        data = torch.load(w / "answers.pt")
        generated = sum(len(s) - st for s, st in zip(data["sequences"], data["starts"]))
        return {"answers": len(data["sequences"]), "tokens": sum(map(len, data["sequences"])),
                "generated_tokens": generated, "sampled": sum(data["sampled"]), "commands": [cmd]}

    def stage_train(self) -> dict:
        a, w = self.args, self.work
        each, out = a.train_seconds / len(a.layers), {}
        for layers in a.layers:
            cmd = self.run("train_drafter", train_drafter, [
                "--target", self.target, "--data", str(w / "answers.pt"), "--out", str(w / f"drafter_{layers}"),
                "--layers", str(layers), "--mask-token", a.mask_token, "--from-target-layers", "--data-vocab",
                "--features-dtype", "bfloat16", "--batch-size", str(a.train_batch), "--anchors", "16",
                "--lr", "1.5e-3", "--seconds", str(each), "--device", self.device, *(["--bf16"] if a.bf16 else [])])
            log = json.loads((w / f"drafter_{layers}" / "train_log.json").read_text())
            out[str(layers)] = {"steps": log["steps"], "train_seconds": log["train_seconds"],
                                "final_loss_ema": log["final_loss_ema"], "commands": [cmd]}
        return {"variants": out}

    def stage_eval(self) -> dict:
        a, w, out = self.args, self.work, {}
        for layers in a.layers:
            path = w / f"eval_{layers}.json"
            cmd = self.run("eval_pair", eval_pair, [
                "--target", self.target, "--drafter", str(w / f"drafter_{layers}"), "--prompts", str(a.heldout),
                "--chat", "--max-new-tokens", str(a.eval_new_tokens), "--batch-size", "64", "--dtype", "float32",
                "--drafter-dtype", "bfloat16", "--device", self.device, "--output", str(path)])
            res = json.loads(path.read_text())
            out[str(layers)] = {"tau": res["tau"], "by_domain": {d: r["tau"] for d, r in res.get("domains", {}).items()},
                                "commands": [cmd]}
        best = max(out, key=lambda k: out[k]["tau"])
        return {"variants": out, "best": best}

    def stage_card(self) -> dict:
        w, out = self.work, Path(self.args.out)
        best = self.done("eval")["best"]
        res = w / "result"
        shutil.rmtree(res, ignore_errors=True)
        shutil.copytree(w / f"drafter_{best}", res)
        shutil.copy2(w / f"eval_{best}.json", res / "eval_mix_heldout.json")
        stages = {s: self.done(s) for s in STAGES[:-1]}
        (res / "pipeline.json").write_text(json.dumps({"device": self.device_name(), "stages": stages}, indent=1) + "\n")
        name = "SmolLM2-135M-Instruct" if self.args.stage else Path(self.target).name
        (res / "README.md").write_text(card(stages, self.device_name(), best, name, self.args.eval_new_tokens))
        (res / "DATA.md").write_text(data_card(stages["prompts"], w / "prompts.jsonl", stages["answers"]["answers"]))
        data = torch.load(w / "answers.pt")
        lens = np.array([len(s) for s in data["sequences"]], dtype=np.int64)
        buf = io.BytesIO()
        np.savez_compressed(buf, tokens=np.concatenate([np.asarray(s, np.int32) for s in data["sequences"]]),
                            lengths=lens, starts=np.asarray(data["starts"], np.int64),
                            sampled=np.asarray(data["sampled"], bool))
        (res / "answers.npz").write_bytes(buf.getvalue())
        parts = write_tar(res, out)
        return {"parts": [p.name for p in parts], "bytes": sum(p.stat().st_size for p in parts)}

    def device_name(self) -> str:
        return torch.cuda.get_device_name() if self.device.startswith("cuda") else "cpu"

    def main(self) -> int:
        budgets, t0 = self.budgets(), time.time()
        todo = [s for s in STAGES if self.done(s) is None]
        print(f"stages to run: {', '.join(todo) or 'none'} on {self.device_name()}; about "
              f"{sum(budgets[s] for s in todo) / 60:.1f} min", flush=True)
        for k, stage in enumerate(STAGES, 1):
            if stage not in todo:
                continue
            left = sum(budgets[s] for s in todo[todo.index(stage):])
            print(f"[{k}/{len(STAGES)}] {stage}: about {budgets[stage]:.0f} s; the rest about {left / 60:.1f} min "
                  f"({time.time() - t0:.0f} s so far)", flush=True)
            start = time.time()
            rec = getattr(self, f"stage_{stage}")()
            self.record(stage, {**rec, "seconds": round(time.time() - start, 1)})
        print(f"done in {time.time() - t0:.0f} s: {self.args.out}", flush=True)
        return 0


def take_turns(mix: list[dict], own: list[dict]) -> list[dict]:
    """Domains in turn; within a domain, the mix and the target's own prompts spread evenly."""
    by_domain = defaultdict(list)
    for src in (mix, own):
        for d in {x["domain"] for x in src}:
            xs = [x for x in src if x["domain"] == d]
            by_domain[d] += [((i + 0.5) / len(xs), x) for i, x in enumerate(xs)]
    queues = [[x for _, x in sorted(v, key=lambda t: t[0])] for _, v in sorted(by_domain.items())]
    out = []
    for i in range(max(map(len, queues), default=0)):
        out += [q[i] for q in queues if i < len(q)]
    return out


def card(stages: dict, device: str, best: str, target: str, new_tokens: int) -> str:
    p, a, t, e = stages["prompts"], stages["answers"], stages["train"]["variants"], stages["eval"]
    rows = "\n".join(f"| {k} layers | {v['tau']:.2f} | " + ", ".join(f"{d} {x:.2f}" for d, x in sorted(v["by_domain"].items()))
                     + f" | {t[k]['steps']} steps, {t[k]['train_seconds']:.0f} s, loss {t[k]['final_loss_ema']:.2f} |"
                     for k, v in e["variants"].items())
    secs = ", ".join(f"{s} {stages[s]['seconds']:.0f} s" for s in stages)
    cmds = "\n".join("    " + " ".join(c) for s in ("prompts", "answers") for c in stages[s]["commands"])
    cmds += "\n" + "\n".join("    " + " ".join(c) for v in (*t.values(), *e["variants"].values()) for c in v["commands"])
    return f"""# DFlash drafter for {target}, trained on {device}

Written by tools/gpu_drafter.py. Kept: the {best}-layer variant (best held-out tau).

| | |
|---|---|
| prompts | {p['prompts']:,} ({p['mix']:,} from the permissive mix, {p['magpie']:,} written by the target, {p['dropped']} dropped as contaminated); DATA.md |
| answers | {a['answers']:,} answers of the target itself ({a['sampled']:,} sampled at 0.8, the rest greedy): {a['tokens']:,} tokens, {a['generated_tokens']:,} generated |
| seconds per stage | {secs} |

Held-out tau (models/prompts_mix_heldout.jsonl, greedy, {new_tokens} new tokens, full depth, fp32 target, bf16 drafter):

| variant | tau | tau by domain | training |
|---|---|---|---|
{rows}

Commands (WORK is the pipeline's work folder):

{cmds}
"""


def data_card(prompts: dict, path: Path, answered: int) -> str:
    used = [json.loads(x) for x in path.read_text(encoding="utf-8").split("\n") if x.strip()][:answered]
    count = Counter(x["source"] for x in used)
    licence = {s.name: f"{s.license} ({s.repo} `{s.path}`)" for s in SOURCES}
    licence["magpie"] = ("written by SmolLM2-135M-Instruct (Apache-2.0) itself, from its chat template's user "
                         "turn (tools/magpie.py)")
    rows = "\n".join(f"| {s} | {licence.get(s, 'unknown')} | {n:,} |" for s, n in count.most_common())
    return f"""# Data card: prompts answered for this drafter

Every answer is the target's own (self-distillation); only prompts come from outside. The prompts file
held {prompts['prompts']:,} prompts after {prompts['dropped']} were dropped for sharing a 13-word run with a
held-out set or a test file; the first {answered:,} were answered. Held-out evaluation uses
models/prompts_mix_heldout.jsonl, drawn from sources the training prompts never use.

| source | licence | prompts answered |
|---|---|---|
{rows}

Domains answered: {dict(Counter(x['domain'] for x in used))}
"""


def write_tar(folder: Path, out: Path) -> list[Path]:
    """folder as out/drafter.tar.NN parts of at most TAR_PART bytes (cat them back into one tar)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for f in sorted(folder.iterdir()):
            if f.name != "answers.npz" or len(buf.getvalue()) + f.stat().st_size < (MAX_PARTS - 1) * TAR_PART:
                tar.add(f, arcname=f.name)
    raw = buf.getvalue()
    if len(raw) > MAX_PARTS * TAR_PART:
        raise SystemExit(f"error: the result is {len(raw) >> 20} MiB, over the {MAX_PARTS} parts a call returns")
    out.mkdir(parents=True, exist_ok=True)
    parts = []
    for k in range(0, len(raw), TAR_PART):
        parts.append(out / f"drafter.tar.{k // TAR_PART:02d}")
        parts[-1].write_bytes(raw[k:k + TAR_PART])
    return parts


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--stage", help="folder the device calls copied the target's parts into (tools/target_parts.py)")
    src.add_argument("--target", help="a target model directory (HF layout) to use as it is")
    p.add_argument("--out", required=True, help="where drafter.tar.NN go (on a device: $OUT)")
    p.add_argument("--work", default="/root/gpu_drafter", help="work folder; what done stages made stays here")
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda when there is one)")
    p.add_argument("--mix", default=str(MODELS / "prompts_mix_train.jsonl.gz"), help="permissive training prompts")
    p.add_argument("--mix-limit", type=int, default=None, help="use the first N prompts of --mix")
    p.add_argument("--heldout", default=str(MODELS / "prompts_mix_heldout.jsonl"))
    p.add_argument("--test", action="append", default=[], help="a benchmark test set to decontaminate against")
    p.add_argument("--magpie-seconds", type=float, default=40, help="for the target's own prompts, all domains")
    p.add_argument("--magpie-count", type=int, default=2000, help="at most this many of each domain")
    p.add_argument("--magpie-batch", type=int, default=512)
    p.add_argument("--magpie-max-new-tokens", type=int, default=128)
    p.add_argument("--answer-seconds", type=float, default=120)
    p.add_argument("--batch-size", type=int, default=1024, help="rows answering at once")
    p.add_argument("--max-new-tokens", type=int, default=256, help="of an answer")
    p.add_argument("--layers", type=lambda s: [int(x) for x in s.split(",")], default=[3, 5],
                   help="draft layers of each variant, comma-separated")
    p.add_argument("--train-seconds", type=float, default=120, help="shared by the variants")
    p.add_argument("--train-batch", type=int, default=64, help="sequences a step")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 autocast in training (default: on CUDA)")
    p.add_argument("--mask-token", default="<empty_output>", help="a target token chat text never holds")
    p.add_argument("--eval-new-tokens", type=int, default=128)
    args = p.parse_args(argv)
    if args.bf16 is None:
        args.bf16 = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return Pipeline(args).main()
    except target_parts.PartsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
