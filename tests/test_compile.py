"""The compiled engine (torch.compile of the step graphs) decodes the same tokens as eager, and after a
warm-up a long run never recompiles. Compiling is slow on CPU (~30-60 s a graph): one tiny llama,
one compiled engine, AR policy (one verify graph, K = 0)."""

import os
import subprocess
import sys
from pathlib import Path

import torch

from minidcut.engine import Engine
from minidcut.loader import load_target
from minidcut.policy import Policy
from minidcut.runtime import COMPILE_CACHE, setup
from tiny import BASE, make_model

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = (5, 17, 9, 30)  # 4 prompts at batch size 2: two rows refilled once by continuous batching
NEW_TOKENS = 60


def test_compiled_ar_decoding_equals_eager_and_never_recompiles_after_warm_up(tmp_path):
    setup(threads=1)
    make_model(tmp_path, "llama", num_hidden_layers=2)  # a smaller graph compiles faster
    target = load_target(tmp_path)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, BASE["vocab_size"], (L,), generator=g).tolist() for L in LENGTHS]

    eager, _ = Engine(target, None, Policy.ar(), batch_size=2, max_seq=128, eos_ids=[],
                      compile=False).generate(prompts, NEW_TOKENS)

    engine = Engine(target, None, Policy.ar(), batch_size=2, max_seq=128, eos_ids=[], compile=True)
    warm, _ = engine.generate(prompts, NEW_TOKENS)  # compiles the (B=2, K=0) verify graph
    assert warm == eager
    with torch.compiler.set_stance("fail_on_recompile"):
        again, stats = engine.generate(prompts, NEW_TOKENS)
    assert stats.steps >= 100  # decode steps run by the compiled graph without a recompile
    assert again == eager
    assert all(len(o) == NEW_TOKENS for o in again)
    assert set(engine.runner.graphs.graphs) == {("verify", 2, 0, True)}  # the one (B = 2, K = 0) verify graph


def test_setup_keeps_inductor_kernels_under_compile_cache_and_engines_touch_no_process_state(tmp_path):
    """minidcut.setup() points inductor at compile_cache/inductor even though loading a model (which
    imports torch._dynamo) already made torch fill in its default cache directory; making engines changes
    no process-wide setting. Run in a fresh interpreter, as a user runs it, with TORCHINDUCTOR_CACHE_DIR
    unset."""
    make_model(tmp_path, "llama", num_hidden_layers=1)
    code = ("import os, sys, torch\n"
            "import minidcut\n"
            "from minidcut.engine import Engine\n"
            "from minidcut.loader import load_target\n"
            "t = load_target(sys.argv[1])\n"
            "minidcut.setup(threads=1)\n"
            "before = (os.environ['TORCHINDUCTOR_CACHE_DIR'], torch._dynamo.config.recompile_limit)\n"
            "for _ in range(3):\n"
            "    Engine(t, batch_size=1, max_seq=32, compile=True)\n"
            "assert before == (os.environ['TORCHINDUCTOR_CACHE_DIR'], torch._dynamo.config.recompile_limit)\n"
            "print(os.environ['TORCHINDUCTOR_CACHE_DIR'])\n")
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == str(COMPILE_CACHE / "inductor")
