"""The real pair (SmolLM2-135M-Instruct, converted by tools/get_smollm2.py, and its shipped drafter):
every policy writes AR's text on held-out chat prompts, at B = 1 and 8, with an fp32 and a bf16
drafter. Slow, and skipped where the target has not been fetched."""

from __future__ import annotations

from pathlib import Path

import pytest

from minidcut import Engine, Policy, cli, load_pair, load_tokenizer
from minidcut.cost_model import CostTable

ROOT = Path(__file__).resolve().parent.parent
TARGET, DRAFTER = ROOT / "models" / "smollm2-135m-instruct", ROOT / "models" / "smollm2-135m-instruct-dflash"
GRID = [0.0, 0.25, 0.5, 0.75, 1.0]

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not (TARGET / "model.safetensors").is_file(),
                                                   reason="run tools/get_smollm2.py first")]


@pytest.mark.parametrize("drafter_dtype", ["float32", "bfloat16"])
def test_every_policy_writes_ar_text_on_held_out_chat_prompts(drafter_dtype):
    target, drafter, _, _ = load_pair(TARGET, DRAFTER, drafter_dtype=drafter_dtype)
    tok = load_tokenizer(TARGET)
    prompts, _ = cli.read_prompts(str(ROOT / "models" / "prompts_chat_heldout.jsonl"), None, tok, chat=True)
    prompts = prompts[::18]  # 13 prompts from all over the set
    max_seq = cli.max_seq(prompts, 48, drafter.block_size)
    # A table whose costs grow slowly with rho: dcut moves between budgets instead of settling on one.
    table = CostTable([1, 2, 4, 8], GRID, [[1.0 + 0.03 * r * b for r in GRID] for b in (1, 2, 4, 8)])
    for B in (1, 8):
        ar, _ = Engine(target, None, Policy.ar(), batch_size=B, max_seq=max_seq, compile=False).generate(prompts, 48)
        for policy in (Policy.full(), Policy.static(0.25), Policy.dcut(table, GRID)):
            out, stats = Engine(target, drafter, policy, batch_size=B, max_seq=max_seq,
                                compile=False).generate(prompts, 48)
            assert out == ar, (policy.label, B)
            if policy.label != "dcut":  # dcut may turn drafting off where it does not pay
                assert stats.tau > 1.05, (policy.label, B, stats.tau)  # drafts were accepted (held-out tau 1.55)
