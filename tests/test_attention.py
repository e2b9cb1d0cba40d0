"""The decode step's attention (layers.attend): SDPA, or in 16 bits on a CPU two batched matmuls."""

import pytest
import torch
import torch.nn.functional as F

from minidcut.layers import attend


@pytest.mark.parametrize("Q", [1, 4])
def test_16_bit_decode_attention_on_a_cpu_is_sdpa_of_the_same_inputs(Q):
    """layers.attend in bf16 on a CPU (batched matmuls, not torch's flash kernel): grouped heads, each
    row's own mask, within bf16's rounding of SDPA on the same inputs in fp32; fp32 is SDPA itself."""
    g = torch.Generator().manual_seed(0)
    n, Hq, Hk, S, Dh = 5, 6, 2, 40, 16
    q = torch.randn(n, Hq, Q, Dh, generator=g)
    k, v = (torch.randn(n + 2, Hk, S + 9, Dh, generator=g)[:n, :, :S] for _ in range(2))  # cache views
    mask = torch.arange(S)[None, None, None, :] <= torch.randint(0, S, (n, 1, Q, 1), generator=g)  # [n, 1, Q, S]
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert torch.equal(attend(q, k, v, mask), ref)
    out = attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    exact = F.scaled_dot_product_attention(*(t.bfloat16().float() for t in (q, k, v)), attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out.float(), exact, atol=2e-2, rtol=2e-2)
