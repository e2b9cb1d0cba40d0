"""Cost of minidcut's MoE block at T = 16 and T = 512 tokens: it should grow with the T*k routed rows,
not T*E (every expert on every token) and not a per-token copy of expert weights.

    python tools/bench_moe.py --threads 1
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# Run as a script: import from the repo root, and never let tools/profile.py shadow the stdlib module.
if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from minidcut.config import parse_model_config  # noqa: E402
from minidcut.layers import MoE  # noqa: E402


def dense_all_experts(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The T*E baseline: every expert computes every token, weights zero where not routed."""
    probs = F.softmax(moe.gate(x), dim=-1, dtype=torch.float32)
    w, e = torch.topk(probs, moe.top_k, dim=-1)
    full = torch.zeros_like(probs).scatter(1, e, w / w.sum(-1, keepdim=True)).to(x.dtype)  # [T, E]
    gu = torch.einsum("th,eih->tei", x, moe.experts.gate_up_proj)
    g, u = gu.chunk(2, dim=-1)
    y = torch.einsum("tei,ehi->teh", F.silu(g) * u, moe.experts.down_proj)
    return (y * full[..., None]).sum(1)


def timeit(fn, x, reps=20):
    for _ in range(3):
        fn(x)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn(x)
    return (time.perf_counter() - t0) / reps


@torch.inference_mode()
def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=4)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = parse_model_config(dict(model_type="qwen3_moe", vocab_size=16, hidden_size=512, num_hidden_layers=1,
                                  num_attention_heads=8, num_experts=args.experts,
                                  num_experts_per_tok=args.top_k, moe_intermediate_size=256, norm_topk_prob=True))
    torch.manual_seed(0)
    moe = MoE(cfg)
    for prm in moe.parameters():
        torch.nn.init.normal_(prm, std=0.05)
    compiled = torch.compile(moe, fullgraph=True, dynamic=False)
    print(f"MoE block: H=512, E={args.experts}, top-{args.top_k}, I=256, fp32, {torch.get_num_threads()} thread(s)")
    print(f"{'T':>5} {'eager ms':>9} {'compiled ms':>12} {'all-experts ms':>15}")
    for T in (16, 512):
        x = torch.randn(T, 512)
        torch.testing.assert_close(moe(x), dense_all_experts(moe, x), rtol=1e-4, atol=1e-4)
        print(f"{T:>5} {timeit(moe, x) * 1e3:9.2f} {timeit(compiled, x) * 1e3:12.2f} "
              f"{timeit(lambda v: dense_all_experts(moe, v), x, 5) * 1e3:15.2f}")


if __name__ == "__main__":
    main()
