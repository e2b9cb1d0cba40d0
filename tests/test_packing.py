"""Linear layers packed for oneDNN (layers.PackedLinear): packed where the CPU supports the dtype, plain
matmuls elsewhere, the same numbers either way."""

import torch
from torch import nn

from minidcut.layers import PackedLinear, pack_linears


def test_fp32_linears_are_packed_and_compute_the_same():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 16, bias=False))
    x = torch.randn(3, 64)
    ref = m(x)
    pack_linears(m)
    assert all(isinstance(layer, PackedLinear) for layer in m)
    torch.testing.assert_close(m(x), ref, rtol=1e-5, atol=1e-5)


def test_a_bf16_linear_is_packed_only_where_the_cpu_has_bf16_instructions_and_runs_everywhere():
    # oneDNN refuses to reorder a bf16 weight on a CPU without bf16 instructions (AVX2 only): packing
    # must leave it as a plain matmul there instead of failing the load of a bf16 drafter.
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 32, dtype=torch.bfloat16))
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    ref = m(x)
    pack_linears(m)
    assert isinstance(m[0], PackedLinear) == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    torch.testing.assert_close(m(x), ref, rtol=2e-2, atol=2e-2)  # bf16: packed and plain round differently
