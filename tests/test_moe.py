"""The MoE block's grouped matmul is graph-safe on every dtype: no host sync (CUDA-graph capture) and
one static compiled graph (torch.compile fullgraph=True), with a cost that follows the T*k routed
(token, expert) rows. Its numbers against transformers are in test_parity.py (fp32 and bf16)."""

import pytest
import torch

from minidcut.config import parse_model_config
from minidcut.layers import MoE, grouped_mm, native_grouped_mm, tiled_grouped_mm

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def loop_grouped_mm(x, w, offs):
    """The definition: rows x[offs[e-1]:offs[e]] times w[e], expert by expert."""
    out, start = [], 0
    for e, end in enumerate(offs.tolist()):
        out.append(x[start:end].float() @ w[e].float())
        start = end
    return torch.cat(out)


def routed(counts, K=64, N=48, dtype=torch.float32, device="cpu", seed=0):
    """x [M, K] sorted by expert, w [E, K, N] (a transposed view, as MoE passes it), offs [E] int32."""
    g = torch.Generator().manual_seed(seed)
    M, E = sum(counts), len(counts)
    x = torch.randn(M, K, generator=g).to(device, dtype)
    w = torch.randn(E, N, K, generator=g).to(device, dtype).transpose(1, 2)
    offs = torch.tensor(counts).cumsum(0).to(device, torch.int32)
    return x, w, offs


ROUTINGS = {
    "spread": [3, 0, 5, 1, 0, 7, 2, 2],
    "one_expert": [0, 0, 20, 0, 0, 0, 0, 0],
    "fewer_rows_than_experts": [1, 0, 0, 1, 0, 1, 0, 0],
    "many_rows": [40, 3, 0, 17, 64, 1, 9, 30],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("routing", ROUTINGS)
def test_tiled_grouped_mm_equals_the_loop_over_experts_for_any_routing(routing, dtype):
    x, w, offs = routed(ROUTINGS[routing], dtype=dtype)
    ref = loop_grouped_mm(x, w, offs)
    tol = 1e-5 if dtype == torch.float32 else 0.05 * ref.abs().max().item()
    assert (tiled_grouped_mm(x, w, offs).float() - ref).abs().max().item() <= tol
    assert (tiled_grouped_mm(x, w.contiguous(), offs).float() - ref).abs().max().item() <= tol
    assert (grouped_mm(x, w, offs).float() - ref).abs().max().item() <= tol


def test_cpu_uses_torch_grouped_mm_for_every_dtype_when_rows_are_16_byte_aligned():
    """On CPU torch._grouped_mm has no device to sync with; on CUDA it reads `offs` on the host except
    in bf16 on compute capability 9.x / 10.x (test_the_moe_block_never_syncs_with_the_host_on_cuda)."""
    assert native_grouped_mm(torch.zeros(4, 64)) and native_grouped_mm(torch.zeros(4, 64, dtype=torch.bfloat16))
    assert not native_grouped_mm(torch.zeros(4, 6))  # 24-byte rows: the tiled path


def moe_block(dtype, device="cpu", E=8, k=2):
    cfg = parse_model_config(dict(model_type="qwen3_moe", vocab_size=16, hidden_size=64, num_hidden_layers=1,
                                  num_attention_heads=4, num_experts=E, num_experts_per_tok=k,
                                  moe_intermediate_size=48, norm_topk_prob=True))
    torch.manual_seed(0)
    moe = MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return moe.to(device, dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@torch.no_grad()
def test_the_moe_block_compiles_to_one_static_graph_on_cpu(dtype):
    moe = moe_block(dtype)
    compiled = torch.compile(moe, fullgraph=True, dynamic=False)  # a graph break is an error
    for T in (1, 5, 37):
        x = torch.randn(T, 64, dtype=dtype)
        torch.testing.assert_close(compiled(x), moe(x), atol=1e-5 if dtype == torch.float32 else 0.05,
                                   rtol=1e-4 if dtype == torch.float32 else 0.02)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@torch.no_grad()
def test_the_moe_block_never_syncs_with_the_host_on_cuda(dtype):
    """Both grouped-matmul paths: torch's grouped GEMM (bf16 on compute capability 9.x / 10.x) and the
    tiles (every other dtype and GPU)."""
    moe = moe_block(dtype, "cuda")
    x = torch.randn(37, 64, dtype=dtype, device="cuda")
    args = routed(ROUTINGS["many_rows"], dtype=dtype, device="cuda")
    warm = moe(x), tiled_grouped_mm(*args), grouped_mm(*args)  # kernel loading is not what is checked
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, tiled, native = moe(x), tiled_grouped_mm(*args), grouped_mm(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(out, warm[0])
    ref = loop_grouped_mm(*args)
    tol = 1e-3 if dtype == torch.float32 else 0.05 * ref.abs().max().item()
    assert (tiled.float() - ref).abs().max().item() <= tol
    assert (native.float() - ref).abs().max().item() <= tol
